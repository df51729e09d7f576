"""Benchmark: gather fusion on CPU, for the elementwise tail of an LSTM cell.

Compares, per (n, F), the unfused torch path (``index_select`` gathers, then one torch op
per node) with the fused numba kernel (one pass, reading rows through the indices).
Two layouts of the operands:

- ``gathered``: all five operands are rows picked by random indices from arena-like
  buffers with 3n rows (the case gather fusion targets);
- ``gates-contig``: the four gates are column slices of one (n, 4F) matmul output,
  read in place (idx None), and only ``c_prev`` is gathered.

Timings are the median of ``--reps`` calls after warm-up (compile included in warm-up),
single-threaded by default. Example::

    NUMBA_NUM_THREADS=2 python -m bench.kernels
    python -m bench.kernels --threads 2 --reps 50
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from acrobat_kernels import lstm_cell_tail, run


def make_sources(layout: str, n: int, F: int, gen: torch.Generator):
    def arena(rows: int, width: int):
        return torch.randn(rows, width, generator=gen)

    def random_rows(rows: int):
        return torch.randint(0, rows, (n,), generator=gen)

    if layout == "gathered":
        return [(buf, random_rows(3 * n)) for buf in (arena(3 * n, F) for _ in range(5))]
    gates = arena(n, 4 * F)
    c_prev = arena(3 * n, F)
    return [(gates[:, k * F:(k + 1) * F], None) for k in range(4)] + [(c_prev, random_rows(3 * n))]


def median_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", default="64,512,2048")
    parser.add_argument("--Fs", default="256,512")
    parser.add_argument("--layouts", default="gathered,gates-contig")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch and numba threads")
    args = parser.parse_args()

    import numba

    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    program = lstm_cell_tail()
    gen = torch.Generator().manual_seed(0)

    start = time.perf_counter()
    run(program, 4, 8, make_sources("gathered", 4, 8, gen), backend="numba")
    print(f"numba compile + first call: {time.perf_counter() - start:.2f} s "
          f"(threads={args.threads})\n")

    header = f"{'layout':<13} {'n':>5} {'F':>4} {'torch us':>10} {'numba us':>10} {'speedup':>8}"
    print(header)
    print("-" * len(header))
    for layout in args.layouts.split(","):
        for n in map(int, args.ns.split(",")):
            for F in map(int, args.Fs.split(",")):
                sources = make_sources(layout, n, F, gen)
                ref = run(program, n, F, sources, backend="torch")
                out = run(program, n, F, sources, backend="numba")
                for a, b in zip(out, ref):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
                t_torch, t_numba = (
                    median_us(functools.partial(run, program, n, F, sources, backend=b), args.reps)
                    for b in ("torch", "numba")
                )
                print(f"{layout:<13} {n:>5} {F:>4} {t_torch:>10.1f} {t_numba:>10.1f} "
                      f"{t_torch / t_numba:>7.2f}x")


if __name__ == "__main__":
    main()
