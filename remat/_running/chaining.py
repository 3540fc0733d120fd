"""Chaining: a region whose outputs feed its other outputs runs as two autograd nodes.

A region is one node of the autograd graph, so with `y, z = region(x)` where `z` is
computed from `y`, autograd would have no path from `z` to `y`: `torch.autograd.grad(z, y)`
fails, where plain autograd (and torch.utils.checkpoint) allow it. So such a region is
split at those outputs: the first part computes them, the rest reads them as inputs.
Gradients are unchanged (the rest sends its gradient for `y` into the first part's
backward); the rest keeps `y` when its backward needs it, as plain autograd does. An
intermediate both parts read is computed by the first and handed to the rest like `y`:
its gradients from both parts then meet before one backward of the op that made it, as
in eager code (computed by each part, its inputs would get two backwards' results added,
which rounds otherwise).
A random op both parts would need, random ops whose draws the split would reorder, or
a function that reseeds a generator leave the region whole (then `grad(z, y)` fails as before, see the README).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Protocol, Sequence

import torch

from .._core.nodes import ancestors, is_random, is_tuple
from .._core.torch_internals import graph_module
from .._trace.randomness import steps_of
from .._trace.records import StageOne


class Runnable(Protocol):
    """A Plan or a Chain: what a region runs per call."""

    stage_one: StageOne

    def apply(self, inputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]: ...

    def plans(self) -> list[Any]: ...


@dataclasses.dataclass
class Chain:
    """A region run as `first` (the outputs others are computed from), then `rest`."""

    stage_one: StageOne  # the whole region's
    first: Runnable
    rest: Runnable
    first_positions: list[list[int]]  # for each of first's outputs, where it goes among the region's outputs
    n_shared: int = 0  # then first's outputs the rest reads, not the region's (intermediates both parts read)

    def apply(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The region's outputs, then the new values of its mutated inputs."""
        handed = list(self.first.apply(inputs)[: len(self.first_positions) + self.n_shared])
        first = handed[: len(self.first_positions)]
        placed = {j: value for value, positions in zip(first, self.first_positions) for j in positions}
        n_rest = self.stage_one.n_outputs - len(placed) + len(self.stage_one.mutated)
        rest = iter(self.rest.apply([*inputs, *handed])[:n_rest])
        return tuple(placed[j] if j in placed else next(rest) for j in range(self.stage_one.n_outputs)) + tuple(rest)

    def plans(self) -> list[Any]:
        return self.first.plans() + self.rest.plans()


def split_at_outputs(stage_one: StageOne) -> tuple[StageOne, StageOne, list[list[int]], set[int], int] | None:
    """(first, rest, where each of first's outputs goes, inputs read in an order the two
    parts break, how many intermediates first hands to rest after those outputs) when
    other outputs are computed from some differentiable outputs, else None. first computes
    each such value once, as many places as it is returned at (an output returned twice,
    or also given to a hook).

    The last: inputs that rest reads before first does. Autograd runs rest's backward
    first, so rest's gradients for an input reach it first; eager's reach it in the
    reverse order of the reads, so for such an input they come later."""
    cuts = _cuts(stage_one)
    if not cuts or why_unsplit(stage_one) is not None:
        return None
    graph = stage_one.graph.graph
    outs = list(next(n for n in graph.nodes if n.op == "output").args[0])
    n_mutated = len(stage_one.mutated)
    first_positions = [j for j in range(stage_one.n_outputs) if outs[j] in cuts]
    rest_positions = [j for j in range(stage_one.n_outputs) if outs[j] not in cuts]
    rest_positions += range(stage_one.n_outputs, stage_one.n_outputs + n_mutated)
    cut_nodes = list(dict.fromkeys(outs[j] for j in first_positions))
    placements = [[j for j in first_positions if outs[j] is node] for node in cut_nodes]

    first_nodes, rest_nodes = _parts(stage_one, cuts)
    shared = _shared(graph, first_nodes, rest_nodes, set(cut_nodes), [outs[j] for j in rest_positions])
    rest_nodes = ancestors([outs[j] for j in rest_positions], stop=set(cut_nodes) | set(shared))
    handed = cut_nodes + shared
    first_gm = _subgraph(stage_one.graph, first_nodes, handed, [])
    rest_gm = _subgraph(stage_one.graph, rest_nodes, [outs[j] for j in rest_positions], handed)
    floating = [_is_floating(node) for node in shared]
    # Every draw continues the stream (else the region stays whole), so each part's do too.
    first = dataclasses.replace(
        stage_one,
        rng_end=None,
        graph=first_gm,
        n_outputs=len(handed),
        n_handed=len(shared),
        mutated=[],
        output_differentiable=[True] * len(cut_nodes) + floating,
        n_hook_outputs=0,  # the region calls its hooks, from its own outputs
        hook_calls=[],
        hooks=None,
    )
    rest = dataclasses.replace(
        stage_one,
        rng_end=None,
        graph=rest_gm,
        n_outputs=len(rest_positions) - n_mutated,
        n_hook_outputs=0,
        hook_calls=[],
        hooks=None,
        output_differentiable=[stage_one.output_differentiable[j] for j in rest_positions[: len(rest_positions) - n_mutated]],
        input_values=[*stage_one.input_values, *(node.meta["val"] for node in handed)],
        input_needs_grad=[*stage_one.input_needs_grad, *(True for _ in cut_nodes), *floating],
        input_paths=[
            *stage_one.input_paths,
            *(f"output {outs.index(node)} of the region" for node in cut_nodes),
            *(f"`{node.name}`, which both parts of the region read" for node in shared),
        ],
    )
    return first, rest, placements, _read_by_rest_first(graph, first_nodes, rest_nodes), len(shared)


def _shared(
    graph: torch.fx.Graph,
    first: set[torch.fx.Node],
    rest: set[torch.fx.Node],
    cuts: set[torch.fx.Node],
    rest_outputs: list[Any],
) -> list[torch.fx.Node]:
    """The values besides the `cuts` that first computes and rest reads too (the nearest to
    rest of those both compute, in graph order); none when one of them is a tuple (a
    multi-output op's result, which is not a tensor: then both parts compute what both read)."""
    both = {n for n in first & rest if n.op == "call_function" and n not in cuts}
    only_rest = rest - first
    found = [n for n in graph.nodes if n in both and (n in rest_outputs or any(u in only_rest for u in n.users))]
    return [] if any(is_tuple(n) for n in found) else found


def _is_floating(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _cuts(stage_one: StageOne) -> set[torch.fx.Node]:
    """The differentiable outputs other outputs are computed from."""
    graph = stage_one.graph.graph
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    live = ancestors(outs, stop=set())  # what the outputs are computed from (not a dead detach)
    return {
        outs[j]
        # what hooks are given, and what a first part hands the rest, does not split
        for j in range(stage_one.n_outputs - stage_one.n_hook_outputs - stage_one.n_handed)
        if isinstance(outs[j], torch.fx.Node)
        and outs[j].op != "placeholder"
        and stage_one.output_differentiable[j]
        and any(user is not output and user in live for user in outs[j].users)
    }


def _parts(stage_one: StageOne, cuts: set[torch.fx.Node]) -> tuple[set[torch.fx.Node], set[torch.fx.Node]]:
    """The nodes of first (what computes the cut outputs) and of rest (the other outputs,
    reading the cut outputs as inputs)."""
    outs = list(next(n for n in stage_one.graph.graph.nodes if n.op == "output").args[0])
    n = stage_one.n_outputs
    first = [outs[j] for j in range(n) if outs[j] in cuts]
    rest = [outs[j] for j in range(n) if outs[j] not in cuts] + outs[n : n + len(stage_one.mutated)]
    return ancestors(first, stop=set()), ancestors(rest, stop=set(first))


def why_unsplit(stage_one: StageOne) -> str | None:
    """Why a region whose outputs feed its other outputs cannot run as two autograd nodes
    (None when it can, or when no output feeds another)."""
    cuts = _cuts(stage_one)
    if not cuts:
        return None
    if stage_one.units:  # a custom Function's ops belong together (`_trace/functions`)
        return "it applies a custom torch.autograd.Function, whose ops belong to one node"
    graph = stage_one.graph.graph
    if stage_one.rng_end is not None and steps_of(graph.nodes, stage_one.rng_end) is not None:
        return "it reseeds a generator, which one forward graph replays"
    if not _random_draws_keep_their_order(graph, *_parts(stage_one, cuts)):
        return "splitting it would draw its random numbers in another order than eager code does"
    return None


def feeds_outputs(stage_one: StageOne) -> bool:
    """Whether some output of the region is computed from another (differentiable) one."""
    return bool(_cuts(stage_one))


def _read_by_rest_first(graph: torch.fx.Graph, first: set[torch.fx.Node], rest: set[torch.fx.Node]) -> set[int]:
    """The inputs (by position) that some node of rest reads before a node of first does."""
    order = {node: k for k, node in enumerate(graph.nodes)}
    found = set()
    for index, placeholder in enumerate(n for n in graph.nodes if n.op == "placeholder"):
        by_first = [order[u] for u in placeholder.users if u in first]
        by_rest = [order[u] for u in placeholder.users if u in rest]
        if by_first and by_rest and min(by_rest) < max(by_first):
            found.add(index)
    return found


def _random_draws_keep_their_order(graph: torch.fx.Graph, first: set[torch.fx.Node], rest: set[torch.fx.Node]) -> bool:
    """Whether running first, then rest draws random numbers as the whole region does:
    each draw in exactly one part (an unread one in neither would be lost), and every
    draw of first before every draw of rest."""
    draws = [n for n in graph.nodes if n.op == "call_function" and n.target is not operator.getitem and is_random(n)]
    if any((n in first) == (n in rest) for n in draws):
        return False
    parts = ["first" if n in first else "rest" for n in draws]
    return parts == sorted(parts)  # "first" < "rest"


def _subgraph(
    gm: torch.fx.GraphModule, keep: set[torch.fx.Node], outputs: list[Any], as_inputs: list[torch.fx.Node]
) -> torch.fx.GraphModule:
    """The graph computing `outputs` from gm's inputs, then one new input per `as_inputs` node,
    which it reads instead of computing that node."""
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if node.op == "placeholder":
            env[node] = new.node_copy(node, env.__getitem__)
    for node in as_inputs:
        placeholder = new.placeholder(f"{node.name}_in")
        placeholder.meta = {key: node.meta[key] for key in ("val", "tensor_meta") if key in node.meta}
        env[node] = placeholder
    for node in nodes:
        if node.op not in ("placeholder", "output") and node in keep and node not in env:
            env[node] = new.node_copy(node, env.__getitem__)
    new.output([env[o] if isinstance(o, torch.fx.Node) else o for o in outputs])
    return graph_module(gm, new)
