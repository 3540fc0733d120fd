"""Reliability: threads, bounded caches, pickling, globals, exceptions and lifetimes behave
as plain PyTorch does. The oracle is the same code without remat."""

from __future__ import annotations

import collections
import copy
import gc
import io
import pickle
import threading
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.fx._symbolic_trace import is_fx_tracing

from remat import (
    RematError,
    RematRetraceWarning,
    RematStateWarning,
    RematTraceError,
    checkpoint_layers,
    clear_cache,
    remat,
    saved_residuals,
)
from remat import policies as P

from conftest import assert_close

D = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning")


def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ w).tanh() @ w.t()


def _global_state() -> tuple[Any, ...]:
    return (
        torch.is_grad_enabled(),
        is_fx_tracing(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch._C._functorch.peek_interpreter_stack() is None,
        torch.get_rng_state(),
    )


def _same_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[:-1] == b[:-1] and torch.equal(a[-1], b[-1])


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


class _Failing(Exception):
    """An exception the user's own code raises."""


def test_many_threads_many_shapes_and_exceptions() -> None:
    """8 threads call fresh wrappers of one function (first calls concurrent), over 6
    shapes, some calls raising in forward and some in backward; every result equals
    eager, the module's parameters stay themselves, and memory and torch's global state
    return to where they were. (The workers hold the parameters themselves: while a trace
    runs, the module's attributes are stand-ins; see the README.)"""
    layer = torch.nn.Linear(6, 6, dtype=D)
    parameters = {name: p for name, p in layer.named_parameters()}
    weight, bias = layer.weight, layer.bias
    fails = torch.zeros((), dtype=D)  # a closed-over tensor the function branches on only through data

    def fn(x: torch.Tensor, fail: str) -> torch.Tensor:
        if fail == "forward":
            raise _Failing("raised in forward")
        y = F.gelu(layer(x)) * (1 + fails)
        if fail == "backward":
            y = y + _raises_in_backward_op(y) * 0
        return y.pow(2).sum()

    def eager(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = x.detach().requires_grad_()
        out = F.gelu(layer(x)).pow(2).sum()
        return (out.detach(), *torch.autograd.grad(out, [x, layer.weight, layer.bias]))

    shapes = [(n, 6) for n in (1, 2, 3, 5, 8, 13)]
    inputs = {shape: torch.randn(shape, dtype=D) for shape in shapes}
    expected = {shape: eager(x) for shape, x in inputs.items()}
    state, live, rss = _global_state(), _live_tensors(), _rss_mib()
    errors: list[BaseException] = []
    mismatches: list[str] = []
    start = threading.Barrier(8)

    def worker(seed: int) -> None:
        start.wait()  # every first call at once
        for i in range(15):
            shape = shapes[(seed + i) % len(shapes)]
            fail = ("forward", "backward", "none", "none", "none")[(seed * 7 + i) % 5]
            wrapped = remat(fn, policy=(P.dots_saveable, P.nothing_saveable)[i % 2], static_argnums=1)
            x = inputs[shape].detach().requires_grad_()
            try:
                out = wrapped(x, fail)
                grads = torch.autograd.grad(out, [x, weight, bias])
            except _Failing as error:
                assert fail != "none", error
                continue
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)
                continue
            try:
                assert_close((out.detach(), *grads), expected[shape])
            except AssertionError as error:
                mismatches.append(f"{shape} {fail}: {error}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert not mismatches, mismatches[:3]
    assert dict(layer.named_parameters()) == parameters  # the very same objects
    assert _same_state(_global_state(), state)
    del threads
    clear_cache(fn)
    leftover = [type(o).__name__ for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    assert _live_tensors() <= live + 10, collections.Counter(leftover).most_common(5)
    assert _rss_mib() < rss + 200


@torch.library.custom_op("remat_reliability::raises_in_backward", mutates_args=())
def _raises_in_backward_op(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_raises_in_backward_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _backward_raises(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    raise _Failing("raised in backward")


_raises_in_backward_op.register_autograd(_backward_raises)


def test_an_exception_in_backward_leaves_everything_usable() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (_raises_in_backward_op(x) * x).sum()

    x = torch.randn(4, dtype=D, requires_grad=True)
    state = _global_state()
    for f in (fn, remat(fn)):
        with pytest.raises(_Failing, match="raised in backward"):
            f(x).backward()
    assert _same_state(_global_state(), state)
    assert_close(torch.autograd.grad(remat(block)(x[None], torch.eye(4, dtype=D)).sum(), x)[0].shape, torch.Size([4]))


def scaled_block(x: torch.Tensor, w: torch.Tensor, scale: int) -> torch.Tensor:
    return block(x, w) * scale


def test_the_plan_cache_is_bounded_and_retracing_warns_naming_what_changed() -> None:
    clear_cache(scaled_block)  # plans are per function: other tests' calls share them
    f = remat(scaled_block, cache_size=4, static_argnums=2)
    x, w = torch.randn(4, 3, dtype=D), torch.randn(3, 3, dtype=D, requires_grad=True)
    with pytest.warns(RematRetraceWarning, match=r"traced 8 times.*argument scale: 7 -> 8"):
        for scale in range(1, 9):  # a static value: each one a trace (sizes would share a template)
            f(x, w, scale).sum().backward()
    assert f.cache_info() == {"hits": 0, "traces": 8, "specialized": 0, "like": 0, "replays": 0, "size": 4, "maxsize": 4}
    f(x, w, 8)  # among the 4 most recent: a hit
    f(x, w, 1)  # evicted: traced again
    assert f.cache_info()["hits"] == 1 and f.cache_info()["traces"] == 9
    clear_cache()
    assert f.cache_info()["size"] == 0
    with pytest.raises(ValueError, match="cache_size"):
        remat(block, cache_size=0)


@pytest.mark.filterwarnings("ignore::remat.RematRetraceWarning")  # twelve lengths, on purpose
def test_traces_leave_a_bounded_number_of_entries_in_torchs_fake_tensor_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Traces use torch's process-wide fake-tensor dispatch cache (faster tracing), which
    nothing bounds; remat drops its oldest entries beyond a limit, and only its own."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import remat._core.torch_internals as internals

    monkeypatch.setattr(internals, "FAKE_CACHE_ENTRIES", 40)
    monkeypatch.setattr(internals, "_FAKE_CACHE_KEYS", collections.deque())
    sentinel = object()
    FakeTensorMode.cache[sentinel] = sentinel  # type: ignore[index]  # an entry of someone else's
    try:
        before = len(FakeTensorMode.cache)
        w = torch.randn(3, 3, dtype=D, requires_grad=True)
        f = remat(block, cache_size=2)
        added = []
        for n in range(1, 13):  # every length a new trace, each adding entries
            x = torch.randn(n, 3, dtype=D, requires_grad=True)
            assert_close(torch.autograd.grad(f(x, w).sum(), (x, w)), torch.autograd.grad(block(x, w).sum(), (x, w)))
            added.append(len(FakeTensorMode.cache) - before)
        assert max(added) > 0 and added[-1] <= 40  # it filled the cache, up to the bound
        assert len(internals._FAKE_CACHE_KEYS) == added[-1]
        assert FakeTensorMode.cache.get(sentinel) is sentinel  # never dropped: not remat's
        clear_cache()  # drops remat's entries too, only those
        assert len(FakeTensorMode.cache) == before and FakeTensorMode.cache.get(sentinel) is sentinel
    finally:
        FakeTensorMode.cache.pop(sentinel, None)  # type: ignore[call-overload]


def test_pickling_a_model_prepared_with_checkpoint_layers_after_a_call() -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4, dtype=D) for _ in range(3)))
    checkpoint_layers(model, P.dots_saveable)
    x = torch.randn(2, 4, dtype=D)
    model(x).sum().backward()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded[0].forward.cache_info()["traces"] == 0  # plans are a cache: rebuilt on first call
    assert_close(loaded(x), model(x))
    loaded(x).sum().backward()
    assert all(p.grad is not None for p in loaded.parameters())
    assert_close(copy.deepcopy(model)(x), model(x))
    wrapped = pickle.loads(pickle.dumps(remat(block, policy=P.dots_saveable)))
    w = torch.randn(4, 4, dtype=D)
    assert_close(wrapped(x, w), block(x, w))


def test_user_exceptions_come_out_unchanged_with_a_note() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the user's message")

    with pytest.raises(ValueError, match="the user's message") as info:
        remat(fn)(torch.randn(2, requires_grad=True))
    assert any("remat traced `" in note for note in getattr(info.value, "__notes__", []))
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        remat(block)(torch.randn(2, 2, requires_grad=True))
    with pytest.raises(TypeError, match="argument n is a list"):
        remat(lambda x, n: x * len(n), static_argnums=1)(torch.randn(2, requires_grad=True), [1, 2])
    assert issubclass(RematTraceError, RematError)


def test_kept_values_are_freed_with_their_graph() -> None:
    """No backward ever runs: what autograd keeps dies with the outputs, as in eager."""
    f = remat(lambda x: x.exp().sin().cos(), policy=P.everything_saveable)
    x = torch.randn(50, dtype=D, requires_grad=True)
    for _ in range(2):
        out = f(x)
        # storages' weak references (a private torch API, torch 2.13): a tensor's Python
        # object is rebuilt on every access, its storage is what autograd holds
        kept = [t.untyped_storage()._weak_ref() for t in out.grad_fn.saved_tensors if t.data_ptr() != x.data_ptr()]
        assert kept
        del out
        gc.collect()
        assert all(torch.UntypedStorage._expired(weak) for weak in kept)


def test_torch_autograd_grad_inside_a_region() -> None:
    """A gradient penalty: the region differentiates inside, remat differentiates that."""
    def penalty(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x @ w).pow(3).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        return g.pow(2).sum()

    x, w = torch.randn(3, 4, dtype=D, requires_grad=True), torch.randn(4, 4, dtype=D, requires_grad=True)
    for policy in (None, P.everything_saveable, P.dots_saveable):
        actual = remat(penalty, policy=policy)(x, w)
        assert_close((actual, *torch.autograd.grad(actual, (x, w))), (e := penalty(x, w), *torch.autograd.grad(e, (x, w))))


def test_updating_a_nonlocal_does_not_retrace_and_says_so() -> None:
    def make() -> Callable[[torch.Tensor], torch.Tensor]:
        calls = 0

        def counted(x: torch.Tensor) -> torch.Tensor:
            nonlocal calls
            calls += 1
            return x.sin()

        return counted

    with pytest.warns(RematStateWarning, match="assigns `calls`"):
        f = remat(make())
        x = torch.randn(3, dtype=D, requires_grad=True)
        for _ in range(10):
            f(x)
    assert f.cache_info()["traces"] == 1


def _aux_outputs(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Outputs computed from other outputs: a view, a chain of two, a shared intermediate."""
    h = F.layer_norm(x, x.shape[-1:])
    y1 = torch.tanh(h @ w)
    y2 = y1.sin() * h  # h is read by both parts
    return y1, y2, (y2.cos() @ w).sum(-1), y1.t()


@pytest.mark.parametrize("policy", [None, P.everything_saveable, P.dots_saveable], ids=["none", "everything", "dots"])
def test_an_output_differentiated_with_respect_to_another(policy: Any) -> None:
    """torch.autograd.grad(z, y) where z is computed from y and both come out of the region."""
    x, w = torch.randn(3, 4, dtype=D, requires_grad=True), torch.randn(4, 4, dtype=D, requires_grad=True)

    def gradients(f: Callable[..., Any]) -> list[torch.Tensor]:
        y1, y2, z, y1t = f(x, w)
        found = list(torch.autograd.grad(z.sum() + y1t.pow(2).sum(), (y1, y2, x, w), retain_graph=True))
        found += torch.autograd.grad(y2.sum(), (y1, x))
        return found

    assert_close(gradients(remat(_aux_outputs, policy=policy)), gradients(_aux_outputs))
    cotangents = [torch.randn_like(t) for t in _aux_outputs(x, w)]
    assert_close(
        torch.func.vjp(remat(_aux_outputs, policy=policy), x, w)[1](tuple(cotangents)),
        torch.func.vjp(_aux_outputs, x, w)[1](tuple(cotangents)),
    )

    def loss(f: Callable[..., Any]) -> Callable[..., torch.Tensor]:
        return lambda x, w: sum(t.sum() * (k + 1) for k, t in enumerate(f(x, w)))

    per_sample = torch.func.vmap(torch.func.grad(loss(remat(_aux_outputs, policy=policy)), argnums=1), in_dims=(0, None))
    expected = torch.func.vmap(torch.func.grad(loss(_aux_outputs), argnums=1), in_dims=(0, None))
    assert_close(per_sample(x.detach().unsqueeze(1), w), expected(x.detach().unsqueeze(1), w))


def _norm_after_an_output(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The second part reads layer_norm's output only; a policy may keep its mean and rstd,
    which autograd does not track."""
    v = F.silu(y)
    return v + F.layer_norm(x, x.shape[-1:]), v


@pytest.mark.parametrize("policy", [None, P.everything_saveable, P.memory_budget(0.5)], ids=["none", "everything", "budget"])
def test_a_gradient_of_a_gradient_through_outputs_feeding_outputs(policy: Any) -> None:
    """Second order through a region run as two autograd nodes, under autograd and
    torch.func: a kept value autograd does not track stays untracked in either part."""
    x, y, t = (torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(k)) for k in range(3))

    def autograd_twice(f: Callable[..., Any]) -> tuple[torch.Tensor, ...]:
        a, b = x.clone().requires_grad_(), y.clone().requires_grad_()
        (g,) = torch.autograd.grad((f(a, b)[0] * t).sum(), a, create_graph=True)
        return torch.autograd.grad((g * t).sum(), (a, b), materialize_grads=True)  # b: unused, zeros

    def func_twice(f: Callable[..., Any]) -> tuple[torch.Tensor, ...]:
        first = torch.func.grad(lambda a, b: (f(a, b)[0] * t).sum())
        return torch.func.grad(lambda a, b: (first(a, b) * t).sum(), argnums=(0, 1))(x, y)  # type: ignore[no-any-return]

    region = remat(_norm_after_an_output, policy=policy)
    assert_close(autograd_twice(region), autograd_twice(_norm_after_an_output))
    assert_close(func_twice(region), func_twice(_norm_after_an_output))


def test_outputs_feeding_outputs_with_dropout_and_running_statistics() -> None:
    """Each draw once and in eager's order, running statistics updated once."""
    def f(x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = F.dropout(F.batch_norm(x, mean, var, training=True) @ w, 0.5)
        return y, F.dropout(y.tanh(), 0.3)

    x, w = torch.randn(6, 4, dtype=D, requires_grad=True), torch.randn(4, 4, dtype=D, requires_grad=True)
    results = []
    for g in (f, remat(f, policy=P.dots_saveable)):
        stats = (torch.zeros(4, dtype=D), torch.ones(4, dtype=D))
        torch.manual_seed(0)
        y, z = g(x, w, *stats)
        results.append([y, z, *torch.autograd.grad(z.sum(), (y, x, w)), *stats, torch.rand(3)])
    assert_close(results[1], results[0])


def test_a_kept_output_is_reported_by_the_part_that_keeps_it() -> None:
    """Under nothing_saveable the rest keeps `y` (its backward needs it), and says so."""
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.exp()
        return y, y.sin()

    kept = saved_residuals(remat(f, policy=P.nothing_saveable), torch.randn(5, dtype=D))
    assert sorted(r.source or "" for r in kept if r.kind == "input") == ["output 0 of the region", "x"]


def test_outputs_whose_split_would_reorder_random_draws_run_replayed() -> None:
    """A draw for `z` comes before the draw for `y`: splitting would swap them, and one
    autograd node would hide that `z` is computed from `y` (a gradient with respect to `y`,
    its hooks and retain_grad would miss `z`'s part, silently). Outside torch.func the
    region runs replayed, saying why: every gradient, `y`'s included, as without remat.
    Under a transform, where no gradient is taken with respect to an output, it stays one
    traced node, exact."""
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask_for_z = F.dropout(x, 0.5)
        y = F.dropout(x.sin(), 0.5)
        return y, (y * mask_for_z).sum()

    x = torch.randn(8, dtype=D, requires_grad=True)
    region = remat(f)
    results = []
    for g in (f, region):
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y, z = g(x)
        assert (g is region) == any("random numbers in another order" in str(w.message) for w in caught)
        y.retain_grad()
        seen: list[torch.Tensor] = []
        y.register_hook(seen.append)
        (y.sum() + z).backward(retain_graph=True)
        results.append([y, z, y.grad, seen[0], x.grad, *torch.autograd.grad(z, (y, x)), torch.rand(3)])
        x.grad = None
    assert_close(results[1], results[0], rtol=0, atol=0)
    assert region.cache_info()["replays"] == 1

    def loss(x: torch.Tensor, g: Any) -> tuple[torch.Tensor, torch.Tensor]:
        y, z = g(x)
        return y.pow(2).sum() + z, y

    under_grad = []
    for g in (f, region):
        torch.manual_seed(0)
        under_grad.append([*torch.func.grad(loss, has_aux=True)(x.detach(), g), torch.rand(3)])
    assert_close(under_grad[1], under_grad[0], rtol=0, atol=0)
    assert region.cache_info()["replays"] == 1  # traced under the transform


def test_outputs_feeding_outputs_in_a_region_that_reseeds_run_replayed() -> None:
    """A region that reseeds stays one graph (one forward graph replays the reseeding), so
    with an output computed from another it runs replayed: `y`'s gradient, the outputs and
    the random stream after it as without remat."""
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(3)
        y = F.dropout(x.sin(), 0.5)
        return y, (y * y).sum()

    x = torch.randn(8, dtype=D, requires_grad=True)
    region = remat(f)
    results = []
    for g in (f, region):
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y, z = g(x)
        assert (g is region) == any("reseeds a generator" in str(w.message) for w in caught)
        results.append([y, z, *torch.autograd.grad(y.sum() + z, (y, x)), torch.rand(3)])
    assert_close(results[1], results[0], rtol=0, atol=0)


def test_a_region_whose_outputs_do_not_feed_each_other_is_one_autograd_node() -> None:
    """Only outputs that others are computed from split a region (autograd saving an
    output makes a dead `detach` of it in the trace, which does not count)."""
    x, w = torch.randn(3, 4, dtype=D, requires_grad=True), torch.randn(4, 4, dtype=D, requires_grad=True)
    for f in (lambda x, w: torch.tanh(x @ w), lambda x, w: (torch.tanh(x @ w), torch.sigmoid(x @ w))):
        wrapped = remat(f)
        out = wrapped(x, w)
        assert len({t.grad_fn for t in (out if isinstance(out, tuple) else (out,))}) == 1
        assert [type(plan).__name__ for plan in wrapped._plans.plans.values()] == ["Plan"]  # not a Chain


def test_an_unread_draw_keeps_a_region_whole() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch.rand(4)  # drawn, never read: eager still moves the stream
        y = x.exp()
        return y, y.sin()

    x = torch.randn(4, dtype=D, requires_grad=True)
    results = []
    for g in (f, remat(f)):
        torch.manual_seed(0)
        y, z = g(x)
        results.append([y, z, *torch.autograd.grad(z.sum(), x), torch.rand(3)])
    assert_close(results[1], results[0])
