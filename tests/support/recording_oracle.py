"""make_fx as the oracle for remat's recorder (remat/_trace/recording.py): every stage-1 graph and
every joint graph remat builds while a function runs is built again with make_fx, and the
two must be the same graph, node by node: op, name, target, arguments, and the meta remat
and torch write (the value's layout, remat's annotations, "original_aten", the autograd
sequence numbers up to renumbering); for stage 1, also what remat notes beside the graph
(the captured tensors it reads, the outputs' structure, the mutated inputs). A stage-1
comparison runs the user's function twice."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Callable, Iterator

import pytest
import torch
import torch._dynamo.config
import torch.fx

import remat._trace.recording
import remat._api.decorator
import remat._plans.templates
import remat._trace.tracing


def _plain(value: Any) -> Any:
    """`value` in a form `==` compares: real tensors (a seeded generator state) by their
    values, weak references by their referent, records field by field."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.tolist()))
    if isinstance(value, weakref.ref):
        return ("object", id(value()))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value) if not hasattr(value, "_fields") else tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, *(_plain(getattr(value, f.name)) for f in dataclasses.fields(value)))
    if type(value).__name__ == "PyTreeSpec":
        return str(value)
    return value


def _value_facts(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, str(v.device), v.requires_grad)
    if isinstance(v, (list, tuple)):
        return type(v)(_value_facts(x) for x in v)
    return v


def graph_facts(gm: torch.fx.GraphModule) -> list[tuple[Any, ...]]:
    """Everything about a graph's nodes that two traces of one function must agree on."""
    numbers: dict[Any, int] = {}  # autograd's sequence numbers count up across traces
    facts = []
    for n in gm.graph.nodes:
        def names(a: Any) -> str:
            return str(torch.fx.node.map_arg(a, lambda m: m.name))

        facts.append((
            n.op, n.name, str(n.target), names(n.args), names(n.kwargs),
            sorted(k for k in n.meta if k != "tensor_meta"),  # make_fx's best-effort copy of "val"; remat reads "val"
            _value_facts(n.meta.get("val")), _plain(n.meta.get("custom")), str(n.meta.get("original_aten")),
            numbers.setdefault(n.meta.get("seq_nr"), len(numbers)),
        ))
    return facts


def refuse_recording(*args: Any, **kwargs: Any) -> Any:
    """Stands in for remat's recorder: every trace is left to make_fx."""
    raise remat._trace.recording.Unrecordable("make_fx asked for by the test")


def _captured_facts(captured: Any) -> list[Any]:
    """What two stage-1 traces must agree on: the graph, and what remat notes beside it."""
    facts = []
    for f in dataclasses.fields(captured):
        value = getattr(captured, f.name)
        if f.name == "graph":
            facts += graph_facts(value)
            continue
        if f.name == "by_reference":
            value = [id(t) for t in value]
        elif f.name == "input_values":
            value = [_value_facts(v) for v in value]
        elif f.name in ("rng_end", "hook_calls", "hooks"):
            value = _plain(value)
        facts.append((f.name, value if f.name != "out_spec" else str(value)))
    return facts


_OUTCOME_LISTS: list[list[tuple[str, str]]] = []  # one per active traces_compared, outermost first
_STAGE: list[str] = []  # the trace being made: "stage 1" or "joint", innermost last


def _note(outcome: str) -> None:
    for outcomes in _OUTCOME_LISTS:
        outcomes.append((_STAGE[-1], outcome))


def _assert_same(facts: list[Any], expected: list[Any], what: str) -> None:
    first = next((i for i, (a, b) in enumerate(zip(facts, expected)) if a != b), min(len(facts), len(expected)))
    assert facts == expected, (
        f"the recorded {what} differs from make_fx's at item {first} of {len(expected)}:\n"
        f"  recorded: {facts[first] if first < len(facts) else None}\n  make_fx:  {expected[first] if first < len(expected) else None}"
    )


def _compared(stage: str, build: Callable[..., Any], facts_of: Callable[[Any], list[Any]], record: Callable[..., Any]) -> Callable[..., Any]:
    """`build` (remat's capture or differentiate) that builds each trace with the recorder
    and again with make_fx, asserts the two are the same, and notes the outcome in every
    active list. An error must be make_fx's error too."""

    def recorded(*args: Any, **kwargs: Any) -> Any:
        try:
            gm = record(*args, **kwargs)
        except Exception:
            _note("make_fx")
            raise
        _note("recorded")
        return gm

    def compared(*args: Any, **kwargs: Any) -> Any:
        # torch's fake-tensor cache keys on whether make_fx is tracing, so the two traces
        # would read different entries, and a cached output can differ from a computed one
        # (as_strided_scatter's storage offset, torch 2.13): both compute every op.
        _STAGE.append(stage)
        try:
            with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
                return compared_uncached(*args, **kwargs)
        finally:
            _STAGE.pop()

    def built_with(stand_in: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        remat._trace.tracing.record_graph = stand_in
        try:
            return build(*args, **kwargs)
        finally:
            remat._trace.tracing.record_graph = record

    def compared_uncached(*args: Any, **kwargs: Any) -> Any:
        offered = [False]

        def offer(*a: Any, **k: Any) -> Any:
            offered[0] = True
            return recorded(*a, **k)

        try:
            result = built_with(offer, args, kwargs)
        except Exception as error:
            with pytest.raises(type(error)) as reference_error:
                built_with(refuse_recording, args, kwargs)
            assert str(reference_error.value) == str(error), (str(reference_error.value), str(error))
            raise
        if not offered[0]:  # not offered to the recorder
            _note("make_fx")
        reference = built_with(refuse_recording, args, kwargs)
        _assert_same(facts_of(result), facts_of(reference), f"{stage} trace")
        return result

    return compared


@contextlib.contextmanager
def traces_compared() -> Iterator[list[tuple[str, str]]]:
    """While inside, every stage-1 and joint trace remat makes is made again with make_fx
    and must give the same graph. Yields a list that gets, per trace, ("stage 1" or
    "joint", "recorded" or "make_fx" (the recorder left it to make_fx)). Nests: the
    outermost patches remat, each gets every outcome made while it is active."""
    outcomes: list[tuple[str, str]] = []
    callers = (remat._api.decorator, remat._plans.templates, remat._trace.tracing)  # tracing's: higher-order gradients' joints
    outermost = not _OUTCOME_LISTS
    differentiate, capture = remat._trace.tracing.differentiate, remat._plans.templates.capture
    if outermost:
        record = remat._trace.tracing.record_graph
        compared_joint = _compared("joint", differentiate, graph_facts, record)
        for module in callers:
            module.differentiate = compared_joint  # type: ignore[attr-defined]
        remat._plans.templates.capture = _compared("stage 1", capture, _captured_facts, record)  # type: ignore[attr-defined]
    _OUTCOME_LISTS.append(outcomes)
    try:
        yield outcomes
    finally:
        _OUTCOME_LISTS.pop()
        if outermost:
            for module in callers:
                module.differentiate = differentiate  # type: ignore[attr-defined]
            remat._plans.templates.capture = capture  # type: ignore[attr-defined]


def run_compared(fn: Callable[[], Any]) -> list[tuple[str, str]]:
    """Run `fn` (which calls remat'd code) with every trace compared; the outcomes."""
    with traces_compared() as outcomes:
        fn()
    return outcomes
