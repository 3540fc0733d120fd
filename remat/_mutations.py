"""Mutations: a traced function may update its inputs; recompute must never do it again.

Functionalization turns in-place updates of inputs into a trailing `copy_(input, new)`,
which becomes an extra output that remat applies once per call. A few ops update inputs
without saying so in their schemas (batch norm's running statistics): they are rewritten
to their functional forms. In-place metadata ops on intermediates (`squeeze_`) become
their out-of-place twins. Anything else that writes in place is refused.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from ._errors import RematTraceError
from ._nodes import SOURCE_KEY

if TYPE_CHECKING:
    from ._tracing import Captured

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
# Ops that update running statistics although their schemas do not say so (torch 2.13).
_UNDECLARED_MUTATIONS = {
    _aten.native_batch_norm.default: (3, 4),
    _aten._native_batch_norm_legit.default: (3, 4),
    _aten.cudnn_batch_norm.default: (3, 4),
    _aten.miopen_batch_norm.default: (3, 4),
}


def _mutated_arguments(node: torch.fx.Node) -> list[Any]:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    if node.target in _UNDECLARED_MUTATIONS and node.args[5]:  # training: updates the statistics
        return [node.args[i] for i in _UNDECLARED_MUTATIONS[node.target]]
    schema = node.target._schema
    return [
        node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]


def functionalize_remaining_mutations(gm: torch.fx.GraphModule, fn_name: str) -> None:
    """Functionalization leaves a few ops that update their inputs (batch norm's running
    statistics); recompute would update them again. Batch norm becomes its functional
    form plus a trailing copy_ (which turns into an output); any other is refused."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    for node in list(graph.nodes):
        mutated = [m for m in _mutated_arguments(node) if m is not None]
        if not mutated or node.target is _aten.copy_.default:
            continue
        if node.target in _BATCH_NORMS_WITH_STATS and node.args[3] is not None:
            with graph.inserting_before(node):
                functional = graph.call_function(_aten._native_batch_norm_legit_functional.default, node.args, node.kwargs)
            functional.meta = dict(node.meta)
            for user in list(node.users):
                if user.target is operator.getitem and user.args[1] > 2 and not user.users:
                    graph.erase_node(user)  # an unused extra output, e.g. cuDNN's reserve space
                    continue
                if user.target is not operator.getitem or user.args[1] > 2:
                    raise RematTraceError(
                        f"remat({fn_name}): the output {user.args[1]} of `{node.target}` cannot be traced "
                        "functionally. Use only the normalized output of batch norm inside remat."
                    )
                user.args = (functional, *user.args[1:])
            with graph.inserting_before(output):
                for k, stat in ((3, node.args[3]), (4, node.args[4])):
                    with graph.inserting_after(functional):
                        new_stat = graph.call_function(operator.getitem, (functional, k))
                    new_stat.meta = {"val": stat.meta["val"]}  # type: ignore[union-attr]
                    later = [u for u in stat.users if u is not functional and u is not node]  # type: ignore[union-attr]
                    for user in later:
                        if _comes_after(graph, user, node):
                            user.replace_input_with(stat, new_stat)  # type: ignore[arg-type]
                    graph.call_function(_aten.copy_.default, (stat, new_stat))
            graph.erase_node(node)
            continue
        twin = _out_of_place_twin(node.target)
        if twin is not None and all(m.op != "placeholder" for m in mutated):
            # an in-place metadata op (squeeze_, t_, ...) on an intermediate: make it a new value
            node.target = twin
            for later in [u for u in mutated[0].users if u is not node and _comes_after(graph, u, node)]:
                later.replace_input_with(mutated[0], node)
            continue
        where = node.meta.get("custom", {}).get(SOURCE_KEY, "an unknown line")
        raise RematTraceError(
            f"remat({fn_name}): `{node.target}` at {where} updates a tensor in place in a way remat "
            "cannot make functional, so recompute would update it again. Compute the new value "
            "out of place and return it, or keep this op out of the remat'd function."
        )
    graph.lint()


def _out_of_place_twin(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """`aten.squeeze.dim` for `aten.squeeze_.dim`, when it exists."""
    packet = op.overloadpacket
    name = packet._qualified_op_name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    twin_packet = getattr(torch.ops.aten, name[:-1], None)
    return getattr(twin_packet, op._overloadname, None) if twin_packet is not None else None


def _comes_after(graph: torch.fx.Graph, a: torch.fx.Node, b: torch.fx.Node) -> bool:
    for node in graph.nodes:
        if node is b:
            return True
        if node is a:
            return False
    return False


def outputs_for_mutations(captured: Captured, fn_name: str) -> None:
    """Replace functionalization's trailing `copy_(input, new)` by extra outputs."""
    gm = captured.graph
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    extra: list[torch.fx.Node] = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default and node.args[0] in placeholders:
            index = placeholders.index(node.args[0])
            example = node.args[0].meta["val"]
            if (example.is_floating_point() or example.is_complex()) and captured.input_needs_grad[index]:
                raise RematTraceError(
                    f"remat({fn_name}) mutates its input `{captured.input_paths[index]}` in place, and "
                    "that input requires grad. Return the new value instead of mutating the input."
                )
            captured.mutated.append(index)
            extra.append(node.args[1])
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    if extra:
        outs = list(output.args[0])
        output.args = (outs + extra,)
