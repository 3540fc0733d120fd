"""CUDA: fused attention, its dropout and autocast, against the same call without remat.

Skipped without a GPU. The structure these kernels have (integer outputs, philox seed and
offset tensors, a padded logsumexp) is also run on CPU-only machines, on the meta device
(tests/contract/test_layouts.py)."""

from __future__ import annotations

from typing import Any, Callable

import optree
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from remat import policies as P
from remat import remat

from conftest import BUILT_IN_POLICIES

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.filterwarnings("ignore::remat.RematPolicyWarning"),
]

POLICIES = BUILT_IN_POLICIES
BACKENDS = {
    "flash": (SDPBackend.FLASH_ATTENTION, torch.bfloat16),
    "efficient": (SDPBackend.EFFICIENT_ATTENTION, torch.float32),
    "efficient_half": (SDPBackend.EFFICIENT_ATTENTION, torch.float16),
    "cudnn": (SDPBackend.CUDNN_ATTENTION, torch.bfloat16),
    "math": (SDPBackend.MATH, torch.float32),
}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def _block(x: torch.Tensor, p: dict[str, torch.Tensor], dropout: float) -> torch.Tensor:
    """A GPT block: layer norm, qkv projection, causal SDPA, output projection, MLP."""
    b, t, d = x.shape
    h = F.layer_norm(x, (d,))
    q, k, v = (h @ p["qkv"]).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4).unbind(0)
    a = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
    x = x + a.transpose(1, 2).reshape(b, t, d) @ p["out"]
    return x + F.gelu(F.layer_norm(x, (d,)) @ p["up"]) @ p["down"]


def _params(d: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"qkv": (d, 3 * d), "out": (d, d), "up": (d, 4 * d), "down": (4 * d, d)}
    return {k: (torch.randn(s, device="cuda", generator=gen) / s[0] ** 0.5).to(dtype) for k, s in shapes.items()}


def _step(f: Callable[..., torch.Tensor], x: torch.Tensor, p: dict[str, torch.Tensor], dropout: float) -> Any:
    torch.manual_seed(0)
    leaves = [x.clone().requires_grad_(), *(v.clone().requires_grad_() for v in p.values())]
    out = f(leaves[0], dict(zip(p, leaves[1:])), dropout)
    grads = torch.autograd.grad(out.float().pow(2).mean(), leaves)
    return [out.float()], [g.float() for g in grads], [torch.cuda.get_rng_state()]


def _assert_matches(actual: Any, expected: Any, again: Any, dtype: torch.dtype) -> None:
    """Results as (outputs, gradients, random state): bitwise where eager is deterministic
    (two eager runs agree bit for bit), else within the dtype's tolerance (kernels whose
    backward accumulates with atomics), the random state always bitwise."""
    flat = [optree.tree_leaves(r) for r in (actual, expected, again)]
    if all(torch.equal(e, g) for e, g in zip(flat[1], flat[2], strict=True)):
        assert all(torch.equal(a, e) for a, e in zip(flat[0], flat[1], strict=True)), "eager is deterministic: bitwise"
        return
    tol = TOLERANCE[dtype]
    for a, e in zip(actual[0], expected[0], strict=True):
        torch.testing.assert_close(a, e, rtol=tol, atol=tol)
    for a, e in zip(actual[1], expected[1], strict=True):
        torch.testing.assert_close(a, e, rtol=tol, atol=tol * e.abs().max().item())
    # the random stream ends where it would
    assert all(torch.equal(a, e) for a, e in zip(actual[2], expected[2], strict=True))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_gpt_block_on_each_attention_kernel(backend: str, policy: str, dropout: float) -> None:
    kernel, dtype = BACKENDS[backend]
    x = torch.randn(2, 64, 64, device="cuda", dtype=dtype)
    p = _params(64, dtype)
    with sdpa_kernel(kernel):
        try:
            expected = _step(_block, x, p, dropout)
        except RuntimeError as error:  # this GPU or build lacks the kernel for these inputs
            pytest.skip(f"{backend} without remat: {error}")
        again = _step(_block, x, p, dropout)
        actual = _step(remat(_block, policy=POLICIES[policy]), x, p, dropout)
    _assert_matches(actual, expected, again, dtype)


TRANSFORMS = {
    "grad": lambda loss: torch.func.grad(loss, argnums=(0, 1)),
    "vmap_grad": lambda loss: torch.func.vmap(torch.func.grad(loss, argnums=1), in_dims=(0, None)),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_gpt_block_on_each_attention_kernel_under_torch_func(backend: str, policy: str, transform: str) -> None:
    """grad and per-sample grad through each fused kernel, as the same transform without remat."""
    kernel, dtype = BACKENDS[backend]
    shape = (2, 1, 64, 64) if transform == "vmap_grad" else (2, 64, 64)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    p = _params(64, dtype)

    def run(f: Callable[..., torch.Tensor]) -> Any:
        loss = lambda x, p: f(x, p, 0.0).float().pow(2).mean()  # noqa: E731
        out = TRANSFORMS[transform](loss)(x, p)
        return [], [t.float() for t in optree.tree_leaves(out)], []

    with sdpa_kernel(kernel):
        try:
            expected = run(_block)
        except RuntimeError as error:  # no such kernel here, or none under this transform
            pytest.skip(f"{backend} under {transform} without remat: {error}")
        again = run(_block)
        actual = run(remat(_block, policy=POLICIES[policy]))
    _assert_matches(actual, expected, again, dtype)


@pytest.mark.parametrize("policy", ["none", "dots", "everything"])
def test_per_sample_gradients_through_fused_attention(policy: str) -> None:
    p = _params(64, torch.float32)
    xs = torch.randn(3, 1, 32, 64, device="cuda")

    def per_sample(f: Callable[..., torch.Tensor]) -> Any:
        loss = lambda p, x: f(x, p, 0.0).pow(2).mean()  # noqa: E731
        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(p, xs)

    expected = per_sample(_block)
    torch.testing.assert_close(per_sample(remat(_block, policy=POLICIES[policy])), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("policy", ["none", "dots", "everything"])
def test_autocast_gradients_equal_no_remat(dtype: torch.dtype, policy: str) -> None:
    x = torch.randn(2, 32, 64, device="cuda")
    p = _params(64, torch.float32)

    def run(f: Callable[..., torch.Tensor]) -> Any:
        with torch.autocast("cuda", dtype=dtype):
            return _step(f, x, p, 0.0)

    expected, again = run(_block), run(_block)
    actual = run(remat(_block, policy=POLICIES[policy]))
    torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=0)  # outputs
    _assert_matches(actual, expected, again, dtype)


def test_offload_copies_on_the_side_stream_keep_every_value() -> None:
    """Offloaded values copied out and back on a side stream while the compute stream is
    busy: the gradients must equal, bit for bit, those of keeping the same values on the
    device (same kernels, same order), so a copy racing a kernel cannot hide."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    d = 1024
    ws = [torch.randn(d, d, device="cuda", generator=gen) / d**0.5 for _ in range(8)]
    x = torch.randn(4096, d, device="cuda", generator=gen)

    def stack(x: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        for w in ws:
            x = x + F.gelu(F.layer_norm(x, (d,)) @ w)
        return x

    def grads(f: Callable[..., torch.Tensor]) -> Any:
        leaves = [x.clone().requires_grad_(), *(w.clone().requires_grad_() for w in ws)]
        out = f(*leaves)
        return torch.autograd.grad(out.pow(2).mean(), leaves)

    kept = grads(remat(stack, policy=P.dots_with_no_batch_dims_saveable))
    offloaded_fn = remat(stack, policy=P.offload_dot_with_no_batch_dims(offload_src="cuda"))
    for _ in range(3):  # the side stream's copies of one call must not race the next call's kernels
        offloaded = grads(offloaded_fn)
        assert all(torch.equal(a, b) for a, b in zip(offloaded, kept, strict=True))
    expected = grads(stack)
    for a, e in zip(offloaded, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4 * e.abs().max().item())
