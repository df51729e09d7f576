"""``LazyTensor``: a handle on one output of one recorded DFG node.

Shape, dtype and device are known when the node is recorded, so user code can ask for
them freely; asking for a *value* (``bool``, ``int``, ``float``, ``.item()``,
``.tolist()``) is a demand that suspends the instance's fiber until the batched graph
has been executed (see ``fibers.py``).

A LazyTensor is not a ``torch.Tensor``: it is a tensor-like that implements
``__torch_function__``. While ``f.map`` runs, a ``TorchFunctionMode`` routes every torch
call to the op table (``ops.py``); methods and operators are installed on this class
from the same table, so ``x @ W``, ``x.chunk(4)`` and ``torch.tanh(x)`` all land in
``graph.record``.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from array import array
from typing import TYPE_CHECKING, Any

import torch

from acrobat import config
from acrobat.errors import LazyValueError, UnsupportedOpError, _is_internal, user_line
from acrobat_kernels import cuda_launch

_native: Any
try:
    from acrobat import _native  # type: ignore[attr-defined, no-redef]
except ImportError:  # not built (no C compiler at install): the Python classes below
    _native = None
if not config.NATIVE:
    _native = None

_TYPE_KEYS: dict[tuple, int] = {}
_LONG = torch.int64


def _demand_py(t):
    from acrobat import fibers

    return fibers.demand_py(t)


# ``t.tolist()`` / ``t.item()``'s value read: fibers.demand_py, bound by acrobat.fibers
# at import (a call per tree node or parser step: no import statement on the way)
DEMAND_PY = _demand_py


def index_tensor(values: list, device: torch.device) -> torch.Tensor:
    """An int64 index tensor of a list of ints: through an ``array`` buffer, 5x cheaper
    than ``torch.tensor(list)`` (1.3 vs 6 us for 50 ints), which the executor pays per
    gather."""
    if not values:
        return torch.empty(0, dtype=_LONG, device=device)
    if device.type == "cuda" and config.INDEX_RING and not torch.is_grad_enabled():
        # (under autograd index_select keeps its index for the backward: a tensor of its own)
        return index_array(array("q", values), device)
    t = torch.frombuffer(array("q", values), dtype=_LONG)  # holds the array alive
    return t if device.type == "cpu" else to_device(t, device)


def stage_array(values: array, out: torch.Tensor) -> bool:
    """``values``' bytes copied into ``out`` (a new contiguous GPU tensor) through the
    device's ring (:meth:`IndexRing.stage`); False where the ring does not take them."""
    if not config.INDEX_RING or out.device.type != "cuda":
        return False
    return _ring(out.device).stage(values, out)


def index_array(values: array, device: torch.device) -> torch.Tensor:
    """An int64 ``array`` on a GPU, for the executor's use within the map (the ring's
    slice is rewritten later: not for a tensor autograd keeps)."""
    if config.INDEX_RING:
        out = _ring(device).put(values)
        if out is not None:
            return out
    return to_device(torch.frombuffer(values, dtype=_LONG), device)


def _ring(device: torch.device) -> IndexRing:
    """``device``'s page-locked ring, made on first use."""
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS[device] = IndexRing(device)
    return ring


class IndexRing:
    """Index arrays for a GPU's gathers, staged through one page-locked buffer into one
    device buffer, both used as rings: an index costs a byte copy on the host, one
    asynchronous copy and a view, where a tensor of its own costs two allocations (one
    page-locked) and torch's bookkeeping of both. When the ring wraps, the CPU waits
    for the stream to finish what it was given, so no slice is rewritten before the
    kernels reading it (and the copy filling it) have run: with ``SIZE`` entries, once
    every few dozen TreeLSTM maps of 64 trees. Not under autograd: the index of an
    ``index_select`` that records its backward must outlive the map."""

    SIZE = 1 << 20  # int64 entries: 8 MiB page-locked + 8 MiB on the device

    def __init__(self, device: torch.device):
        self.device = device
        self.host = torch.empty(self.SIZE, dtype=_LONG, pin_memory=True)
        self.dev = torch.empty(self.SIZE, dtype=_LONG, device=device)
        self.host_ptr = self.host.data_ptr()
        self.dev_ptr = self.dev.data_ptr()
        self.pos = 0
        self.wraps = 0
        self.memcpy = _cuda_memcpy()

    def _reserve(self, n: int) -> int:
        """The position of ``n`` free entries (the ring wrapped first if need be)."""
        pos = self.pos
        if pos + n > self.SIZE:
            torch.cuda.synchronize(self.device)  # (every stream: the ring's users may vary)
            pos = 0
            self.wraps += 1
        self.pos = pos + n
        return pos

    def put(self, values: array) -> torch.Tensor | None:
        """``values`` on the device (a view into the ring), or None if too many."""
        n = len(values)
        if n > self.SIZE // 4:
            return None
        pos = self._reserve(n)
        dev = self.dev[pos : pos + n]
        self._send(pos, values.buffer_info()[0], n * 8, dev)
        return dev

    def _send(self, pos: int, address: int, nbytes: int, dst: torch.Tensor) -> None:
        """The ``nbytes`` at host ``address`` into the ring's host slice at ``pos`` (reserved),
        and from there into ``dst`` (contiguous, as many bytes) without waiting."""
        host = self.host_ptr + pos * 8
        ctypes.memmove(host, address, nbytes)
        if self.memcpy is not None:
            stream = cuda_launch.raw_stream(self.device)
            self.memcpy(dst.data_ptr(), host, nbytes, 1, stream)
        else:
            part = self.host[pos : pos + -(-nbytes // 8)].view(torch.uint8)[:nbytes]
            dst.view(-1).view(torch.uint8).copy_(part, non_blocking=True)

    def stage(self, values: array, out: torch.Tensor) -> bool:
        """Copy the bytes of ``values`` into ``out`` (a new contiguous tensor on the
        ring's device, as many bytes) through the page-locked ring, without waiting:
        the host slice is not rewritten before the copy has run (the ring's wrap waits
        for the device). A batch of per-instance data (``torch.tensor(word_id)``) costs
        a byte copy and one asynchronous copy instead of a page-locked tensor of its own
        and torch's copy (the data op took ~50 µs of CPU a batch that way on an H100's
        host); ``out`` is the caller's, so it may outlive the map. False (nothing
        copied) if too large or not as many bytes."""
        address, count = values.buffer_info()
        nbytes = count * values.itemsize
        n = -(-nbytes // 8)
        if n > self.SIZE // 4 or nbytes != out.nbytes:
            return False
        if nbytes == 0:
            return True
        self._send(self._reserve(n), address, nbytes, out)
        return True


_RINGS: dict = {}


def _cuda_memcpy():
    """cupy's ``cudaMemcpyAsync`` (host to device: kind 1) where cupy is installed (a
    plain runtime call, without torch's bookkeeping of a copy), else None."""
    try:
        import cupy
    except Exception:  # (not installed, or no CUDA runtime it can load)
        return None
    return cupy.cuda.runtime.memcpyAsync


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor copied to a GPU without waiting for it: staged in page-locked memory,
    from which the copy runs asynchronously (from pageable memory the copy waits for the
    stream, so every gather's index would hold the CPU until the GPU had caught up, and
    no kernel launch could run ahead). torch's host allocator keeps the staging buffer
    until the copy has run."""
    if device.type != "cuda":
        return t.to(device)
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t)
    return pinned.to(device, non_blocking=True)


#: Type keys count down from here: ints no op takes as an argument. (They counted down
#: from -1 until session 45, and so met the ints ops do take: the signature of
#: ``x[-1]`` was that of ``x[i]`` for a lazy index ``i`` whose (shape, dtype) was the
#: first interned, and a map after one with such an input inferred a gather's shape for
#: a row's; tests/test_graph.py::test_type_keys_are_no_int_arguments.)
_KEY_BASE = -(1 << 59)


def type_key(shape: torch.Size, dtype: torch.dtype) -> int:
    """An int naming (shape, dtype): cheaper to hash in signatures than the pair, and
    never an int argument of an op (``_KEY_BASE``)."""
    key = _TYPE_KEYS.get((shape, dtype))
    if key is None:
        key = _TYPE_KEYS[(shape, dtype)] = _KEY_BASE - len(_TYPE_KEYS)
    return key


class _LazyFields:
    """LazyTensor's fields (``_native.LazyBase`` holds the same ones in C)."""

    __slots__ = ("node", "idx", "shape", "dtype", "key")

    def __init__(self, node, idx: int, shape: torch.Size, dtype: torch.dtype, key=None):
        self.node = node  # the producing graph.Node
        self.idx = idx  # which output of that node
        self.shape = shape  # per-instance shape (no batch dimension)
        self.dtype = dtype
        # this operand's part of a batching signature: a small int naming (shape, dtype)
        self.key = key if key is not None else type_key(shape, dtype)

    def rebind(self, node, idx: int) -> None:
        """Name output ``idx`` of ``node`` from now on (an in-place update's result)."""
        self.node = node
        self.idx = idx


if TYPE_CHECKING:
    _LazyBase = _LazyFields
else:
    _LazyBase = _native.LazyBase if _native is not None else _LazyFields


def _copy_refused(what: str):
    return UnsupportedOpError(
        f"{what} of a lazy tensor that requires grad (at {user_line(3)}) would be a new leaf "
        "with its own gradient, which a map cannot make; copy it with t.clone() (the "
        "gradient flows back) or t.detach().clone()"
    )


def _printed(t: LazyTensor, caller) -> str:
    """``str(t)`` for a caller's frame (LazyTensor.__str__): the value's str where the
    instance's own code asks inside a map's fiber, else the repr."""
    from acrobat import graph

    rt = graph.RT
    if (
        rt is None
        or rt.fiber is None
        or rt.tracer is not None
        or t.node.rt is not rt
        or rt.thread != threading.get_ident()
        or _is_internal(caller.f_code.co_filename)
    ):
        return repr(t)
    value = t._value()
    with torch._C.DisableTorchFunction():
        return str(value)


class LazyTensor(_LazyBase):
    __slots__ = ()

    if TYPE_CHECKING:  # torch.Tensor's methods are installed at import (acrobat/ops.py);
        # at run time there is no __getattr__ (see TensorAttribute)
        def __getattr__(self, name: str) -> Any: ...

    # ---- metadata: answered without a demand ---------------------------------------
    @property
    def device(self) -> torch.device:
        return self.node.rt.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def requires_grad(self) -> bool:
        """Eager's answer, from the graph (acrobat/autograd_info.py): no value is read."""
        from acrobat import autograd_info

        return autograd_info.requires_grad(self)

    @property
    def is_leaf(self) -> bool:
        from acrobat import autograd_info

        return autograd_info.is_leaf(self)

    @property
    def grad_fn(self):
        """None where eager's is (a leaf, a tensor that does not require grad); a tensor
        computed with gradients has its autograd node only once its batch runs."""
        from acrobat import autograd_info
        from acrobat.errors import UnsupportedOpError  # (not an AttributeError: hasattr and
        # getattr with a default would take it for a missing attribute)
        if autograd_info.is_leaf(self):
            return None
        raise UnsupportedOpError(
            f"x.grad_fn of a lazy tensor that requires grad (at {user_line(2)}): its autograd "
            "node exists only once its batch runs; ask x.requires_grad or x.is_leaf instead"
        )

    def dim(self) -> int:
        return len(self.shape)

    ndimension = dim  # (torch.distributions asks this)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    nelement = numel

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self):
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        return iter(self.unbind(0))  # type: ignore[attr-defined]

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def layout(self):
        return torch.strided

    # what torch's Python code asks of a tensor before choosing its path (nn.MultiheadAttention)
    is_nested = is_sparse = is_quantized = is_meta = is_mkldnn = False

    def __repr__(self) -> str:
        n = self.node
        state = "pending" if n.outs is None else "computed"
        shape = "x".join(map(str, self.shape)) or "scalar"
        return (
            f"LazyTensor({n.op.name}#{self.idx}, {shape}, {self.dtype}, "
            f"instance {n.instance}, {state})"
        )

    __hash__ = object.__hash__  # identity, like torch.Tensor

    def __str__(self) -> str:
        """``print(t)``, ``str(t)``, ``f"{t}"`` in the instance's code: the value, printed as
        eager prints it (a read: the instance suspends until the value is computed, as
        at ``t.item()``). Called by acrobat's or torch's own code, inside a block's trace
        or outside the map's fibers: the repr, which reads nothing."""
        return _printed(self, sys._getframe(1))

    def __format__(self, spec: str) -> str:
        """``f"{loss:.3f}"``: a 0-dim tensor formats its value (a read, as eager's
        ``item()``); anything else, or an empty spec, formats as ``str`` does."""
        if spec and not self.shape:
            return format(self.item(), spec)
        if not spec:
            return _printed(self, sys._getframe(1))
        return object.__format__(self, spec)

    def __copy__(self):
        """``copy.copy(t)``: eager's is a detached tensor sharing the storage."""
        if self.requires_grad:
            raise _copy_refused("copy.copy")
        return self.detach()

    def __deepcopy__(self, memo):
        """``copy.deepcopy(t)``: a copy of the value (eager's refuses a non-leaf that
        requires grad)."""
        if self.requires_grad:
            if not self.is_leaf:
                raise RuntimeError(
                    "Only Tensors created explicitly by the user (graph leaves) support the "
                    "deepcopy protocol at the moment."
                )
            raise _copy_refused("copy.deepcopy")
        out = memo[id(self)] = self.clone()
        return out

    # ---- new tensors of this one's dtype and device: constants, not per-instance data ---
    # (made by the factories inside the map, so they are hoisted and shared like
    # ``torch.zeros(n)``: one object for every instance, and they batch)
    def _like(self, dtype, device) -> dict:
        return {"dtype": dtype or self.dtype, "device": device or self.device}

    def new_zeros(self, *size, dtype=None, device=None, requires_grad=False, **_):
        return torch.zeros(*size, **self._like(dtype, device), requires_grad=requires_grad)

    def new_ones(self, *size, dtype=None, device=None, requires_grad=False, **_):
        return torch.ones(*size, **self._like(dtype, device), requires_grad=requires_grad)

    def new_empty(self, *size, dtype=None, device=None, requires_grad=False, **_):
        return torch.empty(*size, **self._like(dtype, device), requires_grad=requires_grad)

    def new_full(self, size, fill_value, *, dtype=None, device=None, requires_grad=False, **_):
        like = self._like(dtype, device)
        return torch.full(size, fill_value, **like, requires_grad=requires_grad)

    # ---- facts of the dtype and shape, known when recorded ----------------------------
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def cpu(self, memory_format=None):
        """``x.cpu()``: ``x.to("cpu")`` (inside a map tensors stay on the map's device)."""
        return self if self.device.type == "cpu" else self.to("cpu")

    def type(self, dtype=None, non_blocking=False, **kwargs):
        """``x.type()``: the type's name, as eager gives it (``'torch.FloatTensor'``);
        ``x.type(dtype)``, ``dtype`` a ``torch.dtype``, a tensor type or its name
        (``'torch.DoubleTensor'``): ``x.to(dtype)``."""
        with torch._C.DisableTorchFunction():
            if dtype is None:
                return torch.empty(0, dtype=self.dtype, device=self.device).type()
            kind = dtype
            if isinstance(kind, str):
                kind = torch
                for part in dtype.split(".")[1:] if dtype.startswith("torch.") else [dtype]:
                    kind = getattr(kind, part, None)
            if not isinstance(kind, torch.dtype):
                kind = getattr(kind, "dtype", None)
            named = dtype if isinstance(dtype, str) else getattr(dtype, "__module__", "")
            cuda = ".cuda" in f".{named}"
        if not isinstance(kind, torch.dtype):
            raise TypeError(f"x.type({dtype!r}): not a dtype or tensor type (at {user_line(2)})")
        if cuda != (self.device.type == "cuda"):
            from acrobat.errors import UnsupportedOpError

            raise UnsupportedOpError(
                f"x.type({dtype!r}) moves a lazy tensor to another device (at {user_line(2)}):"
                " inside f.map tensors stay on the map's device; use x.to(dtype)"
            )
        return self.to(kind)

    def new_tensor(self, data, dtype=None, device=None, requires_grad=False):
        """``torch.tensor(data)`` of this tensor's dtype: per-instance data, as there."""
        return torch.tensor(data, **self._like(dtype, device), requires_grad=requires_grad)

    def new(self, *args, **kwargs):
        """The legacy constructor: ``x.new(2, 3)`` / ``x.new(torch.Size(...))`` an
        uninitialized tensor of those sizes (a constant: filled in place right after, as in
        ``x.new(2, 3).fill_(v)``, it is built as ``graph.construct`` says), ``x.new(data)``
        a tensor of the data."""
        if (
            len(args) == 1
            and isinstance(args[0], (list, tuple))
            and not isinstance(args[0], torch.Size)
        ):
            return self.new_tensor(args[0], **kwargs)
        if len(args) == 1 and isinstance(args[0], torch.Size):
            args = tuple(args[0])
        return self.new_empty(*(args or (0,)), **kwargs)

    # ---- value demands ---------------------------------------------------------------
    def _value(self) -> torch.Tensor:
        from acrobat import fibers

        return fibers.demand(self)

    def item(self):
        if self.shape.numel() != 1:
            raise ValueError(
                f"a Tensor with {self.shape.numel()} elements cannot be converted to Scalar"
            )
        value = DEMAND_PY(self)
        while type(value) is list:  # a (1,)- or (1, 1)-shaped tensor
            value = value[0]
        return value

    def tolist(self):
        return DEMAND_PY(self)

    def __bool__(self) -> bool:
        return bool(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __index__(self) -> int:
        if self.dtype.is_floating_point or self.dtype == torch.bool:
            raise TypeError("only integer tensors of a single element can be converted to an index")
        return int(self.item())

    def numpy(self):
        value = self._value()
        with torch._C.DisableTorchFunction():
            return value.numpy()

    # ---- escape hatch: used without a running map -----------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Reached only when no acrobat mode is active: the lazy tensor escaped f.map.
        raise LazyValueError(
            f"a LazyTensor was passed to {getattr(func, '__name__', func)} outside f.map "
            f"(at {user_line(2)}). Lazy tensors only live inside the f.map call that made "
            "them; use the real tensors that f.map returns instead of storing lazy ones."
        )

    # (x += y, x.add_(y), x.relu_(), x.zero_() ... are recorded out of place and x rebound
    # where that is exact: ops.in_place, installed by acrobat.ops, which installs x[i] = v
    # too: ops.put.) A matrix product cannot keep x's shape in general: refused loudly.
    def __imatmul__(self, other):
        from acrobat.errors import UnsupportedOpError

        raise UnsupportedOpError(
            f"x @= y on a lazy tensor is not supported inside f.map (at {user_line(2)}); "
            "write it out of place: x = x @ y"
        )


class TensorAttribute:
    """What LazyTensor answers for a public ``torch.Tensor`` attribute it defines nothing
    for (ops.install_tensor_attributes puts one on the class per such name, after every
    method with a row is installed): the method with a generic row, bound (and installed
    on the class for later calls), else an UnsupportedMethodError naming the method (an
    AttributeError too). A class attribute rather than ``__getattr__``: a class with a
    ``__getattr__`` makes CPython look every attribute of every lazy tensor up the slow
    way (``slot_tp_getattr_hook``: ``x.tolist``, ``x.shape``, ``x.key`` ~300-450
    instructions each instead of a specialized load; ~4,700 a DRNN small b64 map)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj, cls=None):
        name = self.name
        if obj is None:  # (LazyTensor.<name>: the class has no such attribute)
            raise AttributeError(f"type object 'LazyTensor' has no attribute {name!r}")
        from acrobat import ops  # (a method with a generic row: bound from now on)
        from acrobat.errors import UnsupportedMethodError

        m = ops.generic_method(name)
        if m is not None:
            return m.__get__(obj)
        if name in ("requires_grad_", "retain_grad", "register_hook"):
            raise UnsupportedMethodError(
                f"x.{name}() on a per-instance value (at {user_line(2)}): gradients "
                "with respect to values computed inside an instance (torch.autograd.grad "
                "there) are not supported; pass the inputs to f.map with "
                "requires_grad=True and take gradients of its outputs after it returns"
            )
        raise UnsupportedMethodError(
            f"acrobat cannot batch Tensor.{name} on lazy tensors (at {user_line(2)}); "
            "see acrobat.ops.TABLE for the supported ops, compute it on real tensors "
            "outside f.map, or open an issue to add a batching rule"
        )


if _native is not None:  # freed in one pass, not through subtype_dealloc (see _native.c)
    _native.fast_dealloc(LazyTensor)
