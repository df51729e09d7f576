"""Per-instance tensors held in attributes of the user's own objects.

``f.map`` wraps the tensors it finds in an instance's arguments as lazy inputs, through
tuples, lists, dicts and namedtuples (``fibers._wrap_inputs``). A tree of the user's
``Node`` objects with a tensor in ``node.x`` is none of those: read as it is, the
tensor is a real one, every op on it runs eagerly, instance by instance, and the map
batches nothing.

While a map runs, each attribute that holds a tensor in the user objects reachable from
the instances' arguments (found by a bounded walk, :func:`tensor_attributes`) gets a
descriptor on its class that hands instance code a lazy input for the tensor (one per
instance and tensor: reading ``node.x`` twice gives the same one), as if it had come in a
list. Other attributes keep Python's own lookup. Left as they are: ``nn.Parameter``\\ s and
tensors that require grad (model state, not instance data), a tensor once a second
instance reads it (shared: the first keeps its input, which is as correct), and reads
outside instance code (acrobat's own, or torch's inside an op). The classes are restored
when the map returns or raises. Classes that cannot take an attribute (defined in C),
``__slots__`` classes and objects past the walk's bounds keep the old behaviour, which
the map's warning (``api.Autobatched.map``, from the same walk) names when nothing was
batched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from threading import get_ident

import torch

from acrobat import config, graph
from acrobat.ops import INPUT

_LEAVES = (str, bytes, int, float, bool, complex, type(None))
_PLAIN = frozenset((*_LEAVES, torch.Tensor))  # element types of lists with no object inside
_MAX_OBJECTS = 256  # objects walked per map, at most: the classes show up early


def tensor_attributes(arg_tuples: list[tuple]) -> set[tuple[type, str]]:
    """The pairs of :func:`attributes_with_tensors` that can take a descriptor."""
    found = attributes_with_tensors(arg_tuples)
    return {(cls, name) for cls, name in found if _patchable(cls, name)}


def attributes_with_tensors(arg_tuples: list[tuple]) -> set[tuple[type, str]]:
    """(class, attribute) of the user objects among the instances' arguments whose
    attribute holds a tensor that is not a parameter (nor requires grad), as far as a walk
    of at most _MAX_OBJECTS objects sees. Where instance 0's arguments hold no object
    with attributes at all (tensors, numbers and containers of them: every benchmark
    model), the others are not walked (a b64 batch of trees of tuples: 61 -> ~1 µs)."""
    found: set[tuple[type, str]] = set()
    seen: set[int] = set()
    budget = _MAX_OBJECTS
    objects = 0  # objects with attributes met
    for k, args in enumerate(arg_tuples):
        if k == 1 and not objects:
            break
        budget, objects = _walk([args], found, seen, budget, objects)
        if budget <= 0:
            break
    return found


def _walk(stack: list, found: set, seen: set, budget: int, objects: int) -> tuple[int, int]:
    """Walk the values on ``stack`` (containers, and the attributes of objects), adding to
    ``found`` the (class, attribute) pairs holding instance tensors; returns the budget
    left and the count of objects with attributes met so far."""
    while stack and budget > 0:
        a = stack.pop()
        t = type(a)
        if t is tuple or t is list:  # (the common case first: sentences, trees of tuples)
            if not _PLAIN.issuperset(map(type, a)):  # a list of word ids: nothing inside
                stack.extend(reversed(a))
            budget -= 1
            continue
        if t in _LEAVES or isinstance(a, (torch.Tensor, torch.nn.Module, type)) or callable(a):
            continue
        if id(a) in seen:
            continue
        seen.add(id(a))
        budget -= 1
        if isinstance(a, (list, tuple)):
            stack.extend(reversed(a))
        elif isinstance(a, dict):
            stack.extend(a.values())
        else:
            fields = getattr(a, "__dict__", None)
            if type(fields) is not dict:
                continue
            objects += 1
            for name, v in fields.items():
                if isinstance(v, torch.Tensor):
                    if type(v) is not torch.nn.Parameter and not v.requires_grad:
                        found.add((t, name))
                else:
                    stack.append(v)
    return budget, objects


def _patchable(cls, name: str) -> bool:
    """Whether a descriptor for ``name`` can go on ``cls`` without changing what else
    reads it: a Python class whose instances keep ``name`` in their ``__dict__`` (no data
    descriptor of that name in its MRO) and which takes new attributes."""
    if cls.__module__ == "builtins" or "__dict__" not in dir(cls):
        return False
    for base in cls.__mro__:
        found = base.__dict__.get(name)
        if found is not None and hasattr(type(found), "__set__"):
            return False  # a property or slot: the instance's __dict__ is not what is read
    try:
        cls.__acrobat_probe__ = None
        del cls.__acrobat_probe__
    except (TypeError, AttributeError):
        return False
    return True


class InstanceAttribute:
    """The descriptor of one attribute of a user class while a map runs: the instance's
    own value, a tensor in it read as the reading instance's lazy input."""

    __slots__ = ("name", "default")

    def __init__(self, name: str, default):
        self.name = name
        self.default = default  # (the class's own attribute of that name, if any)

    def __get__(self, obj, owner=None):
        if obj is None:
            if self.default is _NONE:
                raise AttributeError(self.name)
            return self.default
        try:
            value = obj.__dict__[self.name]
        except KeyError:
            if self.default is _NONE:
                raise AttributeError(
                    f"{type(obj).__name__!r} object has no attribute {self.name!r}"
                ) from None
            value = self.default
            if hasattr(type(value), "__get__"):
                return value.__get__(obj, owner)
        if type(value) is torch.Tensor:
            return _lazy_input(value)
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.name] = value

    def __delete__(self, obj) -> None:
        try:
            del obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None


_NONE = object()


def _lazy_input(value: torch.Tensor):
    rt = graph.RT
    if rt is None or rt.fiber is None or rt.tracer is not None or value.requires_grad:
        return value
    if rt.thread != get_ident():
        return value  # another thread reading the object while the map runs
    if not torch._C._is_torch_function_enabled():
        return value  # (acrobat's or torch's own evaluation)
    instance = rt.fiber.instance
    hit = rt.object_inputs.get((instance, id(value)))
    if hit is not None:
        return hit[1]
    owner = rt.object_owner.setdefault(id(value), instance)
    if owner != instance:
        return value  # another instance's tensor too: shared, a real tensor from now on
    with torch._C.DisableTorchFunction():  # (attribute reads would dispatch to the mode)
        shape, dtype, device = value.shape, value.dtype, value.device
    lazy = graph.record_data(INPUT, (INPUT, shape, dtype, device), value, shape, dtype)
    rt.object_inputs[(instance, id(value))] = (value, lazy)  # (holds the tensor: its id)
    return lazy


@contextlib.contextmanager
def instance_attributes(rt, arg_tuples: list[tuple]) -> Iterator[None]:
    """For the duration of a map: tensors in the attributes of the instances' objects read
    as lazy inputs in instance code (config.OBJECT_INPUTS)."""
    rt.object_inputs = {}
    rt.object_owner = {}
    if not config.OBJECT_INPUTS:
        yield
        return
    try:
        attributes = tensor_attributes(arg_tuples)
    except Exception:  # an optimisation: a strange object graph leaves the map as it was
        if config.VERIFY:
            raise
        attributes = set()
    patched = []
    try:
        for cls, name in attributes:
            own = cls.__dict__.get(name, _NONE)
            default = own if own is not _NONE else _class_default(cls, name)
            setattr(cls, name, InstanceAttribute(name, default))
            patched.append((cls, name, own))
        yield
    finally:
        for cls, name, own in reversed(patched):
            if own is _NONE:
                delattr(cls, name)
            else:
                setattr(cls, name, own)
        rt.object_inputs = {}
        rt.object_owner = {}


def _class_default(cls, name: str):
    for base in cls.__mro__[1:]:
        if name in base.__dict__:
            return base.__dict__[name]
    return _NONE
