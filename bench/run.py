"""Benchmark: model x size x batch x system, timed side by side in one run.

Systems, each checked against the eager outputs of the same task:

- ``acrobat``: ``task.fn.map``, the cells wrapped as ``acrobat.block``;
- ``acrobat-fused``: the same with fused elementwise kernels chosen online
  (``KERNEL_BACKEND="online"``; exploration included in the times);
- ``acrobat-plain``: the model's plain code (no ``@acrobat.block``; automatic coarsening);
- ``eager``: per-instance PyTorch, ``fn.eager`` in a loop;
- ``hand``: hand-batched PyTorch (``bench.hand.<model>``), where it exists;
- ``dynet-1``, ``dynet-2``: DyNet autobatching, agenda-based and depth-based
  (``bench.dynet_models.<model>``, each strategy in its own process), when
  DyNet (``pip install dynet38``) is installed.

Example::

    python -m bench.run --models treelstm,birnn --sizes small --batches 8,64 --reps 10
    python -m bench.run --quick          # smoke test: small, batch 8, 3 reps

Systems are timed in turn, one timed run each per round in a shuffled order (DyNet's
runs served by worker processes), so the machine's slow and fast spells reach every
system alike and the ratios are side by side in time, not only in one report. Each
timed run comes right after an untimed run of the same system (``--settle``, default
1): a run right after another system's is slower than in a loop of its own, by what
the other left in the caches and the allocator (acrobat on DRNN small b64: 14.5 ms in a
loop, 16.8 right after an eager pass, 13.8 with one of its own runs in between), and
an application calls one system again and again.

A ``probe`` is timed in every round too, in the shuffled order like the systems: one
fixed product (:func:`probe`, on torch's threads) that does not change with the code
under test.
This VM has slow spells in which two-thread GEMMs slow by up to several times while the
eager loop's tiny ops and DyNet's one thread do not (TreeLSTM small b8 once measured
acrobat on its plain code at 4.2-49 ms over ten rounds against 3.4-3.7 alone, eager
steady at 20): the report gives each configuration's probe median over the run's
fastest (``machine``, 1.00 = the fastest state seen), so a reader can tell which
configurations ran in a slow spell. ``--no-probe`` leaves it out.

Writes ``<out>.md`` (also printed) and ``<out>.json``; the report ends with the geometric
means of acrobat's systems over DyNet's best, eager and hand. ``--merge A.json B.json``
runs nothing and writes one report from several runs' records (a device's runs, each cut
to fit one call).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import math
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import acrobat
from bench.dynet_models import STRATEGIES
from bench.dynet_models import available as dynet_available
from bench.history_index import speedups as geomean_speedups
from bench.registry import MODELS
from models.common import Task, flatten, outputs_close, run_eager

try:
    from tqdm import tqdm
except ImportError:  # progress bar only when tqdm is installed
    tqdm = None

DYNET_TIMEOUT_S = 600


@dataclass
class Measurement:
    """Timings and checks of one system on one (model, size, batch)."""

    model: str
    size: str
    batch: int
    system: str
    times_ms: list[float]
    max_abs_diff: float | None = None
    ok: bool | None = None
    error: str | None = None
    stats: dict | None = None  # acrobat.stats() after the last timed run

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else math.nan

    @property
    def min_ms(self) -> float:
        return min(self.times_ms) if self.times_ms else math.nan


#: The probe's product: (rows, K) x (K, N), ~0.4 ms on two threads of this VM.
PROBE_SHAPE = (128, 512, 512)


def probe(seed: int = 0) -> Callable[[], list]:
    """The probe run: ``torch.addmm`` of fixed random operands (its own, made once), whose
    time depends on the machine's state only."""
    rows, k, n = PROBE_SHAPE
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen, device="cpu")
    w = torch.randn(n, k, generator=gen, device="cpu")
    b = torch.randn(n, generator=gen, device="cpu")
    return lambda: [torch.addmm(b, x, w.t())]


def acrobat_stats() -> dict | None:
    """``acrobat.stats()`` as a dict, or None where the runtime has no stats (yet)."""
    stats_fn = getattr(acrobat, "stats", None)
    if stats_fn is None:
        return None
    stats = stats_fn()
    if stats is None:
        return None
    if hasattr(stats, "as_dict"):
        return dict(stats.as_dict())
    return {key: value for key, value in vars(stats).items() if not key.startswith("_")}


def train_step(task: Task, forward: Callable[[], Any]) -> Callable[[], Any]:
    """A training step over ``forward`` (one pass over the task's batch): the parameters'
    gradients reset, then those of the sum of every floating output (the outputs come
    back, the gradients stay on ``task.model``)."""
    params = [p for p in task.model.parameters() if p.requires_grad]

    def step():
        for p in params:
            p.grad = None
        with torch.enable_grad():
            out = forward()
            leaves = [t for t in flatten(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            sum(t.sum() for t in leaves).backward()
        return out

    return step


def gradients(task: Task) -> list[torch.Tensor]:
    """Copies of the parameters' gradients after a :func:`train_step` (zeros where none)."""
    return [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for p in task.model.parameters()
        if p.requires_grad
    ]


def training_systems(task: Task, plain_task: Task) -> dict[str, Callable[[], list]]:
    """``--train``: acrobat (blocks, plain) and eager, each a training step. (The
    hand-batched versions write into preallocated buffers under ``no_grad``; DyNet is
    not run: the comparison is acrobat's batched backward against the eager loop's.)"""
    return {
        "acrobat": train_step(task, lambda: task.fn.map(task.inputs, **task.kwargs)),
        "acrobat-plain": train_step(
            plain_task, lambda: plain_task.fn.map(plain_task.inputs, **plain_task.kwargs)
        ),
        "eager": train_step(task, lambda: run_eager(task)),
    }


def torch_systems(name: str, task: Task, plain_task: Task) -> dict[str, Callable[[], list]]:
    """The in-process systems for one task: acrobat (blocks, plain), eager, hand if present."""

    def fused():
        with acrobat.config.override(KERNEL_BACKEND="online"):
            return task.fn.map(task.inputs, **task.kwargs)

    systems = {
        "acrobat": lambda: task.fn.map(task.inputs, **task.kwargs),
        "acrobat-fused": fused,
        "acrobat-plain": lambda: plain_task.fn.map(plain_task.inputs, **plain_task.kwargs),
        "eager": lambda: run_eager(task),
    }
    inline = getattr(importlib.import_module(f"models.{name}"), "INLINE", None)
    if inline is not None:  # the model with its cells written inline (AUTO_REGIONS)
        systems["acrobat-inline"] = lambda: inline.map(plain_task.inputs, **plain_task.kwargs)
    if importlib.util.find_spec(f"bench.hand.{name}") is not None:
        hand = importlib.import_module(f"bench.hand.{name}")
        systems["hand"] = lambda: hand.run(task)
    return systems


class DynetWorker:
    """DyNet with one autobatch strategy, served by a process of its own
    (``bench.dynet_worker --serve``): started (and warmed up) once, then timed one run at
    a time, in turn with the other systems."""

    def __init__(self, task: Task, strategy: int, args: argparse.Namespace):
        self.task = task
        self.tmp = tempfile.TemporaryDirectory()
        self.out = Path(self.tmp.name) / "result.npz"
        command = [
            sys.executable, "-m", "bench.dynet_worker", "--serve",
            "--model", task.name, "--size", task.size, "--batch", str(task.batch),
            "--seed", str(task.seed), "--strategy", str(strategy),
            "--warmup", str(args.warmup), "--out", str(self.out),
        ]  # fmt: skip
        if args.threads:
            command += ["--threads", str(args.threads)]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self._expect("ready")

    def _expect(self, what: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line or (what == "ready" and line != "ready"):
            self.close()
            assert self.proc.stderr is not None
            raise RuntimeError(f"DyNet worker failed:\n{self.proc.stderr.read()[-2000:]}")
        return line

    def once(self) -> float:
        """Time one run (ms, as measured in the worker)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self._expect("time"))

    def outputs(self) -> list:
        """End the worker; the outputs of its last run."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("done\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=DYNET_TIMEOUT_S)
        if self.proc.returncode != 0:
            assert self.proc.stderr is not None
            raise RuntimeError(f"DyNet worker failed:\n{self.proc.stderr.read()[-2000:]}")
        with np.load(self.out) as result:
            outputs: list[list[np.ndarray]] = [[] for _ in self.task.inputs]
            # Keys are out_<instance>_<leaf>; leaves were saved in order.
            for key in sorted(k for k in result.files if k.startswith("out_")):
                _, instance, leaf = key.split("_")
                outputs[int(instance)].append((int(leaf), result[key]))
        self.close()
        return [[array for _, array in sorted(leaves)] for leaves in outputs]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.tmp.cleanup()


def bench_case(
    module, name: str, size: str, batch: int, args: argparse.Namespace
) -> list[Measurement]:
    """Every system on one (model, size, batch), timed in turn: each round times each
    system once, in a shuffled order, so a drift in the machine's speed (this one has slow
    and fast spells lasting seconds) and the previous run's traces in the caches reach
    every system alike."""
    task = module.make_task(size, batch, seed=args.seed, blocks=True)
    plain_task = module.make_task(size, batch, seed=args.seed, blocks=False)
    with torch.no_grad():
        reference = run_eager(task)

    sync = args.device.startswith("cuda")
    measurements: dict[str, Measurement] = {}
    runs: dict[str, Callable[[], float]] = {}
    outputs: dict[str, Any] = {}
    workers: dict[str, DynetWorker] = {}

    def fail(system: str, error: Exception) -> None:
        measurements[system].error = f"{type(error).__name__}: {error}"
        runs.pop(system, None)
        if args.verbose:
            traceback.print_exc()

    def timed(system: str, fn: Callable[[], list]) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            outputs[system] = fn()
            if sync:  # the device's work done, not only launched
                torch.cuda.synchronize()
            ms = (time.perf_counter() - start) * 1e3
            if system.startswith("acrobat"):  # the stats of this system's own last run
                measurements[system].stats = acrobat_stats()
            return ms

        return run

    systems = (
        training_systems(task, plain_task) if args.train else torch_systems(name, task, plain_task)
    )
    with torch.no_grad():
        for system, fn in systems.items():
            measurements[system] = Measurement(name, size, batch, system, [])
            try:
                for _ in range(args.warmup):
                    fn()
                runs[system] = timed(system, fn)
            except Exception as error:  # one failing system must not stop the benchmark
                fail(system, error)
        if args.probe:  # timed in turn with the systems: the machine's state, per round
            measurements["probe"] = Measurement(name, size, batch, "probe", [])
            runs["probe"] = timed("probe", probe(args.seed))
        acrobat.fusion.wait_compiled()  # kernels compiled in the background are not timed
        if (
            args.dynet
            and not args.train
            and args.device == "cpu"  # (the dynet38 wheel is CPU only)
            and dynet_available()
            and importlib.util.find_spec(f"bench.dynet_models.{name}")
        ):
            for strategy in STRATEGIES:
                system = f"dynet-{strategy}"
                measurements[system] = Measurement(name, size, batch, system, [])
                try:
                    workers[system] = DynetWorker(task, strategy, args)
                    runs[system] = workers[system].once
                except Exception as error:
                    fail(system, error)
        gc.collect()
        # Each round in its own order, shuffled (seeded by the case): a run is slower after
        # one that evicted its data from the caches (another process's, a 64 MB pass:
        # TreeLSTM small b8 3.42 -> 3.67 ms), so a fixed rotation, which gives every
        # system the same predecessor in every round, biased the systems against each
        # other (acrobat after DyNet's worker, hand after eager on the same weights).
        rng = random.Random(f"{name}/{size}/{batch}")
        try:
            for _ in range(args.reps):
                order = list(runs)
                rng.shuffle(order)
                for system in order:
                    if system not in runs:
                        continue  # failed earlier in this round
                    try:
                        for _ in range(args.settle):  # untimed: its own run just before
                            runs[system]()
                        measurements[system].times_ms.append(runs[system]())
                    except Exception as error:
                        fail(system, error)
            for system, worker in workers.items():
                if system in runs:
                    try:
                        outputs[system] = worker.outputs()
                    except Exception as error:
                        fail(system, error)
        finally:
            for worker in workers.values():
                worker.close()

    want_grads = None
    if args.train and "eager" in runs:  # one more step each: the gradients agree too
        systems["eager"]()
        want_grads = gradients(task)
    for system, measurement in measurements.items():
        if system == "probe":  # (its own product, not the task's outputs)
            measurement.ok, measurement.max_abs_diff = measurement.error is None, 0.0
        elif measurement.error is None:
            check = outputs_close(outputs[system], reference, atol=args.atol, rtol=args.rtol)
            measurement.ok, measurement.max_abs_diff = check.ok, check.max_abs_diff
            if want_grads is not None and system in systems:
                try:
                    systems[system]()
                except Exception as error:
                    fail(system, error)
                    continue
                grads = gradients(plain_task if system == "acrobat-plain" else task)
                # each gradient on its own scale: an element sums many rounded terms of
                # up to the largest one's size (DRNN small b64: gradients up to ~1.6e3,
                # eager in float32 off float64 by 5.5e-4, acrobat by 2.1e-4)
                scales = [max(1.0, float(w.abs().max())) if w.numel() else 1.0 for w in want_grads]
                g = outputs_close(
                    [x / c for x, c in zip(grads, scales)],
                    [w / c for w, c in zip(want_grads, scales)],
                    atol=args.atol,
                    rtol=args.rtol,
                )
                measurement.ok = measurement.ok and g.ok
                measurement.max_abs_diff = max(measurement.max_abs_diff, g.max_abs_diff)
        log(f"  {system:14s} {format_measurement(measurement)}")
    return list(measurements.values())


def format_measurement(m: Measurement) -> str:
    if m.error:
        return f"ERROR {m.error.splitlines()[0][:100]}"
    verdict = "ok" if m.ok else "MISMATCH"
    return f"median {m.median_ms:9.2f} ms  min {m.min_ms:9.2f} ms  {verdict} ({m.max_abs_diff:.1e})"


def speedup(base: Measurement | None, other: Measurement | None) -> float | None:
    """How many times faster ``base`` is than ``other`` (median over median)."""
    if base is None or other is None or base.error or other.error:
        return None
    return other.median_ms / base.median_ms


def summarize(measurements: list[Measurement]) -> list[dict]:
    """One row per (model, size, batch): acrobat's time, speedups and runtime stats."""
    cases: dict[tuple, dict[str, Measurement]] = {}
    for m in measurements:
        cases.setdefault((m.model, m.size, m.batch), {})[m.system] = m
    rows = []
    for (model, size, batch), systems in cases.items():
        acro = systems.get("acrobat")
        dynets = [m for s, m in systems.items() if s.startswith("dynet") and not m.error]
        dynet_best = min(dynets, key=lambda m: m.median_ms, default=None)
        rows.append({
            "model": model, "size": size, "batch": batch,
            "acrobat_ms": acro.median_ms if acro and not acro.error else None,
            "vs_eager": speedup(acro, systems.get("eager")),
            "vs_dynet_best": speedup(acro, dynet_best),
            "dynet_best": dynet_best.system if dynet_best else None,
            "vs_hand": speedup(acro, systems.get("hand")),
            "vs_plain": speedup(acro, systems.get("acrobat-plain")),
            "probe_ms": _probe_ms(systems.get("probe")),
            "stats": acro.stats if acro else None,
        })  # fmt: skip
    fastest = min((r["probe_ms"] for r in rows if r["probe_ms"] is not None), default=None)
    for row in rows:  # the probe's median over the run's fastest: 1.00 = the fastest state
        row["machine"] = row["probe_ms"] / fastest if fastest and row["probe_ms"] else None
    return rows


def geomeans(measurements: list[Measurement]) -> dict[str, tuple[int, dict]]:
    """``{system: (configurations, {"dynet"|"eager"|"hand": geometric-mean speedup})}`` for
    acrobat's systems, from the correct, error-free measurements only."""
    rows: dict[tuple, dict[str, float]] = {}
    for m in measurements:
        if m.error is None and m.ok and m.times_ms:
            rows.setdefault((m.model, m.size, m.batch), {})[m.system] = m.median_ms
    means = {}
    for system in ("acrobat", "acrobat-plain", "acrobat-fused"):
        count = sum(system in times for times in rows.values())
        if count:
            means[system] = (count, geomean_speedups(rows, system))
    return means


def _probe_ms(m: Measurement | None) -> float | None:
    return m.median_ms if m is not None and not m.error and m.times_ms else None


def _num(value: float | None, digits: int = 2, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}f}{suffix}"


def md_table(header: list[str], rows: list[list[str]], left: int = 0) -> list[str]:
    """A Markdown table; the first ``left`` columns are left-aligned, the others right-aligned."""
    align = ["---"] * left + ["---:"] * (len(header) - left)
    return [" | ".join(["", *cells, ""]).strip() for cells in [header, align, *rows]]


TIME_SPLIT = ("t_record", "t_schedule", "t_gather", "t_kernel")


def markdown(measurements: list[Measurement], summary: list[dict], config: dict) -> str:
    acrobat = {(m.model, m.size, m.batch): m for m in measurements if m.system == "acrobat"}
    times = []
    for m in measurements:
        case = [m.model, m.size, str(m.batch), m.system]
        if m.error:
            error = m.error.splitlines()[0][:80].replace("|", "\\|")
            times.append([*case, "—", "—", "—", "—", f"error: {error}"])
            continue
        if m.system == "probe":  # (not a system: no speedup, nothing to check)
            times.append([*case, _num(m.median_ms), _num(m.min_ms), "—", "—", "—"])
            continue
        gain = speedup(acrobat.get((m.model, m.size, m.batch)), m)
        check = "yes" if m.ok else "**NO**"
        times.append(
            [*case, _num(m.median_ms), _num(m.min_ms), _num(gain, suffix="x"),
             f"{m.max_abs_diff:.1e}", check]
        )  # fmt: skip

    speedups = []
    for row in summary:
        stats = row["stats"] or {}
        dynet = _num(row["vs_dynet_best"], suffix=f"x ({row['dynet_best']})")
        split = [
            _num(stats[key] * 1e3, 1) if stats.get(key) is not None else "—" for key in TIME_SPLIT
        ]
        speedups.append(
            [row["model"], row["size"], str(row["batch"]), _num(row["acrobat_ms"]),
             _num(row["vs_eager"], suffix="x"), dynet, _num(row["vs_hand"], suffix="x"),
             _num(row["vs_plain"], suffix="x"),
             *(_num(stats.get(key), 0) for key in ("nodes", "batches", "launches", "gathers")),
             _num(stats.get("us_per_node")), " / ".join(split) if stats else "—",
             _num(row.get("machine"))]
        )  # fmt: skip

    lines = [
        "# acrobat benchmark",
        "",
        f"torch {config['torch']}, {config['threads']} torch threads, {config['machine']}, "
        + (f"device {config['device']}, " if config.get("device", "cpu") != "cpu" else "")
        +
        f"{config['record_path']} record path, "
        f"malloc {'holding freed memory' if config.get('malloc_held') else 'as is'}; "
        f"{config['reps']} timed rounds after {config['warmup']} warm-up runs; each round times "
        "every system once, in a shuffled order (seeded per case; DyNet in worker "
        f"processes), each timed run right after {config.get('settle', 0)} untimed run(s) "
        "of the same system. "
        + (
            "Training steps: forward and backward of the sum of every output, parameters' "
            "gradients reset first; correct also means every gradient within tolerance of "
            "eager's, each gradient divided by its largest element (at least 1) first. "
            if config.get("train")
            else ""
        )
        + (
            f"Merged from {len(config['merged'])} runs ({', '.join(config['merged'])}), each "
            "in its own process; the machine column compares their probes. "
            if config.get("merged")
            else ""
        )
        + "Correct: every output "
        f"within atol {config['atol']:g} + rtol {config['rtol']:g} of eager.",
        "",
        "## Times",
        "",
        "acrobat speedup = this system's median / acrobat's median.",
        "",
        *md_table(
            ["model", "size", "batch", "system", "median ms", "min ms", "acrobat speedup",
             "max abs diff", "correct"],
            times, left=4,
        ),
        "",
        "## acrobat (blocks) vs the others",
        "",
        *md_table(
            ["model", "size", "batch", "acrobat ms", "vs eager", "vs dynet-best", "vs hand",
             "vs acrobat-plain", "nodes", "batches", "launches", "gathers", "µs/node",
             "record / schedule / gather / kernel ms", "machine"],
            speedups, left=3,
        ),
    ]  # fmt: skip
    means = geomeans(measurements)
    if means:
        lines += [
            "",
            "## Geometric means",
            "",
            "Over the configurations where both systems ran without error and agreed "
            "with eager (the speedup: the other system's median / this one's).",
            "",
            *md_table(
                ["system", "configurations", "vs dynet-best", "vs eager", "vs hand"],
                [[system, str(count), *(_num(over.get(ref), suffix="x")
                                        for ref in ("dynet", "eager", "hand"))]
                 for system, (count, over) in means.items()],
                left=1,
            ),
        ]  # fmt: skip
    if any(row.get("machine") is not None for row in summary):
        rows, k, n = PROBE_SHAPE
        lines += [
            "",
            f"machine = the median of the probe (`torch.addmm`, {rows} x {k} -> {n}, on "
            f"{config['threads']} threads, timed in every round in turn with the systems) "
            "over its fastest median in this run: 1.00 is the fastest state of the machine "
            "seen, 1.30 a configuration timed while the same product took 30% longer.",
        ]
    if not any(row["stats"] for row in summary):
        lines += ["", "(`acrobat.stats()` is not available: no runtime statistics.)"]
    return "\n".join(lines) + "\n"


def finite(value):
    """``value`` with NaN and infinities replaced by None, so that the JSON is strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def log(message: str) -> None:
    if tqdm is not None:
        tqdm.write(message, file=sys.stderr)
    else:
        print(message, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    csv = lambda text: [item for item in text.split(",") if item]
    parser.add_argument("--models", type=csv, default=list(MODELS), help="comma-separated")
    parser.add_argument("--sizes", type=csv, default=["small", "large"], help="comma-separated")
    parser.add_argument("--batches", type=lambda t: [int(b) for b in csv(t)], default=[8, 64])
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions (>= 1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    parser.add_argument(
        "--settle", type=int, default=1,
        help="untimed runs of a system right before each of its timed runs (0: none)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch.set_num_threads; 1 is steadier on a busy machine and matches DyNet (1 thread)",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="cpu",
        help="torch's default device for the models and their inputs (cuda: timed to "
        "torch.cuda.synchronize; DyNet not run)",
    )  # fmt: skip
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--no-dynet", dest="dynet", action="store_false", help="skip DyNet")
    parser.add_argument(
        "--no-probe", dest="probe", action="store_false",
        help="skip the probe (a fixed product timed each round: the machine's state)",
    )  # fmt: skip
    parser.add_argument(
        "--train", action="store_true",
        help="time training steps (forward + backward of the outputs' sum): acrobat and "
        "eager only; gradients checked against eager's",
    )  # fmt: skip
    parser.add_argument(
        "--out", default=None, help="output path without suffix (bench/results/latest)"
    )
    parser.add_argument(
        "--merge", nargs="+", metavar="JSON", default=None,
        help="run nothing: one report at --out from these runs' JSON records (later "
        "runs replace a configuration's system measured earlier)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke test: small, batch 8, 3 reps")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of errors")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.batches, args.reps = ["small"], [8], 3
    if args.out is None:
        args.out = "bench/results/quick" if args.quick else "bench/results/latest"
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.settle < 0:
        parser.error("--settle must be at least 0")
    unknown = [name for name in args.models if name not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    return args


def main(argv: list[str] | None = None) -> list[Measurement]:
    args = parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device != "cpu":
        torch.set_default_device(args.device)
    if acrobat.config.HOLD_MEMORY:
        # what acrobat's first map does (acrobat/memory.py), done first so that every
        # in-process system, eager and hand-batched included, runs with the same malloc
        acrobat.memory.hold()
    if args.dynet and not dynet_available():
        log("DyNet not installed (pip install dynet38): skipping the dynet systems")

    modules = {}
    for name in args.models:
        try:
            modules[name] = importlib.import_module(MODELS[name])
        except Exception as error:
            log(
                f"skipping {name}: {MODELS[name]} does not import ({type(error).__name__}: {error})"
            )

    cases = [
        (name, size, batch) for name in modules for size in args.sizes for batch in args.batches
    ]
    config = run_config(args, modules)
    progress = tqdm(cases, desc="bench", unit="case") if tqdm is not None else cases
    measurements: list[Measurement] = []
    for name, size, batch in progress:
        log(f"{name} {size} batch {batch}")
        try:
            measurements += bench_case(modules[name], name, size, batch, args)
        except Exception as error:  # e.g. make_task failing for one size
            log(f"  skipped: {type(error).__name__}: {error}")
        write_results(measurements, config, args.out, final=False)  # (a cut-off run keeps these)
    return write_results(measurements, config, args.out, final=True)


def run_config(args, modules: dict) -> dict:
    """What the report's header says about this run: its options, versions and machine."""
    return {
        "models": list(modules), "sizes": args.sizes, "batches": args.batches,
        "reps": args.reps, "warmup": args.warmup, "settle": args.settle, "seed": args.seed,
        "train": args.train,
        "atol": args.atol, "rtol": args.rtol, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "record_path": "C" if acrobat.tensor._native is not None else "Python",
        "malloc_held": acrobat.memory.held(), "device": _device_name(args.device),
    }  # fmt: skip


def write_results(measurements: list[Measurement], config: dict, out: str, final: bool):
    """The report (markdown, printed when ``final``) and the JSON records at ``out``."""
    summary = summarize(measurements)
    report = markdown(measurements, summary, config)
    if final:
        print(report)
    md_path, json_path = Path(f"{out}.md"), Path(f"{out}.json")
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(report)
    records = [{**asdict(m), "median_ms": m.median_ms, "min_ms": m.min_ms} for m in measurements]
    payload = {"config": config, "results": records, "summary": summary}
    json_path.write_text(json.dumps(finite(payload), indent=1, default=str))
    if final:
        log(f"wrote {md_path} and {json_path}")
    return measurements


def merge(paths: list[str], out: str) -> list[Measurement]:
    """One report from the JSON records of several runs (e.g. a device's runs, each cut to
    fit one call): a configuration and system measured again replaces the earlier one;
    the header is the first run's, its models, sizes and batches the union."""
    measurements: dict[tuple, Measurement] = {}
    config: dict = {}
    fields = set(Measurement.__dataclass_fields__)
    for path in paths:
        payload = json.loads(Path(path).read_text())
        if not config:
            config = dict(payload["config"])
        for key in ("models", "sizes", "batches"):
            config[key] = list(dict.fromkeys([*config[key], *payload["config"][key]]))
        for record in payload["results"]:
            m = Measurement(**{k: v for k, v in record.items() if k in fields})
            measurements[(m.model, m.size, m.batch, m.system)] = m
    config["merged"] = [Path(path).name for path in paths]
    return write_results(list(measurements.values()), config, out, final=True)


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


if __name__ == "__main__":
    main()
