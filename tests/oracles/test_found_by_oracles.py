"""Cases that torch's op database and real models found silently wrong or refused, each
against the same call without remat (float64). Most failed before their fix; the rest pin
neighbouring behaviour (the .backward() twin of a torch.func case, a refusal's message)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vjp, vmap

import remat as remat_package
from remat import RematError, RematTraceError, remat
from remat import policies as P
from remat._core.torch_internals import torch_at_least

from conftest import assert_close

D = torch.float64
ALL_POLICIES = [None, P.nothing_saveable, P.everything_saveable, P.dots_saveable]
pytestmark = pytest.mark.filterwarnings("ignore::remat.RematPolicyWarning")


def _grads(f: Callable[..., torch.Tensor], *args: torch.Tensor) -> Any:
    """Seeded value, gradient (torch.func.grad) and the random stream afterwards."""
    torch.manual_seed(0)
    value, g = torch.func.grad_and_value(f, argnums=tuple(range(len(args))))(*args)
    return value, g, torch.rand(3)


def _backward(f: Callable[..., torch.Tensor], *args: torch.Tensor) -> Any:
    """Seeded value, gradients by .backward() and the random stream afterwards."""
    torch.manual_seed(0)
    leaves = [a.clone().requires_grad_() for a in args]
    value = f(*leaves)
    value.backward()
    return value.detach(), [leaf.grad for leaf in leaves], torch.rand(3)


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=str)
@pytest.mark.parametrize("run", [_grads, _backward], ids=["grad", "backward"])
def test_qr_gradients(policy: Any, run: Callable[..., Any]) -> None:
    """The backward formula writes `diagonal(g).mul_(0.5)` in place; the graph lost it."""
    def f(a: torch.Tensor) -> torch.Tensor:
        q, r = torch.linalg.qr(a)
        return q.sin().sum() + r.cos().sum()

    a = torch.randn(5, 3, dtype=D)
    assert_close(run(remat(f, policy=policy), a), run(f, a))


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_as_strided_reads_the_storage_offset(offset: int) -> None:
    """as_strided indexes the storage: a view input's offset changes the graph."""
    base = torch.randn(12, dtype=D)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.as_strided(x, (2, 2), (1, 2), 1).sin().sum() + x.sum()

    x = base[offset : offset + 8]
    assert_close(_backward(remat(f), x)[1], _backward(f, x)[1])


def test_as_strided_plans_are_per_storage_offset() -> None:
    base = torch.randn(12, dtype=D)
    f = remat(lambda x: torch.as_strided(x, (2,), (2,), 1).exp().sum())
    for offset in (0, 2, 0):
        x = base[offset : offset + 6].detach().requires_grad_()
        (g,) = torch.autograd.grad(f(x), x)
        x2 = base[offset : offset + 6].detach().requires_grad_()
        (e,) = torch.autograd.grad(torch.as_strided(x2, (2,), (2,), 1).exp().sum(), x2)
        assert_close(g, e)
    assert f.cache_info()["traces"] == 2
    plain = remat(lambda x: x.exp().sum())
    for offset in (0, 2):
        plain(base[offset : offset + 6].detach().requires_grad_())
    assert plain.cache_info()["traces"] == 1  # no as_strided: one plan for every offset


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=str)
def test_sdpa_with_dropout_draws_the_same_mask(policy: Any) -> None:
    """SDPA's dropout on CPU is `empty_like(...).bernoulli_(p)`: made functional."""
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=D) for _ in range(3))

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3).pow(2).sum()

    assert_close(_backward(remat(f, policy=policy), q, k, v), _backward(f, q, k, v))
    assert_close(_grads(remat(f, policy=policy), q, k, v), _grads(f, q, k, v))


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=str)
def test_multi_head_attention_with_dropout(policy: Any) -> None:
    mha = torch.nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True, dtype=D)
    x = torch.randn(2, 5, 8, dtype=D)

    def f(x: torch.Tensor) -> torch.Tensor:
        out, weights = mha(x, x, x, need_weights=True)
        return out.pow(2).sum() + weights.sum()

    def g(x: torch.Tensor) -> torch.Tensor:
        return mha(x, x, x, need_weights=False)[0].pow(2).sum()

    for fn in (f, g):
        assert_close(_backward(remat(fn, policy=policy), x), _backward(fn, x))


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=str)
def test_rrelu_in_training(policy: Any) -> None:
    """rrelu_with_noise writes its noise in place, and its functional form's derivative
    reads the noise it was given (zero gradients)."""
    f = lambda x: F.rrelu(x, 0.1, 0.3, training=True).pow(2).sum()  # noqa: E731
    x = torch.randn(4, 5, dtype=D)
    assert_close(_backward(remat(f, policy=policy), x), _backward(f, x))
    assert_close(_grads(remat(f, policy=policy), x), _grads(f, x))


ELEMENTWISE_UNDER_VMAP = {
    "silu": F.silu,
    "mish": F.mish,
    "atanh": lambda h: torch.atanh(torch.tanh(h) * 0.9),
    "logit": lambda h: torch.logit(torch.sigmoid(h), eps=1e-6),
    "quantile": lambda h: torch.quantile(h, torch.tensor([0.25, 0.5], dtype=D), dim=-1),
    "nanquantile": lambda h: torch.nanquantile(h, 0.3, dim=-1),
}


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=str)
@pytest.mark.parametrize("name", list(ELEMENTWISE_UNDER_VMAP))
def test_per_sample_gradients(name: str, policy: Any) -> None:
    """Backward formulas write in place into `*_like` buffers that vmap batches otherwise."""
    act = ELEMENTWISE_UNDER_VMAP[name]
    f = lambda w, x: act(x @ w).pow(2).sum()  # noqa: E731
    w, xs = torch.randn(4, 4, dtype=D), torch.randn(3, 2, 4, dtype=D)
    expected = vmap(grad(f), in_dims=(None, 0))(w, xs)
    if "quantile" in name and not torch_at_least("2.13"):  # torch 2.11's quantile checks values (aten.equal)
        with pytest.raises(RematTraceError, match="aten.equal"):
            vmap(grad(remat(f, policy=policy)), in_dims=(None, 0))(w, xs)
        return
    assert_close(vmap(grad(remat(f, policy=policy)), in_dims=(None, 0))(w, xs), expected)


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=str)
def test_rmsnorm_swiglu_under_grad_of_vmap(policy: Any) -> None:
    def block(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * p["g"]
        return (F.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]

    gen = torch.Generator().manual_seed(0)
    p = {k: torch.randn(s, dtype=D, generator=gen) for k, s in [("g", (8,)), ("gate", (8, 16)), ("up", (8, 16)), ("down", (16, 8))]}
    xs = torch.randn(3, 4, 8, dtype=D, generator=gen)

    def loss(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return lambda p: vmap(f, in_dims=(0, None))(xs, p).pow(2).sum()

    assert_close(grad(loss(remat(block, policy=policy)))(p), grad(loss(block))(p))


def _batch_norms() -> dict[str, Callable[..., torch.Tensor]]:
    return {
        "batch_norm": lambda x, rm, rv, w, b: F.batch_norm(x, rm, rv, w, b, training=True),
        "native_batch_norm": lambda x, rm, rv, w, b: torch.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)[0],
        "batch_norm_with_update": lambda x, rm, rv, w, b: torch.ops.aten._batch_norm_with_update(x, w, b, rm, rv, 0.1, 1e-5)[0],
        "instance_norm": lambda x, rm, rv, w, b: F.instance_norm(x, rm, rv, w, b, use_input_stats=True),
    }


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=str)
@pytest.mark.parametrize("name", list(_batch_norms()))
@pytest.mark.parametrize("transform", ["grad", "backward"])
def test_norms_with_running_statistics_closed_over(name: str, transform: str, policy: Any) -> None:
    """Running statistics captured by the function are updated once, bitwise as eager."""
    norm = _batch_norms()[name]
    x, w, b = torch.randn(4, 3, 5, dtype=D), torch.randn(3, dtype=D), torch.randn(3, dtype=D)

    def run(wrap: Callable[..., Any]) -> Any:
        rm, rv = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)
        f = wrap(lambda x, w, b: norm(x, rm, rv, w, b).sin().sum())
        result = (_grads if transform == "grad" else _backward)(f, x, w, b)
        return result, rm, rv

    actual, expected = run(lambda f: remat(f, policy=policy)), run(lambda f: f)
    assert_close(actual[0], expected[0])
    assert torch.equal(actual[1], expected[1]) and torch.equal(actual[2], expected[2])


def test_outputs_that_autograd_does_not_track_do_not_require_grad() -> None:
    a, b = torch.randn(3, dtype=D, requires_grad=True), torch.randn(3, dtype=D)

    def f(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            c = a * 3
        return a * 2, b.sin(), c, a.detach()

    assert [t.requires_grad for t in remat(f)(a, b)] == [t.requires_grad for t in f(a, b)] == [True, False, False, False]


def test_an_input_the_outputs_do_not_depend_on_gets_no_gradient() -> None:
    """As in eager: `.grad` stays None (and torch.func.grad gives zeros)."""
    f = lambda x, y: (x * 2).sum() + 0 * y.detach().sum()  # noqa: E731
    x, y = torch.randn(3, dtype=D, requires_grad=True), torch.randn(3, dtype=D, requires_grad=True)
    remat(f)(x, y).backward()
    assert x.grad is not None and y.grad is None
    assert_close(grad(remat(f), argnums=1)(x, y), grad(f, argnums=1)(x, y))


def test_index_fill_in_a_derivative_under_vmap() -> None:
    """trace's derivative fills an unbatched buffer with a batched value; torch's
    out-of-place batching rule for that ignores the batch (silently)."""
    f = lambda x: torch.trace(x * x)  # noqa: E731
    xs = torch.randn(3, 4, 4, dtype=D)
    assert_close(vmap(grad(remat(f)))(xs), vmap(grad(f))(xs))


def test_embedding_bag_lowers_to_the_differentiable_kernel() -> None:
    """Traced without grad, embedding_bag picks a forward-only kernel with no derivative."""
    weight = torch.randn(10, 3, dtype=D)
    index, offsets = torch.tensor([1, 2, 4, 5, 4, 3]), torch.tensor([0, 3])
    f = lambda w: F.embedding_bag(index, w, offsets, mode="mean").pow(2).sum()  # noqa: E731
    assert_close(_backward(remat(f), weight), _backward(f, weight))


@pytest.mark.parametrize("policy", [P.nothing_saveable, P.everything_saveable], ids=str)
def test_second_order_through_svd_under_nested_grad(policy: Any) -> None:
    """Second order needs the input that first order's backward (from U, V) did not."""
    f = lambda a: torch.linalg.svdvals(a).pow(3).sum()  # noqa: E731
    a, v = torch.randn(4, 3, dtype=D), torch.randn(4, 3, dtype=D)
    hvp = lambda g: grad(lambda a: (grad(g)(a) * v).sum())(a)  # noqa: E731
    assert_close(hvp(remat(f, policy=policy)), hvp(f))


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=str)
def test_double_backward_through_decompositions(policy: Any) -> None:
    def f(a: torch.Tensor) -> torch.Tensor:
        return torch.linalg.svdvals(a).pow(3).sum() + torch.linalg.eigvalsh(a @ a.T).pow(3).sum()

    def second_order(fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        a = torch.randn(4, 3, dtype=D, generator=torch.Generator().manual_seed(0)).requires_grad_()
        (g,) = torch.autograd.grad(fn(a), a, create_graph=True)
        return torch.autograd.grad((g * g).sum(), a)[0]

    assert_close(second_order(remat(f, policy=policy)), second_order(f), rtol=1e-7)


REFUSED = {
    "masked_select": (lambda x: torch.masked_select(x, x > 0).sum(), r"`aten.masked_select` returns a tensor whose shape depends"),
    "boolean index": (lambda x: x[x > 0].sum(), r"shape depends on the values"),
    "combinations": (lambda x: torch.combinations(x[0]).sum(), r"shape depends on the values"),
    "cov with weights": (
        lambda x: torch.cov(x, fweights=torch.tensor([1, 2, 1]), aweights=torch.tensor([0.5, 1.0, 2.0], dtype=D)).sum(),
        r"reads tensor values as a Python value",
    ),
    "lstsq": (lambda x: torch.linalg.lstsq(x, x[:, :1]).solution.sum(), r"`aten.linalg_lstsq`"),
    "gaussian_nll_loss": (lambda x: F.gaussian_nll_loss(x, x.detach(), x.detach().abs() + 1), r"reads tensor values"),
    "scatter_reduce prod": (
        lambda x: x.scatter_reduce(0, torch.tensor([[0, 1, 0], [1, 0, 1], [0, 0, 1]]), x, "prod").sum(),
        r"derivative of `aten.scatter_reduce`.*runs `aten._local_scalar_dense`",
    ),
    # the kernel reads a closed-over index tensor's data directly, not through an op
    "tensor_split with tensor indices": (
        lambda x: torch.tensor_split(x, torch.tensor([1, 2]))[0].sum(),
        r"data is not allocated(.|\n)*cannot run inside it",
    ),
}


# Refused only where autograd builds a graph of the backward (torch.func, create_graph=True):
# there its derivative is the formula that reads values; `.backward()` runs one that does not.
REFUSED_UNDER_TRANSFORMS = {"scatter_reduce prod"}


@pytest.mark.parametrize("name", list(REFUSED))
def test_value_dependent_ops_are_refused_naming_op_line_and_fix(name: str) -> None:
    f, message = REFUSED[name]
    x = torch.randn(3, 3, dtype=D, requires_grad=True)
    f(x).backward()  # eager runs it
    with pytest.raises(RematTraceError, match=message) as error:
        if name in REFUSED_UNDER_TRANSFORMS:
            torch.func.grad(remat(f))(x.detach())
        else:
            remat(f, fallback=False)(x).backward()
    assert "test_found_by_oracles.py:" in str(error.value) and "outside the remat'd function" in str(error.value)


@pytest.mark.parametrize("name", sorted(REFUSED_UNDER_TRANSFORMS))
def test_an_op_whose_graph_building_derivative_reads_values_runs_under_backward(name: str) -> None:
    f, _ = REFUSED[name]
    for x in (torch.randn(3, 3, dtype=D), torch.tensor([[0.0, 1, 2], [3, 0, 5], [6, 7, 0]], dtype=D)):
        expected, actual = x.clone().requires_grad_(), x.clone().requires_grad_()
        f(expected).backward()
        remat(f)(actual).backward()
        assert_close(actual.grad, expected.grad)


def test_sparse_inputs_replay_or_are_refused_naming_the_argument() -> None:
    s = torch.eye(3, dtype=D).to_sparse()
    x = torch.randn(3, 2, dtype=D, requires_grad=True)
    f = lambda s, x: (s @ x).sin().sum()  # noqa: E731
    with pytest.raises(RematError, match=r"argument s is a torch.sparse_coo tensor.*to_dense"):
        remat(f, fallback=False)(s, x)
    with pytest.warns(remat_package.RematFallbackWarning, match="torch.sparse_coo"):
        actual = torch.autograd.grad(remat(f)(s, x), x)
    assert torch.equal(actual[0], torch.autograd.grad(f(s, x), x)[0])


def test_an_op_with_integer_outputs() -> None:
    """max with indices: the integer output passes through, not differentiated."""
    f = lambda x: torch.max(x.sin(), dim=1)  # noqa: E731
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    (values, indices), (values_r, indices_r) = f(x), remat(f)(x)
    assert torch.equal(indices_r, indices) and not indices_r.requires_grad
    assert_close(torch.autograd.grad(values_r.sum(), x), torch.autograd.grad(values.sum(), x))
    (out, pullback, aux), (out_r, pullback_r, aux_r) = (
        vjp(lambda x: (g(x)[0], g(x)[1]), x.detach(), has_aux=True) for g in (f, remat(f))
    )
    assert torch.equal(aux_r, aux)
    assert_close(pullback_r(torch.ones(3, dtype=D)), pullback(torch.ones(3, dtype=D)))


NON_CONTIGUOUS_RANDOM = {
    "dropout": lambda x: F.dropout(x.transpose(0, 1), p=0.3, training=True),
    "bernoulli_": lambda x: torch.empty_like(x.transpose(0, 1)).bernoulli_(0.4) * x.transpose(0, 1),
    "uniform_": lambda x: torch.empty_like(x.permute(2, 0, 1)).uniform_() * x.permute(2, 0, 1),
    "sdpa dropout": lambda x: F.scaled_dot_product_attention(*(x.transpose(0, 1),) * 3, dropout_p=0.3),
}


@pytest.mark.parametrize("name", list(NON_CONTIGUOUS_RANDOM))
@pytest.mark.parametrize("transform", ["backward", "vjp", "vmap_different", "vmap_same"])
def test_random_fills_of_non_contiguous_tensors_draw_as_eager(name: str, transform: str) -> None:
    """In-place fills draw in memory order; eager dropout under torch.func draws in logical
    order. remat draws as eager code does in each case (a batch_first attention output is
    transposed, and dropout follows it). Not covered: a hand-written in-place fill of a
    non-contiguous tensor under vmap, whose order depends on vmap's physical layout."""
    if transform.startswith("vmap") and name.endswith("_"):
        pytest.skip("in-place fills of non-contiguous tensors under vmap: drawn in another order (README)")
    f = lambda x: NON_CONTIGUOUS_RANDOM[name](x).sin().sum()  # noqa: E731
    x = torch.randn(4, 2, 8, dtype=D)

    def run(g: Callable[..., torch.Tensor]) -> Any:
        torch.manual_seed(1)
        if transform == "backward":
            result = _backward(g, x)[:2]
        elif transform == "vjp":
            value, pullback = vjp(g, x)
            result = value, pullback(torch.ones((), dtype=D))
        else:
            xs = torch.stack([x, 2 * x])
            result = vmap(grad(g), randomness=transform.split("_")[1])(xs)
        return result, torch.rand(2)

    assert_close(run(remat(g := f)), run(g))
