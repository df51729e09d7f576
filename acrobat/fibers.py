"""One greenlet fiber per instance (and per ``fork``); the driver of ``f.map``.

A fiber runs its instance's Python code, recording lazily, until the code returns or
demands a value (``bool(t)``, ``t.item()``...). When no fiber can make progress, the
pending graph is executed batched across ALL suspended instances and the fibers whose
values now exist resume (ACRoBat section 4.2). Code that never demands a value runs each
fiber once, start to end: no suspension, one flush at the end.

Fibers hand over to each other directly: one that blocks switches straight to the next
ready fiber (``switch_away``), and a worker whose fiber ended runs the next one itself;
only when none is ready (time to flush), to start a new worker, or to raise a fiber's
error does control go back to the driver.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import sys
import threading
import time
from typing import Any

import torch
from greenlet import GreenletExit, greenlet
from torch.overrides import TorchFunctionMode

from acrobat import config, graph, objects, ops, tensor
from acrobat.errors import AcrobatError, LazyValueError, UnsupportedOpError, frame_line, user_line
from acrobat.executor import execute, poison_freed, reset_slots
from acrobat.graph import LazyTensor, Runtime, has_lazy, hoist, record, record_data
from acrobat.ops import (
    FUNCS,
    HOISTED_FACTORIES,
    HOISTED_GETTERS,
    INPLACE_FUNCS,
    INPUT,
    SHORTCUT_ORIGINALS,
    TENSOR,
    in_place,
    inplace_kwarg,
    out_kwarg,
    supported_names,
)
from acrobat.scheduler import describe, lower_bound, relevel, schedule

_RANDOM = {"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson",
           "binomial", *graph._RANDOM_FILLS}  # fmt: skip


_SETITEM = torch.Tensor.__setitem__


class RecordMode(TorchFunctionMode):
    """Routes every torch call made by instance code into the op table."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        op = FUNCS.get(func)
        if op is None and func in SHORTCUT_ORIGINALS:  # a torch function written in Python
            func = SHORTCUT_ORIGINALS[func]  # dispatches under its name: the stand-in
            op = FUNCS[func]
        if op is not None:
            stand_in = func in ops.SHORTCUT_FUNCS
            if stand_in:  # its stand-in was not in place: from the next map of this
                ops.MISSED.add(func)  # function on, it is
            lazy = has_lazy(args) or (kwargs and has_lazy(kwargs))
            if lazy and kwargs.get("inplace"):  # F.relu(x, inplace=True), nn.ReLU(True)
                return inplace_kwarg(op, func, args, kwargs)
            if lazy and kwargs.get("out") is not None:  # torch.add(a, b, out=y)
                return out_kwarg(op, func, args, kwargs)
            if op.special is not None and (lazy or op.kind == "data" or op.name == "getitem"):
                if not (lazy and (stand_in or "decomposes" in op.extra)):
                    return op.special(func, args, kwargs)
                # torch took the mode off the thread for this handler: the rule's own torch
                # calls on lazy tensors (narrow's arange(n) + i) record with it back on, as
                # when the function's stand-in calls the rule from the user's code
                torch._C._push_on_torch_function_stack(self)
                try:
                    return op.special(func, args, kwargs)
                finally:
                    torch._C._pop_torch_function_stack()
            if lazy:
                return record(op, func, args, kwargs)
            if op.name in graph.IMPURE_OPS:  # a draw: each call its own
                return func(*args, **kwargs)
            return hoist(func, args, kwargs)
        if func in HOISTED_FACTORIES or func in HOISTED_GETTERS:
            if has_lazy(args) or (kwargs and has_lazy(kwargs)):
                args, kwargs = _read_numbers(func, args, kwargs)
            return hoist(func, args, kwargs)
        if has_lazy(args) or (kwargs and has_lazy(kwargs)):
            if func is _SETITEM:  # real[i] = lazy (a lazy target: LazyTensor.__setitem__)
                return ops.special_setitem(func, args, kwargs)
            if func in INPLACE_FUNCS:  # torch.relu_(x), F.leaky_relu_(x)
                op, out_of_place = INPLACE_FUNCS[func]
                name = func.__name__
                fix = f"x = torch.{name[:-1]}(x, ...)"
                return in_place(op, out_of_place, args, kwargs, f"{name}(...)", fix)
            query = ops.QUERIES.get(func)
            if query is not None:
                return query(*args, **kwargs)
            op = ops.generic_op(func)
            if op is None:
                raise _unsupported(func)
            if kwargs.get("out") is not None:  # torch.fmod(a, b, out=y)
                return out_kwarg(op, func, args, kwargs)
            return record(op, func, args, kwargs)
        rt = graph.RT
        if rt is not None and rt.tracer is not None and getattr(func, "__name__", "") in _RANDOM:
            raise AcrobatError(
                f"{func.__name__} inside a block (at {user_line(2)}): a block is traced once "
                "and replayed, so the draw would repeat for every call; draw the noise "
                "outside the block and pass it in"
            )
        if rt is not None and rt.fresh and graph.builds(rt, func, args):
            return graph.construct(rt, func, args, kwargs)
        if rt is not None and rt.hoisted_versions:
            graph.note_write(rt, func, args)  # (a write into a shared one: its line)
        return func(*args, **kwargs)


def _read_numbers(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A factory given ``torch.tensor(n)`` of a Python number as a size, bound or fill
    value (``torch.arange(torch.tensor(n))``): the number is known when recorded, and eager
    torch reads it, so the factory gets it. A computed per-instance tensor there would
    need a value demand, which cannot happen inside torch's dispatch: a clear error
    asks for ``int(t)`` first."""

    def read(a):
        t = type(a)
        if t is LazyTensor:
            node = a.node
            if node.op is TENSOR and a.shape == () and type(node.data) in (int, float, bool):
                with torch._C.DisableTorchFunction():
                    return torch.tensor(node.data, dtype=a.dtype).item()
            name = getattr(func, "__name__", repr(func))
            raise UnsupportedOpError(
                f"torch.{name} given a per-instance tensor (at {user_line(2)}): read its value "
                "first, e.g. torch.zeros(int(n)) (a value demand), or pass a Python number"
            )
        if t is tuple or t is list:
            return t(read(x) for x in a)
        return a

    return tuple(read(a) for a in args), {k: read(v) for k, v in (kwargs or {}).items()}


def _unsupported(func) -> UnsupportedOpError:
    import difflib

    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__qualname__", name)
    near = difflib.get_close_matches(name, supported_names(), n=6, cutoff=0.5)
    hint = f" Supported ops with similar names: {', '.join(near)}." if near else ""
    return UnsupportedOpError(
        f"acrobat cannot batch {owner} on lazy tensors (at {user_line(3)}).{hint} "
        "See acrobat.ops.TABLE for the supported ops; compute it on real tensors outside "
        "f.map, or open an issue to add a batching rule."
    )


class Fiber:
    __slots__ = (
        "instance",
        "phase",
        "glet",
        "value",
        "error",
        "done",
        "waiting",
        "joiners",
        "host",
        "task",
        "grad",
        "nest",
    )

    def __init__(self, instance: int, phase: int, task: tuple | None = None):
        self.instance = instance
        self.phase = phase
        self.glet: Any = None
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = False
        self.waiting: Any = None  # the LazyTensor or Fiber this fiber waits for
        self.joiners: list[Fiber] | None = None  # made by the first join: most have none
        self.host = None  # the demanded value, copied to the host after a flush
        self.task = task  # (fn, args, kwargs, wrap_inputs) until it starts
        self.grad = None  # its graph.GradTag inside a grad-mode region of its own, else None
        self.nest = 0  # how many joins it runs inside (Future.result's inline run)


class Future:
    """The result of :func:`acrobat.fork`; ``result()`` joins the child fiber."""

    __slots__ = ("fiber",)

    def __init__(self, fiber: Fiber):
        self.fiber = fiber

    def done(self) -> bool:
        return self.fiber.done

    def result(self):
        child = self.fiber
        if not child.done:
            rt = graph.RT
            me = rt.fiber if rt is not None else None
            if me is None or rt.tracer is not None:
                raise AcrobatError("Future.result() must be called from instance code in f.map")
            ready = rt.ready
            if (
                ready
                and ready[-1] is child
                and child.glet is None
                and me.nest < _INLINE_NEST
                and me.grad is None
                and child.grad is None
                and INLINE_JOINS
            ):
                ready.pop()  # (forked last and not started: it runs here, no switch)
                _run_inline(rt, me, child)
                if me.phase < child.phase:
                    me.phase = child.phase
                return child.value
            if child.joiners is None:
                child.joiners = [me]
            else:
                child.joiners.append(me)
            me.waiting = child
            rt.stats.suspensions += 1
            switch_away(rt)
            me.waiting = None
            if me.phase < child.phase:
                me.phase = child.phase
        return child.value


#: A join of a child fiber that has not started, forked last (the tail of the ready
#: queue), runs the child on the joining fiber's greenlet, as a call: the joiner waits for
#: it anyway, and every other fiber runs while it is suspended as before (the same
#: graph); it saves the handover to a parked worker and the switches there and back.
#: DRNN forks a subtree per node with children and joins them at the chain's end: 230
#: of its 792 joins at b64 find the child not started.
INLINE_JOINS = True
_INLINE_NEST = 32  # joins run inline inside one another at most (the C stack grows)


def _run_inline(rt: Runtime, me: Fiber, child: Fiber) -> None:
    """Run the not-started ``child`` on ``me``'s greenlet (Future.result). While it runs
    it is the running fiber (its ops, reads and joins are its own); a failure is raised
    by the driver, as from a worker, and ``me`` stays suspended until the map unwinds."""
    child.glet = me.glet
    child.nest = me.nest + 1
    rt.fiber = child
    _fiber_main(rt, child)  # (as a worker runs it: its end, its joiners woken)
    rt.fiber = me
    error = child.error
    if isinstance(error, GreenletExit):  # the map unwinding (_kill): through the joiner's
        raise error  # frames too (its worker, the joiner's, parks once they are unwound)
    if error is not None:  # as _worker: the driver raises it, naming the instance
        rt.failed = child
        rt.main.switch()


class _Resolved(Future):
    """What :func:`acrobat.fork` returns outside ``f.map``: the value, computed already."""

    __slots__ = ("_value",)

    def __init__(self, value):
        self._value = value

    def done(self) -> bool:
        return True

    def result(self):
        return self._value


_PLAIN = frozenset({int, float, bool, str, complex, type(None)})  # leaves _wrap_inputs keeps


def _wrap_inputs(a):
    """Per-instance tensor arguments become lazy input nodes so their ops batch."""
    t = type(a)
    if isinstance(a, torch.Tensor):
        with torch._C.DisableTorchFunction():  # attributes would dispatch to the mode
            shape, dtype, device = a.shape, a.dtype, a.device
        return record_data(INPUT, (INPUT, shape, dtype, device), a, shape, dtype)
    if t is tuple or t is list:
        if _PLAIN.issuperset(map(type, a)):  # a sentence's word ids: nothing to wrap
            return t(a)
        return t([_wrap_inputs(x) for x in a])
    if isinstance(a, tuple) and hasattr(a, "_fields"):  # namedtuple
        return t(*(_wrap_inputs(x) for x in a))
    if t is dict:
        return {k: _wrap_inputs(v) for k, v in a.items()}
    return a


def _fiber_main(rt: Runtime, fiber: Fiber) -> None:
    """Run ``fiber``'s task on the calling greenlet: its value or error kept, its joiners
    made ready. ``_native.fiber_main`` is the same in C and replaces it where the
    extension is built (the two helpers below are its Python parts)."""
    fn, args, kwargs, wrap = fiber.task  # type: ignore[misc]  # set until it starts
    fiber.task = None
    if rt.grad_resume is not None:  # (the thread's grad mode may be another fiber's)
        rt.grad_resume()
    try:
        if wrap:
            args = _wrap_args(args)
        fiber.value = fn(*args, **kwargs)
    except BaseException as exc:  # re-raised by the driver, with the instance named
        fiber.error = exc
    fiber.done = True
    if fiber.grad is not None:
        _end_grad(rt, fiber)
    fiber.glet = None  # the worker greenlet goes back to the pool
    if fiber.joiners is not None:
        rt.ready.extend(fiber.joiners)


def _wrap_args(args: tuple) -> tuple:
    """An instance's arguments with its tensors made lazy input nodes."""
    return tuple(_wrap_inputs(a) for a in args)


def _end_grad(rt: Runtime, fiber: Fiber) -> None:
    """A fiber ended inside its grad-mode region (set_grad_enabled(False) not undone)."""
    _tag_fiber(rt, fiber, None)
    _SET_GRAD_ENABLED(rt.grad_mode)


# Creating a greenlet costs ~9 us (a fresh frame stack), switching to a parked one ~0.3 us:
# fibers run on pooled worker greenlets, one pool per thread, so a fork costs a switch at
# most (none when the worker that ran the fiber before it is free).
_LOCAL = threading.local()


def _pool() -> list:
    pool = getattr(_LOCAL, "pool", None)
    if pool is None:
        pool = _LOCAL.pool = []
    return pool


def _pool_for_map() -> list:
    """The parked workers a map may reuse: those started while the driver stood at this
    C stack depth (``_native.stack_mark``). A worker's stack begins where the driver
    stood when it started; a C++ error's backtrace walks from a fiber up into the
    driver's frames there, sound only while those are the frames it started under. A map
    called from elsewhere starts its workers anew (the old ones are unwound)."""
    native = tensor._native
    mark = native.stack_mark() if native is not None else None
    pool = _pool()
    if mark is None or getattr(_LOCAL, "pool_mark", None) != mark:
        _LOCAL.pool_mark = mark
        stale = list(pool)
        pool.clear()
        here = greenlet.getcurrent()
        for g in stale:  # unwound now (a GreenletExit where it parked), back to here
            if not g.dead:
                g.parent = here
                g.throw()
    return pool


def _worker() -> None:
    """A worker greenlet: runs fibers, parking in the pool between them. Its first fiber
    comes through ``_LOCAL.handoff``, not as an argument: the argument tuple of a
    greenlet's run stays alive as long as the greenlet (pooled: for good), and with it
    that fiber's whole graph. When its fiber ends it runs the next ready fiber itself if
    that one has not started (no switch at all), else parks and switches straight to it."""
    me = greenlet.getcurrent()
    pool = _pool()  # a greenlet never leaves its thread
    fiber = _LOCAL.handoff
    _LOCAL.handoff = None
    if _worker_loop is not None:  # the loop below in C (the box: its first fiber, taken out)
        box = [fiber]
        del fiber
        _worker_loop(me, pool, box)
        return
    while True:
        rt: Any = graph.RT  # set while fibers run
        _fiber_main(rt, fiber)
        nxt = None
        if fiber.error is not None:
            rt.failed = fiber  # the driver raises it
        elif rt.ready:
            nxt = rt.ready.popleft()
        fiber = None  # type: ignore[assignment]  # hold nothing of a finished run
        if nxt is not None and nxt.glet is None:  # not started: run it on this worker
            nxt.glet = me
            rt.fiber = fiber = nxt
            continue
        if len(pool) >= config.FIBER_POOL:
            if nxt is not None:
                rt.ready.appendleft(nxt)
            return  # to the parent, the driver
        pool.append(me)
        if nxt is None:
            to = rt.main
        else:
            rt.fiber = nxt
            to = nxt.glet
        rt = nxt = None  # parked, hold nothing of this map
        fiber = to.switch()


_worker_loop = tensor._native.worker_loop if tensor._native is not None else None


def _start(rt: Runtime, fiber: Fiber) -> None:
    """Start ``fiber`` on a new worker greenlet; only the driver does (every worker's
    stack then starts at the same depth)."""
    g = greenlet(_worker, parent=rt.main)
    fiber.glet = g
    _LOCAL.handoff = fiber
    g.switch()


def switch_away(rt: Runtime) -> None:
    """The running fiber blocks (a value demand or a join): switch straight to the next
    ready fiber, or to the driver when none is ready (it flushes) or a fiber failed. Half
    the switches of a round trip through the driver; the order fibers run in is the
    driver's (one FIFO queue, whoever pops it). ``_native.switch_away`` is the same in C
    and replaces it where the extension is built."""
    _hand_over(rt)
    if rt.grad_resume is not None:  # resumed: the thread's grad mode back to this fiber's
        rt.grad_resume()


def _hand_over(rt: Runtime) -> None:
    ready = rt.ready
    if not ready or rt.failed is not None:
        rt.main.switch()
        return
    fiber = ready[0]
    g = fiber.glet
    if g is None:  # not started: on a parked worker, else the driver starts a new one
        pool = rt.pool
        if not pool:  # (a greenlet made here would have its stack below this fiber's:
            rt.main.switch()  # nested ones would deepen the C stack without bound)
            return
        ready.popleft()
        _run_parked(rt, fiber, pool)
        return
    ready.popleft()
    rt.fiber = fiber
    g.switch()


def _run_parked(rt: Runtime, fiber: Fiber, pool: list) -> None:
    """Run ``fiber``, not started, on the last parked worker of ``pool``."""
    g = pool.pop()
    if g.parent is not rt.main:
        g.parent = rt.main
    fiber.glet = g
    rt.fiber = fiber
    g.switch(fiber)


def fork(fn, *args, **kwargs) -> Future:
    """Start ``fn(*args, **kwargs)`` as a child fiber of the running instance.

    Inside ``f.map`` the child runs concurrently with its parent and siblings, so each can
    block on its own tensor values while the others keep recording; ``result()`` joins.
    Outside ``f.map`` (eager) it simply calls ``fn``.

    >>> fut = acrobat.fork(generate, model, h)   # doctest: +SKIP
    >>> subtree = fut.result()                    # doctest: +SKIP
    """
    rt = graph.RT
    if rt is None or rt.fiber is None or rt.tracer is not None:
        return _Resolved(fn(*args, **kwargs))
    parent = rt.fiber
    child = Fiber(parent.instance, parent.phase, (fn, args, kwargs, False))
    if parent.grad is not None:  # forked inside a grad-mode region: the child runs in it
        _tag_fiber(rt, child, parent.grad)
    rt.all_fibers.append(child)
    rt.live.append(child)
    rt.ready.append(child)
    return Future(child)


def concurrent(*thunks):
    """Run zero-argument callables as concurrent fibers; their results, in order."""
    futures = [fork(t) for t in thunks]
    return [f.result() for f in futures]


_torch_function_on = torch._C._is_torch_function_enabled


def _wait(t: LazyTensor):
    """Suspend the running fiber until ``t`` is computed; the host copy of its value when
    the flush made one (non-CPU devices), else None."""
    rt = graph.RT
    node = t.node
    if rt is None or node.rt is not rt:
        raise LazyValueError(
            f"the value of a LazyTensor was read outside the f.map call that made it "
            f"(at {user_line(4)}); use the real tensors f.map returns"
        )
    if node.outs is not None:
        return None
    if node.depth < 0:
        graph.queue(rt, node)
    if rt.tracer is not None:
        raise LazyValueError(
            f"a block read a tensor value (at {user_line(4)}): @acrobat.block functions "
            "must not have tensor-dependent control flow; move the decision out of the block"
        )
    if not _torch_function_on():
        # Inside acrobat's or torch's own evaluation (shape inference, a batched rule):
        # torch asked for a lazy tensor as a Python number (a slice bound, a start, a
        # size). Suspending here would carry DisableTorchFunction's state to the fibers
        # that run meanwhile (it is per thread, not per fiber) and break the map.
        raise LazyValueError(
            f"a per-instance tensor was given where torch needs a Python number (a slice "
            f"bound, a start, a size or a count; at {user_line(4)}): read it first, e.g. "
            "x[int(i):] or torch.narrow(x, 0, int(i), n)"
        )
    fiber = rt.fiber
    fiber.waiting = t
    node.demanded = True  # (its bucket runs at the flush: scheduler.unneeded)
    rt.blocked.append(fiber)  # (counted as suspensions when the driver flushes them)
    switch_away(rt)
    fiber.waiting = None
    host = fiber.host
    fiber.host = None
    return host


def demand(t: LazyTensor) -> torch.Tensor:
    """The value of ``t``; suspends the running fiber until the graph has produced it."""
    host = _wait(t)
    if host is not None:
        return host.tensor() if type(host) is HostRow else host
    node = t.node
    with torch._C.DisableTorchFunction():  # plain indexing, not a recorded row lookup
        return node.outs[t.idx][node.row].detach()


_PY_ROWS_MAX = 64  # per-instance elements up to which a batch is converted whole


def demand_py(t: LazyTensor):
    """``t.tolist()``: the value as Python numbers. After a flush every instance reads its
    decision from the same batch output, so small outputs are converted to Python once
    per batch (one ``tolist``) and each fiber takes its row: a parser's or a tree
    generator's per-decision read costs a list index instead of three torch calls."""
    host = _wait(t)
    if host is None:  # this batch's output converted already: no torch call at all
        node = t.node
        rows = node.rt.py_rows.get(id(node.outs[t.idx]))
        if rows is not None and rows[node.row] is not None:
            return _copy(rows[node.row])
    if host is not None:
        return _host_list(host)
    with torch._C.DisableTorchFunction():
        node = t.node
        buf = node.outs[t.idx]
        rt = node.rt
        if buf.numel() > _PY_ROWS_MAX * max(buf.shape[0], 1) or id(node.outs) in rt.tables:
            return buf[node.row].tolist()
        rows = rt.py_rows.get(id(buf))
        if rows is None:
            rows = rt.py_rows[id(buf)] = buf.tolist()
        row = rows[node.row]
        if row is None:  # handed out to an earlier read (_native.value_read): anew
            return buf[node.row].tolist()
        return _copy(row)  # the caller may mutate its list


def _host_list(host):
    """A demanded value copied to the host by its flush (non-CPU devices), as Python."""
    if type(host) is HostRow:
        return _copy(host.value)  # (the caller may mutate its list)
    with torch._C.DisableTorchFunction():
        return host.tolist()


class HostRow:
    """A GPU read's value: row ``row`` of ``copy``, the host copy of its batch output,
    with the row as Python numbers (``value``) from one ``tolist`` of the whole copy.
    Every instance reads its decision from the same small output, so converting it once
    leaves each read a list index instead of a row view and its own ``tolist`` (~2 µs);
    :func:`demand` makes the view only where a tensor is asked for."""

    __slots__ = ("copy", "row", "value")

    def __init__(self, copy: torch.Tensor, row: int, value):
        self.copy = copy
        self.row = row
        self.value = value

    def tensor(self) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            return self.copy[self.row]


#: GPU reads of small batch outputs served from one ``tolist`` per output (HostRow); off:
#: a row view per read, converted by itself. Measured on an H200 (plain code, small, 9
#: alternating rounds): DRNN b64 1.18x, b8 1.04x, StackRNN 1.16x / 1.04x, Berxit 1.06x /
#: 1.02x.
HOST_ROWS = True


if tensor._native is not None:  # the common path of a read in C (_native.value_read):
    # a suspension and the row of the converted batch without a Python frame
    tensor._native.setup_fibers(demand_py, _host_list, _torch_function_on)
    switch_away = tensor._native.switch_away  # the same, in C (joins use it)
    tensor.DEMAND_PY = tensor._native.value_read
    LazyTensor.tolist = tensor._native.LazyBase.tolist  # type: ignore[method-assign]
    # item() and int(t), float(t), bool(t) over it: the same read, no Python frame
    LazyTensor.item = tensor._native.LazyBase.item  # type: ignore[method-assign]
    for _slot in ("__int__", "__float__", "__bool__"):
        setattr(LazyTensor, _slot, getattr(tensor._native.LazyBase, _slot))
else:
    tensor.DEMAND_PY = demand_py
    LazyTensor.tolist = demand_py  # type: ignore[method-assign]  # t.tolist(): no extra frame


def _copy(row):
    if type(row) is not list:
        return row
    if row and type(row[0]) is list:
        return [_copy(r) for r in row]
    return list(row)


def _flush(rt: Runtime, max_phase=float("inf"), demand: bool = False) -> None:
    if rt.grad_regions:  # the last fiber to run may have been inside its grad-mode region
        _SET_GRAD_ENABLED(rt.grad_mode)
    t0 = time.perf_counter()
    rt.py_rows = {}  # ids of this flush's outputs: a new flush makes new ones
    batches = schedule(rt, max_phase, demand)
    # (the sinks left pending come from several flushes, at the depths each had: levelled
    # by height, as the demand flushes are, they are one level, the last)
    batches = relevel(rt, batches, late=(demand or rt.sunk) and config.RELEVEL)
    rt.stats.t_schedule += time.perf_counter() - t0
    rt.stats.flushes += 1
    if config.VERIFY or config.DEBUG >= 1:
        rt.stats.batches_lower_bound += lower_bound(batches)
    if config.DEBUG >= 1:
        nodes = sum(len(b) for b in batches)
        print(
            f"[acrobat] flush {rt.stats.flushes}: {nodes} nodes in {len(batches)} batches "
            f"(lower bound {lower_bound(batches)})"
        )
        if config.DEBUG >= 2:
            print(describe(batches))
    with torch._C.DisableTorchFunction():
        if rt.freed is not None:
            poison_freed(rt)
        execute(batches, rt.stats)


def _copy_demanded(blocked: list[Fiber], device: torch.device) -> None:
    """The values demanded in this round copied to the host (non-CPU devices), each
    fiber given a view of its row (``fiber.host``). Grouped by the batch output they
    come from (a round's reads mostly share one or two: every instance's decision of
    one batch): a small output is copied whole, a large one only its demanded rows
    (one gather on the device), the copies issued without waiting and waited for once.
    Per fiber that leaves one view of a host tensor; slicing every row on the device
    and concatenating them cost ~8 µs a read."""
    if device.type == "cpu":
        return
    groups: dict = {}
    for fb in blocked:
        t = fb.waiting
        buf = t.node.outs[t.idx]
        group = groups.get(id(buf))
        if group is None:
            groups[id(buf)] = (buf, [fb])
        else:
            group[1].append(fb)
    copies: list[tuple[torch.Tensor, list, list | None]] = []
    waits = set()
    for buf, fibers in groups.values():  # (an output on the host: itself, or its rows)
        rows = [fb.waiting.node.row for fb in fibers]
        whole = buf.nbytes <= _WHOLE_BYTES or 2 * len(rows) >= buf.shape[0]
        src = buf if whole else buf.index_select(0, tensor.index_tensor(rows, buf.device))
        cuda = buf.device.type == "cuda"  # (elsewhere a copy to the host waits itself)
        copies.append((src.to("cpu", non_blocking=cuda), fibers, None if whole else rows))
        if cuda:
            waits.add(buf.device)
    for dev in waits:  # the copies above were queued on each device's current stream
        torch.cuda.current_stream(dev).synchronize()
    for host, fibers, picked in copies:
        if picked is None and HOST_ROWS and host.numel() <= _PY_ROWS_MAX * max(host.shape[0], 1):
            rows = host.tolist()
            for fb in fibers:
                row = fb.waiting.node.row
                fb.host = HostRow(host, row, rows[row])
        elif picked is None:
            for fb in fibers:
                fb.host = host[fb.waiting.node.row]
        else:
            for i, fb in enumerate(fibers):
                fb.host = host[i]


_WHOLE_BYTES = 1 << 16  # a demanded batch output up to this size is copied to the host whole


def _raise_fiber_error(fiber: Fiber, fn_name: str):
    exc = fiber.error
    assert exc is not None
    if isinstance(exc, RecursionError):
        raise AcrobatError(
            f"instance {fiber.instance} of {fn_name}.map exceeded Python's recursion limit "
            "(deep recursion in instance code); raise it with sys.setrecursionlimit"
        ) from exc
    if hasattr(exc, "add_note"):
        exc.add_note(f"acrobat: raised by instance {fiber.instance} of {fn_name}.map")
    raise exc


def _suspended_at(fiber: Fiber) -> str:
    """Where a suspended fiber's user code waits: read from its greenlet's frames only
    when an error message needs it (keeping a frame per suspension cost time)."""
    g = fiber.glet
    if g is None or fiber.task is not None:
        return "<not started>"
    return frame_line(g.gr_frame)


def _drive(rt: Runtime, mode: RecordMode, fn_name: str) -> None:
    rt.mode = mode
    stats = rt.stats
    ready = rt.ready
    pool = rt.pool
    while True:
        t0 = time.perf_counter()
        with mode:
            while ready:
                fiber = ready.popleft()
                rt.fiber = fiber
                g = fiber.glet
                if g is not None:
                    g.switch()
                elif pool:  # a parked worker greenlet runs it
                    _run_parked(rt, fiber, pool)
                else:
                    _start(rt, fiber)
                if rt.failed is not None:
                    _raise_fiber_error(rt.failed, fn_name)
        rt.fiber = None
        stats.t_record += time.perf_counter() - t0
        blocked = rt.blocked
        if not blocked:
            stuck = [f for f in rt.all_fibers if not f.done]
            if stuck:
                names = "; ".join(
                    f"instance {f.instance} waiting at {_suspended_at(f)}" for f in stuck[:4]
                )
                raise AcrobatError(
                    f"deadlock: fibers wait for each other and none can make progress ({names})"
                )
            break
        max_phase = float("inf")
        if rt.phased:  # (else every fiber and node is in phase 0: the flush runs all)
            rt.live = live = [f for f in rt.live if not f.done]  # pruned as fibers end
            max_phase = min([f.phase for f in live])
            for f in blocked:
                p = f.waiting.node.phase
                if p > max_phase:
                    max_phase = p
        stats.suspensions += len(blocked)
        _flush(rt, max_phase, demand=True)
        _copy_demanded(blocked, rt.device)
        rt.blocked = []
        missing = _resume_all(blocked, rt.ready)
        if missing is not None:  # pragma: no cover - scheduler invariant
            raise AcrobatError(
                f"internal: demanded value not produced for instance {missing.instance}"
            )
    _flush(rt)


def _resume_all_py(blocked: list, ready) -> Fiber | None:
    """The fibers a flush unblocked appended to ``ready``; the first whose demanded value
    is still missing instead (none appended then). ``_native.resume_all`` in C."""
    for f in blocked:
        if f.waiting.node.outs is None:
            return f
    ready.extend(blocked)
    return None


_resume_all = tensor._native.resume_all if tensor._native is not None else _resume_all_py


def _queue_deferred(value, rt) -> bool:
    """Queue the deferred constants among a pytree of results; True if any was."""
    t = type(value)
    if t is LazyTensor:
        if value.node.depth < 0:
            graph.queue(rt, value.node)
            return True
        return False
    if t is dict:
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return False
    found = False
    for v in value:
        found |= _queue_deferred(v, rt)
    return found


# results returned as they are besides _PLAIN: values that hold no tensor (x.shape,
# x.dtype, x.device of a lazy tensor are real already)
_VALUES = frozenset({torch.Size, torch.dtype, torch.device, bytes, range})


def _materialize(value, instance: int, fn_name: str):
    t = type(value)
    if t is LazyTensor:
        node = value.node
        if node.outs is None:  # a deferred constant returned as it is
            rt = node.rt
            graph.queue(rt, node)
            _flush(rt)
        if id(node.outs) in node.rt.shared:  # a row of a parameter in place (eager's
            # lookup returns a copy) or one another instance may have (executor._distinct)
            return node.outs[value.idx][node.row].clone()
        tag = graph.grad_tag(node.sig)
        if tag is not None and tag.enabled != torch.is_grad_enabled():
            with torch.set_grad_enabled(tag.enabled):  # (enable_grad inside an instance
                return node.outs[value.idx][node.row]  # of a map without gradients)
        return node.outs[value.idx][node.row]
    if t in _PLAIN or t in _VALUES or isinstance(value, torch.Tensor):
        return value
    if (t is set or t is frozenset) and _PLAIN.issuperset(map(type, value)):
        return t(value)  # (chosen indices, seen words: values as eager returns them)
    if t is list or t is tuple:
        if _PLAIN.issuperset(map(type, value)):  # a tree's parent indices: as they are
            return t(value)
        if t is list:
            return [_materialize(v, instance, fn_name) for v in value]
        return tuple(_materialize(v, instance, fn_name) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return t(*(_materialize(v, instance, fn_name) for v in value))
    if isinstance(value, tuple) and hasattr(t, "n_fields"):  # torch.return_types
        return t([_materialize(v, instance, fn_name) for v in value])
    if t is dict:
        return {k: _materialize(v, instance, fn_name) for k, v in value.items()}
    raise AcrobatError(
        f"instance {instance} of {fn_name}.map returned a {t.__name__}; results must be "
        "pytrees (tuple/list/dict/namedtuple) of tensors and Python values (numbers, "
        "strings, sizes, dtypes, sets of numbers)"
    )


_materialize_py = _materialize
if tensor._native is not None:  # its common cases in C (_native.materialize), else this
    _MISS = object()
    tensor._native.setup_materialize(_MISS, _PLAIN | _VALUES, torch.Tensor, graph.GradTag)

    def _materialize(value, instance: int, fn_name: str):
        out = tensor._native.materialize(value)
        return _materialize_py(value, instance, fn_name) if out is _MISS else out


def map_device(arg_tuples: list[tuple], kwargs: dict) -> torch.device | None:
    """The device a map computes on, which its lazy tensors report (``x.device``): that
    of the first tensor among the instances' arguments (an input, or else a module's
    first parameter or buffer), or None (then torch's default device: where the
    instances' ``torch.tensor(word_id)`` puts the data they start from). acrobat
    batches on one device; an op mixing devices fails as it fails eagerly."""
    return _first_device(arg_tuples[:1], 0) or _first_device(list(kwargs.values()), 1)


def _first_device(a, depth: int) -> torch.device | None:
    if isinstance(a, torch.Tensor):
        with torch._C.DisableTorchFunction():
            return a.device
    if isinstance(a, torch.nn.Module):
        for t in itertools.chain(a.parameters(), a.buffers()):
            return t.device
        return None
    if depth < 3 and isinstance(a, (tuple, list, dict)):
        for x in list(a.values() if isinstance(a, dict) else a)[:8]:
            found = _first_device(x, depth + 1)
            if found is not None:
                return found
    return None


_SET_GRAD_ENABLED = torch._C._set_grad_enabled


def _in_instance(rt) -> bool:
    """Whether the user's instance code of ``rt``'s map switches a mode: a fiber (not the
    driver) and not torch's own code (``nn.LSTM``'s weight flattening on a GPU switches
    gradients off around work that records nothing)."""
    return (
        rt is not None
        and rt.fiber is not None
        and greenlet.getcurrent() is not rt.main
        and rt.thread == threading.get_ident()
        and not _torch_switches()
    )


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SWITCH_FILES = ("grad_mode.py", "autocast_mode.py", "_contextlib.py", "contextlib.py")


def _torch_switches() -> bool:
    """Whether the mode switch being made comes from torch's own code: the first frame
    past the context managers' (and acrobat's) is torch's."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.endswith(_SWITCH_FILES) or name.startswith(_ACROBAT_DIR)):
            return name.startswith(_TORCH_DIR)
        frame = frame.f_back
    return False


_ACROBAT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def autocast_state(device: torch.device):
    """``(device type, dtype)`` of the autocast enabled for ``device``'s type, or None."""
    kind = device.type
    try:
        if not torch.is_autocast_enabled(kind):
            return None
        return kind, torch.get_autocast_dtype(kind)
    except (TypeError, RuntimeError):  # (a torch without per-device queries, a device
        return None  # type autocast does not know)


#: What a map under autocast runs with: torch's kernels, which autocast casts for, not
#: acrobat's own (numba GEMM and tanh, MKL batched GEMM by address, the Elman kernel,
#: fused elementwise kernels), which compute in the operands' dtype.
_AUTOCAST_OFF = dict(FAST_GEMM=False, FAST_TANH=False, FAST_RECURRENCE=False,
                     ROW_OPERANDS=False, KERNEL_BACKEND="off")  # fmt: skip

_SET_AUTOCAST_ENABLED = torch.set_autocast_enabled
_SET_AUTOCAST_DTYPE = torch.set_autocast_dtype


def _autocast_switch(what: str, *args) -> None:
    rt = graph.RT
    if rt is None:
        return
    device_type = args[0] if len(args) == 2 else "cuda"  # (torch's old one-argument form)
    value = args[-1]
    now = (
        torch.is_autocast_enabled(device_type)
        if what == "enabled"
        else torch.get_autocast_dtype(device_type)
    )
    if value != now and _in_instance(rt):  # (a real switch: then whose, by its frames)
        raise AcrobatError(
            f"torch.autocast switched ({device_type} {what} {value}) inside an instance (at "
            f"{user_line(3)}): acrobat runs the whole batch in the autocast f.map was called "
            "in; call f.map inside the autocast instead"
        )


def _set_autocast_enabled(*args) -> None:
    _autocast_switch("enabled", *args)
    _SET_AUTOCAST_ENABLED(*args)


def _set_autocast_dtype(*args) -> None:
    _autocast_switch("dtype", *args)
    _SET_AUTOCAST_DTYPE(*args)


def _set_grad_enabled(enabled: bool) -> None:
    """torch's grad-mode switch while a map runs (``torch.no_grad()``,
    ``torch.enable_grad()``, ``torch.set_grad_enabled``, ``@torch.no_grad()``). Instance
    code switching to a mode other than its map's enters a region of its own: the fiber
    carries a :class:`graph.GradTag`, the nodes it records batch apart from the map's
    (their signature holds the tag) and run in that mode, the shared values it hoists
    are its mode's, and the thread's mode follows the running fiber (every fiber puts its
    own back when it resumes: ``rt.grad_resume``). Blocks and loops called inside run op
    by op. torch's own switches (an ``nn.LSTM`` flattening its weights) change nothing."""
    rt = graph.RT
    if rt is not None and rt.fiber is not None:
        fiber = rt.fiber
        enabled = bool(enabled)
        tag = None if enabled == rt.grad_mode else (graph.GRAD_ON if enabled else graph.GRAD_OFF)
        traced = rt.tracer is not None and enabled != torch.is_grad_enabled()
        if (tag is not fiber.grad or traced) and _in_instance(rt):  # (then whose: frames)
            if traced:
                raise AcrobatError(
                    f"torch's grad mode switched {'on' if enabled else 'off'} inside a block "
                    f"(at {user_line(2)}): a block is traced once and runs in the mode it is "
                    "called in; switch the mode around the block's call instead"
                )
            _tag_fiber(rt, fiber, tag)
    _SET_GRAD_ENABLED(enabled)


def _tag_fiber(rt, fiber, tag) -> None:
    """``fiber``'s grad-mode region begins (a tag) or ends (None)."""
    rt.grad_regions += (tag is not None) - (fiber.grad is not None)
    fiber.grad = tag
    rt.grad_resume = _resume_grad if rt.grad_regions else None


def _resume_grad() -> None:
    """The thread's grad mode set to the running fiber's (called as a fiber starts or
    resumes while any fiber is inside a grad-mode region of its own)."""
    rt = graph.RT
    if rt is not None and rt.fiber is not None:
        tag = rt.fiber.grad
        _SET_GRAD_ENABLED(rt.grad_mode if tag is None else tag.enabled)


_INFERENCE_MODE = torch._C._InferenceMode


def _inference_mode(mode: bool = True):
    """``torch.inference_mode()`` inside an instance of a map with gradients on: refused
    (its tensors could never join the autograd graph of the batch they are computed in;
    ``torch.no_grad()`` is supported)."""
    rt = graph.RT
    if mode and rt is not None and rt.grad_mode and _in_instance(rt):
        raise AcrobatError(
            f"torch.inference_mode() inside an instance (at {user_line(2)}) of a map with "
            "gradients on: use torch.no_grad() there (supported), or call f.map inside "
            "torch.inference_mode()"
        )
    return _INFERENCE_MODE(mode)


def run_map(fn, arg_tuples: list[tuple], kwargs: dict, stats, fn_name: str) -> list:
    running = graph.RT
    if running is not None:
        if running.thread != threading.get_ident():
            raise AcrobatError(
                "f.map is already running in another thread: acrobat runs one map at a time "
                "per process (use worker processes to run maps in parallel)"
            )
        raise AcrobatError("f.map was called inside another f.map; nest plain calls instead")
    rt = Runtime(stats)
    rt.grad_mode = torch.is_grad_enabled()
    rt.default_device = torch.get_default_device()
    rt.device = map_device(arg_tuples, kwargs) or rt.default_device
    rt.autocast = autocast_state(rt.device)  # (the map's device type's autocast)
    reset_slots()
    rt.main = greenlet.getcurrent()
    rt.pool = _pool_for_map()
    rt.all_fibers = []
    for i, args in enumerate(arg_tuples):
        fiber = Fiber(i, 0, (fn, args, kwargs, True))
        rt.all_fibers.append(fiber)
    rt.ready.extend(rt.all_fibers)
    rt.live = list(rt.all_fibers)
    if config.VERIFY and config.FREE_OUTPUTS and not rt.grad_mode and tensor._native is not None:
        rt.freed = []
        tensor._native.keep_freed(rt.freed)
    graph.RT = rt
    t0 = time.perf_counter()
    # A map allocates many small objects and frees none of them until it ends: the cyclic
    # collector's passes over them are pure overhead (up to 10x recording time), so it is
    # paused for the call; the runtime breaks its own reference cycles when it ends.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    torch._C._set_grad_enabled = _set_grad_enabled  # (torch's grad-mode switches call it)
    torch._C._InferenceMode = _inference_mode  # type: ignore[misc, assignment]  # (inference_mode)
    torch.set_autocast_enabled = _set_autocast_enabled  # type: ignore[assignment]  # (torch.autocast
    torch.set_autocast_dtype = _set_autocast_dtype  # type: ignore[assignment]  # calls them)
    ops.distribution_checks(True)  # (Categorical.log_prob of a lazy sample)
    kernels = config.override(**_AUTOCAST_OFF) if rt.autocast else contextlib.nullcontext()
    try:
        kernels.__enter__()
        with objects.instance_attributes(rt, arg_tuples):
            _drive(rt, RecordMode(), fn_name)
        graph.check_hoisted(rt)
        if rt.deferred and _queue_deferred([f.value for f in rt.all_fibers], rt):
            _flush(rt)  # constants returned as they are, all in one batch
        results = [
            _materialize(f.value, f.instance, fn_name) for f in rt.all_fibers[: len(arg_tuples)]
        ]
    except BaseException:
        _kill(rt)
        raise
    finally:
        kernels.__exit__(None, None, None)
        torch._C._set_grad_enabled = _SET_GRAD_ENABLED
        if rt.grad_regions or torch.is_grad_enabled() != rt.grad_mode:
            _SET_GRAD_ENABLED(rt.grad_mode)  # (a map that failed inside a region)
            rt.grad_regions, rt.grad_resume = 0, None
        torch._C._InferenceMode = _INFERENCE_MODE  # type: ignore[misc]
        torch.set_autocast_enabled = _SET_AUTOCAST_ENABLED
        torch.set_autocast_dtype = _SET_AUTOCAST_DTYPE
        ops.distribution_checks(False)
        graph.RT = None
        stats.t_total = time.perf_counter() - t0
        stats.nodes = rt.nodes
        rt.all_fibers = rt.live = []
        rt.ready.clear()
        rt.main = None
        rt.pool = []
        # the constants' nodes and those split_seen holds point back at rt: cycles the
        # paused collector would leave for a later (full) collection
        rt.constants = {}
        rt.split_seen = {}
        rt.kept = []
        if rt.freed is not None:
            tensor._native.keep_freed(None)
            rt.freed = None
        for split in rt.used_splits:  # traces outlive the map; this run's graph must not
            split.memo = {}
        rt.used_splits = []
        if rt.memo_blocks:  # (their last cache hits hold this run's arguments)
            tensor._native.clear_memos(rt.memo_blocks)
            rt.memo_blocks = []
        if gc_was_enabled:
            gc.enable()
    return results


def _kill(rt: Runtime) -> None:
    """Unwind every suspended fiber so no greenlet (or its frames) leaks. With the mode
    on, as when a fiber resumes normally: a fiber suspended inside the mode's handler
    (ops._demanded) took the mode off the stack when it resumed, and torch puts it back
    when the handler returns, here unwinding."""
    rt.ready.clear()  # an unwinding fiber that blocks again goes back to the driver
    with rt.mode if rt.mode is not None else contextlib.nullcontext():
        for f in rt.all_fibers:
            g = f.glet
            if not f.done and g is not None and g and not g.dead:
                with contextlib.suppress(BaseException):
                    g.throw()  # unwinds the fiber's frames; its worker parks in the pool
            f.glet = None
    rt.buckets = {}
    rt.blocked = []
    rt.ready.clear()


if tensor._native is not None:  # a fiber's run in C (_native.fiber_main): no Python frame
    tensor._native.setup_fiber_main(_wrap_args, _end_grad)
    _fiber_main_py = _fiber_main
    _fiber_main = tensor._native.fiber_main
    # a fork from instance code in C (_native.fork): the child and its Future made
    # without a Python frame; outside a map, in a block's trace or a grad-mode region of
    # the fiber's own, it calls fork_py
    fork_py = fork
    tensor._native.setup_fork(Fiber, Future, fork_py)
    fork = tensor._native.fork
