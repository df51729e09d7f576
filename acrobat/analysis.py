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
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import inspect
import textwrap
import threading
import types
import warnings
from collections.abc import Iterator

from acrobat import config, graph
from acrobat.errors import LazyValueError

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
    "isinstance",
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
    "rand_like",
    "randn_like",
    "randint_like",
    "random",
    "uniform",
    "choice",
    "shuffle",
    "sample",
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

_VERDICTS: dict[types.CodeType, bool] = {}


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
    verdict = _VERDICTS.get(code)
    if verdict is None:
        seen = _seen if _seen is not None else set()
        if code in seen:
            return False  # recursion is control flow
        seen.add(code)
        verdict = _check(fn, seen)
        _VERDICTS[code] = verdict
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
    return True


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
    return _immutable_constant(value)


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
    """Objects a function's code can name: globals (incl. nested code), closure cells."""
    codes = [fn.__code__]
    while codes:
        code = codes.pop()
        for name in code.co_names:
            if name in fn.__globals__:
                yield fn.__globals__[name]
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    for cell in fn.__closure__ or ():
        with contextlib.suppress(ValueError):
            yield cell.cell_contents


def discover(root) -> list[types.FunctionType]:
    """The straight-line functions reachable from ``root``, in a deterministic order."""
    from acrobat.api import Autobatched
    from acrobat.block import Block

    found: dict[int, types.FunctionType] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Autobatched):
            stack.append(obj.fn)
            continue
        if isinstance(obj, (Block, types.ModuleType)) or not _user_object(obj):
            continue
        if isinstance(obj, types.FunctionType):
            if obj is not root and straight_line(obj):
                found[id(obj)] = obj
            else:
                stack.extend(_referenced(obj))
        elif isinstance(obj, (tuple, list)):
            stack.extend(v for v in obj if callable(v))
        elif isinstance(obj, dict):
            stack.extend(v for v in obj.values() if callable(v))
    return list(found.values())


def _user_object(obj) -> bool:
    module = getattr(obj, "__module__", None)
    if module is None:
        return isinstance(obj, (tuple, list, dict))
    top = module.split(".")[0]
    return top not in ("torch", "acrobat", "builtins", "numpy", "greenlet", "typing")


# ---- trampolines -------------------------------------------------------------------------

_PLACEHOLDER = 0.123456789e-300  # a constant replaced by the dispatcher in the code object


class AutoBlock:
    """Dispatcher behind a trampolined function: the block inside f.map, else the code."""

    def __init__(self, fn: types.FunctionType):
        from acrobat.block import Block

        self.impl = types.FunctionType(
            fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
        )
        self.impl.__kwdefaults__ = fn.__kwdefaults__
        self.impl.__qualname__ = fn.__qualname__
        self.block = Block(self.impl)
        self.disabled = False
        self.trampoline: types.CodeType | None = None

    def __call__(self, *args, **kwargs):
        rt = graph.RT
        if (
            self.disabled
            or rt is None
            or rt.fiber is None
            or rt.tracer is not None
            or rt.thread != threading.get_ident()  # another thread calling the function
        ):
            return self.impl(*args, **kwargs)
        try:
            return self.block(*args, **kwargs)
        except LazyValueError:
            if rt.tracer is not None:  # pragma: no cover - the tracer resets itself
                raise
            # reads a value, or computes nothing per-instance: per-op recording from now on
            self.disabled = True
            return self.impl(*args, **kwargs)


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


_DISPATCHERS: dict[types.CodeType, AutoBlock] = {}


@contextlib.contextmanager
def auto_blocks(root) -> Iterator[list]:
    """Route the straight-line functions reachable from ``root`` to blocks while inside."""
    if not config.AUTO_BLOCKS:
        yield []
        return
    swapped = []
    try:
        try:
            candidates = discover(root)
        except Exception:  # analysis is an optimisation: never let it break a map
            candidates = []
        for fn in candidates:
            original = fn.__code__
            dispatcher = _DISPATCHERS.get(original)
            if dispatcher is None:
                dispatcher = _DISPATCHERS[original] = AutoBlock(fn)
                dispatcher.trampoline = _trampoline_code(fn, dispatcher)
            if fn.__defaults__ != dispatcher.impl.__defaults__:
                dispatcher.impl.__defaults__ = fn.__defaults__
            assert dispatcher.trampoline is not None
            fn.__code__ = dispatcher.trampoline
            swapped.append((fn, original))
        yield [fn for fn, _ in swapped]
    finally:
        for fn, original in swapped:
            fn.__code__ = original
