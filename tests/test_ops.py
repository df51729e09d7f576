"""Per-op tests, generated from the op table.

``CASES`` maps every row of ``acrobat.ops.TABLE`` (except the data ops ``input``, ``take``
and ``tensor``, tested explicitly at the end of this file) to case builders. A case is a
per-instance function plus the specs of its arguments: per-instance tensors (stacked by
acrobat) and shared tensors or modules (reused operands), with shapes written over size
symbols that hypothesis draws (1..5). ``test_op`` runs every case through the oracle
``check_map`` with batch sizes 1..6, instances of equal shapes or (``ragged``) of shapes
drawn per instance, and asserts that the row really ran as a batch and that n equally
shaped instances take exactly as many batches as one.

A new row without a case fails ``test_every_row_has_a_case``; a new alias that no case
calls fails ``test_every_alias_is_called``.
"""

from __future__ import annotations

import contextlib
import io
import operator
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.overrides import TorchFunctionMode

import acrobat
from acrobat.ops import TABLE, put
from tests.helpers import assert_close_tree, check_map

DATA_OPS = ("input", "take", "tensor")  # tested by the explicit tests at the end


# ---- case specs -----------------------------------------------------------------------


@dataclass(frozen=True)
class Arg:
    """A tensor argument. ``shape`` is a template like ``"a b"``, ``"a*b 3"`` or ``""``
    (0-d), or a tuple of templates of which each example picks one. Float values are
    uniform in [lo, hi); integer values are in [lo, hi) where hi may be a size symbol."""

    shape: str | tuple[str, ...] = "a"
    dtype: torch.dtype = torch.float32
    lo: float | str = -2.0
    hi: float | str = 2.0
    shared: bool = False


def X(shape="a", **kw) -> Arg:
    """A per-instance tensor."""
    return Arg(shape, **kw)


def W(shape="a", **kw) -> Arg:
    """A shared real tensor: one value for the whole map call (a reused operand)."""
    return Arg(shape, shared=True, **kw)


@dataclass(frozen=True)
class Module:
    """A shared object (an nn.Module) built from the example's sizes."""

    build: Callable[[dict], object]
    uses: str = ""  # the size symbols the module fixes for every instance


POS = {"lo": 0.5, "hi": 2.0}  # log, sqrt, divisors, pow bases
LONG = {"dtype": torch.long, "lo": -2, "hi": 3}  # small integers: comparisons see ties
BOOL = {"dtype": torch.bool}

# Right-aligned suffixes of one shape (and size-1 dims): any two broadcast together.
RANKS = ("", "c", "b c", "a b c")
BCAST = (*RANKS, "1 c", "b 1", "a 1 c")
RANKS1 = ("c", "b c", "a b c")  # at least one dim
RANKS2 = ("b c", "a b c")


@dataclass
class Case:
    label: str
    fn: Callable
    args: dict
    recorded: bool = True  # the row runs as a batch (False: hoisted, or an identity)
    sized: bool = False  # the result's size is set by values: read first (not in a block)


def case(label, fn, *, recorded=True, sized=False, **args) -> Case:
    return Case(label, fn, args, recorded, sized)


# ---- calling an alias the way users do -------------------------------------------------

_OPERATORS = {
    "__add__": operator.add,
    "__sub__": operator.sub,
    "__mul__": operator.mul,
    "__truediv__": operator.truediv,
    "__floordiv__": operator.floordiv,
    "__mod__": operator.mod,
    "__pow__": operator.pow,
    "__matmul__": operator.matmul,
    "__and__": operator.and_,
    "__or__": operator.or_,
    "__eq__": operator.eq,
    "__ne__": operator.ne,
    "__lt__": operator.lt,
    "__le__": operator.le,
    "__gt__": operator.gt,
    "__ge__": operator.ge,
    "__neg__": operator.neg,
    "__abs__": abs,
    "__getitem__": operator.getitem,
}


def _is_method(f) -> bool:
    owner = getattr(f, "__objclass__", None)
    return owner in (torch._C.TensorBase, torch.Tensor) or getattr(
        f, "__qualname__", ""
    ).startswith("Tensor.")


CALLED: set = set()  # every alias call() was asked to call (test_every_alias_is_called)


def call(alias, *args, **kwargs):
    """``alias(*args)`` as written in user code: ``x + y`` for an operator, ``x.add(y)``
    for a Tensor method (a LazyTensor is not a Tensor, so ``Tensor.add(x, y)`` would not
    reach it), ``torch.add(x, y)`` / ``F.relu(x)`` otherwise."""
    CALLED.add(alias)
    name = getattr(alias, "__name__", "")
    if name in _OPERATORS:
        assert not kwargs, name
        return _OPERATORS[name](*args)
    if _is_method(alias):
        return getattr(args[0], name)(*args[1:], **kwargs)
    return alias(*args, **kwargs)


def aliases(name, operators=True):
    out = list(dict.fromkeys(TABLE[name].aliases))
    if not operators:
        out = [a for a in out if getattr(a, "__name__", "") not in _OPERATORS]
    return out


def each(name, *args, **kwargs):
    """Every alias of row ``name`` called on the same arguments, as a tuple of results."""
    return tuple(call(a, *args, **kwargs) for a in aliases(name, operators=not kwargs))


def plain(r):
    """A torch.return_types namedtuple as a plain tuple (see test_max_namedtuple_result)."""
    return tuple(r) if isinstance(r, tuple) else r


# ---- the cases, one or more per row ----------------------------------------------------


def computed(fn):
    """``fn`` applied to a value computed from the argument, not to the argument itself
    (basic indexing of an argument is an input of its own, not the op)."""
    return lambda x: fn(x * 1)


CASES: dict[str, list[Case]] = {}


def add(name, *cases):
    CASES.setdefault(name, []).extend(cases)


def alias_case(name, arity, spec, label="aliases"):
    if arity == 1:
        return case(label, lambda x: each(name, x), x=spec)
    return case(label, lambda x, y: each(name, x, y), x=spec, y=spec)


# unary elementwise: every alias on ranks 0..3
# fmt: off
_UNARY_ANY = [
    "neg", "abs", "sigmoid", "tanh", "relu", "gelu", "silu", "elu", "leaky_relu", "softplus",
    "exp", "sin", "cos", "square", "sign", "floor", "ceil", "round", "erf", "contiguous",
    "clone", "detach", "float", "double", "long", "int", "bool", "half", "atan", "tan", "sinh",
    "cosh", "asinh", "expm1", "exp2", "trunc", "frac", "nan_to_num", "isnan", "isinf",
    "isfinite",
]
# fmt: on
for _name in _UNARY_ANY:
    add(_name, alias_case(_name, 1, X(RANKS)))
for _name in ["log", "log1p", "sqrt", "rsqrt", "reciprocal", "log2", "log10"]:
    add(_name, alias_case(_name, 1, X(RANKS, **POS)))
add(
    "bitwise_not",
    alias_case("bitwise_not", 1, X(RANKS, **BOOL)),
    alias_case("bitwise_not", 1, X(RANKS, **LONG), label="int input"),
)
add(
    "logical_not",
    alias_case("logical_not", 1, X(RANKS, **BOOL)),
    alias_case("logical_not", 1, X(RANKS), label="float input"),
)

add("gelu", case("tanh approximation", lambda x: F.gelu(x, approximate="tanh"), x=X(RANKS)))
add("elu", case("alpha", lambda x: (F.elu(x, 0.5), F.elu(x, alpha=2.0)), x=X(RANKS)))
add(
    "leaky_relu",
    case(
        "slope", lambda x: (F.leaky_relu(x, 0.3), F.leaky_relu(x, negative_slope=0.01)), x=X(RANKS)
    ),
)
add(
    "softplus", case("beta threshold", lambda x: F.softplus(x, beta=2.0, threshold=1.0), x=X(RANKS))
)
add(
    "round",
    case(
        "decimals",
        lambda x: (torch.round(x * 7, decimals=1), (x * 7).round(decimals=-1)),
        x=X(RANKS),
    ),
)
add(
    "clamp",
    case("min max", lambda x: each("clamp", x, min=-0.5, max=0.5), x=X(RANKS)),
    case("positional min", lambda x: (torch.clamp(x, -1.0), x.clip(None, 0.25)), x=X(RANKS)),
    case("lazy tensor bounds", lambda x, y: torch.clamp(x, min=y), x=X(BCAST), y=X(BCAST)),
    case(
        "shared tensor bound",
        lambda x, w: (x.clamp(max=w), torch.clamp(x, w - 1, w)),
        x=X(BCAST),
        w=W(BCAST),
    ),
)
add("contiguous", case("transposed", lambda x: x.transpose(0, -1).contiguous(), x=X(RANKS1)))
for _name in ["float", "double", "long", "int", "bool", "half"]:
    add(_name, case("from long", lambda x, _n=_name: getattr(x, _n)(), x=X(RANKS, **LONG)))
add(
    "to",
    case(
        "dtype",
        lambda x: (
            x.to(torch.float64),
            x.to(dtype=torch.long),
            x.to(torch.float32),
            x.to("cpu"),
            x.to("cpu", torch.float16),
        ),
        x=X(RANKS),
    ),
    case("like lazy", lambda x, y: (x.to(y), y.to(x)), x=X(RANKS), y=X(RANKS, **LONG)),
    case("like shared", lambda x, w: x.to(w), x=X(RANKS), w=W("2", dtype=torch.float64)),
)
add(
    "type_as",
    case("lazy", lambda x, y: (x.type_as(y), y.type_as(x)), x=X(RANKS), y=X(RANKS, **LONG)),
    case("shared", lambda x, w: x.type_as(w), x=X(RANKS), w=W("2", dtype=torch.float64)),
)

# binary elementwise: every alias with two lazy operands (broadcasting, 0-d), with a shared
# operand on either side, and with a Python scalar on either side (operators reflect)
_BINARY_DOMAIN = {
    "add": {}, "sub": {}, "mul": {}, "maximum": {}, "minimum": {},
    "div": POS, "floor_divide": POS, "remainder": POS, "pow": POS,
    "eq": LONG, "ne": LONG, "lt": LONG, "le": LONG, "gt": LONG, "ge": LONG,
    "logical_and": BOOL, "logical_or": BOOL, "atan2": {}, "hypot": {}, "logaddexp": {},
}  # fmt: skip
_SCALAR = {
    "add": 1.5,
    "sub": 1.5,
    "mul": -2,
    "div": 1.5,
    "floor_divide": 0.75,
    "remainder": 1.5,
    "pow": 2,
    "eq": 1,
    "ne": 1,
    "lt": 1,
    "le": 0,
    "gt": 0,
    "ge": 1,
}
_REFLECTED = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "div": operator.truediv,
    "floor_divide": operator.floordiv,
    "remainder": operator.mod,
    "pow": operator.pow,
    "eq": operator.eq,
    "ne": operator.ne,
    "gt": operator.lt,
    "ge": operator.le,
    "lt": operator.gt,
    "le": operator.ge,
}  # 2 - x calls x.__rsub__(2); 2 < x calls x.__gt__(2)
for _name, _dom in _BINARY_DOMAIN.items():
    add(
        _name,
        alias_case(_name, 2, X(BCAST, **_dom)),
        case(
            "shared operand",
            lambda x, w, _n=_name: each(_n, x, w) + each(_n, w, x),
            x=X(BCAST, **_dom),
            w=W(BCAST, **_dom),
        ),
    )
    if _dom is LONG:
        add(_name, case("float", lambda x, y, _n=_name: each(_n, x, y), x=X(BCAST), y=X(BCAST)))
for _name, _s in _SCALAR.items():
    add(
        _name,
        case(
            "python scalar",
            lambda x, _n=_name, _s=_s: each(_n, x, _s),
            x=X(RANKS, **_BINARY_DOMAIN[_name]),
        ),
    )
for _name, _op in _REFLECTED.items():
    add(
        _name,
        case(
            "reflected scalar",
            lambda x, _f=_op: (_f(2, x), _f(0.5, x)),
            x=X(RANKS, **_BINARY_DOMAIN[_name]),
        ),
    )
add(
    "add",
    case(
        "alpha",
        lambda x, y: (torch.add(x, y, alpha=2), x.add(y, alpha=-0.5)),
        x=X(BCAST),
        y=X(BCAST),
    ),
    case("int + float", lambda x, y: (x + y, y + x, x + 1), x=X(RANKS, **LONG), y=X(RANKS)),
)
add("sub", case("alpha", lambda x, y: torch.sub(x, y, alpha=3), x=X(BCAST), y=X(BCAST)))
add(
    "div",
    case(
        "rounding mode",
        lambda x, y: (torch.div(x, y, rounding_mode="floor"), x.div(y, rounding_mode="trunc")),
        x=X(BCAST),
        y=X(BCAST, **POS),
    ),
)
add(
    "logical_and",
    case("int bitwise &", lambda x, y: (x & y, y & 3), x=X(BCAST, **LONG), y=X(BCAST, **LONG)),
)
add(
    "logical_or",
    case("int bitwise |", lambda x, y: (x | y, y | 3), x=X(BCAST, **LONG), y=X(BCAST, **LONG)),
)
add("logical_and", case("reflected", lambda x: True & x, x=X(RANKS, **BOOL)))
add("logical_or", case("reflected", lambda x: False | x, x=X(RANKS, **BOOL)))
add(
    "where",
    case(
        "lazy",
        lambda c, x, y: (torch.where(c, x, y), x.where(c, y)),
        c=X(BCAST, **BOOL),
        x=X(BCAST),
        y=X(BCAST),
    ),
    case(
        "scalar other",
        lambda c, x: (torch.where(c, x, 0.0), torch.where(c, 1.0, x)),
        c=X(BCAST, **BOOL),
        x=X(BCAST),
    ),
    case("comparison", lambda x: torch.where(x > 0, x, -x * 0.5), x=X(RANKS)),
    case(
        "shared operands",
        lambda c, x, w, m: (torch.where(c, w, x), torch.where(m, x, w)),
        c=X(BCAST, **BOOL),
        x=X(BCAST),
        w=W(BCAST),
        m=W(BCAST, **BOOL),
    ),
)
add(
    "masked_fill",
    case(
        "aliases",
        lambda x, m: (torch.masked_fill(x, m, -1.0), x.masked_fill(m, 0.5)),
        x=X(RANKS),
        m=X(RANKS, **BOOL),
    ),
    case(
        "broadcast mask",
        lambda x, m: x.masked_fill(m, 2.0),
        x=X("a b c"),
        m=X(("c", "b 1"), **BOOL),
    ),
    case("shared mask", lambda x, m: x.masked_fill(m, -3.0), x=X(RANKS), m=W(RANKS, **BOOL)),
    case(
        "lazy 0-d value",
        lambda x, m, v: x.masked_fill(m, v),
        x=X(RANKS1),
        m=X(RANKS1, **BOOL),
        v=X(""),
    ),
)
add(
    "lerp",
    case(
        "scalar weight",
        lambda x, y: (torch.lerp(x, y, 0.3), x.lerp(y, 0.75)),
        x=X(BCAST),
        y=X(BCAST),
    ),
    case(
        "tensor weight",
        lambda x, y, w: (torch.lerp(x, y, w), x.lerp(y, y * 0.5)),
        x=X(RANKS),
        y=X(RANKS),
        w=X(RANKS),
    ),
    case("shared", lambda x, w: torch.lerp(x, w, w), x=X(BCAST), w=W(BCAST)),
)
add(
    "addcmul",
    case(
        "aliases",
        lambda x, y, z: (torch.addcmul(x, y, z), x.addcmul(y, z, value=0.5)),
        x=X(BCAST),
        y=X(BCAST),
        z=X(BCAST),
    ),
    case(
        "shared",
        lambda x, w: (torch.addcmul(w, x, w, value=-2), torch.addcmul(x, w, w)),
        x=X(BCAST),
        w=W(BCAST),
    ),
)

# dropout: an identity in eval mode (no node at all); a batched mask in training, checked
# through a deterministic function of it (x / (1 - 0.5) is exactly 2 x)
add(
    "dropout",
    case(
        "eval",
        lambda x, drop: (
            F.dropout(x, 0.5, training=False),
            drop(x),
            F.dropout(x, p=0.0),
            torch.dropout(x, 0.3, False),
        ),
        recorded=False,
        x=X(RANKS),
        drop=Module(lambda d: nn.Dropout(0.3).eval()),
    ),
    case(
        "training",
        lambda x, drop: tuple(
            torch.where(y == 0, x * 2, y)
            for y in (
                F.dropout(x, 0.5),
                F.dropout(x, p=0.5, training=True),
                torch.dropout(x, 0.5, True),
                drop(x),
            )
        ),
        x=X(RANKS),
        drop=Module(lambda d: nn.Dropout(0.5).train()),
    ),
)
# random: values differ from eager; check functions of them that do not (and see the
# explicit tests below)
add(
    "rand_like",
    case(
        "bounds",
        lambda x: (
            torch.rand_like(x) < 1.0,
            torch.rand_like(x) >= 0,
            torch.randn_like(x) * 0.0 + x,
        ),
        x=X(RANKS),
    ),
)
# (recorded as the reductions all / any)
add("is_all_true", case("bool", lambda x: torch._is_all_true(x > 0), x=X(RANKS), recorded=False))
add("is_any_true", case("bool", lambda x: torch._is_any_true(x > 0), x=X(RANKS), recorded=False))
add(
    "pad_sequence",
    case(  # (recorded as its parts: F.pad of each, a stack)
        "sides and values",
        lambda x: (
            nn.utils.rnn.pad_sequence([x, x[:1] * 2], batch_first=True, padding_value=-1.0),
            torch._C._nn.pad_sequence([x * 2, x[:2]], False, 0.5, "left"),
            nn.utils.rnn.pad_sequence([x]),
        ),
        x=X(("a", "a b")),
        recorded=False,
    ),
)
add(
    "multinomial",
    case(  # draws differ from eager's; what they must satisfy does not
        "valid draws",
        lambda x: (
            torch.softmax(x, -1).gather(-1, torch.multinomial(torch.softmax(x, -1), 1)) > 0,
            torch.multinomial(torch.softmax(x, -1), x.shape[-1]).sort(-1).values,
            x.exp().multinomial(2, replacement=True) < x.shape[-1],
            torch.multinomial(torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float(), 1),
        ),
        x=X(("c", "b c")),
    ),
)
add(
    "gumbel_softmax",
    case(  # (draws differ from eager's: rows that sum to one, one-hots)
        "soft and hard",
        lambda x: (
            F.gumbel_softmax(x, tau=0.5).sum(-1),
            F.gumbel_softmax(x, hard=True).sum(-1),
            F.gumbel_softmax(x, 2.0, True, dim=-1).amax(-1),
        ),
        x=X(("c", "b c")),
        recorded=False,  # (recorded as its parts)
    ),
)
add(
    "normal",
    case(  # (draws differ from eager's: a zero std draws the mean itself)
        "tensor mean and std",
        lambda x: (
            torch.normal(x, x.abs() * 0),
            torch.normal(x * 0, 1.0).shape[-1] + x,
            torch.normal(x, torch.ones(x.shape)) * 0 + x,
        ),
        x=X(RANKS1),
    ),
)
add(
    "poisson",
    case(  # (draws differ from eager's: a zero rate draws zero, a draw is a count)
        "rates",
        lambda x: (
            torch.poisson(x.abs() * 0),
            torch.poisson(x.abs()) >= 0,
            (torch.poisson(x.abs()) % 1) * 0 + x,
        ),
        x=X(RANKS),
    ),
)
add(
    "binomial",
    case(  # (a certain success or failure draws the count or zero)
        "counts and probabilities",
        lambda x: (
            torch.binomial(x.abs().round(), (x > 0).float()),
            torch.binomial(torch.full(x.shape, 3.0), torch.sigmoid(x)) <= 3,
        ),
        x=X(RANKS),
    ),
)
add(
    "bernoulli",
    case(
        "0 and 1",
        lambda x: (
            torch.bernoulli(torch.sigmoid(x)) <= 1,
            torch.bernoulli((x > 0).float()),
            torch.sigmoid(x).bernoulli() * 0 + x,
        ),
        x=X(RANKS),
    ),
)
add(
    "zeros_like",
    case(
        "hoisted",
        lambda x: (
            x + torch.zeros_like(x),
            torch.ones_like(x, dtype=torch.long),
            x * torch.full_like(x, 3.0),
            torch.zeros_like(torch.empty_like(x)),
        ),
        recorded=False,
        x=X(RANKS),
    ),
)

# shape ops
add(
    "reshape",
    case(
        "flat",
        lambda x: (torch.reshape(x, (-1,)), x.reshape(-1), x.reshape((1, -1)), x.reshape(1, -1)),
        x=X(RANKS),
    ),
    case("split a dim", lambda x: x.reshape(x.shape[0], 2, -1), x=X("a 2*b")),
    case("shared source", lambda x, w: x.reshape(-1) + w.reshape(-1).sum(), x=X(RANKS), w=W("a b")),
)
add(
    "view",
    case("flat", lambda x: (x.view(-1), x.view(1, *x.shape), x.view((-1, 1))), x=X(RANKS)),
    case("split a dim", lambda x: x.view(x.shape[0], 2, -1), x=X("a 2*b")),
    case(
        "as another dtype",  # the same bits read as another dtype (was float, silently)
        lambda x: (x.view(torch.int32), x.view(torch.int16), (x * 2).view(torch.uint8) * 1),
        x=X(("4", "a 4")),
    ),
)
add(
    "view_as",
    case("lazy", lambda x, y: x.view_as(y), x=X("a b*c"), y=X("a b c")),
    case("shared", lambda x, w: x.view_as(w), x=X("a b c"), w=W("a*b c")),
)
add(
    "reshape_as",
    case("lazy", lambda x, y: x.reshape_as(y), x=X("a b*c"), y=X("a b c")),
    case("shared", lambda x, w: x.reshape_as(w), x=X("a b c"), w=W("a*b c")),
)
add(
    "flatten",
    case("aliases", lambda x: (torch.flatten(x), x.flatten(), x.flatten(-1)), x=X(RANKS)),
    case(
        "dims",
        lambda x: (x.flatten(1), torch.flatten(x, 0, -2), x.flatten(start_dim=-2)),
        x=X(RANKS2),
    ),
)
add(
    "unflatten",
    case(
        "aliases",
        lambda x: (torch.unflatten(x, -1, (2, -1)), x.unflatten(0, (1, -1))),
        x=X(("2*c", "b 2*c")),
    ),
)
add(
    "squeeze",
    case("all", lambda x: (torch.squeeze(x), x.squeeze()), x=X(("1", "a 1", "1 a 1 b"))),
    case(
        "dims",
        lambda x: (
            x.squeeze(1),
            x.squeeze(-1),
            torch.squeeze(x, 0),
            x.squeeze((1, 2)),
            x.squeeze(dim=-2),
        ),
        x=X(("a 1 1", "1 b 1", "a b c")),
    ),
)
add(
    "unsqueeze",
    case(
        "dims",
        lambda x: (torch.unsqueeze(x, 0), x.unsqueeze(-1), x.unsqueeze(dim=x.ndim)),
        x=X(RANKS),
    ),
    case("middle", lambda x: (x.unsqueeze(1), x.unsqueeze(-2)), x=X(RANKS1)),
)
add(
    "expand",
    case("new dims", lambda x: (x.expand(3, *x.shape), x.expand(2, 1, *x.shape)), x=X(RANKS)),
    case("size-1 dims", lambda x: (x.expand(-1, 4), x.expand(2, -1, 3)), x=X("a 1")),
    case("expand_as lazy", lambda x, y: x.expand_as(y), x=X(("1", "c", "1 c")), y=X("b c")),
    case(
        "expand_as shared",
        lambda x, w: (x.expand_as(w), w.expand_as(x.expand_as(w))),
        x=X(("1", "c", "1 c")),
        w=W("b c"),
    ),
)

# reductions: every alias over all elements, over a dim (negative too, keepdim), over a
# tuple of dims, with a dtype, on 0-d tensors
_REDUCE = [
    "sum",
    "mean",
    "prod",
    "amax",
    "amin",
    "max",
    "min",
    "argmax",
    "argmin",
    "logsumexp",
    "all",
    "any",
]
for _name in _REDUCE:
    _spec = X(RANKS1, **BOOL) if _name in ("all", "any") else X(RANKS1)
    _spec0 = X("", **BOOL) if _name in ("all", "any") else X("")
    add(
        _name,
        case(
            "dim",
            lambda x, _n=_name: tuple(
                map(
                    plain,
                    each(_n, x, 0)
                    + each(_n, x, -1)
                    + each(_n, x, x.ndim - 1, True)
                    + each(_n, x, dim=0, keepdim=True),
                )
            ),
            x=_spec,
        ),
        case(
            "0-d", lambda x, _n=_name: tuple(map(plain, each(_n, x, 0) + each(_n, x, -1))), x=_spec0
        ),
    )
    if _name != "logsumexp":
        add(
            _name,
            case("everything", lambda x, _n=_name: each(_n, x), x=_spec),
            case("0-d everything", lambda x, _n=_name: each(_n, x), x=_spec0),
        )
for _name in ("sum", "mean", "amax", "amin", "logsumexp", "all", "any"):
    _spec = X(RANKS2, **BOOL) if _name in ("all", "any") else X(RANKS2)
    add(
        _name,
        case(
            "tuple dims",
            lambda x, _n=_name: each(_n, x, (0, -1)) + each(_n, x, dim=[-1, 0], keepdim=True),
            x=_spec,
        ),
    )
for _name in ("sum", "mean", "prod"):
    add(
        _name,
        case(
            "dtype",
            lambda x, _n=_name: (
                each(_n, x, dtype=torch.float64) + each(_n, x, -1, dtype=torch.float64)
            ),
            x=X(RANKS1),
        ),
    )
add(
    "sum",
    case("long", lambda x: (x.sum(), x.sum(-1), torch.sum(x, 0, True)), x=X(RANKS1, **LONG)),
    case("keepdim everything", lambda x: torch.sum(x, dim=None, keepdim=True), x=X(RANKS1)),
    case(
        "empty dims: everything",  # (was an IndexError inside the batched rule)
        lambda x: (x.sum(dim=()), torch.sum(x, (), keepdim=True), x.mean(dim=[])),
        x=X(RANKS1),
    ),
)
add(
    "max",
    case(
        "values indices",
        lambda x: (x.max(-1).values, x.max(dim=0)[1], *torch.max(x, 0, keepdim=True)),
        x=X(RANKS1),
    ),
    case("binary", lambda x, y: (torch.max(x, y), x.max(y)), x=X(BCAST), y=X(BCAST)),
)
add(
    "min",
    case("values indices", lambda x: (x.min(-1).indices, x.min(dim=0)[0]), x=X(RANKS1)),
    case("binary", lambda x, w: torch.min(x, w), x=X(BCAST), w=W(BCAST)),
)
add("argmax", case("long ties", lambda x: (x.argmax(), x.argmax(-1)), x=X(RANKS1, **LONG)))

for _name in ("softmax", "log_softmax"):
    add(
        _name,
        case("dims", lambda x, _n=_name: each(_n, x, 0) + each(_n, x, -1), x=X(RANKS1)),
        case(
            "kwargs",
            lambda x, _n=_name: (
                getattr(F, _n)(x, dim=-1, dtype=torch.float64),
                getattr(torch, _n)(x, 0, dtype=torch.float64),
                getattr(x, _n)(dim=x.ndim - 1),
            ),
            x=X(RANKS1),
        ),
        case("0-d", lambda x, _n=_name: each(_n, x, 0) + each(_n, x, -1), x=X("")),
        case("implicit dim", lambda x, _n=_name: _implicit_softmax(_n, x), x=X(RANKS)),
    )


def _implicit_softmax(name, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Implicit dimension choice ..."
        return getattr(F, name)(x)


for _tx, _ty, _tz in (("a", "d", "d"), ("a b", "d b", "a d"), ("a b c", "d b c", "a b d")):
    add(
        "cat",
        case(
            f"aliases {_tx}",
            lambda x, y: each("cat", [x, y], 0) + (torch.cat((y, x, y)),),
            x=X(_tx),
            y=X(_ty),
        ),
        case(
            f"last dim {_tx}",
            lambda x, z: (
                torch.cat([x, z], -1),
                torch.cat((z, x), dim=-1),
                torch.cat(tensors=[x, z, x], dim=x.ndim - 1),
            ),
            x=X(_tx),
            z=X(_tz),
        ),
    )
add(
    "cat",
    case(
        "shared parts",
        lambda x, w: (torch.cat([x, w], -1), torch.cat([w, x, w])),
        x=X("b c"),
        w=W("b c"),
    ),
    case(
        "one part, mixed dtypes",
        lambda x, y: (torch.cat([x]), torch.cat([x, y])),
        x=X("a b"),
        y=X("c b", **LONG),
    ),
)
for _t in RANKS:
    add(
        "stack",
        case(
            f"dims {_t!r}",
            lambda x, y: (
                torch.stack([x, y]),
                torch.stack((x, y), -1),
                torch.stack([y, x, y], dim=x.ndim // 2),
                torch.stack(tensors=[x, y], dim=-1),
            ),
            x=X(_t),
            y=X(_t),
        ),
    )
add(
    "stack",
    case(
        "shared parts",
        lambda x, w: (torch.stack([x, w]), torch.stack([w, x], 1)),
        x=X("b c"),
        w=W("b c"),
    ),
    case("one part", lambda x: torch.stack([x]), x=X(RANKS)),
)
add(
    "chunk",
    case("aliases", lambda x: each("chunk", x, 2) + each("chunk", x, 3, -1), x=X(RANKS1)),
    case("kwargs", lambda x: torch.chunk(x, chunks=2, dim=x.ndim - 1), x=X(RANKS1)),
)
add(
    "split",
    case("aliases", lambda x: each("split", x, 2) + each("split", x, 1, -1), x=X(RANKS1)),
    case(
        "sections",
        lambda x: torch.split(x, [x.shape[-1] - 1, 1], dim=-1) + x.split([1, x.shape[0] - 1]),
        x=X(RANKS1),
    ),
    case(
        "kwargs",
        lambda x: (torch.split(x, split_size_or_sections=2, dim=-1), x.split(split_size=1)),
        x=X(RANKS1),
    ),
)
add(
    "unbind",
    case("aliases", lambda x: each("unbind", x) + each("unbind", x, -1), x=X(RANKS1)),
    case("iteration", lambda x: (list(x), tuple(r * 2 for r in x), len(x)), x=X(RANKS1)),
    case("unpack", lambda x: (lambda a, b: a - b)(*x), x=X(("2", "2 b"))),
)
add(
    "narrow",
    case(
        "aliases",
        lambda x: (
            each("narrow", x, 0, x.shape[0] // 2, (x.shape[0] + 1) // 2)
            + each("narrow", x, -1, 0, 1)
        ),
        x=X(RANKS1),
    ),
)
add(
    "select",
    case("aliases", lambda x: each("select", x, 0, -1) + each("select", x, -1, 0), x=X(RANKS1)),
    case("kwargs", lambda x: torch.select(x, dim=x.ndim - 1, index=x.shape[-1] // 2), x=X(RANKS1)),
)
add(
    "transpose",
    case("aliases", lambda x: each("transpose", x, 0, -1), x=X(RANKS1)),
    case("mT", lambda x: (x.mT, torch.transpose(x, -2, -1), x.transpose(1, 0)), x=X(RANKS2)),
)
add(
    "t",
    case("aliases", lambda x: each("t", x), x=X(("", "c", "b c"))),
    case("T", lambda x: (x.T, x.T.T), x=X(("", "c", "b c"))),
)
add(
    "permute",
    case(
        "aliases",
        lambda x: each("permute", x, (2, 0, 1)) + (x.permute(-1, 0, 1), x.permute([1, 2, 0])),
        x=X("a b c"),
    ),
    case("T of 3-d", lambda x: _T3(x), x=X("a b c")),
    case(
        "identity",
        lambda x: (x.permute(tuple(range(x.ndim))), torch.permute(x, tuple(range(x.ndim)))),
        x=X(("", "b c")),
    ),
)


def _T3(x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # x.T on 3-d is deprecated in torch
        return x.T


# matmul: every combination of per-instance/shared operands of ranks 1..3
_MATMUL_FORMS = [f for f in aliases("matmul") if f.__name__ in ("matmul", "__matmul__")]
_LEFT = {1: "k", 2: "m k", 3: "b m k"}
_RIGHT = {1: "k", 2: "k p", 3: "b k p"}
for _ra in (1, 2, 3):
    for _rb in (1, 2, 3):
        for _mode, (_fa, _fb) in {
            "lazy@lazy": (X, X),
            "lazy@shared": (X, W),
            "shared@lazy": (W, X),
        }.items():
            add(
                "matmul",
                case(
                    f"{_mode} {_ra}d@{_rb}d",
                    lambda a, b: tuple(call(f, a, b) for f in _MATMUL_FORMS),
                    a=_fa(_LEFT[_ra]),
                    b=_fb(_RIGHT[_rb]),
                ),
            )
add(
    "matmul",
    case("broadcast batch", lambda a, b: (a @ b, b.mT @ a.mT), a=X("1 m k"), b=X("b k p")),
    case(
        "mm",
        lambda a, b, w: (torch.mm(a, b), a.mm(w), torch.mm(w.t(), a.t())),
        a=X("m k"),
        b=X("k p"),
        w=W("k p"),
    ),
    case(
        "bmm",
        lambda a, b, w: (torch.bmm(a, b), a.bmm(w), w.transpose(1, 2).bmm(a.mT)),
        a=X("b m k"),
        b=X("b k p"),
        w=W("b k p"),
    ),
    case(
        "mv",
        lambda a, v, w, m: (torch.mv(a, v), a.mv(w), m.mv(v), torch.mv(m, v)),
        a=X("m k"),
        v=X("k"),
        w=W("k"),
        m=W("p k"),
    ),
    case(
        "dot",
        lambda x, y, w: (torch.dot(x, y), x.dot(w), w.dot(x), torch.dot(w, y)),
        x=X("k"),
        y=X("k"),
        w=W("k"),
    ),
)

add(
    "linear",
    case(
        "F.linear",
        lambda x, w, b: (
            F.linear(x, w, b),
            F.linear(x, w),
            F.linear(x, w, bias=b),
            F.linear(input=x, weight=w),
        ),
        x=X(("k", "m k", "b m k")),
        w=W("p k"),
        b=W("p"),
    ),
    case(
        "nn.Linear",
        lambda x, lin: lin(x),
        x=X(("k", "m k")),
        lin=Module(lambda d: nn.Linear(d["k"], d["p"]), uses="k p"),
    ),
    case(
        "lazy weight and bias",
        lambda x, y, b: (F.linear(x, y), F.linear(y, y, b)),
        x=X(("k", "m k")),
        y=X("p k"),
        b=X("p"),
    ),
    case("shared input", lambda w, y: F.linear(w, y), w=W("m k"), y=X("p k")),
)
add(
    "addmm",
    case(
        "addmm",
        lambda x, w, b: (torch.addmm(b, x, w), b.addmm(x, w, beta=0.5, alpha=2)),
        x=X("m k"),
        w=W("k p"),
        b=W("p"),
    ),
    case("lazy bias", lambda x, y, b: torch.addmm(b, x, y), x=X("m k"), y=X("k p"), b=X("m p")),
    case(
        "baddbmm",
        lambda x, y, b: (torch.baddbmm(b, x, y), torch.baddbmm(b, x, x.mT, beta=0)),
        x=X("b m k"),
        y=X("b k m"),
        b=W("m"),
    ),
    case(
        "einsum",
        lambda x, y, w: (
            torch.einsum("ij,j->i", w, x),
            torch.einsum("i,i->", x, y),
            torch.einsum("i,j->ij", [x, y]),
        ),
        x=X("k"),
        y=X("k"),
        w=W("p k"),
    ),
    case(
        "bilinear",
        lambda x, y, w, b: (F.bilinear(x, y, w, b), F.bilinear(x, y, w)),
        x=X("m i"),
        y=X("m j"),
        w=W("o i j"),
        b=W("o"),
    ),
)
add(
    "embedding",
    case(
        "F.embedding",
        lambda i, w: (F.embedding(i, w), F.embedding(i, w, padding_idx=0)),
        i=X(RANKS, dtype=torch.long, lo=0, hi="v"),
        w=W("v d"),
    ),
    case(
        "nn.Embedding",
        lambda i, emb: torch.tanh(emb(i)),
        i=X(RANKS, dtype=torch.long, lo=0, hi="v"),
        emb=Module(lambda d: nn.Embedding(d["v"], 3), uses="v"),
    ),
    case(
        "lazy table",
        lambda i, w: F.embedding(i, w),
        i=W("c", dtype=torch.long, lo=0, hi="v"),
        w=X("v d"),
    ),
)
add(
    "index_select",
    case(
        "index_select",
        lambda x, i: (torch.index_select(x, 0, i), x.index_select(-1, i)),
        x=X("a a"),
        i=X(("", "c"), dtype=torch.long, lo=0, hi="a"),
    ),
    case(
        "shared source",
        lambda w, i: torch.index_select(w, 0, i),
        w=W("a b"),
        i=X(("", "c"), dtype=torch.long, lo=0, hi="a"),
    ),
    case(
        "shared index",
        lambda x, i: x.index_select(1, i),
        x=X("b a"),
        i=W("c", dtype=torch.long, lo=0, hi="a"),
    ),
    case(
        "gather",
        lambda x, i: (torch.gather(x, 1, i), x.gather(-1, i)),
        x=X("a b"),
        i=X("a c", dtype=torch.long, lo=0, hi="b"),
    ),
)
add(
    "layer_norm",
    case(
        "F.layer_norm",
        lambda x, w, b: (
            F.layer_norm(x, (x.shape[-1],), w, b),
            F.layer_norm(x, x.shape[-1:], eps=1e-3),
            F.layer_norm(x, x.shape[-1:], bias=b),
        ),
        x=X(RANKS1),
        w=W("c"),
        b=W("c"),
    ),
    case(
        "nn.LayerNorm",
        lambda x, ln: ln(x),
        x=X(("c", "a c")),
        ln=Module(lambda d: nn.LayerNorm(d["c"]), uses="c"),
    ),
    case("two dims, no affine", lambda x: F.layer_norm(x, x.shape[-2:]), x=X(RANKS2)),
    case("lazy weight", lambda x, w: F.layer_norm(x, w.shape, w), x=X("a c"), w=X("c")),
)


def _cells(kind):
    def build(d):
        if kind == "lstm":
            return nn.LSTMCell(d["i"], d["h"])
        if kind == "gru":
            return nn.GRUCell(d["i"], d["h"])
        return nn.RNNCell(d["i"], d["h"], nonlinearity=kind)

    return Module(build, uses="i h")


add(
    "rnn_cell",
    case(
        "nn.LSTMCell 1-d",
        lambda x, h, c, cell: cell(x, (h, c)),
        x=X("i"),
        h=X("h"),
        c=X("h"),
        cell=_cells("lstm"),
    ),
    case(
        "nn.LSTMCell 2-d",
        lambda x, h, c, cell: cell(x, (h, c)),
        x=X("m i"),
        h=X("m h"),
        c=X("m h"),
        cell=_cells("lstm"),
    ),
    case("nn.GRUCell 1-d", lambda x, h, cell: cell(x, h), x=X("i"), h=X("h"), cell=_cells("gru")),
    case(
        "nn.GRUCell 2-d", lambda x, h, cell: cell(x, h), x=X("m i"), h=X("m h"), cell=_cells("gru")
    ),
    case(
        "nn.RNNCell tanh",
        lambda x, h, cell: cell(x, h),
        x=X("m i"),
        h=X("m h"),
        cell=_cells("tanh"),
    ),
    case("nn.RNNCell relu", lambda x, h, cell: cell(x, h), x=X("i"), h=X("h"), cell=_cells("relu")),
    case(
        "zero state",
        lambda x, lstm, gru: (lstm(x), gru(x)),
        x=X("i"),
        lstm=_cells("lstm"),
        gru=_cells("gru"),
    ),
    case("chained", lambda x, cell: cell(x, cell(x, None)), x=X("i"), cell=_cells("gru")),
    case(
        "torch functions",
        lambda x, h, c, lstm, rnn: (
            torch.lstm_cell(x, (h, c), lstm.weight_ih, lstm.weight_hh),
            torch.rnn_tanh_cell(x, h, rnn.weight_ih, rnn.weight_hh, rnn.bias_ih, rnn.bias_hh),
        ),
        x=X("m i"),
        h=X("m h"),
        c=X("m h"),
        lstm=_cells("lstm"),
        rnn=_cells("tanh"),
    ),
)

add(
    "getitem",
    case(
        "basic",
        computed(
            lambda x: (
                x[0],
                x[-1],
                x[1:],
                x[::2],
                x[None],
                x[..., 0],
                x[0, ..., None],
                x[-1:, None],
                x[:, 1:],
                x[:, -1],
                x[..., None, :1],
            )
        ),
        x=X(RANKS2),
    ),
    case(
        "1-d",
        computed(lambda x: (x[0], x[-1], x[1:], x[:-1], x[None], x[...], x[..., None])),
        x=X("c"),
    ),
    case("0-d", computed(lambda x: (x[None], x[...], x[()], x[None, None])), x=X("")),
    case(  # parts of a per-instance argument are inputs of their own (ops._special_getitem)
        "of an input",
        lambda x: (x[0], x[-1], x[1:], x[..., 0], x[:, None, -1:]),
        x=X(RANKS2),
        recorded=False,
    ),
    case("list", lambda x: (x[[0, -1]], x[:, [0, 0]], x[0, [0, -1]], x[[-1, 0], 0]), x=X(RANKS2)),
    case("non-adjacent lists", lambda x: (x[[0, -1], :, [0, 0]], x[[0], 1:, 0]), x=X("a b c")),
    case(
        "shared index tensor",
        lambda x, i: (x[i], x[:, i], x[i, 0]),
        x=X("a a"),
        i=W(("c", "b c"), dtype=torch.long, lo=0, hi="a"),
    ),
    case(
        "lazy index into shared",
        lambda w, i: (w[i], w[i] * 2),
        w=W("v d"),
        i=X(RANKS1, dtype=torch.long, lo=0, hi="v"),
    ),
    case(
        "lazy index into lazy",
        lambda x, i: x[i],
        x=X(("a", "a d")),
        i=X(RANKS1, dtype=torch.long, lo=0, hi="a"),
    ),
    case(
        "lazy index in a tuple",
        lambda x, i: (x[i, :], x[:, i]),
        x=X("a a"),
        i=X("c", dtype=torch.long, lo=0, hi="a"),
    ),
    case(
        "0-d index tensors",
        lambda x, w, i, j: (x[i], w[i], x[j], w[j], x[:, i]),
        x=X("a a"),
        w=W("a d"),
        i=X("", dtype=torch.long, lo=0, hi="a"),
        j=W("", dtype=torch.long, lo=0, hi="a"),
    ),
    case(
        "negative lazy index",
        lambda x, i: x[i - x.shape[0]],
        x=X("a"),
        i=X("c", dtype=torch.long, lo=0, hi="a"),
    ),
    case(
        "shared bool mask",
        lambda x, m: (x[m], x[:, m[0:1].squeeze(0)]),
        x=X("a a"),
        m=W("a a", **BOOL),
    ),
)


# rows a b, a value of b, an int below a read from a per-instance value
_PUT_ARGS = {"x": X("a b"), "v": X("b"), "i": X("", dtype=torch.long, lo=0, hi="a")}


def _put_chain(x, v, i):
    y = put(x * 1, 0, v)  # a put's result nothing else read: the next writes into it
    y = put(y, -1 - int(i), v * 2)
    return put(y, (slice(1, None), Ellipsis), 0.5)


add(
    "put",
    case(  # x[i] = v recorded out of place (analysis rewrites a local's writes to it)
        "ints, slices, ..., values",
        lambda x, v, i: (
            put(x * 1, int(i), v),
            put(x * 1, (slice(None), 0), 2.5),
            put(x * 1, (Ellipsis, -1), v[0]),
            put(x * 1, (int(i), slice(0, 1)), v[:1]),
        ),
        sized=True,
        **_PUT_ARGS,
    ),
    case(
        "into a shared tensor",
        lambda w, v, i: (
            put(w.clone(), int(i), v),  # (eager writes into the clone: w stays as it is)
            put(w.clone(), (int(i), slice(None)), v[None]),
        ),
        w=W("a b"),
        sized=True,
        **{k: a for k, a in _PUT_ARGS.items() if k != "x"},
    ),
    case("a boolean mask", lambda x: put(x * 1, x > 0, -1.0), x=X(RANKS1)),
)
add(
    "put_into",
    case("a chain of writes", _put_chain, sized=True, **_PUT_ARGS),
)


add(
    "pick",
    case(  # x[i] with a Python int per instance, read from a value (config.INT_PICKS)
        "per-instance ints",
        lambda x, i: ((x * 1)[int(i)], (x * 2)[-1 - int(i)], (x * 3)[0]),
        x=X(("a", "a c", "a b c")),
        i=X("", dtype=torch.long, lo=0, hi="a"),
        sized=True,
    ),
)


# operands by keyword (torch.sum(input=x, dim=0)): no rule may assume they are positional
_KEYWORDS = {
    "sum": lambda x, w: torch.sum(input=x, dim=0),
    "mean": lambda x, w: torch.mean(dim=-1, keepdim=True, input=x),
    "prod": lambda x, w: torch.prod(input=x, dim=1),
    "max": lambda x, w: tuple(torch.max(input=x, dim=0)),
    "argmax": lambda x, w: torch.argmax(input=x, dim=1),
    "logsumexp": lambda x, w: torch.logsumexp(input=x, dim=1),
    "all": lambda x, w: torch.all(input=x > 0, dim=1),
    "softmax": lambda x, w: torch.softmax(input=x, dim=0),
    "log_softmax": lambda x, w: torch.log_softmax(input=x, dim=1),
    "reshape": lambda x, w: torch.reshape(input=x, shape=(-1,)),
    "flatten": lambda x, w: torch.flatten(input=x),
    "squeeze": lambda x, w: torch.squeeze(input=x[None], dim=0),
    "unsqueeze": lambda x, w: torch.unsqueeze(input=x, dim=0),
    "chunk": lambda x, w: torch.chunk(input=x, chunks=2, dim=1),
    "split": lambda x, w: torch.split(tensor=x, split_size_or_sections=1, dim=1),
    "unbind": lambda x, w: torch.unbind(input=x, dim=1),
    "narrow": lambda x, w: torch.narrow(input=x, dim=1, start=0, length=1),
    "select": lambda x, w: torch.select(input=x, dim=1, index=0),
    "transpose": lambda x, w: torch.transpose(input=x, dim0=0, dim1=1),
    "t": lambda x, w: torch.t(input=x),
    "permute": lambda x, w: torch.permute(input=x, dims=(1, 0)),
    "matmul": lambda x, w: (torch.matmul(input=x, other=w), torch.matmul(other=x.t(), input=x)),
    "linear": lambda x, w: F.linear(input=x, weight=w.t()),
    "addmm": lambda x, w: torch.addmm(input=x @ w, mat1=x, mat2=w),
    "add": lambda x, w: torch.add(input=x, other=w.t()),
    "tanh": lambda x, w: torch.tanh(input=x),
    "pow": lambda x, w: torch.pow(input=x, exponent=2),
    "clamp": lambda x, w: torch.clamp(input=x, min=w.t()),
    "where": lambda x, w: torch.where(condition=x > 0, input=x, other=w.t()),
    "masked_fill": lambda x, w: torch.masked_fill(input=x, mask=x > 0, value=x[0, 0]),
    "lerp": lambda x, w: torch.lerp(input=x, end=w.t(), weight=0.5),
    "cat": lambda x, w: torch.cat(tensors=[x, w.t()], dim=1),
    "stack": lambda x, w: torch.stack(tensors=[x, w.t()]),
    "index_select": lambda x, w: torch.index_select(input=x, dim=1, index=torch.tensor([0])),
    "gather": lambda x, w: torch.gather(input=x, dim=1, index=torch.zeros_like(x).long()),
    "layer_norm": lambda x, w: F.layer_norm(input=x, normalized_shape=x.shape[-1:]),
    "embedding": lambda x, w: F.embedding(input=torch.tensor([0, 0]), weight=x),
    "rnn_cell": lambda x, w: torch.rnn_tanh_cell(input=x, hx=x @ w, w_ih=w.t(), w_hh=w.t() @ w),
    "to": lambda x, w: x.to(dtype=torch.float64),
    "expand": lambda x, w: x.expand(size=(2, *x.shape)),
}
for _name, _fn in _KEYWORDS.items():
    add(
        "index_select" if _name == "gather" else _name,
        case(f"keywords {_name}", _fn, x=X("b c"), w=W("c b")),
    )


# rows batched by the vmap fallback
add("repeat", case("sizes", lambda x: (x.repeat(2, 1), x.repeat(1, 1, 3)), x=X(("c", "b c"))))
add("tile", case("reps", lambda x: (torch.tile(x, (2,)), x.tile(1, 2)), x=X(RANKS1)))
add("flip", case("dims", lambda x: (torch.flip(x, (0,)), x.flip(-1)), x=X(RANKS1)))
add(
    "roll",
    case("shifts", lambda x: (torch.roll(x, 1, 0), x.roll(-2, -1), torch.roll(x, 3)), x=X(RANKS1)),
)
add("tril", case("diagonal", lambda x: (torch.tril(x), x.tril(-1)), x=X(("b c", "a b c"))))
add("triu", case("diagonal", lambda x: (torch.triu(x, 1), x.triu()), x=X(("b c", "a b c"))))
add("cumsum", case("dims", lambda x: (torch.cumsum(x, 0), x.cumsum(-1)), x=X(RANKS1)))
add("cumprod", case("dims", lambda x: (torch.cumprod(x, 0), x.cumprod(dim=-1)), x=X(RANKS1, **POS)))
add(
    "outer",
    case(
        "lazy and shared",
        lambda x, y, w: (torch.outer(x, y), x.outer(w)),
        x=X("b"),
        y=X("c"),
        w=W("c"),
    ),
)
add(
    "norm",
    case(
        "p and dims",
        lambda x: (
            torch.norm(x),
            x.norm(dim=-1),
            x.norm(p=1, dim=0),
            torch.linalg.vector_norm(x, ord=2, dim=-1),
        ),
        x=X(RANKS1),
    ),
)
add(
    "normalize",
    case("dims", lambda x: (F.normalize(x, dim=-1), F.normalize(x, p=1, dim=0)), x=X(RANKS1)),
)
add(
    "cosine_similarity",
    case(
        "lazy and shared",
        lambda x, y, w: (F.cosine_similarity(x, y, dim=-1), torch.cosine_similarity(x, w, dim=-1)),
        x=X("b c"),
        y=X("b c"),
        w=W("c"),
    ),
)
add(
    "hardtanh",
    case("bounds", lambda x: (F.hardtanh(x), F.hardtanh(x, -0.5, 0.5), F.relu6(x * 4)), x=X(RANKS)),
)
add(
    "selu",
    case(
        "aliases", lambda x: (torch.selu(x), F.selu(x), F.celu(x, 0.5), torch.celu(x)), x=X(RANKS)
    ),
)
add(
    "mish",
    case(
        "aliases",
        lambda x: (F.mish(x), F.hardswish(x), F.hardsigmoid(x), F.softsign(x)),
        x=X(RANKS),
    ),
)

add(
    "topk",
    case(
        "k and dims",
        lambda x: (plain(torch.topk(x, 2)), plain(x.topk(1, dim=0, largest=False))),
        x=X(("3", "b 3")),
    ),
)
add(
    "sort",
    case(
        "values and orders",
        lambda x: (
            plain(torch.sort(x)),
            plain(x.sort(dim=0, descending=True)),
            torch.argsort(x, dim=-1),
            x.argsort(descending=True),
        ),
        x=X(RANKS1),
    ),
)
add(
    "kthvalue",
    case(
        "k-th and median",
        lambda x: (
            plain(torch.kthvalue(x, 1)),
            plain(x.kthvalue(1, dim=0)),
            torch.median(x),
            plain(x.median(dim=-1)),
        ),
        x=X(RANKS1),
    ),
)
add(
    "std",
    case(
        "spreads",
        lambda x: (
            torch.std(x),
            x.std(dim=-1, unbiased=False),
            torch.var(x, -2),
            x.var(dim=-1, correction=0, keepdim=True),
        ),
        x=X(("2 3", "b 2 3")),
    ),
)
add(
    "diag",
    case(
        "matrix and vector",
        lambda x, v: (torch.diag(x), x.diag(1), torch.diag(v), torch.trace(x), x.trace()),
        x=X("b c"),
        v=X("c"),
    ),
)
add(
    "diagonal",
    case(
        "offsets",
        lambda x: (torch.diagonal(x), x.diagonal(offset=1, dim1=-2, dim2=-1)),
        x=X(("b c", "a b c")),
    ),
)
add(
    "pad",
    case("sides and value", lambda x: (F.pad(x, (1, 2)), F.pad(x, (0, 1), value=3.0)), x=X(RANKS1)),
)
add(
    "one_hot",
    case(
        "classes",
        lambda i: (F.one_hot(i, 5), F.one_hot(i, num_classes=6) * 2),
        i=X(RANKS, dtype=torch.long, lo=0, hi=5),
    ),
)
add(
    "scatter",
    case(
        "scatters and index_add",
        lambda x, s, i, j: (
            torch.scatter(x, 1, i, 2.0),
            x.scatter(1, i, -1.0),
            torch.scatter_add(x, 1, i, s),
            x.scatter_add(1, i, s),
            x.index_add(1, i[0], s),
            torch.index_add(x, 0, j, s),
        ),
        x=X("b c"),
        s=X("b c"),
        i=X("b c", dtype=torch.long, lo=0, hi="c"),
        j=X("b", dtype=torch.long, lo=0, hi="b"),
    ),
)
add(
    "loss",
    case(
        "per-instance losses",
        lambda x, t, y, p, q: (
            F.cross_entropy(x, t),
            F.cross_entropy(x, t, reduction="none", label_smoothing=0.1),
            F.nll_loss(F.log_softmax(x, -1), t),
            F.mse_loss(x, y),
            F.l1_loss(x, y, reduction="sum"),
            F.smooth_l1_loss(x, y),
            F.huber_loss(x, y, delta=0.5),
            F.binary_cross_entropy(p, q),
            F.binary_cross_entropy_with_logits(x, q),
            F.kl_div(F.log_softmax(x, -1), q, reduction="batchmean"),
        ),
        x=X("b c"),
        t=X("b", dtype=torch.long, lo=0, hi="c"),
        y=X("b c"),
        p=X("b c", lo=0.05, hi=0.95),
        q=X("b c", lo=0.0, hi=1.0),
    ),
    case(
        "shared weights",
        lambda x, t, w: F.cross_entropy(x, t, weight=w),
        x=X("b c"),
        t=X("b", dtype=torch.long, lo=0, hi="c"),
        w=W("c", lo=0.5, hi=2.0),
    ),
)

add(
    "diff",
    case(
        "orders, dims, prepend and append",
        lambda x, p: (
            torch.diff(x),
            x.diff(n=2, dim=0),
            torch.diff(x, dim=0, prepend=p[None], append=x[:1]),
        ),
        x=X("3 b"),
        p=X("b"),
    ),
)
add(
    "conv",
    case(
        "1-d and 2-d, unbatched and batched",
        lambda x, m, w: (
            F.conv1d(x, w, padding=1),
            m(x),
            F.conv2d(x.unsqueeze(1), w.unsqueeze(-1)),
        ),
        x=X("2 b"),
        m=Module(lambda d: nn.Conv1d(2, 3, 1)),
        w=W("2 2 1"),
    ),
    case(
        "keywords, groups, padding, bias, a batch of its own",
        lambda x, w, b: (
            F.conv1d(input=x, weight=w, bias=b, padding="same", groups=2),
            F.conv1d(x[None].expand(3, 2, x.shape[1]), w, b, 1, 1, 1, 2),
            F.conv2d(x[None, None], w[:1, :1, None], stride=(1, 2), padding=(0, 1)),
        ),
        x=X("2 b"),
        w=W("2 1 3"),
        b=W("2"),
    ),
    case(
        "per-instance weights and bias (a hypernetwork's)",
        lambda x, v: (
            F.conv1d(x, v[:, :, None], padding=1),
            F.conv1d(x, v.T[:, :, None].contiguous(), bias=v[0], padding=1),
        ),
        x=X("2 b"),
        v=X("2 2"),
    ),
)
add(
    "pool",
    case(
        "max, average, adaptive",
        lambda x: (
            F.max_pool1d(x, 2),
            plain(F.max_pool1d(x, 2, return_indices=True)),
            F.max_pool2d(x.unsqueeze(0), 1),
            F.avg_pool1d(x, 1),
            F.avg_pool2d(x.unsqueeze(0), 1),
            F.adaptive_avg_pool1d(x, 1),
            F.adaptive_avg_pool2d(x.unsqueeze(0), 1),
            F.adaptive_max_pool1d(x, 1),
            plain(F.max_pool2d(x.unsqueeze(0), 1, return_indices=True)),
            plain(F.adaptive_max_pool1d(x, 2, return_indices=True)),
            # unbatched inputs (ops.pool_rule: the rows are the batch; above, each
            # instance a batch of its own, flattened into the rows)
            F.max_pool1d(x[0], 2),
            plain(F.adaptive_max_pool1d(x[0], 1, return_indices=True)),
            F.avg_pool2d(x, 2, ceil_mode=True),
        ),
        x=X("b 2 4"),
    ),
)
add(
    "embedding_bag",
    case(
        "modes, weights, padding_idx",
        lambda i, w, p: (
            F.embedding_bag(i, w, mode="mean"),
            F.embedding_bag(i, w, mode="sum", per_sample_weights=p),
            F.embedding_bag(i, w, mode="max"),
            F.embedding_bag(i, w, padding_idx=0),
        ),
        i=X("b c", dtype=torch.long, lo=0, hi="v"),
        w=W("v d"),
        p=X("b c"),
    ),
    case(
        "nn.EmbeddingBag on ids[None]",
        lambda i, bag: torch.tanh(bag(i[None])),
        i=X("c", dtype=torch.long, lo=0, hi="v"),
        bag=Module(lambda d: nn.EmbeddingBag(d["v"], 3), uses="v"),
    ),
)
add(
    "interpolate",
    case(
        "linear, nearest, bilinear",
        lambda x: (
            F.interpolate(x, scale_factor=2, mode="linear"),
            F.interpolate(x, size=5, mode="nearest"),
            F.interpolate(x.unsqueeze(0), scale_factor=(1, 2), mode="bilinear"),
            F.interpolate(x * 2, size=3, mode="linear", align_corners=True),
        ),
        x=X("b 2 4"),
    ),
)
add(
    "prelu",
    case("prelu and glu", lambda x, w: (F.prelu(x, w), F.glu(x * 1, -1)), x=X("b 2"), w=W("1")),
)
add(
    "pairwise_distance",
    case(
        "lazy and shared",
        lambda x, y, w: (F.pairwise_distance(x, y), F.pairwise_distance(x, w)),
        x=X("b c"),
        y=X("b c"),
        w=W("c"),
    ),
)
add(
    "batch_norm",
    case(
        "fixed statistics (eval mode) and the instance's own",
        lambda x, m, v, w: (
            F.batch_norm(x, m, v.abs() + 0.5, w, w, False, 0.1, 1e-5),
            F.batch_norm(x, None, None, w, None, training=True),
        ),
        x=X("3 c"),
        m=W("c"),
        v=W("c"),
        w=W("c"),
    ),
)
add(
    "group_norm",
    case(
        "group and instance norm",
        lambda x, w: (
            F.group_norm(x.unsqueeze(0), 1, w, w),
            F.instance_norm(x.unsqueeze(0)),
            F.instance_norm(x.unsqueeze(0), w.abs() * 0, w.abs() + 1, use_input_stats=False),
        ),
        x=X("c 3"),
        w=W("c"),
    ),
)
add(
    "repeat_interleave",
    case(
        "a number and the instance's known repeats",
        lambda x: (
            torch.repeat_interleave(x, 2),
            x.repeat_interleave(2, dim=0),
            x.repeat_interleave(torch.tensor([1, 2, 0]), dim=-1),
        ),
        x=X("b 3"),
    ),
)
add(
    "float_power",
    case(
        "float64 powers",
        lambda x, y: (torch.float_power(x, 2), x.float_power(y)),
        x=X(RANKS, **POS),
        y=X(RANKS),
    ),
)
add(
    "movedim",
    case(
        "and moveaxis",
        lambda x: (
            torch.movedim(x, 0, -1),
            x.movedim(-1, 0),
            torch.moveaxis(x, 1, 0),
            x.moveaxis(0, 1),
        ),
        x=X(RANKS2),
    ),
)
add(
    "cdist",
    case("lazy and shared", lambda x, y, w: (torch.cdist(x, y), torch.cdist(x, w)),
         x=X("b c"), y=X("a c"), w=W("a c")),
)  # fmt: skip
add(
    "isclose",
    case("elementwise", lambda x, y: (torch.isclose(x, y), x.isclose(x * 1.0000001)),
         x=X(BCAST), y=X(BCAST)),
)  # fmt: skip
add(
    "cummax",
    case(
        "and cummin",
        lambda x: (
            plain(torch.cummax(x, 0)),
            plain(x.cummax(-1)),
            plain(torch.cummin(x, 0)),
            plain(x.cummin(-1)),
        ),
        x=X(RANKS1),
    ),
)
add(
    "equal",
    case(
        "equal and allclose, read as Python bools",
        lambda x, y: (
            torch.equal(x, y),
            x.equal(x * 1),
            torch.allclose(x, y, atol=0.5),
            x.allclose(x + 1e-9),
        ),
        recorded=False,
        sized=True,
        x=X(RANKS1),
        y=X(RANKS1),
    ),
)
# sizes set by values: read, computed as eager computes them, re-entered as instance data
add(
    "nonzero",
    case(
        "positions",
        lambda x: (
            torch.nonzero(x > 0),
            (x > 0).nonzero(),
            torch.argwhere(x < 0),
            (x < 0).argwhere(),
            torch.nonzero(x > 0, as_tuple=True),
        ),
        recorded=False,
        sized=True,
        x=X(RANKS1),
    ),
)
add(
    "unique",
    case(
        "values, inverse and counts",
        lambda x: (
            torch.unique(x.round()),
            x.round().unique(return_counts=True),
            torch.unique_consecutive(x.round()),
            x.round().unique_consecutive(return_inverse=True),
        ),
        recorded=False,
        sized=True,
        x=X(RANKS1),
    ),
)
add(
    "bincount",
    case(
        "counts and shared weights",
        lambda i, w: (
            torch.bincount(i.abs()),
            i.abs().bincount(minlength=5),
            torch.bincount(i.abs(), weights=w),
        ),
        recorded=False,
        sized=True,
        i=X("c", **LONG),
        w=W("c"),
    ),
)
add(
    "masked_select",
    case(
        "by a per-instance mask, and boolean indexing",
        lambda x, y: (
            torch.masked_select(x, y > 0),
            x.masked_select(x > 0) * 2,
            x[x > 0] + 1,
            y[y.sum(-1) > 0] if y.dim() > 1 else y[y > 0],
        ),
        recorded=False,
        sized=True,
        x=X(RANKS1),
        y=X(RANKS1),
    ),
)
add(
    "attention",
    case(
        "scaled dot product",
        lambda q, k: F.scaled_dot_product_attention(q, k, k),
        q=X("b c"),
        k=X("a c"),
    ),
    case(
        "multi-head attention, with and without weights",
        lambda x, m: (plain(m(x, x, x)), m(x, x, x, need_weights=False)[0]),
        x=X("b 4"),
        m=Module(lambda d: nn.MultiheadAttention(4, 2).eval()),
    ),
)


# sequence modules: one packed call over sequences of any length (recorded outside blocks);
# inside a block's trace (test_op_inside_a_block) the same calls are sequence_batch
_SEQUENCE_CASES = [
    case(
        "lstm unbatched",
        lambda x, m: m(x),
        x=X("a b"),
        m=Module(lambda d: nn.LSTM(d["b"], 3), uses="b"),
    ),
    case(
        "bidirectional gru, batch of one",
        lambda x, m: m(x.unsqueeze(0)),
        x=X("a b"),
        m=Module(
            lambda d: nn.GRU(d["b"], 2, num_layers=2, bidirectional=True, batch_first=True),
            uses="b",
        ),
    ),
    case(
        "rnn, sequence first",
        lambda x, m: m(x.unsqueeze(1)),
        x=X("a b"),
        m=Module(lambda d: nn.RNN(d["b"], 4), uses="b"),
    ),
]
add("sequences", *_SEQUENCE_CASES)
add(
    "sequence_batch",
    *(
        case(f"{c.label} (a node only inside blocks)", c.fn, recorded=False, **c.args)
        for c in _SEQUENCE_CASES
    ),
)


# ---- the generated test ----------------------------------------------------------------


def _parse(template: str):
    return [tok.split("*") for tok in template.split()]


def _size(token, dims):
    out = 1
    for part in token:
        out *= int(part) if part.isdigit() else dims[part]
    return out


def _symbols(template: str) -> set:
    return {p for tok in _parse(template) for p in tok if not p.isdigit()}


def _make(spec: Arg, template, dims, gen):
    shape = tuple(_size(tok, dims) for tok in _parse(template))
    if spec.dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    if spec.dtype.is_floating_point:
        return (torch.rand(shape, generator=gen) * (spec.hi - spec.lo) + spec.lo).to(spec.dtype)
    hi = dims[spec.hi] if isinstance(spec.hi, str) else spec.hi
    return torch.randint(int(spec.lo), hi, shape, generator=gen, dtype=spec.dtype)


@dataclass
class Example:
    instances: list
    shared: dict
    ragged: bool


def build(c: Case, draw: Callable[[int, int], int], max_n=6) -> Example:
    """One example of case ``c``; ``draw(lo, hi)`` picks integers (hypothesis, or random)."""
    templates = {}
    for name, spec in c.args.items():
        if isinstance(spec, Arg):
            alts = (spec.shape,) if isinstance(spec.shape, str) else spec.shape
            templates[name] = alts[draw(0, len(alts) - 1)] if len(alts) > 1 else alts[0]
    n = draw(1, max_n)
    ragged = bool(draw(0, 1))
    seed = draw(0, 2**16)
    symbols, fixed = set(), set()
    for name, spec in c.args.items():
        if isinstance(spec, Module):
            fixed |= set(spec.uses.split())
            continue
        syms = _symbols(templates[name]) | {v for v in (spec.lo, spec.hi) if isinstance(v, str)}
        symbols |= syms
        if spec.shared:
            fixed |= syms
    symbols |= fixed

    def sizes():
        return {s: draw(1, 5) for s in sorted(symbols)}

    base = sizes()
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # module initialisation
    shared = {}
    for name, spec in c.args.items():
        if isinstance(spec, Module):
            shared[name] = spec.build(base)
        elif spec.shared:
            shared[name] = _make(spec, templates[name], base, gen)
    instances = []
    for i in range(n):
        dims = base
        if ragged and i > 0:
            dims = {**base, **{s: v for s, v in sizes().items() if s not in fixed}}
        instances.append(
            {
                name: _make(spec, templates[name], dims, gen)
                for name, spec in c.args.items()
                if isinstance(spec, Arg) and not spec.shared
            }
        )
    return Example(instances, shared, ragged)


def _fn(c: Case):
    return acrobat.autobatch(lambda inst, **shared: c.fn(**inst, **shared))


def run_case(name: str, c: Case, ex: Example):
    f = _fn(c)
    stats = check_map(f, ex.instances, **ex.shared)
    if c.recorded:
        assert name in stats.by_op, f"{name} never ran as a batch: {stats.by_op}"
    else:
        assert name not in stats.by_op, f"{name} should not be a node: {stats.by_op}"
    if not ex.ragged and not c.sized and len(ex.instances) > 1:
        # equally shaped instances batch completely: n of them take as many batches as one
        _, one = f.map(ex.instances[:1], stats=True, **ex.shared)
        assert stats.batches == one.batches, (stats.by_op, one.by_op)


def _case_params():
    for name in TABLE:
        for c in CASES.get(name, []):
            yield pytest.param(name, c, id=f"{name}-{c.label}")


@pytest.mark.parametrize("name, c", list(_case_params()))
@settings(max_examples=10)
@given(data=st.data())
def test_op(name, c, data):
    ex = build(c, lambda lo, hi: data.draw(st.integers(lo, hi)))
    run_case(name, c, ex)


def test_every_row_has_a_case():
    missing = [name for name in TABLE if name not in CASES and name not in DATA_OPS]
    assert not missing, f"op table rows without a test case in CASES: {missing}"
    unknown = [name for name in CASES if name not in TABLE]
    assert not unknown, f"CASES for ops not in the table: {unknown}"
    data_rows = sorted(name for name, op in TABLE.items() if op.kind == "data")
    assert data_rows == sorted(DATA_OPS), "a new data op needs an explicit test below"


class _SeenFuncs(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.funcs = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.add(func)
        return func(*args, **(kwargs or {}))


# Plain Python wrappers that call the Tensor method without dispatching themselves
# (F.sigmoid is ``input.sigmoid()``): the mode sees the method they call instead.
_UNDISPATCHED = {F.sigmoid, F.tanh}


def test_every_alias_is_called():
    """Each alias of each row is called by some case of that row (run eagerly): either
    through ``call`` or seen by a TorchFunctionMode (module forwards, F wrappers)."""
    rng = random.Random(0)
    CALLED.clear()
    uncalled = []
    for name, cases in CASES.items():
        seen = _SeenFuncs()
        for c in cases:
            ex = build(c, rng.randint, max_n=1)
            with torch.no_grad(), warnings.catch_warnings(), seen:
                warnings.simplefilter("ignore")
                c.fn(**ex.instances[0], **ex.shared)
        uncalled += [
            (name, a)
            for a in TABLE[name].aliases
            if a not in seen.funcs and a not in CALLED and a not in _UNDISPATCHED
        ]
    assert not uncalled, f"aliases no case calls: {uncalled}"


# ---- random ops: distributions, not values -----------------------------------------------


@pytest.mark.parametrize("draw", [torch.rand_like, torch.randn_like, F.dropout])
def test_random_ops_draw_per_instance(draw):
    f = acrobat.autobatch(lambda x: draw(x))
    torch.manual_seed(0)
    xs = [torch.ones(400) for _ in range(4)]
    with torch.no_grad():
        got = f.map(xs)
    for y, x in zip(got, xs):
        assert y.shape == x.shape and y.dtype == torch.float32
        if draw is torch.rand_like:
            assert y.min() >= 0 and y.max() < 1 and 0.4 < y.mean() < 0.6
        elif draw is torch.randn_like:
            assert y.min() < 0 < y.max() and abs(y.mean()) < 0.2 and 0.8 < y.std() < 1.2
        else:
            assert set(y.unique().tolist()) == {0.0, 2.0} and 0.35 < (y == 0).float().mean() < 0.65
    # the instances' draws are independent: no two share their noise
    assert all(not torch.equal(got[0], g) for g in got[1:])


# Aliases of one row that are different functions must not batch together: ``func``
# is part of the batching signature.
def test_rand_like_and_randn_like_in_one_instance():
    @acrobat.autobatch
    def f(x):
        return torch.rand_like(x), torch.randn_like(x)

    torch.manual_seed(0)
    for u, g in f.map([torch.ones(400) for _ in range(3)]):
        assert u.min() >= 0 and u.max() < 1
        assert g.min() < 0 < g.max()


def test_rnn_tanh_and_relu_cells_with_shared_weights():
    cell = nn.RNNCell(3, 4)
    weights = (cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)

    @acrobat.autobatch
    def f(xh):
        x, h = xh
        return torch.rnn_tanh_cell(x, h, *weights), torch.rnn_relu_cell(x, h, *weights)

    with torch.no_grad():
        check_map(f, [(torch.randn(2, 3), torch.randn(2, 4)) for _ in range(3)])


def test_bitwise_and_logical_and_on_ints():
    @acrobat.autobatch
    def f(x):
        return x & (x + 1), torch.logical_and(x, x + 1)

    check_map(f, [torch.arange(4) + i for i in range(3)])


def _bitwise_in_place(x):
    y = x * 3
    y &= 6
    y |= 1
    y ^= 5
    y <<= 1
    y >>= 2
    return y


@given(
    st.lists(st.lists(st.integers(0, 31), min_size=1, max_size=5), min_size=1, max_size=5),
    st.sampled_from(["xor", "shifts", "bools", "plus", "in place"]),
)
def test_bitwise_operators_and_plus(rows, which):
    """``^ << >>`` (torch's generic ops: no row of the table), their reflected and in-place
    forms, ``&= |=`` and unary ``+`` on lazy tensors (they raised a TypeError)."""
    fn = {
        "xor": lambda x: (x ^ 3, 5 ^ x, x ^ (x + 1)),
        "shifts": lambda x: (x << 2, x >> 1, 1 << (x % 4), 64 >> (x % 3)),
        "bools": lambda x: ((x > 2) ^ (x < 9), (x > 2) ^ True),
        "plus": lambda x: +x * 2,
        "in place": _bitwise_in_place,
    }[which]
    check_map(acrobat.autobatch(fn), [torch.tensor(r) for r in rows])


def test_format_spec_copy_and_deepcopy():
    """``f"{loss:.3f}"`` formats a 0-dim value (a read), ``copy.copy`` / ``copy.deepcopy``
    of a lazy tensor work as eager's (they raised: no format spec, no pickling)."""
    import copy

    def f(x):
        y = x * 2
        c, d = copy.copy(y), copy.deepcopy(y)
        s = float(f"{y.sum():.2f}")
        return c + 1, d * 3, torch.tensor(s)

    check_map(acrobat.autobatch(f), [torch.randn(3) for _ in range(4)])
    w = nn.Parameter(torch.randn(3))

    def g(x):
        return copy.deepcopy(x * w)

    with pytest.raises(RuntimeError, match="graph leaves"):
        g(torch.randn(3))
    with pytest.raises(RuntimeError, match="graph leaves"):
        acrobat.autobatch(g).map([torch.randn(3) for _ in range(2)])


def _printing(x, i: int):
    h = torch.tanh(x * 2)
    print(i, h)
    text = f"{i}: {h} {h.long()}"  # an f-string's empty spec formats as str does
    print(text)
    return h + 1, str(h.sum()), text


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_print_and_str_show_the_value_as_eager(sizes):
    """``print(t)``, ``str(t)`` and ``f"{t}"`` in the instance's code read the value and
    print it as eager does (they showed the LazyTensor's repr); the instances' prints
    interleave, each instance's in its own order. ``repr`` reads nothing."""
    xs = [torch.randn(n) for n in sizes]
    f = acrobat.autobatch(_printing)
    out = io.StringIO()
    with torch.no_grad(), contextlib.redirect_stdout(out):
        got = f.map(xs, list(range(len(xs))))
    want = io.StringIO()
    with torch.no_grad(), contextlib.redirect_stdout(want):
        expected = [_printing(x, i) for i, x in enumerate(xs)]
    assert_close_tree(got, expected)

    def by_instance(text):
        lines: dict = {}
        for line in text.getvalue().splitlines():
            lines.setdefault(int(line.split(" ")[0].rstrip(":")), []).append(line)
        return lines

    assert by_instance(out) == by_instance(want)
    assert repr(got[0][0]).startswith("tensor(")  # (the map's results are real)

    def reprs(x):
        return x * 2, repr(x * 2)

    (_, text), = acrobat.autobatch(reprs).map([torch.randn(2)])
    assert text.startswith("LazyTensor(")


def test_plus_of_a_bool_raises_as_eager():
    with pytest.raises(RuntimeError, match="bool tensor is not supported"):
        acrobat.autobatch(lambda x: +(x > 1)).map([torch.arange(3)])


# ---- data ops and namedtuples: explicit tests -----------------------------------------------

torch.manual_seed(0)
EMB = nn.Embedding(10, 4)
PARAM = torch.randn(7, 3)
PARAM1 = torch.randn(5)


@given(st.lists(st.integers(-7, 6), min_size=1, max_size=8))
def test_take_python_int_rows(ids):
    @acrobat.autobatch
    def f(i):
        return torch.tanh(PARAM[i]), PARAM1[i % 5] * 2, PARAM[i] @ PARAM.t()

    stats = check_map(f, ids)
    # one index_select per parameter, however many instances
    assert stats.by_op["take"] == [2, 3 * len(ids)]


def test_take_out_of_range_names_the_instance():
    @acrobat.autobatch
    def f(i):
        return PARAM[i]

    with pytest.raises(IndexError, match="instance 1"):
        f.map([0, 7, 1])


@given(st.lists(st.integers(0, 9), min_size=1, max_size=8))
def test_tensor_int_constants_feed_embedding(ids):
    @acrobat.autobatch
    def f(i):
        return torch.tanh(EMB(torch.tensor(i)))

    with torch.no_grad():
        stats = check_map(f, ids)
    # the constant is deferred and the lookup becomes ONE row-lookup batch of the table
    assert stats.by_op["take"] == [1, len(ids)]
    assert "tensor" not in stats.by_op and "embedding" not in stats.by_op

    @acrobat.autobatch
    def g(i):  # the same constant also used on its own: it becomes a node after all
        t = torch.tensor(i)
        return EMB(t) * 2, t + 1

    with torch.no_grad():
        stats = check_map(g, ids)
    assert stats.by_op["tensor"] == [1, len(ids)]


def test_embedding_shortcut_keeps_padding_gradients():
    emb = torch.nn.Embedding(6, 3, padding_idx=0)

    @acrobat.autobatch
    def f(i):
        return emb(torch.tensor(i))

    ids = [0, 1, 0, 4]
    torch.stack(f.map(ids)).sum().backward()
    got = emb.weight.grad.clone()
    emb.weight.grad = None
    torch.stack([f.eager(i) for i in ids]).sum().backward()
    torch.testing.assert_close(got, emb.weight.grad)
    assert got[0].abs().sum() == 0  # the padding row gets no gradient


def test_returned_deferred_constant():
    @acrobat.autobatch
    def f(i):
        return torch.tensor(i)

    assert [int(v) for v in f.map([3, 4])] == [3, 4]


@given(
    st.lists(
        st.tuples(
            st.integers(-5, 5),
            st.floats(-3, 3, width=32, allow_subnormal=False),
            st.booleans(),
            st.integers(-(2**62), 2**62),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_tensor_constants(values):
    @acrobat.autobatch
    def f(v):
        i, x, b, big = v
        return (
            torch.tensor([big, i]),  # int64 at full range
            torch.tensor([x, 0.5], dtype=torch.int64),  # torch's truncation: batched with ^
            torch.tensor([i, x]),  # mixed ints and floats: the default float dtype
            torch.tensor([b, b], dtype=torch.float32),  # batched with ^
            torch.tensor([x, -1e9, 1e39]),  # a mask's NEG; out of float32's range: inf
            torch.tensor(i),
            torch.tensor(x),
            torch.tensor(b),
            torch.tensor(i, dtype=torch.float32) * torch.tensor(x),
            torch.as_tensor(i) + 1,
            torch.tensor([i, i + 1, 2]),
            torch.tensor([x, 1.0], dtype=torch.float64),
            torch.where(torch.tensor(b), torch.tensor(x), torch.tensor(0.0)),
            torch.tensor([[i, 0], [0, i]]) + 0,  # nested lists: a real constant
        )

    stats = check_map(f, values)
    assert stats.by_op["tensor"][0] <= 10  # one batch per (shape, dtype), not per instance


def test_lazy_bool_mask_index_reads_the_mask():
    """``x[mask]`` reads the mask (each instance's count sizes its result); a mask with
    other indices is refused naming the line; a mask of the wrong shape is eager's
    IndexError."""

    @acrobat.autobatch
    def f(x):
        m = x.reshape(3, 2)
        return x[x > 0], m[m.sum(1) > 0] * 2

    check_map(f, [torch.randn(6) for _ in range(4)])

    @acrobat.autobatch
    def g(x):
        m = x.reshape(3, 2)
        return m[m[:, 0] > 0, 0]

    with pytest.raises(acrobat.UnsupportedOpError, match=r"boolean mask.*test_ops\.py"):
        g.map([torch.randn(6) for _ in range(2)])

    @acrobat.autobatch
    def h(x):
        return x.reshape(3, 2)[x > 0]

    with pytest.raises(IndexError, match="shape of the mask"):
        h.map([torch.randn(6)])
    with pytest.raises(IndexError, match="shape of the mask"):
        h.eager(torch.randn(6))


def test_row_of_a_shared_mask_as_index():
    mask = torch.tensor([[True, False, True], [False, True, True]])

    @acrobat.autobatch
    def f(x):
        return x[mask[1]]

    check_map(f, [torch.randn(3) for _ in range(2)])


def test_x_at_W_T_batches():
    @acrobat.autobatch
    def f(x):
        return x @ PARAM.T

    stats = check_map(f, [torch.randn(3) for _ in range(4)])
    assert stats.by_op["matmul"] == [1, 4], stats.by_op


def test_tensor_of_lazy_is_an_error():
    @acrobat.autobatch
    def f(x):
        return torch.tensor(x)

    with pytest.raises(acrobat.UnsupportedOpError, match=r"torch\.stack"):
        f.map([torch.randn(3)])


@given(st.lists(st.integers(1, 4), min_size=1, max_size=6), st.booleans())
def test_input_structures(sizes, same):
    gen = torch.Generator().manual_seed(len(sizes))
    insts = []
    for k in sizes:
        k = 3 if same else k
        insts.append(
            {
                "x": torch.randn(k, generator=gen),
                "pair": (torch.randint(0, 5, (k, 2), generator=gen), torch.rand(()) < 0.5),
                "list": [torch.randn(5, generator=gen)],
                "n": k,
            }
        )

    @acrobat.autobatch
    def f(inst):
        x, (i, b), (y,), k = inst["x"], inst["pair"], inst["list"], inst["n"]
        return x, i, b, y, x.sum() * k + y[0], {"x": x * 2, "b": b}

    stats = check_map(f, insts)
    shapes = {len(inst["x"]) for inst in insts}
    # one input batch per distinct (shape, dtype): x (and i) per size, b, y and y[0] (a
    # part of an argument, an input of its own) once each
    assert stats.by_op["input"][0] == 2 * len(shapes) + 3
    assert stats.by_op["input"][1] == 5 * len(insts)


def test_input_two_iterables_and_shared():
    @acrobat.autobatch
    def f(x, y, scale):
        return x * scale + y

    xs = [torch.randn(3) for _ in range(4)]
    ys = [torch.randn(3) for _ in range(4)]
    got = f.map(xs, ys, scale=torch.tensor(2.0))
    for g, x, y in zip(got, xs, ys):
        assert_close_tree(g, f.eager(x, y, scale=torch.tensor(2.0)))


def test_max_namedtuple_result():
    @acrobat.autobatch
    def f(x):
        return x.max(-1)

    check_map(f, [torch.randn(2, 3) for _ in range(3)])


_NOT_IN_BLOCKS = {"rand_like", "dropout", "multinomial", "bernoulli", "gumbel_softmax", "normal",
                  "poisson", "binomial"}  # fmt: skip


@pytest.mark.parametrize(
    "name, c", [p for p in _case_params() if p.values[0] not in _NOT_IN_BLOCKS]
)
@settings(max_examples=3)
@given(data=st.data())
def test_op_inside_a_block(name, c, data):
    """Every case again with its function as an ``@acrobat.block``: the op runs inside a
    traced program, as generated code (acrobat/codegen.py) calling torch directly or the
    op's rule."""
    ex = build(c, lambda lo, hi: data.draw(st.integers(lo, hi)))
    body = acrobat.block(lambda inst, shared: c.fn(**inst, **shared))
    f = acrobat.autobatch(lambda inst, **shared: body(inst, shared))
    if c.sized:  # a value read inside a block: a clear error (an automatic block records
        # op by op instead; test_sized_ops_in_plain_functions)
        with pytest.raises(acrobat.AcrobatError, match=r"not inside a block|block read"):
            f.map(ex.instances, **ex.shared)
        return
    check_map(f, ex.instances, **ex.shared)


@acrobat.autobatch
def sized_by_numbers(instance):
    x, n, fill = instance
    ramp = torch.arange(torch.tensor(n)).float()
    return x * ramp[-1] + torch.full((2,), torch.tensor(fill)) + torch.zeros(torch.tensor(2))


@settings(max_examples=15, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 9), st.floats(-3, 3, allow_subnormal=False) | st.integers(-3, 3)),
        min_size=1,
        max_size=6,
    )
)
def test_factories_read_numbers_made_tensors_as_eager_does(specs):
    xs = [(torch.randn(2), n, fill) for n, fill in specs]
    with torch.no_grad():
        check_map(sized_by_numbers, xs)


def test_factories_given_a_computed_tensor_ask_for_its_value():
    @acrobat.autobatch
    def f(x):
        return torch.zeros(torch.tensor(2) + 1) + x

    with pytest.raises(acrobat.UnsupportedOpError, match=r"torch\.zeros given a per-instance"):
        f.map([torch.ones(3)])
    # acrobat is usable after the error
    torch.testing.assert_close(sized_by_numbers.map([(torch.ones(2), 3, 1.0)])[0],
                               sized_by_numbers.eager((torch.ones(2), 3, 1.0)))  # fmt: skip


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_new_tensors_take_the_dtype_and_are_shared_constants(lengths, dtype):
    @acrobat.autobatch
    def f(x):
        z = x.new_zeros(1, x.shape[-1])  # sizes as ints and as a tuple
        o = x.new_ones((x.shape[-1],))
        full = x.new_full((1, 1), 1.5)
        ints = x.new_zeros(3, dtype=torch.long)
        data = x.new_tensor([float(len(x)), 2.0])  # per-instance data, this dtype
        legacy = x.new([1.0, float(len(x))])  # the legacy constructor: data
        empty = x.new(2, 3), x.new_empty(4), x.new(torch.Size([1, 2]))
        shapes = [tuple(t.shape) for t in empty] + [str(e.dtype) for e in empty]
        return (x + z, x * o + full, ints + 1, data * legacy, x.sum() * data, shapes)

    gen = torch.Generator().manual_seed(len(lengths))
    xs = [torch.randn(n, 3, generator=gen, dtype=dtype) for n in lengths]
    stats = check_map(f, xs)
    for name in ("zeros", "ones", "full", "empty"):
        assert name not in stats.by_op  # hoisted: one shared tensor, no per-instance node


def test_filling_a_legacy_new_tensor_in_place_equals_eager():
    @acrobat.autobatch
    def f(x):
        return x + x.new(1, 3).fill_(0.5)  # built right after it is made (graph.construct)

    check_map(f, [torch.randn(1, 3) for _ in range(2)])

    @acrobat.autobatch
    def g(x):
        c = x.new(1, 3).fill_(0.5)
        y = x * c  # read by a recorded op first: filling it again would show in y
        c.fill_(2.0)
        return y + c

    with pytest.raises(acrobat.AcrobatError, match=r"empty\(\.\.\.\).*modified in place"):
        g.map([torch.randn(1, 3) for _ in range(2)])


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 6), min_size=1, max_size=6),
    grad=st.booleans(),
)
def test_parts_of_inputs_of_any_length_batch_as_inputs(lengths, grad):
    @acrobat.autobatch
    def f(x):
        first, last = x[0], x[-1]  # rows whose position depends on nothing lazy
        mid = x[len(x) // 2]
        return torch.tanh(first * 2 + last) - mid, x[1:, 0] * 1, x[..., 1:2].sum()

    gen = torch.Generator().manual_seed(sum(lengths))
    xs = [torch.randn(n, 4, generator=gen).requires_grad_(grad) for n in lengths]
    with torch.set_grad_enabled(grad):
        stats = check_map(f, xs)
    assert "getitem" not in stats.by_op  # every part is an input of its own
    # the rows of inputs of every length batch together: one input batch for the rows, one
    # per length for each of the two length-dependent parts and for the whole inputs
    assert stats.by_op["input"][0] <= 1 + 3 * len(set(lengths))
    if grad:  # gradients reach the user's tensors through the parts, as in eager
        outs = f.map(xs)
        torch.stack([o[0].sum() + o[1].sum() + o[2] for o in outs]).sum().backward()
        got = [x.grad.clone() for x in xs]
        for x in xs:
            x.grad = None
        torch.stack([sum(t.sum() for t in f.eager(x)[:3]) for x in xs]).sum().backward()
        for g, x in zip(got, xs):
            torch.testing.assert_close(g, x.grad)


# ---- losses under training; methods without a row ------------------------------------------


@settings(max_examples=10, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    classes=st.integers(2, 5),
    seed=st.integers(0, 2**16),
)
def test_per_instance_losses_train_like_eager(lengths, classes, seed):
    """A per-step cross-entropy and MSE inside the instance: the batched losses and every
    parameter's gradient equal the eager loop's."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    cell, head = nn.Linear(6, 4), nn.Linear(4, classes)
    seqs = [
        (
            [torch.randn(6, generator=g) for _ in range(k)],
            torch.randint(0, classes, (k,), generator=g),
        )
        for k in lengths
    ]

    @acrobat.autobatch
    def loss_of(xs, labels):
        h = torch.zeros(4)
        total = torch.zeros(())
        for x, y in zip(xs, labels.tolist()):
            h = torch.tanh(cell(x) + h)
            total = total + F.cross_entropy(head(h), torch.tensor(y))
        return total + F.mse_loss(h, torch.ones(4))

    params = [*cell.parameters(), *head.parameters()]
    got = torch.stack(loss_of.map([s for s, _ in seqs], [t for _, t in seqs]))
    want = torch.stack([loss_of.eager(s, t) for s, t in seqs])
    torch.testing.assert_close(got, want)
    for a, b in zip(
        torch.autograd.grad(got.sum(), params), torch.autograd.grad(want.sum(), params)
    ):
        torch.testing.assert_close(a, b)


def test_one_hot_without_num_classes_is_refused():
    @acrobat.autobatch
    def f(i):
        return F.one_hot(i)

    with pytest.raises(acrobat.UnsupportedOpError, match="num_classes"):
        f.map([torch.tensor(1), torch.tensor(2)])


@pytest.mark.parametrize(
    "norm", [lambda: nn.BatchNorm1d(3), lambda: nn.InstanceNorm1d(3, track_running_stats=True)]
)
def test_a_norm_updating_running_statistics_is_refused_and_eval_mode_batches(norm):
    """In training mode the eager loop updates the running statistics once per instance,
    in order: refused, naming the way out; in eval mode the fixed statistics batch."""
    layer = norm()

    @acrobat.autobatch
    def f(x, layer):
        return layer(x.t().unsqueeze(0)).squeeze(0) + 1

    xs = [torch.randn(4, 3) for _ in range(3)]
    with pytest.raises(acrobat.UnsupportedOpError, match=r"running statistics.*model.eval"):
        f.map(xs, layer=layer)
    with torch.no_grad():
        layer.running_mean.normal_()
        layer.running_var.uniform_(0.5, 2.0)
    layer.eval()
    check_map(f, xs, layer=layer)


def test_repeat_interleave_by_computed_repeats_is_refused():
    @acrobat.autobatch
    def f(x):
        return x.repeat_interleave((x > 0).long())

    with pytest.raises(acrobat.UnsupportedOpError, match=r"repeats.*values"):
        f.map([torch.randn(3), torch.randn(3)])


def test_type_conversions_match_eager():
    @acrobat.autobatch
    def f(x):
        return (
            x.type(),
            x.type(torch.float64) * 2,
            x.type("torch.IntTensor"),
            x.type(torch.LongTensor),
            x.type(dtype=torch.float16),
        )

    check_map(f, [torch.randn(3) * 4 for _ in range(3)])

    @acrobat.autobatch
    def g(x):
        return x.type("torch.cuda.FloatTensor")

    with pytest.raises(acrobat.UnsupportedOpError, match="another device"):
        g.map([torch.randn(2)])


def _positive_part(x, w):  # straight-line: an automatic block, whose trace reads a mask
    return x[x > 0].sum() * w + torch.masked_select(x, x < 0).sum()


@acrobat.autobatch
def sized_in_helpers(x, w):
    return _positive_part(x, w) + torch.unique(x.round()).sum() + x.nonzero().sum()


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=6))
def test_sized_ops_in_plain_functions_batch_and_keep_gradients(lengths):
    """A helper reading a mask becomes no block (its trace reads a value): recorded op by
    op, each instance's mask read, and the gradient through the selected values is
    eager's."""
    w = torch.randn((), requires_grad=True)
    xs = [torch.randn(k) for k in lengths]
    got = sized_in_helpers.map(xs, w=w)
    want = [sized_in_helpers.eager(x, w) for x in xs]
    assert_close_tree(got, want, 1e-5, 1e-5)
    (g,) = torch.autograd.grad(sum(got), w)
    (e,) = torch.autograd.grad(sum(want), w)
    torch.testing.assert_close(g, e)


def test_bincount_weights_needing_a_gradient_are_refused():
    """(eager's result has no derivative for them: backward raises; acrobat would read
    them, silently dropping it)"""

    @acrobat.autobatch
    def f(x, w):
        return torch.bincount(torch.tensor([0, 1, 1]), weights=x * w)

    w = torch.randn(3, requires_grad=True)
    with pytest.raises(acrobat.UnsupportedOpError, match="gradient"):
        f.map([torch.randn(3), torch.randn(3)], w=w)
    with torch.no_grad():
        check_map(f, [torch.randn(3), torch.randn(3)], w=w)


@pytest.mark.parametrize("fast", [True, False], ids=["stand-ins", "handler"])
def test_a_read_inside_the_modes_handler_leaves_the_mode_stack_as_it_was(fast):
    """Without the torch stand-ins, torch.bincount reaches the recording mode's handler,
    where each instance reads its values (the mode put back meanwhile). A map failing
    after those reads, with instances still suspended there, must leave torch's mode stack
    as it found it (it kept the mode once: every later torch call of the process was
    recorded into a dead map)."""

    @acrobat.autobatch
    def f(x, w):
        return torch.bincount(torch.tensor([0, 1, 1]), weights=x * w)

    w = torch.randn(3, requires_grad=True)
    depth = torch._C._len_torch_function_stack()
    with acrobat.config.override(FAST_FUNCTIONS=fast):
        with pytest.raises(acrobat.UnsupportedOpError, match="gradient"):
            f.map([torch.randn(3), torch.randn(3)], w=w)
        assert torch._C._len_torch_function_stack() == depth
        with torch.no_grad():
            check_map(f, [torch.randn(3) for _ in range(3)], w=w)
        assert torch._C._len_torch_function_stack() == depth


def test_facts_of_dtype_and_shape_are_eagers():
    @acrobat.autobatch
    def f(x):
        return x.element_size(), x.nbytes, x.itemsize, x.cpu() * 2

    check_map(f, [torch.randn(2, 3), torch.randn(2, 3).double()])


def test_a_tensor_method_without_a_row_raises_clearly():
    @acrobat.autobatch
    def f(x):
        assert not hasattr(x, "no_such_attribute") and hasattr(x, "topk")
        return x.logcumsumexp(0)  # no row

    off = acrobat.config.override(GENERIC_VMAP=False)  # (else a generic vmap row)
    with off, pytest.raises(acrobat.UnsupportedOpError, match=r"Tensor\.logcumsumexp") as err:
        f.map([torch.randn(3)])
    assert isinstance(err.value, AttributeError)  # hasattr(x, "logcumsumexp") is False


@acrobat.autobatch
def _gathers_growing_rows(x, picks):
    chosen: list = []
    outs = []
    for p in picks:  # the list grows after each use, as a selection loop's would
        chosen.append(p)
        outs.append(x[chosen].sum(0))
        nested = [chosen, [0] * len(chosen)]
        outs.append(x[nested[0]][:, :1].sum() + x[0, nested[1]].sum())
    return torch.stack([o.sum() for o in outs])


@settings(max_examples=20, deadline=None)
@given(picks=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=5), min_size=1, max_size=6))
def test_indexing_lists_changed_afterwards_keep_their_positions(picks):
    xs = [torch.randn(5, 3) for _ in picks]
    with torch.no_grad():
        got = _gathers_growing_rows.map(xs, picks)
        want = [_gathers_growing_rows.eager(x, p) for x, p in zip(xs, picks)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


_LIST_ARG_OPS = {  # op(x, list) and how the instance changes the list after the call
    "permute": (lambda x, l: x.reshape(2, 3).permute(l), [1, 0], list.reverse),
    "repeat": (lambda x, l: x.repeat(l), [2], lambda l: l.__setitem__(0, 3)),
    "pad": (lambda x, l: F.pad(x, l), [1, 2], lambda l: l.__setitem__(0, 3)),
    "pad_kw": (lambda x, l: F.pad(x, pad=l), [1, 2], lambda l: l.append(1)),
    "split": (lambda x, l: torch.split(x, l)[0], [2, 4], list.reverse),
    "flip": (lambda x, l: x.reshape(2, 3).flip(l), [0], lambda l: l.__setitem__(0, 1)),
    "sum": (lambda x, l: x.reshape(2, 3).sum(l), [0], lambda l: l.__setitem__(0, 1)),
    "roll": (lambda x, l: x.roll(l), [1], lambda l: l.__setitem__(0, 2)),
    "cat": (lambda x, l: torch.cat(l), None, list.reverse),  # a list of lazy parts
    "tuple_of_lists": (lambda x, l: x.reshape(2, 3)[(l, [0, 0])], [1, 0], list.reverse),
}


@pytest.mark.parametrize("name", sorted(_LIST_ARG_OPS))
def test_list_arguments_changed_after_the_call_keep_their_values(name):
    op, values, change = _LIST_ARG_OPS[name]

    @acrobat.autobatch
    def f(x):
        arg = [x[:2] * 2, x[2:]] if values is None else list(values)
        y = op(x, arg)
        change(arg)  # eager has used the list already
        return y * 1

    xs = [torch.randn(6) for _ in range(3)]
    with torch.no_grad():
        check_map(f, xs)


@pytest.mark.parametrize("block", [False, True])
def test_a_memory_format_for_the_instances_rank(block):
    """``y.to(memory_format=torch.channels_last)`` of a 4-d value: the batch is 5-d, so
    the format (a layout, not a value) is left out of it, in a rule and in a block's
    generated code alike (it raised "required rank 4 tensor")."""
    conv = nn.Conv2d(3, 4, 3)

    def body(x):
        y = conv(x[None]).to(memory_format=torch.channels_last)
        return y.contiguous(memory_format=torch.channels_last).clone(
            memory_format=torch.preserve_format
        ).sum((0, 2, 3))

    f = acrobat.autobatch(acrobat.block(body) if block else body)
    check_map(f, [torch.randn(3, 6, 6) for _ in range(3)], atol=1e-5)
