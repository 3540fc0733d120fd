"""Custom torch.autograd.Functions traced as units, under torch.func transforms.

A Function's forward traces like any code, but its backward is its own, not the
derivative of those ops (a straight-through estimator, a clipped gradient, a kernel
written by hand), so the ops alone would give a wrong gradient. Under a torch.func
transform, where a region must be traced, stage 1 therefore keeps each application as a
unit: its tensor arguments enter through one marker op and each tensor it returns leaves
through another, the ops in between are its forward. Stage 2 does not replay those ops:
at the unit's last marker it calls the Function itself, so autograd runs its own backward
while the joint graph is traced, and that backward's ops are what the graph recomputes
and differentiates. The policy then decides about the forward's and the backward's ops
like any others.

Only what a replay of the Function reproduces is a unit: its forward may not draw random
numbers nor write in place (the graph would hold them twice or not at all), and it must
be usable under torch.func as torch requires (a `setup_context`; under vmap, a vmap rule).
Outside transforms a region with a Function runs replayed, its Python again in backward.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import optree
import torch
import torch.fx

from .._core.errors import RematTraceError
from .._core.nodes import ancestors, is_random, is_view
from .._core.torch_internals import (
    any_autocast_enabled,
    function_applications_to,
    function_has_setup_context,
    function_has_vmap_rule,
)


@torch.library.custom_op("remat::unit_inputs", mutates_args=())
def _unit_inputs(xs: list[torch.Tensor], unit: int) -> list[torch.Tensor]:
    """A Function's tensor arguments, entering unit `unit` (copies: custom ops may not
    return their inputs; stage 2 never runs it)."""
    return [x.clone() for x in xs]


@_unit_inputs.register_fake
def _(xs: list[torch.Tensor], unit: int) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in xs]


def _unit_inputs_backward(ctx: Any, grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], None]:
    return list(grads), None


_unit_inputs.register_autograd(_unit_inputs_backward)


@torch.library.custom_op("remat::unit_output", mutates_args=())
def _unit_output(x: torch.Tensor, unit: int, index: int) -> torch.Tensor:
    """Output `index` (of the flattened result) of unit `unit`."""
    return x.clone()


@_unit_output.register_fake
def _(x: torch.Tensor, unit: int, index: int) -> torch.Tensor:
    return torch.empty_like(x)


def _unit_output_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    return grad, None, None


_unit_output.register_autograd(_unit_output_backward)

UNIT_INPUTS = torch.ops.remat.unit_inputs.default
UNIT_OUTPUT = torch.ops.remat.unit_output.default
UNIT_MARKERS = frozenset({UNIT_INPUTS, UNIT_OUTPUT})

# While a unit's outputs pass through their markers: the tracer lets values of a custom
# Function through (elsewhere it refuses them: their backward is not in the graph).
_LEAVING: contextvars.ContextVar[bool] = contextvars.ContextVar("remat_leaving_unit", default=False)


def leaving_unit() -> bool:
    return _LEAVING.get()


@dataclass
class Unit:
    """One application of a Function: how to call it again from its tensor arguments."""

    function: type[torch.autograd.Function]
    spec: Any  # the tree of (args, kwargs)
    leaves: list[Any]  # its leaves, None where a tensor goes
    tensor_positions: list[int]  # where the tensors go, in the inputs marker's order

    def apply(self, tensors: list[torch.Tensor]) -> list[Any]:
        """The Function applied to `tensors`: its result's leaves, as flattened in stage 1."""
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors, strict=True):
            leaves[position] = tensor
        args, kwargs = optree.tree_unflatten(self.spec, leaves)
        return optree.tree_leaves(self.function.apply(*args, **kwargs), none_is_leaf=True)  # type: ignore[arg-type]


@dataclass
class UnitRecorder:
    """Stage 1's side: each custom Function the traced code applies becomes a unit."""

    vmapped: bool  # a vmap is among the transforms the region runs under
    nested: bool  # the region is differentiated twice (a gradient of a gradient)
    units: dict[int, Unit] = field(default_factory=dict)
    _numbers: Iterator[int] = field(default_factory=itertools.count)

    def start(self) -> None:
        """(Again, when the trace restarts.)"""
        self.units.clear()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with function_applications_to(self._apply):
            yield

    def _apply(self, function: type[torch.autograd.Function], apply: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        name = function.__qualname__
        if not function_has_setup_context(function):
            raise RematTraceError(
                f"the custom torch.autograd.Function `{name}` has no `setup_context` staticmethod, which torch "
                "requires of a Function used under torch.func transforms (grad, vjp, vmap...), as this region is: "
                "move `ctx` out of `forward` into `setup_context(ctx, inputs, output)`",
                replayable=False,
            )
        if self.vmapped and not function_has_vmap_rule(function):
            raise RematTraceError(
                f"the custom torch.autograd.Function `{name}` has no vmap rule, which torch requires of a Function "
                "used under vmap, as this region is: set `generate_vmap_rule = True` on it, or give it a `vmap` "
                "staticmethod",
                replayable=False,
            )
        if any_autocast_enabled():
            raise RematTraceError(
                f"the custom torch.autograd.Function `{name}` is applied under autocast, whose casts remat cannot "
                "replay inside a unit: apply it outside the autocast context (or cast its inputs yourself)",
                replayable=False,
            )
        if self.nested:
            raise RematTraceError(
                f"a gradient of a gradient through the custom torch.autograd.Function `{name}`: remat traces a "
                "Function's backward as ops whose own derivatives are those of its forward's ops, not of the "
                "Function, so the second gradient would be wrong. Take the inner gradient outside the remat'd "
                "function, or apply remat to code without the Function",
                replayable=False,
            )
        leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)  # type: ignore[arg-type]
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not positions:  # nothing for its backward to reach: its ops are the whole story
            return apply(*args, **kwargs)
        number = next(self._numbers)
        entered = UNIT_INPUTS([leaves[i] for i in positions], number)
        statics = [None if i in positions else x for i, x in enumerate(leaves)]
        for i, tensor in zip(positions, entered, strict=True):
            leaves[i] = tensor
        self.units[number] = Unit(function, spec, statics, positions)
        args, kwargs = optree.tree_unflatten(spec, leaves)
        token = _LEAVING.set(True)
        try:
            out = apply(*args, **kwargs)
            out_leaves, out_spec = optree.tree_flatten(out, none_is_leaf=True)  # type: ignore[arg-type]
            left = []
            for index, leaf in enumerate(out_leaves):
                if isinstance(leaf, torch.Tensor):
                    marked = UNIT_OUTPUT(leaf, number, index)
                    leaf = marked if leaf.requires_grad else marked.detach()  # a non-differentiable output stays one
                left.append(leaf)
        finally:
            _LEAVING.reset(token)
        return optree.tree_unflatten(out_spec, left)


def unit_of(node: torch.fx.Node) -> int | None:
    """The unit a marker node belongs to."""
    if node.op == "call_function" and node.target in UNIT_MARKERS:
        return int(node.args[1])  # type: ignore[call-overload]
    return None


def interiors(graph: torch.fx.Graph) -> dict[int, set[torch.fx.Node]]:
    """Per unit, the ops of its forward: everything that depends on its inputs marker, up
    to its output markers (a value read past them would be one the Function leaks)."""
    found: dict[int, set[torch.fx.Node]] = {}
    for entry in graph.nodes:
        if entry.target is not UNIT_INPUTS:
            continue
        below: set[torch.fx.Node] = set()
        stack = list(entry.users)
        while stack:
            node = stack.pop()
            if node in below or node.target is UNIT_OUTPUT:
                continue
            if node.op == "output":
                raise RematTraceError(
                    "a custom torch.autograd.Function hands out a value it computes inside other than by returning "
                    "it, which remat cannot trace as a unit"
                )
            below.add(node)
            stack.extend(node.users)
        found[unit_of(entry)] = below  # type: ignore[index]
    return found


def check_units(graph: torch.fx.Graph, units: dict[int, Unit]) -> None:
    """Refuse a unit whose forward a replay of the Function would not reproduce, or whose
    backward alone reads a random draw (see `_drawn_argument_only_backward_reads`)."""
    for unit, interior in interiors(graph).items():
        name = units[unit].function.__qualname__
        drawn = _drawn_argument_only_backward_reads(graph, unit)
        if drawn is not None:
            raise RematTraceError(
                f"the custom torch.autograd.Function `{name}` does not read its tensor argument {drawn} in "
                "forward, and that argument is computed from random draws: only the Function's backward reads "
                "it, where remat would draw the numbers again. Compute the argument outside the remat'd "
                "function and pass it in, or read it in the Function's forward",
                replayable=False,
            )
        for node in interior:
            if node.op != "call_function":
                continue
            schema = getattr(node.target, "_schema", None)
            if is_random(node):
                raise RematTraceError(
                    f"the custom torch.autograd.Function `{name}` draws random numbers in its forward "
                    f"({node.target}), which remat cannot recompute as a unit: draw them outside the Function and "
                    "pass them in",
                    replayable=False,
                )
            if schema is not None and schema.is_mutable and _entered(node.args[0]):
                raise RematTraceError(
                    f"the custom torch.autograd.Function `{name}` writes in place into an argument "
                    f"({node.target}), which remat cannot recompute as a unit: return a new tensor instead",
                    replayable=False,
                )


def unit_entry(graph: torch.fx.Graph, unit: int) -> torch.fx.Node:
    """The inputs marker of Function unit `unit`: where the unit's arguments enter the graph."""
    return next(n for n in graph.nodes if n.target is UNIT_INPUTS and unit_of(n) == unit)


def _drawn_argument_only_backward_reads(graph: torch.fx.Graph, unit: int) -> int | None:
    """The position (among its tensor arguments) of an argument of `unit` that its forward
    does not read and that is computed from a random draw, or None. Eager code draws it in
    forward; in remat's joint graph nothing forward reads it, so it would be drawn in
    backward, from the generator as it is then."""
    entry = unit_entry(graph, unit)
    read = {u.args[1] for u in entry.users if u.target is operator.getitem and u.users}
    for position, argument in enumerate(entry.args[0]):  # type: ignore[arg-type]
        if position not in read and any(is_random(n) for n in ancestors([argument], set())):
            return position
    return None


def _entered(value: Any) -> bool:
    """Whether `value` is (a view of) a tensor a unit's inputs marker hands in."""
    while isinstance(value, torch.fx.Node) and value.op == "call_function":
        if value.target is operator.getitem and getattr(value.args[0], "target", None) is UNIT_INPUTS:
            return True
        if not is_view(value):
            return False
        value = value.args[0]
    return False
