"""Partitioning: split a joint forward+backward graph by what may be kept.

The one place a policy is consulted. Backward nodes are those that feed the gradients but
not the outputs. Walking back from every forward value that backward reads, each value is
either an input (kept by reference), a value the policy allows (kept: a residual), or
recomputed inside the backward graph from its own inputs. Views are never kept: their base
is, and the view is recomputed for free. A random op that is recomputed replays the
generator state its forward run captured, so recompute draws the same numbers.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx

from remat.policies import (
    dots_and_attention_saveable,
    dots_saveable,
    dots_with_no_batch_dims_saveable,
)

from .._core.nodes import (
    SCOPE_KEY,
    ancestors,
    is_random,
    is_tuple,
    is_view,
    node_name,
    producer,
    source_line,
    view_root,
)
from .._core.torch_internals import graph_module
from .._trace.passes import read_mutated_inputs_from_copies
from .._trace.pipelines import joint_passes
from .._trace.randomness import (
    RNG_KEY,
    Source,
    capture_rng_state,
    generator_state,
    recorded_draws,
    replay_random,
    set_generator_state,
    state_shape,
    steps_of,
)
from .asking import Decide, ask, kept_unasked
from .budget import Budget, choose_within_budget
from .costs import flops, value_bytes
from .offloading import offload_of, offloaded_value, to_device, to_host
from .recompute_check import check_recomputed

# What a budget's search starts from besides nothing and everything: so it never does
# worse than one of these built-in policies whose kept values fit the budget.
BUDGET_SEEDS = (dots_saveable, dots_with_no_batch_dims_saveable, dots_and_attention_saveable)

@dataclass(frozen=True)
class KeptValue:
    """One intermediate the forward keeps for backward, described for people."""

    op: Any
    name: str | None
    source: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str = "intermediate"  # "rng": a generator state to replay; "debug": kept only to check recompute
    scope: int = 0  # which remat region (0: the outermost; then nested ones) produced it


@dataclass(frozen=True)
class RecomputedOp:
    """One op the backward re-runs, with what that costs."""

    op: Any
    source: str | None
    flops: int
    scope: int = 0


@dataclass
class Partition:
    forward: torch.fx.GraphModule  # inputs -> outputs, residuals that are not outputs, rng states
    forward_pure: torch.fx.GraphModule  # the same without capturing rng states (for retracing)
    backward: torch.fx.GraphModule  # kept inputs, residuals, rng states, tangents -> gradients
    saved_inputs: list[int]
    residual_outputs: list[int]  # where each kept value (residuals, rng states, debug values) sits among forward's outputs
    kept: list[KeptValue]
    recomputed: list[RecomputedOp]  # what backward re-runs (views and tuple items, which are free, left out)
    replayed: list[int]  # rng index of each random op backward replays, in the order of its states
    checked: int  # debug mode: how many recomputed values backward compares with the forward's
    offloaded: int = 0  # kept values held in host memory between forward and backward


def _computed_from(roots: Iterable[Any], inputs: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The op nodes `roots` are computed from, the `inputs` themselves left out."""
    return ancestors(roots, inputs) - inputs


@dataclass
class _Joint:
    """The joint graph told apart: its inputs and tangents, the forward's outputs and the
    gradients, and the op nodes each side computes (a node both need is a forward node)."""

    graph: torch.fx.Graph
    inputs: list[torch.fx.Node]
    tangents: list[torch.fx.Node]
    outs: list[Any]
    grads: list[Any]
    forward: set[torch.fx.Node]
    backward: set[torch.fx.Node]
    input_set: set[torch.fx.Node] = field(init=False)

    def __post_init__(self) -> None:
        self.input_set = set(self.inputs)


def _classify(graph: torch.fx.Graph, n_inputs: int, n_outputs: int, forward: set[torch.fx.Node] | None = None) -> _Joint:
    """Which op nodes compute the outputs, and which only the gradients (given `forward`,
    only the latter are found again: after the joint passes)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    outs, grads = list(output.args[0][:n_outputs]), list(output.args[0][n_outputs:])
    if forward is None:
        forward = _computed_from(outs, set(placeholders))
        # every output of a multi-output forward op is computed in forward, even one only backward reads
        forward |= {u for n in forward if is_tuple(n) for u in n.users}
    backward = _computed_from(grads, set(placeholders)) - forward
    return _Joint(graph, placeholders[:n_inputs], placeholders[n_inputs:], outs, grads, forward, backward)


@dataclass
class _Kept:
    """What the forward keeps and the backward recomputes, and how the forward graph hands
    it over: residuals (by output position), random ops backward replays, debug values."""

    saved: list[torch.fx.Node]  # inputs backward reads, in graph order
    residuals: list[torch.fx.Node]  # kept intermediates, in graph order
    recompute: set[torch.fx.Node]
    replayed: list[torch.fx.Node]  # recomputed random ops, whose generator state is kept
    keep_forward: set[torch.fx.Node]  # what the forward graph runs
    checked: list[torch.fx.Node]  # debug mode: recomputed values backward compares with the forward's
    out_positions: dict[torch.fx.Node, int]  # a residual that is also an output: its first position
    extra: list[torch.fx.Node]  # residuals that are not outputs, in graph order
    offloads: dict[torch.fx.Node, Any]  # residuals held in host memory, with the policy's answer

    def residual_outputs(self, n_outputs: int) -> list[int]:
        """Where each kept value (residuals, rng states, debug values) sits among forward's outputs."""
        positions = [self.out_positions[r] if r in self.out_positions else n_outputs + self.extra.index(r) for r in self.residuals]
        return positions + [n_outputs + len(self.extra) + k for k in range(len(self.replayed) + len(self.checked))]


def _needed_by_backward(joint: _Joint) -> list[torch.fx.Node]:
    """The forward values and inputs backward reads, in graph order (repeats included)."""
    needed: list[torch.fx.Node] = []
    for node in joint.graph.nodes:
        if node in joint.backward:
            needed.extend(i for i in node.all_input_nodes if i in joint.forward or i in joint.input_set)
    needed.extend(g for g in joint.grads if isinstance(g, torch.fx.Node) and (g in joint.forward or g in joint.input_set))
    return needed


def _choose_kept(
    joint: _Joint,
    decide: Decide,
    exact: bool,
    debug: bool,
    budget: Budget | None,
    offload: bool,
    must_keep: set[torch.fx.Node],
    second_order: bool = False,
) -> _Kept:
    """Ask the policy (or fit the budget) and walk back from what backward needs; for a
    backward that is differentiated again, keep the outputs it reads (their second-order
    terms then meet at the forward's node, as eager's at its op's) and of the rest only
    what no recomputed value leads to."""
    graph, input_set = joint.graph, joint.input_set
    needed = _needed_by_backward(joint)
    if exact:
        allowed = {n for n in joint.forward if decide(n)}
    elif budget is not None:
        allowed = _within_budget(graph, joint.forward, needed, input_set, decide, budget, must_keep)
    else:
        allowed = _allowed(graph, joint.forward, decide) | must_keep
    if second_order and not exact:  # the outputs, as eager's derivatives read an op's saved result
        allowed |= {o for o in joint.outs if isinstance(o, torch.fx.Node) and o in joint.forward}
    saved_inputs, residuals, recompute = _walk(needed, allowed, input_set, exact)
    while second_order and (downstream := _downstream_of_recompute(graph, residuals, recompute) - must_keep):
        allowed -= downstream | {producer(n) for n in downstream}
        saved_inputs, residuals, recompute = _walk(needed, allowed, input_set, exact)

    order = {n: i for i, n in enumerate(graph.nodes)}
    residual_list = sorted(residuals, key=order.__getitem__)
    random_ops = [n for n in graph.nodes if n.op == "call_function" and n.target is not operator.getitem and is_random(n)]
    replayed = [n for n in random_ops if n in recompute]
    # A random op runs in forward even when nothing reads its result: plain eager code
    # draws its numbers too, and the global random stream must end where it would.
    unread_random = [n for n in random_ops if n not in joint.forward and n not in joint.backward]
    keep_forward = _computed_from(list(joint.outs) + residual_list + unread_random, set(joint.inputs) | set(joint.tangents))
    out_positions = {node: i for i, node in reversed(list(enumerate(joint.outs))) if isinstance(node, torch.fx.Node)}
    checked = [  # an output is not returned twice (that would make autograd drop its gradient)
        n for n in graph.nodes
        if debug and n in recompute and n in keep_forward and n.op == "call_function" and not is_tuple(n)
        and n not in out_positions
    ]
    extra = [r for r in residual_list if r not in out_positions]
    # kept values the policy moves to host memory (outputs are alive anyway: they stay)
    offloads = {} if exact or not offload else {
        r: answer for r in extra
        if not (budget is not None and budget.governs(r)) and (answer := offload_of(decide, r, producer(r))) is not None
    }
    return _Kept(
        sorted(saved_inputs, key=order.__getitem__), residual_list, recompute, replayed, keep_forward, checked,
        out_positions, extra, offloads,
    )


def _downstream_of_recompute(
    graph: torch.fx.Graph, residuals: set[torch.fx.Node], recompute: set[torch.fx.Node]
) -> set[torch.fx.Node]:
    """The kept values computed (in forward) from a value backward recomputes. In a
    gradient of a gradient such a value would be two autograd nodes, the forward's (which
    the kept value leads back to) and the backward's, each adding its own second-order
    terms before they meet: eager has one node, which adds them all, so the sums round
    otherwise."""
    reached: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if any(i in reached or (i in recompute and i.op == "call_function") for i in node.all_input_nodes):
            reached.add(node)
    return residuals & reached


def _build_forward(
    joint_gm: torch.fx.GraphModule, joint: _Joint, kept: _Kept, rng_end: dict[str, Source] | None, lowered: bool
) -> torch.fx.Graph:
    """inputs -> outputs, the residuals that are not outputs. Lowered: also replay the
    function's own reseeding, snapshot rng states for replays, offload what is offloaded
    and, in debug mode, output the values backward will recompute, so it can compare."""
    graph, outs, input_set = joint.graph, joint.outs, joint.input_set
    forward_graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    states: list[torch.fx.Node] = []
    for node in joint.inputs:
        env[node] = forward_graph.node_copy(node)
    runs = [n for n in graph.nodes if n in kept.keep_forward]
    streams = _Streams(joint_gm, forward_graph, runs, rng_end) if lowered else None
    for node in runs:
        if streams is not None:
            streams.before(node)
        if lowered and node in kept.replayed:
            states.append(_capture_state(forward_graph, node, env))
        env[node] = forward_graph.node_copy(node, env.__getitem__)
        if streams is not None:
            streams.after(node)
    if streams is not None:
        streams.at_end()
    forward_outputs = [
        _distinct_output(forward_graph, env[o], o in input_set or outs.index(o) < i) for i, o in enumerate(outs)
    ]
    tail = states + [env[n] for n in kept.checked] if lowered else []
    residuals = [
        _offloaded(forward_graph, r, env[r], kept.offloads[r].dst) if lowered and r in kept.offloads else env[r]
        for r in kept.extra
    ]
    forward_graph.output(forward_outputs + residuals + tail)
    return forward_graph


def _build_backward(joint: _Joint, kept: _Kept) -> torch.fx.Graph:
    """kept inputs, residuals, rng states, debug values, tangents -> gradients: what is not
    kept is recomputed, random ops replay their state, offloaded values come back first."""
    backward_graph = torch.fx.Graph()
    benv: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in kept.saved + kept.residuals:
        benv[node] = backward_graph.placeholder(node.name)
        benv[node].meta = dict(node.meta)
    state_inputs = {node: backward_graph.placeholder(f"rng_state_{i}") for i, node in enumerate(kept.replayed)}
    forward_values = {node: backward_graph.placeholder(f"forward_value_{i}") for i, node in enumerate(kept.checked)}
    for node in joint.tangents:
        benv[node] = backward_graph.placeholder(node.name)
        benv[node].meta = dict(node.meta)
    for node in kept.offloads:  # first thing backward does: bring them back, ahead of use
        benv[node] = _brought_back(backward_graph, node, benv[node], kept.offloads[node].dst)
    for node in joint.graph.nodes:
        if node in state_inputs:
            benv[node] = _replay(backward_graph, node, state_inputs[node], benv)
        elif node in kept.recompute or node in joint.backward:
            benv[node] = backward_graph.node_copy(node, benv.__getitem__)
        if node in forward_values:
            benv[node] = _check(backward_graph, node, benv[node], forward_values[node])
    backward_graph.output([benv[g] if isinstance(g, torch.fx.Node) else g for g in joint.grads])
    return backward_graph


def partition(
    joint_gm: torch.fx.GraphModule,
    n_inputs: int,
    n_outputs: int,
    decide: Decide,
    exact: bool = False,
    debug: bool = False,
    mutated: Sequence[int] = (),
    budget: Budget | None = None,
    offload: bool = True,
    rng_end: dict[str, Source] | None = None,
    second_order: bool = False,
    read_as_is: Iterable[torch.fx.Node] = (),
) -> Partition:
    """Split `joint_gm` (inputs, tangents -> outputs, gradients) into forward and backward:
    classify its nodes, run the joint passes, choose what is kept, build both graphs and
    describe what is kept and recomputed.

    With `exact`, `decide` names the very nodes to keep (views included) and nothing
    else is kept: used to rebuild a backward for a forward that has already run. With
    `debug`, backward checks every recomputed value against the forward's. Inputs in
    `mutated` are updated after the forward, so backward may only read copies of them.
    With a `budget`, what its region keeps is chosen to fit it (see budget.py). Values
    a policy answers `Offload` for wait in host memory (see offloading.py) when `offload`.
    `rng_end`: where the function left each generator's stream (see _trace/randomness.py).
    With `second_order` (a backward that is differentiated again), nothing is kept that is
    computed from a value backward recomputes: second-order terms then add as in eager;
    but for `read_as_is`, outputs backward reads as the caller's own tensors (their hooks run).
    """
    graph = joint_gm.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"][:n_inputs]
    must_keep = read_mutated_inputs_from_copies(graph, [inputs[i] for i in mutated]) | set(read_as_is)
    joint = _classify(graph, n_inputs, n_outputs)
    joint_passes(graph, joint.forward, joint.backward)
    joint = _classify(graph, n_inputs, n_outputs, forward=joint.forward)
    if _computed_from(joint.outs, joint.input_set) & set(joint.tangents):
        raise AssertionError("remat: a forward output depends on a tangent; please report this bug")
    kept = _choose_kept(joint, decide, exact, debug, budget, offload, must_keep, second_order)
    return Partition(
        forward=_module(joint_gm, _build_forward(joint_gm, joint, kept, rng_end, lowered=True)),
        forward_pure=_module(joint_gm, _build_forward(joint_gm, joint, kept, rng_end, lowered=False)),
        backward=_module(joint_gm, _build_backward(joint, kept)),
        saved_inputs=[inputs.index(n) for n in kept.saved],
        residual_outputs=kept.residual_outputs(n_outputs),
        kept=[replace(_kept_value(r), kind="offloaded") if r in kept.offloads else _kept_value(r) for r in kept.residuals]
        + [_describe_state(n) for n in kept.replayed]
        + [replace(_kept_value(n), kind="debug") for n in kept.checked],
        recomputed=[
            _describe_recompute(n)
            for n in graph.nodes
            if n in kept.recompute and n.op == "call_function" and n.target is not operator.getitem and not is_view(n)
        ],
        replayed=[n.meta.get("custom", {}).get(RNG_KEY, -1) for n in kept.replayed],
        checked=len(kept.checked),
        offloaded=len(kept.offloads),
    )


def _offloaded(graph: torch.fx.Graph, node: torch.fx.Node, value: torch.fx.Node, dst: str) -> torch.fx.Node:
    """A forward node making `node`'s host copy."""
    host = graph.call_function(to_host, (value, dst))
    host.meta = {**node.meta, "val": offloaded_value(node, dst)}
    return host


def _brought_back(graph: torch.fx.Graph, node: torch.fx.Node, host: torch.fx.Node, dst: str) -> torch.fx.Node:
    """A backward node bringing an offloaded value (`host`, a placeholder) back to the
    device it was computed on."""
    host.meta = {**node.meta, "val": offloaded_value(node, dst)}
    back = graph.call_function(to_device, (host, node.meta["val"].device))
    back.meta = dict(node.meta)
    return back


def _check(graph: torch.fx.Graph, node: torch.fx.Node, recomputed: torch.fx.Node, original: torch.fx.Node) -> torch.fx.Node:
    """Debug mode: the recomputed value, after checking it equals the forward's."""
    where = f"{producer(node).target} from {source_line(node) or 'an unknown line'}"
    return graph.call_function(check_recomputed, (recomputed, original, where))


def _device_of(node: torch.fx.Node) -> torch.device:
    val = node.meta["val"]
    return (val[0] if isinstance(val, (tuple, list)) else val).device


def _capture_state(graph: torch.fx.Graph, node: torch.fx.Node, env: dict[torch.fx.Node, torch.fx.Node]) -> torch.fx.Node:
    """A node that snapshots the generator `node` is about to draw from (a generator passed
    to the op is a get_attr node of the graph: `env` has its copy)."""
    generator = torch.fx.map_arg(node.kwargs.get("generator"), env.__getitem__)
    state = graph.call_function(capture_rng_state, (_device_of(node), generator))
    state.meta = {"val": torch.empty(state_shape(_device_of(node)), dtype=torch.uint8, device="meta")}
    return state


def _replay(
    graph: torch.fx.Graph, node: torch.fx.Node, state: torch.fx.Node, env: dict[torch.fx.Node, torch.fx.Node]
) -> torch.fx.Node:
    """`node` again, drawing from the state its forward run captured."""
    args = torch.fx.map_arg(node.args, env.__getitem__)
    kwargs = torch.fx.map_arg(node.kwargs, env.__getitem__)
    target: Any = node.target
    new = graph.call_function(replay_random, (state, _device_of(node), target, *args), dict(kwargs))
    new.meta = dict(node.meta)
    return new


class _Streams:
    """Builds the forward graph's steps that replay what the function's Python did to the
    generators (`randomness.stream_steps`): a generator put at a seeded state, or at one
    read at the start or right after a draw, before the draws that drew from it and when
    the function returned."""

    def __init__(
        self, root: torch.fx.GraphModule, graph: torch.fx.Graph, forward: list[torch.fx.Node], end: dict[str, Source] | None
    ) -> None:
        self.root, self.graph = root, graph
        draws = recorded_draws(forward)
        self.draw_of = {node: draw for draw, (node, _, _) in draws.items()}
        self.key_of = {draw: key for draw, (_, key, _) in draws.items()}
        self.steps = steps_of(forward, end) if end is not None else None
        self.read: dict[Any, torch.fx.Node] = {}  # (None, generator) or draw -> the state read there
        self.seeded = 0  # seeded states held by the graph
        if self.steps is not None:
            starts = {key for key, source in [*self.steps.before.values(), *self.steps.at_end.items()] if source == ("start",)}
            for key in sorted(starts):
                self.read[(None, key)] = self._call(generator_state, key)

    def _call(self, fn: Callable[..., Any], *args: Any) -> torch.fx.Node:
        node = self.graph.call_function(fn, args)
        if fn is generator_state:
            node.meta["val"] = torch.empty(state_shape(torch.device(args[0])), dtype=torch.uint8, device="meta")
        return node

    def _put(self, key: str, source: Source) -> None:
        if source[0] == "seeded":
            name = f"_remat_seeded_state_{self.seeded}"
            self.seeded += 1
            setattr(self.root, name, source[1])
            state = self.graph.get_attr(name)
        else:
            state = self.read[(None, key) if source[0] == "start" else source[1]]
        self._call(set_generator_state, key, state)

    def before(self, node: torch.fx.Node) -> None:
        draw = self.draw_of.get(node)
        if self.steps is not None and draw in self.steps.before:
            self._put(*self.steps.before[draw])

    def after(self, node: torch.fx.Node) -> None:
        draw = self.draw_of.get(node)
        if self.steps is not None and draw is not None and draw in self.steps.read_after:
            self.read[draw] = self._call(generator_state, self.key_of[draw])

    def at_end(self) -> None:
        for key, source in sorted(self.steps.at_end.items()) if self.steps is not None else ():
            self._put(key, source)


def _describe_recompute(node: torch.fx.Node) -> RecomputedOp:
    return RecomputedOp(node.target, source_line(node), flops(node), node.meta.get("custom", {}).get(SCOPE_KEY, 0))


def _describe_state(node: torch.fx.Node) -> KeptValue:
    return KeptValue(
        op=node.target,
        name=None,
        source=source_line(node),
        shape=state_shape(_device_of(node)),
        dtype=torch.uint8,
        kind="rng",
        scope=node.meta.get("custom", {}).get(SCOPE_KEY, 0),
    )


_STRIDE_SENSITIVE_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _module(root: torch.fx.GraphModule, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A runnable module; `view` becomes `reshape`, which views when the strides allow.

    Strides were traced on fake tensors at one layout; under vmap (and for some kernels)
    the real tensors can arrive with another, where `view` would fail.
    """
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _STRIDE_SENSITIVE_VIEWS:
            node.target = torch.ops.aten.reshape.default
    return graph_module(root, graph)


def _distinct_output(graph: torch.fx.Graph, node: torch.fx.Node, needs_alias: bool) -> torch.fx.Node:
    """An autograd.Function may not return an input as-is, nor one tensor twice (marking
    one occurrence non-differentiable would mark both): return an alias, a free view."""
    if not needs_alias:
        return node
    alias = graph.call_function(torch.ops.aten.alias.default, (node,))
    alias.meta = dict(node.meta)
    return alias


def _walk(
    needed: Iterable[torch.fx.Node], allowed: set[torch.fx.Node], input_set: set[torch.fx.Node], exact: bool = False
) -> tuple[set[torch.fx.Node], set[torch.fx.Node], set[torch.fx.Node]]:
    """From what backward reads, back to what is kept: (inputs kept, values kept, values
    recomputed). A value is kept where allowed (never a view: its base is), else recomputed
    from its own inputs."""
    saved_inputs: set[torch.fx.Node] = set()
    residuals: set[torch.fx.Node] = set()
    recompute: set[torch.fx.Node] = set()
    stack = list(needed)
    while stack:
        node = stack.pop()
        if node in saved_inputs or node in residuals or node in recompute:
            continue
        if node in input_set:
            saved_inputs.add(node)
        elif node.op == "get_attr":
            recompute.add(node)
        elif exact and node in allowed:
            residuals.add(node)
        elif not exact and not is_view(node) and (node in allowed or producer(node) in allowed) and not is_tuple(node):
            residuals.add(node)
        else:
            recompute.add(node)
            stack.extend(node.all_input_nodes)
    return saved_inputs, residuals, recompute


def _within_budget(
    graph: torch.fx.Graph,
    forward_nodes: set[torch.fx.Node],
    needed: list[torch.fx.Node],
    input_set: set[torch.fx.Node],
    decide: Decide,
    budget: Budget,
    must_keep: set[torch.fx.Node],
) -> set[torch.fx.Node]:
    """What a memory-budget region may keep: the values of its own ops (nested regions
    decide theirs) whose kept bytes fit the budget with the least recompute FLOPs, and its
    collectives' outputs, kept anyway (a budget names no op)."""
    base = _allowed(graph, forward_nodes, lambda n: kept_unasked(None, n.target) if budget.governs(n) else decide(n))
    base |= must_keep
    _, _, recomputed_by_default = _walk(needed, base, input_set)
    candidates = [
        producer(n) for n in graph.nodes
        if n in recomputed_by_default and n.op == "call_function" and budget.governs(n) and not is_view(n)
    ]

    def cost(chosen: frozenset[torch.fx.Node]) -> tuple[int, int]:
        _, residuals, recompute = _walk(needed, base | chosen, input_set)
        kept = sum(value_bytes(r.meta["val"]) for r in residuals if r not in must_keep)
        return kept, sum(flops(n) for n in recompute)

    candidates = list(dict.fromkeys(candidates))
    seeds = [frozenset(c for c in candidates if ask(policy, c)) for policy in BUDGET_SEEDS]
    return base | choose_within_budget(candidates, cost, budget, seeds)


def _allowed(graph: torch.fx.Graph, forward_nodes: set[torch.fx.Node], decide: Decide) -> set[torch.fx.Node]:
    """The forward values that may be kept: policy-approved, or the base of an approved view."""
    allowed: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node not in forward_nodes or node.op != "call_function" or node.target is operator.getitem:
            continue
        if decide(node):
            if is_view(node):
                root = view_root(node)
                if root.op == "call_function":
                    allowed.add(producer(root))
            else:
                allowed.add(node)
    return allowed


def _kept_value(node: torch.fx.Node) -> KeptValue:
    val = node.meta["val"]
    custom = node.meta.get("custom", {}) or producer(node).meta.get("custom", {})
    return KeptValue(
        op=producer(node).target,
        name=node_name(node) or node_name(producer(node)),
        source=source_line(node),
        shape=tuple(val.shape),
        dtype=val.dtype,
        scope=custom.get(SCOPE_KEY, 0),
    )
