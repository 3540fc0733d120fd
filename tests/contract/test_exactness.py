"""Exact recomputation: randomness, mutation, autocast, custom ops, attention, nesting, debug."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from remat import RecomputeMismatchError, RematTraceError, remat, saved_residuals, saved_tensor_bytes
from remat import policies as P
from remat._core.torch_internals import torch_at_least

from conftest import POLICIES, assert_close

D = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::remat.RematPolicyWarning")  # shared name policies, unnamed functions
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _leaf(*shape: int, dtype: torch.dtype = D, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_()


# ---------------------------------------------------------------- randomness

RANDOM_FUNCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "dropout": lambda x, w: F.dropout(torch.tanh(x @ w), p=0.4, training=True) @ w,
    "rand": lambda x, w: torch.sin(x @ w) * torch.rand_like(x),
    "randn": lambda x, w: torch.tanh(x @ w + torch.randn(x.shape, dtype=x.dtype, device=x.device)),
    "bernoulli": lambda x, w: torch.sin(x @ w) * torch.bernoulli(torch.sigmoid(x)),
    "randint": lambda x, w: torch.sin(x @ w) * torch.randint(0, 3, x.shape, device=x.device).to(x.dtype),
    "normal_": lambda x, w: torch.tanh(x @ w) * torch.empty_like(x).normal_(1.0, 0.5),
    "uniform_": lambda x, w: torch.sin(x @ w).exp() * torch.empty_like(x).uniform_(-1, 1),
}


def _run_seeded(fn: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor, device: str = "cpu") -> Any:
    torch.manual_seed(123)
    out = fn(x, w)
    grads = torch.autograd.grad((out * out).sum(), [x, w])
    after = torch.rand(4, device=device)  # where the global stream is after forward and backward
    return out, grads, after


@pytest.mark.parametrize("policy_name", ["default", "dots", "everything", "names_but"])
@pytest.mark.parametrize("name", list(RANDOM_FUNCTIONS))
def test_random_ops_recompute_the_same_draws(name: str, policy_name: str) -> None:
    fn = RANDOM_FUNCTIONS[name]
    x, w = _leaf(5, 4), _leaf(4, 4)
    assert_close(_run_seeded(remat(fn, policy=POLICIES[policy_name]), x, w), _run_seeded(fn, x, w))


@pytest.mark.parametrize("policy_name", ["default", "dots", "everything"])
def test_random_ops_drawing_from_a_generator_passed_to_them(policy_name: str) -> None:
    """`torch.rand(..., generator=g)`: the graph holds the generator itself (make_fx records
    it as an attribute); recompute replays its state, and it ends where eager leaves it."""
    generator = torch.Generator().manual_seed(7)

    def noisy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(x.shape, dtype=x.dtype, generator=generator)
        return F.dropout(torch.tanh(x @ w) * noise, p=0.3, training=True) @ w

    def run(fn: Callable[..., torch.Tensor]) -> Any:
        generator.manual_seed(7)
        out, grads, after = _run_seeded(fn, x, w)
        return out, grads, after, torch.rand(3, generator=generator)

    x, w = _leaf(5, 4), _leaf(4, 4)
    if not torch_at_least("2.13"):  # torch 2.11's make_fx cannot record a Generator argument: refused, named
        with pytest.raises(RematTraceError, match="argument of type"):
            remat(noisy, policy=POLICIES[policy_name])(x, w)
        return
    assert_close(run(remat(noisy, policy=POLICIES[policy_name])), run(noisy))


@needs_cuda
@pytest.mark.parametrize("name", list(RANDOM_FUNCTIONS))
def test_random_ops_recompute_the_same_draws_on_cuda(name: str) -> None:
    fn = RANDOM_FUNCTIONS[name]
    x, w = _leaf(5, 4, device="cuda"), _leaf(4, 4, device="cuda")
    assert_close(_run_seeded(remat(fn), x, w, "cuda"), _run_seeded(fn, x, w, "cuda"))


def test_replayed_random_ops_keep_a_generator_state_not_a_mask() -> None:
    fn = RANDOM_FUNCTIONS["dropout"]
    x, w = _leaf(64, 64), _leaf(64, 64)
    report = saved_residuals(remat(fn), x, w)
    (rng,) = [r for r in report if r.kind == "rng"]
    assert rng.dtype == torch.uint8 and "bernoulli" in str(rng.op) and rng.source.startswith("test_exactness.py:")
    assert rng.nbytes == torch.get_rng_state().numel() < 64 * 64 * 8  # smaller than the mask it replaces
    kept_everything = saved_residuals(remat(fn, policy=P.everything_saveable), x, w)
    assert not [r for r in kept_everything if r.kind == "rng"]  # a kept mask needs no replay


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_vmap_randomness_matches_no_remat(randomness: str) -> None:
    fn = RANDOM_FUNCTIONS["dropout"]
    xs, w = torch.randn(3, 5, 4, dtype=D), torch.randn(4, 4, dtype=D)

    def per_sample(f: Callable[..., torch.Tensor]) -> Any:
        torch.manual_seed(7)
        result = vmap(grad(lambda x, w: f(x, w).pow(2).sum(), argnums=1), in_dims=(0, None), randomness=randomness)(xs, w)
        return result, torch.rand(3)

    assert_close(per_sample(remat(fn, policy=P.dots_saveable)), per_sample(fn))


def _noise_like_a_value_changed_through_a_view(x: torch.Tensor) -> torch.Tensor:
    changed = x.clone()
    changed.t()[0].add_(x[:, 0])
    return changed * torch.rand_like(changed) + torch.randn_like(changed)


@pytest.mark.parametrize("transform", ["none", "grad", "vmap", "vmap_grad_different", "vmap_grad_same"])
def test_noise_like_a_value_changed_through_a_view_draws_as_eager(transform: str) -> None:
    """`rand_like` draws in its input's memory order. Functionalization gives a value changed
    through a transposed view back as a scatter into that view, transposed under vmap(grad):
    drawn in that order, the same numbers landed on other elements (found by the
    random-program tester, seed 65753)."""
    fn = _noise_like_a_value_changed_through_a_view
    xs = torch.randn(2, 3, 4, dtype=D)
    runs = {
        "none": lambda f: f(xs[0]),
        "grad": lambda f: grad(lambda x: f(x).sum())(xs[0]),
        "vmap": lambda f: vmap(f, randomness="different")(xs),
        "vmap_grad_different": lambda f: vmap(grad(lambda x: f(x).sum()), randomness="different")(xs),
        "vmap_grad_same": lambda f: vmap(grad(lambda x: f(x).sum()), randomness="same")(xs),
    }

    def run(f: Callable[..., torch.Tensor]) -> Any:
        torch.manual_seed(3)
        return runs[transform](f), torch.rand(2)

    assert_close(run(remat(fn)), run(fn))


def _fill_of_computed(x: torch.Tensor) -> torch.Tensor:
    return x * (x * 1).bernoulli_(0.5)


def _random_in_a_range(x: torch.Tensor) -> torch.Tensor:
    return x.sin() + x.new_empty(x.shape).random_(3, 10) + (x * 1).random_(-5, 1000)


@pytest.mark.parametrize("fn", [_fill_of_computed, _random_in_a_range], ids=lambda f: f.__name__)
def test_random_fills_of_computed_values_and_ranges_match_no_remat(fn: Callable[..., torch.Tensor]) -> None:
    """A fill of a value autograd tracks has a zero derivative in eager code (its functional
    form has none); `random_(low, high)` draws the same integers."""
    def run(f: Callable[..., torch.Tensor]) -> Any:
        torch.manual_seed(3)
        x = torch.randn(6, dtype=D, requires_grad=True)
        out = f(x)
        out.pow(2).sum().backward()
        return out.detach(), x.grad, torch.rand(2)

    assert_close(run(remat(fn)), run(fn))
    xs = torch.randn(3, 6, dtype=D)
    torch.manual_seed(4)
    expected = vmap(grad(lambda x: fn(x).pow(2).sum()), randomness="same")(xs)
    torch.manual_seed(4)
    assert_close(vmap(grad(lambda x: remat(fn)(x).pow(2).sum()), randomness="same")(xs), expected)


def _fill_is_the_only_path(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * 2 + (y.exp() + 1).normal_(0, 0.5) * x  # `y` reaches the output only through the fill


def _fill_beside_another_path(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (y * 1).bernoulli_(0.5) * y * x + x.tanh()


def _fill_backward(f: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
    out = f(x, y)
    out.pow(2).sum().backward()
    return out.detach(), x.grad, y.grad


def _fill_double_backward(f: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
    gx, gy = torch.autograd.grad(f(x, y).pow(2).sum(), [x, y], create_graph=True)
    ((gx * gx).sum() + (gy * x).sum()).backward()
    return gx.detach(), gy.detach(), x.grad, y.grad


FILL_RUNS = {
    "backward": _fill_backward,
    "double_backward": _fill_double_backward,
    "grad": lambda f, x, y: grad(lambda x, y: f(x, y).pow(2).sum(), argnums=(0, 1))(x.detach(), y.detach()),
    "vmap_grad": lambda f, x, y: vmap(grad(lambda x, y: f(x, y).pow(2).sum(), argnums=(0, 1)), randomness="same")(
        torch.stack([x.detach(), x.detach() * 2]), torch.stack([y.detach(), -y.detach()])
    ),
}


@pytest.mark.parametrize("transform", list(FILL_RUNS))
@pytest.mark.parametrize("policy_name", ["none", "nothing", "everything", "dots"])
@pytest.mark.parametrize("fn", [_fill_is_the_only_path, _fill_beside_another_path], ids=lambda f: f.__name__)
def test_a_random_fill_of_a_value_that_requires_grad_gives_its_inputs_zero_gradients(
    fn: Callable[..., torch.Tensor], policy_name: str, transform: str
) -> None:
    """Eager autograd keeps a filled value on the graph with a zero derivative: its inputs
    get zeros, not None (an optimizer's weight decay and momentum skip a None gradient),
    in a gradient of a gradient too (found by the random-program tester, seed 90950)."""
    policy = {"none": None, "nothing": P.nothing_saveable, "everything": P.everything_saveable, "dots": P.dots_saveable}

    def run(f: Callable[..., torch.Tensor]) -> Any:
        torch.manual_seed(6)
        x = torch.randn(3, 4, dtype=D, requires_grad=True)
        y = torch.randn(3, 4, dtype=D, requires_grad=True)
        return FILL_RUNS[transform](f, x, y), torch.rand(2)

    expected = run(fn)
    actual = run(remat(fn, policy=policy[policy_name]))
    if transform == "double_backward":  # second-order contributions to `x` meet in another order: an ulp
        assert_close(actual, expected)
    else:
        assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("randomness", ["different", "same"])
@pytest.mark.parametrize("transform", ["vmap", "vmap_grad"])
def test_a_fill_of_a_tensor_made_like_a_batched_one_draws_as_eager_under_vmap(transform: str, randomness: str) -> None:
    """Eager `empty_like(x).uniform_()` draws a row per element when vmap batches `x` with
    `randomness="different"` (and one row for all with "same")."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * torch.empty_like(x).uniform_() + x.new_empty(x.shape).normal_()

    xs = torch.randn(3, 4, dtype=D)

    def run(fn: Callable[..., torch.Tensor]) -> Any:
        torch.manual_seed(5)
        if transform == "vmap":
            leaf = xs.clone().requires_grad_()
            out = vmap(fn, randomness=randomness)(leaf)
            out.pow(2).sum().backward()
            return out.detach(), leaf.grad, torch.rand(2)
        return vmap(grad(lambda x: fn(x).pow(2).sum()), randomness=randomness)(xs), torch.rand(2)

    assert_close(run(remat(f)), run(f))


def _fill_of_a_transposed_value(x: torch.Tensor) -> torch.Tensor:
    return (x.mT * 1).uniform_() * x.mT


def _fill_made_like_a_transposed_value(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x.mT).bernoulli_(0.5) * x.mT + x.mT


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("randomness", ["different", "same"])
@pytest.mark.parametrize("transform", ["vmap", "vmap_grad"])
@pytest.mark.parametrize(
    "fn", [_fill_of_a_transposed_value, _fill_made_like_a_transposed_value], ids=lambda f: f.__name__
)
def test_a_fill_of_a_value_laid_out_otherwise_draws_as_eager_under_vmap(
    fn: Callable[..., torch.Tensor], transform: str, randomness: str, layout: str
) -> None:
    """Outside vmap an in-place fill draws in the tensor's memory order; vmap with
    `randomness="same"` draws a batched tensor's fill in its logical order instead."""
    xs = torch.randn(2, 3, 4, dtype=D, generator=torch.Generator().manual_seed(0))
    xs = xs if layout == "contiguous" else xs.mT.contiguous().mT

    def run(f: Callable[..., torch.Tensor]) -> Any:
        torch.manual_seed(5)
        if transform == "vmap":
            leaf = xs.detach().clone(memory_format=torch.preserve_format).requires_grad_()
            out = vmap(f, randomness=randomness)(leaf)
            out.pow(2).sum().backward()
            return out.detach(), leaf.grad, torch.rand(2)
        return vmap(grad(lambda x: f(x).pow(2).sum()), randomness=randomness)(xs), torch.rand(2)

    assert_close(run(remat(fn)), run(fn), rtol=0, atol=0)


_CAPTURED_UNBATCHED = torch.randn(4, dtype=D)


def _write_batched_into_unbatched(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = y.clone()
    t.add_(x)  # x batched, y not: eager vmap refuses
    return t * x


def _write_through_a_view_of_an_unbatched_clone(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = y.clone()
    t[:2].mul_(x[:2].sin())
    return t + x


def _write_into_a_clone_of_a_captured_tensor(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = _CAPTURED_UNBATCHED.clone()
    t.copy_(x * y)
    return t


def _write_a_draw_into_an_unbatched_clone(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = y.clone()
    t.add_(torch.randn_like(y))  # a batched draw under randomness="different"
    return t * x


@pytest.mark.parametrize(
    "fn",
    [_write_batched_into_unbatched, _write_through_a_view_of_an_unbatched_clone,
     _write_into_a_clone_of_a_captured_tensor, _write_a_draw_into_an_unbatched_clone],
    ids=lambda f: f.__name__[1:],
)
@pytest.mark.parametrize("transform", ["vmap", "vmap_grad", "vmap_vmap"])
def test_a_batched_value_written_into_an_unbatched_tensor_raises_as_eager_under_vmap(
    fn: Callable[..., torch.Tensor], transform: str
) -> None:
    """Eager vmap refuses to write a value it batches into a tensor it does not (`x` is
    batched, `y` is not); remat's functional graph could compute it: it raises as eager
    code does, with torch's own error. Under two vmaps, `y` is batched by the outer one
    only, `x` by the inner one. (`xs` requires grad: a region with nothing to differentiate
    runs as it is anyway.)"""
    xs, y = torch.randn(3, 4, dtype=D, requires_grad=True), torch.randn(4, dtype=D)

    def run(f: Callable[..., torch.Tensor]) -> str:
        torch.manual_seed(0)
        with pytest.raises(RuntimeError) as raised:
            if transform == "vmap":
                vmap(f, in_dims=(0, None), randomness="different")(xs, y)
            elif transform == "vmap_grad":
                vmap(grad(lambda x, y: f(x, y).sum()), in_dims=(0, None), randomness="different")(xs, y)
            else:
                inner = vmap(f, in_dims=(0, None), randomness="different")
                ys = torch.randn(2, 4, dtype=D, requires_grad=True)
                vmap(inner, in_dims=(None, 0), randomness="different")(xs, ys)
        return str(raised.value).splitlines()[0]

    assert run(remat(fn)) == run(fn)


def _update_a_captured_count(x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        count.add_(1)  # a counter the function closes over (as a norm layer's)
    return (x.sin() * (1 + count)).sum()


def _update_captured_statistics(x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        stats[:2].mul_(0.9).add_(x.mean(0)[:2] * 0.1)  # through a view of it
    return (x.sin() + stats).sum()


@pytest.mark.parametrize("fn", [_update_a_captured_count, _update_captured_statistics], ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("transform", ["grad", "jvp", "grad_of_grad", "vmap_grad"])
def test_a_write_into_a_tensor_a_gradient_transform_does_not_track_raises_as_eager(
    fn: Callable[..., torch.Tensor], transform: str
) -> None:
    """Eager gradient transforms refuse to write into a tensor they do not wrap (one the
    function closes over): remat's graph would apply the write after the call; it raises
    as eager code does, with torch's own error, and leaves the tensor as eager code does."""
    x = torch.randn(3, 4, dtype=D)

    def run(f: Callable[..., torch.Tensor]) -> tuple[str, torch.Tensor]:
        captured = torch.zeros(4, dtype=D) if fn is not _update_a_captured_count else torch.zeros((), dtype=D)
        with pytest.raises(RuntimeError) as raised:
            if transform == "grad":
                grad(lambda x: f(x, captured))(x)
            elif transform == "jvp":
                torch.func.jvp(lambda x: f(x, captured), (x,), (x,))
            elif transform == "grad_of_grad":
                grad(lambda x: grad(lambda x: f(x, captured))(x).sum())(x)
            else:
                vmap(grad(lambda x: f(x, captured)))(x[None].expand(2, 3, 4))
        return str(raised.value).splitlines()[0], captured

    (error, left), (expected, eager_left) = run(remat(fn)), run(fn)
    assert error == expected and "mutate a captured Tensor" in error
    assert torch.equal(left, eager_left)


@pytest.mark.parametrize("fn", [_update_a_captured_count, _update_captured_statistics], ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("transform", ["grad", "backward"])
def test_a_write_with_grad_off_into_a_tensor_given_is_a_constant_as_in_eager(
    fn: Callable[..., torch.Tensor], transform: str
) -> None:
    """The same writes into a tensor the region is given (a gradient transform wraps it)
    run; what they write is a constant of backward, through a view of the tensor too."""
    x = torch.randn(3, 4, dtype=D)
    results = []
    for f in (fn, remat(fn)):
        given = torch.zeros(4, dtype=D) if fn is not _update_a_captured_count else torch.zeros((), dtype=D)
        if transform == "grad":
            gradient = grad(f)(x, given)
        else:
            leaf = x.clone().requires_grad_()
            f(leaf, given).backward()
            gradient = leaf.grad
        results.append((gradient, given))
    assert_close(results[1], results[0])


def test_a_batched_value_written_into_a_batched_tensor_under_vmap_stays_traced() -> None:
    """The same writes into tensors vmap batches are exact and traced (not run as they are)."""
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t = x.clone()
        t[:2].mul_(y[:2].sin())
        return (t * y).sum()

    xs, ys = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    region = remat(f, policy=None)
    assert_close(vmap(grad(region))(xs, ys), vmap(grad(f))(xs, ys))
    assert region.cache_info()["traces"] == 1


def test_vmap_default_randomness_raises_like_no_remat() -> None:
    fn = RANDOM_FUNCTIONS["rand"]
    xs, w = torch.randn(3, 5, 4, dtype=D), torch.randn(4, 4, dtype=D)
    for f in (fn, remat(fn)):
        with pytest.raises(RuntimeError, match="randomness"):
            vmap(grad(lambda x, w: f(x, w).sum(), argnums=1), in_dims=(0, None))(xs, w)


def test_forward_mode_through_random_ops_matches_no_remat() -> None:
    """Under forward-mode AD a region runs as it is, so even random draws stay exact."""
    x, w = torch.randn(5, 4, dtype=D), torch.randn(4, 4, dtype=D)
    fn = RANDOM_FUNCTIONS["randn"]

    def hvp(f: Callable[..., torch.Tensor]) -> Any:
        torch.manual_seed(11)
        return torch.func.jvp(lambda w: grad(lambda w: f(x, w).pow(2).sum())(w), (w,), (torch.ones_like(w),))

    assert_close(hvp(remat(fn)), hvp(fn))


def test_attention_without_dropout_is_not_treated_as_random() -> None:
    q, k, v = (_leaf(1, 2, 5, 4) for _ in range(3))
    report = saved_residuals(remat(lambda q, k, v: F.scaled_dot_product_attention(q, k, v).sin()), q, k, v)
    assert [r.kind for r in report] == ["input"] * 3


# ---------------------------------------------------------------- mutation


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6, dtype=D)
        self.bn = torch.nn.BatchNorm1d(6, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bn(self.lin(x)))


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("policy_name", ["default", "dots", "everything"])
def test_batchnorm_buffers_update_once_through_functional_call(policy_name: str) -> None:
    torch.manual_seed(0)
    plain, checkpointed = ConvNet(), ConvNet()
    checkpointed.load_state_dict(plain.state_dict())
    x = torch.randn(8, 6, dtype=D)

    def run(model: torch.nn.Module, use_remat: bool) -> Any:
        params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}
        buffers = dict(model.named_buffers())
        call = lambda p, b, x: functional_call(model, {**p, **b}, (x,))  # noqa: E731
        f = remat(call, policy=POLICIES[policy_name]) if use_remat else call
        out = f(params, buffers, x)
        after_forward = _state(model)
        grads = torch.autograd.grad(out.pow(2).sum(), list(params.values()))
        assert_close(_state(model), after_forward)  # backward (recompute) never mutates
        return out, grads, after_forward

    assert_close(run(checkpointed, True), run(plain, False), rtol=0, atol=0)


def test_batchnorm_module_under_remat_updates_once() -> None:
    torch.manual_seed(0)
    plain, checkpointed = ConvNet(), ConvNet()
    checkpointed.load_state_dict(plain.state_dict())
    x = torch.randn(8, 6, dtype=D)
    remat(checkpointed, policy=P.nothing_saveable)(x).sum().backward()
    plain(x).sum().backward()
    assert_close(_state(checkpointed), _state(plain), rtol=0, atol=0)
    assert_close([p.grad for p in checkpointed.parameters()], [p.grad for p in plain.parameters()])


def test_in_place_ops_on_inputs_and_intermediates() -> None:
    def fn(x: torch.Tensor, stats: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        h = x @ x.t()
        h.mul_(0.5).tanh_()  # in place on intermediates
        stats.mul_(0.9).add_(h.detach().mean(0) * 0.1)  # running statistics
        counter.add_(1)
        return h.sum(-1)

    x = _leaf(4, 3)
    stats_a, stats_b = torch.zeros(4, dtype=D), torch.zeros(4, dtype=D)
    counter_a, counter_b = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    f = remat(fn)
    out_a = f(x, stats_a, counter_a)
    g_a = torch.autograd.grad(out_a.sum(), x)
    out_b = fn(x, stats_b, counter_b)
    g_b = torch.autograd.grad(out_b.sum(), x)
    assert_close((out_a, g_a, stats_a, counter_a), (out_b, g_b, stats_b, counter_b), rtol=0, atol=0)
    assert counter_a.item() == 1


def test_mutating_an_input_that_requires_grad_is_a_clear_error() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x.sum()

    h = _leaf(3) * 1.0
    with pytest.raises(RematTraceError, match=r"mutates in place an input that requires grad, at test_exactness.py:\d+ \(`x.mul_\(2\)`\).*Return the new value"):
        remat(fn)(h)


# ---------------------------------------------------------------- autocast


def _mixed(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    h = F.gelu(x @ w)
    h = F.layer_norm(h, (h.shape[-1],), g)
    return torch.softmax(h @ w.t(), -1)


@pytest.mark.parametrize(
    "device, dtype",
    [("cpu", torch.bfloat16), pytest.param("cuda", torch.float16, marks=needs_cuda), pytest.param("cuda", torch.bfloat16, marks=needs_cuda)],
)
@pytest.mark.parametrize("policy_name", ["default", "dots", "everything"])
def test_autocast_matches_no_remat(device: str, dtype: torch.dtype, policy_name: str) -> None:
    x, w, g = _leaf(4, 8, dtype=torch.float32, device=device), _leaf(8, 8, dtype=torch.float32, device=device), _leaf(8, dtype=torch.float32, device=device)
    f = remat(_mixed, policy=POLICIES[policy_name])

    def run(fn: Callable[..., torch.Tensor]) -> Any:
        with torch.autocast(device, dtype=dtype):
            out = fn(x, w, g)
        return out, torch.autograd.grad(out.float().pow(2).sum(), [x, w, g])

    actual, expected = run(f), run(_mixed)
    assert actual[0].dtype == expected[0].dtype  # softmax runs in float32 under CUDA's autocast, not CPU's
    assert_close(actual, expected, rtol=0, atol=0)
    assert f.cache_info()["traces"] == 1


# ---------------------------------------------------------------- custom ops


@torch.library.custom_op("remat_tests::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


def _scaled_tanh_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def _scaled_tanh_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
    (y,) = ctx.saved_tensors
    return grad_out * (ctx.scale - y * y / ctx.scale), None


scaled_tanh.register_autograd(_scaled_tanh_backward, setup_context=_scaled_tanh_setup)


def _uses_custom_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return scaled_tanh(x @ w, 2.0) @ w


@pytest.mark.parametrize(
    "policy", [None, P.save_ops("remat_tests::scaled_tanh"), P.save_ops(torch.ops.remat_tests.scaled_tanh.default)]
)
def test_custom_op_works_and_can_be_named_in_a_policy(policy: Any) -> None:
    x, w = _leaf(4, 3), _leaf(3, 3)
    f = remat(_uses_custom_op, policy=policy)
    assert_close(torch.autograd.grad(f(x, w).sum(), [x, w]), torch.autograd.grad(_uses_custom_op(x, w).sum(), [x, w]))
    kept = [str(r.op) for r in saved_residuals(f, x, w) if r.kind == "intermediate"]
    assert kept == ([] if policy is None else ["remat_tests.scaled_tanh.default"])


@pytest.mark.parametrize("call", ["tolist", "numpy"])
def test_untraceable_calls_name_the_line(call: str) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        values = x.tolist() if call == "tolist" else x.detach().numpy()
        return x * len(values)

    with pytest.raises(RematTraceError, match=r"test_exactness.py:\d+ \(`values = x.tolist.*(?s:.*)static_argnums"):
        remat(fn, fallback=False)(_leaf(3))


# ---------------------------------------------------------------- attention


def _ops_run(names: frozenset[str], fn: Callable[[], Any]) -> tuple[int, Any]:
    """How many calls of ops named in `names` `fn` makes, and its result. Counted by the
    profiler, which sees the autograd engine's own threads (CUDA's backward runs in one;
    a dispatch mode entered here is not active there); a call inside another counted one
    is not counted (CUDA's memory-efficient SDPA calls `_efficient_attention_forward`)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()

    def outermost(event: Any) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name in names:
                return False
            parent = parent.cpu_parent
        return True

    return sum(1 for e in prof.events() if e.name in names and outermost(e)), result


def _attention_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    b, t, d = x.shape
    q, k, v = (x @ w).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return torch.tanh(out.transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_attention_outputs_can_be_kept_so_backward_does_not_recompute_them(device: str) -> None:
    # Heads of width 8 in float32: a fused kernel takes them on CUDA (float64, or width 4,
    # goes to the math path there, with no attention op to count).
    dtype = torch.float32 if device == "cuda" else D
    x, w = _leaf(2, 5, 16, dtype=dtype, device=device), _leaf(16, 48, dtype=dtype, device=device)
    count, expected = _ops_run(P.ATTENTION, lambda: torch.autograd.grad(_attention_block(x, w).sum(), [x, w]))
    assert count == 1  # one fused attention kernel, which nothing_saveable runs again
    for policy, recomputed in [(P.nothing_saveable, 1), (P.dots_and_attention_saveable, 0), (P.save_ops(P.ATTENTION), 0)]:
        out = remat(_attention_block, policy=policy)(x, w)
        count, grads = _ops_run(P.ATTENTION, lambda: torch.autograd.grad(out.sum(), [x, w]))  # noqa: B023
        assert count == recomputed, policy
        assert_close(grads, expected, **({"rtol": 1e-5, "atol": 1e-6} if device == "cuda" else {}))


def test_op_groups_extend_by_composition() -> None:
    policy = P.save_ops(P.DOTS, P.ATTENTION, "mylib::fused_mlp")
    assert policy(torch.ops.aten.bmm.default) and policy(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert "mylib::fused_mlp" in policy.ops and P.op_key("aten::convolution") in P.CONVOLUTIONS
    assert "_c10d_functional::reduce_scatter_tensor" in P.COLLECTIVES


# ---------------------------------------------------------------- nesting


def _inner(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(F.gelu(x @ w) @ w)


def test_nested_regions_use_the_innermost_policy() -> None:
    inner = remat(_inner, policy=P.dots_saveable)

    def outer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.sin(inner(x, w) @ w)
        return inner(h, w) + vmap(lambda r: torch.cos(r @ w))(h)

    def plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.sin(_inner(x, w) @ w)
        return _inner(h, w) + vmap(lambda r: torch.cos(r @ w))(h)

    x, w = _leaf(4, 3), _leaf(3, 3)
    for outer_policy in (None, P.everything_saveable):
        f = remat(outer, policy=outer_policy)
        assert_close(torch.autograd.grad(f(x, w).sum(), [x, w]), torch.autograd.grad(plain(x, w).sum(), [x, w]))
        assert_close(grad(lambda w: f(x, w).sum())(w), grad(lambda w: plain(x, w).sum())(w))
        report = saved_residuals(f, x, w)
        inner_kept = [r for r in report if r.region == "_inner"]
        assert {str(r.op) for r in inner_kept} == {"aten.mm.default"} and len(inner_kept) == 4  # dots only
        outer_kept = [r for r in report if r.region.endswith("outer") and r.kind == "intermediate"]
        assert (len(outer_kept) > 0) == (outer_policy is P.everything_saveable)


# ---------------------------------------------------------------- debug mode


def test_debug_mode_catches_a_changed_input_naming_op_and_line() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.sin(torch.tanh(x @ w) @ w)

    x, w = _leaf(4, 3), _leaf(3, 3)
    out = remat(fn, debug=True)(x, w)
    torch.autograd.grad(out.sum(), [x, w])  # a faithful recompute passes
    out = remat(fn, debug=True)(x, w)
    w.data.add_(1.0)  # behind autograd's back
    with pytest.raises(RecomputeMismatchError, match=r"aten.mm.default from test_exactness.py:\d+"):
        torch.autograd.grad(out.sum(), [x, w])


@torch.library.custom_op("remat_tests::noisy", mutates_args=())
def noisy(x: torch.Tensor) -> torch.Tensor:
    return x + torch.randn_like(x)  # draws random numbers without saying so


@noisy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


noisy.register_autograd(lambda ctx, g: g)


def test_debug_mode_catches_an_undeclared_random_custom_op() -> None:
    x = _leaf(4, 3)
    out = remat(lambda x: torch.sin(noisy(x)), debug=True)(x)
    with pytest.raises(RecomputeMismatchError, match="remat_tests.noisy"):
        torch.autograd.grad(out.sum(), x)


def test_debug_mode_off_costs_nothing() -> None:
    x, w = _leaf(4, 3), _leaf(3, 3)
    off = saved_tensor_bytes(remat(_inner), x, w)
    on = saved_tensor_bytes(remat(_inner, debug=True), x, w)
    assert off == sum(r.nbytes for r in saved_residuals(remat(_inner), x, w)) and on > off


@pytest.mark.parametrize("policy_name", ["default", "dots", "everything"])
def test_debug_mode_gives_the_same_gradients(policy_name: str) -> None:
    x, w = _leaf(4, 3), _leaf(3, 3)
    f = remat(_inner, policy=POLICIES[policy_name], debug=True)
    assert_close(torch.autograd.grad(f(x, w).sum(), [x, w]), torch.autograd.grad(_inner(x, w).sum(), [x, w]))
    assert_close(grad(lambda w: f(x, w).sum())(w), grad(lambda w: _inner(x, w).sum())(w))


def test_an_unread_random_op_still_advances_the_random_stream() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        torch.randn_like(x)  # drawn, never read: eager code still consumes the stream
        return torch.sin(x @ w)

    x, w = _leaf(5, 4), _leaf(4, 4)
    assert_close(_run_seeded(remat(fn), x, w), _run_seeded(fn, x, w))


# ---------------------------------------------------------------- writes rewritten without a retrace


def _writes_fresh(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w
    h.mul_(2)  # a fresh value, written once: rewritten out of place
    return torch.tanh(h) * h


def _writes_through_a_view(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w
    h[:, 0].mul_(2)  # the write goes through a view
    return torch.tanh(h)


def _writes_an_aliased_value(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w
    v = h.view(-1)
    h.add_(1)  # `v` must see the write
    return torch.tanh(v).sum() * h


def _writes_twice(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w
    h.add_(1)
    h.mul_(3)  # traced as a write to the first write's result: a chain, rewritten link by link
    return torch.tanh(h)


def _writes_with_promotion(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = (x @ w).float()
    h.add_(x)  # float32 += float64 stays float32; the out-of-place add would promote
    return h.double() * x


def _copies_into_a_fresh_value(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    out.copy_(x @ w)  # aten.copy has no derivative: this write must take the retrace (found by OpInfo `diff`)
    return torch.tanh(out)


@pytest.mark.parametrize(
    "fn, rewritten",
    [(_writes_fresh, True), (_writes_through_a_view, False), (_writes_an_aliased_value, False),
     (_writes_twice, True), (_writes_with_promotion, False), (_copies_into_a_fresh_value, False)],
    ids=["fresh", "through_view", "aliased", "twice", "promotion", "copy"],
)
def test_writes_to_fresh_values_are_rewritten_and_others_functionalized(
    fn: Callable[..., torch.Tensor], rewritten: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 1 rewrites a write to a fresh, unaliased value out of place instead of
    retracing the graph through functionalization; any other write takes the retrace.
    Either way the values and gradients are those of no remat."""
    import remat._trace.passes as passes
    import remat._trace.tracing as tracing

    answers: list[bool] = []

    def spy(gm: torch.fx.GraphModule) -> bool:
        answers.append(passes.writes_out_of_place(gm))
        return answers[-1]

    monkeypatch.setattr(tracing, "writes_out_of_place", spy)
    x, w = _leaf(4, 4), _leaf(4, 4)
    for policy in (None, P.everything_saveable):
        out = remat(fn, policy=policy)(x, w)
        assert_close((out, torch.autograd.grad(out.sum(), [x, w])), (fn(x, w), torch.autograd.grad(fn(x, w).sum(), [x, w])))
    assert answers[0] is rewritten  # stage 1 of the first trace


# ---------------------------------------------------------------- inputs returned as outputs


def _returns_its_input(t1: torch.Tensor, t2: torch.Tensor, t3: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """t1 used twice inside and returned unchanged (torch's own checkpoint test shape)."""
    t4 = t1 + t2 * t3
    t5 = t1 * t2 + t3
    t4 *= 3
    return t4, t5, t1


@pytest.mark.parametrize("used", [(0,), (2,), (0, 2), (1, 2), (0, 1, 2)])
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_an_input_returned_unchanged_gets_its_whole_gradient(used: tuple[int, ...], policy_name: str) -> None:
    """The returned input's gradient joins those of its uses inside (it was dropped when the
    input was used more than once inside: a silent wrong gradient), under .backward() and
    torch.func.grad, whichever outputs are used."""

    def loss(f: Callable[..., Any], t1: torch.Tensor, t2: torch.Tensor, t3: torch.Tensor) -> torch.Tensor:
        out = f(t1, t2, t3)
        return sum(((k + 2) * out[k].sin()).sum() for k in used)  # type: ignore[return-value]

    region = remat(_returns_its_input, policy=POLICIES[policy_name])
    t1, t2, t3 = _leaf(5), _leaf(5), torch.randn(5, dtype=D)
    expected = torch.autograd.grad(loss(_returns_its_input, t1, t2, t3), (t1, t2), allow_unused=True)
    actual = torch.autograd.grad(loss(region, t1, t2, t3), (t1, t2), allow_unused=True)
    assert_close(actual, expected)
    assert_close(grad(loss, argnums=(1, 2))(region, t1, t2, t3), grad(loss, argnums=(1, 2))(_returns_its_input, t1, t2, t3))
