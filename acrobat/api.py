"""The user API: ``autobatch`` (with ``.map`` and ``.eager``), ``block``, ``phase``,
``fork``/``concurrent`` and ``stats``. Thin: it wires the stages together."""

from __future__ import annotations

import contextlib
import functools
import time
import types
import warnings
import weakref
from typing import Any

import torch

from acrobat import analysis, config, fibers, graph, memory, objects, ops
from acrobat.errors import AcrobatError, AcrobatWarning
from acrobat.stats import Stats

_LAST_STATS: Stats | None = None


class _MapChoice:
    """The online choice between the batched map and the eager loop for one key of a
    function (config.MAP_CHOICE; Astra's work-conserving trials: every run computes the
    map's real results).

    Trials: the two alternate, the batched map first, each run timed per instance; the
    first run of each is untimed (traces, kernels, caches). The batched map is kept as
    soon as it is clearly faster: its first timed run ``CLEAR_FIRST`` times faster than
    even the eager loop's untimed first (the eager loop not tried again), or ``CLEAR``
    times faster than the eager loop's timed run; else after ``TRIALS`` timed runs each,
    the faster by its best time, the eager loop only if 10% faster (never early: a map's
    early runs may still trace new shapes). The untimed first run of the eager loop can
    hold one-time costs of its own (a BiLSTM tagger's first ``torch.lstm`` with gradients
    took 27 ms against 0.12 after, its first eager run 30 ms against ~2): judged by it
    at 3x, a map 15% slower than the eager loop was kept, and the re-check put off by
    the ratio it showed; hence the wider margin there.

    Re-checks: the kept variant's times are watched (the best of its last ``WINDOW``
    runs), and the other runs again now and then, so a verdict made while traces were
    still warming up, or before the data changed, does not stand for good. The next
    re-check comes after ``RECHECK`` maps times the other's last ratio to the kept one
    (a loop 8x slower is re-tried 8x less often: at most ~1/RECHECK of the time goes to
    re-checks), the period doubling each time the verdict stands (up to ``RECHECK_MAX``
    maps); the other takes over only if clearly faster than the kept one's recent best
    (the eager loop: 10% faster; the batched map: faster).

    With gradients (results that require grad), a run's time is its forward and the
    backward through its results (:meth:`observe`): the eager loop's backward walks every
    instance's small ops, the map's batched ones, so the forward alone misjudges a
    training step (the batched map of a causal LM's step, 1.7x faster than the eager
    loop's step at batch 64, lost its trials by its forward). A run whose backward has
    not come by the next map counts its forward alone."""

    TRIALS = 2
    CLEAR = 3.0
    CLEAR_FIRST = 8.0
    WINDOW = 8
    SAMPLE = 8
    RECHECK = 64
    RECHECK_MAX = 1 << 16

    __slots__ = (
        "runs", "choice", "recent", "ratio", "period", "due", "calls", "checking", "pending",
    )  # fmt: skip

    def __init__(self):
        self.runs: dict[str, list[float]] = {"map": [], "eager": []}
        self.choice: str | None = None
        self.recent: list[float] = []  # the kept variant's last seconds per instance
        self.ratio = 1.0  # the other's time over the kept one's, when last measured
        self.period = self.RECHECK  # maps between re-checks, before the ratio
        self.due = 0  # the map count at which the other runs again
        self.calls = 0  # maps since the choice
        self.checking = False  # the run in flight is a re-check of the other
        # a run waiting for the backward through its results: [variant, forward seconds,
        # instances, the backward's start or None, the hooks' handles]
        self.pending: list | None = None

    def observe(self, variant: str, seconds: float, instances: int, results) -> None:
        """:meth:`note` the run, at once or, where its results require grad, once the
        backward through them ends (its time added: from the first result's gradient to
        the end of that backward pass, ``queue_callback`` of autograd's engine). Once
        chosen, the kept variant's runs with gradients are timed one in ``SAMPLE``."""
        if not torch.is_grad_enabled() or _ENGINE is None:
            self.note(variant, seconds, instances)
            return
        if variant == self.choice and not self.checking and self.calls % self.SAMPLE:
            return  # (its backward timed one run in SAMPLE: hooks cost ~3 us a tensor)
        tensors = _grad_tensors(results)
        if not tensors:
            self.note(variant, seconds, instances)
            return
        if len(tensors) > 4:  # autograd reaches the first made last and the last first
            tensors = tensors[:2] + tensors[-2:]
        pending: list = [variant, seconds, instances, None, []]

        def started(grad):
            if pending[3] is None and self.pending is pending:
                pending[3] = time.perf_counter()
                _ENGINE.queue_callback(finished)

        def finished():
            for handle in pending[4]:
                handle.remove()
            if self.pending is pending:
                self.pending = None
                self.note(variant, seconds + time.perf_counter() - pending[3], instances)

        pending[4] = [t.register_hook(started) for t in tensors]
        self.pending = pending

    def settle(self) -> None:
        """A run still waiting for its backward (none came: the results were not used in
        a loss, or not yet) is noted by its forward alone."""
        pending = self.pending
        if pending is not None:
            self.pending = None
            for handle in pending[4]:
                handle.remove()
            self.note(*pending[:3])

    def next(self) -> str:
        choice = self.choice
        if choice is None:
            return "map" if len(self.runs["map"]) <= len(self.runs["eager"]) else "eager"
        self.calls += 1
        if self.calls >= self.due and self.recent:
            self.checking = True
            return "eager" if choice == "map" else "map"
        return choice

    def note(self, variant: str, seconds: float, instances: int) -> None:
        t = seconds / instances
        if self.choice is None:
            self._trial(variant, t)
        elif variant == self.choice:
            self.recent.append(t)
            if len(self.recent) > self.WINDOW:
                del self.recent[0]
        elif self.checking:
            self._recheck(variant, t)

    def _trial(self, variant: str, t: float) -> None:
        runs = self.runs
        runs[variant].append(t)
        maps, loops = runs["map"][1:], runs["eager"][1:]
        if maps and runs["eager"] and not loops and maps[0] * self.CLEAR_FIRST < runs["eager"][0]:
            self._decide("map", maps[0], runs["eager"][0])
        elif maps and loops and min(maps) * self.CLEAR < min(loops):
            self._decide("map", min(maps), min(loops))
        elif len(maps) >= self.TRIALS and len(loops) >= self.TRIALS:
            if min(loops) < 0.9 * min(maps):
                self._decide("eager", min(loops), min(maps))
            else:
                self._decide("map", min(maps), min(loops))

    def _decide(self, choice: str, kept: float, other: float) -> None:
        self.choice = choice
        self.recent = [kept]
        self.period = self.RECHECK
        self._schedule(other / kept)

    def _schedule(self, ratio: float) -> None:
        self.ratio = max(ratio, 1.0)
        self.calls = 0
        self.due = int(self.period * self.ratio)

    def _recheck(self, variant: str, t: float) -> None:
        self.checking = False
        kept = min(self.recent)
        better = t < 0.9 * kept if variant == "eager" else t < kept
        if better:
            self._decide(variant, t, kept)
        else:
            self.period = min(2 * self.period, self.RECHECK_MAX)
            self._schedule(t / kept)


def _grad_tensors(results) -> list:
    """The tensors among a map's results (pytrees) that require grad."""
    return [
        t
        for t in torch.utils._pytree.tree_leaves(results)
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]


_ENGINE: Any
try:  # autograd's engine: queue_callback runs a function when the backward pass ends
    from torch.autograd.variable import Variable

    _ENGINE = Variable._execution_engine
    _ENGINE.queue_callback  # noqa: B018 - (it must exist)
except (ImportError, AttributeError):  # pragma: no cover - every torch this supports has it
    _ENGINE = None


class Autobatched:
    """A per-instance function with a batched ``map``. See :func:`autobatch`."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "f")
        functools.update_wrapper(self, fn)
        self._bound: weakref.WeakKeyDictionary | None = None  # object -> bound Autobatched
        # the torch functions with a stand-in that its maps have called (ops.fast_functions)
        self._calls: frozenset = frozenset()
        self._warned_objects = False  # the unbatched-objects warning, given once
        self._choices: dict = {}  # key -> _MapChoice (config.MAP_CHOICE)

    def __get__(self, obj, objtype=None):
        """On a method (``@acrobat.autobatch`` in a class body), ``model.encode`` is the
        function bound to ``model``, batched: ``model.encode.map(trees)``."""
        if obj is None:
            return self
        try:
            if self._bound is None:
                self._bound = weakref.WeakKeyDictionary()
            bound = self._bound.get(obj)
            if bound is None:
                bound = self._bound[obj] = Autobatched(types.MethodType(self.fn, obj))
            return bound
        except TypeError:  # not weakly referenceable (or unhashable): bound anew
            return Autobatched(types.MethodType(self.fn, obj))

    def __call__(self, *args, **kwargs):
        # Inside f.map this is the instance's own (possibly recursive) call; outside it is
        # the plain function.
        return self.fn(*args, **kwargs)

    def eager(self, *args, **kwargs):
        """Run the undecorated function on real tensors: the reference for ``map``."""
        if graph.RT is not None:
            raise AcrobatError(f"{self.__name__}.eager was called inside f.map")
        return self.fn(*args, **kwargs)

    def map(self, *iterables, stats: bool = False, **shared):
        """``[f(*args, **shared) for args in zip(*iterables)]``, computed batched.

        Per-instance arguments come positionally, one iterable each; arguments shared by
        every instance (the model) come as keywords. Returns real tensors in input order;
        with ``stats=True`` returns ``(results, acrobat.Stats)``.
        """
        global _LAST_STATS
        if not iterables:
            raise AcrobatError(
                f"{self.__name__}.map needs at least one iterable of per-instance arguments"
            )
        columns = []
        for k, it in enumerate(iterables):
            try:
                columns.append(list(it))
            except TypeError:
                raise AcrobatError(
                    f"{self.__name__}.map: positional argument {k} is a "
                    f"{type(it).__name__}, not an iterable of per-instance values; pass shared "
                    "arguments as keywords"
                ) from None
        lengths = [len(c) for c in columns]
        if len(set(lengths)) > 1:
            raise AcrobatError(
                f"{self.__name__}.map: per-instance iterables have different lengths {lengths}"
            )
        st = Stats()
        st.instances = lengths[0]
        _LAST_STATS = st
        if lengths[0] == 0:
            return ([], st) if stats else []
        choice = self._choice(lengths[0], shared) if config.MAP_CHOICE and not stats else None
        if choice is not None:
            choice.settle()
        if choice is not None and choice.next() == "eager":
            t0 = time.perf_counter()
            try:
                results = [self.fn(*args, **shared) for args in zip(*columns)]
            except Exception:  # the batched map raises it as acrobat does: naming the
                results = None  # instance, the op and the line
            if results is not None:
                choice.observe("eager", time.perf_counter() - t0, lengths[0], results)
                st.eager_loop = True
                return results
        t0 = time.perf_counter()
        if config.HOLD_MEMORY and not memory.held():
            memory.hold()  # freed buffers serve the next mini-batch (acrobat/memory.py)
        ops.MISSED.clear()
        try:
            with (
                analysis.auto_blocks(self.fn, shared),
                ops.fast_modules(),
                ops.fast_functions(self._calls),
            ):
                results = fibers.run_map(self.fn, list(zip(*columns)), shared, st, self.__name__)
        finally:
            if ops.MISSED:  # called without their stand-ins in place: in from the next map
                self._calls = self._calls | ops.MISSED
                ops.MISSED.clear()
        if choice is not None:
            choice.observe("map", time.perf_counter() - t0, lengths[0], results)
        if st.nodes == 0 and not self._warned_objects:
            found = objects.attributes_with_tensors([tuple(c[0] for c in columns)])
            if found:
                where = ", ".join(sorted(f"{cls.__name__}.{name}" for cls, name in found))
                self._warned_objects = True
                warnings.warn(
                    f"{self.__name__}.map batched nothing: instance 0's tensors are attributes "
                    f"of objects ({where}), which acrobat does not treat as per-instance "
                    "inputs, so their ops ran one instance at a time. Pass the tensors in "
                    "tuples, lists, dicts or namedtuples (or as arguments) to batch them.",
                    AcrobatWarning,
                    stacklevel=2,
                )
        return (results, st) if stats else results

    def _choice(self, n: int, shared: dict) -> _MapChoice | None:
        """The choice for a map of ``n`` instances with ``shared`` arguments: keyed by the
        batch size's power of two, the grad mode and the modules passed (not inside
        another map, where the function is the instance's own call)."""
        if graph.RT is not None:
            return None
        key = (
            n.bit_length(),
            torch.is_grad_enabled(),
            tuple((k, id(v)) for k, v in shared.items() if isinstance(v, torch.nn.Module)),
        )
        found = self._choices.get(key)
        if found is None:
            if len(self._choices) > 64:  # (modules made anew every call: keys that never repeat)
                self._choices.clear()
            found = self._choices[key] = _MapChoice()
        return found


def autobatch(fn) -> Autobatched:
    """Decorate a per-instance forward function so it can run a mini-batch batched.

    >>> @acrobat.autobatch
    ... def encode(tree, model):
    ...     if tree.is_leaf:
    ...         return model.leaf(model.emb(torch.tensor(tree.word_id)))
    ...     return model.node(encode(tree.left, model), encode(tree.right, model))
    >>> outs = encode.map(trees, model=model)            # doctest: +SKIP
    >>> refs = [encode.eager(t, model=model) for t in trees]   # doctest: +SKIP
    """
    if isinstance(fn, Autobatched):
        return fn
    return Autobatched(fn)


@contextlib.contextmanager
def phase(name: str):
    """Mark a program phase: inside ``f.map``, the nodes of a phase run only after every
    instance has finished the previous one, and depth restarts in it, so e.g. all per-token
    classifiers of a BiRNN form one batch. Outside ``f.map`` it does nothing."""
    rt = graph.RT
    fiber = rt.fiber if rt is not None and rt.tracer is None else None
    if fiber is None:
        yield
        return
    assert rt is not None  # (a fiber runs)
    rt.phased = True
    fiber.phase += 1
    try:
        yield
    finally:
        fiber.phase += 1


def stats() -> Stats | None:
    """Counters and timings of the most recent ``f.map`` call (None before the first)."""
    return _LAST_STATS


fork = fibers.fork
concurrent = fibers.concurrent
