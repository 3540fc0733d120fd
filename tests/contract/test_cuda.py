"""CUDA: fused attention, its dropout and autocast, against the same call without remat.

Skipped without a GPU. The structure these kernels have (integer outputs, philox seed and
offset tensors, a padded logsumexp) is also run on CPU-only machines, on the meta device
(tests/contract/test_layouts.py)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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
    return out.float(), [g.float() for g in grads], torch.cuda.get_rng_state()


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
        actual = _step(remat(_block, policy=POLICIES[policy]), x, p, dropout)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual[0], expected[0], rtol=tol, atol=tol)
    for a, e in zip(actual[1], expected[1]):
        torch.testing.assert_close(a, e, rtol=tol, atol=tol * e.abs().max().item())
    assert torch.equal(actual[2], expected[2])  # the CUDA random stream ends where it would


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

    actual, expected = run(remat(_block, policy=POLICIES[policy])), run(_block)
    torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=0)
    for a, e in zip(actual[1], expected[1]):
        torch.testing.assert_close(a, e, rtol=1e-3, atol=1e-3 * e.abs().max().item())
