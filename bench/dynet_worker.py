"""Times one DyNet model in a process of its own (DyNet is configured once, at import).

Run by :mod:`bench.run`, one process per (task, autobatch strategy)::

    python -m bench.dynet_worker --model treelstm --size small --batch 8 \\
        --strategy 1 --reps 10 --out /tmp/result.npz

With ``--serve`` the worker times one run per ``go`` line on stdin and prints each
time, so the parent can interleave DyNet's runs with the other systems' (the machine's
speed drifts; systems timed in turn see the same drift). The task is rebuilt from
(model, size, batch, seed), so its weights and inputs are those of the parent's task.
The ``.npz`` holds ``times_ms`` and the outputs of the last timed run, flattened:
``out_<instance>_<leaf>``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import numpy as np
import torch

from bench.dynet_models import DEFAULT_MEM, configure
from bench.registry import MODELS
from models.common import flatten


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--size", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy", type=int, default=1, help="DyNet autobatch value")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (model setup)")
    parser.add_argument("--mem", default=DEFAULT_MEM, help="DyNet memory, MB")
    parser.add_argument("--out", required=True, help="path of the .npz to write")
    parser.add_argument(
        "--serve",
        action="store_true",
        help="after the warm-up print 'ready', then time one run per 'go' line on stdin "
        "(printing its ms) until 'done' or end of input; --reps is ignored",
    )
    args = parser.parse_args(argv)

    configure(autobatch=args.strategy, mem=args.mem)
    if args.threads:
        torch.set_num_threads(args.threads)
    task = importlib.import_module(MODELS[args.model]).make_task(args.size, args.batch, args.seed)
    dynet_model = importlib.import_module(f"bench.dynet_models.{args.model}")
    net = dynet_model.build(task)

    for _ in range(args.warmup):
        dynet_model.forward(net, task.inputs)

    def once() -> tuple[float, list]:
        start = time.perf_counter()
        outputs = dynet_model.forward(net, task.inputs)
        return (time.perf_counter() - start) * 1e3, outputs

    times_ms: list[float] = []
    outputs: list = []
    if args.serve:  # one timed run per "go" line, so the parent can interleave systems
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            ms, outputs = once()
            times_ms.append(ms)
            print(f"{ms!r}", flush=True)
    else:
        for _ in range(args.reps):
            ms, outputs = once()
            times_ms.append(ms)

    arrays = {
        f"out_{i}_{j}": np.asarray(leaf)
        for i, output in enumerate(outputs)
        for j, leaf in enumerate(flatten(output))
    }
    np.savez(args.out, times_ms=np.asarray(times_ms), **arrays)


if __name__ == "__main__":
    main()
