"""memory_budget: the kept bytes fit, the recompute is least. The oracles: every subset of
named values tried through the public name policies (brute force), and the same function
without remat for values and gradients."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from remat import RematError, checkpoint_layers, checkpoint_name, compare, remat, report
from remat import policies as P

from conftest import assert_close

D = torch.float64
NAMES = ("h1", "a", "h2", "b", "c", "e")


def named_block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Every value backward may read carries a name, so name policies reach every choice."""
    h1 = checkpoint_name(x @ w1, "h1")
    a = checkpoint_name(torch.tanh(h1), "a")
    h2 = checkpoint_name(a @ w2, "h2")
    b = checkpoint_name(torch.sin(h2), "b")
    c = checkpoint_name(b * a, "c")
    return checkpoint_name(c.exp(), "e").sum()


def _args(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(*s, dtype=D, generator=gen) / 4).requires_grad_() for s in shapes]


def kept_and_recomputed(fn: Any, *args: Any) -> tuple[int, int]:
    found = report(fn, *args)
    return sum(r.nbytes for r in found.residuals if r.kind == "intermediate"), sum(r.flops for r in found.recomputes)


def test_matches_brute_force_over_every_subset_of_named_values() -> None:
    args = _args((6, 8), (8, 8), (8, 8))
    outcomes = [
        kept_and_recomputed(remat(named_block, policy=P.save_only_these_names(*subset) if subset else None), *args)
        for size in range(len(NAMES) + 1)
        for subset in itertools.combinations(NAMES, size)
    ]
    for limit in sorted({kept for kept, _ in outcomes}) + [100, 700]:
        kept, recomputed = kept_and_recomputed(remat(named_block, policy=P.memory_budget(limit)), *args)
        best = min(flop for bytes_kept, flop in outcomes if bytes_kept <= limit)
        assert kept <= limit and recomputed == best, (limit, kept, recomputed, best)


@pytest.mark.parametrize("limit", [0, 0.25, 0.6, 1.0, 3000])
def test_values_and_gradients_as_without_remat(limit: Any) -> None:
    args = _args((6, 8), (8, 8), (8, 8))
    f = remat(named_block, policy=P.memory_budget(limit))
    assert_close((f(*args), torch.autograd.grad(f(*args), args)), (named_block(*args), torch.autograd.grad(named_block(*args), args)))
    x, w1, w2 = (a.detach() for a in args)
    per_sample = torch.func.vmap(torch.func.grad(f, argnums=1), in_dims=(0, None, None))
    assert_close(per_sample(x.unsqueeze(1), w1, w2), torch.func.vmap(torch.func.grad(named_block, argnums=1), in_dims=(0, None, None))(x.unsqueeze(1), w1, w2))


def transformer_block(x: torch.Tensor, wqkv: torch.Tensor, wo: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """More candidate values than the exact search tries: the greedy choice."""
    h = F.layer_norm(x, x.shape[-1:])
    q, k, v = (h @ wqkv).chunk(3, dim=-1)
    attn = torch.softmax(q @ k.transpose(-1, -2) / 4, dim=-1) @ v
    x = x + attn @ wo
    return (x + F.gelu(F.layer_norm(x, x.shape[-1:]) @ w1) @ w2).sum()


def test_a_larger_region_fits_its_budget_between_the_two_extremes() -> None:
    args = _args((2, 5, 16), (16, 48), (16, 16), (16, 32), (32, 16))
    nothing = kept_and_recomputed(remat(transformer_block, policy=P.nothing_saveable), *args)
    everything = kept_and_recomputed(remat(transformer_block, policy=P.everything_saveable), *args)
    for fraction in (0.0, 0.3, 0.7, 1.0):
        f = remat(transformer_block, policy=P.memory_budget(fraction))
        kept, recomputed = kept_and_recomputed(f, *args)
        assert kept <= fraction * everything[0] and everything[1] <= recomputed <= nothing[1]
        assert_close(torch.autograd.grad(f(*args), args), torch.autograd.grad(transformer_block(*args), args))
    assert kept_and_recomputed(remat(transformer_block, policy=P.memory_budget(1.0)), *args) == everything
    middle = kept_and_recomputed(remat(transformer_block, policy=P.memory_budget(0.5)), *args)
    assert nothing[0] < middle[0] < everything[0] and everything[1] < middle[1] < nothing[1]


@pytest.mark.parametrize("policy", [P.dots_saveable, P.dots_with_no_batch_dims_saveable, P.dots_and_attention_saveable])
def test_never_worse_than_a_built_in_policy_that_fits(policy: Any) -> None:
    args = _args((2, 5, 16), (16, 48), (16, 16), (16, 32), (32, 16))
    kept, recomputed = kept_and_recomputed(remat(transformer_block, policy=policy), *args)
    budget_kept, budget_recomputed = kept_and_recomputed(remat(transformer_block, policy=P.memory_budget(kept)), *args)
    assert budget_kept <= kept and budget_recomputed <= recomputed


def test_compare_puts_the_budget_on_the_frontier() -> None:
    args = _args((2, 5, 16), (16, 48), (16, 16), (16, 32), (32, 16))
    region = remat(transformer_block)
    rows = compare(region, *args, policies=[P.nothing_saveable, P.memory_budget(0.5), P.everything_saveable], baseline=False)
    nothing, budget, everything = rows
    assert nothing.kept_bytes < budget.kept_bytes < everything.kept_bytes
    assert nothing.recompute_flops > budget.recompute_flops > everything.recompute_flops


def test_checkpoint_layers_spreads_a_model_budget_over_its_layers() -> None:
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Sigmoid()) for _ in range(3)).double()
    x = torch.randn(4, 8, dtype=D, requires_grad=True)

    def run(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = layer(x)
        return x.sum()

    expected = torch.autograd.grad(run(x), [x, *layers.parameters()])
    checkpoint_layers(layers, None, budget=3 * 256)
    per_layer = {}
    for r in report(run, x).residuals:
        if r.kind == "intermediate":
            per_layer[r.region] = per_layer.get(r.region, 0) + r.nbytes
    assert len(per_layer) == 3 and all(0 < kept <= 256 for kept in per_layer.values())
    assert_close(torch.autograd.grad(run(x), [x, *layers.parameters()]), expected)


def test_bad_budgets_and_budgets_inside_other_policies_are_refused() -> None:
    with pytest.raises(TypeError, match="bytes \\(an int\\) or a fraction"):
        P.memory_budget("1GB")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="within \\[0, 1\\]"):
        P.memory_budget(1.5)
    with pytest.raises(ValueError, match="at least 0"):
        P.memory_budget(-1)
    x = torch.randn(3, 3, dtype=D, requires_grad=True)
    with pytest.raises(TypeError, match="chooses what a whole region keeps"):
        remat(lambda x: torch.tanh(x @ x), policy=P.memory_budget(10) | P.dots_saveable)(x)


@pytest.mark.parametrize("outer", ["budget", "policy"])
def test_a_nested_region_with_a_budget_of_its_own_is_refused(outer: str) -> None:
    """A budget chooses for a whole region: a nested budget under an outer budget or an
    outer policy is refused with the fix; the same budget nested shares the outer one."""
    x = torch.randn(4, 4, dtype=D, requires_grad=True)
    inner = remat(lambda h: torch.tanh(h @ h), policy=P.memory_budget(0.3))
    outer_policy = P.memory_budget(0.7) if outer == "budget" else P.dots_saveable
    with pytest.raises(RematError, match="nested region has a memory_budget policy of its own"):
        remat(lambda x: inner(x.sin()).cos().sum(), policy=outer_policy)(x)
    same = remat(lambda h: torch.tanh(h @ h), policy=P.memory_budget(0.3))
    f = remat(lambda x: same(x.sin()).cos().sum(), policy=P.memory_budget(0.3))
    expected = torch.autograd.grad(torch.tanh(x.sin() @ x.sin()).cos().sum(), x)
    assert_close(torch.autograd.grad(f(x), x), expected)
