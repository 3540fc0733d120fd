"""Low precision is bitwise, as eager: bfloat16 and float16 parameters, and float32 under
bfloat16 autocast, compared with torch.equal against the same code without remat.

remat's graphs run the ops eager autograd runs, in the same dtypes and order: `.backward()`
gets the derivatives `.backward()` runs (SiLU's fused `silu_backward`, not the composite
formula a graph-building backward uses), autocast's casts are where eager puts them (one
cast of a parameter per region, as autocast's cache makes it), and a region's graphs are
never autocast twice.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator, Sequence

import pytest
import torch
import torch.nn.functional as F

import model_zoo as Z
import remat
from remat import policies as P

POLICIES = {"none": None, "nothing": P.nothing_saveable, "everything": P.everything_saveable, "dots": P.dots_saveable}


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """torch's deterministic kernels: the MoE experts' gather backward accumulates repeated
    indices in parallel otherwise, and eager code itself then differs from run to run."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _bitwise(actual: Any, expected: Any) -> None:
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype and torch.equal(a, e), f"{a.dtype}: differs by {(a.float() - e.float()).abs().max()}"


def _block(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    h = F.silu(x @ w)
    h = F.layer_norm(F.gelu(h), (h.shape[-1],), g)
    return torch.softmax(h @ w.t(), -1) + F.mish(h).sigmoid() + F.softplus(h).tanh()


OPS: dict[str, Callable[..., torch.Tensor]] = {
    "silu": lambda x, w, g: F.silu(x),
    "gelu": lambda x, w, g: F.gelu(x, approximate="tanh"),
    "mish": lambda x, w, g: F.mish(x),
    "layer_norm": lambda x, w, g: F.layer_norm(x, (x.shape[-1],), g),
    "rms_norm": lambda x, w, g: F.rms_norm(x, (x.shape[-1],), g),
    "log_softmax": lambda x, w, g: F.log_softmax(x @ w, -1),
    "sdpa": lambda x, w, g: F.scaled_dot_product_attention(x[None], x[None], (x @ w)[None], is_causal=True)[0],
    "block": _block,
}


def _grads(fn: Callable[..., torch.Tensor], dtype: torch.dtype, autocast: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    leaf_dtype = torch.float32 if autocast else dtype
    x, w, g = (torch.randn(*shape, generator=gen).to(leaf_dtype).requires_grad_() for shape in ((6, 16), (16, 16), (16,)))
    if autocast:
        with torch.autocast("cpu", dtype=dtype):
            out = fn(x, w, g)
    else:
        out = fn(x, w, g)
    cotangent = torch.randn(out.shape, generator=gen).to(out.dtype)
    return [out.detach(), *torch.autograd.grad(out, [x, w, g], cotangent, allow_unused=True, materialize_grads=True)]


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("dtype, autocast", [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)], ids=["bf16", "fp16", "bf16-autocast"])
@pytest.mark.parametrize("op", list(OPS))
def test_low_precision_ops_are_bitwise(op: str, dtype: torch.dtype, autocast: bool, policy_name: str) -> None:
    fn = OPS[op]
    _bitwise(_grads(remat.remat(fn, policy=POLICIES[policy_name]), dtype, autocast), _grads(fn, dtype, autocast))


def test_torch_s_cpu_autocast_checkpoint_case_is_bitwise() -> None:
    """torch's own test of checkpointing under CPU bf16 autocast, as a user writes it: three
    matmuls reusing their inputs (one of them three times), gradients compared bitwise."""
    def foo(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = torch.mm(x, y)
        y = torch.mm(x, z)
        z = torch.mm(z, z)
        return z, x, y

    def run(fn: Callable[..., Any]) -> list[torch.Tensor]:
        torch.manual_seed(0)
        leaves = [torch.randn(3, 3, requires_grad=True) for _ in range(3)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = fn(*leaves)
            sum(o.sum() for o in outs).backward()  # inside the autocast region, as torch's test does
        return [o.detach() for o in outs] + [leaf.grad for leaf in leaves]

    for policy in POLICIES.values():
        _bitwise(run(remat.remat(foo, policy=policy)), run(foo))


def test_sdpa_with_dropout_under_autocast_is_bitwise() -> None:
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)

    def run(fn: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 2, 8, 16, requires_grad=True) for _ in range(3))
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(q, k, v)
        out.float().pow(2).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad, torch.rand(2)]  # type: ignore[list-item]

    for policy in POLICIES.values():
        _bitwise(run(remat.remat(attention, policy=policy)), run(attention))


def _gradients(
    loss: Callable[..., torch.Tensor], transform: str, batched: Sequence[torch.Tensor], unbatched: Sequence[torch.Tensor] = ()
) -> Any:
    """Every input's gradient of `loss` under `transform`: `.backward()` and grad on the first
    element of each `batched` input, vmap(grad) over all of them (`unbatched` as they are)."""
    first = [b[0] for b in batched]
    argnums = tuple(range(len(batched) + len(unbatched)))
    if transform == "grad":
        return torch.func.grad(loss, argnums=argnums)(*first, *unbatched)
    if transform == "vmap_grad":
        in_dims = (0,) * len(batched) + (None,) * len(unbatched)
        return torch.func.vmap(torch.func.grad(loss, argnums=argnums), in_dims=in_dims)(*batched, *unbatched)
    leaves = [t.clone().requires_grad_() for t in (*first, *unbatched)]
    loss(*leaves).backward()
    return tuple(leaf.grad for leaf in leaves)


@pytest.mark.parametrize("transform", ["backward", "grad", "vmap_grad"])
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_an_input_autocast_casts_twice_under_a_transform_is_bitwise(policy_name: str, transform: str) -> None:
    """Under torch.func, a transform's input is a leaf that requires grad, which eager
    autocast casts once for all its uses (its cast cache), as it does a parameter: `x`
    here feeds a matmul and a module's Linear, whose gradients sum in bf16 before one cast."""
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU())
    xs, ws, cotangent = torch.randn(2, 3, 4), torch.randn(2, 4, 4), torch.randn(3, 4)

    def body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w + layer(x)

    def run(fn: Callable[..., torch.Tensor]) -> Any:
        def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = fn(x, w)
            return (out * cotangent).sum()

        return _gradients(loss, transform, (xs, ws))

    _bitwise(run(remat.remat(body, policy=POLICIES[policy_name])), run(body))


def _inside_one_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return torch.addmm(x, x, w)  # x cast once, for both uses


def _inside_two_blocks(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = x @ w
    scaled = a.float() * 2  # between the blocks: the cache is dropped, x is cast again
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return scaled + x @ w.t()


def _inside_a_disabled_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = x @ w
        with torch.autocast("cpu", enabled=False):
            b = a.float().sin()  # still one cache lifetime
        return b + x @ w.t()


def _first_cast_without_grad(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            a = F.linear(x, w)  # a cast of x made with grad off: later casts do not read it
        return F.linear(x, w) * a


def _a_cast_without_grad_between(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = x @ w
        with torch.no_grad():
            b = x @ w.t()
        return a * b + x @ w


@pytest.mark.parametrize("transform", ["backward", "grad", "vmap_grad"])
@pytest.mark.parametrize(
    "fn",
    [
        _inside_one_block, _inside_two_blocks, _inside_a_disabled_block,
        _first_cast_without_grad, _a_cast_without_grad_between,
    ],
    ids=lambda f: f.__name__,
)
def test_autocast_blocks_inside_a_region_cast_as_eager_caches(fn: Callable[..., torch.Tensor], transform: str) -> None:
    """Autocast's cast cache lives from the first open context to the last close: a leaf
    used twice in one lifetime is cast once, in two lifetimes twice, as in eager; a cast
    made under `no_grad` is not the one later differentiable uses read."""
    torch.manual_seed(0)
    xs, ws, cotangent = torch.randn(2, 3, 4), torch.randn(2, 4, 4), torch.randn(3, 4)

    def run(f: Callable[..., torch.Tensor]) -> Any:
        return _gradients(lambda x, w: (f(x, w).float() * cotangent).sum(), transform, (xs, ws))

    for policy in POLICIES.values():
        _bitwise(run(remat.remat(fn, policy=policy)), run(fn))


@pytest.mark.parametrize("transform", ["backward", "grad", "vmap_grad"])
@pytest.mark.parametrize("cache", [None, True], ids=["cache-default", "cache-enabled"])
def test_a_weight_two_linears_share_under_autocast_is_bitwise(cache: bool | None, transform: str) -> None:
    """`.backward()` casts the shared weight once (autocast's cache); under torch.func,
    `linear` runs as a matmul with the weight's transpose, a view the cache skips, so each
    use casts it again. An explicit `cache_enabled=True` inside changes nothing in the trace."""
    torch.manual_seed(0)
    xs, ys, w0, cotangent = torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(4, 4), torch.randn(3, 4)

    def body(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            return F.linear(x, w) + F.linear(F.layer_norm(y, (4,)), w)

    def run(fn: Callable[..., torch.Tensor]) -> Any:
        return _gradients(lambda x, y, w: (fn(x, y, w).float() * cotangent).sum(), transform, (xs, ys), (w0,))

    for policy in POLICIES.values():
        _bitwise(run(remat.remat(body, policy=policy)), run(body))


def _attention(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    q, k, v = x @ w, x @ w.t(), x * 2  # x used three times
    return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


def _squares(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * x) @ w  # x twice in one op: autograd adds self's gradient, then other's


def _stacked(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.stack([x, x @ w]).tanh().sum(0) @ w  # one use inside a list argument


def _around_a_region(region: Callable[..., torch.Tensor], order: str) -> Callable[..., torch.Tensor]:
    """The region's input used outside it too, its gradient reached from outside before
    the region's ("residual after": `x + f(x)`) or after ("used before": `x.sin()` first)."""

    def model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if order == "residual after":
            return x + region(x, w)
        before = (x * 3).sin()
        return before.sum(-1, keepdim=True) * region(x, w)

    return model


@pytest.mark.parametrize("transform", ["backward", "grad", "vmap_grad"])
@pytest.mark.parametrize("order", ["residual after", "used before"])
@pytest.mark.parametrize("dtype, autocast", [(torch.bfloat16, False), (torch.bfloat16, True)], ids=["bf16", "bf16-autocast"])
@pytest.mark.parametrize("fn", [_attention, _squares, _stacked], ids=lambda f: f.__name__)
def test_an_input_used_inside_and_outside_a_region_gets_eager_s_gradient(
    fn: Callable[..., torch.Tensor], dtype: torch.dtype, autocast: bool, order: str, transform: str
) -> None:
    """Autograd adds the gradient contributions of a value one at a time, as the ops using
    it finish their backward: `x + f(x)` with x used three times in f sums
    ((outside + use 1) + use 2) + use 3. A region that summed its own contributions first
    would round differently in low precision; remat hands autograd one gradient per use."""
    torch.manual_seed(0)
    xs = torch.randn(2, 5, 8).to(torch.float32 if autocast else dtype)
    ws = torch.randn(2, 8, 8).to(xs.dtype) * 0.3
    cotangent = torch.randn(5, 8)

    def run(region: Callable[..., torch.Tensor]) -> Any:
        model = _around_a_region(region, order)

        def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                out = model(x, w)
            return (out.float() * cotangent).sum()

        return _gradients(loss, transform, (xs, ws))

    expected = run(fn)
    for policy in POLICIES.values():
        _bitwise(run(remat.remat(fn, policy=policy)), expected)


def _chain_read_later(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An output that feeds another (remat runs two Functions, the second's backward
    first); the second part reads x after the first part does."""
    v1 = torch.reciprocal(1 + x * x)
    return v1 + torch.tanh(x @ w), v1


def _chain_read_earlier(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same, the second part reading x before the first part does."""
    m = torch.maximum(x, x.flip(-1))
    t = x * 2
    t.add_(x)
    return t + torch.sigmoid(m @ w), t


@pytest.mark.parametrize("transform", ["backward", "grad", "vmap_grad"])
@pytest.mark.parametrize("fn", [_chain_read_later, _chain_read_earlier], ids=lambda f: f.__name__)
def test_an_input_read_by_both_parts_of_a_chained_region_gets_eager_s_gradient(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], transform: str
) -> None:
    """Eager adds x's contributions in the reverse order of the reads; a chained region's
    second Function hands autograd its contributions first. Where that is eager's order
    too, one gradient per use; where it is not, one sum per part (two terms add alike in
    either order)."""
    torch.manual_seed(1)
    xs = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    ws = torch.randn(2, 4, 4, dtype=torch.bfloat16) * 0.5
    cotangent = torch.randn(3, 4)

    def run(region: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Any:
        return _gradients(lambda x, w: (region(x, w)[0].float() * cotangent).sum(), transform, (xs, ws))

    expected = run(fn)
    for policy in POLICIES.values():
        _bitwise(run(remat.remat(fn, policy=policy)), expected)


def _chain_interleaved(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An output (`v`) that feeds another, x read four times, by the other output before
    and after `v`'s read: eager adds `v`'s term between the others."""
    before = x.t().reshape(x.shape)
    v = torch.atan(x)
    return before + F.layer_norm(x, x.shape[-1:], v[0], v[1]) + x * w, v


@pytest.mark.parametrize("transform", ["grad", "vmap_grad"])
def test_outputs_feeding_outputs_under_a_transform_add_gradient_terms_in_eager_s_order(transform: str) -> None:
    """Under a torch.func transform, which takes no gradient with respect to an output, such
    a region stays one autograd node, whose gradient terms come in eager's order (two
    nodes would add each node's terms first: with three or more terms, another rounding)."""
    torch.manual_seed(0)
    xs = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    ws = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    cotangent = torch.randn(3, 4, dtype=torch.bfloat16)

    def run(region: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Any:
        return _gradients(lambda x, w: (region(x, w)[0] * cotangent).sum(), transform, (xs, ws))

    expected = run(_chain_interleaved)
    for policy in POLICIES.values():
        _bitwise(run(remat.remat(_chain_interleaved, policy=policy)), expected)


def _chain_sharing_an_intermediate(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An output (`v`) that feeds another, and an intermediate (`h`) both parts read."""
    h = x @ w
    v = h * 0.6
    return torch.softmax(h @ v.t() / 2, -1) @ v, v


@pytest.mark.parametrize("transform", ["backward", "grad", "vmap_grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_intermediate_both_parts_of_a_chained_region_read_gets_eager_s_gradient(
    dtype: torch.dtype, transform: str
) -> None:
    """Eager sums the gradients of an intermediate both parts read before one backward of
    the op that made it; computed by each part, `x` and `w` would get two products added,
    rounded otherwise (found by the random-program tester, seed 94188)."""
    torch.manual_seed(2)
    xs, ws = torch.randn(2, 3, 4, dtype=dtype), torch.randn(2, 4, 4, dtype=dtype) * 0.5
    cotangent, other = torch.randn(3, 4, dtype=dtype), torch.randn(3, 4, dtype=dtype)

    def run(region: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Any:
        def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            out, v = region(x, w)
            return (out * cotangent).sum() + (v * other).sum()

        return _gradients(loss, transform, (xs, ws))

    expected = run(_chain_sharing_an_intermediate)
    for policy in POLICIES.values():
        _bitwise(run(remat.remat(_chain_sharing_an_intermediate, policy=policy)), expected)


@pytest.mark.models
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen3_moe"])
def test_transformers_models_with_bf16_parameters_are_bitwise(name: str) -> None:
    """Loss and every gradient of a bf16 model through checkpoint_layers (dropout on)."""
    torch.manual_seed(0)
    reference = getattr(Z, name)("sdpa").to(torch.bfloat16)
    model = copy.deepcopy(reference)
    remat.checkpoint_layers(model.model.layers, P.nothing_saveable)
    ids = torch.randint(0, Z.VOCAB, (Z.BATCH, Z.SEQ), generator=torch.Generator().manual_seed(3))

    def step(m: torch.nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(1)
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return [out.loss.detach(), *(p.grad for p in m.parameters())]

    with _deterministic():
        _bitwise(step(model), step(reference))


@pytest.mark.models
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen3_moe", "vit"])
def test_float32_models_under_bf16_autocast_are_bitwise(name: str) -> None:
    """Loss and every gradient of a float32 model trained under CPU bf16 autocast, layers
    through checkpoint_layers (dropout on), backward outside the autocast block as
    PyTorch advises: transformers models and a timm-style ViT."""
    torch.manual_seed(0)
    if name == "vit":
        reference: torch.nn.Module = Z.TinyViT().float().train()
        layers = lambda m: m.blocks  # noqa: E731
        images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
        target = torch.tensor([1, 7])
        forward = lambda m: F.cross_entropy(m(images), target)  # noqa: E731
    else:
        reference = getattr(Z, name)("sdpa").float()
        layers = lambda m: m.model.layers  # noqa: E731
        ids = torch.randint(0, Z.VOCAB, (Z.BATCH, Z.SEQ), generator=torch.Generator().manual_seed(3))
        forward = lambda m: m(input_ids=ids, labels=ids).loss  # noqa: E731
    model = copy.deepcopy(reference)
    remat.checkpoint_layers(layers(model), P.nothing_saveable)

    def step(m: torch.nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward(m)
        loss.backward()
        return [loss.detach(), *(p.grad for p in m.parameters() if p.grad is not None)]

    with _deterministic():
        _bitwise(step(model), step(reference))


def _kept_and_read_twice(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x` read by three ops, `h` kept by every policy but None and read by two."""
    h = x @ w
    return (h * x).sum(1, keepdim=True) * h


def _recomputed_before_kept(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`tanh(x)`, which dots_saveable recomputes, leads to `tanh(x) @ w`, which it keeps."""
    h = torch.tanh(x)
    return torch.tanh(h @ w) * h


def _view_of_kept(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A view of kept `h` saved by bmm, `h` read again."""
    h = x @ w
    return torch.bmm(h.unsqueeze(1), w.expand(4, 4, 4)).squeeze(1) * h


def _views_of_an_input_as_weights(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Views of the input `x` as layer_norm's weight and bias (saved by it), under a kept value."""
    return torch.tanh(F.layer_norm(x, (4,), x[0], x[1])) @ w


_BIAS = torch.randn(4, generator=torch.Generator().manual_seed(7)).requires_grad_()


def _through_a_biased_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A captured bias, which no first-order backward reads, under a kept matmul whose
    input backward recomputes: a double backward recomputes that matmul from the bias."""
    return F.gelu(F.linear(torch.square(x), w, _BIAS)) + torch.sigmoid(x)


def _second_order(region: Callable[..., torch.Tensor], transform: str, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x, w, cotangent, tx, tw = (torch.randn(4, 4, generator=gen) for _ in range(5))

    def first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if transform == "grad_grad":
            gx, gw = torch.func.grad(lambda x, w: (region(x, w) * cotangent).sum(), argnums=(0, 1))(x, w)
        else:
            gx, gw = torch.autograd.grad((region(x, w) * cotangent).sum(), (x, w), create_graph=True)
        return (gx * tx).sum() + (gw * tw).sum()

    if transform == "grad_grad":
        return torch.func.grad(first, argnums=(0, 1))(x, w)  # type: ignore[no-any-return]
    x.requires_grad_(), w.requires_grad_()
    return torch.autograd.grad(first(x, w), (x, w))


@pytest.mark.parametrize("transform", ["double_backward", "grad_grad"])
def test_a_second_order_gradient_through_kept_values_adds_an_input_s_terms_one_by_one(transform: str) -> None:
    """A backward of a backward gives each of an input's uses in the region its own
    gradient, as first order does, so that autograd adds them one by one after the terms
    from the first backward's ops, as eager code does: bitwise in float32 (one sum inside
    the region's node rounded otherwise in almost every seed)."""
    for seed in range(3):
        expected = _second_order(_kept_and_read_twice, transform, seed)
        for policy in POLICIES.values():
            _bitwise(_second_order(remat.remat(_kept_and_read_twice, policy=policy), transform, seed), expected)


@pytest.mark.parametrize("transform", ["double_backward", "grad_grad"])
@pytest.mark.parametrize(
    "fn",
    [_recomputed_before_kept, _view_of_kept, _views_of_an_input_as_weights, _through_a_biased_linear],
    ids=lambda f: f.__name__,
)
def test_a_second_order_gradient_meets_each_value_s_terms_in_one_node_as_eager(
    fn: Callable[..., torch.Tensor], transform: str
) -> None:
    """Where backward recomputes a value that a kept value is computed from (a view
    included), the value would be two nodes in a gradient of a gradient, each summing its
    own second-order terms: a backward that is differentiated again reads no such kept
    value, so the terms meet in one node as in eager: bitwise in float32 under every
    policy (without it, all but None differ in most seeds)."""
    policies = [*POLICIES.values(), P.dots_with_no_batch_dims_saveable, P.memory_budget(0.5)]
    for seed in range(3):
        expected = _second_order(fn, transform, seed)
        for policy in policies:
            _bitwise(_second_order(remat.remat(fn, policy=policy), transform, seed), expected)


def test_a_double_backward_whose_input_changed_since_reads_the_kept_values_instead() -> None:
    """A double backward recomputes from an input first order did not keep only while it
    is unchanged: a bias changed in place after the forward (eager's backward never reads
    it) leaves the kept values read, as before, within float32 rounding, and no error."""
    bias = _BIAS.detach().clone().requires_grad_()

    def region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.gelu(F.linear(torch.square(x), w, bias)) + torch.sigmoid(x)

    def run(f: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            bias.copy_(_BIAS)
        gen = torch.Generator().manual_seed(0)
        x, w, cotangent, tx = (torch.randn(4, 4, generator=gen).requires_grad_() for _ in range(4))
        gx, gw = torch.autograd.grad((f(x, w) * cotangent).sum(), (x, w), create_graph=True)
        with torch.no_grad():
            bias.add_(0.0)  # a new version, the same values
        return torch.autograd.grad((gx * tx).sum() + gw.sum(), (x, w))

    expected = run(region)
    for policy in (P.dots_saveable, P.everything_saveable):
        torch.testing.assert_close(run(remat.remat(region, policy=policy)), expected, rtol=1e-5, atol=1e-6)
