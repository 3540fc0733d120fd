"""The records the stages pass on: the regions a trace met (`Scope`) and what stage 1
recorded of one function (`StageOne`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx

from .hooks import HookCall, HookSet
from .randomness import Source

if TYPE_CHECKING:
    from .arguments import Call


@dataclass(frozen=True)
class Scope:
    """A remat region met while tracing: the outermost one, or one nested inside it."""

    policy: Callable[..., bool] | None
    region: str


@dataclass(frozen=True)
class InPlaceWrite:
    """An in-place write the traced function makes, by what its operands are computed from:
    the graph inputs (positions) and whether a random draw reaches the tensor written and
    the other tensors the op reads (a random fill's own draw counts as read), and the
    graph input the written tensor is, or is a view of. Under vmap, eager code refuses to
    write a batched value into an unbatched tensor; under a gradient transform, to write
    into a tensor the transform does not track (one the function closes over)."""

    target_inputs: frozenset[int]
    target_random: bool
    value_inputs: frozenset[int]
    value_random: bool
    target_input: int | None = None


@dataclass(frozen=True)
class StageOne:
    """The stage-1 graph of one function and what it needs per call, built whole once
    stage 1 is done."""

    graph: torch.fx.GraphModule
    n_explicit: int  # graph inputs [0, n_explicit) are the call's tensors, in order
    lifted: list[int]  # then these captured candidates (indices into Call.captured)
    by_reference: list[torch.Tensor]  # then these tensors, captured from globals or attributes
    input_paths: list[str]
    out_spec: Any
    out_static: list[Any]  # output leaves; None where a tensor goes
    n_outputs: int  # tensor outputs of the user function
    mutated: list[int]  # graph inputs whose new values follow the outputs
    input_needs_grad: list[bool] = field(default_factory=list)
    scopes: list[Scope] = field(default_factory=list)  # [0] is the region itself, then nested ones
    input_values: list[Any] = field(default_factory=list)  # fake example of each graph input
    reads_storage_offsets: bool = False  # as_strided reads an input: plans are per storage offset
    output_differentiable: list[bool] = field(default_factory=list)  # per tensor output: tracked by autograd
    # each generator's stream when the function returns; None: every draw continues the stream
    rng_end: dict[str, Source] | None = field(default_factory=dict)
    n_hook_outputs: int = 0  # the last of the n_outputs: what module hooks are given (`hooks`)
    n_handed: int = 0  # before those: intermediates a chained region's first part hands the rest
    hook_calls: list[HookCall] = field(default_factory=list)
    hooks: HookSet | None = None  # the hooks of the modules the trace called
    changes_state: bool = False  # the trace changed an object the function reaches (warned)
    # a random fill of a tensor made like another (see _running/executing.eager_under_transforms)
    fills_like: bool = False
    fills_permuted: bool = False  # one of them of a tensor whose memory order is not its logical order
    units: dict[int, Any] = field(default_factory=dict)  # custom autograd.Functions traced as units (`_trace/functions`)
    # before functionalization (see _running/executing.eager_under_transforms)
    in_place_writes: tuple[InPlaceWrite, ...] = ()
    # the grad mode the function leaves its caller in (`torch.set_grad_enabled(False)` not undone)
    grad_enabled_after: bool = True

    @functools.cached_property
    def returned_as_is(self) -> list[tuple[int, bool, int]]:
        """The outputs eager code returns as the very objects it has: (position, True, graph
        input) for an input returned unchanged, (position, False, earlier position) for a
        value returned again. A hook or `retain_grad` on such an object sees every gradient
        that reaches it, as in eager code, not the share that came through one output."""
        outs = list(next(n for n in self.graph.graph.nodes if n.op == "output").args[0])[: self.n_outputs]
        placeholders = {n: i for i, n in enumerate(n for n in self.graph.graph.nodes if n.op == "placeholder")}
        first: dict[Any, int] = {}
        as_is: list[tuple[int, bool, int]] = []
        for j, out in enumerate(outs):
            if out in placeholders:
                as_is.append((j, True, placeholders[out]))
            elif out in first:
                as_is.append((j, False, first[out]))
            else:
                first[out] = j
        return as_is

    def graph_inputs(self, call: Call) -> list[torch.Tensor]:
        """The call's tensors in this graph's input order: its arguments, the captured tensors
        the graph reads, then the tensors it holds by reference."""
        return call.tensors + [call.captured[i] for i in self.lifted] + self.by_reference
