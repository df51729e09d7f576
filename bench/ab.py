"""A/B of one ``acrobat.config`` flag on the benchmark models, in one process.

Each round runs the map once per value of the flag, in a shuffled order, so the
machine's slow and fast spells reach every value alike (times of separate processes, or
of machines lent one after another, do not compare). Every value's outputs are checked
against the eager loop's first.

    python -m bench.ab --flag INDEX_RING --values 0,1 --models treelstm,stackrnn \\
        --sizes small --batches 64 --device cuda

``--flag MODULE:NAME`` sets a module's attribute instead (a kernel module's switch, e.g.
``acrobat_kernels.elementwise:DRIVER_LAUNCH``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import random
import statistics
import time

import torch

import acrobat
from bench.registry import MODELS
from models.common import outputs_close, run_eager


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a string flag (KERNEL_BACKEND=numba)


def _target(name: str):
    """(the object holding flag ``name``, its attribute): acrobat.config's, or for
    ``MODULE:NAME`` that module's."""
    if ":" not in name:
        return acrobat.config, name
    path, _, attr = name.partition(":")
    return importlib.import_module(path), attr


@contextlib.contextmanager
def flag(name: str, value):
    """``acrobat.config.override(name=value)``, or for ``MODULE:NAME`` that attribute of
    that module set for the duration."""
    target, attr = _target(name)
    if target is acrobat.config:  # (override checks the name is a flag)
        with acrobat.config.override(**{attr: value}):
            yield
        return
    old = getattr(target, attr)
    setattr(target, attr, value)
    try:
        yield
    finally:
        setattr(target, attr, old)


def ab_case(module, size: str, batch: int, args) -> dict:
    task = module.make_task(size, batch, blocks=args.blocks)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with torch.no_grad():
        reference = run_eager(task)

    def run(value):
        with flag(args.flag, value):
            start = time.perf_counter()
            outs = task.fn.map(task.inputs, **task.kwargs)
            sync()
            ms = (time.perf_counter() - start) * 1e3
        stats = acrobat.stats()
        return outs, ms, stats.t_gather * 1e3 if stats is not None else float("nan")

    times: dict = {v: [] for v in args.values}
    gathers: dict = {v: [] for v in args.values}
    with torch.no_grad():
        for value in args.values:
            for _ in range(args.warmup):
                outs, _, _ = run(value)
            acrobat.fusion.wait_compiled()  # kernels compiled in the background
            check = outputs_close(outs, reference, atol=1e-4, rtol=1e-4)
            if not check:
                raise AssertionError(f"{args.flag}={value!r}: {check.message}")
        rng = random.Random(f"{module.__name__}/{size}/{batch}")
        for _ in range(args.reps):
            order = list(args.values)
            rng.shuffle(order)
            for value in order:
                _, ms, gather_ms = run(value)
                times[value].append(ms)
                gathers[value].append(gather_ms)
    return {
        v: (statistics.median(times[v]), min(times[v]), statistics.median(gathers[v]))
        for v in args.values
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    csv = lambda text: [item for item in text.split(",") if item]
    parser.add_argument(
        "--flag", required=True, help="an acrobat.config name, or MODULE:NAME"
    )
    parser.add_argument("--values", type=lambda t: [_value(v) for v in csv(t)], default=[0, 1])
    parser.add_argument("--models", type=csv, default=list(MODELS))
    parser.add_argument("--sizes", type=csv, default=["small"])
    parser.add_argument("--batches", type=lambda t: [int(b) for b in csv(t)], default=[64])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--blocks", action="store_true", help="the models with @block cells")
    parser.add_argument("--device", default="cpu", help="torch's default device (cuda)")
    args = parser.parse_args(argv)
    target, attr = _target(args.flag)
    if not hasattr(target, attr):
        parser.error(f"{target.__name__} has no flag {attr}")
    if args.device != "cpu":
        torch.set_default_device(args.device)
    print(f"{args.flag}: {args.values}, device {args.device}, {args.reps} rounds; median ms "
          "(min ms, median gather ms)")  # fmt: skip
    for name in args.models:
        module = importlib.import_module(MODELS[name])
        for size in args.sizes:
            for batch in args.batches:
                try:
                    res = ab_case(module, size, batch, args)
                except Exception as error:  # one failing case must not stop the rest
                    print(f"{name} {size} b{batch}: {type(error).__name__}: {error}")
                    continue
                base = res[args.values[0]][0]
                cells = [
                    f"{v!r}: {m:.2f} ({lo:.2f}, {g:.2f}) {base / m:.2f}x"
                    for v, (m, lo, g) in res.items()
                ]
                print(f"{name} {size} b{batch}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
