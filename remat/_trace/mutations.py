"""Mutations: a traced function may update its inputs; recompute must never do it again.

Functionalization turns in-place updates of inputs into a trailing `copy_(input, new)`,
which becomes an extra output that remat applies once per call. A few ops update inputs
without saying so in their schemas (batch norm's running statistics): they are rewritten
to their functional forms. In-place metadata ops on intermediates (`squeeze_`) become
their out-of-place twins. Anything else that writes in place is refused.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx

from .._core.errors import RematTraceError
from .._core.nodes import comes_after, is_random, source_line, view_root, written_values
from .._core.torch_internals import OpOverload
from .passes import argument
from .records import InPlaceWrite

_aten = torch.ops.aten
# Batch norms in training mode that update running statistics in place. All take
# (input, weight, bias, running_mean, running_var, training, momentum, eps) and return the
# normalized output, the batch mean and the inverse std first; the functional form returns
# those and the new statistics. (cuDNN's and MIOpen's kernels become the native one, whose
# results may differ from theirs in the last bits; checked on CPU only.)
_BATCH_NORMS_WITH_STATS = (
    _aten.native_batch_norm.default,
    _aten._native_batch_norm_legit.default,
    _aten.cudnn_batch_norm.default,
    _aten.miopen_batch_norm.default,
)


def _mutated_arguments(node: torch.fx.Node) -> list[Any]:
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return []
    return written_values(node.target, node.args, node.kwargs)


def functionalize_remaining_mutations(gm: torch.fx.GraphModule, fn_name: str) -> None:
    """Functionalization leaves a few ops that write their arguments in place: batch
    norm's running statistics (undeclared), ops without a registered functional variant
    (`bernoulli_.float`, which SDPA's dropout uses on CPU; `rrelu_with_noise`'s noise) and
    in-place metadata ops (`transpose_`). Each becomes its out-of-place twin, later readers
    read the new value, and a write to a graph input becomes a trailing `copy_` (an extra
    output, applied once per call). Any other in-place write is refused: recompute would
    write again."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    for node in list(graph.nodes):
        mutated = [m for m in _mutated_arguments(node) if m is not None]
        if not mutated or node.target is _aten.copy_.default:
            continue
        if node.target in _BATCH_NORMS_WITH_STATS and node.args[3] is not None:
            _functional_batch_norm(graph, node, output, fn_name)
            continue
        twin = _functional_twin(node.target)  # type: ignore[arg-type]
        if twin is not None and all(m.op != "placeholder" for m in mutated):
            _rewrite_to_twin(graph, node, twin)
            continue
        where = source_line(node) or "an unknown line"
        raise RematTraceError(
            f"remat({fn_name}): `{node.target}` at {where} updates a tensor in place in a way remat "
            "cannot make functional, so recompute would update it again. Compute the new value "
            "out of place and return it, or keep this op out of the remat'd function."
        )
    graph.lint()


def _functional_batch_norm(graph: torch.fx.Graph, node: torch.fx.Node, output: torch.fx.Node, fn_name: str) -> None:
    """Batch norm in training becomes its functional form, which also returns the new
    running statistics; they replace the old ones for later readers, and a statistic that
    is a graph input gets a trailing copy_."""
    with graph.inserting_before(node):
        functional = graph.call_function(_aten._native_batch_norm_legit_functional.default, node.args, node.kwargs)
    functional.meta = dict(node.meta)
    for user in list(node.users):
        index: Any = user.args[1] if user.target is operator.getitem else None
        if index is not None and index > 2 and not user.users:
            graph.erase_node(user)  # an unused extra output, e.g. cuDNN's reserve space
            continue
        if index is None or index > 2:
            raise RematTraceError(
                f"remat({fn_name}): the output {user.args[1]} of `{node.target}` cannot be traced "
                "functionally. Use only the normalized output of batch norm inside remat."
            )
        user.args = (functional, *user.args[1:])
    for k, stat in ((3, node.args[3]), (4, node.args[4])):
        with graph.inserting_after(functional):
            new_stat = graph.call_function(operator.getitem, (functional, k))
        new_stat.meta = {"val": stat.meta["val"]}  # type: ignore[union-attr]
        _read_new_value(graph, stat, new_stat, node)  # type: ignore[arg-type]
        if stat.op == "placeholder":  # type: ignore[union-attr]
            with graph.inserting_before(output):
                graph.call_function(_aten.copy_.default, (stat, new_stat))
    graph.erase_node(node)


def _read_new_value(graph: torch.fx.Graph, old: torch.fx.Node, new: torch.fx.Node, writer: torch.fx.Node) -> None:
    """Readers of `old` that come after `writer` read `new` instead."""
    for user in [u for u in old.users if u is not writer and u is not new and comes_after(graph, u, writer)]:
        user.replace_input_with(old, new)


@dataclass(frozen=True)
class _Twin:
    """The out-of-place form of an in-place op: `result` is the output index of the op's
    own result (None: the whole output), `written` maps each written argument's position
    to the output index holding its new value (None: the whole output)."""

    op: OpOverload
    result: int | None
    written: dict[int, int | None]


# In-place ops that functionalization leaves alone, with their functional forms (torch 2.13).
_TWINS = {
    _aten.bernoulli_.float: _Twin(_aten.bernoulli.p, None, {0: None}),
    _aten.rrelu_with_noise.default: _Twin(_aten.rrelu_with_noise_functional.default, 0, {1: 1}),
}


def _functional_twin(op: OpOverload) -> _Twin | None:
    """`aten.transpose.int` for `aten.transpose_.default`: the out-of-place op of the same
    name without the trailing underscore whose arguments match."""
    if op in _TWINS:
        return _TWINS[op]
    name = op.overloadpacket._qualified_op_name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    if packet is None:
        return None
    wanted = [(a.name, str(a.type)) for a in op._schema.arguments]
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        if [(a.name, str(a.type)) for a in candidate._schema.arguments] == wanted:
            return _Twin(candidate, None, {0: None})
    return None


def _rewrite_to_twin(graph: torch.fx.Graph, node: torch.fx.Node, twin: _Twin) -> None:
    """Replace in-place `node` by `twin`; later readers of what it wrote read the new values."""
    written = {i: argument(node, i, None) for i in twin.written}
    with graph.inserting_before(node):
        new = graph.call_function(twin.op, node.args, node.kwargs)
    new.meta = dict(node.meta)
    new.meta["val"] = twin.op(*_fake_args(node.args), **_fake_args(node.kwargs)) if twin.result is not None else node.meta["val"]
    result = new
    if twin.result is not None:
        with graph.inserting_after(new):
            result = graph.call_function(operator.getitem, (new, twin.result))
        result.meta = {**node.meta, "val": new.meta["val"][twin.result]}
    node.replace_all_uses_with(result)
    for position, index in twin.written.items():
        value = new
        if index is not None:
            with graph.inserting_after(result):
                value = graph.call_function(operator.getitem, (new, index))
            value.meta = {**node.meta, "val": new.meta["val"][index]}
        _read_new_value(graph, written[position], value, node)  # type: ignore[arg-type]
    graph.erase_node(node)


def _fake_args(args: Any) -> Any:
    return torch.fx.map_arg(args, lambda n: n.meta["val"])


def _through_aliases(node: Any) -> Any:
    """The node itself, or the input behind a chain of `alias` ops (instance norm writes its
    running statistics through `alias(running_mean).copy_(...)`)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is _aten.alias.default:
        node = node.args[0]
    return node


def outputs_for_mutations(gm: torch.fx.GraphModule, fn_name: str, input_paths: Sequence[str], input_needs_grad: Sequence[bool]) -> list[int]:
    """Replace functionalization's trailing `copy_(input, new)` by extra outputs; returns the
    inputs written, in the order of their new values after the outputs."""
    mutated: list[int] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    extra: list[torch.fx.Node] = []
    for node in list(gm.graph.nodes):
        target = _through_aliases(node.args[0]) if node.op == "call_function" else None
        if node.target is torch.ops.aten.copy_.default and target in placeholders:
            index = placeholders.index(target)
            example = target.meta["val"]  # type: ignore[union-attr]
            if (example.is_floating_point() or example.is_complex()) and input_needs_grad[index]:
                raise RematTraceError(
                    f"remat({fn_name}) mutates its input `{input_paths[index]}` in place, and "
                    "that input requires grad. Return the new value instead of mutating the input.",
                    replayable=False,
                )
            mutated.append(index)
            written, value = node.args
            extra.append(value)
            node.replace_all_uses_with(written)
            gm.graph.erase_node(node)
            while written is not target and not written.users:  # aliases only the write read
                alias, written = written, written.args[0]
                gm.graph.erase_node(alias)
    if extra:
        outs = list(output.args[0])
        output.args = (outs + extra,)
    return mutated


def in_place_writes(gm: torch.fx.GraphModule) -> tuple[InPlaceWrite, ...]:
    """The in-place writes of a stage-1 graph before functionalization, each with the graph
    inputs and random draws its written tensor and its other operands are computed from
    (through every op, views included: under vmap an op's result is batched when an
    operand is)."""
    if not any(_mutated_arguments(n) for n in gm.graph.nodes):
        return ()
    reach: dict[torch.fx.Node, tuple[frozenset[int], bool]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for position, node in enumerate(placeholders):
        reach[node] = (frozenset([position]), False)
    writes: list[InPlaceWrite] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        operands = [reach[a] for a in node.all_input_nodes if a in reach]
        drawn = is_random(node)
        reach[node] = (frozenset().union(*(r[0] for r in operands)), drawn or any(r[1] for r in operands))
        for target in _mutated_arguments(node):
            if not isinstance(target, torch.fx.Node) or target not in reach:
                continue
            others = [reach[a] for a in node.all_input_nodes if a is not target and a in reach]
            viewed = _viewed_input(target) if target is node.args[0] and _in_place_op(node.target) else None
            writes.append(InPlaceWrite(
                target_inputs=reach[target][0], target_random=reach[target][1],
                value_inputs=frozenset().union(*(r[0] for r in others)),
                value_random=drawn or any(r[1] for r in others),
                target_input=placeholders.index(viewed) if viewed is not None else None,
            ))
    return tuple(writes)


def _in_place_op(op: Any) -> bool:
    """Whether `op` writes its first argument and returns it, and aliases nothing else:
    what torch.func's gradient transforms call an in-place op (`add_`, `copy_`; not batch
    norm, which writes its running statistics unannounced) and check (torch 2.13)."""
    schema = op._schema
    if not schema.is_mutable or len(schema.returns) != 1 or not schema.arguments:
        return False
    first, rest = schema.arguments[0].alias_info, schema.arguments[1:]
    returned = schema.returns[0].alias_info
    return bool(
        first is not None and first.is_write and all(a.alias_info is None for a in rest)
        and returned is not None and returned.is_write
    )


def _viewed_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The placeholder `node` is, or is a view of (through views only), else None."""
    root = view_root(node)
    return root if root.op == "placeholder" else None
