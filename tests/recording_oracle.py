"""make_fx as the oracle for remat's joint-trace recorder (remat/_recording.py): every joint
graph remat builds while a function runs is built again with make_fx, and the two must be
the same graph, node by node: op, name, target, arguments, and the meta remat and torch
write (the value's layout, remat's annotations, "original_aten", the autograd sequence
numbers up to renumbering)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch._dynamo.config
import torch.fx

import remat._recording
import remat._remat
import remat._specializing
import remat._tracing


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
            _value_facts(n.meta.get("val")), n.meta.get("custom"), str(n.meta.get("original_aten")),
            numbers.setdefault(n.meta.get("seq_nr"), len(numbers)),
        ))
    return facts


def refuse_recording(*args: Any, **kwargs: Any) -> Any:
    """Stands in for remat's recorder: every joint is left to make_fx."""
    raise remat._recording.Unrecordable("make_fx asked for by the test")


_OUTCOME_LISTS: list[list[str]] = []  # one per active joints_compared, outermost first


def _compared(differentiate: Callable[..., torch.fx.GraphModule], record: Callable[..., Any]) -> Callable[..., torch.fx.GraphModule]:
    """`differentiate` that builds each joint with the recorder and again with make_fx,
    asserts the graphs are the same, and notes the outcome in every active list."""

    def note(outcome: str) -> None:
        for outcomes in _OUTCOME_LISTS:
            outcomes.append(outcome)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        try:
            gm = record(*args, **kwargs)
        except Exception:
            note("make_fx")
            raise
        note("recorded")
        return gm

    def compared(*args: Any) -> torch.fx.GraphModule:
        # torch's fake-tensor cache keys on whether make_fx is tracing, so the two traces
        # would read different entries, and a cached output can differ from a computed one
        # (as_strided_scatter's storage offset, torch 2.13): both compute every op.
        with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
            return compared_uncached(*args)

    def compared_uncached(*args: Any) -> torch.fx.GraphModule:
        offered = [False]

        def offer(*a: Any, **k: Any) -> Any:
            offered[0] = True
            return recorded(*a, **k)

        remat._tracing.record = offer
        try:
            gm = differentiate(*args)
        finally:
            remat._tracing.record = record
        if not offered[0]:  # not offered to the recorder (a custom op)
            note("make_fx")
        remat._tracing.record = refuse_recording
        try:
            reference = differentiate(*args)
        finally:
            remat._tracing.record = record
        facts, expected = graph_facts(gm), graph_facts(reference)
        first = next((i for i, (a, b) in enumerate(zip(facts, expected)) if a != b), min(len(facts), len(expected)))
        assert facts == expected, (
            f"the recorded joint differs from make_fx's at node {first} of {len(expected)}:\n"
            f"  recorded: {facts[first] if first < len(facts) else None}\n  make_fx:  {expected[first] if first < len(expected) else None}"
        )
        return gm

    return compared


@contextlib.contextmanager
def joints_compared() -> Iterator[list[str]]:
    """While inside, every joint trace remat makes is made again with make_fx and must
    give the same graph. Yields a list that gets, per joint, "recorded" or "make_fx" (the
    recorder left it to make_fx). Nests: the outermost patches remat, each gets every
    outcome made while it is active."""
    outcomes: list[str] = []
    callers = (remat._remat, remat._specializing, remat._tracing)  # _tracing's: higher-order gradients' joints
    outermost = not _OUTCOME_LISTS
    differentiate = remat._tracing.differentiate
    if outermost:
        compared = _compared(differentiate, remat._tracing.record)
        for module in callers:
            module.differentiate = compared  # type: ignore[attr-defined]
    _OUTCOME_LISTS.append(outcomes)
    try:
        yield outcomes
    finally:
        _OUTCOME_LISTS.pop()
        if outermost:
            for module in callers:
                module.differentiate = differentiate  # type: ignore[attr-defined]


def run_compared(fn: Callable[[], Any]) -> list[str]:
    """Run `fn` (which calls remat'd code) with every joint compared; the outcomes."""
    with joints_compared() as outcomes:
        fn()
    return outcomes
