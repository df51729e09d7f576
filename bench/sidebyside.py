"""Two checkouts' acrobat on one benchmark task, measured side by side in alternated processes.

A change to the C extension or to what a map allocates cannot be switched by a flag in one
process (``bench.ab``), and two full runs of ``bench.run`` taken an hour apart differ by
more than most changes: this VM's slow spells slow acrobat's Python-bound recording by up
to 50% while the BLAS-bound hand-batched version barely moves. Here each checkout's
process runs in turn, ``--alternations`` times; every process times the map and the
hand-batched version in turn (each timed run right after an untimed one of the same
system, as ``bench.run --settle 1``) and reports medians and fastest runs. The summary
gives, per checkout, the median over its processes of acrobat's median and of hand /
acrobat (hand, timed beside it, normalises the machine's speed at that moment), and the
median of hand / acrobat by each process's fastest runs.

    python -m bench.sidebyside /tmp/old-checkout . --model drnn --size small --batch 64

Each root must hold a built checkout (``python setup.py build_ext --inplace`` there, for
its C extension); its own ``acrobat``, ``models`` and ``bench.hand`` are the ones imported.
Session 56 measured its DRNN changes this way (DRNN small b64: 11.78 -> 10.97 ms, hand /
acrobat 0.695 -> 0.736 over 8 alternations).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

#: A child process's start (argv: root, model, size, batch, count): the checkout's own
#: acrobat imported (checked), the model's plain-code task made (bench.icount uses it too).
CHILD_TASK = r"""
import json, os, statistics, sys, time
os.environ["ACROBAT_MAP_CHOICE"] = "0"
root, name, size = sys.argv[1:4]
batch, count = int(sys.argv[4]), int(sys.argv[5])
sys.path.insert(0, root)
import importlib
import torch
import acrobat
if not os.path.realpath(acrobat.__file__).startswith(os.path.realpath(root)):
    raise SystemExit(f"acrobat imported from {acrobat.__file__}, not from {root}")
model = importlib.import_module(f"models.{name}")
task = model.make_task(size, batch, seed=0, blocks=False)
"""

_CHILD = CHILD_TASK + r"""
rounds = count
hand = importlib.import_module(f"bench.hand.{name}")
def run_acrobat():
    return task.fn.map(task.inputs, **task.kwargs)
def run_hand():
    return hand.run(task)
times = {"acrobat": [], "hand": []}
with torch.no_grad():
    for _ in range(3):
        run_acrobat(); run_hand()
    for _ in range(rounds):
        for key, fn in (("acrobat", run_acrobat), ("hand", run_hand)):
            fn()
            t = time.perf_counter(); fn(); times[key].append(time.perf_counter() - t)
out = {k: {"median": statistics.median(v) * 1e3, "min": min(v) * 1e3} for k, v in times.items()}
print(json.dumps(out))
"""


def measure(root: str, model: str, size: str, batch: int, rounds: int) -> dict:
    """One process of checkout ``root``: {"acrobat"|"hand": {"median", "min"}} in ms."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, os.path.abspath(root), model, size, str(batch), str(rounds)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{root}: the measuring process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict]) -> dict:
    """Per checkout: medians over its processes of acrobat's median, of hand / acrobat, and
    of hand / acrobat by the processes' fastest runs."""
    return {
        "acrobat_ms": statistics.median(r["acrobat"]["median"] for r in runs),
        "hand_ms": statistics.median(r["hand"]["median"] for r in runs),
        "hand_over_acrobat": statistics.median(
            r["hand"]["median"] / r["acrobat"]["median"] for r in runs
        ),
        "hand_over_acrobat_fastest": statistics.median(
            r["hand"]["min"] / r["acrobat"]["min"] for r in runs
        ),
        "processes": len(runs),
    }


def task_arguments(p: argparse.ArgumentParser) -> None:
    """The two checkouts and the benchmark task (bench.icount takes them too)."""
    p.add_argument("roots", nargs=2, help="two built checkouts: the baseline, then the change")
    p.add_argument("--model", default="drnn")
    p.add_argument("--size", default="small")
    p.add_argument("--batch", type=int, default=64)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m bench.sidebyside", description=__doc__.split("\n\n")[0]
    )
    task_arguments(p)
    p.add_argument("--alternations", type=int, default=8, help="processes per checkout")
    p.add_argument("--rounds", type=int, default=30, help="timed runs of each system a process")
    args = p.parse_args(argv)
    if args.alternations < 1 or args.rounds < 1:
        p.error("--alternations and --rounds must be >= 1")
    runs: list[list[dict]] = [[], []]  # baseline's processes, the change's
    for _ in range(args.alternations):
        for i, root in enumerate(args.roots):
            runs[i].append(measure(root, args.model, args.size, args.batch, args.rounds))
    summary = {"baseline": summarize(runs[0]), "change": summarize(runs[1])}
    print(f"{args.model} {args.size} b{args.batch}, plain code, {args.alternations} alternations")
    print("| checkout | acrobat ms | hand ms | hand / acrobat | by fastest runs |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for root, s in zip(args.roots, summary.values()):
        print(
            f"| {root} | {s['acrobat_ms']:.2f} | {s['hand_ms']:.2f} | "
            f"{s['hand_over_acrobat']:.3f} | {s['hand_over_acrobat_fastest']:.3f} |"
        )
    return summary


if __name__ == "__main__":
    main()
