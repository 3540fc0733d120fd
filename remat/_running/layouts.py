"""Layouts: a graph runs on real tensors as it was traced on fake ones, or not at all.

Graphs are traced on fake tensors whose metadata comes from each op's meta function. A
real kernel may disagree: CPU layer norm returns float32 statistics for bfloat16 input
where its meta function says bfloat16; any kernel may lay out its output otherwise than
its meta function says. The op itself is what eager code runs too, so its real value is right; what can
go wrong is the rest of the graph, traced under the wrong belief (autocast inserts a cast
only where it sees another dtype; `as_strided` reads memory order). So the first run of
each graph of a plan goes node by node (`graph_code.run_checked_nodes`) and compares every
value with what was traced:
- an op whose inputs were as traced may differ (the meta function's mistake): accepted,
  and its value marked (CUDA's memory-efficient attention gives its dropout seed and offset
  on the CPU where its meta function says the GPU; its backward op takes them as they are);
- an op that reads a marked value and itself differs from the trace is where the graph
  parts from eager code: RematError, naming both ops and lines;
- a value whose strides differ and that an `as_strided` reads: RematError likewise.
The check reads metadata only, once per graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from .._core.errors import RematError
from .._core.nodes import AS_STRIDED_OPS, is_view, producer, source_line
from .._core.torch_internals import OpOverload, has_batched_level
from .graph_code import run_checked_nodes


def _strides_agree(real: torch.Tensor, traced: torch.Tensor) -> bool:
    """Strides matter only along dimensions with more than one element."""
    if real.numel() == 0:
        return True
    return all(size == 1 or a == b for size, a, b in zip(real.shape, real.stride(), traced.stride()))


def _describe_layout(t: Any) -> str:
    return f"{t.dtype} {list(t.shape)} on {t.device}"


def _source(n: torch.fx.Node) -> str:
    return source_line(n) or "an unknown line"


def _reader_of_memory_order(n: torch.fx.Node) -> torch.fx.Node | None:
    """An `as_strided` that reads `n`'s memory, directly or through views."""
    stack, seen = [n], set()
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if getattr(user.target, "overloadpacket", None) in AS_STRIDED_OPS and user.args[0] is node:
                return user
            if is_view(user):
                stack.append(user)
    return None


_MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.bmm.default})
_POINTWISE_OR_REDUCTION = {torch.Tag.pointwise, torch.Tag.reduction}
_aten = torch.ops.aten
# views that keep a broadcast tensor broadcast (every stride 0) and never refuse one
_SHAPE_VIEWS = frozenset({
    _aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.view.default, _aten.unsqueeze.default,
    _aten.squeeze.dim, _aten.squeeze.dims, _aten.squeeze.default, _aten.expand.default, _aten.select.int,
    _aten.slice.Tensor, _aten.alias.default,
})


def broadcast_tangents(gm: torch.fx.GraphModule, n_tangents: int) -> frozenset[int]:
    """Which of a backward graph's last `n_tangents` placeholders (its cotangents) may take
    a broadcast gradient (every stride 0, as `.sum()` gives) as it is, as eager's backward
    takes it: a sum over it then adds in eager's order (over a contiguous copy the order
    may differ, and so may the last bit), and no copy of its size is made. Each must reach
    only matrix products, and pointwise ops and reductions whose other operands were
    traced contiguous, all with results traced contiguous, through views of its shape,
    never the graph's output: such a view of a broadcast tensor is broadcast, and these
    ops lay out their results as traced, so every later value is laid out as traced."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tangents = placeholders[len(placeholders) - n_tangents:]
    return frozenset(k for k, tangent in enumerate(tangents) if _settles_broadcast(tangent))


def _settles_broadcast(node: torch.fx.Node) -> bool:
    for user in node.users:
        op = user.target
        if user.op != "call_function" or not isinstance(op, OpOverload):
            return False
        if op in _SHAPE_VIEWS and user.args[0] is node:
            if not _settles_broadcast(user):
                return False
            continue
        if not (op in _MATMULS or _POINTWISE_OR_REDUCTION & set(op.tags)) or not _traced_contiguous(user):
            return False
        if op not in _MATMULS and not all(_traced_contiguous(a) for a in user.all_input_nodes if a is not node):
            return False
    return True


def _traced_contiguous(node: torch.fx.Node) -> bool:
    traced = node.meta.get("val")
    return isinstance(traced, torch.Tensor) and traced.layout == torch.strided and traced.is_contiguous()


class _LayoutCheck:
    """Compares each value of a graph's run with the traced one (see the module docstring),
    called with each placeholder's and each call's node and value as the run makes them."""

    def __init__(self, region: str) -> None:
        self.region = region
        self.differs: dict[torch.fx.Node, torch.fx.Node] = {}  # value -> the op where it first differed

    def __call__(self, n: torch.fx.Node, out: Any) -> Any:
        upstream = next((self.differs[a] for a in n.all_input_nodes if a in self.differs), None)
        op = producer(n).target
        traced = n.meta.get("val")
        if not isinstance(out, torch.Tensor) or not isinstance(traced, torch.Tensor) or not (
            n.op == "placeholder" or isinstance(op, OpOverload)
        ):
            if upstream is not None:  # a tuple of values, or remat's own step: passes the mark on
                self.differs[n] = upstream
            return out
        if out.shape != traced.shape or out.dtype != traced.dtype or out.device.type != traced.device.type:
            if upstream is not None and not is_view(n):
                origin = upstream or n
                raise RematError(
                    f"remat({self.region}): `{op}` at {_source(n)} gave {_describe_layout(out)} where it was traced as "
                    f"{_describe_layout(traced)}, because `{producer(origin).target}` at {_source(origin)} gives values "
                    "its meta function describes otherwise. The traced graph parts from eager code here "
                    "(e.g. autocast casts chosen for the traced dtype). Keep these ops out of the remat'd "
                    "function, and please report it."
                )
            self.differs[n] = upstream or n
        elif upstream is not None and n.op == "call_function" and not is_view(n):
            pass  # an op that read an unexpected value but gave what was traced: the mark stops here
        elif upstream is not None:
            self.differs[n] = upstream
        if out.layout == torch.strided and not _strides_agree(out, traced):
            reader = _reader_of_memory_order(n)
            if reader is not None:
                raise RematError(
                    f"remat({self.region}): `{op}` at {_source(n)} laid out its result with strides "
                    f"{list(out.stride())} where it was traced with {list(traced.stride())}, and "
                    f"`{reader.target}` at {_source(reader)} reads that memory order, so the traced graph "
                    "computes something else than eager code. Keep these ops out of the remat'd "
                    "function, or make the value contiguous before the as_strided."
                )
        return out


class _CheckingInterpreter(torch.fx.Interpreter):
    """Runs a graph `run_checked_nodes` does not, checking as it would."""

    def __init__(self, gm: torch.fx.GraphModule, check: _LayoutCheck) -> None:
        super().__init__(gm)
        self.check = check

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        return self.check(n, out) if n.op in ("placeholder", "call_function") else out


def run_checked(gm: torch.fx.GraphModule, region: str, *inputs: Any) -> tuple[Any, bool]:
    """Run `gm` on `inputs`, checking values against the trace when it can (not under vmap,
    whose batched tensors have other strides): returns the outputs and whether it checked."""
    if any(isinstance(t, torch.Tensor) and has_batched_level(t) for t in inputs):
        gm.code  # a lazy graph module generates its forward here (its first forward would call gm(...))
        return gm.forward(*inputs), False  # not gm(...): module hooks (a global one) are not for remat's graphs
    check = _LayoutCheck(region)
    ran, outputs = run_checked_nodes(gm, check, inputs)
    if ran:
        return outputs, True
    return _CheckingInterpreter(gm, check).run(*inputs), True
