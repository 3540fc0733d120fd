"""Facts about nodes of traced aten graphs, shared by the stages that read them."""

from __future__ import annotations

import functools
import operator
from typing import Any, Iterable, Sequence

import optree
import torch
import torch.fx

from .torch_internals import OpOverload, size_hint

# What tracing writes in node.meta["custom"], which retraces carry over to new graphs.
SOURCE_KEY = "remat_source"  # the user's file:line that ran the op
SCOPE_KEY = "remat_scope"  # index of the nested remat region whose policy governs the op
DIFFERENTIABLE_KEY = "remat_differentiable"  # whether autograd tracks the value
BACKWARD_KEY = "remat_backward"  # computed by an autograd.grad/backward the function runs: whether it builds a graph
USER_DETACH_KEY = "remat_user_detach"  # a `detach` the function's code calls (not autograd's own)
RNG_STREAM_KEY = "remat_rng_stream"  # a random op's (draw number, generator, the stream it draws from)
FILL_LIKE_KEY = "remat_fill_like"  # a random fill drawn into a fresh tensor, where eager filled a tensor in place
FILL_PERMUTED_KEY = "remat_fill_permuted"  # such a fill of a tensor whose memory order is not its logical order
AUTOCAST_CAST_KEY = "remat_autocast_cast"  # a cast autocast made (not the user's `.to`)
NAME_KEY = "remat_name"  # the name checkpoint_name gave the value
USE_ALIAS_KEY = "remat_use_alias"  # stage 2's alias of an input for one of its uses, taken out after
GRADIENT_COUNT_KEY = "remat_gradient_count"  # on a joint graph's input: how many gradients it gets, one per use
GRAD_OFF_KEY = "remat_grad_off"  # computed with grad disabled (no_grad, inference_mode): a constant of backward

# The ops that read a tensor's memory by its strides and offset, not by its logical order.
AS_STRIDED_OPS = frozenset({torch.ops.aten.as_strided, torch.ops.aten.as_strided_copy, torch.ops.aten.as_strided_scatter})

NO_DEFAULT = object()  # an argument without a default in its op's schema


@functools.cache
def schema_defaults(op: OpOverload) -> tuple[list[Any], dict[str, Any]]:
    """An op's positional arguments' defaults (NO_DEFAULT where none), and its keyword-only
    arguments' (torch 2.13, FunctionSchema)."""
    arguments = op._schema.arguments
    positional = [a.default_value if a.has_default_value() else NO_DEFAULT for a in arguments if not a.kwarg_only]
    keyword = {a.name: a.default_value for a in arguments if a.kwarg_only and a.has_default_value()}
    return positional, keyword


@functools.cache
def written_arguments(op: OpOverload) -> tuple[tuple[int, str], ...]:
    """The (position, name) of each argument an op writes in place, as its schema says."""
    return tuple((i, a.name) for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


# Ops that update running statistics in training although their schemas do not say so
# (torch 2.13): the positions of those statistics.
_UNDECLARED_MUTATIONS = {
    torch.ops.aten.native_batch_norm.default: (3, 4),
    torch.ops.aten._native_batch_norm_legit.default: (3, 4),
    torch.ops.aten.cudnn_batch_norm.default: (3, 4),
    torch.ops.aten.miopen_batch_norm.default: (3, 4),
}


# In-place ops whose result does not depend on what the memory they write held before.
_OVERWRITING = frozenset({
    torch.ops.aten.copy_.default, torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor, torch.ops.aten.zero_.default,
    torch.ops.aten.uniform_.default, torch.ops.aten.normal_.default, torch.ops.aten.bernoulli_.float,
    torch.ops.aten.bernoulli_.Tensor, torch.ops.aten.exponential_.default, torch.ops.aten.geometric_.default,
    torch.ops.aten.log_normal_.default, torch.ops.aten.cauchy_.default, torch.ops.aten.random_.default,
    getattr(torch.ops.aten.random_, "from"), torch.ops.aten.random_.to,
})


# c10d's collectives (torch.distributed.all_reduce and the like, process-group calls) that
# write their first argument (a tensor or a list of them) although their schemas do not
# say so (torch 2.13); the second set only fill an output buffer, not reading what it held.
_C10D_WRITING = frozenset({
    "allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_", "allgather_", "_allgather_base_",
    "allgather_coalesced_", "allgather_into_tensor_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_", "alltoall_", "alltoall_base_", "gather_", "scatter_", "recv_",
    "recv_any_source_",
})
_C10D_FILLING = _C10D_WRITING - {"allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_"}


def _c10d_name(op: Any) -> str | None:
    """The name of a c10d collective, or None for any other op."""
    return op.__name__.split(".")[0] if getattr(op, "namespace", None) == "c10d" else None


def writes_in_place(op: OpOverload) -> bool:
    """Whether `op` writes memory it was given: as its schema says, or a c10d collective."""
    return op._schema.is_mutable or _c10d_name(op) in _C10D_WRITING


def overwrites(op: OpOverload) -> bool:
    """Whether `op` writes without reading what the memory held: a copy, a fill, or only
    `out=` arguments (an all-gather's output buffer)."""
    if op in _OVERWRITING or _c10d_name(op) in _C10D_FILLING:
        return True
    written = [a for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    return bool(written) and all(a.kwarg_only and a.name.startswith("out") for a in written)


def written_values(op: OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """What a call of `op` writes in place (fx nodes or tensors, None for an absent
    optional): the arguments its schema marks written, and batch norm's running
    statistics in training and c10d collectives' tensors, which their schemas do not mark."""
    undeclared = _UNDECLARED_MUTATIONS.get(op)
    if undeclared is not None and args[5]:  # training: updates the statistics
        return [args[i] for i in undeclared]
    if _c10d_name(op) in _C10D_WRITING:
        return [args[0]]
    return [args[i] if i < len(args) else kwargs.get(name) for i, name in written_arguments(op)]


def ancestors(roots: Iterable[Any], stop: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes `roots` are computed from, not looking past `stop` (which are included)."""
    seen: set[torch.fx.Node] = set()
    todo = [r for r in roots if isinstance(r, torch.fx.Node)]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node not in stop:
            todo.extend(node.all_input_nodes)
    return seen


def producer(node: torch.fx.Node) -> torch.fx.Node:
    """The op node behind `node`: its parent for a getitem of a multi-output op."""
    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[0]  # type: ignore[return-value]
    return node


def is_view(node: torch.fx.Node) -> bool:
    op = producer(node).target
    return isinstance(op, OpOverload) and op.is_view


def view_root(node: torch.fx.Node) -> torch.fx.Node:
    """The value `node` views (through views only), or `node` itself when it is no view."""
    while node.op == "call_function" and is_view(node):
        source = producer(node).args[0]
        if not isinstance(source, torch.fx.Node):
            break
        node = source
    return node


def is_random(node: torch.fx.Node) -> bool:
    """Whether the op draws random numbers (attention with dropout_p=0 does not)."""
    node = producer(node)
    return isinstance(node.target, OpOverload) and draws_random(node.target, node.args, node.kwargs)


def draws_random(op: OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a call of `op` with these arguments draws random numbers (attention with
    dropout_p=0 does not)."""
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" in names:
        index = names.index("dropout_p")
        p = kwargs.get("dropout_p", args[index] if index < len(args) else 0.0)
        return bool(p != 0.0)
    return True


def generators_of(args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Generator]:
    """The generators a call is given explicitly (`generator=`), not the default ones."""
    leaves: list[Any] = optree.tree_leaves((args, kwargs))  # type: ignore[arg-type]
    return [g for g in leaves if isinstance(g, torch.Generator)]


def is_tuple(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def meta_like(value: Any) -> Any:
    """A data-free meta tensor with `value`'s shape, strides and dtype (what policies see);
    other values unchanged. A symbolic size becomes its hint, the size it was traced with."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = tuple(size_hint(s) for s in value.shape)
    stride = tuple(size_hint(s) for s in value.stride())
    return torch.empty_strided(shape, stride, dtype=value.dtype, device="meta")


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return meta_like(value.meta.get("val"))
    return value


def meta_arguments(node: torch.fx.Node) -> tuple[Any, dict[str, Any]]:
    """The node's args and kwargs with every input replaced by a data-free meta tensor."""
    is_node = lambda x: isinstance(x, torch.fx.Node)  # noqa: E731
    args: Any = optree.tree_map(_to_meta, node.args, is_leaf=is_node, none_is_leaf=True)  # type: ignore[arg-type]
    kwargs: Any = optree.tree_map(_to_meta, node.kwargs, is_leaf=is_node, none_is_leaf=True)  # type: ignore[arg-type]
    return args, kwargs


def comes_after(graph: torch.fx.Graph, a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether node `a` comes after node `b` in `graph`."""
    for node in graph.nodes:
        if node is b:
            return True
        if node is a:
            return False
    return False


def annotate(
    node: torch.fx.Node | None, key: str, value: object, overwrite: bool = True, producer_too: bool = True
) -> None:
    """Write `key` in the node's custom meta, which retraces carry over to the new graph.

    An output of a multi-output op is a getitem node that retraces rebuild from the op's
    node, so the op's node gets the annotation too (unless `producer_too` is False).
    """
    while node is not None:
        custom = node.meta.get("custom", {})
        if overwrite or key not in custom:
            node.meta["custom"] = {**custom, key: value}
        is_item = producer_too and node.op == "call_function" and node.target is operator.getitem
        node = node.args[0] if is_item else None  # type: ignore[assignment]


def source_line(node: torch.fx.Node) -> str | None:
    """The user's `file:line` that made the node's value (its op's, for an output of a
    multi-output op), if tracing saw one."""
    custom = node.meta.get("custom", {}) or producer(node).meta.get("custom", {})
    return custom.get(SOURCE_KEY)


def node_name(node: torch.fx.Node) -> str | None:
    """The checkpoint_name written on a traced node, if any."""
    return node.meta.get("custom", {}).get(NAME_KEY)
