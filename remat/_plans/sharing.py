"""Plans shared between regions whose stage-1 graphs are the same.

A model's layers are usually one class with other parameters, so each layer's traced graph
is the same graph. Tracing the joint forward+backward graph and partitioning it (about two
thirds of a trace) then happens once: every further layer traces its stage-1 graph, which
is what decides whether it is the same, and reuses the partitioned graphs with its own
names and tensors.

"The same" is decided on everything the plan is built from: each node's op, arguments,
traced value (shape, strides, storage offset, dtype, device, requires-grad) and the facts
remat wrote on it (names, source lines, scopes, random indices), the inputs' and outputs'
structure, and the policies of the region and of the regions nested in it. Anything this
cannot compare for certain (a tensor constant, a generator, an op that is not an aten
op) makes the graph unshared: it is planned on its own, as before.
"""

from __future__ import annotations

import operator
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from .._core.torch_internals import OpOverload

if TYPE_CHECKING:
    from .._trace.records import StageOne

_SHARED: weakref.WeakValueDictionary[tuple[Any, ...], Any] = weakref.WeakValueDictionary()

_ATOMS = (bool, int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class _Unshareable(Exception):
    """A graph holds something whose equality cannot be decided here."""


def _canonical(value: Any, index: dict[torch.fx.Node, int]) -> Any:
    """A hashable form of a node argument or fact, equal only for equal values."""
    if isinstance(value, torch.fx.Node):
        if value not in index:
            raise _Unshareable("a node of another graph")
        return ("node", index[value])
    if isinstance(value, (float, complex)):
        return (type(value), repr(value))  # repr: -0.0 and 0.0 differ
    if isinstance(value, _ATOMS):
        return (type(value), value)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_canonical(v, index) for v in value))
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise _Unshareable("a dict with keys that are not strings")
        return (dict, tuple((k, _canonical(value[k], index)) for k in sorted(value)))
    if isinstance(value, slice):
        return (slice, _canonical((value.start, value.stop, value.step), index))
    raise _Unshareable(type(value).__name__)


def _traced_value(value: Any) -> Any:
    """What the plan reads of a node's traced value."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise _Unshareable("unstrided tensor")
        return (
            "tensor", tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype,
            value.device, value.requires_grad,
        )
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_traced_value(v) for v in value))
    return _canonical(value, {})


def _target(target: Any) -> Any:
    if isinstance(target, OpOverload) or target is operator.getitem:
        return target
    raise _Unshareable(repr(target))


def graph_signature(stage_one: StageOne) -> tuple[Any, ...] | None:
    """Everything of a stage-1 capture its plan depends on, or None when it cannot be
    compared for certain (the plan is then not shared)."""
    if stage_one.units:  # custom Functions: their graphs name no Function (`_trace/functions`)
        return None
    index: dict[torch.fx.Node, int] = {}
    nodes = []
    try:
        for node in stage_one.graph.graph.nodes:
            if node.op not in ("placeholder", "call_function", "output"):
                raise _Unshareable(node.op)  # get_attr: a constant whose values live on the module
            index[node] = len(index)
            nodes.append((
                node.op,
                _target(node.target) if node.op == "call_function" else None,
                _canonical(node.args, index),
                _canonical(node.kwargs, index),
                _traced_value(node.meta.get("val")),
                _canonical(node.meta.get("custom", {}), index),
            ))
        outputs = _canonical(stage_one.out_static, {})
        streams = _canonical(stage_one.rng_end, {})
    except _Unshareable:
        return None
    return (
        tuple(nodes),
        stage_one.n_explicit, tuple(stage_one.lifted), len(stage_one.by_reference), stage_one.out_spec, outputs,
        stage_one.n_outputs, tuple(stage_one.mutated), tuple(stage_one.input_needs_grad),
        tuple(stage_one.output_differentiable), stage_one.reads_storage_offsets,
        tuple(scope.policy for scope in stage_one.scopes), streams,
    )


def shared_plan(key: tuple[Any, ...]) -> Any:
    """The live plan stored under `key`, or None."""
    return _SHARED.get(key)


def share_plan(key: tuple[Any, ...], plan: Any) -> None:
    _SHARED[key] = plan


def clear_shared_plans() -> None:
    _SHARED.clear()
