"""Instructions a map executes, counted by valgrind's cachegrind: two checkouts compared
where timing cannot tell them apart.

A change that saves 1-2% of a map (a C helper that stops making an int per row, a list it
no longer builds) is below this VM's timing noise: two full runs of ``bench.run`` differ
by 5-10%, and even alternated processes (``bench.sidebyside``) by ~3% from one batch of
alternations to the next. The instructions a map executes barely move: each checkout runs
the model's plain-code map ``--warm`` times and ``--warm + --maps`` times, in two processes
under ``valgrind --tool=cachegrind`` (PYTHONHASHSEED=0; OMP_NUM_THREADS=1: one thread, no
OpenMP spinning, which valgrind would count); the difference over ``--maps`` is the count of
one map, imports and compiles cancelling out. One throwaway process per checkout first:
numba compiles its kernels again for the CPU valgrind reports (no AVX-512) and caches them.

    python -m bench.icount /tmp/old-checkout . --model drnn --size small --batch 64

Each root must hold a built checkout, as for ``bench.sidebyside``. About 2.5 minutes a
process for DRNN (the import dominates); the two checkouts run side by side (2 cores).

What it measures is the runtime's own work, not its speed: under valgrind the online GEMM
choice sees valgrind's timings and may run torch's MKL instead of the numba kernel (the
GEMMs' instructions then dominate but are the same for both checkouts where the choice
is), cache misses and greenlet stack copies cost what their instructions do, and
instructions are not time. Use it for changes to the recording and bookkeeping paths;
time kernels with ``bench.run`` or ``bench.sidebyside``. Session 58: its code against
f56f84a on DRNN small b64, 181.19M -> 178.88M instructions a map (-1.27%; by hand before
the tool, 181.07M -> 178.80M), where three batches of ``bench.sidebyside`` alternations
of the same checkouts read -3.7%, -4.2% and +0.8%.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from bench import sidebyside

_CHILD = sidebyside.CHILD_TASK + r"""
with torch.no_grad():
    for _ in range(count):
        task.fn.map(task.inputs, **task.kwargs)
"""

_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def instructions(valgrind_output: str) -> int:
    """The ``I refs`` total cachegrind prints at the end of a run."""
    found = _REFS.findall(valgrind_output)
    if not found:
        raise ValueError("no 'I refs' line in valgrind's output (did the program fail?)")
    return int(found[-1].replace(",", ""))


def per_map(few: int, many: int, maps: int) -> float:
    """One map's instructions from two runs' totals that differ by ``maps`` maps."""
    if maps <= 0:
        raise ValueError("maps must be positive")
    return (many - few) / maps


def _count(root: str, args, maps: int) -> int:
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    cmd = [
        "valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
        os.path.realpath(sys.executable), "-c", _CHILD,
        root, args.model, args.size, str(args.batch), str(maps),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{root}: the map failed under valgrind:\n{done.stderr[-2000:]}")
    return instructions(done.stderr)


def main(argv=None) -> None:
    doc = (__doc__ or "").split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m bench.icount", description=doc)
    sidebyside.task_arguments(parser)
    parser.add_argument("--warm", type=int, default=3, help="maps in the shorter run")
    parser.add_argument("--maps", type=int, default=10, help="maps the longer run adds")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    roots = [os.path.realpath(r) for r in args.roots]
    with ThreadPoolExecutor(len(roots)) as pool:  # (one process per checkout at a time)
        list(pool.map(lambda r: _count(r, args, 1), roots))  # numba's compiles, cached
        few = list(pool.map(lambda r: _count(r, args, args.warm), roots))
        many = list(pool.map(lambda r: _count(r, args, args.warm + args.maps), roots))
    print(f"{args.model} {args.size} b{args.batch}, instructions a map ({args.maps} maps):")
    base = None
    for root, a, b in zip(args.roots, few, many):
        n = per_map(a, b, args.maps)
        change = "" if base is None else f" ({100 * (n / base - 1):+.2f}%)"
        base = base or n
        print(f"  {root}: {n / 1e6:.2f}M{change}")


if __name__ == "__main__":
    main()
