"""A plan's first run checks real values against the traced ones (remat/_running/layouts.py).

Real kernels can disagree with their meta functions (CPU layer norm returns float32
statistics for bfloat16 input where its meta function says bfloat16). These
tests make such kernels on CPU with custom ops whose fake implementation says otherwise
than the real one, and check that remat is exact where the difference cannot matter and
refuses, naming both ops, where it would."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from remat import RematError, remat
from remat import policies as P

from conftest import assert_close

D = torch.float64
POLICIES = [P.nothing_saveable, P.everything_saveable, P.save_ops("remat_layout_tests::column_major")]


@torch.library.custom_op("remat_layout_tests::column_major", mutates_args=())
def column_major(x: torch.Tensor) -> torch.Tensor:
    """Twice x, laid out column-major, where its fake says row-major."""
    return (2 * x).t().contiguous().t()


@column_major.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


column_major.register_autograd(lambda ctx, g: 2 * g)


@torch.library.custom_op("remat_layout_tests::wider_stats", mutates_args=())
def wider_stats(x: torch.Tensor) -> torch.Tensor:
    """Per-row means in float64 for float32 input, where its fake says float32 (as CPU
    layer norm does for bfloat16)."""
    return x.double().mean(-1, keepdim=True)


@wider_stats.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[:-1] + (1,))


def _grads(f: Any, *args: torch.Tensor) -> Any:
    leaves = [a.clone().requires_grad_() for a in args]
    out = f(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves)


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_a_layout_that_no_op_reads_runs_as_in_eager(policy: Any) -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = column_major(x @ w)
        return (y.sin() @ w.t()).pow(2).sum()

    x, w = torch.randn(3, 4, dtype=D), torch.randn(4, 5, dtype=D)
    g = remat(f, policy=policy)
    for _ in range(2):  # the first run checks, the second runs the plain graph
        assert_close(_grads(g, x, w), _grads(f, x, w))


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_a_layout_that_as_strided_reads_is_refused_naming_both_ops(policy: Any) -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = column_major(x @ w)
        return torch.as_strided(y, (y.numel(),), (1,)).sin().sum()

    x, w = torch.randn(3, 4, dtype=D), torch.randn(4, 5, dtype=D)
    message = r"column_major.*test_layouts.py:\d+ laid out its result with strides \[1, 3\].*\[5, 1\].*as_strided.*test_layouts.py:\d+"
    with pytest.raises(RematError, match=message):
        _grads(remat(f, policy=policy), x, w)


def test_a_dtype_difference_that_later_results_do_not_see_runs_as_in_eager() -> None:
    """Like layer norm's statistics: the differing value flows into ops whose results are
    still what was traced (here a comparison), so the graph did not part from eager code.
    (A cast back with `.float()` would not do: traced on a float32 stand-in it is no op,
    and the check reports the graph parting from eager at the next op.)"""
    def f(x: torch.Tensor) -> torch.Tensor:
        above = x.detach() > wider_stats(x.detach())
        return (x * above).pow(2).sum()

    x = torch.randn(3, 4)
    assert_close(_grads(remat(f), x), _grads(f, x))


def test_a_dtype_difference_that_changes_later_results_is_refused() -> None:
    """The traced graph believed float32, so every op after it was traced for float32;
    the real float64 value makes them compute something else than traced."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * wider_stats(x.detach())).sum()

    with pytest.raises(RematError, match=r"aten.mul.Tensor.*float64.*traced as torch.float32.*wider_stats"):
        remat(f)(torch.randn(3, 4, requires_grad=True))


AATEN = torch.ops.aten
CUDA_ATTENTION = {
    "flash": lambda q, k, v: AATEN._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0],
    "flash dropout": lambda q, k, v: AATEN._scaled_dot_product_flash_attention(q, k, v, 0.1, True)[0],
    "efficient": lambda q, k, v: AATEN._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[0],
    "cudnn": lambda q, k, v: AATEN._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True)[0],
}


@pytest.mark.parametrize("policy", [None, P.everything_saveable, P.dots_and_attention_saveable], ids=str)
@pytest.mark.parametrize("kernel", list(CUDA_ATTENTION))
def test_cuda_attention_kernels_structure_on_the_meta_device(kernel: str, policy: Any) -> None:
    """The CUDA kernels' schemas (integer outputs, philox seed/offset tensors, a padded
    logsumexp), run through the whole pipeline on data-free meta tensors, as CPU-only
    machines can: forward, setup_context and backward must handle every output kind.
    Values need a GPU (tests/contract/test_cuda.py); this checks structure: gradients' metadata."""
    if kernel == "flash dropout" and policy is None:
        pytest.skip("replaying a random op needs a real generator: on meta only the kept kernel output runs")
    attention = CUDA_ATTENTION[kernel]
    f = lambda q, k, v: attention(q, k, v).sum()  # noqa: E731
    q, k, v = (torch.empty(2, 4, 16, 8, device="meta", dtype=torch.float16).requires_grad_() for _ in range(3))
    expected = torch.autograd.grad(f(q, k, v), (q, k, v))
    actual = torch.autograd.grad(remat(f, policy=policy)(q, k, v), (q, k, v))
    for a, e in zip(actual, expected):
        assert (a.shape, a.stride(), a.dtype) == (e.shape, e.stride(), e.dtype)


def _conv_channels_last(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A pointwise op whose other operand is laid out channels-last."""
    image = x.reshape(1, 17, 2, 4).contiguous(memory_format=torch.channels_last)
    return torch.tanh(image) * x.reshape(1, 17, 2, 4) * w[0, :4]


LAID_OUT_REGIONS: dict[str, Any] = {
    "tanh(x @ w)": lambda x, w: torch.tanh(x @ w),
    "a biased linear": lambda x, w: torch.nn.functional.linear(x, w, w[0]),  # its bias gradient sums the gradient
    "a bias added": lambda x, w: torch.sin(x) + w[0],
    "transposed output": lambda x, w: (x @ w).t() * 2,
    "a pointwise op over a transposed value": lambda x, w: torch.sin(x @ w) * (w @ x.t()).t(),
    "as_strided": lambda x, w: torch.as_strided(x @ w, (8, 17), (1, 8)).exp(),
    "channels-last": _conv_channels_last,
    "an output viewing an input": lambda x, w: x.view(-1) * 1.0 + (x @ w).view(-1),
}
# what the caller does with the region's output: the gradient each hands the region
USES: dict[str, Any] = {
    "sum": torch.sum,  # broadcast (every stride 0)
    "scaled sum": lambda out: out.sum() * 0.1,  # broadcast, not ones: a sum over it rounds
    "mean": torch.mean,  # divided: contiguous
    "transposed": lambda out: (out.reshape(out.shape[0], -1).t() * torch.linspace(-1, 1, out.shape[0])).sum(),
    "permuted by einsum": lambda out: torch.einsum("ij,ik->jk", *[out.reshape(out.shape[0], -1)] * 2).sum(),
}


@pytest.mark.parametrize("use", list(USES))
@pytest.mark.parametrize("policy", [None, P.nothing_saveable, P.everything_saveable, P.dots_saveable], ids=str)
@pytest.mark.parametrize("region", list(LAID_OUT_REGIONS))
def test_a_gradient_laid_out_otherwise_runs_the_backward_eager_runs(region: str, policy: Any, use: str) -> None:
    """Autograd hands a region's backward the gradient laid out as the caller's code made
    it: broadcast by `.sum()`, transposed, permuted. Eager's derivatives run on it as it
    is, and their sums and products add in the order that layout gives; remat runs a
    backward traced for that layout (or, where the graph allows, the one it has, a
    broadcast gradient entering as it is). Every gradient is bitwise eager's."""
    f = LAID_OUT_REGIONS[region]
    torch.manual_seed(0)
    x, w = torch.randn(17, 8), torch.randn(8, 8)

    def grads(fn: Any) -> Any:
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        out = fn(*leaves)
        USES[use](out).backward()
        return out.detach(), [t.grad for t in leaves]

    region_fn = remat(f, policy=policy)
    expected = grads(f)
    for _ in range(3):  # the first run checks layouts, later ones run the plain graphs
        out, got = grads(region_fn)
        assert torch.equal(out, expected[0])
        assert all(torch.equal(a, b) for a, b in zip(got, expected[1], strict=True))


@pytest.mark.parametrize("transform", ["grad", "vjp", "vmap(grad)"])
@pytest.mark.parametrize("use", list(USES))
@pytest.mark.parametrize("policy", [None, P.nothing_saveable, P.dots_saveable], ids=str)
@pytest.mark.parametrize("region", list(LAID_OUT_REGIONS))
def test_under_torch_func_a_gradient_laid_out_otherwise_runs_the_backward_eager_runs(
    region: str, policy: Any, use: str, transform: str
) -> None:
    """The same under torch.func: `grad` of the caller's loss, `vjp` pulling back the
    cotangent that loss's backward gives (`torch.func.vjp` of the use, so laid out as
    there), and per example under `vmap(grad)` (the backward traced for the layout each
    example's gradient has)."""
    if transform == "vmap(grad)" and region in ("as_strided", "channels-last"):
        pytest.skip("no batching rule for as_strided_scatter, nor for a channels-last clone (eager raises too)")
    f = LAID_OUT_REGIONS[region]
    torch.manual_seed(0)
    x, w = torch.randn(17, 8), torch.randn(8, 8)

    def grads(fn: Any) -> Any:
        grad = torch.func.grad(lambda *a: USES[use](fn(*a)), argnums=(0, 1))
        if transform == "grad":
            return grad(x, w)
        if transform == "vjp":
            out, pullback = torch.func.vjp(fn, x, w)
            (cotangent,) = torch.func.vjp(USES[use], out)[1](torch.tensor(1.0))
            return pullback(cotangent)
        return torch.func.vmap(grad, in_dims=(0, None))(x.expand(3, 17, 8) * torch.arange(1.0, 4.0)[:, None, None], w)

    region_fn = remat(f, policy=policy)
    expected = grads(f)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(grads(region_fn), expected, strict=True))


SECOND_ORDER_USES: dict[str, Any] = {**USES, "square": lambda out: (out * out).sum()}


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equal, or both None (a gradient that does not reach an input)."""
    return a is None and b is None or a is not None and b is not None and torch.equal(a, b)


@pytest.mark.parametrize("use", ["scaled sum", "transposed"])
@pytest.mark.parametrize("policy", [None, P.nothing_saveable, P.dots_saveable], ids=str)
@pytest.mark.parametrize("region", ["tanh(x @ w)", "a biased linear", "a pointwise op over a transposed value"])
def test_a_gradient_penalty_over_a_gradient_laid_out_otherwise_is_eager_s(region: str, policy: Any, use: str) -> None:
    """A gradient penalty: `torch.autograd.grad(loss, inputs, create_graph=True)`, then a
    backward through those gradients. The backward that builds a graph is traced for the
    gradient's layout too: first and second order bitwise."""
    f = LAID_OUT_REGIONS[region]
    torch.manual_seed(0)
    x, w = torch.randn(17, 8), torch.randn(8, 8)

    def grads(fn: Any) -> Any:
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        first = torch.autograd.grad(SECOND_ORDER_USES[use](fn(*leaves)), leaves, create_graph=True)
        sum((g * g).sum() for g in first).backward()
        return [g.detach() for g in first], [t.grad for t in leaves]

    region_fn = remat(f, policy=policy)
    expected = grads(f)
    for _ in range(2):
        got = grads(region_fn)
        for order in range(2):
            assert all(_same(a, b) for a, b in zip(got[order], expected[order], strict=True)), order


@pytest.mark.parametrize("use", ["scaled sum", "transposed", "square"])
@pytest.mark.parametrize("policy", [None, P.nothing_saveable, P.dots_saveable], ids=str)
@pytest.mark.parametrize("region", ["tanh(x @ w)", "a biased linear", "a bias added"])
def test_nested_torch_func_gradients_are_eager_s_whatever_the_loss_does_with_the_output(
    region: str, policy: Any, use: str
) -> None:
    """The same under nested torch.func gradients: the backward reads the region's
    output as the forward made it, so the outer gradient's terms through it meet in one
    node (an output kept for backward costs no memory beyond what eager's op keeps)."""
    f = LAID_OUT_REGIONS[region]
    torch.manual_seed(0)
    x, w = torch.randn(17, 8), torch.randn(8, 8)

    def grads(fn: Any) -> Any:
        inner = torch.func.grad(lambda *a: SECOND_ORDER_USES[use](fn(*a)), argnums=(0, 1))
        return torch.func.grad(lambda *a: sum((g * g).sum() for g in inner(*a)), argnums=(0, 1))(x, w)

    region_fn = remat(f, policy=policy)
    expected = grads(f)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(grads(region_fn), expected, strict=True))


def test_past_eight_gradient_layouts_a_plan_makes_gradients_contiguous_and_stays_right() -> None:
    """A plan traces a backward for each of its first eight gradient layouts; later ones
    run the contiguous backward on a contiguous copy (close to eager's, not bitwise: the
    scale's gradient sums in another order)."""
    def f(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * scale)

    region_fn = remat(f)
    torch.manual_seed(0)
    x, scale = torch.randn(2, 3, 4, 5), torch.randn(5)
    permutations = [p for p in itertools.permutations(range(4)) if p != (0, 1, 2, 3)][:12]
    for k, order in enumerate(permutations):
        weights = torch.linspace(-1, 1, 120).reshape([(2, 3, 4, 5)[d] for d in order])

        def grads(fn: Any, order: tuple[int, ...] = order, weights: torch.Tensor = weights) -> list[torch.Tensor]:
            leaves = [x.clone().requires_grad_(), scale.clone().requires_grad_()]
            (fn(*leaves).permute(*order) * weights).sum().backward()  # the gradient arrives permuted back
            return [t.grad for t in leaves]

        got, expected = grads(region_fn), grads(f)
        if k < 8:
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), order
        else:
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    (plan,) = region_fn._plans.plans.values()
    assert len(plan._laid_out) == 8 and all(g is not None for g in plan._laid_out.values())


@torch.library.custom_op("remat_layout_tests::doubled_gradient", mutates_args=())
def doubled_gradient(g: torch.Tensor) -> torch.Tensor:
    return g * 2


@doubled_gradient.register_fake
def _(g: torch.Tensor) -> torch.Tensor:
    if not g.is_contiguous():  # a fake that cannot describe other layouts, as some kernels' cannot
        raise RuntimeError("doubled_gradient: contiguous gradients only")
    return torch.empty_like(g)


@torch.library.custom_op("remat_layout_tests::doubled", mutates_args=())
def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


doubled.register_fake(lambda x: torch.empty_like(x))
doubled.register_autograd(lambda ctx, g: doubled_gradient(g))


def test_a_backward_that_cannot_be_traced_for_a_gradient_s_layout_runs_on_a_contiguous_copy() -> None:
    """Tracing the backward for a transposed gradient fails (a fake that only knows
    contiguous tensors): the backward traced for a contiguous one runs on a copy, as it
    does past the eighth layout, and the gradient is still eager's."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return doubled(torch.sin(x))

    def grad(fn: Any) -> torch.Tensor:
        leaf = x.clone().requires_grad_()
        (fn(leaf).t() * torch.linspace(0, 1, 5, dtype=D)).sum().backward()  # the gradient arrives transposed
        return leaf.grad

    region_fn = remat(f)
    x = torch.randn(5, 3, dtype=D)
    for _ in range(2):
        assert_close(grad(region_fn), grad(f))
    (plan,) = region_fn._plans.plans.values()
    assert list(plan._laid_out.values()) == [None]
