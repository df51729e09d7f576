"""The user API: ``autobatch`` (with ``.map`` and ``.eager``), ``block``, ``phase``,
``fork``/``concurrent`` and ``stats``. Thin: it wires the stages together."""

from __future__ import annotations

import contextlib
import functools
import time
import types
import warnings
import weakref

import torch

from acrobat import analysis, config, fibers, graph, memory, objects, ops
from acrobat.errors import AcrobatError, AcrobatWarning
from acrobat.stats import Stats

_LAST_STATS: Stats | None = None


class _MapChoice:
    """The online choice between the batched map and the eager loop for one key of a
    function (config.MAP_CHOICE; Astra's work-conserving trials): the two alternate, the
    batched map first, until each has run ``TRIALS`` times after an untimed first run
    (traces, kernels, caches); then the faster by its best time per instance, the eager
    loop only if 10% faster."""

    TRIALS = 2

    __slots__ = ("runs", "choice")

    def __init__(self):
        self.runs: dict[str, list[float]] = {"map": [], "eager": []}
        self.choice: str | None = None

    def next(self) -> str:
        if self.choice is not None:
            return self.choice
        return "map" if len(self.runs["map"]) <= len(self.runs["eager"]) else "eager"

    def note(self, variant: str, seconds: float, instances: int) -> None:
        if self.choice is not None:
            return
        runs = self.runs[variant]
        runs.append(seconds / instances)
        if all(len(r) > self.TRIALS for r in self.runs.values()):
            best = {k: min(r[1:]) for k, r in self.runs.items()}
            self.choice = "eager" if best["eager"] < 0.9 * best["map"] else "map"


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
        if choice is not None and choice.next() == "eager":
            t0 = time.perf_counter()
            try:
                results = [self.fn(*args, **shared) for args in zip(*columns)]
            except Exception:  # the batched map raises it as acrobat does: naming the
                results = None  # instance, the op and the line
            if results is not None:
                choice.note("eager", time.perf_counter() - t0, lengths[0])
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
            choice.note("map", time.perf_counter() - t0, lengths[0])
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
