"""Online variant choice: work-conserving trials, then the fastest variant sticks."""

import time

import torch

import acrobat
from acrobat import choice


def test_trials_compute_real_results_then_fastest_wins(tmp_path):
    c = choice.Chooser(trials=2, warmup=0)
    calls = []

    def slow():
        calls.append("slow")
        time.sleep(0.002)
        return 1

    def fast():
        calls.append("fast")
        return 1

    results = [c.run(("k", 4), {"slow": slow, "fast": fast}) for _ in range(6)]
    assert results == [1] * 6  # every call, trial or not, returns the real result
    assert calls[:4].count("slow") == 2 and calls[:4].count("fast") == 2
    assert calls[4:] == ["fast", "fast"]
    assert c.decided[("k", 4)] == "fast"


def test_decisions_persist_to_disk(tmp_path):
    path = str(tmp_path / "choices.json")
    with acrobat.config.override(CHOICE_CACHE=path):
        a = choice.Chooser(trials=1, warmup=0)
        for _ in range(2):
            a.run(("op", 3, torch.float32), {"x": lambda: 0, "y": lambda: 0})
        b = choice.Chooser(trials=1, warmup=0)
        b.run(("op", 3, torch.float32), {"x": lambda: 0, "y": lambda: 0})
        assert b.decided[("op", 3, torch.float32)] == a.decided[("op", 3, torch.float32)]
        assert not b.samples  # no trial needed: the saved decision was used


def test_warm_up_runs_are_not_timed():
    c = choice.Chooser(trials=1, warmup=1)
    first = []

    def compiles_first():
        if not first:
            first.append(1)
            time.sleep(0.01)  # a JIT compile on the first call must not count
        return 2

    for _ in range(4):
        assert c.run("k", {"jit": compiles_first, "plain": lambda: (time.sleep(0.001), 2)[1]}) == 2
    assert c.decided["k"] == "jit"


def test_bucket():
    assert [choice.bucket(n) for n in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]


def test_every_variant_is_correct():
    """Every matrix-vector variant runs during the trials (bmm, multiply + sum, bmm over
    the transposed matrices); each must match eager."""

    @acrobat.autobatch
    def f(m, v):
        return m @ v

    ms = [torch.randn(5, 3) for _ in range(6)]  # not square: a transposing variant shows
    vs = [torch.randn(3) for _ in range(6)]
    with torch.no_grad():
        for _ in range(3 * (choice.TRIALS + 1) + 1):
            got = f.map(ms, vs)
            for g, m, v in zip(got, ms, vs):
                torch.testing.assert_close(g, m @ v)
    assert any(k[0] == "mv" and k[1] == (5, 3) for k in choice.CHOOSER.decided)


def test_trials_compare_time_per_row_within_a_bucket(monkeypatch):
    """A bucket spans up to 2x in rows (65-128): trials taken in turn can meet different
    batch sizes, so raw times would let the slower variant win on the smaller batches.
    With ``work`` (a GEMM's rows) each trial counts per row. Fake clock: variant "a"
    costs 1.0 per row, "b" 0.8; the calls alternate 65 and 128 rows, so "a"'s trials all
    meet 65 rows and "b"'s 128 (raw: a 65 < b 102.4)."""
    clock = [0.0]
    monkeypatch.setattr(choice.time, "perf_counter", lambda: clock[0])

    def variant(per_row):
        def run():
            clock[0] += per_row * rows[0]
            return per_row

        return run

    for work, want in ((False, "a"), (True, "b")):
        c = choice.Chooser(trials=3, warmup=0)
        for i in range(6):
            rows = [65 if i % 2 == 0 else 128]
            c.run(("linear", 128), {"a": variant(1.0), "b": variant(0.8)},
                  work=rows[0] if work else None)  # fmt: skip
        assert c.decided[("linear", 128)] == want
