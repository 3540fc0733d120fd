"""The policy vocabulary: values, matching by op packet, names, batch dims."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from remat import checkpoint_name, remat, report, saved_residuals
from remat import policies as P

from conftest import assert_close

D = torch.float64


def kept_ops(fn: Any, *args: Any) -> list[str]:
    return [P.op_key(r.op) for r in saved_residuals(fn, *args) if r.kind == "intermediate"]


def kept_names(fn: Any, *args: Any) -> list[str | None]:
    return sorted(str(r.name) for r in saved_residuals(fn, *args) if r.kind == "intermediate")


@pytest.mark.parametrize(
    "policy, text",
    [
        (P.everything_saveable, "everything_saveable"),
        (P.nothing_saveable, "nothing_saveable"),
        (P.dots_saveable, "dots_saveable"),
        (P.dots_with_no_batch_dims_saveable, "dots_with_no_batch_dims_saveable"),
        (P.save_only_these_names("b", "a"), "save_only_these_names('a', 'b')"),
        (P.save_any_names_but_these("a"), "save_any_names_but_these('a')"),
        (P.save_anything_except_these_names("a"), "save_anything_except_these_names('a')"),
        (P.save_from_both_policies(P.dots_saveable, P.save_only_these_names("a")),
         "(dots_saveable | save_only_these_names('a'))"),
        (P.save_ops(torch.ops.aten.mm, "aten::bmm"), "save_ops(aten::mm, aten::bmm)"),
    ],
)
def test_builtin_policies_are_frozen_hashable_values_with_readable_repr(policy: Any, text: str) -> None:
    assert repr(policy) == text
    assert hash(policy) == hash(policy)
    with pytest.raises(AttributeError):
        policy.label = "changed"  # frozen


def test_equal_policies_are_equal_cache_keys() -> None:
    assert P.save_only_these_names("a", "b") == P.save_only_these_names("b", "a")
    assert P.checkpoint_dots is P.dots_saveable
    assert P.checkpoint_dots_with_no_batch_dims is P.dots_with_no_batch_dims_saveable


@pytest.mark.parametrize(
    "spelling", [torch.ops.aten.mm, torch.ops.aten.mm.default, "aten::mm", "aten.mm", "mm", "aten.mm.default", "torch.ops.aten.mm"]
)
def test_ops_match_by_overload_packet_in_every_spelling(spelling: Any) -> None:
    assert P.op_key(spelling) == "aten::mm"
    assert P.save_ops(spelling)(torch.ops.aten.mm.default)


def test_op_key_rejects_non_ops() -> None:
    with pytest.raises(TypeError, match="not an op"):
        P.op_key(3.5)


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=D, requires_grad=True)


def test_dots_without_batch_dims_keep_x_at_w_but_not_einsum_scores() -> None:
    def attn(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
        q = torch.tanh(x @ wq).unflatten(-1, (2, 2)).transpose(1, 2)  # [B, H, T, E]
        k = torch.tanh(x @ wk).unflatten(-1, (2, 2)).transpose(1, 2)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(2)
        return torch.softmax(scores, -1).sum()

    args = (_leaf(2, 3, 4), _leaf(4, 4), _leaf(4, 4))
    no_batch = kept_ops(remat(attn, policy=P.dots_with_no_batch_dims_saveable), *args)
    every_dot = kept_ops(remat(attn, policy=P.dots_saveable), *args)
    assert no_batch == ["aten::mm", "aten::mm"]  # x[B,T,D] @ W folds B and T into rows
    assert sorted(every_dot) == ["aten::bmm", "aten::mm", "aten::mm"]


def test_a_dot_is_judged_by_its_real_batch_dimensions() -> None:
    """einsum('ij,jk->ik') lowers to a bmm with a batch of one: no batch dimension, as JAX
    judges its dot_general, so it is kept and backward recomputes no matmul."""
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.einsum("ij,jk->ik", a, b)).sum()

    args = (_leaf(3, 4), _leaf(4, 5))
    policy = P.dots_with_no_batch_dims_saveable
    assert kept_ops(remat(f, policy=policy), *args) == ["aten::bmm"]
    recomputed = [str(r.op) for r in report(remat(f, policy=policy), *args).recomputes]
    assert not [op for op in recomputed if "mm" in op]
    assert_close(torch.autograd.grad(remat(f, policy=policy)(*args), args), torch.autograd.grad(f(*args), args))
    meta = lambda *shape: torch.empty(shape, device="meta")  # noqa: E731
    assert policy(torch.ops.aten.bmm.default, meta(1, 3, 4), meta(1, 4, 5))
    assert not policy(torch.ops.aten.bmm.default, meta(2, 3, 4), meta(2, 4, 5))
    assert not policy(torch.ops.aten.baddbmm.default, meta(2, 3, 5), meta(2, 3, 4), meta(2, 4, 5))


def _named(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = checkpoint_name(torch.sin(x @ w), "a")
    b = checkpoint_name(torch.tanh(a * 3), "b")
    return torch.cos(b @ w) + a * b  # backward reads a, b and both matmul outputs


@pytest.mark.parametrize(
    "policy, expected",
    [
        (P.save_only_these_names("a"), ["a"]),
        (P.save_only_these_names("a", "b"), ["a", "b"]),
        (P.save_any_names_but_these("a"), ["b"]),
        (P.save_from_both_policies(P.save_only_these_names("b"), P.dots_saveable), ["None", "None", "b"]),
    ],
)
def test_name_policies(policy: Any, expected: list[str]) -> None:
    assert kept_names(remat(_named, policy=policy), _leaf(3, 3), _leaf(3, 3)) == expected


def test_save_anything_except_these_names_really_excludes_them() -> None:
    """Unlike jax's version, the named values are not kept (and neither is the op under them)."""
    args = (_leaf(3, 3), _leaf(3, 3))
    everything = saved_residuals(remat(_named, policy=P.everything_saveable), *args)
    excluded = saved_residuals(remat(_named, policy=P.save_anything_except_these_names("a")), *args)
    assert "a" in [r.name for r in everything]
    assert "a" not in [r.name for r in excluded] and "b" in [r.name for r in excluded]
    assert sum(r.nbytes for r in excluded) < sum(r.nbytes for r in everything)


def test_custom_policy_sees_ops_and_data_free_tensors() -> None:
    seen: list[tuple[Any, list[str], dict[str, Any]]] = []

    def spy(op: Any, *args: Any, **kwargs: Any) -> bool:
        seen.append((op, [a.device.type for a in args if isinstance(a, torch.Tensor)], dict(kwargs)))
        return False

    remat(_named, policy=spy)(_leaf(3, 3), _leaf(3, 3)).sum().backward()
    assert all(isinstance(op, torch._ops.OpOverload) for op, _, _ in seen)
    assert all(device == "meta" for _, devices, _ in seen for device in devices)
    assert {kwargs.get("name") for _, _, kwargs in seen} >= {"a", "b"}


def test_checkpoint_name_is_identity_outside_remat_and_under_vmap() -> None:
    x = _leaf(4, 3)
    tree = {"a": x, "b": [x * 2]}
    assert checkpoint_name(tree, "t") is tree
    out = torch.func.vmap(lambda r: checkpoint_name(r.sin(), "s"))(x)
    torch.testing.assert_close(out, x.sin())
    (g,) = torch.autograd.grad(checkpoint_name(x * 3, "m").sum(), x)
    torch.testing.assert_close(g, torch.full_like(x, 3.0))
    with pytest.raises(TypeError, match="non-empty string"):
        checkpoint_name(x, "")


@pytest.mark.parametrize("policy", [P.nothing_saveable, P.everything_saveable], ids=["nothing", "everything"])
def test_a_factory_backward_reads_keeps_nothing(policy: Any) -> None:
    """`zeros_like(x) * x`: backward reads only the zeros, which it makes again from the
    traced shape, so nothing is kept (JAX keeps nothing either); gradients as without remat."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return (torch.zeros_like(x) * x + torch.ones_like(x) * 2).sum()

    x = _leaf(3, 4)
    assert saved_residuals(remat(f, policy=policy), x) == []
    assert_close(torch.autograd.grad(remat(f, policy=policy)(x), x), torch.autograd.grad(f(x), x))
    per_sample = torch.func.vmap(torch.func.grad(remat(f, policy=policy)))(x.detach())
    assert_close(per_sample, torch.func.vmap(torch.func.grad(f))(x.detach()))


_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default


@pytest.mark.parametrize("policy", [None, P.nothing_saveable, P.dots_saveable, P.dots_with_no_batch_dims_saveable,
                                    P.save_only_these_names("a"), P.save_ops(torch.ops.aten.mm)])
def test_a_collective_is_kept_unless_the_policy_names_collectives(policy: Any) -> None:
    """Recomputing a collective communicates again in backward: its output is kept without
    asking a policy that does not name collectives, eager and compiled alike; a policy that
    names them decides."""
    from remat._partition.asking import kept_unasked

    assert not P.names_collectives(policy)
    assert _kept(policy) == (True, True)
    recomputed = (policy or P.nothing_saveable) & ~P.save_ops(P.COLLECTIVES)
    assert P.names_collectives(recomputed) and _kept(recomputed) == (False, False)
    assert _kept((policy or P.nothing_saveable) | P.save_ops(P.COLLECTIVES)) == (True, True)
    assert not kept_unasked(policy, torch.ops.aten.mm.default)  # only collectives


def _kept(policy: Any, op: Any = _GATHER) -> tuple[bool, bool]:
    """Whether `op`'s output may be kept under `policy`: (eager, compiled)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from remat._partition.asking import answer_of, kept_unasked
    from remat._partition.compiling import Decisions

    args = (torch.empty(4, 8, device="meta"), 2, "0") if op is _GATHER else (torch.empty(4, 8, device="meta"),) * 2
    eager = kept_unasked(policy, op) or (policy is not None and answer_of(policy, op, args, {}, None))
    compiled = Decisions(policy, "f")(None, op, *args) is CheckpointPolicy.MUST_SAVE
    return bool(eager), compiled


@pytest.mark.parametrize("answer", ["MUST_SAVE", "PREFER_SAVE", "PREFER_RECOMPUTE", "MUST_RECOMPUTE"])
def test_a_torch_policy_decides_about_collectives_as_torch_does(answer: str) -> None:
    """torch's selective checkpoint asks its policy_fn about collectives as about any op,
    eager and compiled (torch's partitioner saves only collectives outside such a region):
    a converted policy_fn, and a converted list of ops to save, decide the same."""
    from torch.utils.checkpoint import CheckpointPolicy

    policy = P.from_selective_checkpoint(lambda ctx, op, *args, **kwargs: CheckpointPolicy[answer])
    assert P.names_collectives(policy) and P.names_collectives(policy | P.dots_saveable)
    saved = answer.endswith("SAVE")
    assert _kept(policy) == (saved, saved)
    assert _kept(policy, torch.ops.aten.mm.default) == (saved, saved)
    listed = P.from_selective_checkpoint([torch.ops.aten.mm, *P.COLLECTIVES] if saved else [torch.ops.aten.mm])
    assert P.names_collectives(listed) and _kept(listed) == (saved, saved)
