"""Inspecting: what remat regions keep for backward and what backward recomputes."""

from __future__ import annotations

import contextlib
import contextvars
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import optree
import torch

from .._partition.costs import nbytes_of

if TYPE_CHECKING:
    from .._running.chaining import Runnable
    from .._running.executing import Plan


@dataclass(frozen=True)
class Residual:
    """One tensor a remat region keeps alive for its backward pass."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    kind: str  # "input" (kept by reference), "intermediate" (computed and kept), "offloaded" (kept in host memory), "rng" (a generator state to replay a random op), "debug"
    op: Any  # the aten op that produced it; None for inputs
    name: str | None  # its checkpoint_name, if any
    source: str | None  # argument path for inputs, the user's file:line for intermediates
    region: str  # qualified name of the remat'd function


@dataclass(frozen=True)
class Recompute:
    """One op a region's backward re-runs because its policy did not keep the value."""

    op: Any
    source: str | None
    flops: int
    region: str


@dataclass
class Report:
    """What the remat regions reached by a call keep and recompute, one entry per region call."""

    residuals: list[Residual] = field(default_factory=list)
    recomputes: list[Recompute] = field(default_factory=list)
    calls: int = 0  # remat region calls seen

    @property
    def kept_bytes(self) -> int:
        """Bytes kept where they were computed (offloaded values are counted apart)."""
        return sum(r.nbytes for r in self.residuals if r.kind != "offloaded")

    @property
    def offloaded_bytes(self) -> int:
        """Bytes held in host memory between forward and backward."""
        return sum(r.nbytes for r in self.residuals if r.kind == "offloaded")

    @property
    def recompute_flops(self) -> int:
        return sum(r.flops for r in self.recomputes)

    def by_region(self) -> dict[str, tuple[int, int]]:
        """Per region: (bytes kept, FLOPs recomputed)."""
        totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for r in self.residuals:
            totals[r.region][0] += r.nbytes if r.kind != "offloaded" else 0
        for c in self.recomputes:
            totals[c.region][1] += c.flops
        return {region: (kept, flop) for region, (kept, flop) in totals.items()}

    def __str__(self) -> str:
        header = ("region", "kind", "op", "name", "shape", "dtype", "bytes", "source")
        rows = [
            (r.region, r.kind, _op(r.op), r.name or "-", str(list(r.shape)), _dtype(r.dtype), human_bytes(r.nbytes), r.source or "-")
            for r in self.residuals
        ]
        lines = _table(header, rows)
        if self.recomputes:
            lines += ["", "recomputed in backward:"]
            grouped: dict[tuple[str, str, str], list[int]] = defaultdict(list)
            for c in self.recomputes:
                grouped[(c.region, _op(c.op), c.source or "-")].append(c.flops)
            lines += _table(
                ("region", "op", "source", "times", "FLOPs"),
                [(reg, op, src, str(len(f)), human_flops(sum(f))) for (reg, op, src), f in grouped.items()],
            )
        lines += ["", "per region:"]
        lines += _table(
            ("region", "kept", "recomputed FLOPs"),
            [(reg, human_bytes(kept), human_flops(flop)) for reg, (kept, flop) in self.by_region().items()],
        )
        offloaded = f"; {human_bytes(self.offloaded_bytes)} offloaded to host memory" if self.offloaded_bytes else ""
        lines.append(
            f"total: {self.kept_bytes} bytes ({human_bytes(self.kept_bytes)}) in {len(self.residuals)} tensors{offloaded}; "
            f"backward recomputes {human_flops(self.recompute_flops)}FLOP"
        )
        return "\n".join(lines)


def _op(op: Any) -> str:
    return "-" if op is None else str(op)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(x) for x in column) for column in zip(header, *rows)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def human_bytes(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{nbytes} B"


def human_flops(count: int) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} "


def plan_report(plan: Plan) -> Report:
    """What one plan keeps (kept inputs, then kept values) and recomputes."""
    stage_one = plan.stage_one
    report = Report()
    for i in plan.part.saved_inputs:
        val = stage_one.input_values[i]
        shape = tuple(val.shape)
        report.residuals.append(
            Residual(shape, val.dtype, nbytes_of(shape, val.dtype), "input", None, None, stage_one.input_paths[i], plan.region)
        )
    for kept in plan.part.kept:
        region = stage_one.scopes[kept.scope].region
        nbytes = nbytes_of(kept.shape, kept.dtype)
        report.residuals.append(Residual(kept.shape, kept.dtype, nbytes, kept.kind, kept.op, kept.name, kept.source, region))
    for op in plan.part.recomputed:
        report.recomputes.append(Recompute(op.op, op.source, op.flops, stage_one.scopes[op.scope].region))
    return report


_recorder: contextvars.ContextVar[Report | None] = contextvars.ContextVar("remat_recorder", default=None)


def record(runnable: Runnable) -> None:
    """Called by every remat region when it runs (with its Plan, or Chain of plans); a
    no-op, and cheap, unless a report is being made."""
    sink = _recorder.get()
    if sink is None:
        return
    for plan in runnable.plans():
        found = plan_report(plan)
        sink.calls += 1
        sink.residuals.extend(found.residuals)
        sink.recomputes.extend(found.recomputes)


@contextlib.contextmanager
def recording() -> Iterator[Report]:
    sink = Report()
    token = _recorder.set(sink)
    try:
        yield sink
    finally:
        _recorder.reset(token)


def report(f: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
    """What the remat regions reached by `f(*args, **kwargs)` keep and recompute.

    Differentiates with respect to every floating-point tensor in `args` (as
    `torch.func.vjp(f, *args)` would) without running backward. `print(report(...))`
    shows a table of every kept tensor, what backward recomputes and its FLOPs, and
    totals per region and overall.
    """
    leaves, spec = optree.tree_flatten(args)  # type: ignore[var-annotated,arg-type]
    moving = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())]

    def g(*values: torch.Tensor) -> Any:
        full = list(leaves)
        for i, v in zip(moving, values):
            full[i] = v
        out = f(*optree.tree_unflatten(spec, full), **kwargs)
        return [x for x in optree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]

    with recording() as sink:
        torch.func.vjp(g, *[leaves[i] for i in moving])
    return sink


def saved_residuals(f: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """The tensors the remat regions reached by `f(*args, **kwargs)` keep for backward."""
    return report(f, *args, **kwargs).residuals


def print_saved_residuals(f: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Print `report(f, *args, **kwargs)`: the kept tensors, what is recomputed, totals."""
    print(report(f, *args, **kwargs))
