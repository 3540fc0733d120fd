"""Offload: a policy's third answer. On CPU the host is both sides: values and gradients
must equal the same code without remat, and reports must say what waits in host memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from remat import RematError, checkpoint_name, remat, report
from remat import policies as P

from conftest import assert_close

D = torch.float64


def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = checkpoint_name(F.gelu(F.layer_norm(x, x.shape[-1:]) @ w1), "hidden")
    return torch.tanh(h @ w2 + x)


def _args(device: str = "cpu", dtype: torch.dtype = D) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 5, 8), (8, 16), (16, 8)]
    return [(torch.randn(*s, dtype=dtype, generator=gen) / 3).to(device).requires_grad_() for s in shapes]


OFFLOADING = {
    "dots": P.offload_dot_with_no_batch_dims(),
    "ops": P.offload_ops("aten::gelu", "aten::tanh"),
    "names": P.save_and_offload_only_these_names(names_which_can_be_saved=[], names_which_can_be_offloaded=["hidden"]),
    "names_and_dots": P.save_and_offload_only_these_names(names_which_can_be_saved=["hidden"], names_which_can_be_offloaded=[])
    | P.offload_dot_with_no_batch_dims(),
}


@pytest.mark.parametrize("name", list(OFFLOADING))
def test_values_and_gradients_as_without_remat(name: str) -> None:
    args = _args()
    f = remat(block, policy=OFFLOADING[name])
    loss = lambda g: lambda *a: g(*a).pow(2).sum()  # noqa: E731
    assert_close(torch.autograd.grad(loss(f)(*args), args), torch.autograd.grad(loss(block)(*args), args))
    cotangent = torch.randn(3, 5, 8, dtype=D)
    assert_close(torch.func.vjp(f, *args)[1](cotangent), torch.func.vjp(block, *args)[1](cotangent))
    x, w1, w2 = (a.detach() for a in args)
    per_sample = torch.func.vmap(torch.func.grad(loss(f), argnums=1), in_dims=(0, None, None))
    assert_close(per_sample(x, w1, w2), torch.func.vmap(torch.func.grad(loss(block), argnums=1), in_dims=(0, None, None))(x, w1, w2))
    assert_close(torch.func.jacrev(f, argnums=2)(x[:1], w1, w2), torch.func.jacrev(block, argnums=2)(x[:1], w1, w2))


def test_reports_say_what_waits_in_host_memory() -> None:
    args = _args()
    found = report(remat(block, policy=P.offload_dot_with_no_batch_dims()), *args)
    offloaded = [r for r in found.residuals if r.kind == "offloaded"]
    assert [P.op_key(r.op) for r in offloaded] == ["aten::mm", "aten::mm"]  # both x @ W matmuls
    assert found.offloaded_bytes == sum(r.nbytes for r in offloaded) == (15 * 16 + 15 * 8) * 8  # float64 [15, 16] and [15, 8]
    assert found.kept_bytes == sum(r.nbytes for r in found.residuals if r.kind == "input")
    assert "offloaded to host memory" in str(found)
    kept = report(remat(block, policy=P.dots_with_no_batch_dims_saveable), *args)
    assert [r.kind for r in kept.residuals if r.kind != "input"] == ["intermediate", "intermediate"]


def test_a_value_on_another_device_than_src_is_kept_where_it_is() -> None:
    policy = P.offload_dot_with_no_batch_dims(offload_src="cuda")
    kinds = {r.kind for r in report(remat(block, policy=policy), *_args()).residuals}
    assert kinds == {"input", "intermediate"}


def test_second_order_through_offloaded_values() -> None:
    """Nested torch.func transforms: remat sees the nesting and keeps the values instead,
    exactly. A backward of a backward through an offloaded value is refused."""
    x, w1, w2 = (a.detach() for a in _args())
    f = remat(block, policy=P.offload_dot_with_no_batch_dims())

    def second(g: Any) -> Any:
        return torch.func.grad(lambda w: torch.func.grad(lambda w: g(x, w, w2).pow(2).sum())(w).pow(2).sum())(w1)

    assert_close(second(f), second(block))
    w = w1.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(x, w, w2).pow(2).sum(), w, create_graph=True)
    with pytest.raises(RematError, match="offloaded to host memory"):
        g.pow(2).sum().backward()


def test_offload_policies_check_their_arguments() -> None:
    with pytest.raises(ValueError, match="both saved and offloaded"):
        P.save_and_offload_only_these_names(names_which_can_be_saved=["a"], names_which_can_be_offloaded=["a"])
    assert repr(P.offload_ops("aten::mm")) == "offload_ops(aten::mm)"
    assert P.offload_dot_with_no_batch_dims() == P.offload_dot_with_no_batch_dims()  # a cache key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_offloaded_values_wait_in_pinned_host_memory() -> None:
    args = _args("cuda", torch.float32)
    f = remat(block, policy=P.offload_dot_with_no_batch_dims(offload_src="cuda"))
    out = f(*args)
    host = [t for t in out.grad_fn.saved_tensors if t.device.type == "cpu"]
    assert len(host) == 2 and all(t.is_pinned() for t in host)
    expected = torch.autograd.grad(block(*args).sum(), args)
    assert_close(torch.autograd.grad(out.sum(), args), expected, rtol=1e-5, atol=1e-6)


def test_a_sparse_kept_value_stays_where_it_is() -> None:
    """Found by the OpInfo sweep (to_sparse under an offload-everything policy)."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.to_sparse() * 2).to_dense().sin()

    x = torch.randn(4, 3, dtype=D, requires_grad=True)
    g = remat(f, policy=lambda op, *args, **kwargs: P.Offload())
    assert_close(torch.autograd.grad(g(x).sum(), x), torch.autograd.grad(f(x).sum(), x))
