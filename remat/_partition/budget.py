"""Memory budgets: choose what a region keeps so that it fits a number of bytes and
backward recomputes the fewest FLOPs.

The choice is over the region's own values that backward would otherwise recompute.
With few of them (`EXACT_UP_TO`) every subset is tried, so the choice is optimal; with
more it is approximate: the better of adding values greedily (most recompute FLOPs saved
per byte first), dropping them greedily from all, and what the built-in dots policies
would keep (so it never does worse than one of those that fits), then swaps of one kept
value for one recomputed value while they lower the recompute.
Bytes are those of kept intermediates; inputs are kept anyway and do not count.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch.fx

from remat.policies import MemoryBudget

from .._core.errors import RematError
from .._core.nodes import SCOPE_KEY
from .._trace.records import Scope

EXACT_UP_TO = 12  # candidates for which every subset is tried (4,096 walks of the graph)

Cost = Callable[[frozenset[torch.fx.Node]], tuple[int, int]]  # chosen -> (kept bytes, recompute FLOPs)


@dataclass(frozen=True)
class Budget:
    """The budget of one region and which of its scopes (nested regions) it governs."""

    limit: int | float  # bytes, or a fraction of what keeping every value would keep
    scopes: frozenset[int]

    def governs(self, node: torch.fx.Node) -> bool:
        return node.meta.get("custom", {}).get(SCOPE_KEY, 0) in self.scopes

    def in_bytes(self, everything: int) -> int:
        return int(self.limit * everything) if isinstance(self.limit, float) else self.limit


def budget_of(scopes: Sequence[Scope]) -> Budget | None:
    """The region's budget when its policy is `memory_budget(...)`; nested regions without a
    policy of their own share it."""
    outer = scopes[0].policy if scopes else None
    if any(isinstance(s.policy, MemoryBudget) and s.policy != outer for s in scopes):
        raise RematError(
            "remat: a nested region has a memory_budget policy of its own, but budgets choose for a "
            "whole region: give the budget to the outermost remat, or give the nested one another policy."
        )
    if not isinstance(outer, MemoryBudget):
        return None
    policy = outer
    return Budget(policy.limit, frozenset(k for k, s in enumerate(scopes) if s.policy == policy))


def choose_within_budget(
    candidates: list[torch.fx.Node], cost: Cost, budget: Budget, seeds: Sequence[frozenset[torch.fx.Node]] = ()
) -> frozenset[torch.fx.Node]:
    """The candidates to keep: kept bytes within the budget, recompute FLOPs least.
    `seeds`: other choices the approximate search starts from."""
    everything = frozenset(candidates)
    kept_by_all = cost(everything)[0]
    limit = budget.in_bytes(kept_by_all)
    if kept_by_all <= limit:
        return everything
    if len(candidates) <= EXACT_UP_TO:
        best, best_cost = frozenset[torch.fx.Node](), (0, 0)
        for size in range(len(candidates) + 1):
            for subset in map(frozenset, itertools.combinations(candidates, size)):
                kept, recompute = cost(subset)
                if kept <= limit and (not best or (recompute, kept) < best_cost):
                    best, best_cost = subset, (recompute, kept)
        return best
    return _greedy(candidates, cost, limit, seeds)


def _greedy(
    candidates: list[torch.fx.Node], cost: Cost, limit: int, seeds: Sequence[frozenset[torch.fx.Node]]
) -> frozenset[torch.fx.Node]:
    """The best of adding values from none, dropping values from all (each step the best
    FLOPs per byte) and the seeds that fit, then improved by swapping one kept value for
    one recomputed."""
    found = [_adding(candidates, cost, limit), _dropping(candidates, cost, limit), *seeds]
    best = min((s for s in found if cost(s)[0] <= limit), key=lambda s: cost(s)[::-1], default=frozenset())
    return _swapped(best, candidates, cost, limit)


def _adding(candidates: list[torch.fx.Node], cost: Cost, limit: int) -> frozenset[torch.fx.Node]:
    chosen: frozenset[torch.fx.Node] = frozenset()
    kept, recompute = cost(chosen)
    while True:
        steps = []
        for node in candidates:
            if node not in chosen:
                trial_kept, trial_recompute = cost(chosen | {node})
                if trial_kept <= limit and trial_recompute < recompute:
                    steps.append(((recompute - trial_recompute) / max(trial_kept - kept, 1), node, trial_kept, trial_recompute))
        if not steps:
            return chosen
        _, node, kept, recompute = max(steps, key=lambda step: step[0])
        chosen |= {node}


def _dropping(candidates: list[torch.fx.Node], cost: Cost, limit: int) -> frozenset[torch.fx.Node]:
    chosen = frozenset(candidates)
    kept, recompute = cost(chosen)
    while kept > limit and chosen:
        steps = []
        for node in chosen:
            trial_kept, trial_recompute = cost(chosen - {node})
            if trial_kept < kept:
                steps.append(((trial_recompute - recompute) / (kept - trial_kept), node, trial_kept, trial_recompute))
        if not steps:
            break
        _, node, kept, recompute = min(steps, key=lambda step: step[0])
        chosen -= {node}
    return chosen


def _swapped(chosen: frozenset[torch.fx.Node], candidates: list[torch.fx.Node], cost: Cost, limit: int) -> frozenset[torch.fx.Node]:
    """Swap one kept value for one recomputed one (or add one) while that lowers recompute."""
    kept, recompute = cost(chosen)
    improved = True
    while improved:
        improved = False
        for out in [None, *chosen]:
            for node in candidates:
                if node in chosen:
                    continue
                trial = (chosen - {out}) | {node}
                trial_kept, trial_recompute = cost(trial)
                if trial_kept <= limit and (trial_recompute, trial_kept) < (recompute, kept):
                    chosen, kept, recompute, improved = trial, trial_kept, trial_recompute, True
                    break
            if improved:
                break
    return chosen
