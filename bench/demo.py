"""The main job: a TreeLSTM over the SST test trees, batched by acrobat vs the eager loop.

    python -m bench.demo                 # hidden 256, mini-batches of 64, whole test split
    python -m bench.demo --size large --batch 64 --limit 640

Prints the time of both, the speedup and the largest difference between their outputs.
"""

from __future__ import annotations

import argparse
import time

import torch

from models import treelstm
from models.sst import load_trees, split_vocab


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(treelstm.SIZES), default="small")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--limit", type=int, default=None, help="use the first N test trees")
    parser.add_argument("--plain", action="store_true", help="no @acrobat.block on the cells")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    vocab = split_vocab("test")
    trees = load_trees("test", limit=args.limit, vocab=vocab)
    task = treelstm.make_task(args.size, args.batch, blocks=not args.plain)
    model, fn = task.model, task.fn
    batches = [trees[i : i + args.batch] for i in range(0, len(trees), args.batch)]
    print(
        f"TreeLSTM ({args.size}, hidden {model.hidden}) on {len(trees)} SST test trees, "
        f"mini-batches of {args.batch}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    with torch.no_grad():
        fn.map(batches[0], model=model)  # warm-up: traces blocks, fills shape caches
        t0 = time.perf_counter()
        batched = [out for b in batches for out in fn.map(b, model=model)]
        t_batched = time.perf_counter() - t0
        t0 = time.perf_counter()
        eager = [fn.eager(t, model=model) for t in trees]
        t_eager = time.perf_counter() - t0
    diff = max(
        (g - w).abs().max().item() for gb, wb in zip(batched, eager) for g, w in zip(gb, wb)
    )
    print(f"acrobat (f.map)   {t_batched * 1e3:9.1f} ms")
    print(f"eager loop        {t_eager * 1e3:9.1f} ms")
    print(f"speedup           {t_eager / t_batched:9.2f}x")
    print(f"max |difference|  {diff:9.2e}")


if __name__ == "__main__":
    main()
