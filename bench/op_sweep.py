"""Differential sweep of torch's OpInfo database: every op on per-instance tensors, map vs eager.

For each OpInfo of ``torch.testing._internal.common_methods_invocations.op_db`` (CPU,
float32 samples, the first ``--samples`` of each), the instance function calls the op on
its own tensor (the sample's input, scaled per instance so that instances differ), with
the sample's other arguments shared; ``f.map`` over the instances is compared with the
eager loop. Each (op, sample) lands in one of:

- ``ok``: the map equals eager (NaNs where eager has them);
- ``mismatch``: the map returned values that differ from eager's: a bug;
- ``unsupported``: the map raised ``UnsupportedOpError`` (acrobat cannot batch the op);
- ``error``: the map raised something else (another ``AcrobatError``, a torch error);
- ``known``: an error listed in ``KNOWN`` with its reason;
- ``skipped``: random ops (and samples with dropout), eager failing on the scaled inputs,
  non-tensor inputs.

It needs ``expecttest`` (torch's testing internals import it): ``pip install expecttest``.
A development tool, not part of the test suite: it takes a few minutes.

    python -m bench.op_sweep --out /tmp/sweep          # writes /tmp/sweep.md and .json
    python -m bench.op_sweep --only add,diff,gather    # some ops
    python -m bench.op_sweep --ragged                  # instances of three lengths
"""

from __future__ import annotations

import argparse
import json
import signal
import traceback
import zlib
from collections import Counter

import torch
from torch.utils import _pytree

import acrobat
from acrobat.errors import LazyValueError, UnsupportedOpError

RANDOM = ("rand", "normal", "uniform", "bernoulli", "multinomial", "dropout", "cauchy",
          "exponential", "geometric", "log_normal", "poisson", "empty", "new_empty")  # fmt: skip
# not ops users call on a tensor: a value read through torch's descriptor (x.item() is
# acrobat's demand), Python 2's reflected division
NOT_CALLED = ("item", "__rdiv__")
# known limitations, each with why: (op name, what the detail says) -> reason
KNOWN = {
    # (--ragged: the op inside an explicit block, which must not read values; the error
    # says so in other words for this one)
    ("masked_select", "did not receive"): "a read of the mask inside a block: refused",
}
# known mismatches (--grad --ragged), each with why: (op name, a word of the sample)
KNOWN_MISMATCH = {
    ("nn.functional.layer_norm", "eps: -0.5"): "a negative eps makes a zero pad row NaN, "
    "and its zero gradient NaN times 0 in the shared weights' gradients",
    ("_segment_reduce", "offsets: T(5,)"): "--ragged: offsets past a shorter instance's "
    "data, which eager reads past its end unchecked (undefined values)",
}
INSTANCES = 3


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _scaled(x, i: int):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return (x * (1 + 0.25 * i)).detach()
    return x


def _leaves(out) -> list:
    return [v for v in _pytree.tree_leaves(out)]


def _same(a, b) -> bool:
    la, lb = _leaves(a), _leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(y, torch.Tensor):
            if not isinstance(x, torch.Tensor) or x.shape != y.shape or x.dtype != y.dtype:
                return False
            if y.is_floating_point() or y.is_complex():
                if not _same_values(x, y):
                    return False
            elif not torch.equal(x, y):
                return False
        elif x != y and not (x != x and y != y):  # (NaN)
            return False
    return True


def _same_values(x, y) -> bool:
    """Equal up to float32 rounding of sums of many terms: relative to y's magnitude."""
    scale = float(y.abs().nan_to_num(0, 0, 0).max()) if y.numel() else 0.0
    return torch.allclose(x, y, rtol=1e-4, atol=1e-5 * max(1.0, scale), equal_nan=True)


def _ragged(x, i: int):
    """Instance ``i``'s input, its first dim one row longer or shorter than the sample's
    (row 0 repeated, or the last row dropped) and scaled: instances of lengths that vary,
    which run padded where the op's padding allows (a block of the op between two
    products)."""
    if x.ndim == 0 or x.shape[0] < 2:
        return _scaled(x, i)
    if i % 3 == 1:
        x = x[:-1]
    elif i % 3 == 2:  # (a new value, not a repeat: a sort's ties are in any order)
        first = x[:1] * 1.5 + 0.25 if x.is_floating_point() else x[:1]
        x = torch.cat([first, x])
    return _scaled(x, i)


def _float_sum(out):
    """The sum of every element of ``out``'s floating tensors (a loss), or None."""
    parts = [
        o.sum() for o in _leaves(out) if isinstance(o, torch.Tensor) and o.is_floating_point()
    ]
    return torch.stack(parts).sum() if parts else None


def _grads_match(instance, f, xs, args, kwargs) -> bool | None:
    """Training: the gradients of a loss over the map's outputs, for every instance's
    input and the sample's shared float tensors, equal the eager loop's (None: no
    gradient to compare)."""
    shared = [
        a for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_floating_point()
    ]

    def grads(run):
        inputs = [x.detach().clone().requires_grad_() for x in xs]
        for a in shared:
            a.grad = None
        with torch.enable_grad():
            outs = run(inputs)
            losses = [_float_sum(o) for o in outs]
            if any(v is None or not v.requires_grad for v in losses):
                return None
            torch.stack(losses).sum().backward()
        return [x.grad for x in inputs] + [a.grad for a in shared]

    for a in shared:
        a.requires_grad_(True)
    try:
        try:
            want = grads(lambda ins: [instance(t) for t in ins])
        except Exception:  # (eager's backward refuses: an operand that takes no gradient)
            return None
        if want is None:
            return None
        with torch.no_grad():  # (--ragged: a padding family forms over these traces)
            f.map([x.detach() for x in xs])
        got = grads(lambda ins: f.map(ins))
    finally:
        for a in shared:
            a.requires_grad_(False)
            a.grad = None
    if got is None:
        return False
    return all(
        (g is None and w is None) or (g is not None and w is not None and _same_values(g, w))
        for g, w in zip(got, want)
    )


def _known(op, detail: str) -> bool:
    return any(o == op.name and w in detail for o, w in KNOWN_MISMATCH)


def sweep_op(op, samples: int, ragged: bool = False, grad: bool = False) -> list[tuple[str, str]]:
    """[(outcome, detail)] per sample of ``op``."""
    name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
    if any(r in op.name for r in RANDOM):
        return [("skipped", "random")]
    if op.name in NOT_CALLED:
        return [("skipped", "not called on tensors")]
    torch.manual_seed(zlib.crc32(name.encode()))  # (the same samples in every process)
    try:
        inputs = list(op.sample_inputs("cpu", torch.float32))[:samples]
    except Exception as exc:  # (no float32 samples)
        return [("skipped", f"samples: {type(exc).__name__}")]
    results = []
    for sample in inputs:
        x = sample.input
        if not isinstance(x, torch.Tensor):
            results.append(("skipped", "input not a tensor"))
            continue
        args, kwargs = sample.args, sample.kwargs
        if kwargs.get("dropout_p", 0) or ("attention" in op.name and kwargs.get("training")):
            results.append(("skipped", "random: dropout"))
            continue
        if x.dtype not in (torch.float32, torch.float64, torch.int64, torch.int32, torch.bool):
            results.append(("skipped", f"dtype {x.dtype}"))
            continue
        if x.layout != torch.strided:
            results.append(("skipped", f"layout {x.layout}"))
            continue
        xs = [(_ragged if ragged else _scaled)(x, i) for i in range(INSTANCES)]
        fn = op.op
        if getattr(fn, "__objclass__", None) is torch._C.TensorBase or op.op is op.method_variant:
            method = fn.__name__  # (a method: called on the tensor, as users call it)

            def instance(t, method=method, args=args, kwargs=kwargs):
                return getattr(t, method)(*args, **kwargs)

        elif ragged:  # (in a block: its traces at three lengths run padded)

            def core(t, fn=fn, args=args, kwargs=kwargs):
                return fn(t * 1, *args, **kwargs)

            block = acrobat.block(core)

            def instance(t, block=block):
                return _plus_one(block(t))

        else:

            def instance(t, fn=fn, args=args, kwargs=kwargs):
                return fn(t, *args, **kwargs)

        try:
            with torch.no_grad():
                want = [instance(t) for t in xs]
        except Exception as exc:
            results.append(("skipped", f"eager: {type(exc).__name__}"))
            continue
        if grad and not (op.supports_autograd and x.is_floating_point()):
            results.append(("skipped", "no autograd"))
            continue
        f = acrobat.autobatch(instance)
        signal.alarm(20)
        try:
            if grad:
                same = _grads_match(instance, f, xs, args, kwargs)
                if same is None:
                    results.append(("skipped", "no gradient"))
                    continue
                detail = f"{name}: {tuple(x.shape)} args={_brief(args)} kwargs={_brief(kwargs)}"
                outcome = "ok" if same else "known" if _known(op, detail) else "mismatch"
                results.append((outcome, detail))
                continue
            with torch.no_grad():
                got = f.map(xs)
                if ragged:  # (a padding family forms over the first map's traces)
                    got = f.map(xs)
            detail = f"{name}: {tuple(x.shape)} args={_brief(args)} kwargs={_brief(kwargs)}"
            outcome = "ok" if all(_same(g, w) for g, w in zip(got, want)) else "mismatch"
            if outcome == "mismatch" and ragged and _known(op, detail):
                outcome = "known"
            results.append((outcome, detail))
        except UnsupportedOpError as exc:
            results.append(("unsupported", f"{name}: {str(exc).splitlines()[0][:160]}"))
        except LazyValueError as exc:  # (a block must not read values or compute nothing)
            results.append(("unsupported", f"{name}: {str(exc).splitlines()[0][:160]}"))
        except _Timeout:
            results.append(("error", f"{name}: timeout"))
        except Exception as exc:
            last = traceback.extract_tb(exc.__traceback__)[-1]
            known = [why for (o, says), why in KNOWN.items() if o == op.name and says in str(exc)]
            results.append(("known" if known else "error",
                            f"{name}: {type(exc).__name__}: {str(exc)[:160]} "
                            f"({last.filename.rsplit('/', 1)[-1]}:{last.lineno})"))  # fmt: skip
        finally:
            signal.alarm(0)
    return results


def _plus_one(out):
    """``out`` with 1 added to its floating tensors (an op after the swept one)."""
    if isinstance(out, torch.Tensor):
        return out + 1 if out.is_floating_point() else out
    if isinstance(out, (tuple, list)):
        return type(out)(_plus_one(o) for o in out) if type(out) in (tuple, list) else out
    return out


def _brief(v) -> str:
    def one(a):
        if isinstance(a, torch.Tensor):
            return f"T{tuple(a.shape)}"
        return repr(a)[:30]

    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {one(a)}" for k, a in v.items()) + "}"
    return "(" + ", ".join(one(a) for a in v) + ")"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--only", default="")
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--grad", action="store_true",
        help="training: the gradients of a loss over the outputs, map vs eager",
    )  # fmt: skip
    parser.add_argument(
        "--ragged", action="store_true",
        help="instances' first dims of three lengths (padded runs); the op in a block",
    )  # fmt: skip
    args = parser.parse_args()
    from torch.testing._internal.common_methods_invocations import op_db

    signal.signal(signal.SIGALRM, _alarm)
    acrobat.config.MAP_CHOICE = False
    only = set(args.only.split(",")) if args.only else None
    records = []
    counts: Counter = Counter()
    for op in op_db:
        if only and op.name not in only:
            continue
        for outcome, detail in sweep_op(op, args.samples, args.ragged, args.grad):
            counts[outcome] += 1
            records.append({"op": op.name, "variant": op.variant_test_name,
                             "outcome": outcome, "detail": detail})  # fmt: skip
    lines = [f"# OpInfo sweep: map vs eager ({len(records)} samples)", ""]
    lines += [f"- {k}: {v}" for k, v in sorted(counts.items())]
    for outcome in ("mismatch", "error", "unsupported"):
        lines += ["", f"## {outcome}", ""]
        lines += [f"- {r['detail']}" for r in records if r["outcome"] == outcome]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out + ".md", "w") as fh:
            fh.write(text)
        with open(args.out + ".json", "w") as fh:
            json.dump(records, fh, indent=1)


if __name__ == "__main__":
    main()
