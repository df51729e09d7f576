"""The static side: what can be known about the user's code before it runs.

Automatic coarsening (ACRoBat's grain-size coarsening, appendix A.2, without annotations).
``f.map`` looks at the functions the decorated function can reach (its globals, closure
cells, and functions kept in tuples/lists/dicts/namedtuples there, transitively through
functions that have control flow) and finds the *straight-line* ones: a body of plain
assignments and one final ``return``, calling only torch, methods of its values and
attributes of its arguments (``model.fc(x)``). Those are treated as ``@acrobat.block``:
traced once per signature, recorded as ONE node per call.

How calls are routed: for the duration of the map, each such function's ``__code__`` is
swapped for a trampoline with the same signature that calls the block; the function object
(and every reference to it, in a namedtuple of cells or anywhere) stays the same, and the
original code is restored when the map ends. Safe fallback: a function that turns out to
read a tensor value (or otherwise cannot be traced) is called as written from then on.

What makes a function straight-line is decided from its source (``inspect``/``ast``,
cached per code object); functions without source, with closures, ``*args``-only C
functions, generators and methods are left alone.

Regions (``config.AUTO_REGIONS``, the section at the end): in the functions with control
flow that the search passes through, the decorated one included, each maximal run of
straight-line assignments is outlined into a function of its own, called through a
``RegionBlock``, and the function's code is swapped for the rewritten one for the map.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import inspect
import operator
import os
import sys
import sysconfig
import textwrap
import threading
import types
import warnings
from collections.abc import Iterator
from typing import Any, TypeGuard

import torch

from acrobat import config, executor, graph
from acrobat.block import STANDS_FOR, Block, is_namedtuple
from acrobat.errors import LazyValueError, NoInstanceWork
from acrobat.ops import (
    SCALAR_DTYPES,
    TENSOR,
    UPDATE_METHODS,
    augment,
    factory_call,
    is_lazy,
    item_updated,
    keep_row,
    lookup_call,
    put_item,
    put_rows,
    scalar_data,
    update,
    update_item,
    value_data,
)
from acrobat.scan import Scan
from acrobat.tensor import _native, _printed

# Builtins a straight-line tensor function may call (metadata and conversions; a value
# demand such as int(t) makes tracing fail, and the function falls back to per-op).
_SAFE_BUILTINS = {
    "len",
    "tuple",
    "list",
    "range",
    "int",
    "float",
    "min",
    "max",
    "abs",
    "getattr",
    "zip",
    "reversed",
    "enumerate",
    "sum",
}
# Method names that mutate Python containers or tensors in place: never straight-line.
_MUTATORS = {
    "append",
    "extend",
    "insert",
    "pop",
    "remove",
    "update",
    "setdefault",
    "clear",
    "add",
    "discard",
    "write",
    "send",
    "put",
    "popitem",
    "sort",
    "reverse",
    "popleft",
    "appendleft",
    "extendleft",
    "rotate",
}
# Random number generators: a trace would replay one draw for every call.
_RANDOM = {
    "rand",
    "randn",
    "randint",
    "randperm",
    "normal",
    "bernoulli",
    "multinomial",
    "poisson",
    "binomial",
    "rand_like",
    "randn_like",
    "randint_like",
    "random",
    "uniform",
    "choice",
    "shuffle",
    "sample",
    "rsample",
    "gumbel_softmax",
    "gauss",
}
_FORBIDDEN = (
    ast.If,
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.With,
    ast.AsyncWith,
    ast.Try,
    ast.Raise,
    ast.Assert,
    ast.Global,
    ast.Nonlocal,
    ast.Delete,
    ast.AugAssign,
    ast.IfExp,
    ast.BoolOp,
    ast.Lambda,
    ast.Yield,
    ast.YieldFrom,
    ast.Await,
    ast.NamedExpr,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Match,
)
_CONSTANT_TYPES = (int, float, bool, str, type(None), complex)

_VERDICTS: dict[tuple, bool] = {}


def _code_key(fn: types.FunctionType) -> tuple:
    """A cache key of what analysing ``fn`` found: its code and its globals' identity.
    Code objects compare by value, not by file: the same function pasted into two
    modules had one entry, and the second ran the first's outlined regions and blocks,
    which read the first module's globals (its weights, silently)."""
    return fn.__code__, id(fn.__globals__)


def _is_torch_object(obj) -> bool:
    module = getattr(obj, "__module__", None) or getattr(obj, "__name__", "")
    return isinstance(module, str) and module.split(".")[0] == "torch"


def _immutable_constant(value) -> bool:
    if isinstance(value, _CONSTANT_TYPES):
        return True
    if type(value) is tuple:
        return all(_immutable_constant(v) for v in value)
    return False


def _function_ast(fn) -> ast.FunctionDef | None:
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    return tree.body[0]


def straight_line(fn, _seen: set | None = None) -> bool:
    """True if ``fn`` is a pure straight-line tensor function (see the module docstring)."""
    if not isinstance(fn, types.FunctionType) or fn.__closure__ or fn.__name__ == "<lambda>":
        return False
    code = fn.__code__
    key = _code_key(fn)
    verdict = _VERDICTS.get(key)
    if verdict is None:
        seen = _seen if _seen is not None else set()
        if code in seen:
            return False  # recursion is control flow
        seen.add(code)
        verdict = _check(fn, seen)
        _VERDICTS[key] = verdict
    return verdict


def _check(fn, seen: set) -> bool:
    if fn.__code__.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE):
        return False
    node = _function_ast(fn)
    if node is None or node.decorator_list:
        return False
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # docstring
    if not body or not isinstance(body[-1], ast.Return):
        return False
    params = {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
    if node.args.vararg:
        params.add(node.args.vararg.arg)
    if node.args.kwarg:
        params.add(node.args.kwarg.arg)
    local = set(params)
    for stmt in body:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if not _plain_target(target, local):
                    return False
        elif isinstance(stmt, ast.AnnAssign):
            if stmt.value is None or not _plain_target(stmt.target, local):
                return False
        elif not isinstance(stmt, (ast.Return, ast.Pass)):
            return False
        if isinstance(stmt, ast.Return) and stmt is not body[-1]:
            return False
    nodes = [n for stmt in body for n in ast.walk(stmt)]  # annotations not included
    for sub in nodes:
        # comprehensions unroll over Python structure (part of a block's signature); a
        # filter (``if``) would branch, and an async one would suspend
        if isinstance(sub, ast.comprehension) and (
            sub.ifs or sub.is_async or not _plain_target(sub.target, local)
        ):
            return False
    for sub in nodes:
        if isinstance(sub, _FORBIDDEN):
            return False
        if (
            isinstance(sub, ast.Name)
            and isinstance(sub.ctx, ast.Load)
            and sub.id not in local
            and not _global_ok(fn, sub.id, seen)
        ):
            return False
        if isinstance(sub, ast.Call) and not _call_ok(sub.func, local):
            return False
        if (
            isinstance(sub, ast.Call)
            and isinstance(sub.func, ast.Attribute)
            and sub.func.attr in _DEMAND_METHODS
        ):
            return False  # reads a value (``.tolist()``): a trace would fail; outlined instead
    # no operation at all (``return a``, ``return (a, b)``): nothing a block could batch,
    # while its dispatch would cost every call, ~1 us with Python values for arguments
    return any(isinstance(sub, _OPERATIONS) for sub in nodes)


_OPERATIONS = (ast.Call, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Subscript, ast.Attribute)


def _plain_target(target, local: set) -> bool:
    if isinstance(target, ast.Name):
        local.add(target.id)
        return True
    if isinstance(target, (ast.Tuple, ast.List)):
        return all(_plain_target(t, local) for t in target.elts)
    if isinstance(target, ast.Starred):
        return _plain_target(target.value, local)
    return False  # attribute or subscript assignment: a side effect


def _global_ok(fn, name: str, seen: set) -> bool:
    """A global the function reads must not be state that could change between calls."""
    if name in fn.__globals__:
        value = fn.__globals__[name]
    elif hasattr(builtins, name):
        return name in _SAFE_BUILTINS
    else:
        return False
    if isinstance(value, types.ModuleType):
        return value.__name__.split(".")[0] in ("torch", "math")
    if _is_torch_object(value):
        return getattr(value, "__name__", "") not in _RANDOM
    if isinstance(value, types.FunctionType):
        return straight_line(value, seen)
    if isinstance(value, type):
        return False  # constructing objects: not a tensor op
    if isinstance(value, torch.nn.Module):
        # a model held in a global (``net = Net()`` in a script or notebook): read as a
        # module argument is; a trace that reads it checks its state (block._dependencies)
        return GLOBAL_MODULES
    return _immutable_constant(value)


# a global holding a user's nn.Module instance may be read by straight-line code (blocks,
# runs) as torch's own modules are (read when analysing; tests/test_analysis.py)
GLOBAL_MODULES = True


def _call_ok(func, local: set) -> bool:
    if isinstance(func, ast.Name):
        return True  # checked as a global load (or a local callable: a module argument)
    if isinstance(func, ast.Attribute):
        # a method of a value, an attribute of an argument (``model.fc``) or of a module
        return (
            func.attr not in _MUTATORS
            and func.attr not in _RANDOM
            and not (func.attr.endswith("_") and not func.attr.endswith("__"))
        )
    return isinstance(func, (ast.Call, ast.Subscript))


# ---- discovery -------------------------------------------------------------------------


def _referenced(fn) -> Iterator[object]:
    """Objects a function's code can name: globals (incl. nested code), closure cells, and
    the attributes of the user's own modules among them that its code names
    (``cells.lstm(...)`` after ``from mymodel import cells``, ``drnn.PLAIN.node``)."""
    codes = [fn.__code__]
    while codes:
        code = codes.pop()
        names = code.co_names  # (global and attribute names alike)
        for name in names:
            if name in fn.__globals__:
                value = fn.__globals__[name]
                yield value
                if isinstance(value, types.ModuleType):
                    yield from _module_members(value, names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    for cell in fn.__closure__ or ():
        with contextlib.suppress(ValueError):
            yield cell.cell_contents


def _module_members(module: types.ModuleType, names: tuple, depth: int = 3) -> Iterator[object]:
    """The attributes of a user module (and of its user submodules, ``depth`` levels) whose
    names are among ``names``; nothing for other modules."""
    if depth == 0 or not _user_module(module):
        return
    members = vars(module)
    for name in names:
        member = members.get(name)
        if member is None:
            continue
        if isinstance(member, types.ModuleType):
            yield from _module_members(member, names, depth - 1)
        else:
            yield member


_NOT_USER_PATHS: tuple | None = None  # the standard library's and installed packages' dirs


def _user_module(module: types.ModuleType) -> bool:
    """A module of the user's own code: a source file outside the standard library and the
    installed packages (an editable install's files are in its source tree), and not
    torch's, acrobat's or another library that :func:`_user_object` leaves alone."""
    global _NOT_USER_PATHS
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py") or module.__name__.split(".")[0] in _LIBRARIES:
        return False
    if _NOT_USER_PATHS is None:
        paths = sysconfig.get_paths()
        roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
        _NOT_USER_PATHS = tuple(os.path.join(os.path.realpath(r), "") for r in roots)
    return not os.path.realpath(path).startswith(_NOT_USER_PATHS)


def discover(root) -> list[types.FunctionType]:
    """The straight-line functions reachable from ``root``, in a deterministic order."""
    return _reachable(root)[0]


def _reachable(
    root, classes: tuple = ()
) -> tuple[list[types.FunctionType], list[types.FunctionType]]:
    """(straight-line functions, functions with control flow, ``root`` included) reachable
    from ``root``, each in a deterministic order. ``classes``: the user's ``nn.Module``
    classes of the map's shared arguments (:func:`module_classes`): their ``forward`` is
    reachable (the module is called), and so is every method whose name the reachable
    code uses (``model.combine(l, r)``, ``self.gate(x)``)."""
    from acrobat.api import Autobatched

    found: dict[int, types.FunctionType] = {}
    control: dict[int, types.FunctionType] = {}
    seen: set[int] = set()
    names: set[str] = {"forward"}  # attribute names the reachable code uses
    classes = tuple(classes)
    stack = [root]
    while stack:
        while stack:
            obj = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, Autobatched):
                stack.append(obj.fn)
                continue
            if isinstance(obj, torch.nn.Module) and config.AUTO_METHODS:
                # a model the code reaches as a global or closure variable, not an argument
                more = [c for c in module_classes({"": obj}) if c not in classes]
                classes += tuple(more)
                continue
            if isinstance(obj, (Block, types.ModuleType)) or not _user_object(obj):
                continue
            if isinstance(obj, types.FunctionType):
                if config.AUTO_METHODS:  # (classes come only with it)
                    names.update(_code_names(obj.__code__))
                if obj is not root and straight_line(obj):
                    found[id(obj)] = obj
                else:
                    control[id(obj)] = obj
                    stack.extend(_referenced(obj))
            elif isinstance(obj, (tuple, list)):
                stack.extend(v for v in obj if callable(v))
            elif isinstance(obj, dict):
                stack.extend(v for v in obj.values() if callable(v))
        stack = [m for m in _methods(classes, names) if id(m) not in seen]
        if not stack and classes and CONTROL_CALLERS:
            stack = _demote_callers(found, control, classes)
    return list(found.values()), list(control.values())


def _demote_callers(found: dict, control: dict, classes: tuple) -> list:
    """Move from ``found`` to ``control`` each straight-line function that calls a method
    of ``classes`` with control flow (``self.encode(tree)`` in a ``forward`` whose own
    lines are straight): traced as a block, its call would run the method inside the
    trace (a tree's recursion keyed by the tree, a trace per call: run as written, op by
    op); as a function with control flow, its lines become regions and the method's own
    runs are outlined. Returns the demoted functions (their references are searched)."""
    if not found:
        return []
    methods = {
        id(v)
        for cls in classes
        for klass in cls.__mro__
        if _user_object(klass)  # (not torch.nn.Module's hundreds of attributes)
        for v in vars(klass).values()
    }
    demoted: list = []
    while True:
        flow = {fn.__name__ for fn in control.values() if id(fn) in methods}
        moved = [fn for fn in found.values() if not flow.isdisjoint(_method_calls(fn))]
        if not moved:
            return demoted
        for fn in moved:
            del found[id(fn)]
            control[id(fn)] = fn
        demoted.extend(moved)


def flow_names(classes: tuple, control: list) -> frozenset:
    """The names under which ``classes`` have a method among ``control`` (the functions with
    control flow :func:`_reachable` found, callers of such methods demoted into it
    included): what ``name`` finds on the class, not a base's method it overrides."""
    if not classes or not ARG_METHODS:
        return _NONE
    found = {id(fn) for fn in control}
    names = {fn.__name__ for fn in control}
    return frozenset(
        name for cls in classes for name in names if id(getattr(cls, name, None)) in found
    )


_METHOD_CALLS: dict[types.CodeType, frozenset] = {}


def _method_calls(fn) -> frozenset:
    """The attribute names ``fn``'s code calls as methods (``x.name(...)``; cached)."""
    calls = _METHOD_CALLS.get(fn.__code__)
    if calls is None:
        node = _function_ast(fn)
        calls = _METHOD_CALLS[fn.__code__] = frozenset(
            ()
            if node is None
            else (
                sub.func.attr
                for sub in ast.walk(node)
                if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
            )
        )
    return calls


_CONTROL = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.IfExp, ast.Match)
_FLOW: dict[types.CodeType, bool] = {}


def has_control_flow(fn) -> bool:
    """Whether ``fn``'s source branches or loops (or calls itself by name; cached per code
    object). False where its source cannot be read."""
    flow = _FLOW.get(fn.__code__)
    if flow is None:
        node = _function_ast(fn)
        flow = node is not None and any(
            isinstance(sub, _CONTROL)
            or (isinstance(sub, ast.Call) and getattr(sub.func, "id", None) == fn.__name__)
            for sub in ast.walk(node)
        )
        _FLOW[fn.__code__] = flow
    return flow


def _control_methods(fn) -> set[str]:
    """The names of the methods with control flow of the user class ``fn`` is a method of
    (found by its qualified name among its module's globals), ``fn``'s own name among
    them if it has control flow; empty for a function that is no method."""
    path = fn.__qualname__.split(".")[:-1]
    if not path or "<locals>" in path:  # (a class defined in a function: itself only)
        return {fn.__name__} if has_control_flow(fn) and _takes_self(fn) else set()
    owner: Any = fn.__globals__.get(path[0])
    for name in path[1:]:
        owner = getattr(owner, name, None)
    if not isinstance(owner, type):
        return set()
    names = set()
    for klass in owner.__mro__:
        if not _user_object(klass):
            break
        for name, value in vars(klass).items():
            if isinstance(value, types.FunctionType) and has_control_flow(value):
                names.add(name)
    return names


def _control_method(module, name: str) -> bool:
    """Whether the method ``name`` of ``module``'s class has control flow or calls one of
    its class's methods that has (a ``forward`` calling ``self.encode(tree)``)."""
    method = getattr(type(module), name, None)
    if not isinstance(method, types.FunctionType) or not _user_object(method):
        return False  # (torch's own modules: their checks are no control flow of ours)
    return has_control_flow(method) or not _control_methods(method).isdisjoint(
        _method_calls(method)
    )


def _takes_self(fn) -> bool:
    code = fn.__code__
    return code.co_argcount > 0 and code.co_varnames[0] == "self"


def _code_names(code: types.CodeType) -> Iterator[str]:
    """The global and attribute names a code object (and the code nested in it) uses."""
    yield from code.co_names
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _code_names(c)


def _methods(classes: tuple, names: set) -> list[types.FunctionType]:
    """The plain functions named in ``names`` that ``classes`` define (dunder methods,
    static and class methods, properties and wrapped functions are not)."""
    out = []
    for cls in classes:
        for klass in cls.__mro__:
            if not _user_object(klass):
                break  # torch.nn.Module and its library subclasses
            for name, value in vars(klass).items():
                if (
                    name in names
                    and not name.startswith("__")
                    and isinstance(value, types.FunctionType)
                ):
                    out.append(value)
    return out


def module_classes(shared: dict) -> tuple:
    """The classes of the user's own ``nn.Module``s among the shared arguments of a map
    (the modules themselves, or in a tuple, list or dict, and all their submodules), in a
    deterministic order."""
    classes: dict[type, None] = {}
    values = list(shared.values())
    while values:
        value = values.pop()
        if isinstance(value, torch.nn.Module):
            kinds: dict[type, None] = {}
            _module_types(value, kinds)
            for kind in kinds:
                if kind not in classes and _user_object(kind):
                    classes[kind] = None
        elif isinstance(value, (tuple, list)):
            values.extend(value)
        elif isinstance(value, dict):
            values.extend(value.values())
    return tuple(classes)


def _module_types(m: torch.nn.Module, kinds: dict) -> None:
    """The types of ``m`` and its submodules into ``kinds``, in ``m.modules()``'s order:
    read from the modules' own dicts (``modules()`` walks generators and prefixes, 3x
    slower; this runs at every map)."""
    seen = set()
    todo = [m]
    while todo:
        mod = todo.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        kinds[type(mod)] = None
        children = mod.__dict__.get("_modules")
        if children:
            todo.extend([c for c in reversed(children.values()) if c is not None])


#: Packages whose objects analysis never looks into.
_LIBRARIES = ("torch", "acrobat", "builtins", "numpy", "greenlet", "typing")


def _user_object(obj) -> bool:
    module = getattr(obj, "__module__", None)
    if module is None:
        return isinstance(obj, (tuple, list, dict))
    return module.split(".")[0] not in _LIBRARIES


# ---- trampolines -------------------------------------------------------------------------

_PLACEHOLDER = 0.123456789e-300  # a constant replaced by the dispatcher in the code object


# calls of an automatic block for which its trace computes nothing per-instance (each then
# runs as written) before a block that has no other trace runs as written for good
# (AutoBlock._idle)
IDLE_CALLS = 32


class AutoBlock(_native.AutoBase if _native is not None else object):  # type: ignore[misc]
    """Dispatcher behind a trampolined function: the block inside f.map, else the code.
    With the C extension, its base's call slot takes a positional call of an enabled
    dispatcher without value parameters straight to the block's fast path (no Python
    frame), and calls ``_call`` for the rest. The fields that slot reads are slots (read
    at their offsets there)."""

    __slots__ = (
        "impl", "block", "disabled", "trampoline", "values", "value_block", "__dict__",
        "__weakref__",
    )  # fmt: skip

    def __init__(self, fn: types.FunctionType):
        self.impl = types.FunctionType(
            fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
        )
        self.impl.__kwdefaults__ = fn.__kwdefaults__
        self.impl.__qualname__ = fn.__qualname__
        self.block = Block(self.impl)
        self.disabled = False
        self.trampoline: types.CodeType | None = None
        # value parameters (see _value_params): their positions, and the block over the
        # rewritten function that takes torch.tensor(p) for p
        self.values: tuple[int, ...] = ()
        self.value_block: Block | None = None
        self.failed_kinds: set[tuple] = set()  # the values' types the value block failed
        self.idle_calls = 0  # calls whose trace computed nothing per-instance (_idle)

    def _call(self, *args, **kwargs):
        rt = graph.RT
        if (
            self.disabled
            or not graph.calls_record(rt)
            or rt.thread != threading.get_ident()  # another thread calling the function
        ):
            return self.impl(*args, **kwargs)
        values = self.values
        if (
            values
            and config.VALUE_PARAMS
            and not kwargs
            and all(i < len(args) and type(args[i]) in SCALAR_DTYPES for i in values)
        ):  # Python numbers where the body reads torch.tensor(p): the tensors instead
            call_args = list(args)
            for i in values:
                call_args[i] = scalar_data(args[i])
            return self._value_call(args, call_args)
        return self._block_call(args, kwargs)

    def _value_call(self, args, call_args):
        """The value block's call with the numbers made data nodes (``call_args``); if
        its body needs the numbers themselves, the plain block's call from now on. (The
        C call slot comes here when the value block's trace is not a hit.)"""
        assert self.value_block is not None
        kinds = tuple([type(args[i]) for i in self.values])
        if kinds in self.failed_kinds:
            return self._block_call(args, {})
        try:
            return self.value_block(*call_args)
        except Exception:
            if graph.RT.tracer is not None:  # pragma: no cover - the tracer resets itself
                raise
            if all(kind is int for kind in kinds):
                # the body needs the number itself (torch.arange(torch.tensor(n))): from
                # now on its torch.tensor is a constant of the block's trace again
                self.values = ()
            else:  # a float where the body indexes: those calls only (ints still batch)
                self.failed_kinds.add(kinds)
        return self._block_call(args, {})

    def _idle(self) -> bool:
        """Whether a call whose trace computes nothing per-instance leaves the block on:
        not once the block has had IDLE_CALLS such calls and no trace that computes
        something, or more than BLOCK_CACHE_SIZE // 4 such signatures."""
        self.idle_calls += 1
        if self.idle_calls > IDLE_CALLS and not self.block.cache:
            return False
        return len(self.block.idle_keys) <= config.BLOCK_CACHE_SIZE // 4

    def _block_call(self, args, kwargs):
        rt = graph.RT
        try:
            return self.block(*args, **kwargs)
        except LazyValueError as exc:
            if rt.tracer is not None:  # pragma: no cover - the tracer resets itself
                raise
            if type(exc) is NoInstanceWork and self._idle():
                # nothing per-instance for these arguments alone (an if's branch not
                # taken leaves the lazy inputs unread, a state still a constant at the
                # first step): as written for calls like this one (Block.idle_keys)
                return self.impl(*args, **kwargs)
            # reads a value, or computes nothing per-instance: as written from now on,
            # its straight-line runs outlined as regions (``k = int(<tensor work>)``: the
            # work before the read one node)
            self.disabled = True
            if AUTO_OUTLINE and not self.impl.__closure__:
                outlined = outline(self.impl)
                if outlined is not None:
                    self.impl.__code__ = outlined.code
            return self.impl(*args, **kwargs)


if _native is None:
    AutoBlock.__call__ = AutoBlock._call  # type: ignore[method-assign]


def _trampoline_code(fn: types.FunctionType, dispatcher) -> types.CodeType:
    sig = inspect.signature(fn)
    params, call = [], []
    star_seen = False
    for p in sig.parameters.values():
        if p.kind is p.POSITIONAL_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD:
            params.append(p.name)
            call.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            params.append("*" + p.name)
            call.append("*" + p.name)
            star_seen = True
        elif p.kind is p.KEYWORD_ONLY:
            if not star_seen:
                params.append("*")
                star_seen = True
            params.append(p.name)
            call.append(f"{p.name}={p.name}")
        else:
            params.append("**" + p.name)
            call.append("**" + p.name)
    if any(p.kind is p.POSITIONAL_ONLY for p in sig.parameters.values()):
        last = max(i for i, p in enumerate(sig.parameters.values()) if p.kind is p.POSITIONAL_ONLY)
        params.insert(last + 1, "/")
    src = (
        f"def {fn.__name__}({', '.join(params)}):\n    return {_PLACEHOLDER!r}({', '.join(call)})\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        module = compile(src, fn.__code__.co_filename, "exec")
    code = next(c for c in module.co_consts if isinstance(c, types.CodeType))
    consts = tuple(
        dispatcher if c == _PLACEHOLDER and type(c) is float else c for c in code.co_consts
    )
    return code.replace(
        co_consts=consts, co_name=fn.__code__.co_name, co_firstlineno=fn.__code__.co_firstlineno
    )


_DISPATCHERS: dict[tuple, AutoBlock] = {}  # _code_key(fn) -> its dispatcher


def _value_params(fn: types.FunctionType, dispatcher: AutoBlock) -> None:
    """Find ``fn``'s value parameters: positional parameters without a default that the
    body reads only as ``torch.tensor(p)`` (``torch`` the module, no other argument) and
    never assigns, such as ``word_id`` in ``word(model, word_id)``. A call that passes
    Python numbers there makes each one a per-instance data node (what the body's
    ``torch.tensor`` would make) and calls a block over a copy of ``fn`` that takes the
    tensor itself: ONE node per call, batched over the instances' numbers, where the
    block would otherwise see no lazy argument and run the body op by op."""
    try:
        node = _function_ast(fn)
        code = fn.__code__
        if node is None or fn.__closure__ or code.co_freevars:
            return
        args = node.args
        positional = args.posonlyargs + args.args
        first_default = len(positional) - len(args.defaults)
        body = node.body
        assigned = {n for stmt in body if isinstance(stmt, (ast.Assign, ast.AnnAssign))
                    for n in _assigned_names(stmt)}  # fmt: skip
        loads = _load_counts(body)
        context = _recompilable(fn, node)
        if context is None:
            return  # the source is not what runs (edited since import)
        imports, flags = context
        positions = []
        for i, a in enumerate(positional[:first_default]):
            if a.arg in assigned or not loads.get(a.arg):
                continue
            unwrap = _ValueUnwrapper(fn, a.arg)
            trial = copy.deepcopy(body)
            trial = [unwrap.visit(s) for s in trial]
            if unwrap.count == loads[a.arg]:
                positions.append(i)
                body = trial
        if not positions:
            return
        node.body = body
        rewritten = _functions(_compiled([*imports, node], code, flags))[node.name]
        impl = types.FunctionType(
            rewritten.replace(co_name=code.co_name, co_qualname=code.co_qualname),
            fn.__globals__,
            fn.__name__,
            fn.__defaults__,
        )
        impl.__qualname__ = fn.__qualname__
    except Exception:  # an optimisation: anything unexpected leaves the calls as they are
        if config.VERIFY:
            raise
        return
    dispatcher.values = tuple(positions)
    dispatcher.value_block = Block(impl)


@contextlib.contextmanager
def auto_blocks(root, shared: dict | None = None) -> Iterator[list]:
    """Route the straight-line functions reachable from ``root`` to blocks while inside
    (``shared``: the map's shared arguments, whose user modules' methods are reachable
    too)."""
    global _MAP_FLOW
    if not config.AUTO_BLOCKS:
        yield []
        return
    swapped = []
    try:
        try:
            if isinstance(root, types.MethodType):  # a bound method decorated: its function
                shared = {**(shared or {}), "self": root.__self__}  # and its object's class
                root = root.__func__
            classes = module_classes(shared) if shared and config.AUTO_METHODS else ()
            candidates, control = _reachable(root, classes)
            flow = flow_names(classes, control)
        except Exception:  # analysis is an optimisation: never let it break a map
            candidates, control, flow = [], [], _NONE
        _MAP_FLOW = flow
        for fn in candidates:
            original = fn.__code__
            dispatcher = _DISPATCHERS.get(_code_key(fn))
            if dispatcher is None:
                dispatcher = _DISPATCHERS[_code_key(fn)] = AutoBlock(fn)
                dispatcher.trampoline = _trampoline_code(fn, dispatcher)
                STANDS_FOR[dispatcher.trampoline] = dispatcher.impl
                _value_params(fn, dispatcher)
            if fn.__defaults__ != dispatcher.impl.__defaults__:
                dispatcher.impl.__defaults__ = fn.__defaults__
                if dispatcher.value_block is not None:
                    dispatcher.value_block.fn.__defaults__ = fn.__defaults__
            assert dispatcher.trampoline is not None
            fn.__code__ = dispatcher.trampoline
            swapped.append((fn, original))
        for fn in control if config.AUTO_REGIONS else ():
            outlined = outline(fn)
            if outlined is not None:
                swapped.append((fn, fn.__code__))
                fn.__code__ = outlined.code
        yield [fn for fn, _ in swapped]
    finally:
        _MAP_FLOW = _NONE
        for fn, original in swapped:
            fn.__code__ = original


# ---- regions -------------------------------------------------------------------------------
#
# A function with control flow (the decorated one, a recursive encoder, a parser loop) can
# still hold straight-line stretches: an LSTM cell written inline after the recursive
# calls. Each maximal run of consecutive assignments whose right-hand sides pass the
# straight-line checks and make at least MIN_REGION_OPS tensor calls is outlined into a
# function of its own (its free locals in, every name it assigns out) and called through a
# RegionBlock, so it records as ONE node, like an @acrobat.block call. The rest of the
# function runs as written. The rewritten code is compiled from the function's source, so
# it is only used where compiling the unmodified source reproduces the running bytecode
# (a source file edited after import is left alone).

MIN_REGION_OPS = 2  # tensor calls a run needs to be worth a block (one op is one node anyway)
SPLIT_DEMANDS = True  # x = int(<tensor work>): the work may join a run (read when outlining)
SPLIT_RETURNS = True  # return <tensor work>: the work may join a run (read when outlining)
SPLIT_STORES = True  # obj.h = <tensor work> / d[k] = ...: the work may join a run (likewise)
SPLIT_LISTS = True  # y = f([<work> for x in xs], ...): the comprehension mapped on its own
# y = g(f(xs)[i]) / return ... with xs a container local: f(xs) split off, the rest a run
SPLIT_PARTS = True
# ... and a returned expression alone (no run before it) is a run of its own
LONE_RETURNS = True
# a run's reads of ``obj.attr`` where ``obj`` is only read that way are made at its call
REGION_ATTRIBUTES = True
# operators in a statement with a tensor call count as tensor calls (read when outlining)
OPERATORS = True
# a run returns only the names the function reads outside it (or a loop may read again):
# its temporaries are not results (read when outlining)
LIVE_OUTPUTS = True
# a run's ``a[i]`` of two locals it does not assign is read at its call (read when outlining),
# and so is ``obj.w[i]`` / ``obj.w[:, i]`` (a lookup into a module's weight by an int)
REGION_SUBSCRIPTS = True
# a number a straight-line body (or a loop's body) uses as an index, ``W[i]`` or ``W[:, i]``,
# is taken as a 0-d tensor like one it reads as ``torch.tensor(i)`` (read when outlining)
INDEX_VALUES = True
# an automatic block whose trace reads a value runs its body outlined (regions) from then on
AUTO_OUTLINE = True
# a straight-line function calling a method with control flow (``forward`` calling
# ``self.encode(tree)``) is searched and outlined as one with control flow, not a block
CONTROL_CALLERS = True
# statements reading a local only ever bound to a list/tuple/dict/set display or
# comprehension stay out of runs (a run given one runs op by op: read when outlining)
SPLIT_CONTAINERS = True
_REGION_BASE = 1e-300  # region k's call is a placeholder constant _REGION_BASE * (k + 3)
_DEMANDS = {"int", "float", "bool", "complex"}  # builtins that read a tensor's value
_DEMAND_METHODS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}
_FUTURE_FLAGS = 0x1FE0000  # co_flags bits of __future__ features (compile() flags)
_REGION_ARGS = (int, float, bool, str, type(None))
LOOKUP_CALLS = True  # f(torch.tensor(x)) outside runs -> ops.lookup_call (read when outlining)
_LOOKUP_PLACEHOLDER = _REGION_BASE * 2  # the call's constant: regions use k + 3 >= 3
# torch.zeros(n) / torch.ones(n) outside runs -> ops.factory_call (read when outlining)
FACTORY_CALLS = True
_FACTORY_PLACEHOLDER = _REGION_BASE * 1
# isinstance(x, torch.Tensor) / torch.is_tensor(x) -> a check that counts a LazyTensor as
# the tensor it stands for (read when outlining)
TYPE_CHECKS = True
_ISINSTANCE_PLACEHOLDER = -_REGION_BASE * 1
_IS_TENSOR_PLACEHOLDER = -_REGION_BASE * 2
_SIZE_FACTORIES = {"zeros", "ones"}  # torch.<name>(size) with one positional size
# x[i] = v on a local the function owns -> x = ops.put_item(v, x, i) (read when outlining)
ITEM_WRITES = True
_PUT_PLACEHOLDER = -_REGION_BASE * 3
_SLICE_PLACEHOLDER = -_REGION_BASE * 4  # the builtin slice, whatever the module calls it
# for t in range(...) whose counter is read only as ``x[t]`` (x a local the body does not
# touch otherwise) -> a loop over the rows x[t] would read, which can be a scan (read when
# outlining); ``_index_loop``
INDEX_LOOPS = True
# ``for i in range(3): <assignments that could join a run>`` (a literal trip count, a body
# that reads no value) -> its body written out three times, ``i`` a constant in each copy,
# so the loop joins the straight-line code around it: a GNN's message passing rounds are
# one block with the lookups before and the readout after (read when outlining); longer
# loops, or bodies of more tensor calls, stay loops (a scan)
UNROLL_LOOPS = True
UNROLL_TRIPS = 8  # at most this many trips ...
UNROLL_OPS = 48  # ... and this many tensor calls written out in all
_ROWS_PLACEHOLDER = -_REGION_BASE * 5
# a run's reads of ``module.NAME`` (a user module's constant: ``torch.zeros(P.HIDDEN)``) are
# made at its call, as REGION_ATTRIBUTES does for a local's attributes; the module itself
# would keep the statement out of runs (a trace would fix the value; read when outlining)
MODULE_ATTRIBUTES = True
# a loop's temporary read after it (its last value) is one more output of the scan's step
# (read when outlining): ``_Rewriter._scan``
SCAN_LASTS = True
# a run's parameter that it writes into, given a real tensor the instances share, is
# read as a row (RegionBlock._converted; read at every call)
STATE_ROWS = True
# for t in range(...) writing x[t] = v once a step, x a local the function owns that the
# loop touches no other way -> the values appended to a list, written after the loop in
# one op (ops.put_rows; read when outlining): ``_row_writes``
LOOP_ROW_WRITES = True
_KEEP_PLACEHOLDER = -_REGION_BASE * 6
_PUT_ROWS_PLACEHOLDER = -_REGION_BASE * 7
_RANGE_PLACEHOLDER = -_REGION_BASE * 8
# acc += v (-=, *=, /=) on a local nothing else can see (a number or a tensor the function
# made: ``_accumulators``) -> acc = ops.augment(acc, v, "+"): an assignment, which runs and
# scans take (read when outlining)
AUGMENTED = True
_AUG_PLACEHOLDER = -_REGION_BASE * 9
_UPDATE_PLACEHOLDER = -_REGION_BASE * 10  # acc.add_(v) -> acc = ops.update(acc, "add_", v)
# x[index] op= v (+ - * /) on a name the function does not own (a layer's output, an
# argument) -> ops.update_item(x, index, v, op): Python's in-place op on the item, a view,
# could not be recorded; update_item writes the item back out of place, or makes a
# boolean mask's update a where (read when outlining): ``_ItemUpdates``
ITEM_UPDATES = True
_ITEM_UPDATE_PLACEHOLDER = -_REGION_BASE * 11
_IS_LAZY_PLACEHOLDER = -_REGION_BASE * 12
_ITEM_UPDATED_PLACEHOLDER = -_REGION_BASE * 13  # an owned x[mask] += v: ops.item_updated
# print(...) -> lazy_print(print, ...): lazy arguments made strings before the line is
# written (read when outlining, with TYPE_CHECKS)
PRINTS = True
_PRINT_PLACEHOLDER = -_REGION_BASE * 14
# for layer in self.layers: <assignments that could join a run> -> the loop joins the run
# around it, the region running it as written (its trace writes it out, keyed by the
# module, whose state a trace checks: an appended layer retraces), behind a check that the
# container is a module (all_modules; else the code as before: the loop a scan or a region
# per trip). Read when outlining: ``_Rewriter._loop_ops``
LOOP_RUNS = True
# ... and so do loops over a bare name (``for layer in layers``, a module passed in): most
# such loops go over tensors (``for x in xs``), where the guard fails and the loop is a
# scan as before, at the cost of the guard's call
LOOP_NAMES = True
# ... and so do loops whose bodies hold ifs on what a trace may fix (``if i < len(self.
# layers) - 1: x = torch.relu(x)``, ``if self.residual:``; ``_Rewriter._static_test``)
LOOP_BRANCHES = True
_STATIC_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device"})
# an if between the statements of a run joins it (``h = self.fc1(x); if self.use_norm:
# h = self.norm(h); return self.fc2(torch.relu(h))``: one region, not three nodes) where
# its branches are assignments that could join a run (and such ifs) and its test either
# reads nothing the run assigns (then it is evaluated at the region's call, as written,
# and passed as a bool: the trace is keyed by the branch taken) or reads what a trace may
# fix (``h.shape[0] > 1``, ``h is None``, a module's flag); ``_Rewriter._if_ops``. Read
# when outlining
RUN_BRANCHES = True
# tensor methods an if's test may call: what they return is fixed by a trace's shapes
_META_METHODS = frozenset({"dim", "size", "numel", "ndimension", "is_floating_point", "is_complex"})
# builtins an if's test evaluated at a region's call may call (no side effects)
_TEST_BUILTINS = ("len", "isinstance", "hasattr", "getattr", "callable")
_MODULES_PLACEHOLDER = -_REGION_BASE * 15
# calls a run may hold that are no tensor op of their own (a write or an augmented
# assignment counts as one: _ops)
_WRITE_PLACEHOLDERS = (
    _PUT_PLACEHOLDER, _SLICE_PLACEHOLDER, _KEEP_PLACEHOLDER, _AUG_PLACEHOLDER, _UPDATE_PLACEHOLDER
)  # fmt: skip
_ONE_OP_PLACEHOLDERS = (_PUT_PLACEHOLDER, _AUG_PLACEHOLDER, _UPDATE_PLACEHOLDER)


class Outlined:
    """A function's code with its straight-line runs outlined into region calls."""

    def __init__(self, code: types.CodeType, regions: list):
        self.code = code
        self.regions = regions  # RegionBlock per outlined run, in source order


_OUTLINED: dict[tuple, Outlined | None] = {}  # _code_key(fn) -> its outline


def outline(fn) -> Outlined | None:
    """``fn``'s code with straight-line runs outlined (cached per _code_key, and per the
    names of :data:`_MAP_FLOW` it calls as methods); None if it has none or cannot be
    rewritten safely."""
    flow = _NONE  # (what _Rewriter._control_call reads of _MAP_FLOW: fn's method names)
    if _MAP_FLOW and isinstance(fn, types.FunctionType):
        flow = _MAP_FLOW & _method_calls(fn)
    key = _code_key(fn) if not flow else (*_code_key(fn), flow)
    if key in _OUTLINED:
        return _OUTLINED[key]
    try:
        result = _outline(fn)
    except Exception:  # an optimisation: anything unexpected leaves the function alone
        if config.VERIFY:
            raise
        result = None
    _OUTLINED[key] = result
    return result


_NONE: frozenset = frozenset()
#: While a map's functions are outlined (auto_blocks): the names of the methods with control
#: flow of the map's module classes (:func:`flow_names`). A call ``m.name(...)`` of one of
#: them is a control call even where ``m`` is a local, unknown to the analysis (a model
#: passed as an argument: ``h = net.encode(tree)``), as :func:`_demote_callers` takes such
#: calls by name; a run would run the method's recursion inside its trace.
_MAP_FLOW: frozenset = _NONE
ARG_METHODS = True  # (read when outlining)


_REGION_BASES: tuple = (AutoBlock,) if _native is None else (_native.RegionBase, AutoBlock)


class RegionBlock(*_REGION_BASES):  # type: ignore[misc]
    """Dispatcher of one outlined run: a block when it gets a lazy tensor and only
    tensors, modules and scalars; the run's own code otherwise. With the C extension its
    base's call slot makes the common call (lazy tensors, scalars and code-like objects
    seen before, the trace cached) without a Python frame; ``_region_call`` is the whole
    call in Python."""

    def __init__(
        self,
        fn: types.FunctionType,
        tensor_args: tuple[int, ...] = (),
        stacked: tuple = (),
        index_args: tuple[int, ...] = (),
        state_args: tuple[int, ...] = (),
    ):
        super().__init__(fn)
        self.hits = 0
        # parameters read only as an index: a Python int there is made a per-instance
        # data node when the run is a block call (one trace for all ints)
        self.index_args = index_args
        # parameters the run writes into (analysis._written): a real tensor the instances
        # share there (a mask's hoisted torch.zeros(n)) is read as a row
        # (executor.constant), so the first call's traces of every size are one padded
        # family, as the later calls' are
        self.state_args = state_args
        # parameters the run reads only as torch.stack(p): a list there is an argument
        # (keyed by its length; acrobat/padding.py pads the lengths into one batch)
        self.stacked = stacked
        self.misses = 0
        # positions where the call passes x for the run's torch.tensor(x) (_FactoryHoister)
        self.tensor_args = tensor_args
        # id -> object of arguments found _code_like (modules, cell tuples): they stay so,
        # and the entry keeps the object alive so its id is not reused
        self.code_like: dict[int, object] = {}

    def _region_call(self, *args):
        rt = graph.RT
        if self.tensor_args:
            args = self._tensors(rt, args)
        if self.disabled or not graph.calls_record(rt):
            return self.impl(*args)
        lazy = False
        known = self.code_like
        stacked = {id(args[i]) for i in self.stacked if i < len(args)} if (
            self.stacked and config.PAD_RAGGED
        ) else ()
        for a in args:
            t = type(a)
            if t is graph.LazyTensor:
                lazy = True
            elif t in _REGION_ARGS or id(a) in known:
                continue
            elif _code_like(a):
                _remember(known, a)
            elif _state_tuple(a):  # a (named)tuple of tensors (an LSTM's State(h, c)):
                lazy = True  # keyed by its type and fields, as a block's argument
            elif t is list and id(a) in stacked and a and _all_lazy(a):
                # a list of per-instance tensors the run only stacks: a trace per
                # length, padded into one batch (padding.View's packed list)
                lazy = True
            elif t is list and id(a) in stacked and not a:
                continue  # (empty: stacked in a branch not taken, RUN_BRANCHES)
            else:
                lazy = False  # a container or object: its structure would key the trace
                break
        if not lazy:
            self.misses += 1
            if self.misses > 32 and not self.hits:
                self.disabled = True  # never per-instance work: skip the check from now on
            return self.impl(*args)
        self.hits += 1
        if self.index_args or self.state_args:
            args = self._converted(graph.RT, args)
        return self._region_block(*args)

    def _converted(self, rt, args: tuple) -> tuple:
        """``args`` with the Python ints at ``index_args`` made per-instance data nodes, and
        the shared factory constants at ``state_args`` read as rows."""
        out = list(args)
        for i in self.index_args:
            if i < len(out) and type(out[i]) is int:
                out[i] = scalar_data(out[i], deferred=True)
        if STATE_ROWS and config.CONSTANT_STATES:
            for i in self.state_args:
                v = out[i] if i < len(out) else None
                if type(v) is torch.Tensor and not v.requires_grad:
                    out[i] = executor.constant(rt, v)
        return tuple(out)

    def _region_block(self, *args):
        """The block call of a hit (arguments converted, counted)."""
        out = AutoBlock.__call__(self, *args)
        if _retraces(self.block):
            self.disabled = True  # a new trace per call: scalars that change every time
        elif self.block.sizes_apart and config.PAD_RAGGED:
            # per-instance values with two sizes that vary apart (a pair's source and
            # target lengths): a trace per pair of sizes, batches of about one; op by op,
            # each op batches with those of its own shape (packed sequences: all of them)
            self.disabled = True
        return out

    def _tensors(self, rt, args: tuple) -> list:
        """``args`` with ``torch.tensor(x)`` made of each x at ``tensor_args``: inside a map
        a data node recorded directly where x is a number or a flat list of them
        (:func:`acrobat.ops.value_data`, what the recording mode would make, without its
        dispatch: ~1 µs a call), else through ``torch.tensor`` as the source wrote it."""
        out = list(args)
        direct = (
            rt is not None
            and rt.fiber is not None
            and rt.tracer is None
            and rt.thread == threading.get_ident()
        )
        for i in self.tensor_args:
            made = value_data(out[i]) if direct else None
            out[i] = torch.tensor(out[i]) if made is None else made
        return out


if _native is None:
    RegionBlock.__call__ = RegionBlock._region_call  # type: ignore[method-assign]
else:
    _native.setup_calls(graph, sys.modules[__name__], torch)
    # value_data's common cases in C (ops.value_data is the specification)
    _native.setup_values(TENSOR, torch.Size([]), torch.int64, torch.Size, torch.get_default_dtype)


def _retraces(block: Block) -> bool:
    """Whether an outlined run keeps making traces: more than BLOCK_CACHE_SIZE // 4 of
    them in one map (a scalar that changes from call to call keys a new trace). A run
    serving many shapes in one process (a test suite, a notebook with several model
    sizes) makes as many traces, but a few per map, each reused by its calls."""
    return block.run_traces > config.BLOCK_CACHE_SIZE // 4


class ScanBlock(_native.ScanBase if _native is not None else object):  # type: ignore[misc]
    """Dispatcher of an outlined loop (``for _ in range(...)``, ``for x in xs`` or
    ``for x, y in zip(xs, ys)`` over straight-line assignments and appends; see
    ``_Rewriter._scan_call``). Called as ``scan(iterable, lists, *carried, *free)``
    (for zip, ``iterable`` is the tuple of sequences): inside f.map, records the loop as
    ONE node (acrobat/scan.py), appends each step's outputs to ``lists`` and returns the
    carried names' final values; None (anything it cannot take: outside a map, fewer
    than two steps, elements that are not lazy tensors, a body that reads a value) and
    the caller runs the loop as written. With the C extension the common case (loops
    over lazy tensors, the body's trace cached, its states lazy or shared constants)
    runs in ``_native.ScanBase``'s call slot and the rest here, ``_scan_call``."""

    def __init__(
        self,
        fn: types.FunctionType,
        carried: int,
        appends: int,
        sequences: int,
        reverse: bool = False,
        values: tuple = (),
    ):
        self.step = RegionBlock(fn)  # the body: a peeled first step, and the trace
        self.carried = carried
        self.appends = appends
        self.sequences = sequences  # elements per step: 0 for a counted loop
        self.counted = sequences == 0
        self.reverse = reverse  # the loop runs over reversed(items)
        # sequences whose elements the body reads only as torch.tensor(x) (the outlined
        # body takes that tensor): Python numbers of one type
        self.values = values
        self.disabled = False
        self.impl = self.step.impl

    def _scan_call(self, items, lists: tuple, *values):
        rt = graph.RT
        if (
            self.disabled
            or not config.AUTO_SCANS
            or not graph.calls_record(rt)
            or rt.thread != threading.get_ident()
        ):
            return None
        if self.counted:
            if type(items) is not range:
                return None
            seqs: list = []
            count = len(items)
        else:
            seqs = [items] if self.sequences == 1 else list(items)
            for j, seq in enumerate(seqs):
                if type(seq) is graph.LazyTensor and seq.ndim and j not in self.values:
                    # a per-instance tensor's rows (``for t in tokens``): unbound once (what
                    # the loop as written would do), its rows the loop's elements
                    seq = seqs[j] = list(seq.unbind(0))
                if type(seq) is not list and type(seq) is not tuple:
                    return None  # not consumed: the loop as written iterates it
                if not seq:
                    continue  # no steps: declined below
                if len(set(map(type, seq))) != 1:
                    return None
                kind = type(seq[0])
                if kind not in SCALAR_DTYPES if j in self.values else kind is not graph.LazyTensor:
                    return None  # numbers where the body reads torch.tensor(x), else lazies
            if self.reverse:
                seqs = [seqs[0][::-1]]
            if len(seqs) == 1:
                count = len(seqs[0])
            else:
                count = min(map(len, seqs))
                if any(len(seq) != count for seq in seqs):
                    seqs = [seq[:count] for seq in seqs]  # zip stops at the shortest
        if count < 2:
            return None
        k = self.carried
        known = self.step.code_like
        for a in values[k:]:
            if type(a) is graph.LazyTensor or type(a) in _REGION_ARGS or id(a) in known:
                continue
            if not _code_like(a):
                return None  # an object whose state a trace would fix
            _remember(known, a)
        if k and not _all_lazy(values[:k]):
            if config.CONSTANT_STATES:
                # a state that starts as a shared constant (torch.zeros(h)): read as a row
                # (or one a block trace made and returns, in a later map)
                made, traced = rt.factory_keys, graph.TRACE_FACTORIES
                values = tuple(
                    executor.constant(rt, v)
                    if i < k and (id(v) in made or id(v) in traced)
                    else v
                    for i, v in enumerate(values)
                )
            if not all(isinstance(v, _TENSORS) or type(v) in _NUMBERS for v in values[:k]):
                # a container state (a dict of tensors): its items come in through the
                # body's region of each step (read at its call), the loop as written
                return None
            if not _all_lazy(values[:k]):
                # a state that starts as another real tensor, or as a number (``loss =
                # 0`` before ``loss += ...``, analysis.AUGMENTED): the first step alone
                values = (*self._finish(1, seqs, lists, values), *values[k:])
                seqs = [seq[1:] for seq in seqs]
                count -= 1
                if count < 2 or not _all_lazy(values[:k]):
                    return self._finish(count, seqs, lists, values)
        heads = [seq[0] for seq in seqs]
        for j in self.values:  # the tensor the body gets: a constant no node reads
            heads[j] = scalar_data(heads[j], deferred=True)
        first = (*heads, *values)
        try:
            trace, inputs = self.step.block.trace_for(rt, first)
        except LazyValueError:
            if rt.tracer is not None:  # pragma: no cover - the tracer resets itself
                raise
            self.disabled = True  # the body reads a value: the loop as written
            return self._finish(count, seqs, lists, values)
        if _retraces(self.step.block):
            self.disabled = True  # a new trace per call: scalars that change every time
        if trace is None:
            return self._finish(count, seqs, lists, values)
        scan = trace.scan
        if scan is None:
            scan = Scan.make(trace, k, self.appends, self.sequences, first, inputs, self.values)
            trace.scan = scan = scan or False
        if scan is False or any(len(set(map(_KEY, seqs[j]))) != 1 for j in scan.lazy):
            return self._finish(count, seqs, lists, values)  # elements of different shapes
        return scan.record(rt, inputs, seqs, count, lists)

    def _finish(self, count: int, seqs: list, lists: tuple, values: tuple) -> tuple:
        """The first ``count`` steps one by one, the body as a block per step: a peeled
        first step, or all steps when the loop cannot be one node."""
        k = self.carried
        free = values[k:]
        state = values[:k]
        numbers = self.values
        for t in range(count):
            elements = [
                torch.tensor(seq[t]) if j in numbers else seq[t] for j, seq in enumerate(seqs)
            ]
            outs = self.step(*elements, *state, *free)
            state = outs[:k]
            for out, value in zip(lists, outs[k:]):
                out.append(value)
        return tuple(state)


if _native is None:
    ScanBlock.__call__ = ScanBlock._scan_call  # type: ignore[method-assign]
else:
    _native.setup_scans(config, executor)


_KEY = operator.attrgetter("key")
_NUMBERS = (int, float)
_TENSORS = (graph.LazyTensor, torch.Tensor)


def _all_lazy(values: tuple) -> bool:
    """Whether every one of ``values`` is a LazyTensor."""
    return all(type(v) is graph.LazyTensor for v in values)


_CALLABLES = (torch.nn.Module, types.FunctionType, AutoBlock, Block)
_CODE_LIKE_KEPT = 64  # per region: the models pass one or two (the model, its cells)


def _remember(known: dict, a) -> None:
    """Keep a _code_like verdict for ``a`` (the entry keeps it alive, so its id is not
    reused). Not for tensors: a real state such as a map's ``torch.zeros(h)`` is a new
    object every map and cheap to check, and would fill the table (and stay alive)."""
    if len(known) < _CODE_LIKE_KEPT and not isinstance(a, torch.Tensor):
        known[id(a)] = a


def _state_tuple(a) -> bool:
    """A namedtuple holding a lazy tensor, its other fields tensors or scalars (an LSTM's
    State(h, c)); a plain tuple of tensors or Nones, one lazy (an instance given as
    (adjacency, features), or (tokens, mask or None), unpacked inside the run; not with
    numbers, which code may turn into tensors that the run's trace would then hold)."""
    plain = type(a) is tuple
    if not plain and not is_namedtuple(a):
        return False
    lazy = False
    for v in a:
        t = type(v)
        if t is graph.LazyTensor:
            lazy = True
        elif not (isinstance(v, torch.Tensor) or v is None or (t in _REGION_ARGS and not plain)):
            return False
    return lazy


def _code_like(a) -> bool:
    """A region argument keyed by identity without risk: a tensor, module or function, or
    a small tuple of modules, functions and scalars (a namedtuple of cells)."""
    if isinstance(a, (torch.Tensor, *_CALLABLES)):
        return True
    if isinstance(a, tuple) and len(a) <= 16:
        return all(type(v) in _REGION_ARGS or isinstance(v, _CALLABLES) for v in a)
    return False


def _comprehension_only(node: ast.FunctionDef) -> set:
    """Names ``node`` binds only as comprehension variables. From Python 3.12 on
    (inlined comprehensions, PEP 709) they are among the code's ``co_varnames``, where
    3.11 kept them in the comprehension's own code: the function's locals leave them
    out, or every statement with a comprehension would look like one shadowing a local."""
    bound = _comprehension_targets(node)
    targets = {id(t) for t in bound}
    elsewhere: set = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store) and id(sub) not in targets:
            elsewhere.add(sub.id)
        elif isinstance(sub, ast.arg):
            elsewhere.add(sub.arg)
    return {t.id for t in bound} - elsewhere


def _outline(fn) -> Outlined | None:
    if not isinstance(fn, types.FunctionType) or fn.__closure__:
        return None
    code = fn.__code__
    if code.co_freevars:  # (cell variables are fine: comprehensions capture locals)
        return None
    if code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR):
        return None
    node = _function_ast(fn)
    if node is None:
        return None
    for sub in ast.walk(node):
        if sub is not node and isinstance(
            sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
        ):
            return None  # nested scopes: names could be bound where the rewrite cannot see
        if isinstance(sub, (ast.Global, ast.Nonlocal)):
            return None
    context = _recompilable(fn, node)
    if context is None:
        return None  # the source is not what runs (edited since import)
    imports, flags = context
    # (with the names a comprehension captures: on 3.11 those are cells, not varnames, and
    # a statement reading ``h`` beside ``[f(h) for f in fs]`` was kept out of every run)
    local = set(code.co_varnames) | set(code.co_cellvars)
    owned = _owned_tensors(node, local) if ITEM_WRITES else set()
    accumulators = _accumulators(node, local) if AUGMENTED else set()
    # (first: a loop's acc += v is then an assignment the row writes' checks allow)
    augmented = _rewrite_augmented(node, accumulators) if accumulators else 0
    # (first: the loops' row writes leave the loop, the rest of its writes stay in place)
    ranges, lists = (
        _rewrite_row_writes(fn, node, owned, local) if owned and LOOP_ROW_WRITES else ([], [])
    )
    # (before the runs are found: a rewritten write, x = put_item(v, x, i), may join one)
    writes = _rewrite_item_writes(node, owned) if owned else 0
    writes += len(ranges) + augmented
    # (after: the owned locals' writes are assignments now; what is left is the others')
    writes += _rewrite_item_updates(node) if ITEM_UPDATES else 0
    local.update(ranges, lists)
    rewriter = _Rewriter(fn, local - _comprehension_only(node))
    rewriter.ranges = set(ranges)
    rewriter.rewrite(node)
    lookups = _rewrite_lookups(node) if LOOKUP_CALLS or FACTORY_CALLS else 0
    checks = _rewrite_type_checks(node) if TYPE_CHECKS else 0
    if not rewriter.regions and not lookups and not checks and not writes:
        return None
    body = [*imports, node, *(r.definition for r in rewriter.regions)]
    codes = _functions(_compiled(body, code, flags))
    dispatchers: dict = {
        _LOOKUP_PLACEHOLDER: lookup_call,
        _FACTORY_PLACEHOLDER: factory_call,
        _ISINSTANCE_PLACEHOLDER: lazy_isinstance,
        _IS_TENSOR_PLACEHOLDER: lazy_is_tensor,
        _PUT_PLACEHOLDER: put_item,
        _SLICE_PLACEHOLDER: slice,
        _ROWS_PLACEHOLDER: index_rows,
        _KEEP_PLACEHOLDER: keep_row,
        _PUT_ROWS_PLACEHOLDER: put_rows,
        _RANGE_PLACEHOLDER: range,
        _AUG_PLACEHOLDER: augment,
        _UPDATE_PLACEHOLDER: update,
        _ITEM_UPDATE_PLACEHOLDER: update_item,
        _IS_LAZY_PLACEHOLDER: is_lazy,
        _ITEM_UPDATED_PLACEHOLDER: item_updated,
        _PRINT_PLACEHOLDER: lazy_print,
        _MODULES_PLACEHOLDER: all_modules,
    }
    regions = []
    for r in rewriter.regions:
        lines = f"line {r.first}" if r.first == r.last else f"lines {r.first}-{r.last}"
        where = f"{fn.__name__} ({code.co_filename.rsplit('/', 1)[-1]}, {lines})"
        region_code = _dispatched(codes[r.name], dispatchers)  # (its writes' put_item)
        # (named as the function its lines are in: errors and tracebacks say ``in f``)
        region_code = region_code.replace(co_name=code.co_name)
        region_fn = types.FunctionType(region_code, fn.__globals__, where)
        region_fn.__qualname__ = where  # names the block op: errors and stats say where
        dispatcher: object
        if r.carried or r.appends:
            dispatcher = ScanBlock(
                region_fn, r.carried, r.appends, r.sequences, r.reverse, r.values
            )
        else:
            dispatcher = RegionBlock(
                region_fn, r.tensor_args, r.stacked, r.index_args, r.state_args
            )
        dispatchers[r.placeholder] = dispatcher
        regions.append(dispatcher)
    main = _dispatched(codes[node.name], dispatchers)
    # (co_firstlineno stays the recompiled def's: line numbers are stored relative to it,
    # so the original's, a decorator's line, moved every reported line up by one)
    new = main.replace(co_name=code.co_name, co_qualname=code.co_qualname)
    if new.co_freevars:  # pragma: no cover - no nested scopes, so none
        return None
    return Outlined(new, regions)


def _dispatched(code: types.CodeType, dispatchers: dict) -> types.CodeType:
    """``code`` with each placeholder constant replaced by its dispatcher, in the code of
    its comprehensions too (their own code objects, among its constants: the type checks
    are rewritten inside them)."""
    consts = tuple(
        dispatchers.get(c, c)
        if type(c) is float
        else _dispatched(c, dispatchers)
        if type(c) is types.CodeType
        else c
        for c in code.co_consts
    )
    return code.replace(co_consts=consts)


class _Lookups(ast.NodeTransformer):
    """``f(torch.tensor(x))`` -> ``<lookup_call>(f, torch.tensor, x)`` and ``torch.zeros(n)``
    -> ``<factory_call>(torch.zeros, n)`` (see _rewrite_lookups)."""

    def __init__(self):
        self.count = 0

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        if node.keywords or len(node.args) != 1 or isinstance(node.args[0], ast.Starred):
            return node
        if FACTORY_CALLS and _torch_attr(node.func) in _SIZE_FACTORIES:
            self.count += 1
            call = ast.Call(
                func=ast.Constant(_FACTORY_PLACEHOLDER), args=[node.func, node.args[0]], keywords=[]
            )
            return _located(call, node)
        if not LOOKUP_CALLS or not _is_lookup(node):
            return node
        inner = node.args[0]
        assert isinstance(inner, ast.Call)  # (_is_lookup: torch.tensor(x))
        self.count += 1
        call = ast.Call(
            func=ast.Constant(_LOOKUP_PLACEHOLDER),
            args=[node.func, inner.func, inner.args[0]],
            keywords=[],
        )
        return _located(call, node)

    def _scope(self, node):  # another code object: its constants are not the function's
        return node

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _scope
    visit_Lambda = visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope


def _is_lookup(expr) -> bool:
    """Whether ``expr`` is an ``f(torch.tensor(x))`` that _rewrite_lookups routes (a run of
    only such statements stays as written: the lookup records one node, as a block the
    tensor and the call record two)."""
    if not (
        isinstance(expr, ast.Call)
        and not expr.keywords
        and len(expr.args) == 1
        and not isinstance(expr.args[0], ast.Starred)
        and _callee(expr.func)
    ):
        return False
    inner = expr.args[0]
    return (
        isinstance(inner, ast.Call)
        and not inner.keywords
        and len(inner.args) == 1
        and not isinstance(inner.args[0], ast.Starred)
        and isinstance(inner.func, ast.Attribute)
        and inner.func.attr == "tensor"
        and isinstance(inner.func.value, ast.Name)
    )


def _has_lookup(expr) -> bool:
    """Whether ``expr`` holds an ``f(torch.tensor(x))`` that _rewrite_lookups would route."""
    return any(_is_lookup(sub) for sub in ast.walk(expr))


def _torch_attr(func) -> str | None:
    """``name`` where ``func`` is written ``torch.name``, else None."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.attr if func.value.id == "torch" else None
    return None


def _callee(func) -> bool:
    """A callee worth routing: a name or attribute chain (``model.emb``, ``emb``) not
    rooted at ``torch`` (whose functions are never an embedding)."""
    while isinstance(func, ast.Attribute):
        func = func.value
    return isinstance(func, ast.Name) and func.id != "torch"


def _rewrite_lookups(node: ast.FunctionDef) -> int:
    """Rewrite ``f(torch.tensor(x))`` in ``node``'s own code (not in outlined runs, whose
    calls are traced as blocks, nor in comprehensions) to ``ops.lookup_call(f,
    torch.tensor, x)``: an embedding lookup of a Python number recorded in one call (a
    TreeLSTM leaf's ``model.emb(torch.tensor(tree.word_id))``). The evaluation order is
    the same (``f``, ``torch.tensor``, ``x``), and anything but an ``nn.Embedding`` given
    an int is called as written. Likewise ``torch.zeros(n)`` / ``torch.ones(n)`` become
    ``ops.factory_call(torch.zeros, n)``, which reads the map's shared constant without
    the mode's dispatch (a tree generator's ``h_f = torch.zeros(h)`` per sibling chain).
    Returns how many calls were rewritten."""
    lookups = _Lookups()
    node.body = [lookups.visit(stmt) for stmt in node.body]
    return lookups.count


# ---- writes into part of a tensor the function owns --------------------------------------
# ``x[i] = v`` becomes ``x = ops.put_item(v, x, i)`` (the value, the tensor and the index
# evaluated in eager's order), ``x[i] += v`` becomes ``x = ops.put_item(x[i] + v, x, i)``
# where ``i`` reads names and constants only (it is evaluated twice). Inside a map that
# records the write out of place and rebinds ``x``; elsewhere it writes in place. Exact
# only where nothing else can see ``x``'s tensor: ``x`` is a local (not a parameter) bound
# only to tensors the function makes (a torch factory, torch.cat/stack, a clone), and
# every read of it uses the value at once (arithmetic, a torch function or method that
# returns a new tensor, a metadata attribute, ``return``, a layer ``self.fc(x)`` whose
# result is used at once in turn), never keeping a view or the tensor itself (``y = x``,
# ``x[0]`` kept, ``x.view(...)``, a list, a call of a function that could keep it).

_OWNING_FACTORIES = frozenset(
    {"zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like",
     "tensor", "arange", "eye", "linspace", "logspace", "rand", "randn", "randint",
     "rand_like", "randn_like", "randint_like", "stack", "cat", "concat", "concatenate",
     "clone", "where", "tril", "triu", "diag", "diag_embed"}
)  # fmt: skip
_OWNING_METHODS = frozenset(
    {"clone", "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"}
)  # fmt: skip
# torch functions whose result may be (a view of) an operand, or that write into one
_ALIASING = frozenset(
    {"narrow", "select", "split", "split_with_sizes", "chunk", "unbind", "tensor_split",
     "hsplit", "vsplit", "dsplit", "t", "transpose", "swapaxes", "swapdims", "permute",
     "movedim", "moveaxis", "reshape", "view_as_real", "view_as_complex", "squeeze",
     "unsqueeze", "flatten", "unflatten", "ravel", "diagonal", "as_strided", "detach",
     "real", "imag", "conj", "resolve_conj", "resolve_neg", "broadcast_to",
     "broadcast_tensors", "atleast_1d", "atleast_2d", "atleast_3d", "as_tensor", "asarray",
     "dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d",
     "dropout3d", "identity", "contiguous", "align_tensors", "expand_as", "view_as"}
)  # fmt: skip
# tensor methods whose result is always a new tensor (or a Python value) and that do not
# write into the tensor
_FRESH_METHODS = frozenset(
    {"sum", "mean", "max", "min", "argmax", "argmin", "amax", "amin", "prod", "std", "var",
     "norm", "tolist", "item", "clone", "masked_fill", "softmax", "log_softmax", "exp",
     "log", "tanh", "sigmoid", "relu", "abs", "neg", "sqrt", "rsqrt", "pow", "add", "sub",
     "mul", "div", "matmul", "mm", "mv", "dot", "eq", "ne", "gt", "lt", "ge", "le", "any",
     "all", "nonzero", "cumsum", "cumprod", "logsumexp", "topk", "sort", "argsort",
     "numel", "size", "dim", "gather", "index_select", "masked_select", "where", "count_nonzero",
     "isinf", "isnan", "isfinite", "logical_not", "logical_and", "logical_or", "sign",
     "floor", "ceil", "round", "clamp", "maximum", "minimum", "square", "equal", "allclose"}
)  # fmt: skip
_METADATA = frozenset(
    {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "is_sparse"}
)  # fmt: skip
_VALUE_BUILTINS = frozenset(
    {"len", "print", "int", "float", "bool", "str", "repr", "isinstance", "format"}
)  # fmt: skip


def _parents_and_params(node: ast.FunctionDef) -> tuple[dict, set]:
    """(id of each node under ``node`` -> its parent, the function's parameter names)."""
    parents: dict = {}
    for parent in ast.walk(node):
        for child in ast.iter_child_nodes(parent):
            parents[id(child)] = parent
    a = node.args
    params = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if p}
    return parents, params


def _owned_tensors(node: ast.FunctionDef, local: set) -> set[str]:
    """The locals whose item writes the function may rewrite (see the section comment),
    decided on its source before anything in it is rewritten."""
    parents, params = _parents_and_params(node)
    written = set()
    for sub in ast.walk(node):
        target = None
        if isinstance(sub, ast.Assign) and len(sub.targets) == 1:
            target = sub.targets[0]
        elif isinstance(sub, ast.AugAssign):
            target = sub.target
        if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
            written.add(target.value.id)
    owned = {name for name in written if name in local and name not in params}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in owned and not _owned_use(sub, parents):
            owned.discard(sub.id)
    return owned


def _owned_use(name: ast.Name, parents: dict) -> bool:
    """Whether this occurrence of an owned local keeps it unshared (see _owned_tensors)."""
    parent = parents.get(id(name))
    if isinstance(name.ctx, ast.Store):
        return (
            isinstance(parent, ast.Assign)
            and len(parent.targets) == 1
            and parent.targets[0] is name
            and _owning(parent.value)
        )
    if isinstance(name.ctx, ast.Del):
        return False
    if isinstance(parent, ast.AugAssign) and parent.target is name:
        return True  # x += v: the tensor updated, no alias made
    if _in_place_statement(name, parent, parents):
        return True  # x.mul_(0.5) on a line of its own: the same
    if isinstance(parent, ast.Subscript) and parent.value is name:
        grand = parents.get(id(parent))
        if isinstance(parent.ctx, ast.Store):  # the write itself
            return (
                isinstance(grand, ast.Assign) and len(grand.targets) == 1
            ) or isinstance(grand, ast.AugAssign)
        return _used_at_once(parent, parents)  # x[i]: a view, used right away or not at all
    return _used_at_once(name, parents)


def _in_place_statement(name: ast.Name, parent, parents: dict) -> bool:
    """Whether ``name`` is the tensor of an in-place method call that is a statement of
    its own (``x.mul_(0.5)``, ``x.zero_()``): its result (``x`` itself) goes nowhere, so
    the call makes no alias; the update reaches the tensor ``x`` names then (a lazy
    value is updated as written, graph/ops ``in_place``)."""
    if not isinstance(parent, ast.Attribute) or parent.value is not name:
        return False
    attr = parent.attr
    if not attr.endswith("_") or attr.startswith("_"):
        return False
    call = parents.get(id(parent))
    return (
        isinstance(call, ast.Call)
        and call.func is parent
        and isinstance(parents.get(id(call)), ast.Expr)
    )


def _used_at_once(expr, parents: dict) -> bool:
    """Whether the value of ``expr`` (an owned tensor or a view of it) is consumed where it
    stands: an operand of arithmetic or a comparison, the tensor of a method that makes a
    new tensor or of a metadata attribute, an argument of a torch function that makes a
    new tensor (directly or in a list) or of a builtin that reads a value, or returned."""
    parent = parents.get(id(expr))
    if isinstance(parent, (ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp)):
        return True
    if isinstance(parent, ast.Attribute) and parent.value is expr:
        grand = parents.get(id(parent))
        if parent.attr in _METADATA:
            return True
        return (  # a method that makes a new tensor (or a Python value)
            isinstance(grand, ast.Call)
            and grand.func is parent
            and parent.attr in _FRESH_METHODS
            and not any(k.arg == "out" for k in grand.keywords)
        )
    if isinstance(parent, ast.Return):
        return True
    if isinstance(parent, (ast.List, ast.Tuple)) and isinstance(parent.ctx, ast.Load):
        grand = parents.get(id(parent))
        if isinstance(grand, ast.Return):
            return True
        return isinstance(grand, ast.Call) and parent in grand.args and _fresh_call(grand)
    if isinstance(parent, ast.keyword):
        parent = parents.get(id(parent))
        if not isinstance(parent, ast.Call):
            return False
    elif not isinstance(parent, ast.Call) or expr is parent.func:
        return False
    if _fresh_call(parent):
        return True
    # a layer of an object (``self.out(x)``, ``m.proj(x[:-1])``): its result may be the
    # argument itself (nn.Identity, dropout in eval mode) or a view (nn.Flatten), so it
    # must be used at once too
    return _layer_call(parent) and _used_at_once(parent, parents)


def _layer_call(call: ast.Call) -> bool:
    """A call of an attribute of a name (a module's layer: ``self.fc(x)``), no keywords
    that write into an operand."""
    f = call.func
    return (
        isinstance(f, ast.Attribute)
        and isinstance(f.value, ast.Name)
        and not f.attr.endswith("_")
        and not any(k.arg in ("out", "inplace") for k in call.keywords)
    )


def _fresh_call(call: ast.Call) -> bool:
    """A call of a torch function (``torch.x`` / ``torch.nn.functional.x`` / ``F.x``) that
    makes a new tensor and writes into none of its operands, or of a builtin that reads a
    value (``len``, ``print``, ``int``...)."""
    f = call.func
    if any(k.arg in ("out", "inplace") for k in call.keywords):
        return False
    if isinstance(f, ast.Name):
        return f.id in _VALUE_BUILTINS
    if not isinstance(f, ast.Attribute):
        return False
    root = f.value
    while isinstance(root, ast.Attribute):
        root = root.value
    if not isinstance(root, ast.Name) or root.id not in ("torch", "F"):
        return False
    return f.attr not in _ALIASING and not f.attr.endswith("_")


def _owning(value) -> bool:
    """Whether an assigned value is a new tensor the function owns: a torch factory or
    joining call, a clone, a ``new_*`` tensor."""
    if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Attribute):
        return False
    f = value.func
    if f.attr in _OWNING_METHODS:
        return True
    if f.attr == "detach" and not value.args and not value.keywords:
        return _owning(f.value)  # x.clone().detach(): a view of a new tensor nothing holds
    return (
        f.attr in _OWNING_FACTORIES
        and isinstance(f.value, ast.Name)
        and f.value.id == "torch"
        and not any(k.arg == "out" for k in value.keywords)
    )


class _ItemWrites(ast.NodeTransformer):
    """``x[i] = v`` -> ``x = <put_item>(v, x, i)`` for the owned ``x`` (see
    _rewrite_item_writes)."""

    def __init__(self, owned: set):
        self.owned = owned
        self.count = 0

    def visit_Assign(self, node: ast.Assign):
        target = self._owned_item(node.targets[0] if len(node.targets) == 1 else None)
        if target is None:
            return node
        return self._put(node, target, node.value)

    def visit_AugAssign(self, node: ast.AugAssign):
        target = self._owned_item(node.target)
        if target is None:
            return node
        if not _simple_index(target.slice):  # (a mask: evaluated once, ops.item_updated)
            if type(node.op) not in _AUG_OPS or not ITEM_UPDATES:
                return node
            self.count += 1
            name = target.value.id
            call = ast.Call(
                func=ast.Constant(_ITEM_UPDATED_PLACEHOLDER),
                args=[
                    ast.Name(name, ast.Load()),
                    _index_expr(target.slice),
                    node.value,
                    ast.Constant(_AUG_OPS[type(node.op)]),
                ],
                keywords=[],
            )
            assign = ast.Assign(targets=[ast.Name(name, ast.Store())], value=call)
            return _located(assign, node)
        read = ast.Subscript(
            value=ast.Name(target.value.id, ast.Load()), slice=target.slice, ctx=ast.Load()
        )
        value = ast.BinOp(left=read, op=node.op, right=node.value)
        return self._put(node, target, value)

    def _owned_item(self, target) -> Any:
        """``target`` if it is ``x[...]`` of an owned ``x``, else None."""
        if (
            isinstance(target, ast.Subscript)
            and isinstance(target.value, ast.Name)
            and target.value.id in self.owned
        ):
            return target
        return None

    def _put(self, stmt, target: Any, value):
        self.count += 1
        name = target.value.id
        call = ast.Call(
            func=ast.Constant(_PUT_PLACEHOLDER),
            args=[value, ast.Name(name, ast.Load()), _index_expr(target.slice)],
            keywords=[],
        )
        assign = ast.Assign(targets=[ast.Name(name, ast.Store())], value=call)
        return _located(assign, stmt)

    def _scope(self, node):
        return node

    visit_Lambda = visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope


def _index_expr(index):
    """The index of a subscript as an expression: ``a:b`` -> ``slice(a, b, None)``."""
    if isinstance(index, ast.Slice):
        bounds = (index.lower, index.upper, index.step)
        parts = [p if p is not None else ast.Constant(None) for p in bounds]
        return ast.Call(func=ast.Constant(_SLICE_PLACEHOLDER), args=parts, keywords=[])
    if isinstance(index, ast.Tuple):
        return ast.Tuple([_index_expr(e) for e in index.elts], ast.Load())
    return index


def _simple_index(index) -> bool:
    """An index of names, constants, slices and arithmetic of them: evaluating it twice
    does what evaluating it once does."""
    return all(
        isinstance(sub, (ast.Name, ast.Constant, ast.Slice, ast.Tuple, ast.BinOp, ast.UnaryOp,
                         ast.Load, ast.operator, ast.unaryop))
        for sub in ast.walk(index)
    )  # fmt: skip


class _ItemUpdates(ast.NodeTransformer):
    """``x[index] op= v`` -> ``if <is_lazy>(x): <update_item>(x, index, v, op)`` ``else:
    x[index] op= v`` for a name ``x`` or lookups in it (``state["h"][i]``: read twice, see
    _lookups; see ITEM_UPDATES): one evaluation of each other part, as Python's (the item
    read after ``v``); anything but a lazy tensor (a real one, a list)
    updated by the statement as written, as eager does it (a constant's update counts
    its references: ops.in_place)."""

    def __init__(self):
        self.count = 0

    def visit_AugAssign(self, node: ast.AugAssign):
        target = node.target
        if (
            not isinstance(target, ast.Subscript)
            or not _lookups(target.value)
            or type(node.op) not in _AUG_OPS
        ):
            return node
        self.count += 1
        call = ast.Call(
            func=ast.Constant(_ITEM_UPDATE_PLACEHOLDER),
            args=[
                _loaded(target.value),
                _index_expr(copy.deepcopy(target.slice)),  # (the statement stays, below)
                copy.deepcopy(node.value),
                ast.Constant(_AUG_OPS[type(node.op)]),
            ],
            keywords=[],
        )
        test = ast.Call(
            func=ast.Constant(_IS_LAZY_PLACEHOLDER),
            args=[_loaded(target.value)],
            keywords=[],
        )
        return _located(ast.If(test=test, body=[ast.Expr(call)], orelse=[node]), node)

    def _scope(self, node):
        return node

    visit_Lambda = visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope


def _lookups(expr) -> bool:
    """A name, or lookups in it by constants and names (``state["h"]``, ``hs[i]``): read
    twice (the test and the update), it gives the same object."""
    while isinstance(expr, ast.Subscript):
        if not isinstance(expr.slice, (ast.Constant, ast.Name)):
            return False
        expr = expr.value
    return isinstance(expr, ast.Name)


def _loaded(expr):
    """A copy of the target's container expression, read (ctx Load throughout)."""
    out = copy.deepcopy(expr)
    for sub in ast.walk(out):
        if hasattr(sub, "ctx"):
            sub.ctx = ast.Load()
    return out


def _rewrite_item_updates(node: ast.FunctionDef) -> int:
    """Rewrite the item updates left in ``node``'s own code (ITEM_UPDATES). Returns how
    many."""
    updates = _ItemUpdates()
    node.body = [updates.visit(stmt) for stmt in node.body]
    return updates.count


def _written_in_place(node: ast.FunctionDef) -> set[str]:
    """The names the function's own code writes into in place as it stands (after the
    rewrites of owned locals): ``x[i] = v``, ``x[i] op= v``, ``x.mul_(2)`` alone. A
    constant ``x = torch.zeros(n)`` made by a run would be its trace's one tensor, which
    every call returns: a write into it is kept out of runs (``_Rewriter._ops``), so the
    runtime's constant tracking (graph.construct) makes the writer's copy."""
    names = set()
    for sub in ast.walk(node):
        target = None
        if isinstance(sub, ast.Subscript) and isinstance(sub.ctx, ast.Store):
            target = sub.value
        elif isinstance(sub, ast.AugAssign) and isinstance(sub.target, ast.Subscript):
            target = sub.target.value
        elif (call := _method_update(sub)) is not None:
            target = call.func.value  # type: ignore[attr-defined]
        if isinstance(target, ast.Name):
            names.add(target.id)
    return names


def _rewrite_item_writes(node: ast.FunctionDef, owned: set) -> int:
    """Rewrite the writes into items of the ``owned`` locals in ``node``'s own code (runs
    never hold them: a subscript store is not a plain assignment). Returns how many."""
    writes = _ItemWrites(owned)
    node.body = [writes.visit(stmt) for stmt in node.body]
    return writes.count


# A buffer filled a row per step (``states = torch.zeros(n, h)`` then ``for t in
# range(n): h = cell(x[t], h); states[t] = h``) is written in place in eager. Recorded
# as written, each step's write is a put of the whole buffer (O(n^2) copies inside a
# traced loop body) and the loop's counter is read as an index, so it is no scan. Where
# the loop touches the buffer only by that one write per step, nothing else can see the
# buffer before the loop ends (the function owns it: no alias, no view kept), and the
# loop cannot end early or be interrupted and resumed in the function (no break,
# continue, return, try or with around it), the writes are made after the loop, in one
# op of all the values (ops.put_rows)::
#
#     _acrobat_rgK = range(...)
#     _acrobat_rwK = []
#     for t in _acrobat_rgK:                  # (or reversed(_acrobat_rgK))
#         h = cell(x[t], h)
#         _acrobat_rwK.append(<keep_row>(h))  # was: states[t] = h
#     states = <put_rows>(states, _acrobat_rgK, _acrobat_rwK, reversed?)
#
# The loop is then a loop over positions appending its states (_index_loop, _scan).
# ``keep_row`` marks a lazy value as read, as the put did, so that an update of it in
# place later in the loop is refused as before instead of reaching the deferred write
# (a real tensor is copied). A write that fails (a position out of range, a value that
# does not fit the row) raises eager's error after the loop instead of at its step.

# statements that catch what their body raises (and go on after it), and what else a
# loop whose writes leave it must not hold
_GUARDS: tuple = (ast.Try, ast.With, ast.AsyncWith)
if sys.version_info >= (3, 11):
    _GUARDS += (ast.TryStar,)
_LOOP_EXITS: tuple = _GUARDS + (
    ast.Break, ast.Continue, ast.Return, ast.Yield, ast.YieldFrom, ast.Await, ast.Delete,
    ast.AugAssign, ast.Global, ast.Nonlocal, ast.FunctionDef, ast.AsyncFunctionDef,
    ast.Lambda, ast.ClassDef,
)  # fmt: skip


def _rewrite_row_writes(fn, node: ast.FunctionDef, owned: set, local: set) -> tuple:
    """Rewrite the loops of ``node`` that fill ``owned`` buffers a row per step (see the
    section comment). Returns the names the rewrite binds: (ranges, lists)."""
    ranges: list[str] = []
    lists: list[str] = []
    if any(b in local or b in fn.__globals__ for b in ("range", "reversed")):
        return ranges, lists

    def rewrite(stmts: list, guarded: bool) -> list:
        out: list = []
        for stmt in stmts:
            inner = guarded or isinstance(stmt, _GUARDS)
            for field in ("body", "orelse", "finalbody"):
                block = getattr(stmt, field, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                    setattr(stmt, field, rewrite(block, inner))
            for handler in getattr(stmt, "handlers", ()):
                handler.body = rewrite(handler.body, True)
            for case in getattr(stmt, "cases", ()):
                case.body = rewrite(case.body, inner)
            new = None if guarded else _row_write_loop(stmt, out, owned, len(ranges))
            if new is None:
                out.append(stmt)
            else:  # (the range's binding, the lists' bindings, the loop, the writes)
                out.extend(new)
                loop = next(i for i, s in enumerate(new) if isinstance(s, ast.For))
                ranges.append(new[0].targets[0].id)
                lists.extend(s.targets[0].id for s in new[1:loop])
        return out

    node.body = rewrite(node.body, False)
    return ranges, lists


def _row_write_loop(stmt, before: list, owned: set, k: int) -> list | None:
    """The statements replacing ``stmt`` (see the section comment), or None."""
    if not isinstance(stmt, ast.For) or stmt.orelse or not isinstance(stmt.target, ast.Name):
        return None
    span: Any = stmt.iter
    reverse = _plain_call(span, "reversed") and len(span.args) == 1
    if reverse:
        span = span.args[0]
    if not _plain_call(span, "range") or len(span.args) > 3:
        return None
    counter = stmt.target.id
    writes: dict[int, str] = {}  # position in the body -> the buffer it writes
    for j, s in enumerate(stmt.body):
        if (
            isinstance(s, ast.Assign)
            and len(s.targets) == 1
            and isinstance(s.targets[0], ast.Subscript)
            and isinstance(s.targets[0].value, ast.Name)
            and s.targets[0].value.id in owned
            and isinstance(s.targets[0].slice, ast.Name)
            and s.targets[0].slice.id == counter
        ):
            writes[j] = s.targets[0].value.id
    buffers = list(writes.values())
    if not buffers or len(set(buffers)) != len(buffers) or counter in buffers:
        return None  # (one write a step of each buffer)
    for buffer in buffers:  # bound before the loop, so that the write after it reads it
        if not any(
            isinstance(s, ast.Assign) and any(_binds(t, buffer) for t in s.targets)
            for s in before
        ):
            return None
    body: list[Any] = stmt.body
    written = {id(body[j].targets[0].value) for j in writes}
    for s in stmt.body:
        for sub in ast.walk(s):
            if isinstance(sub, _LOOP_EXITS):
                return None
            if isinstance(sub, ast.Name):
                if sub.id in buffers and id(sub) not in written:
                    return None  # the loop reads a buffer (or binds it)
                if sub.id == counter and not isinstance(sub.ctx, ast.Load):
                    return None
            elif isinstance(sub, (ast.Assign, ast.AnnAssign, ast.For, ast.AsyncFor)):
                stores: list[Any] = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                if not all(_plain_target(t, set()) for t in stores) and not (
                    isinstance(sub, ast.Assign) and id(getattr(stores[0], "value", None)) in written
                ):
                    return None  # a store into an object (a tensor's items, maybe)
            elif isinstance(sub, ast.Call):
                f = sub.func
                if isinstance(f, ast.Attribute) and f.attr.endswith("_") and not (
                    f.attr.endswith("__")
                ):
                    return None  # an in-place method (the values kept must not change)
                if any(kw.arg in ("out", "inplace") for kw in sub.keywords):
                    return None
    span_name = f"_acrobat_rg{k}"
    lists = {buffer: f"_acrobat_rw{k}_{n}" for n, buffer in enumerate(buffers)}
    bind_span = ast.Assign(
        targets=[ast.Name(span_name, ast.Store())],
        value=ast.Call(ast.Constant(_RANGE_PLACEHOLDER), span.args, []),
    )
    out = [_located(bind_span, stmt)]
    for values in lists.values():
        bind = ast.Assign(targets=[ast.Name(values, ast.Store())], value=ast.List([], ast.Load()))
        out.append(_located(bind, stmt))
    body = list(body)
    puts = []
    for j, buffer in writes.items():
        write: Any = stmt.body[j]
        keep = ast.Call(ast.Constant(_KEEP_PLACEHOLDER), [write.value], [])
        append = ast.Expr(
            ast.Call(
                ast.Attribute(ast.Name(lists[buffer], ast.Load()), "append", ast.Load()),
                [keep],
                [],
            )
        )
        body[j] = _located(append, write)
        put = ast.Assign(
            targets=[ast.Name(buffer, ast.Store())],
            value=ast.Call(
                ast.Constant(_PUT_ROWS_PLACEHOLDER),
                [
                    ast.Name(buffer, ast.Load()),
                    ast.Name(span_name, ast.Load()),
                    ast.Name(lists[buffer], ast.Load()),
                    ast.Constant(reverse),
                ],
                [],
            ),
        )
        puts.append(_located(put, write))
    loop_iter: ast.expr = ast.Name(span_name, ast.Load())
    if reverse:
        loop_iter = ast.Call(ast.Name("reversed", ast.Load()), [loop_iter], [])
    loop = ast.For(target=stmt.target, iter=loop_iter, body=body, orelse=[])
    ast.copy_location(loop, stmt)
    loop.end_lineno, loop.end_col_offset = stmt.end_lineno, stmt.end_col_offset
    return [*out, _located(loop, stmt), *puts]


def _plain_call(expr, name: str) -> bool:
    """``expr`` is a call of ``name`` with positional, unstarred arguments only."""
    return (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Name)
        and expr.func.id == name
        and not expr.keywords
        and len(expr.args) >= 1
        and not any(isinstance(a, ast.Starred) for a in expr.args)
    )


def _binds(target, name: str) -> bool:
    """Whether the assignment target ``target`` binds the local ``name``."""
    if isinstance(target, ast.Name):
        return target.id == name
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_binds(t, name) for t in target.elts)
    return isinstance(target, ast.Starred) and _binds(target.value, name)


# ``loss = 0`` then ``loss += criterion(out, target[t])`` in a loop (the PyTorch
# tutorials' way of summing a loss) is an augmented assignment, which no run or scan
# takes: each step's loss ran op by op. On a number ``acc += v`` is ``acc = acc + v``; on a
# tensor it updates the tensor in place, which differs from the rebinding only where
# something else holds the tensor (an alias sees the update) or the result would not fit
# it (another shape or dtype: eager raises). ``_accumulators`` finds the locals only ever
# bound to a number or a tensor the function makes (a torch factory, a clone) or by such
# updates, and read only by value (as _owned_tensors reads them: arithmetic, torch
# functions that make new tensors, ``return``...), so nothing else can hold them; their
# ``acc op= v`` (``+ - * /``) become ``acc = augment(acc, v, op)``, which makes the plain op
# where its result keeps x's shape and dtype, else runs the in-place op itself (eager's
# error or update). An in-place method written as a statement of its own on such a local
# (``h.mul_(0.9)``, ``acc.add_(v, alpha=2)``, ``mask.masked_fill_(m, 0)``, ``h.zero_()``:
# the methods of ops.UPDATE_METHODS) is the same kind of update and becomes ``h =
# update(h, "mul_", 0.9)``, the out-of-place form where its result fits ``h``, else the
# method as written (ops.update).

_AUG_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def _method_statement(stmt, methods) -> ast.Call | None:
    """The call if the statement ``stmt`` is a call alone of a method in ``methods`` on a
    name (``x.mul_(0.9)``, ``out.append(h)``), with no ``*`` or ``**`` arguments."""
    if not isinstance(stmt, ast.Expr) or not isinstance(stmt.value, ast.Call):
        return None
    call = stmt.value
    f = call.func
    if (
        isinstance(f, ast.Attribute)
        and f.attr in methods
        and isinstance(f.value, ast.Name)
        and not any(isinstance(a, ast.Starred) for a in call.args)
        and all(k.arg is not None for k in call.keywords)
    ):
        return call
    return None


def _method_update(stmt) -> ast.Call | None:
    """The call of ``x.mul_(...)`` (a method of ops.UPDATE_METHODS) if the statement
    ``stmt`` is that call alone, else None."""
    return _method_statement(stmt, UPDATE_METHODS)


def _accumulators(node: ast.FunctionDef, local: set) -> set[str]:
    """The locals whose augmented assignments the function may rewrite (see above),
    decided on its source before anything in it is rewritten."""
    parents, params = _parents_and_params(node)
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.AugAssign) and isinstance(sub.target, ast.Name):
            names.add(sub.target.id)
        elif (call := _method_update(sub)) is not None:
            names.add(call.func.value.id)  # type: ignore[attr-defined]
    names = {n for n in names if n in local and n not in params}
    for sub in ast.walk(node):
        if not isinstance(sub, ast.Name) or sub.id not in names:
            continue
        owner = parents.get(id(sub))
        if isinstance(sub.ctx, ast.Store):
            if isinstance(owner, ast.AugAssign) and owner.target is sub:
                ok = type(owner.op) in _AUG_OPS
            else:
                ok = (
                    isinstance(owner, ast.Assign)
                    and len(owner.targets) == 1
                    and owner.targets[0] is sub
                    and (_number(owner.value) or _owning(owner.value))
                )
        else:
            ok = isinstance(sub.ctx, ast.Load) and _owned_use(sub, parents)
        if not ok:
            names.discard(sub.id)
    return names


def _number(value) -> bool:
    """An int or float literal (``-1`` too; not a bool)."""
    if isinstance(value, ast.UnaryOp) and isinstance(value.op, (ast.USub, ast.UAdd)):
        value = value.operand
    return isinstance(value, ast.Constant) and type(value.value) in (int, float)


class _Augmented(ast.NodeTransformer):
    """``acc op= v`` -> ``acc = <augment>(acc, v, op)`` for the accumulators (see above)."""

    def __init__(self, names: set):
        self.names = names
        self.count = 0

    def visit_AugAssign(self, node: ast.AugAssign):
        target = node.target
        if not isinstance(target, ast.Name) or target.id not in self.names:
            return node
        self.count += 1
        call = ast.Call(
            func=ast.Constant(_AUG_PLACEHOLDER),
            args=[
                ast.Name(target.id, ast.Load()),
                node.value,
                ast.Constant(_AUG_OPS[type(node.op)]),
            ],
            keywords=[],
        )
        return _located(ast.Assign(targets=[ast.Name(target.id, ast.Store())], value=call), node)

    def visit_Expr(self, node: ast.Expr):
        call = _method_update(node)
        if call is None or call.func.value.id not in self.names:  # type: ignore[attr-defined]
            return node
        self.count += 1
        name, method = call.func.value.id, call.func.attr  # type: ignore[attr-defined]
        value = ast.Call(
            func=ast.Constant(_UPDATE_PLACEHOLDER),
            args=[ast.Name(name, ast.Load()), ast.Constant(method), *call.args],
            keywords=call.keywords,
        )
        return _located(ast.Assign(targets=[ast.Name(name, ast.Store())], value=value), node)

    def _scope(self, node):
        return node

    visit_Lambda = visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope


def _rewrite_augmented(node: ast.FunctionDef, names: set) -> int:
    """Rewrite the accumulators' augmented assignments in ``node``'s own code. Returns
    how many."""
    rewriter = _Augmented(names)
    node.body = [rewriter.visit(stmt) for stmt in node.body]
    return rewriter.count


class _TypeChecks(ast.NodeTransformer):
    """``isinstance(x, T)`` -> ``<lazy_isinstance>(isinstance, x, T)``,
    ``torch.is_tensor(x)`` -> ``<lazy_is_tensor>(torch.is_tensor, x)`` and ``print(...)``
    -> ``<lazy_print>(print, ...)`` (see _rewrite_type_checks)."""

    def __init__(self):
        self.count = 0

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        f = node.func
        if PRINTS and isinstance(f, ast.Name) and f.id == "print":
            self.count += 1
            call = ast.Call(
                func=ast.Constant(_PRINT_PLACEHOLDER), args=[f, *node.args], keywords=node.keywords
            )
            return _located(call, node)
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            return node
        if isinstance(f, ast.Name) and f.id == "isinstance" and len(node.args) == 2:
            placeholder = _ISINSTANCE_PLACEHOLDER
        elif _torch_attr(f) == "is_tensor" and len(node.args) == 1:
            placeholder = _IS_TENSOR_PLACEHOLDER
        else:
            return node
        self.count += 1
        call = ast.Call(func=ast.Constant(placeholder), args=[f, *node.args], keywords=[])
        return _located(call, node)

    def _scope(self, node):  # (comprehensions are visited: _dispatched reaches them)
        return node

    visit_Lambda = visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope


def _rewrite_type_checks(node: ast.FunctionDef) -> int:
    """Rewrite ``isinstance(x, T)`` and ``torch.is_tensor(x)`` in ``node``'s own code and
    its comprehensions to calls of :func:`lazy_isinstance` / :func:`lazy_is_tensor`,
    given the callee as written (so a shadowed ``isinstance`` is still the one called).
    Returns how many were rewritten."""
    checks = _TypeChecks()
    node.body = [checks.visit(stmt) for stmt in node.body]
    return checks.count


_IS_TENSOR = torch.is_tensor


def _names_tensor(classes) -> bool:
    """Whether an ``isinstance`` class argument admits a plain ``torch.Tensor``."""
    if type(classes) is tuple:
        return any(_names_tensor(c) for c in classes)
    if isinstance(classes, types.UnionType):  # torch.Tensor | None
        return any(_names_tensor(c) for c in classes.__args__)
    return isinstance(classes, type) and issubclass(torch.Tensor, classes)


def lazy_isinstance(check, obj, classes) -> bool:
    """``check(obj, classes)``, where ``check`` is the builtin ``isinstance`` and ``obj`` a
    LazyTensor: True also where ``classes`` admits a ``torch.Tensor``, as it would for the
    tensor the lazy one stands for in eager code (a tree's leaves told from its lists by
    ``isinstance(t, torch.Tensor)``). A LazyTensor is not a ``torch.Tensor`` subclass, so
    the builtin alone says False; analysis rewrites the calls in the functions it
    outlines (TYPE_CHECKS)."""
    if type(obj) is graph.LazyTensor and check is isinstance:
        return isinstance(obj, classes) or _names_tensor(classes)
    return check(obj, classes)


def lazy_print(check, *args, **kwargs):
    """``check(*args, **kwargs)``, where ``check`` is the builtin ``print``: its lazy tensor
    arguments made strings first (each a read of the value, as ``str(t)`` is:
    LazyTensor.__str__), so that the line is written whole. Python's print writes each
    argument as it converts it; the instance suspended at a read in the middle, and the
    other instances' prints went into its line."""
    if check is print and any(type(a) is graph.LazyTensor for a in args):
        caller = sys._getframe(1)
        args = tuple(
            _printed(a, caller) if type(a) is graph.LazyTensor else a for a in args
        )
    return check(*args, **kwargs)


def all_modules(*containers) -> bool:
    """Whether every one of ``containers`` (the sequences a run's loops go over) is a
    torch module (a ModuleList, a Sequential, a ParameterList...): the run then takes the
    loop (LOOP_RUNS), its trace keyed by the module, whose layers and parameters a trace's
    validity check covers."""
    return all(isinstance(c, torch.nn.Module) for c in containers)


def lazy_is_tensor(check, obj) -> bool:
    """``check(obj)``, where ``check`` is ``torch.is_tensor``: True for a LazyTensor too."""
    if type(obj) is graph.LazyTensor and check is _IS_TENSOR:
        return True
    return check(obj)


def _recompilable(fn, node: ast.FunctionDef) -> tuple[list, int] | None:
    """(module imports, future flags) to recompile ``fn`` from ``node``, its parsed source
    (moved to the file's line numbers, decorators dropped, in place), if compiling the
    unmodified source reproduces the running bytecode; None if not (edited since import)."""
    code = fn.__code__
    node.decorator_list = []
    ast.increment_lineno(node, code.co_firstlineno - 1)
    flags = code.co_flags & _FUTURE_FLAGS
    imports = [i for i in _module_imports(fn) if not isinstance(i, ast.ImportFrom)
               or i.module != "__future__"]  # fmt: skip
    if _functions(_compiled([*imports, node], code, flags))[node.name].co_code != code.co_code:
        return None
    return imports, flags


def _compiled(body: list, code: types.CodeType, flags: int) -> types.CodeType:
    """Module statements ``body`` compiled as ``code``'s file, with its future flags."""
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)  # calling a constant placeholder
        return compile(module, code.co_filename, "exec", flags=flags, dont_inherit=True)


def _functions(module: types.CodeType) -> dict[str, types.CodeType]:
    """The code objects of a compiled module's functions, by name."""
    return {c.co_name: c for c in module.co_consts if isinstance(c, types.CodeType)}


_IMPORTS: dict[str, list] = {}


def _module_imports(fn) -> list:
    """The import statements at the top level of ``fn``'s module: CPython compiles
    ``torch.tanh(x)`` differently when ``torch`` is an imported name of the module, so a
    function recompiled on its own must see them to give the same bytecode."""
    name = fn.__module__ or ""
    found = _IMPORTS.get(name)
    if found is None:
        found = []
        module = inspect.getmodule(fn)
        with contextlib.suppress(OSError, TypeError, SyntaxError):
            if module is not None:
                tree = ast.parse(inspect.getsource(module))
                found = [s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))]
        _IMPORTS[name] = found
    return found


class _Region:
    def __init__(
        self, k: int, stmts: list, params: list, values: list, outputs: list, carried: int = 0
    ):
        self.carried = carried  # > 0: a loop's body (ScanBlock), carrying `outputs`
        self.lasts: list[tuple[str, str]] = []  # (temporary read after the loop, its list)
        self.appends = 0  # a loop body's outputs appended to lists, per step
        self.reverse = False  # a loop over reversed(<sequence>)
        self.zipped = False  # a loop over zip(<sequence>, ...): one element of each per step
        self.sequences = 0  # elements per step: 0 (counted), 1, or zip's sequences
        self.values: tuple[int, ...] = ()  # sequences of numbers the body reads as tensors
        self.tensor_args: tuple[int, ...] = ()  # parameters the call passes x of torch.tensor(x)
        self.index_args: tuple[int, ...] = ()  # parameters read only as an index (_index_only)
        self.state_args: tuple[int, ...] = ()  # parameters it writes into (_written)
        self.stacked = tuple(i for i, p in enumerate(params) if _only_stacked(p, stmts))
        self.name = f"_acrobat_region_{k}"
        self.placeholder = _REGION_BASE * (k + 3)
        self.first = stmts[0].lineno
        self.last = getattr(stmts[-1], "end_lineno", None) or stmts[-1].lineno
        ret = ast.Return(value=ast.Tuple([ast.Name(o, ast.Load()) for o in outputs], ast.Load()))
        body = list(stmts) + [_located(ret, stmts[-1])]
        args = ast.arguments(
            posonlyargs=[],
            args=[ast.arg(p) for p in params],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=[],
        )
        definition = ast.FunctionDef(name=self.name, args=args, body=body, decorator_list=[])
        self.definition = _located(definition, stmts[0], stmts[-1])
        call = ast.Assign(
            targets=[ast.Tuple([ast.Name(o, ast.Store()) for o in outputs], ast.Store())],
            value=ast.Call(
                func=ast.Constant(self.placeholder),
                args=values,
                keywords=[],
            ),
        )
        self.call = _located(call, stmts[0], stmts[-1])


def _index_only(stmts: list, names: list) -> tuple[int, ...]:
    """Positions of the parameters ``names`` that ``stmts`` read only as an index: the
    position of a rewritten write (``put_item(v, x, i)``) or the whole index of a load
    ``x[i]``. A Python int passed there becomes a per-instance data node at the call
    (RegionBlock): one trace for every int (a pointer network's chosen row, a step's
    slot in a buffer) where the int would key a trace per value."""
    uses: dict = {}
    index_uses: dict = {}
    for stmt in stmts:
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                uses[sub.id] = uses.get(sub.id, 0) + 1
            index = None
            if _is_put(sub):
                index = sub.args[2]
            elif isinstance(sub, ast.Subscript) and isinstance(sub.ctx, ast.Load):
                index = sub.slice
            if isinstance(index, ast.Name):
                index_uses[index.id] = index_uses.get(index.id, 0) + 1
    return tuple(
        k for k, p in enumerate(names) if index_uses.get(p) and index_uses[p] == uses.get(p)
    )


def _written(stmts: list, names: list) -> tuple[int, ...]:
    """Positions of the parameters ``names`` that ``stmts`` write into (the target of a
    rewritten ``x = put_item(v, x, i)``: a mask, a buffer): given a real tensor the
    instances share (the hoisted ``torch.zeros(n)`` it starts as), the call reads it as
    a row (RegionBlock), so the traces of the first call, one per size, pad together."""
    targets = {
        sub.args[1].id
        for stmt in stmts
        for sub in ast.walk(stmt)
        if _is_put(sub) and isinstance(sub.args[1], ast.Name)
    }
    return tuple(k for k, p in enumerate(names) if p in targets)


def _is_put(node) -> TypeGuard[ast.Call]:
    """Whether ``node`` is a rewritten write's call, ``put_item(value, x, index)``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Constant)
        and node.func.value == _PUT_PLACEHOLDER
        and len(node.args) == 3
    )


def _only_stacked(name: str, stmts: list) -> bool:
    """Whether ``stmts`` read ``name`` only as ``torch.stack(name)`` (along dim 0)."""
    stacks = 0
    inside: set = set()
    for stmt in stmts:
        for sub in ast.walk(stmt):
            if (
                isinstance(sub, ast.Call)
                and isinstance(sub.func, ast.Attribute)
                and sub.func.attr == "stack"
                and isinstance(sub.func.value, ast.Name)
                and sub.func.value.id == "torch"
                and len(sub.args) == 1
                and not sub.keywords
                and isinstance(sub.args[0], ast.Name)
                and sub.args[0].id == name
            ):
                stacks += 1
                inside.add(id(sub.args[0]))
    for stmt in stmts:
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Name) and sub.id == name and id(sub) not in inside:
                return False
    return stacks > 0


def _located(node, first, last=None):
    """``node`` and its unlocated children placed at the lines of ``first``..``last``."""
    last = last or first
    for sub in ast.walk(node):
        if "lineno" in sub._attributes and getattr(sub, "lineno", None) is None:
            sub.lineno, sub.col_offset = first.lineno, first.col_offset
            sub.end_lineno = last.end_lineno or last.lineno
            sub.end_col_offset = last.end_col_offset or 0
    return node


class _Rewriter:
    """Finds the runs of one function's statement lists and replaces them by calls."""

    def __init__(self, fn, local: set):
        self.fn = fn
        self.local = local  # the function's local names (co_varnames)
        self.regions: list[_Region] = []
        self.seen: set = set()
        self.loads: dict[str, int] = {}  # name -> loads of it in the whole function
        self.scannable = False  # no ``del`` anywhere: a bound name stays bound
        self.root: ast.FunctionDef | None = None
        self.tensor_names: set | None = None  # (_tensor_operators: names tensor work binds)
        self.values = 0  # value reads split off their expressions (_split_demands)
        self.returns = 0  # returned expressions split off their return (_split_demands)
        self.containers: set[str] = set()  # locals only ever bound to list/tuple/dict/set
        self.written: set[str] = set()  # names written into in place (_written_in_place)
        self.control_methods: set[str] | None = None  # (_control_methods, when first asked)
        self.dynamic = False  # the function calls locals() / vars() / eval / exec
        self.load_pos: dict[str, list] = {}  # name -> (line, column) of each read of it
        self.after_reads: dict[int, set] = {}  # id(split-off part) -> its statement's reads
        self.loop_spans: list[tuple] = []  # (start, end) positions of each loop statement
        self.ranges: set[str] = set()  # locals bound to range(...) by _rewrite_row_writes
        self.plain_loops: set[int] = set()  # ids of loops kept out of runs (a guard's else)
        self.callers: set[str] | None = None  # names called through (_called_through)

    def rewrite(self, node, bound: frozenset = frozenset()) -> None:
        """Rewrite the statement lists under ``node``; ``bound``: local names certainly
        bound when ``node`` starts (the function's parameters, earlier assignments)."""
        if isinstance(node, ast.FunctionDef) and not self.loads:
            self.root = node
            self.containers = _container_names(node) if SPLIT_CONTAINERS else set()
            self.written = _written_in_place(node)
            if UNROLL_LOOPS:  # (first: the counts and positions below are the copies')
                self._unroll(node)
            self.loads = _load_counts(node.body)
            self.dynamic = _reads_frame(node)
            augmented = {
                id(sub.target) for sub in ast.walk(node) if isinstance(sub, ast.AugAssign)
            }
            for sub in ast.walk(node):  # (a del or an x += ... reads x too)
                if isinstance(sub, ast.Name) and (
                    isinstance(sub.ctx, (ast.Load, ast.Del)) or id(sub) in augmented
                ):
                    self.load_pos.setdefault(sub.id, []).append((sub.lineno, sub.col_offset))
                elif isinstance(sub, (ast.For, ast.AsyncFor, ast.While)):
                    self.loop_spans.append(_span([sub]))
            self.scannable = not any(isinstance(sub, ast.Delete) for sub in ast.walk(node))
            a = node.args
            bound = frozenset(
                p.arg for p in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if p
            )
        if isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            return  # a handler could see the names a run had assigned when it raised
        if isinstance(node, (ast.With, ast.AsyncWith)) and not all(
            _transparent(item.context_expr) for item in node.items
        ):
            return  # a context manager could swallow an exception: the same problem
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                setattr(node, field, self._block(stmts, bound))
        for handler in getattr(node, "handlers", ()):
            self.rewrite(handler, bound)
        for case in getattr(node, "cases", ()):
            self.rewrite(case, bound)

    def _unroll(self, node) -> None:
        """Write out the loops under ``node`` that :meth:`_unrolled` takes, innermost
        first (an outer loop whose body is then all assignments may go too)."""
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if not (isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt)):
                continue
            out: list = []
            for stmt in stmts:
                self._unroll(stmt)
                copies = self._unrolled(stmt)
                if copies is None:
                    out.append(stmt)
                else:
                    out.extend(copies)
            setattr(node, field, out)
        for handler in getattr(node, "handlers", ()):
            self._unroll(handler)
        for case in getattr(node, "cases", ()):
            self._unroll(case)

    def _unrolled(self, stmt) -> list | None:
        """``for i in range(<int literals>): <body>`` (or over a tuple or list display of
        constants, UNROLL_LITERALS) as the body written out once per trip with ``i`` a
        constant (UNROLL_LOOPS), or None: the loop stays. Only a body of
        assignments that could all join a run (no value read, no call with control flow,
        no container), at most UNROLL_TRIPS trips and UNROLL_OPS tensor calls in all, and
        no tensor call that reads nothing the body assigns (its scan hoists such work out
        of the loop: ``for _ in range(8): h = torch.tanh(w(x) + u(h))`` at width 512 took
        1.6 ms a map of 8 as a scan, 3.7 written out, as w's weights were read 8 times). The
        same Python: a ``for`` over a range runs its body once per number in order; the
        counter keeps its last value after the loop where anything reads it there; an
        ``else:`` runs after (nothing in such a body can break)."""
        if not isinstance(stmt, ast.For) or not isinstance(stmt.target, ast.Name):
            return None
        trips: Any = _literal_trips(stmt.iter)  # (``for w in (0.5, 0.25):``, UNROLL_LITERALS)
        if trips is None:
            trips = self._range_trips(stmt.iter)
        if trips is None or not 1 <= len(trips) <= UNROLL_TRIPS:
            return None
        name = stmt.target.id
        ops = 0
        varying = {name}
        body: list[Any] = stmt.body
        for sub in body:
            k = self._ops(sub)
            if k < 0 or self._reads_container(sub.value) or name in _assigned_names(sub):
                return None
            ops += k
            varying |= _assigned_names(sub)
        if ops == 0 and UNROLL_OPERATORS and self._tensor_operators(body):
            ops = sum(_operator_count(sub.value) for sub in body)  # (``h = h * w + x``)
        if ops == 0 or ops * len(trips) > UNROLL_OPS:
            return None
        for sub in body:  # loop-invariant tensor work (``w(x)`` beside ``u(h)``): a
            for call in ast.walk(sub.value):  # scan computes it once, the copies each time
                if (
                    isinstance(call, ast.Call)
                    and self._tensor_call(call.func)
                    and varying.isdisjoint(_names(call))
                ):
                    return None
        out = [
            _Constants({name: i}).visit(copy.deepcopy(sub)) for i in trips for sub in body
        ]
        if self.root is not None and _loads_outside_loops_over(self.root, name):
            last = ast.Assign(targets=[ast.Name(name, ast.Store())], value=ast.Constant(trips[-1]))
            out.append(_located(last, stmt))  # (at the loop's lines: it ends where it did)
        return out + stmt.orelse  # (a body of assignments never breaks: else always runs)

    def _range_trips(self, it) -> range | None:
        """The numbers of ``range(<int literals>)``, or None."""
        if not self._builtin_call(it, "range") or len(it.args) > 3:
            return None
        bounds = [_int_literal(a) for a in it.args]
        return None if None in bounds else range(*bounds)  # type: ignore[arg-type]

    def _tensor_operators(self, body: list) -> bool:
        """Whether every statement of a loop's body assigns, by operators, a name that the
        function binds elsewhere by tensor work (``h = h * w + x`` after ``h = m.a(x)``):
        operators on tensors, not index arithmetic (UNROLL_OPERATORS)."""
        if self.root is None:
            return False
        if self.tensor_names is None:
            self.tensor_names = {
                name
                for sub in ast.walk(self.root)
                if isinstance(sub, ast.Assign) and self._ops(sub) > 0
                for name in _assigned_names(sub)
            }
        return all(
            isinstance(sub, ast.Assign)
            and _operator_count(sub.value) > 0
            and _assigned_names(sub) <= self.tensor_names
            for sub in body
        )

    def _block(self, stmts: list, inherited: frozenset) -> list:
        out: list = []
        run: list = []
        ops = 0
        bound = set(inherited)
        stmts = self._split_demands(stmts)
        start = frozenset(bound)  # the names bound where the run starts
        guarded: list = []  # the run's loops and comprehensions over layers (LOOP_RUNS)
        lists: set = set()  # the lists those comprehensions make (read inside the run)
        for stmt in stmts + [None]:
            if not run:
                start = frozenset(bound)
            if isinstance(stmt, ast.Return) and (run or LONE_RETURNS):
                stmt, k = self._split_return(stmt, run)  # its tensor work may end the run
                ops += k
            mapped = None
            k = self._comprehension_ops(stmt, run) if stmt is not None else -1
            if k >= 0:
                guarded.append(stmt)
                lists |= _assigned_names(stmt)
            elif stmt is not None:
                mapped = self._comprehension(stmt, bound)
                k = self._ops(stmt) if mapped is None else -1
                if k >= 0 and self._reads_container(stmt.value, lists | _run_displays(run)):
                    k = -1  # a run given a list runs as written: leave the statement out
                if k < 0 and LOOP_RUNS and isinstance(stmt, ast.For):
                    k = self._loop_ops(stmt, bound, run)
                    if k >= 0:
                        guarded.append(stmt)
                if k < 0 and RUN_BRANCHES and isinstance(stmt, ast.If):
                    k = self._if_ops(stmt, bound, run)
            if k >= 0:
                run.append(stmt)
                ops += k
                if isinstance(stmt, ast.If):
                    bound |= _sure_assigned([stmt])
                elif not isinstance(stmt, ast.For):  # (a loop's names: maybe never bound)
                    bound |= _assigned_names(stmt)
                continue
            if run:
                lookups = (
                    LOOKUP_CALLS
                    and not guarded
                    and all(not isinstance(s, ast.If) and _is_lookup(s.value) for s in run)
                )
                if guarded or (ops >= MIN_REGION_OPS and not lookups):  # (a loop counts >= 2)
                    out.extend(self._close(run, start, guarded))
                else:
                    out.extend(run)
            run, ops, guarded, lists = [], 0, [], set()
            if stmt is None:
                continue
            if mapped is not None:
                out.extend(mapped)
                bound |= _assigned_names(stmt)
                continue
            scan = None
            if INDEX_LOOPS and isinstance(stmt, ast.For):
                # (first: _scan takes ``for t in reversed(range(n))`` as a loop over
                # numbers, which its ScanBlock declines at run time: a range is no list)
                loop = self._index_loop(stmt)
                if loop is not None and (scan := self._scan(loop, bound)) is not None:
                    stmt = loop  # (its fallback, the loop as written, reads the rows too)
            if scan is None and isinstance(stmt, ast.For):
                scan = self._scan(stmt, bound)
            if scan is not None:
                out.extend(self._scan_call(scan, stmt, bound))
                continue
            self.rewrite(stmt, frozenset(bound))
            out.append(stmt)
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                bound |= _assigned_names(stmt)
        return out

    def _loop_ops(
        self, stmt, bound: set, run: list, outer: frozenset = frozenset(), varying=None
    ) -> int:
        """Tensor calls (counted twice: a loop makes them once per element) of ``for x in
        <container>: <body>`` that may join a run (LOOP_RUNS), or -1. The container is a
        local or its attribute chain (``self.layers``, ``self.enc.blocks[1:]``, or such
        chains under zip, enumerate or reversed; :meth:`_loop_chains`), checked to be a
        module when the run is called (:meth:`_close`'s guard; a loop nested in the body
        goes over a chain of its loop's element, ``block.layers``); the body is
        assignments that could join a run, such loops, and ifs on what the trace may fix
        (:meth:`_static_test`, LOOP_BRANCHES); no ``else``. The chains are read when the
        run is called: they read nothing the run assigns before the loop. A name the loop
        assigns that is not bound before it and is read after it is left unbound by a loop
        of no elements, where the region's return would fail: such a loop stays out.
        ``varying``: the names the run and the outermost loop assign (an if's test must
        not read them)."""
        if id(stmt) in self.plain_loops or stmt.orelse or not isinstance(stmt, ast.For):
            return -1
        targets = _target_names(stmt.target)
        chains = self._loop_chains(stmt.iter, outer)
        if targets is None or chains is None:
            return -1
        if varying is None:  # (the outermost loop)
            varying = _run_assigned(run) | _loop_assigned(stmt)
        inner = outer | targets
        body = set().union(*(_loop_assigned(sub) for sub in stmt.body))
        if not targets.isdisjoint(body):
            return -1  # (the body rebinding the loop's variable: kept simple)
        ops = self._body_ops(stmt.body, inner, varying - inner, bound, run)
        assigned = body | targets
        if ops <= 0 or not assigned.isdisjoint(_names(stmt.iter)):
            return -1
        if outer:
            return 2 * ops
        if not _run_assigned(run).isdisjoint(_names(stmt.iter)):
            return -1  # the guard reads the chains at the run's call, before it assigns
        if any(self._live(name, [stmt], []) for name in assigned - bound):
            return -1
        return 2 * ops

    def _body_ops(
        self, stmts: list, names: frozenset, varying: set, bound: set, run: list, branch=False
    ) -> int:
        """Tensor calls of a loop's body (see :meth:`_loop_ops`; ``names``: the variables
        of the loops around it), or -1. An if counts its larger branch. ``branch``: the
        body of an if's branch outside loops (:meth:`_if_ops`, RUN_BRANCHES): no loops,
        the tests of its ifs read only what a trace fixes (:meth:`_fixed_test`)."""
        ops = 0
        sub: Any
        for sub in stmts:
            if isinstance(sub, ast.For) and not branch:
                k = self._loop_ops(sub, bound, run, names, varying)
            elif isinstance(sub, ast.If) and (branch or LOOP_BRANCHES):
                test = self._fixed_test if branch else self._static_test
                if not test(sub.test, varying):
                    return -1
                a = self._body_ops(sub.body, names, varying, bound, run, branch)
                b = self._body_ops(sub.orelse, names, varying, bound, run, branch)
                k = -1 if a < 0 or b < 0 else max(a, b)
                if k >= 0 and not branch and self._unsafe_branches(sub, bound | varying | names):
                    k = -1  # (an if's branches: _if_ops checks them all at once)
            else:
                k = self._ops(sub)
                if k >= 0 and self._reads_container(sub.value):
                    k = -1
            if k < 0:
                return -1
            ops += k
        return ops

    def _static_test(self, test, varying: set) -> bool:
        """Whether an if's test in a loop body (LOOP_BRANCHES) reads only what a trace
        may fix: the loops' variables (``i < len(self.layers) - 1``), names the run does
        not assign (a flag argument), attributes (``self.residual``: a module's plain
        attribute, covered by its state), a tensor's shape (``h.shape[0] > 3``: the
        trace is keyed by shapes), constants and ``len``; no other call (a tensor's
        value would end the trace: correct, the region running as written, but slow)."""
        shapes = {
            id(sub.value)
            for sub in ast.walk(test)
            if isinstance(sub, ast.Attribute) and sub.attr in _STATIC_ATTRIBUTES
        }
        for sub in ast.walk(test):
            if isinstance(sub, _TEST_FORBIDDEN):
                return False
            if isinstance(sub, ast.Call):
                if not self._builtin_call(sub, "len"):
                    return False
            elif isinstance(sub, ast.Name) and id(sub) not in shapes:
                if sub.id in varying:
                    return False
                if sub.id not in self.local and not _global_ok(self.fn, sub.id, self.seen):
                    return False
        return True

    def _if_ops(self, stmt, bound: set, run: list) -> int:
        """Tensor calls (its larger branch's) of an if that may join the run before it
        (RUN_BRANCHES), or -1. Its test either reads nothing the run assigns
        (:meth:`_call_test`: evaluated at the region's call) or only what a trace may fix
        (:meth:`_fixed_test`); its branches are assignments that could join a run and such
        ifs (:meth:`_body_ops`), reading no attribute of the user's objects (those a
        region reads at its call, where a branch not taken must not read them). A name
        only some branches bind, unbound before, must not be read after it (the region
        could not return it)."""
        if self.dynamic:  # (the frame's names are read as such: keep them as written)
            return -1
        varying = _run_assigned(run)
        if not (self._call_test(stmt.test, varying) or self._fixed_test(stmt.test, varying)):
            return -1
        assigned = _loop_assigned(stmt)
        a = self._body_ops(stmt.body, frozenset(), varying | assigned, bound, run, True)
        b = self._body_ops(stmt.orelse, frozenset(), varying | assigned, bound, run, True)
        if a < 0 or b < 0 or self._unsafe_branches(stmt, bound):
            return -1
        maybe = assigned - _sure_assigned([stmt]) - bound
        if maybe == assigned or any(self._live(name, [stmt], []) for name in maybe):
            return -1
        return max(a, b)

    def _unsafe_branches(self, stmt, bound: set) -> bool:
        """Whether the branches of the if ``stmt`` read what a region would read at its
        call though eager reads it only where the branch is taken: an attribute of the
        user's objects (not hoisted out of a branch, the region would be given the object
        and keyed by it) or a local that may be unbound before the if (:func:`_maybe_read`;
        ``bound``: the names bound there)."""
        if _object_roots(_branch_values([stmt]), self.local) - self._called_through():
            return True
        return _maybe_read(stmt.body + stmt.orelse, bound, self.local)

    def _call_test(self, test, varying: set) -> bool:
        """Whether an if's test can be evaluated at the call of the region that holds the
        if (RUN_BRANCHES), as written (``and``/``or`` too): it reads no name the run
        assigns before it, and what it reads is the same for every instance or keys a
        trace anyway (:meth:`_test_reads`); besides a tensor's shape methods it calls only
        ``len``, ``isinstance``, ``hasattr``, ``getattr``, ``callable``. The region is
        given its truth value: its trace is keyed by the branch taken."""
        parts = self._test_reads(test, True)
        return parts is not None and self._test_names(test, parts, varying, True)

    def _fixed_test(self, test, varying: set) -> bool:
        """Whether an if's test inside a region (RUN_BRANCHES) reads only what its trace
        fixes (:meth:`_test_reads`; names the run assigns, ``varying``, only as a
        tensor's metadata or compared with None). No ``and``/``or`` (a region may read an
        attribute at its call that a short circuit would skip), and besides a tensor's
        shape methods no call but ``len`` of an attribute chain."""
        parts = self._test_reads(test, False)
        return parts is not None and self._test_names(test, parts, varying, False)

    def _test_reads(self, test, at_call: bool) -> tuple | None:
        """(ids of the names an if's test reads as a tensor's metadata, ``h.shape``,
        ``h.dim()``, or compares with None; ids of the names at the root of an attribute
        chain or given to ``hasattr``/``getattr``), or None if the test holds what no
        test joining a run may (``at_call``: evaluated at the region's call)."""
        meta: set = set()
        chains: set = set()
        for sub in ast.walk(test):
            if isinstance(sub, _TEST_FORBIDDEN):
                return None
            if not at_call and isinstance(sub, (ast.BoolOp, ast.IfExp)):
                return None
            if isinstance(sub, ast.Attribute):
                if isinstance(sub.value, ast.Name):
                    (meta if sub.attr in _STATIC_ATTRIBUTES else chains).add(id(sub.value))
            elif isinstance(sub, ast.Call):
                func = sub.func
                first = sub.args[0] if sub.args else None
                if isinstance(func, ast.Attribute) and func.attr in _META_METHODS:
                    if isinstance(func.value, ast.Name):
                        meta.add(id(func.value))
                elif self._builtin_call(sub, "len") and isinstance(first, ast.Attribute):
                    continue  # (``len(self.layers)``)
                elif not at_call:
                    return None
                elif self._builtin_call(sub, "isinstance") or (
                    isinstance(func, ast.Constant)
                    and func.value in (_ISINSTANCE_PLACEHOLDER, _IS_TENSOR_PLACEHOLDER)
                ):
                    if isinstance(first, ast.Name):
                        meta.add(id(first))  # (a type: the same for every instance)
                elif any(self._builtin_call(sub, b) for b in ("hasattr", "getattr")):
                    if isinstance(first, ast.Name):
                        chains.add(id(first))
                elif not self._builtin_call(sub, "callable"):
                    return None
            elif isinstance(sub, ast.Compare) and _none_test(sub):
                meta.add(id(sub.left))
        return meta, chains

    def _test_names(self, test, parts: tuple, varying: set, at_call: bool) -> bool:
        """Whether the names an if's test reads (``parts``: :meth:`_test_reads`) are what
        a test joining a run may read: names the run assigns (``varying``) only as
        metadata and only inside the trace; others as metadata, or as the root of an
        attribute chain if they are locals the function calls through (a module's flag,
        the same for every instance: not a tree node's, which would split the run's
        batches by branch) or globals; no other local (``if flag:``, an int: a value per
        instance)."""
        meta, chains = parts
        for sub in ast.walk(test):
            if not isinstance(sub, ast.Name):
                continue
            if sub.id in varying and (at_call or id(sub) not in meta):
                return False
            if id(sub) in meta:
                continue
            if sub.id in self.local:
                if id(sub) not in chains or sub.id not in self._called_through():
                    return False
            elif not at_call and not _global_ok(self.fn, sub.id, self.seen):
                return False
        return True

    def _called_through(self) -> set:
        """The function's locals it calls through somewhere (``m.fc(x)``, ``layer(h)``):
        modules and other objects with methods, not records of per-instance data (whose
        attributes a region reads at its call: REGION_ATTRIBUTES)."""
        if self.callers is None:
            self.callers = set()
            for sub in ast.walk(self.root) if self.root is not None else ():
                if isinstance(sub, ast.Call):
                    func = sub.func
                    while isinstance(func, (ast.Attribute, ast.Subscript)):
                        func = func.value
                    if isinstance(func, ast.Name) and func.id in self.local:
                        self.callers.add(func.id)
        return self.callers

    def _loop_chains(self, expr, outer: frozenset) -> list | None:
        """The containers a loop's iterable reads (see :meth:`_loop_ops`), or None: a
        local or a global model (``layers``, LOOP_NAMES) or its attribute chain
        (``self.layers``; with ``outer`` non-empty, one of those names or its attribute),
        optionally sliced by names and constants, alone or as the arguments of zip, or of
        enumerate or reversed with one argument."""
        parts = [expr]
        one = self._builtin_call(expr, "enumerate") or self._builtin_call(expr, "reversed")
        if (self._builtin_call(expr, "zip") and expr.args) or (one and len(expr.args) == 1):
            parts = expr.args
        for part in parts:
            chain = part
            if isinstance(chain, ast.Subscript) and isinstance(chain.slice, ast.Slice):
                if not all(isinstance(sub, _SLICE_PARTS) for sub in ast.walk(chain.slice)):
                    return None
                chain = chain.value
            if not isinstance(chain, ast.Attribute) and not (
                (outer or LOOP_NAMES) and isinstance(chain, ast.Name)  # (``for l in layers``)
            ):
                return None
            while isinstance(chain, ast.Attribute):
                chain = chain.value
            if not isinstance(chain, ast.Name):
                return None
            if outer:
                if chain.id not in outer:
                    return None
            elif chain.id not in self.local and not (
                GLOBAL_MODULES and isinstance(self.fn.__globals__.get(chain.id), torch.nn.Module)
            ):
                return None
        return parts

    def _reads_container(self, expr, made: set | frozenset = frozenset()) -> bool:
        """Whether ``expr`` reads one of the function's container locals (SPLIT_CONTAINERS)
        other than ``made`` (lists the run makes itself: a comprehension over a module's
        layers, LOOP_RUNS)."""
        if not self.containers:
            return False
        return not (self.containers - made).isdisjoint(_loads(self.fn, expr))

    def _comprehension_ops(self, stmt, run: list) -> int:
        """Tensor calls (twice, as a loop's) of ``y = [<value> for x in <container>]`` over a
        module's layers (``[head(h) for head in self.heads]``; the container as a loop's,
        :meth:`_loop_chains`) that may join a run guarded like a loop (LOOP_RUNS), or -1;
        where the guard fails, the comprehension is mapped as before (a scan)."""
        if not (
            LOOP_RUNS
            and id(stmt) not in self.plain_loops
            and isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.ListComp)
            and len(stmt.value.generators) == 1
        ):
            return -1
        gen = stmt.value.generators[0]
        if gen.ifs or gen.is_async or _target_names(gen.target) is None:
            return -1
        parts = self._loop_chains(gen.iter, frozenset())
        if parts is None or any(
            isinstance(p.value if isinstance(p, ast.Subscript) else p, ast.Name) for p in parts
        ):  # (not over a bare name: ``[emb(w) for w in words]`` is a scan's, as it was)
            return -1
        if not _run_assigned(run).isdisjoint(_names(gen.iter)):
            return -1  # (the guard reads the container at the run's call)
        k = self._ops(stmt)
        if k <= 0 or self._reads_container(stmt.value):
            return -1
        return 2 * k

    def _split_return(self, stmt: ast.Return, run: list) -> tuple[ast.Return, int]:
        """``return <expr>`` after a run, where ``<expr>`` is an outlinable right-hand side
        with tensor calls: ``_acrobat_return_k = <expr>`` appended to ``run`` and
        ``return _acrobat_return_k`` returned (a tree cell's last line, ``return
        torch.tanh(mix(...))``, joins the block of the lines before it). Alone (``run``
        empty: a tree cell's branch that only returns, or returns after a loop), it is a
        run of its own if it makes MIN_REGION_OPS tensor calls (LONE_RETURNS), unless it
        holds an embedding lookup, which keeps its fast path (``_rewrite_lookups``)."""
        if not SPLIT_RETURNS or stmt.value is None:
            return stmt, 0
        name = f"_acrobat_return_{self.returns}"
        assign = _located(ast.Assign(targets=[ast.Name(name, ast.Store())], value=stmt.value), stmt)
        k = self._ops(assign)
        # (``return u @ v`` after the run that made u and v: as an assignment of operators)
        operators = k == 0 and run and RUN_OPERATORS and _operates_on(stmt.value, run)
        if (k <= 0 and not operators) or self._reads_container(assign.value, _run_displays(run)):
            return stmt, 0
        if not run and (k < MIN_REGION_OPS or _has_lookup(stmt.value)):
            return stmt, 0
        self.returns += 1
        self.local.add(name)
        run.append(assign)
        return _located(ast.Return(value=ast.Name(name, ast.Load())), stmt), k

    def _split_demands(self, stmts: list) -> list:
        """``x = int(<expr>)`` (or float/bool, ``<expr>.item()``/``.tolist()``) as
        ``_acrobat_value_k = <expr>; x = int(_acrobat_value_k)`` where the expression is
        an outlinable right-hand side with tensor calls: the value read ends a run, the
        tensor work before it can join one (a parser's ``int(torch.argmax(scores +
        torch.tensor(mask)))``: one block node instead of an add and an argmax). Likewise
        an ``if`` whose test reads one (an early exit's ``if torch.sigmoid(stop(h)).item()
        > 0.6:``), and (SPLIT_STORES) a store of tensor work into an attribute or an item,
        ``node.h = <expr>`` / ``memo[k] = <expr>``, as ``_acrobat_stored_k = <expr>`` and
        the store of that name (Python evaluates the value before the target's parts)."""
        return [part for stmt in stmts for part in self._split(stmt)]

    def _split(self, stmt) -> list:
        """``stmt`` and the statements split off before it (see _split_demands)."""
        for prefix, split in (
            ("stored", _stored if SPLIT_STORES else None),
            ("value", _demanded if SPLIT_DEMANDS else None),
            ("list", _list_argument if SPLIT_LISTS else None),
            ("part", self._container_call if SPLIT_PARTS else None),
        ):
            found = split(stmt, self.local) if split is not None else None
            if found is None:
                continue
            name = f"_acrobat_{prefix}_{self.values}"
            assign = _located(
                ast.Assign(targets=[ast.Name(name, ast.Store())], value=found[0]), stmt
            )
            if self._ops(assign) <= 0:
                break
            self.values += 1
            found[1](ast.Name(name, ast.Load()))
            # what the statement reads runs after the split-off part, though its position
            # (the whole statement's: a store's target, an if's body) may lie inside the
            # part's: _live counts those reads as later ones
            self.after_reads[id(assign)] = {
                sub.id
                for sub in ast.walk(stmt)
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load)
            }
            if prefix == "list":
                self.containers.add(name)  # (a run given the list would run as written)
            elif prefix == "part":
                self.local.add(name)  # (a tensor: the statement can join a run)
            return [*self._split(assign), stmt]  # (a read's work may hold a list)
        return [stmt]

    def _container_call(self, stmt, local: set):
        """(C, put) when the value of ``stmt`` (an assignment's or a return's) starts by
        calling ``f(c, ...)`` on ``c``, one of the function's container locals
        (SPLIT_CONTAINERS): ``torch.stack(states)`` in ``return
        F.cross_entropy(m.out(torch.stack(states)[:-1]), tokens[1:])``. The call goes
        first in Python's order of evaluation (down first arguments, attributes,
        subscripted values and left operands, past name-chain lookups, which do
        nothing), so
        ``_acrobat_part_k = C`` before the statement is exact; it stays out of runs, and
        the rest, reading a tensor now, can be one (a loss over a loop's stacked outputs:
        one padded block for all lengths instead of its ops per size)."""
        if isinstance(stmt, ast.Assign):
            if not all(_plain_target(t, set()) for t in stmt.targets):
                return None
        elif not isinstance(stmt, ast.Return) or stmt.value is None:
            return None
        if not self.containers:
            return None
        put: Any = None  # sets the node in its parent
        node = stmt.value
        while True:
            if isinstance(node, ast.Call):
                if isinstance(node.func, ast.Attribute) and not _name_chain(node.func):
                    put, node = _value_setter(node.func), node.func.value  # (r.sum(0): r first)
                    continue
                if not node.args or not _name_chain(node.func):
                    return None
                if any(isinstance(a, ast.Starred) for a in node.args):
                    return None
                first = node.args[0]
                if isinstance(first, ast.Name) and first.id in self.containers:
                    return (node, put) if put is not None else None  # (not the whole value)
                put, node = _first_setter(node.args), first
            elif isinstance(node, (ast.Attribute, ast.Subscript)):
                put, node = _value_setter(node), node.value
            elif isinstance(node, ast.BinOp):  # (its left operand is evaluated first)
                put, node = _left_setter(node), node.left
            else:
                return None

    def _scan(self, stmt: ast.For, bound: set) -> _Region | None:
        """``stmt`` outlined as a loop (ScanBlock), if it has no ``else`` and its body is
        outlinable assignments and ``out.append(value)`` calls (``out`` bound before the
        loop and read nowhere else in it), making a tensor call, and it is either
        ``for c in range(...)`` with ``c`` never read (counted), or ``for x in <iterable>``
        with ``x`` read only inside the body (over a sequence). Its state (the names it
        assigns that are bound before it) is carried, names it reads and does not assign
        are passed in, and a name it assigns that is not bound before must be read only
        inside it after its assignment (a temporary). None otherwise."""
        it: Any = stmt.iter
        target: Any = stmt.target
        if not self.scannable or stmt.orelse:
            return None
        zipped = isinstance(target, ast.Tuple) and self._builtin_call(it, "zip")
        if zipped:  # for x, y in zip(xs, ys): one element of each sequence per step
            names = [t.id for t in target.elts if isinstance(t, ast.Name)]
            if not names or len(names) != len(target.elts) or len(set(names)) != len(names):
                return None
            if len(it.args) != len(names):
                return None
        elif isinstance(target, ast.Name):
            names = [target.id]
        else:
            return None
        counted = not zipped and self._range(it)
        body_loads = _load_counts(stmt.body)
        if any(_loads_outside_loops_over(self.root, name) for name in names):
            return None  # the counter or element is read after a loop (its last value)
        if counted and body_loads.get(target.id, 0):
            return None  # the counter is read: each step would differ
        body: list = []  # assignments; appends as ``_acrobat_outJ = value``
        lists: list[str] = []  # the list each output is appended to, in order
        ops = 0
        for s in stmt.body:
            append = _append(s)
            if append is not None:
                name, value = append
                if name not in bound or name in names:
                    return None
                s = _located(
                    ast.Assign(
                        targets=[ast.Name(f"_acrobat_out{len(lists)}", ast.Store())], value=value
                    ),
                    s,
                )
                lists.append(name)
            k = self._ops(s)
            if k < 0:
                return None
            ops += k
            body.append(s)
        if ops == 0:
            return None
        for name in set(lists):  # appended to only: the loop must not read the list
            if body_loads.get(name, 0) != lists.count(name) or _read_names(it) & {name}:
                return None
        assigned: list[str] = []
        reads: list[str] = []  # local names read before the body assigns them
        for s in body:
            inner = _comprehension_names(s.value)
            for sub in ast.walk(s.value):
                if (
                    isinstance(sub, ast.Name)
                    and isinstance(sub.ctx, ast.Load)
                    and sub.id in self.local
                    and sub.id not in names
                    and sub.id not in inner
                    and sub.id not in assigned
                    and sub.id not in reads
                ):
                    reads.append(sub.id)
            for name in sorted(_assigned_names(s)):
                if name not in assigned and not name.startswith("_acrobat_out"):
                    assigned.append(name)
        if any(name in assigned for name in names):
            return None
        carried = [a for a in assigned if a in bound]
        lasts: list[str] = []  # temporaries read after the loop (their last values)
        for a in assigned:
            if a not in bound and (a in reads or self.loads.get(a, 0) != body_loads.get(a, 0)):
                if a in reads or not SCAN_LASTS:
                    return None  # read before its first assignment (or after the loop)
                lasts.append(a)
        if not carried and not lists:
            return None
        # a temporary read after the loop (``output, hidden = rnn(x[i], hidden)``, then
        # ``return output``) is one more output a step, appended to a list of the rewrite's
        # own: the loop's last value is that list's last item (_scan_call)
        last_lists = [f"_acrobat_last{len(self.regions)}_{j}" for j in range(len(lasts))]
        for a, name in zip(lasts, last_lists):
            out = ast.Name(f"_acrobat_out{len(lists)}", ast.Store())
            keep = ast.Assign(targets=[out], value=ast.Name(a, ast.Load()))
            body.append(_located(keep, body[-1]))
            lists.append(name)
        # the body's statements are shared with the loop kept to run as written: the
        # outlined copy is a deep copy (hoisting rewrites it)
        body = [copy.deepcopy(s) for s in body]
        # a state the body sets to a value it was given (``dec_in = target[t]``, the next
        # step's input: an element, or a name bound outside the body) would be no output
        # of the traced step but one of its arguments, which a Scan cannot carry: the
        # outlined copy hands on a clone of it (the same value; the loop as written keeps
        # the statement as it is)
        made: set = set()
        kept = set(carried) | set(lasts)
        for s in body:
            if isinstance(s, ast.Assign) and len(s.targets) == 1:
                lhs: Any = s.targets[0]
                rhs: Any = s.value
                pairs = [(lhs, rhs)]
                if (  # prev, h = h, cell(x, h): element by element
                    isinstance(lhs, ast.Tuple)
                    and isinstance(rhs, ast.Tuple)
                    and len(lhs.elts) == len(rhs.elts)
                ):
                    pairs = list(zip(lhs.elts, rhs.elts))
                for j, (t, v) in enumerate(pairs):
                    if (
                        isinstance(t, ast.Name)
                        and t.id in kept
                        and isinstance(v, ast.Name)
                        and v.id not in made
                    ):
                        clone = ast.Attribute(ast.Name(v.id, ast.Load()), "clone", ast.Load())
                        call = _located(ast.Call(clone, [], []), v)
                        if v is rhs:
                            s.value = call
                        else:
                            rhs.elts[j] = call
            made |= _assigned_names(s)
        # an element read only as ``torch.tensor(x)`` (a word id) may be a Python number:
        # the outlined body takes the tensor itself, so a scan makes one tensor of all
        # rows' numbers at once (values; else each step's torch.tensor is a node)
        numbers = []
        if not counted:
            for j, name in enumerate(names):
                unwrap = _ValueUnwrapper(self.fn, name)
                for s in body:
                    s.value = unwrap.visit(s.value)
                if unwrap.count and unwrap.count == body_loads.get(name, 0):
                    numbers.append(j)
                elif unwrap.count:  # read otherwise too: the body as written
                    return None
        # attributes of names the body only reads (``instance.x``) are read once, at the
        # call: the object itself would key the trace by identity, one per instance
        hoisted: list = []
        fixed = {r for r in reads if r not in assigned}
        for s in body:
            roots = fixed
            if MODULE_ATTRIBUTES:
                roots = fixed | _module_roots(self.fn, s.value, self.local)
            s.value = _AttributeHoister(roots, hoisted).visit(s.value)
        free = []
        for s in body:
            for sub in ast.walk(s.value):
                if (
                    isinstance(sub, ast.Name)
                    and isinstance(sub.ctx, ast.Load)
                    and sub.id in fixed
                    and sub.id not in free
                ):
                    free.append(sub.id)
        outputs = carried + [f"_acrobat_out{j}" for j in range(len(lists))]
        params = carried + [name for name, _ in hoisted] + free
        if zipped:  # the scan takes the sequences; the loop as written zips them
            it = ast.Tuple(list(it.args), ast.Load())
        values = [it, ast.Tuple([ast.Name(x, ast.Load()) for x in lists], ast.Load())]
        values += [ast.Name(p, ast.Load()) for p in carried]
        values += [expr for _, expr in hoisted] + [ast.Name(p, ast.Load()) for p in free]
        if not counted:
            params = names + params
        region = _Region(len(self.regions), body, params, values, carried, len(carried))
        region.definition.body[-1].value = _located(
            ast.Tuple([ast.Name(o, ast.Load()) for o in outputs], ast.Load()), body[-1]
        )
        region.appends = len(lists)
        region.zipped = zipped
        region.sequences = 0 if counted else len(names)
        region.values = tuple(numbers)
        region.reverse = not counted and self._builtin_call(it, "reversed") and len(it.args) == 1
        region.lasts = list(zip(lasts, last_lists))
        self.local.update(last_lists)
        self.regions.append(region)
        return region

    def _index_loop(self, stmt: ast.For) -> ast.For | None:
        """``for t in range(...)`` (or ``reversed(range(...))``) whose counter the body
        reads only as ``x[t]`` or ``x[t + c]`` / ``x[t - c]`` (``c`` an int constant), ``x``
        a local the body reads only that way, rewritten to a loop over those rows (a
        sequence per ``(x, c)``)::

            for _acrobat_rowK_0, _acrobat_rowK_1 in zip(
                index_rows(x, range(...)), index_rows(y, range(...))
            ):
                <body with x[t] -> _acrobat_rowK_0, y[t] -> _acrobat_rowK_1>

        which ``_scan`` can take as a loop over sequences (an RNN written over positions,
        ``h = cell(x[t], h)``: one node per instance instead of its ops at every step).
        The rows are the same values ``x[t]`` reads at each step (``index_rows``: one
        unbind of a lazy tensor, eager's IndexError for a position out of range, before
        the loop instead of at that step). None where it does not apply: the counter read
        otherwise or after the loop, an ``else``, or a range whose arguments are not plain
        reads (the zip evaluates the range once per sequence)."""
        target, it = stmt.target, stmt.iter
        if stmt.orelse or not isinstance(target, ast.Name) or not self.scannable:
            return None
        counter = target.id
        span: Any = it
        if self._builtin_call(it, "reversed") and len(span.args) == 1:
            span = span.args[0]
        if not self._range(span):
            return None
        if self.root is None or _loads_outside_loops_over(self.root, counter):
            return None  # its last value is read after the loop
        uses: list[tuple[str, int]] = []  # (x, c) of each x[t + c]
        for s in stmt.body:
            for sub in ast.walk(s):
                if (
                    isinstance(sub, ast.Subscript)
                    and isinstance(sub.ctx, ast.Load)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id in self.local
                    and sub.value.id != counter
                    and (c := _counter_offset(sub.slice, counter)) is not None
                ):
                    uses.append((sub.value.id, c))
        if not uses:
            return None
        sequences = sorted(set(uses))
        read = [x for x, _ in uses]
        seen = dict.fromkeys((counter, *read), 0)  # every Name node of them, any ctx
        for s in stmt.body:
            for sub in ast.walk(s):
                if isinstance(sub, ast.Name) and sub.id in seen:
                    seen[sub.id] += 1
                elif isinstance(sub, (ast.FunctionDef, ast.Lambda, ast.ClassDef)):
                    return None
        if seen.pop(counter) != len(uses):
            return None  # the counter read otherwise (or bound in the body)
        if any(n != read.count(x) for x, n in seen.items()):
            return None  # x read (or bound) otherwise than as x[t + c]
        if len(sequences) > 1 and not all(_plain_read(a) for a in getattr(span, "args", ())):
            return None
        k = len(self.regions)
        names = {xc: f"_acrobat_row{k}_{j}" for j, xc in enumerate(sequences)}
        body = [_RowReplacer(counter, names).visit(copy.deepcopy(s)) for s in stmt.body]
        # the lists the body appends to: one of them may be x under another name, whose
        # rows the loop as written reads as they grow (index_rows checks, at run time)
        grown = sorted({found[0] for s in stmt.body if (found := _append(s)) is not None})
        calls: list[ast.expr] = [
            ast.Call(
                func=ast.Constant(_ROWS_PLACEHOLDER),
                args=[
                    ast.Name(x, ast.Load()),
                    copy.deepcopy(it),
                    ast.Tuple([ast.Name(g, ast.Load()) for g in grown], ast.Load()),
                    ast.Constant(c),
                ],
                keywords=[],
            )
            for x, c in sequences
        ]
        if len(calls) == 1:
            new_target: ast.expr = ast.Name(names[sequences[0]], ast.Store())
            new_iter = calls[0]
        else:
            stores: list[ast.expr] = [ast.Name(names[x], ast.Store()) for x in sequences]
            new_target = ast.Tuple(stores, ast.Store())
            new_iter = ast.Call(ast.Name("zip", ast.Load()), calls, [])
        self.local.update(names.values())  # (locals of the rewritten code)
        loop = ast.For(target=new_target, iter=new_iter, body=body, orelse=[])
        ast.copy_location(loop, stmt)
        loop.end_lineno, loop.end_col_offset = stmt.end_lineno, stmt.end_col_offset
        return _located(loop, stmt)

    def _scan_call(self, region: _Region, loop: ast.For, bound: set) -> list:
        """The statements replacing ``loop``: the ScanBlock records the loop as one node
        and returns the carried values, or returns None and the loop runs as written
        (its body's runs outlined as usual)::

            _acrobat_itK = <iterable>
            _acrobat_stK = <ScanBlock>(_acrobat_itK, (lists), *carried, *free)
            if _acrobat_stK is None:
                for x in _acrobat_itK: <body>
            else:
                (*carried,) = _acrobat_stK
        """
        k = len(self.regions) - 1
        it, st = f"_acrobat_it{k}", f"_acrobat_st{k}"
        call = region.call
        values = call.value.args
        iterable = values[0]
        if region.reverse:  # for x in reversed(xs): the scan takes xs and reverses it
            iterable = iterable.args[0]
        first = ast.Assign(targets=[ast.Name(it, ast.Store())], value=iterable)
        values[0] = ast.Name(it, ast.Load())
        state = ast.Assign(targets=[ast.Name(st, ast.Store())], value=call.value)
        call.value = ast.Name(st, ast.Load())
        loop.iter = ast.Name(it, ast.Load())
        if region.reverse:
            loop.iter = ast.Call(ast.Name("reversed", ast.Load()), [loop.iter], [])
        elif region.zipped:
            loop.iter = ast.Call(
                ast.Name("zip", ast.Load()), [ast.Starred(loop.iter, ast.Load())], []
            )
        self.rewrite(loop, frozenset(bound))
        test = ast.Compare(ast.Name(st, ast.Load()), [ast.Is()], [ast.Constant(None)])
        done: list[ast.stmt] = [call]
        starts: list[ast.stmt] = []
        for a, name in region.lasts:  # _acrobat_lastK_j = [] ... if it: a = its last item
            made = ast.Assign(targets=[ast.Name(name, ast.Store())], value=ast.List([], ast.Load()))
            starts.append(made)
            last = ast.Subscript(ast.Name(name, ast.Load()), ast.Constant(-1), ast.Load())
            done.append(
                ast.If(
                    test=ast.Name(name, ast.Load()),
                    body=[ast.Assign(targets=[ast.Name(a, ast.Store())], value=last)],
                    orelse=[],
                )
            )
        branch = ast.If(test=test, body=[loop], orelse=done)
        return [_located(node, loop) for node in (first, *starts, state, branch)]

    def _range(self, expr) -> bool:
        """``expr`` is ``range(...)`` (the builtin) or a local bound to one before its loop
        (_rewrite_row_writes)."""
        if isinstance(expr, ast.Name):
            return expr.id in self.ranges
        return self._builtin_call(expr, "range") and len(expr.args) <= 3

    def _builtin_call(self, expr, name: str) -> bool:
        """``expr`` is a call of the builtin ``name`` (not shadowed) with positional,
        unstarred arguments only."""
        shadowed = name in self.local or name in self.fn.__globals__
        return not shadowed and _plain_call(expr, name)

    def _comprehension(self, stmt, bound: set) -> list | None:
        """``y = [value for x in xs]`` (one ``for``, no ``if``) outlined as a loop without
        state: the statements replacing it, or None. It is rewritten to the loop it
        stands for, its variables renamed so they cannot meet the function's::

            _acrobat_lsK = []
            <the loop's scan call: for _acrobat_eK_0 in xs: _acrobat_lsK.append(value)>
            y = _acrobat_lsK

        so every element's ``value`` is one step of a scan whose steps do not depend on
        each other: one node per instance (a per-token classifier, BiRNN's output)."""
        if not (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.ListComp)
            and len(stmt.value.generators) == 1
        ):
            return None
        comp = stmt.value
        gen = comp.generators[0]
        if gen.ifs or gen.is_async:
            return None
        targets: list[Any] = gen.target.elts if isinstance(gen.target, ast.Tuple) else [gen.target]
        if not all(isinstance(t, ast.Name) for t in targets):
            return None
        names = [t.id for t in targets]
        if len(set(names)) != len(names) or set(names) & _comprehension_names(comp.elt):
            return None
        k = len(self.regions)
        fresh = {name: f"_acrobat_e{k}_{i}" for i, name in enumerate(names)}
        value = _Renamer(fresh).visit(copy.deepcopy(comp.elt))
        lst = f"_acrobat_ls{k}"
        store: list[ast.expr] = [ast.Name(fresh[n], ast.Store()) for n in names]
        target = store[0] if isinstance(gen.target, ast.Name) else ast.Tuple(store, ast.Store())
        append = ast.Expr(
            ast.Call(ast.Attribute(ast.Name(lst, ast.Load()), "append", ast.Load()), [value], [])
        )
        loop = ast.For(target=target, iter=copy.deepcopy(gen.iter), body=[append], orelse=[])
        loop = _located(loop, stmt)
        self.local |= {lst, *fresh.values()}  # locals of the rewritten function
        region = self._scan(loop, set(bound) | {lst})
        if region is None:
            return None
        start = ast.Assign(targets=[ast.Name(lst, ast.Store())], value=ast.List([], ast.Load()))
        done = ast.Assign(targets=[ast.Name(stmt.targets[0].id, ast.Store())],
                          value=ast.Name(lst, ast.Load()))  # fmt: skip
        calls = self._scan_call(region, loop, set(bound) | {lst})
        return [_located(start, stmt), *calls, _located(done, stmt)]

    def _close(self, run: list, start: frozenset, loops: list) -> list:
        """The region call replacing ``run`` (``start``: the names bound before it). A run
        holding loops (``loops``: those and its comprehensions over layers, LOOP_RUNS)
        is called where their containers are modules
        (all_modules), and otherwise runs as the statements would have been rewritten
        with the loops left out of runs (a scan, a region per trip)."""
        params: list = []
        assigned: list = []
        hoisted: list = []  # (parameter, expression evaluated at the call)
        objects = _object_roots(run, self.local) if REGION_ATTRIBUTES else set()
        if loops:
            memo: dict = {}
            plain = copy.deepcopy(run, memo)  # (before the hoisting below edits the run)
            for stmt in run:
                if id(stmt) in self.after_reads:
                    self.after_reads[id(memo[id(stmt)])] = self.after_reads[id(stmt)]
            found = [
                self._loop_chains(
                    loop.iter if isinstance(loop, ast.For) else loop.value.generators[0].iter,
                    frozenset(),
                )
                or []
                for loop in loops
            ]
            chains = [copy.deepcopy(c) for parts in found for c in parts]

        def take(expr, inside: set, branch: bool = False):
            """``expr`` with its parts read at the call hoisted, its parameters noted;
            ``inside``: the names of the loops around it (assigned there); ``branch``: in
            an if's branch or test (RUN_BRANCHES), where nothing that could fail or
            make a tensor is read at the call (the branch may not be taken)."""
            bound = _comprehension_names(expr)
            keep = set(assigned) | bound | inside  # names the call site cannot evaluate
            if not inside and not branch:  # (in a loop: a new tensor per element, as written)
                expr = _FactoryHoister(self.fn, keep, hoisted).visit(expr)
            if REGION_SUBSCRIPTS and not branch:  # (first: ``obj.w[i]`` is read whole at the call)
                expr = _SubscriptHoister(self.local - keep, hoisted).visit(expr)
            roots = set() if branch else objects - keep
            if MODULE_ATTRIBUTES:
                roots |= _module_roots(self.fn, expr, self.local)
            if roots:
                expr = _AttributeHoister(roots, hoisted).visit(expr)
            for sub in ast.walk(expr):
                if (
                    isinstance(sub, ast.Name)
                    and sub.id in self.local
                    and sub.id not in bound
                    and sub.id not in assigned
                    and sub.id not in params
                ):
                    params.append(sub.id)
            return expr

        def visit(stmt, inside: set, branch: bool = False, top: bool = False) -> None:
            if isinstance(stmt, ast.If) and not inside:  # (RUN_BRANCHES)
                if top and self._call_test(stmt.test, set(assigned)):
                    # evaluated at the call, as written; the region is given its truth
                    test = ast.UnaryOp(ast.Not(), ast.UnaryOp(ast.Not(), stmt.test))
                    stmt.test = _parameter_for(_located(test, stmt.test), hoisted)
                else:
                    stmt.test = take(stmt.test, inside, True)
                for name in sorted(_loop_assigned(stmt) - _sure_assigned([stmt])):
                    if name in start and name not in assigned and name not in params:
                        params.append(name)  # (a branch not taken leaves it as it was)
                for part in stmt.body + stmt.orelse:
                    visit(part, inside, True)
                return
            if isinstance(stmt, ast.If):  # (in a loop's body: LOOP_BRANCHES)
                stmt.test = take(stmt.test, inside)
                for part in stmt.body + stmt.orelse:
                    visit(part, inside, True)
                return
            if isinstance(stmt, ast.For):
                stmt.iter = take(stmt.iter, inside, branch)
                inside = inside | _loop_assigned(stmt)
                targets = [stmt.target]
            else:
                stmt.value = take(stmt.value, inside, branch)
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name) and sub.id not in assigned:
                        assigned.append(sub.id)
            for sub in stmt.body if isinstance(stmt, ast.For) else ():
                visit(sub, inside, branch)

        for stmt in run:
            visit(stmt, set(), top=True)
        names = [p for p, _ in hoisted] + params
        # torch.tensor(x) moved out of the run: the call passes x, and the dispatcher
        # makes the tensor (inside a map, a data node without torch's dispatch)
        made = tuple(i for i, (_, e) in enumerate(hoisted) if _plain_tensor_call(e))
        values = [e.args[0] if i in made else e for i, (_, e) in enumerate(hoisted)]
        values += [ast.Name(p, ast.Load()) for p in params]
        maybe = _maybe_unbound(run, start)  # (an if's branch not taken: RUN_BRANCHES)
        if maybe:
            assigned = [a for a in assigned if a not in maybe]
        if LIVE_OUTPUTS and not self.dynamic:
            live = [a for a in assigned if self._live(a, run, params)]
            assigned = live or assigned[-1:]  # (a run nothing reads still runs: its errors)
        region = _Region(len(self.regions), run, names, values, assigned)
        region.tensor_args = made
        region.index_args = _index_only(run, names)
        region.state_args = _written(run, names)
        self.regions.append(region)
        if not loops:
            return [region.call]
        self.plain_loops.update(id(memo[id(stmt)]) for stmt in loops)
        check = ast.Call(ast.Constant(_MODULES_PLACEHOLDER), chains, [])
        guard = ast.If(test=check, body=[region.call], orelse=self._block(plain, start))
        return [_located(guard, run[0], run[-1])]

    def _live(self, name: str, run: list, params: list) -> bool:
        """Whether ``name``, assigned in ``run``, may be read after it: a read of it later
        in the source, or anywhere in a loop around the run (the loop may come back to
        it), or the run reads its value from before (a loop's carried state). Names the
        rewriting made (``_acrobat_*``) and names not plain locals (cells, globals) are."""
        if name.startswith("_acrobat_") or name not in self.local or name in params:
            return True
        if any(name in self.after_reads.get(id(stmt), ()) for stmt in run):
            return True  # (read by the rest of a statement split in the run: after it)
        first, last = _span(run)
        loops = [(a, b) for a, b in self.loop_spans if a <= first and last <= b]
        for pos in self.load_pos.get(name, ()):
            if first <= pos <= last:
                continue  # (the run's own reads, after it assigned the name)
            if pos > last or any(a <= pos <= b for a, b in loops):
                return True
        return False

    def _ops(self, stmt) -> int:
        """Tensor calls of an outlinable assignment; -1 if it is not one."""
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None and stmt.simple:
            targets, value = [stmt.target], stmt.value
        else:
            return -1
        if (
            _owning(value)
            and len(targets) == 1
            and isinstance(targets[0], ast.Name)
            and targets[0].id in self.written
        ):  # a constant written into in place later: made where the write can build it
            return -1  # (from a trace it would be the trace's one tensor, every call's)
        if not all(_plain_target(t, set()) for t in targets):
            return -1
        bound = _comprehension_names(value)
        if bound & self.local:
            return -1  # a comprehension variable shadowing a local: keep it simple
        ops = operators = 0
        modules = _module_roots(self.fn, value, self.local) if MODULE_ATTRIBUTES else set()
        for sub in ast.walk(value):
            if isinstance(sub, _FORBIDDEN):
                return -1
            if isinstance(sub, ast.comprehension) and (sub.ifs or sub.is_async):
                return -1
            if isinstance(sub, ast.Call):
                f = sub.func
                if isinstance(f, ast.Constant) and f.value in _WRITE_PLACEHOLDERS:
                    ops += f.value in _ONE_OP_PLACEHOLDERS  # (x[i] = v, acc += v: one op)
                    continue
                if (
                    isinstance(f, ast.Name)
                    and f.id in _DEMANDS
                    and f.id not in self.local
                    and not all(isinstance(a, ast.Constant) for a in sub.args)
                ):  # (float("-inf") reads no value)
                    return -1
                if isinstance(f, ast.Attribute) and f.attr in _DEMAND_METHODS:
                    return -1
                if not _call_ok(f, self.local) or (CONTROL_CALLERS and self._control_call(f)):
                    return -1
                ops += self._tensor_call(f)
            elif _is_operator(sub):
                operators += 1
            if (
                isinstance(sub, ast.Name)
                and isinstance(sub.ctx, ast.Load)
                and sub.id not in self.local
                and sub.id not in bound
                and sub.id not in modules
                and not _global_ok(self.fn, sub.id, self.seen)
            ):
                return -1
        # an operator beside a tensor call is likely a tensor op too (o * torch.tanh(c));
        # alone, operators are as likely index arithmetic (i = 2 * i + 1)
        return ops + operators if ops and OPERATORS else ops

    def _control_call(self, f) -> bool:
        """Whether the call is of a function with control flow: a global one, or a method
        of the function's own class by name (``self.encode(tree)``, the function itself
        included). Left out of runs: a region would run it inside its trace, given the
        objects it recurses over (a trace per call: the region as written)."""
        if isinstance(f, ast.Name):
            if f.id not in self.local:
                value = self.fn.__globals__.get(f.id)
                if GLOBAL_MODULES and isinstance(value, torch.nn.Module):
                    return _control_method(value, "forward")  # (``net(tree)``)
                return isinstance(value, types.FunctionType) and has_control_flow(value)
            if f.id != "self" or not _takes_self(self.fn):
                return False
            name = "forward"  # ``self(child)``: the module's own forward, recursing
        elif isinstance(f, ast.Attribute):
            name = f.attr
            owner = f.value
            if GLOBAL_MODULES and isinstance(owner, ast.Name) and owner.id not in self.local:
                value = self.fn.__globals__.get(owner.id)
                if isinstance(value, torch.nn.Module):  # (a global model's method)
                    return _control_method(value, name)
            if name in _MAP_FLOW:  # (a method of the map's models, by name)
                return True
        else:
            return False
        if self.control_methods is None:
            self.control_methods = _control_methods(self.fn)
        return name in self.control_methods

    def _tensor_call(self, f) -> int:
        """1 if the call is likely a tensor op: torch's, a method or module of a local,
        or a straight-line function; builtins and other globals count 0."""
        if isinstance(f, ast.Name):
            if f.id in self.local:
                return 1
            value = self.fn.__globals__.get(f.id)
            return int(isinstance(value, types.FunctionType) or _is_torch_object(value))
        root = f
        while isinstance(root, ast.Attribute):
            root = root.value
        if not isinstance(root, ast.Name):
            return 1  # a method of a computed value: (a + b).tanh()
        if root.id in self.local:
            return 1
        value = self.fn.__globals__.get(root.id)
        if GLOBAL_MODULES and isinstance(value, torch.nn.Module):
            return 1  # (a global model's layer, ``net.inp(x)``)
        return int(isinstance(value, types.ModuleType) and value.__name__.split(".")[0] == "torch")


# Context managers that never swallow an exception (so a run inside their body may
# assign its names all at once at the end): acrobat.phase and torch's grad modes.
_TRANSPARENT = {"phase", "no_grad", "enable_grad", "inference_mode", "set_grad_enabled"}


def _transparent(expr) -> bool:
    if not isinstance(expr, ast.Call):
        return False
    f = expr.func
    return (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) in _TRANSPARENT


def _append(stmt) -> tuple[str, ast.expr] | None:
    """(list name, value) if ``stmt`` is ``name.append(value)``."""
    call = _method_statement(stmt, ("append",))
    if call is None or len(call.args) != 1 or call.keywords:
        return None
    return call.func.value.id, call.args[0]  # type: ignore[attr-defined]


def _list_argument(stmt, local: set):
    """(C, put) when ``stmt`` is ``target = f(C, ...)`` with ``C`` a list comprehension
    of one ``for`` and no ``if`` (``scores = torch.cat([self.s(h) for h in hs])``), ``f``
    a name or attribute chain (looked up before ``C`` is evaluated, without effect on it),
    also under first arguments and attributes of results (``topk(cat([...]), 2).indices``):
    ``_acrobat_list_k = C`` is then a comprehension of its own, mapped as a scan."""
    if not isinstance(stmt, ast.Assign) or not all(_plain_target(t, set()) for t in stmt.targets):
        return None
    call = stmt.value
    while isinstance(call, ast.Attribute):  # (``topk(...).indices``: read after the call)
        call = call.value
    while isinstance(call, ast.Call) and call.args and _name_chain(call.func):
        comp = call.args[0]  # (first arguments all the way down: evaluated first)
        if (
            isinstance(comp, ast.ListComp)
            and len(comp.generators) == 1
            and not comp.generators[0].ifs
            and not comp.generators[0].is_async
        ):
            return comp, _first_setter(call.args)
        call = comp
        while isinstance(call, ast.Attribute):
            call = call.value
    return None


def _value_setter(node):
    """A function making ``node.value`` its argument."""
    return lambda e: setattr(node, "value", e)


def _left_setter(node):
    """A function making ``node.left`` its argument."""
    return lambda e: setattr(node, "left", e)


def _first_setter(args: list):
    """A function making its argument ``args[0]``."""
    return lambda e: args.__setitem__(0, e)


def _name_chain(f) -> bool:
    """A name or an attribute chain rooted at one (``torch.cat``, ``self.s``)."""
    while isinstance(f, ast.Attribute):
        f = f.value
    return isinstance(f, ast.Name)


def _stored(stmt, local: set):
    """(E, put) when ``stmt`` is ``a.b = E`` or ``a[k] = E`` (one target, a store), or
    ``xs.append(E)`` (``appendleft``, ``add``: a container local of the function given one
    value; its method is looked up before E is evaluated, without effect on E): ``put``
    makes its argument the value."""
    if (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], (ast.Attribute, ast.Subscript))
    ):
        return stmt.value, lambda e: setattr(stmt, "value", e)
    call = _method_statement(stmt, _STORING)
    if call is not None and len(call.args) == 1 and not call.keywords:
        name = call.func.value.id  # type: ignore[attr-defined]
        if name in local and not name.startswith("_acrobat_"):  # (a comprehension's: as
            return call.args[0], _first_setter(call.args)  # it was)
    return None


_STORING = {"append", "appendleft", "add"}


def _demanded(stmt, local: set):
    """(E, put) when ``stmt`` is ``target = int(E)`` (float, bool; the builtin) or
    ``target = E.item()`` / ``E.tolist()``, or an ``if`` testing such a read (``if
    E.item() > 0.5:``, ``if not bool(E):``): ``put(expr)`` makes ``expr`` the operand."""
    if isinstance(stmt, ast.If):
        test = stmt.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            test = test.left  # (evaluated first: E before the comparator, as written)
        elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test = test.operand
        return _demand_call(test, local)
    if not isinstance(stmt, ast.Assign) or not all(_plain_target(t, set()) for t in stmt.targets):
        return None
    return _demand_call(stmt.value, local)


def _demand_call(call, local: set):
    """(E, put) when ``call`` is ``int(E)`` / ``float(E)`` / ``bool(E)`` (the builtins),
    ``E.item()`` or ``E.tolist()``."""
    if not isinstance(call, ast.Call) or call.keywords:
        return None
    f = call.func
    builtin = isinstance(f, ast.Name) and f.id in ("int", "float", "bool") and f.id not in local
    if builtin and len(call.args) == 1 and not isinstance(call.args[0], ast.Starred):
        return call.args[0], _first_setter(call.args)
    if isinstance(f, ast.Attribute) and f.attr in ("item", "tolist") and not call.args:
        return f.value, lambda e: setattr(f, "value", e)
    return None


def _names(expr) -> set:
    return {sub.id for sub in ast.walk(expr) if isinstance(sub, ast.Name)}


def _assigned_names(stmt) -> set:
    """The names a plain assignment binds."""
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    return {sub.id for t in targets for sub in ast.walk(t) if isinstance(sub, ast.Name)}


_SLICE_PARTS = (ast.Name, ast.Constant, ast.Slice, ast.Load, ast.UnaryOp, ast.USub)


def _run_assigned(run: list) -> set:
    """The names the statements of ``run`` bind (:func:`_loop_assigned`)."""
    return set().union(*(_loop_assigned(stmt) for stmt in run))


def _loop_assigned(stmt) -> set:
    """The names a statement of a run binds: an assignment's, or a loop's (LOOP_RUNS: its
    variables and its body's, nested loops' and ifs' included)."""
    if isinstance(stmt, ast.If):
        return set().union(*(_loop_assigned(sub) for sub in stmt.body + stmt.orelse))
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        return _assigned_names(stmt)
    if not isinstance(stmt, ast.For):
        return set()  # (any other statement keeps its loop out of runs: _body_ops)
    names = {sub.id for sub in ast.walk(stmt.target) if isinstance(sub, ast.Name)}
    return names.union(*(_loop_assigned(sub) for sub in stmt.body))


def _sure_assigned(stmts: list) -> set:
    """The names every path through ``stmts`` (a run's assignments and ifs) binds (a
    loop binds none for sure: it may run no trip)."""
    names: set = set()
    for stmt in stmts:
        if isinstance(stmt, ast.If):
            names |= _sure_assigned(stmt.body) & _sure_assigned(stmt.orelse)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            names |= _assigned_names(stmt)
    return names


def _none_test(node) -> bool:
    """Whether ``node`` is ``name is None`` / ``name is not None`` (chained alike)."""
    return (
        isinstance(node, ast.Compare)
        and isinstance(node.left, ast.Name)
        and all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)
        and all(isinstance(c, ast.Constant) and c.value is None for c in node.comparators)
    )


def _maybe_read(stmts: list, bound: set | frozenset, local: set) -> bool:
    """Whether ``stmts`` (an if's branches) read a local that may be unbound before them
    (not in ``bound``) and that they do not bind themselves: a region would read it at
    its call, where eager, not taking the branch, never reads it."""
    own = _run_assigned(stmts)
    for stmt in stmts:
        for sub in ast.walk(stmt):
            if isinstance(sub, _COMPREHENSIONS):
                own = own | _comprehension_names(sub)
    for stmt in stmts:
        for sub in ast.walk(stmt):
            if (
                isinstance(sub, ast.Name)
                and isinstance(sub.ctx, ast.Load)
                and sub.id in local
                and sub.id not in bound
                and sub.id not in own
            ):
                return True
    return False


def _maybe_unbound(run: list, start: frozenset) -> set:
    """The names only some branches of an if in ``run`` bind (RUN_BRANCHES), unbound
    before it (``start``: the names bound where it starts) and not bound for sure after:
    the region must not return them."""
    have = set(start)
    maybe: set = set()
    for stmt in run:
        if isinstance(stmt, ast.If):
            sure = _sure_assigned([stmt])
            maybe |= _loop_assigned(stmt) - sure - have
            have |= sure
        elif not isinstance(stmt, ast.For):
            have |= _assigned_names(stmt)
    return maybe - have


def _target_names(target) -> frozenset | None:
    """The names a loop's target binds, if it is a name or a flat tuple of distinct names."""
    if isinstance(target, ast.Name):
        return frozenset([target.id])
    if isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts):
        names = [e.id for e in target.elts if isinstance(e, ast.Name)]
        if names and len(set(names)) == len(names):
            return frozenset(names)
    return None


def _loads_outside_loops_over(root, name: str) -> int:
    """Reads of ``name`` in ``root`` outside the bodies of ``for name in ...`` loops and
    the comprehensions that bind it (a loop variable read only inside the loops that
    bind it has no observable last value; a read elsewhere may see one)."""
    count = 0
    stack = [root]
    while stack:
        node = stack.pop()
        if (
            isinstance(node, (ast.For, ast.AsyncFor))
            and isinstance(node.target, ast.Name)
            and node.target.id == name
        ):
            stack.extend([node.iter, *node.orelse])
            continue
        if isinstance(node, _COMPREHENSIONS) and name in _comprehension_names(node):
            stack.append(node.generators[0].iter)  # the rest reads the comprehension's
            continue
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load):
            count += 1
        stack.extend(ast.iter_child_nodes(node))
    return count


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)
# what an if's test in a loop body may not hold (_Rewriter._static_test)
_TEST_FORBIDDEN = (ast.Lambda, ast.Yield, ast.YieldFrom, ast.Await, ast.NamedExpr, *_COMPREHENSIONS)


_FRAME_READERS = frozenset({"locals", "vars", "eval", "exec", "dir"})


def _span(stmts: list) -> tuple:
    """((line, column) of the first statement's start, of the last one's end)."""
    a, b = stmts[0], stmts[-1]
    return (a.lineno, a.col_offset), (b.end_lineno or b.lineno, b.end_col_offset or 0)


def _reads_frame(node) -> bool:
    """Whether a function's code may read its locals by name (``locals()``, ``eval``...)."""
    return any(
        isinstance(sub, ast.Call)
        and isinstance(sub.func, ast.Name)
        and sub.func.id in _FRAME_READERS
        for sub in ast.walk(node)
    )


def _load_counts(stmts: list) -> dict[str, int]:
    """How often each name is read in ``stmts``."""
    counts: dict[str, int] = {}
    for stmt in stmts:
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                counts[sub.id] = counts.get(sub.id, 0) + 1
    return counts


_DISPLAYS = (ast.List, ast.ListComp, ast.Tuple, ast.Dict, ast.DictComp, ast.Set, ast.SetComp)


#: ``return <operators>`` over what the run before it computed (``return u @ v``, ``return
#: h * scale + bias``) joins that run as an assignment of operators does (read when
#: outlining); alone, operators are as likely index arithmetic and a return of them stays.
RUN_OPERATORS = True


def _is_operator(node) -> bool:
    """Whether ``node`` is an arithmetic operator (``a @ b``, ``-h``; not ``not x``, not
    the number ``-1``)."""
    return isinstance(node, ast.BinOp) or (
        isinstance(node, ast.UnaryOp)
        and not isinstance(node.op, ast.Not)
        and not isinstance(node.operand, ast.Constant)  # (-1: a number)
    )


def _operates_on(expr, run: list) -> bool:
    """Whether ``expr`` is an operator expression (``a @ b``, ``-h``, ``h * s + b``) that
    reads a name the statements of ``run`` bind."""
    if not _is_operator(expr):
        return False
    names = _run_assigned(run)
    return any(isinstance(sub, ast.Name) and sub.id in names for sub in ast.walk(expr))


#: A statement of a run may read a container the run itself made before it, ``hs =
#: [m.a(x), m.b(x)]; h = torch.cat(hs)``: the trace builds that list from its own lazy
#: tensors, no container comes in from outside (read when outlining).
RUN_DISPLAYS = True
_DISPLAY_VALUES = (ast.List, ast.Tuple, ast.Dict, ast.Set)


def _run_displays(run: list) -> set[str]:
    """The names the statements of ``run`` bind to a list, tuple, dict or set display
    (RUN_DISPLAYS; not comprehensions: those are mapped or LOOP_RUNS' own)."""
    if not RUN_DISPLAYS:
        return set()
    return {
        t.id
        for stmt in run
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, _DISPLAY_VALUES)
        for t in stmt.targets
        if isinstance(t, ast.Name)
    }


def _container_names(fn: ast.FunctionDef) -> set[str]:
    """Local names every binding of which (in ``fn``'s own code) assigns a list, tuple,
    dict or set display or comprehension: ``kids = [encode(c) for c in tree]``. A run of
    assignments given such a value runs op by op (RegionBlock: its structure would key
    the trace), so statements reading one are left out of runs and the rest can still
    be one."""
    found: dict[str, bool] = {}
    params = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    for p in [*params, fn.args.vararg, fn.args.kwarg]:
        if p is not None:
            found[p.arg] = False  # (a parameter may be anything)
    stack: list[ast.AST] = list(fn.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, _COMPREHENSIONS):
            continue  # another scope: its loop names are its own
        display = None
        if isinstance(node, ast.Assign):
            display = isinstance(node.value, _DISPLAYS)
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            display = isinstance(node, ast.AnnAssign) and isinstance(node.value, _DISPLAYS)
            targets = [node.target]
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.NamedExpr)):
            targets = [getattr(node, "target", None)] + [
                i.optional_vars for i in getattr(node, "items", ())
            ]
            display = False
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                found[(alias.asname or alias.name).split(".")[0]] = False
        elif isinstance(node, ast.ExceptHandler) and node.name:
            found[node.name] = False
        if display is not None:
            for target in targets:
                if isinstance(target, ast.Name):
                    found[target.id] = found.get(target.id, True) and display
                elif target is not None:  # unpacked: what each name gets is unknown
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Name):
                            found[sub.id] = False
        stack.extend(ast.iter_child_nodes(node))
    return {name for name, only in found.items() if only}


def _loads(fn, expr) -> set[str]:
    """The names ``expr`` reads (comprehension variables included), but inside
    ``torch.tensor(...)``: a run's call evaluates those (_FactoryHoister), so a list made
    a tensor there (a parser's ``torch.tensor(mask)``) is not given to the run; nor is
    the container of an item ``xs[i]`` (_SubscriptHoister)."""
    names: set[str] = set()
    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Call) and _torch_factory(fn, node):
            continue
        if REGION_SUBSCRIPTS and _name_item(node):
            # (``kept[k]``: read at the call, _SubscriptHoister; the run gets the item)
            if isinstance(node.slice, ast.Name):
                names.add(node.slice.id)
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            names.add(node.id)
        stack.extend(ast.iter_child_nodes(node))
    return names


def _comprehension_names(value) -> set:
    return {t.id for t in _comprehension_targets(value)}


def _comprehension_targets(value) -> list:
    """The names (``ast.Name`` nodes) the comprehensions in ``value`` bind."""
    return [
        t
        for sub in ast.walk(value)
        if isinstance(sub, ast.comprehension)
        for t in ast.walk(sub.target)
        if isinstance(t, ast.Name)
    ]


def _torch_factory(fn, call) -> bool:
    """``call`` is ``torch.tensor(...)`` or ``torch.as_tensor(...)``, ``torch`` being the
    module in ``fn``'s globals."""
    f = call.func
    return (
        isinstance(f, ast.Attribute)
        and f.attr in _FACTORIES
        and isinstance(f.value, ast.Name)
        and getattr(fn.__globals__.get(f.value.id), "__name__", "") == "torch"
    )


class _ValueUnwrapper(ast.NodeTransformer):
    """``torch.tensor(name)`` (``torch`` the module, no other argument) becomes ``name``;
    ``count`` says how many were, and how many times ``name`` indexes something else
    (INDEX_VALUES: ``W[name]``, ``W[:, name]``, :func:`_index_use`), which a 0-d int64
    tensor in its place does alike (left as written)."""

    def __init__(self, fn, name: str):
        self.fn = fn
        self.name = name
        self.count = 0

    def visit_Call(self, node):
        if (
            _torch_factory(self.fn, node)
            and len(node.args) == 1
            and not node.keywords
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == self.name
        ):
            self.count += 1
            return ast.copy_location(ast.Name(self.name, ast.Load()), node)
        return self.generic_visit(node)

    def visit_Subscript(self, node):
        if INDEX_VALUES and _index_use(node, self.name):
            self.count += 1
            node.value = self.visit(node.value)
            return node
        return self.generic_visit(node)


def _index_use(node: ast.Subscript, name: str) -> bool:
    """Whether ``node`` is a load ``E[name]`` or ``E[<slices>, name, <slices>]`` with
    ``name`` read nowhere else in it (not in ``E``, not in a slice's bounds): an index
    that a 0-d int64 tensor gives the same rows as the Python int (a copy, not a view)."""
    if not isinstance(node.ctx, ast.Load) or name in _names(node.value):
        return False
    parts = _name_and_slices(node.slice)
    return (
        parts is not None and parts[0].id == name and not any(name in _names(e) for e in parts[1])
    )


class _RowReplacer(ast.NodeTransformer):
    """Each ``x[t + c]`` (``t`` the counter, ``(x, c)`` one of ``names``) replaced by the
    name of those rows (``_Rewriter._index_loop`` checked that the counter is read only
    so)."""

    def __init__(self, counter: str, names: dict):
        self.counter = counter
        self.names = names

    def visit_Subscript(self, node):
        if isinstance(node.value, ast.Name):
            c = _counter_offset(node.slice, self.counter)
            name = self.names.get((node.value.id, c)) if c is not None else None
            if name is not None:
                return ast.copy_location(ast.Name(name, ast.Load()), node)
        return self.generic_visit(node)


def _counter_offset(index, counter: str) -> int | None:
    """``c`` where ``index`` is ``counter``, ``counter + c``, ``c + counter`` or ``counter -
    c`` (``c`` an int constant), else None."""
    if isinstance(index, ast.Name):
        return 0 if index.id == counter else None
    if not isinstance(index, ast.BinOp) or not isinstance(index.op, (ast.Add, ast.Sub)):
        return None
    left, right = index.left, index.right
    if isinstance(index.op, ast.Add) and isinstance(left, ast.Constant):
        left, right = right, left
    if not (
        isinstance(left, ast.Name)
        and left.id == counter
        and isinstance(right, ast.Constant)
        and type(right.value) is int
    ):
        return None
    return right.value if isinstance(index.op, ast.Add) else -right.value


def _read_names(it) -> set:
    """The names a loop's iterable reads, leaving out the lists an index loop gives
    ``index_rows`` only to compare identities with (``_Rewriter._index_loop``)."""
    zipped = isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "zip"
    names: set = set()
    for part in it.args if zipped else [it]:
        if (
            isinstance(part, ast.Call)
            and isinstance(part.func, ast.Constant)
            and part.func.value == _ROWS_PLACEHOLDER
        ):
            names |= _names(part.args[0]) | _names(part.args[1])
        else:
            names |= _names(part)
    return names


def _plain_read(expr) -> bool:
    """Whether evaluating ``expr`` twice is the same as once: names, constants, their
    attributes, items and arithmetic, ``len(...)`` and ``.size(...)`` of those."""
    if isinstance(expr, (ast.Name, ast.Constant)):
        return True
    if isinstance(expr, ast.Attribute):
        return _plain_read(expr.value)
    if isinstance(expr, ast.Subscript):
        return _plain_read(expr.value) and _plain_read(expr.slice)
    if isinstance(expr, ast.UnaryOp):
        return _plain_read(expr.operand)
    if isinstance(expr, ast.BinOp):
        return _plain_read(expr.left) and _plain_read(expr.right)
    if isinstance(expr, ast.Call) and not expr.keywords and all(map(_plain_read, expr.args)):
        f = expr.func
        return (isinstance(f, ast.Name) and f.id == "len") or (
            isinstance(f, ast.Attribute) and f.attr == "size" and _plain_read(f.value)
        )
    return False


def index_rows(seq: Any, indices, grown: tuple = (), offset: int = 0):
    """``[seq[i + offset] for i in indices]``: the rows a loop ``for t in indices``
    reading ``seq[t + offset]`` reads, in its order (``analysis._index_loop``). A
    tensor's are views from one unbind (a lazy one records one node); a position out of
    range raises eager's IndexError (before the loop, not at its step). Where ``seq`` is
    one of the lists the loop appends to (``grown``: another name for it), each is read
    at its step, as the loop as written reads it (an iterator: the scan declines it)."""
    if offset:
        indices = [i + offset for i in indices]
    if any(g is seq for g in grown):
        return (seq[i] for i in indices)
    tensor = type(seq) is graph.LazyTensor or isinstance(seq, torch.Tensor)
    if tensor and seq.ndim:
        positions = list(indices)
        n = seq.shape[0]
        for i in positions:
            if type(i) is not int:
                return [seq[i] for i in positions]
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for dimension 0 with size {n}")
        rows = seq.unbind(0)
        return [rows[i] for i in positions]
    return [seq[i] for i in indices]


#: UNROLL_LOOPS also writes out a loop whose body is operators alone on names the function
#: binds by tensor work (``for w in (0.5, 0.25): h = h * w + x`` after ``h = m.a(x)``): the
#: copies join the run around them as assignments of operators do.
UNROLL_OPERATORS = True


def _operator_count(expr) -> int:
    """The arithmetic operators in ``expr`` (:func:`_is_operator`)."""
    return sum(map(_is_operator, ast.walk(expr)))


#: UNROLL_LOOPS also writes out a loop over a tuple or list display of constants (``for w
#: in (0.5, 0.25):``, ``for k in [1, 2, 4]:``) as it does one over ``range`` of literals.
UNROLL_LITERALS = True
_LITERAL_TYPES = (int, float, bool, str, complex, type(None))


def _literal_trips(expr) -> list | None:
    """The values of a tuple or list display of constants (numbers, strings, booleans,
    None; ``-1`` included), in order, or None (UNROLL_LITERALS)."""
    if not UNROLL_LITERALS or not isinstance(expr, (ast.Tuple, ast.List)):
        return None
    try:
        values = ast.literal_eval(expr)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if not all(type(v) in _LITERAL_TYPES for v in values):
        return None
    return list(values)


def _int_literal(expr) -> int | None:
    """The value of an int literal (``3``, ``-2``), else None."""
    sign = 1
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):
        sign, expr = -1, expr.operand
    if isinstance(expr, ast.Constant) and type(expr.value) is int:
        return sign * expr.value
    return None


class _Constants(ast.NodeTransformer):
    """Reads of the given names replaced by their constants (an unrolled loop's counter)."""

    def __init__(self, values: dict):
        self.values = values

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and node.id in self.values:
            return ast.copy_location(ast.Constant(self.values[node.id]), node)
        return node


class _Renamer(ast.NodeTransformer):
    """Names renamed by a mapping (a comprehension's variables made a loop's)."""

    def __init__(self, names: dict):
        self.names = names

    def visit_Name(self, node):
        if node.id in self.names:
            return ast.copy_location(ast.Name(self.names[node.id], node.ctx), node)
        return node


class _AttributeHoister(ast.NodeTransformer):
    """``name.attr...`` (a load, not a called method) of a name in ``roots`` becomes a
    parameter, its expression evaluated at the call (ScanBlock: once per loop)."""

    def __init__(self, roots: set, hoisted: list):
        self.roots = roots
        self.hoisted = hoisted

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute):  # keep the method access; hoist its receiver
            func.value = self.visit(func.value)
        else:
            node.func = self.visit(func)
        node.args = [self.visit(a) for a in node.args]
        node.keywords = [self.visit(k) for k in node.keywords]
        return node

    def visit_Attribute(self, node):
        root = node
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(node.ctx, ast.Load) and isinstance(root, ast.Name) and root.id in self.roots:
            return _parameter_for(node, self.hoisted)
        return self.generic_visit(node)


def _parameter_for(node, hoisted: list) -> ast.Name:
    """A load of the parameter that passes ``node``'s value, evaluated at the call (one
    per distinct expression; appended to ``hoisted`` as (parameter, expression))."""
    dump = ast.dump(node)
    name = next((p for p, expr in hoisted if ast.dump(expr) == dump), None)
    if name is None:
        name = f"_acrobat_arg{len(hoisted)}"
        hoisted.append((name, node))
    return ast.copy_location(ast.Name(name, ast.Load()), node)


_TENSOR_ATTRIBUTES = frozenset(dir(torch.Tensor))


def _object_roots(run: list, local: set) -> set:
    """Locals of ``run`` read only as ``name.attr`` (never called through, ``name.f(...)``,
    and never an attribute a tensor has, ``x.shape``): likely the user's own objects (a
    tree node's ``node.x``), whose attributes a region reads at its call instead
    (REGION_ATTRIBUTES); given the object itself, the region would run as written."""
    roots: set = set()
    other: set = set()
    for value in _run_values(run):
        attributes = set()
        for sub in ast.walk(value):
            if isinstance(sub, ast.Attribute):
                attributes.add(id(sub.value))
                root = sub.value
                if isinstance(root, ast.Name) and root.id in local:
                    if isinstance(sub.ctx, ast.Load) and sub.attr not in _TENSOR_ATTRIBUTES:
                        roots.add(root.id)
                    else:
                        other.add(root.id)
            elif isinstance(sub, ast.Call):
                func = sub.func
                if (
                    isinstance(func, ast.Attribute)
                    and isinstance(func.value, ast.Attribute)
                    and isinstance(func.value.value, ast.Name)
                    and func.value.attr not in _TENSOR_ATTRIBUTES
                    and func.attr in _TENSOR_ATTRIBUTES
                ):
                    continue  # ``node.x.unsqueeze(0)``: a tensor method of the attribute
                while isinstance(func, ast.Attribute):
                    func = func.value
                if isinstance(func, ast.Name):
                    other.add(func.id)  # a call through it: a module, a method
        for sub in ast.walk(value):  # read bare: passed on as it is
            if isinstance(sub, ast.Name) and id(sub) not in attributes:
                other.add(sub.id)
    return roots - other


def _branch_values(ifs: list) -> list:
    """The assignments of the branches of ``ifs`` and of the ifs inside them (their
    tests left out), as a run for :func:`_object_roots`."""
    out: list = []
    for stmt in ifs:
        for sub in stmt.body + stmt.orelse:
            out.extend(_branch_values([sub]) if isinstance(sub, ast.If) else [sub])
    return out


def _run_values(run: list) -> Iterator:
    """The expressions of a run's statements: the assignments' values, and of a loop
    (LOOP_RUNS) its iterable and its body's."""
    for stmt in run:
        if isinstance(stmt, ast.For):
            yield stmt.iter
            yield from _run_values(stmt.body)
        elif isinstance(stmt, ast.If):
            yield stmt.test
            yield from _run_values(stmt.body + stmt.orelse)
        else:
            yield stmt.value


def _module_roots(fn, expr, local: set) -> set:
    """Globals of ``fn`` bound to a module (not torch's or math) that ``expr`` reads only
    as ``module.NAME`` of an immutable constant (an int, a float, a string...): never
    called through, read bare or deeper (MODULE_ATTRIBUTES)."""
    roots: set = set()
    other: set = set()
    attributes = set()
    for sub in ast.walk(expr):
        if isinstance(sub, ast.Call):
            func = sub.func
            while isinstance(func, ast.Attribute):
                func = func.value
            if isinstance(func, ast.Name):
                other.add(func.id)  # a call through it
        elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
            attributes.add(id(sub.value))
            name = sub.value.id
            module = fn.__globals__.get(name) if name not in local else None
            if (
                isinstance(module, types.ModuleType)
                and module.__name__.split(".")[0] not in ("torch", "math")
                and isinstance(sub.ctx, ast.Load)
                and _immutable_constant(getattr(module, sub.attr, _MISSING))
            ):
                roots.add(name)
            else:
                other.add(name)
    for sub in ast.walk(expr):
        if isinstance(sub, ast.Name) and id(sub) not in attributes:
            other.add(sub.id)
    return roots - other


_MISSING = object()


def _name_item(node) -> bool:
    """Whether ``node`` is a load ``a[i]`` of two names, or ``a["h"]`` / ``a[0]`` /
    ``a[-1]`` (a name and a constant key: a dict or list state's item, a list's last)."""
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.ctx, ast.Load)
        and isinstance(node.value, ast.Name)
        and (isinstance(node.slice, ast.Name) or _constant_key(node.slice))
    )


def _constant_key(index) -> bool:
    """A str or int constant, a negative int included (``-1`` parses as a minus sign
    applied to ``1``)."""
    if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub):
        index = index.operand
        return isinstance(index, ast.Constant) and type(index.value) is int
    return isinstance(index, ast.Constant) and type(index.value) in (str, int)


class _SubscriptHoister(ast.NodeTransformer):
    """``a[i]`` (a load) of two locals in ``names`` becomes a parameter, evaluated at the
    call (REGION_SUBSCRIPTS): with ``i`` a Python int that differs from instance to
    instance (a decoder's ``logp[tok]``), the int would key the region's trace (a batch
    per value), where the pick at the call batches across the ints (ops.PICK); with ``a``
    a list or dict of tensors, the region would be given the container."""

    def __init__(self, names: set, hoisted: list):
        self.names = names
        self.hoisted = hoisted

    def visit_Subscript(self, node):
        if (
            _name_item(node)
            and node.value.id in self.names
            and (not isinstance(node.slice, ast.Name) or node.slice.id in self.names)
        ):
            return _parameter_for(node, self.hoisted)
        if _weight_item(node, self.names):
            return _parameter_for(node, self.hoisted)
        return self.generic_visit(node)

    def _scope(self, node):  # (a comprehension's names are its own)
        return node

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _scope
    visit_Lambda = _scope


def _weight_item(node, names: set) -> bool:
    """Whether ``node`` is a load ``obj.w[i]`` or ``obj.w[:, i]`` (an attribute chain
    rooted at a name of ``names``, indexed by a name of ``names`` and slices whose bounds
    read only those and constants): read at the call, a Python int ``i`` makes a row
    lookup there (ops.TAKE, batched across the ints) instead of keying the trace."""
    if not isinstance(node, ast.Subscript) or not isinstance(node.ctx, ast.Load):
        return False
    root = node.value
    if not isinstance(root, ast.Attribute):
        return False
    while isinstance(root, ast.Attribute):
        root = root.value
    if not isinstance(root, ast.Name) or root.id not in names:
        return False
    parts = _name_and_slices(node.slice)
    if parts is None or parts[0].id not in names:
        return False
    return all(
        isinstance(sub, (ast.Slice, ast.Name, ast.Constant, ast.Load))
        and (not isinstance(sub, ast.Name) or sub.id in names)
        for e in parts[1]
        for sub in ast.walk(e)
    )


def _name_and_slices(index) -> tuple[ast.Name, list] | None:
    """(the name, the slices) of an index that is one name, or a tuple of one name and
    slices (``W[i]``, ``W[:, i]``, ``W[1:, i, :2]``); None for any other index."""
    entries = index.elts if isinstance(index, ast.Tuple) else [index]
    items = [e for e in entries if isinstance(e, ast.Name)]
    slices = [e for e in entries if isinstance(e, ast.Slice)]
    if len(items) != 1 or len(items) + len(slices) != len(entries):
        return None
    return items[0], slices


_FACTORIES = {"tensor", "as_tensor"}
_SIMPLE = (ast.Name, ast.Attribute, ast.Constant, ast.Subscript, ast.Load, ast.Slice,
           ast.Tuple, ast.List, ast.UnaryOp, ast.USub, ast.keyword)  # fmt: skip


def _plain_tensor_call(expr) -> bool:
    """``torch.tensor(x)``: one positional argument, no keywords (not ``as_tensor``, which
    keeps a tensor it is given)."""
    return (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr == "tensor"
        and len(expr.args) == 1
        and not expr.keywords
        and not isinstance(expr.args[0], ast.Starred)
    )


class _FactoryHoister(ast.NodeTransformer):
    """``torch.tensor(tree.word_id)`` inside a run becomes a parameter evaluated at the call:
    per instance, a Python value made a tensor is a lazy input (a deferred constant) rather
    than part of the block's signature, and the object it is read from (a tree node) stays
    out of the block's arguments. Only arguments of plain loads (no calls) that the run
    does not assign are moved, so moving them changes no evaluation that matters."""

    def __init__(self, fn, assigned: set, hoisted: list):
        self.fn = fn
        self.assigned = assigned
        self.hoisted = hoisted

    def visit_Call(self, node):
        f = node.func
        if (
            _torch_factory(self.fn, node)
            and all(
                isinstance(sub, _SIMPLE)
                for sub in ast.walk(node)
                if sub is not node and sub is not f and sub is not f.value
            )
            and not any(
                isinstance(sub, ast.Name) and sub.id in self.assigned for sub in ast.walk(node)
            )
        ):
            name = f"_acrobat_arg{len(self.hoisted)}"
            self.hoisted.append((name, node))
            return ast.copy_location(ast.Name(name, ast.Load()), node)
        return self.generic_visit(node)
