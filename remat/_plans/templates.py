"""Shape templates: one symbolic trace serves every size a dimension takes.

A region traces once per input signature. When a call differs from an earlier one only
in the sizes of some dimensions (a new sequence length), remat traces the function once
more with those dimensions symbolic: a *template*, its stage-1 and joint forward+backward
graphs and the guards that trace assumed (equal sizes, a branch taken, every symbolic size
at least 2). A later size that satisfies the guards gets its graphs by evaluating the
template's shapes at that size, without running the function or tracing again. The
partition and everything after it run on those concrete graphs as after any trace, so
policies, budgets, reports and layout checks see each size as it is.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import sympy  # type: ignore[import-untyped]
import torch
import torch.fx

from .._core.torch_internals import (
    SYMBOLIC_SCALARS,
    fake_of_layout,
    graph_module,
    guards_expression,
    guards_hold,
    new_fake_mode,
    symbolic_expression,
    symbolic_templates_work,
    symbolic_tracing,
    transforms_active,
)
from .._running.chaining import feeds_outputs
from .._trace.arguments import Call
from .._trace.records import StageOne
from .._trace.tracing import capture, differentiate


class _NoTemplate(Exception):
    """This function's graphs cannot be made a template (the reason is in the message)."""


@dataclass
class Template:
    """The graphs of one function traced with some dimensions symbolic."""

    stage_one: StageOne  # stage 1, symbolic
    joint: torch.fx.GraphModule  # forward+backward, symbolic
    mode: Any  # the fake mode of the trace, holding its shape environment
    guards: str | None  # a Python expression over the inputs' sizes, strides and offsets
    dims: tuple[frozenset[int], ...]  # per tensor of the call (arguments, then captured): symbolic dims

    def specialize(self, call: Call) -> tuple[StageOne, torch.fx.GraphModule] | None:
        """The stage-1 and joint graphs for this call's sizes, or None if the guards fail."""
        stage_one = self.stage_one
        inputs = stage_one.graph_inputs(call)
        if not guards_hold(self.mode, self.guards, inputs):
            return None
        values = _AtSizes(self.mode, _bindings(self.mode, stage_one.input_values, inputs))
        try:
            graph = values.graph(stage_one.graph)
            joint = values.graph(self.joint)
        except _NoTemplate:  # a size the inputs do not determine (data-dependent)
            return None
        input_values = [n.meta["val"] for n in graph.graph.nodes if n.op == "placeholder"]
        return dataclasses.replace(stage_one, graph=graph, input_values=input_values), joint


def _bindings(mode: Any, placeholders: list[Any], inputs: list[torch.Tensor]) -> dict[Any, Any]:
    """Each symbol of the graph's inputs, bound to this call's size."""
    bindings: dict[Any, Any] = {}
    for fake, real in zip(placeholders, inputs):
        pairs = [*zip(fake.shape, real.shape), *zip(fake.stride(), real.stride()), (fake.storage_offset(), real.storage_offset())]
        for symbolic, concrete in pairs:
            expression = symbolic_expression(mode, symbolic)
            if isinstance(expression, sympy.Symbol):
                bindings[expression] = sympy.Integer(int(concrete))
    return bindings


class _AtSizes:
    """Evaluates a symbolic trace's values at bound sizes and copies its graphs so."""

    def __init__(self, mode: Any, bindings: dict[Any, Any]) -> None:
        self.mode = mode
        self.bindings = bindings
        self.concrete_mode = new_fake_mode()
        self.known: dict[Any, Any] = {}

    def scalar(self, value: Any) -> Any:
        expression = symbolic_expression(self.mode, value)
        if expression is None:
            return value
        result = self.known.get(expression)
        if result is None:
            evaluated = sympy.sympify(expression).xreplace(self.bindings)
            if evaluated.free_symbols:
                raise _NoTemplate(f"{expression} is not determined by the inputs' sizes")
            kind = int if isinstance(value, torch.SymInt) else float if isinstance(value, torch.SymFloat) else bool
            result = self.known[expression] = kind(evaluated)
        return result

    def value(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            scalar = self.scalar
            fake = fake_of_layout(
                self.concrete_mode, tuple(scalar(n) for n in value.shape), tuple(scalar(s) for s in value.stride()),
                scalar(value.storage_offset()), value.dtype, value.device,
            )
            return fake.requires_grad_(value.requires_grad) if value.requires_grad else fake
        if isinstance(value, (tuple, list)):
            return type(value)(self.value(v) for v in value)
        return self.scalar(value)

    def graph(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """A copy of `gm` whose values are at these sizes; a node computing a size (a
        symbolic scalar) becomes that size, a constant of the copy."""
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, Any] = {}
        for node in gm.graph.nodes:
            if node.op == "output":
                graph.output(torch.fx.map_arg(node.args[0], env.__getitem__))
                continue
            val = node.meta.get("val")
            if node.op == "call_function" and isinstance(val, SYMBOLIC_SCALARS):
                env[node] = self.scalar(val)
                continue
            args, kwargs = torch.fx.node.map_aggregate(  # nodes to copies, sizes a pass wrote in to values
                (node.args, node.kwargs), lambda a: env[a] if isinstance(a, torch.fx.Node) else self.scalar(a)
            )
            new = graph.create_node(node.op, node.target, args, kwargs, node.name)  # type: ignore[arg-type]
            new.meta = {key: item for key, item in node.meta.items() if key != "tensor_meta"}
            if "val" in node.meta and node.op != "get_attr":  # a constant's value has no symbolic size
                new.meta["val"] = self.value(val)
            env[node] = new
        return graph_module(gm, graph)


def trace_template(
    fn: Callable[..., Any], region: str, call: Call, policy: Callable[..., bool] | None, dims: tuple[frozenset[int], ...]
) -> Template:
    """Trace `fn` with the dimensions `dims` names symbolic (raises _NoTemplate, or the
    error symbolic tracing met, when it cannot serve as a template)."""
    tensors = call.tensors + call.captured
    marked = {id(t): d for t, d in zip(tensors, dims) if d}
    with symbolic_tracing(marked) as mode, warnings.catch_warnings():
        # a pass that writes a symbolic size into a node (random_fills_in_memory_order) is fine:
        # sizes in arguments are evaluated like every other at specialization
        warnings.filterwarnings("ignore", message="Raw SymInt value", category=UserWarning)
        stage_one = capture(fn, region, call, policy)
        diff_inputs = [i for i, needs in enumerate(stage_one.input_needs_grad) if needs]
        if not diff_inputs:
            raise _NoTemplate("nothing needs a gradient")
        if stage_one.reads_storage_offsets:
            raise _NoTemplate("as_strided reads an input: plans are per storage offset")
        if any(isinstance(leaf, SYMBOLIC_SCALARS) for leaf in stage_one.out_static):
            raise _NoTemplate("the function returns a size")
        if feeds_outputs(stage_one):
            raise _NoTemplate("outputs feed other outputs (a chain of plans, or a replay)")
        float_outputs = [j for j, differentiable in enumerate(stage_one.output_differentiable) if differentiable]
        joint = differentiate(stage_one, diff_inputs, float_outputs, create_graph=False)  # templates: no transforms
        guards = guards_expression(mode, stage_one.input_values)
    return Template(stage_one, joint, mode, guards, dims)


# A template's symbolic trace costs about this many plain traces of the same function
# (measured 3.1 on a transformers Llama decoder layer: 511 against 163 ms).
TEMPLATE_COST_RATIO = 3.0


@dataclass
class _Family:
    """Calls whose signatures differ at most in sizes, strides and storage offsets.

    A template is bought as skis are: a family pays each new size's trace (its *rent*)
    until what it has paid reaches what the template would cost (TEMPLATE_COST_RATIO
    plain traces), then traces the template. So a dimension that takes a few sizes never
    costs more than twice per-size tracing, and one that takes many costs one template. A
    region whose plans are shared with a like region pays a third of a trace per size (its
    stage 1 only) and so waits longer.
    """

    first: list[tuple[int, ...]]  # the first call's shapes, per tensor (arguments, then captured)
    template: Template | None = None
    tried: set[tuple[frozenset[int], ...]] = field(default_factory=set)  # dims a template was traced (or failed) for
    rent: float = 0.0  # seconds this family's traces took
    trace_seconds: float = 0.0  # what a plain trace of its function takes (its own, or a shared plan's)

    def worth_a_template(self) -> bool:
        return self.trace_seconds > 0 and self.rent >= TEMPLATE_COST_RATIO * self.trace_seconds


@dataclass
class Graphs:
    """What `Templates.graphs_for` gives: stage 1 for the call, the joint graph when a
    template gave it (None: trace it), and whether the function was traced."""

    stage_one: StageOne
    joint: torch.fx.GraphModule | None
    traced: bool
    family: _Family | None
    started: float

    def charge(self, shared_seconds: float | None) -> float:
        """Once the plan is built: count a traced build's time as its family's rent, and
        return what a plain trace of the function takes, for the plan to carry (this
        build's time; `shared_seconds` when the plan is another region's, traced in that
        much; the family's when a template gave the graphs)."""
        elapsed = _clock() - self.started
        if self.joint is not None:
            return self.family.trace_seconds if self.family is not None else elapsed
        estimate = elapsed if shared_seconds is None else shared_seconds
        if self.family is not None:
            self.family.rent += elapsed
            self.family.trace_seconds = max(self.family.trace_seconds, estimate)
        return estimate


def _clock() -> float:
    return time.perf_counter()


@dataclass
class Templates:
    """A region's templates, one per family of calls (bounded like its plans)."""

    maxsize: int
    families: OrderedDict[tuple[Any, ...], _Family] = field(default_factory=OrderedDict)

    def graphs_for(self, fn: Callable[..., Any], region: str, call: Call, policy: Callable[..., bool] | None) -> Graphs:
        """Stage 1 for this call and, from a template, its joint graph."""
        started = _clock()
        if transforms_active() or not symbolic_templates_work():  # under transforms the trace depends on their levels
            return Graphs(capture(fn, region, call, policy), None, True, None, started)
        shapes = [tuple(t.shape) for t in (*call.tensors, *call.captured)]
        key = call.key_without_sizes()
        family = self.families.get(key)
        if family is None:
            family = self.families[key] = _Family(shapes)
            while len(self.families) > self.maxsize:
                self.families.popitem(last=False)
            return Graphs(capture(fn, region, call, policy), None, True, family, started)
        self.families.move_to_end(key)
        if family.template is not None:
            graphs = family.template.specialize(call)
            if graphs is not None:
                return Graphs(graphs[0], graphs[1], False, family, started)
        dims = _changed_dims(family, shapes)
        symbolic_sizes_at_least_2 = all(shape[d] >= 2 for shape, ds in zip(shapes, dims) for d in ds)
        if any(dims) and dims not in family.tried and symbolic_sizes_at_least_2 and family.worth_a_template():
            family.tried.add(dims)
            try:
                template = trace_template(fn, region, call, policy, dims)
                graphs = template.specialize(call)
            except Exception:  # anything symbolic tracing cannot do: trace this size as it is
                graphs = None
            else:
                family.template = template
            if graphs is not None:
                return Graphs(graphs[0], graphs[1], True, family, started)
        return Graphs(capture(fn, region, call, policy), None, True, family, started)


def _changed_dims(family: _Family, shapes: list[tuple[int, ...]]) -> tuple[frozenset[int], ...]:
    """Per tensor, the dimensions whose size differs from the family's first call (and
    those its template already has symbolic)."""
    before = family.template.dims if family.template is not None else tuple(frozenset() for _ in shapes)
    return tuple(
        frozenset(d for d, (a, b) in enumerate(zip(first, now)) if a != b) | old
        for first, now, old in zip(family.first, shapes, before)
    )

