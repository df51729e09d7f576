"""Bad input gets a clear error that names the op, the instance and the user's line, and
one failing instance never corrupts another's result (or the next map call)."""

import gc

import greenlet
import pytest
import torch

import acrobat
from tests.helpers import check_map

W = torch.randn(4, 4)


@acrobat.autobatch
def good(x):
    return torch.tanh(x @ W)


def test_unsupported_function_names_function_and_line():
    @acrobat.autobatch
    def f(x):
        return torch.fft.fft(x)  # unsupported-op-line

    off = acrobat.config.override(GENERIC_VMAP=False)  # (else a generic vmap row)
    with off, pytest.raises(acrobat.UnsupportedOpError) as err:
        f.map([torch.randn(4), torch.randn(4)])
    msg = str(err.value)
    assert "fft" in msg
    assert "test_errors.py" in msg and "unsupported-op-line" in msg
    check_map(good, [torch.randn(4) for _ in range(3)])  # map usable afterwards


def test_a_random_function_without_a_row_stays_unsupported():
    """The generic vmap rows leave out random draws (a batch would draw other numbers
    than the eager loop): torch.rrelu in training on a lazy tensor raises, naming the line."""

    @acrobat.autobatch
    def f(x):
        return torch.rrelu(x, training=True)  # random-op-line

    with pytest.raises(acrobat.UnsupportedOpError, match="random-op-line"):
        f.map([torch.randn(4), torch.randn(4)])


@pytest.mark.parametrize("call", ["function", "keyword"])
def test_where_of_a_condition_alone_is_nonzero_as_eager(call):
    """torch.where(c) is nonzero(c, as_tuple=True): sized by the values, which each
    instance reads first (it was once batched as the elementwise form: wrong indices)."""

    @acrobat.autobatch
    def f(x):
        if call == "function":
            return torch.where(x > 0)
        return torch.where(condition=x > 0)

    got = check_map(f, [torch.tensor([1.0, -1.0, 3.0]), torch.tensor([-1.0, 2.0, 0.5])])
    assert got.suspensions >= 2  # every instance read its condition

    @acrobat.autobatch
    def three(x):
        return torch.where(x > 0, x, -x), x.where(x > 0, 0.0)

    check_map(three, [torch.randn(4) for _ in range(3)])


def test_unsupported_method_suggests_nearby_ops():
    @acrobat.autobatch
    def f(x):
        return torch.logcumsumexp(x, 0)

    off = acrobat.config.override(GENERIC_VMAP=False)  # (else a generic vmap row)
    with off, pytest.raises(acrobat.UnsupportedOpError, match=r"logcumsumexp.*logsumexp"):
        f.map([torch.randn(4)])


def test_shape_mismatch_names_instance_and_line_at_record_time():
    @acrobat.autobatch
    def f(x):
        return x @ W  # shape-mismatch-line

    xs = [torch.randn(4), torch.randn(4), torch.randn(5)]
    with pytest.raises(acrobat.ShapeError) as err:
        f.map(xs)
    msg = str(err.value)
    assert "instance 2" in msg and "shape-mismatch-line" in msg and "matmul" in msg


def test_instance_exception_is_reraised_with_instance_and_others_cleaned_up():
    class Boom(Exception):
        pass

    @acrobat.autobatch
    def f(x, k):
        y = torch.sigmoid(x)
        if k == 3:
            raise Boom("bad instance")
        return y

    with pytest.raises(Boom) as err:
        f.map([torch.randn(2) for _ in range(5)], range(5))
    assert any("instance 3" in note for note in getattr(err.value, "__notes__", []))
    gc.collect()
    # no fiber survives the failed call: every live greenlet but the current one is an idle
    # worker parked in the pool (not holding any instance's frames)
    from acrobat.fibers import _pool

    live = [o for o in gc.get_objects() if type(o) is greenlet.greenlet and o and not o.dead]
    parked = {id(g) for g in _pool()}
    assert all(id(g) in parked for g in live if g is not greenlet.getcurrent())
    check_map(good, [torch.randn(4) for _ in range(4)])


def test_map_argument_errors():
    with pytest.raises(acrobat.AcrobatError, match="different lengths"):
        good.map([torch.randn(4)] * 3, [1, 2])
    with pytest.raises(acrobat.AcrobatError, match="at least one iterable"):
        good.map()
    with pytest.raises(acrobat.AcrobatError, match="not an iterable"):
        good.map(5)
    assert good.map([]) == []


def test_return_types():
    @acrobat.autobatch
    def pytree(x):
        return {"a": torch.sigmoid(x), "b": [x.sum(), 3, None], "c": (1.5, "s")}

    check_map(pytree, [torch.randn(3) for _ in range(3)])

    @acrobat.autobatch
    def values(x):  # values that hold no tensor, as eager returns them
        y = torch.tanh(x)
        return y, y.shape, y.dtype, y.device, {int(x.argmax()), 7}, frozenset({"w"}), b"b"

    xs = [torch.randn(3), torch.randn(2, 2)]
    for got, x in zip(values.map(xs), xs):
        want = values.fn(x)
        torch.testing.assert_close(got[0], want[0])
        assert got[1:] == want[1:] and type(got[1]) is torch.Size

    @acrobat.autobatch
    def bad(x):
        return object()

    with pytest.raises(acrobat.AcrobatError, match=r"instance 0 .*returned a object"):
        bad.map([torch.randn(2)])


def test_lazy_escaping_map_errors_on_use():
    stash = []

    @acrobat.autobatch
    def leak(x):
        y = torch.tanh(x)
        stash.append(y)
        return y

    leak.map([torch.randn(2)])
    escaped = stash[0]
    with pytest.raises(acrobat.LazyValueError, match=r"outside f.map"):
        torch.sigmoid(escaped)
    with pytest.raises(acrobat.LazyValueError):
        escaped + 1
    with pytest.raises(acrobat.LazyValueError):
        escaped.tolist()

    @acrobat.autobatch
    def reuse(x):
        return x + escaped

    with pytest.raises(acrobat.LazyValueError, match=r"another f.map"):
        reuse.map([torch.randn(2)])


def test_inplace_update_of_an_input_is_refused():
    """(``y += 1`` on a fresh result is recorded: tests/test_in_place.py.)"""

    @acrobat.autobatch
    def f(x):
        x += 1
        return x

    with pytest.raises(acrobat.UnsupportedOpError, match=r"x = x \+ y"):
        f.map([torch.randn(2)])


def test_batched_runtime_failure_names_instance():
    emb = torch.nn.Embedding(5, 3)

    @acrobat.autobatch
    def f(i):
        return emb(i)

    idx = [torch.tensor(1), torch.tensor(9), torch.tensor(2)]
    with pytest.raises(acrobat.AcrobatError, match="instance 1"):
        f.map(idx)


def one_hot_twice(t):  # a straight-line function: an automatic block
    return torch.nn.functional.one_hot(t, 5).float() * 2


def one_hot_keywords(t):  # (its tensor given by keyword)
    return torch.nn.functional.one_hot(input=t, num_classes=5).float() * 2


def one_hot_read(t):  # a value read after it: the op recorded alone
    y = torch.nn.functional.one_hot(t, 5)
    return y * 2 if int(t[0]) > 0 else y


@pytest.mark.parametrize("bad, why", [(5, "smaller than num_classes"), (-1, "non-negative")])
@pytest.mark.parametrize("f", [one_hot_twice, one_hot_keywords, one_hot_read])
def test_one_hot_class_out_of_range_names_instance(bad, why, f):
    """torch.vmap's one_hot checks no value (a class out of range was a row of zeros, where
    eager raises): the batch is one F.one_hot call, which raises eager's error."""
    xs = [torch.tensor([1, 2]), torch.tensor([4, bad]), torch.tensor([0, 3])]
    with pytest.raises(RuntimeError, match=why):
        f(xs[1])
    g = acrobat.autobatch(f)
    with pytest.raises(acrobat.AcrobatError, match=f"instance 1: Class values must be {why}"):
        g.map(xs)
    stats = check_map(g, [xs[0], xs[2], torch.tensor([4, 0, 1])])
    blocks = [op for op in stats.by_op if op.startswith("block:")]
    assert bool(blocks) == (f is not one_hot_read), stats.by_op


INDEXED = {  # (x: 6 numbers, i: 2 per-instance indices into them)
    "gather": lambda x, i: x.gather(0, i),
    "index_select": lambda x, i: x.index_select(0, i),
    "take": lambda x, i: torch.take(x, i),
    "getitem": lambda x, i: x[i] * 2,
    "getitem_2d": lambda x, i: x.reshape(2, 3)[0, i % 4],
    "embedding": lambda x, i: torch.nn.functional.embedding(i, W.T.repeat(2, 1)[:6]) * x[0],
    "scatter": lambda x, i: torch.zeros(6).scatter(0, i, x[:2]),
    "scatter_add": lambda x, i: torch.zeros(6).scatter_add(0, i, x[:2]),
    "index_add": lambda x, i: torch.zeros(6).index_add(0, i, x[:2]),
    "index_put": lambda x, i: torch.zeros(6).index_put((i,), x[:2]),
    "index_copy": lambda x, i: torch.zeros(6).index_copy(0, i, x[:2]),
    "index_fill": lambda x, i: x.index_fill(0, i, 0.0),
    "cross_entropy": lambda x, i: torch.nn.functional.cross_entropy(x.reshape(2, 3), i % 4),
    "one_hot": lambda x, i: torch.nn.functional.one_hot(i, 6) * x[0],
}


@pytest.mark.parametrize("bad", [7, -9])
@pytest.mark.parametrize("name", sorted(INDEXED))
def test_indices_out_of_range_raise_as_eager(name, bad):
    """A per-instance index out of range raises in the map where the eager call raises,
    naming the instance (none reads another instance's rows or is silently dropped: the
    batched rules lay the rows end to end, and torch.vmap's index_fill and one_hot check
    no value); in range, the map equals the eager loop."""
    fn = INDEXED[name]
    g = torch.Generator().manual_seed(bad)
    xs = [torch.randn(6, generator=g) for _ in range(3)]
    good = [torch.tensor([0, 1]), torch.tensor([2, 1]), torch.tensor([1, 0])]
    with pytest.raises((IndexError, RuntimeError)):
        fn(xs[1], torch.tensor([1, bad]))
    f = acrobat.autobatch(lambda x, i: fn(x, i))
    with pytest.raises((IndexError, RuntimeError), match="instance 1"):
        f.map(xs, [good[0], torch.tensor([1, bad]), good[2]])
    got = f.map(xs, good)
    for x, i, y in zip(xs, good, got):
        torch.testing.assert_close(y, fn(x, i))


def test_take_out_of_range_is_caught_at_record_time():
    table = torch.randn(5, 3)

    @acrobat.autobatch
    def f(i):
        return table[i] * 2  # take-line

    with pytest.raises(IndexError, match=r"instance 2.*take-line"):
        f.map([0, 4, 7])


def test_recursion_limit_gives_clear_error():
    import sys

    @acrobat.autobatch
    def deep(x, n):
        return x if n == 0 else deep(x + 1, n - 1)

    limit = sys.getrecursionlimit()
    with pytest.raises(acrobat.AcrobatError, match="recursion limit"):
        deep.map([torch.zeros(1)], [limit + 100])
    check_map(good, [torch.randn(4)])


def test_nested_map_is_refused():
    @acrobat.autobatch
    def outer(x):
        return good.map([x])

    with pytest.raises(acrobat.AcrobatError, match=r"inside another f.map"):
        outer.map([torch.randn(4)])


def test_concurrent_map_from_another_thread_is_refused():
    import threading

    started, release = threading.Event(), threading.Event()

    @acrobat.autobatch
    def slow(x):
        started.set()
        release.wait(5)
        return x + 1

    errors = []

    def other():
        started.wait(5)
        try:
            good.map([torch.randn(4)])
        except acrobat.AcrobatError as exc:
            errors.append(str(exc))
        finally:
            release.set()

    t = threading.Thread(target=other)
    t.start()
    slow.map([torch.randn(2)])
    t.join()
    assert errors and "another thread" in errors[0]


def test_in_place_write_into_a_shared_constant_is_an_error():
    @acrobat.autobatch
    def f(x, i):
        mask = torch.zeros(4)  # constant: made once and shared by all instances
        y = x * mask  # read by a recorded op, which runs later
        alias = mask  # (another name for it: analysis leaves its writes as written)
        alias[i] = 1.0  # an in-place write would leak into y and the other instances
        return y + mask

    with pytest.raises(acrobat.AcrobatError, match=r"modified in place \(at .*alias\[i\] = 1.0"):
        f.map([torch.randn(4) for _ in range(3)], [0, 1, 2])  # (the write's line named)

    @acrobat.autobatch
    def h(x, i):
        mask = torch.zeros(4)
        y = x * mask
        mask[i] = 1.0  # a local the function owns: rewritten, the instance's own copy
        return y + mask

    xs = [torch.randn(4) for _ in range(3)]
    for out, x, i in zip(h.map(xs, [0, 1, 2]), xs, [0, 1, 2]):
        torch.testing.assert_close(out, h.eager(x, i))

    @acrobat.autobatch
    def g(x, i):  # the functional way works
        mask = torch.tensor([1.0 if k == i else 0.0 for k in range(4)])
        return x * mask

    check_map_pairs = [torch.randn(4) for _ in range(3)]
    got = g.map(check_map_pairs, [0, 1, 2])
    for out, x, i in zip(got, check_map_pairs, [0, 1, 2]):
        torch.testing.assert_close(out, g.eager(x, i))


def test_gradients_inside_an_instance_say_how_to_take_them():
    @acrobat.autobatch
    def f(x):
        x = x.clone().requires_grad_()
        return torch.autograd.grad((x * x).sum(), x)[0]

    with pytest.raises(acrobat.UnsupportedOpError, match="take gradients of its outputs"):
        f.map([torch.randn(3), torch.randn(3)])
    # the way it says: inputs that require grad, gradients of the map's outputs
    g = acrobat.autobatch(lambda x: (x * x).sum())
    xs = [torch.randn(3, requires_grad=True) for _ in range(3)]
    grads = torch.autograd.grad(torch.stack(g.map(xs)).sum(), xs)
    for x, grad in zip(xs, grads):
        torch.testing.assert_close(grad, 2 * x.detach())
