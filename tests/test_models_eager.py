"""The benchmark models: SST parsing, eager outputs, and the baselines that must match them.

``fn.map == [fn.eager]`` is checked here on the real models at batch 8; with the
eager stub of acrobat it holds trivially, with the runtime it is the real check.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re

import pytest
import torch

from bench.dynet_models import available as dynet_available
from models import sst
from models.common import flatten, outputs_close, run_eager

MODELS = ["treelstm", "mvrnn", "birnn"]
HAND = ["treelstm", "mvrnn", "birnn"]
LEAF = re.compile(r"\(\d+ [^()\s]+\)")  # a leaf: "(label word)"


def make_task(name: str, batch: int, blocks: bool = True):
    return importlib.import_module(f"models.{name}").make_task("small", batch, blocks=blocks)


# --- SST ---------------------------------------------------------------------------------


@pytest.mark.parametrize("split, count", [("test", 2210), ("dev", 1101)])
def test_sst_reads_shipped_split(split, count):
    lines = (sst.DATA_DIR / f"{split}.txt").read_text(encoding="utf-8").splitlines()
    trees = sst.load_trees(split)
    assert len(trees) == len(lines) == count
    for line, tree in zip(lines, trees):
        words = sst.leaves(tree)
        assert len(words) == len(LEAF.findall(line))
        assert sst.num_nodes(tree) == 2 * len(words) - 1  # strictly binary
        assert repr(tree) == line


def test_sst_root_labels_match_published_counts():
    labels = [tree.label for tree in sst.load_trees("test")]
    assert [labels.count(k) for k in range(5)] == [279, 633, 389, 510, 399]


def test_sst_tree_helpers():
    tree = sst.parse_tree("(3 (2 It) (4 (2 's) (3 lovely)))")
    assert not tree.is_leaf and tree.left.is_leaf and tree.left.word == "It"
    assert sst.height(tree) == 2 and sst.height(tree.left) == 0
    vocab = sst.Vocab(["lovely", "It", "lovely"])
    assert sst.sentence_ids(vocab.index(tree)) == [2, 0, 1]  # "'s" is unknown


@pytest.mark.parametrize(
    "line", ["(3 (2 a) (2 b) (2 c))", "(3 (2 a)", "(3 (2 a) (2 b)) (2 c)", "(3 word (2 b))"]
)
def test_sst_rejects_malformed_trees(line):
    with pytest.raises(ValueError):
        sst.parse_tree(line)


def test_vocab_keeps_most_frequent_and_unk_is_zero():
    vocab = sst.Vocab(["b", "a", "b", "c", "b", "a"], max_size=2)
    assert vocab.words == ["<unk>", "b", "a"]
    assert (vocab["b"], vocab["a"], vocab["c"], vocab["never seen"]) == (1, 2, 0, 0)
    assert len(sst.split_vocab("test", max_size=1000)) == 1001


# --- models, eager -----------------------------------------------------------------------


def expected_shapes(name: str, task, instance) -> list[tuple]:
    dim = task.model.hidden if name == "treelstm" else task.model.dim
    if name == "birnn":
        return [(len(instance), 5)]
    return [(dim,), (5,)]


@pytest.mark.parametrize("name", MODELS)
def test_eager_outputs_have_right_shapes_and_are_finite(name):
    task = make_task(name, batch=4)
    with torch.no_grad():
        outputs = run_eager(task)
    assert len(outputs) == 4
    for instance, output in zip(task.inputs, outputs):
        leaves = flatten(output)
        assert [tuple(t.shape) for t in leaves] == expected_shapes(name, task, instance)
        assert all(torch.isfinite(t).all() for t in leaves)


@pytest.mark.parametrize("name", MODELS)
def test_make_task_is_deterministic(name):
    a, b = make_task(name, batch=2), make_task(name, batch=2, blocks=False)
    with torch.no_grad():
        assert outputs_close(run_eager(a), run_eager(b), atol=0, rtol=0)


# --- baselines and the batched run -------------------------------------------------------


@pytest.mark.parametrize("name", HAND)
def test_hand_batched_matches_eager(name):
    task = make_task(name, batch=8)
    hand = importlib.import_module(f"bench.hand.{name}")
    with torch.no_grad():
        check = outputs_close(hand.run(task), run_eager(task), atol=1e-5, rtol=1e-5)
    assert check, check.message


@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "plain"])
@pytest.mark.parametrize("name", MODELS)
def test_map_matches_eager(name, blocks):
    task = make_task(name, batch=8, blocks=blocks)
    with torch.no_grad():
        batched = task.fn.map(task.inputs, **task.kwargs)
        check = outputs_close(batched, run_eager(task), atol=1e-5, rtol=1e-5)
    assert len(batched) == 8
    assert check, check.message


@pytest.mark.skipif(not dynet_available(), reason="DyNet (dynet38) is not installed")
@pytest.mark.parametrize("name", MODELS)
def test_dynet_matches_eager(name):
    from bench.dynet_models import configure

    configure(autobatch=1, mem="256")  # once per process: DyNet reads it at first import
    dynet_model = importlib.import_module(f"bench.dynet_models.{name}")
    task = make_task(name, batch=4)
    with torch.no_grad():
        check = outputs_close(dynet_model.run(task), run_eager(task), atol=1e-4, rtol=1e-4)
    assert check, check.message


def test_bench_harness_writes_report(tmp_path, monkeypatch):
    import acrobat
    from bench import run

    class Stats:  # the shape of acrobat.stats() once the runtime has it
        nodes, batches, launches, gathers, gather_bytes = 100, 10, 12, 3, 4096
        t_record, t_schedule, t_gather, t_kernel, us_per_node = 1e-3, 2e-4, 1e-4, 5e-3, 1.5

        def as_dict(self):
            return {
                k: getattr(self, k) for k in dir(self) if not k.startswith("_") and k != "as_dict"
            }

    monkeypatch.setattr(acrobat, "stats", lambda: Stats(), raising=False)
    out = tmp_path / "results"
    args = ["--models", "birnn", "--sizes", "small", "--batches", "2", "--reps", "1"]
    measurements = run.main([*args, "--warmup", "0", "--no-dynet", "--out", str(out)])
    systems = {"acrobat", "acrobat-fused", "acrobat-plain", "eager", "hand", "probe"}
    assert {m.system for m in measurements} == systems
    assert all(m.ok and m.error is None for m in measurements)
    report = (tmp_path / "results.md").read_text()
    assert "| birnn | small | 2 | acrobat |" in report and "| 100 |" in report
    # the probe's row has its time and nothing to compare; the machine column is 1.00 for
    # the run's only (so fastest) configuration
    assert "| birnn | small | 2 | probe |" in report and "| — | — | — |" in report
    lines = report.splitlines()
    assert lines[lines.index("## acrobat (blocks) vs the others") + 4].endswith("| 1.00 |")
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["summary"][0]["machine"] == 1.0 and payload["summary"][0]["probe_ms"] > 0
    # the geometric means: with one configuration, each is that configuration's ratio
    means = dict(run.geomeans(measurements))
    times = {m.system: m.median_ms for m in measurements}
    count, over = means["acrobat-plain"]
    assert count == 1 and over["eager"] == pytest.approx(times["eager"] / times["acrobat-plain"])
    assert over["hand"] == pytest.approx(times["hand"] / times["acrobat-plain"])
    assert over["dynet"] is None and "## Geometric means" in report
    measurements = run.main([*args, "--warmup", "0", "--no-dynet", "--no-probe", "--out", str(out)])
    assert "probe" not in {m.system for m in measurements}
    assert "machine =" not in (tmp_path / "results.md").read_text()


def test_bench_merge_joins_runs_later_replacing_earlier(tmp_path):
    """``--merge`` writes one report from several runs' JSON records: their configurations
    joined, a configuration's system measured again replaced by the later run's."""
    from bench import run

    def record(model, system, times, batch=2):
        return {"model": model, "size": "small", "batch": batch, "system": system,
                "times_ms": times, "max_abs_diff": 0.0, "ok": True, "error": None,
                "stats": None}  # fmt: skip

    config = {
        "models": ["birnn"], "sizes": ["small"], "batches": [2], "reps": 1, "warmup": 0,
        "settle": 0, "seed": 0, "train": False, "atol": 1e-4, "rtol": 1e-4, "threads": 2,
        "torch": "x", "python": "3", "machine": "m", "record_path": "C",
        "malloc_held": False, "device": "cpu",
    }  # fmt: skip
    first = {"config": config, "results": [
        record("birnn", "acrobat-plain", [4.0]), record("birnn", "eager", [8.0]),
        record("birnn", "hand", [2.0]),
    ]}  # fmt: skip
    second = {"config": {**config, "models": ["drnn"]}, "results": [
        record("drnn", "acrobat-plain", [1.0]), record("drnn", "eager", [2.0]),
        record("birnn", "acrobat-plain", [2.0]),  # measured again: replaces the 4.0
    ]}  # fmt: skip
    paths = []
    for name, payload in (("a.json", first), ("b.json", second)):
        (tmp_path / name).write_text(json.dumps(payload))
        paths.append(str(tmp_path / name))
    out = tmp_path / "merged"
    measurements = run.main(["--merge", *paths, "--out", str(out)])
    assert len(measurements) == 5
    plain = {m.model: m.median_ms for m in measurements if m.system == "acrobat-plain"}
    assert plain == {"birnn": 2.0, "drnn": 1.0}
    count, over = run.geomeans(measurements)["acrobat-plain"]
    assert count == 2 and over["eager"] == pytest.approx(math.sqrt(4.0 * 2.0))
    assert over["hand"] == pytest.approx(1.0)  # birnn only: 2.0 / 2.0
    report = (tmp_path / "merged.md").read_text()
    assert "Merged from 2 runs (a.json, b.json)" in report
    assert json.loads((tmp_path / "merged.json").read_text())["config"]["models"] == [
        "birnn", "drnn"
    ]


def test_bench_training_steps_check_gradients(tmp_path, monkeypatch):
    """``--train`` times acrobat and eager training steps and checks every gradient
    against eager's: a batched backward that got a gradient wrong fails its check."""
    from bench import run

    out = tmp_path / "train"
    args = ["--models", "treelstm", "--sizes", "small", "--batches", "3", "--reps", "1"]
    measurements = run.main([*args, "--warmup", "0", "--train", "--out", str(out)])
    assert {m.system for m in measurements} == {"acrobat", "acrobat-plain", "eager", "probe"}
    assert all(m.ok and m.error is None for m in measurements)
    assert "Training steps" in (tmp_path / "train.md").read_text()

    real = run.gradients

    def off_by_one_percent(task):  # acrobat-plain's gradients, perturbed
        grads = real(task)
        return [g * 1.01 for g in grads] if task.blocks is False else grads

    monkeypatch.setattr(run, "gradients", off_by_one_percent)
    measurements = run.main([*args, "--warmup", "0", "--train", "--out", str(out)])
    verdict = {m.system: m.ok for m in measurements}
    assert verdict == {"acrobat": True, "acrobat-plain": False, "eager": True, "probe": True}


def test_bench_history_index_matches_the_kept_runs():
    """bench/history/README.md's index rows are what bench.history_index computes from the
    kept reports (every column but the commit's date, which needs git history)."""
    from bench import history_index

    path = os.path.join(history_index.HISTORY, "README.md")
    with open(path) as f:
        lines = [line.strip() for line in f if line.startswith("| `RESULTS")]
    table = {line.split(" | ")[0]: line for line in lines}
    kept = sorted(f for f in os.listdir(history_index.HISTORY) if f.startswith("RESULTS_"))
    assert sorted(name.strip("| `") for name in table) == kept
    for name in kept:
        got = history_index.row(os.path.join(history_index.HISTORY, name)).split(" | ")
        want = table[f"| `{name}`"].split(" | ")
        del got[2], want[2]
        assert got == want, name


def test_bench_ab_sets_and_restores_config_flags_and_module_switches(capsys):
    """bench.ab's flag(): an acrobat.config flag or a MODULE:NAME attribute, set for the
    duration and restored after; a run prints one line per case with both values."""
    import acrobat
    from acrobat_kernels import elementwise
    from bench import ab

    before = elementwise.DRIVER_LAUNCH
    with ab.flag("acrobat_kernels.elementwise:DRIVER_LAUNCH", not before):
        assert elementwise.DRIVER_LAUNCH is (not before)
    assert elementwise.DRIVER_LAUNCH is before
    with ab.flag("VERIFY", False):
        assert acrobat.config.VERIFY is False
    assert acrobat.config.VERIFY is True  # (conftest's)
    ab.main(["--flag", "acrobat_kernels.elementwise:DRIVER_LAUNCH", "--values", "0,1",
             "--models", "birnn", "--batches", "2", "--reps", "1", "--warmup", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert "birnn small b2: 0: " in out and "| 1: " in out
    for name, said in [("NO_SUCH", "acrobat.config has no flag NO_SUCH"),
                       ("acrobat.fibers:NO_SUCH", "acrobat.fibers has no flag NO_SUCH")]:
        with pytest.raises(SystemExit):
            ab.main(["--flag", name])
        assert said in capsys.readouterr().err


def test_bench_icount_reads_cachegrind_totals_and_takes_one_map():
    """bench.icount: a map's instructions are the difference of two cachegrind totals over
    the maps between them; valgrind's summary line is read, and a run that printed none
    (the program failed) is an error. (The valgrind runs themselves take minutes: not run
    here.)"""
    from bench import icount

    out = "==1== \n==1== I   refs:      9,582,926,713\n"
    assert icount.instructions(out) == 9_582_926_713
    assert icount.per_map(9_582_926_713, 11_370_898_236, 10) == pytest.approx(178_797_152.3)
    with pytest.raises(ValueError, match="I refs"):
        icount.instructions("==1== Process terminating with default action of signal 11")
    with pytest.raises(ValueError):
        icount.per_map(1, 2, 0)


def test_bench_sidebyside_alternates_checkouts_and_summarizes(capsys):
    """bench.sidebyside: each checkout's process times the map and the hand-batched version
    in turn; the summary is per checkout (here the same one twice, a small task)."""
    from bench import sidebyside

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    summary = sidebyside.main(
        [root, root, "--model", "birnn", "--size", "small", "--batch", "4",
         "--alternations", "1", "--rounds", "2"]
    )  # fmt: skip
    assert set(summary) == {"baseline", "change"}
    for s in summary.values():
        assert s["processes"] == 1
        assert s["acrobat_ms"] > 0 and s["hand_ms"] > 0
        assert s["hand_over_acrobat"] == pytest.approx(s["hand_ms"] / s["acrobat_ms"])
        assert s["hand_over_acrobat_fastest"] > 0
    assert "| checkout | acrobat ms |" in capsys.readouterr().out
    runs = [{"acrobat": {"median": 2.0, "min": 1.0}, "hand": {"median": 1.0, "min": 0.8}}] * 3
    assert sidebyside.summarize(runs)["hand_over_acrobat_fastest"] == pytest.approx(0.8)
    with pytest.raises(SystemExit):
        sidebyside.main([root, root, "--rounds", "0"])
