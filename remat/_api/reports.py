"""Inspecting: what remat regions keep for backward and what backward recomputes."""

from __future__ import annotations

import contextlib
import contextvars
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, Sequence

import optree
import torch

from .._core.residuals import Recompute, Residual
from .._partition.costs import nbytes_of

if TYPE_CHECKING:
    from .._running.chaining import Runnable
    from .._running.executing import Plan
    from .._running.replaying import KeptMemory, Observe


class RegionTotals(NamedTuple):
    """One region's totals in a report (a tuple: `kept, flops = totals`)."""

    kept_bytes: int
    recompute_flops: int


@dataclass
class Report:
    """What the remat regions reached by a call keep and recompute, one entry per region call."""

    residuals: list[Residual] = field(default_factory=list)
    recomputes: list[Recompute] = field(default_factory=list)
    calls: int = 0  # remat region calls seen
    replayed: set[str] = field(default_factory=set)  # regions that ran as torch.utils.checkpoint runs them

    def add(self, residuals: Sequence[Residual], recomputes: Sequence[Recompute]) -> None:
        """One region call's records."""
        self.calls += 1
        self.residuals.extend(residuals)
        self.recomputes.extend(recomputes)

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

    def by_region(self) -> dict[str, RegionTotals]:
        """Per region, in call order: bytes kept and FLOPs recomputed."""
        totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for r in self.residuals:
            totals[r.region][0] += r.nbytes if r.kind != "offloaded" else 0
        for c in self.recomputes:
            totals[c.region][1] += c.flops
        return {region: RegionTotals(kept, flop) for region, (kept, flop) in totals.items()}

    def _kinds(self) -> dict[str, str]:
        """Per region, how many tensors of each kind it keeps, for people."""
        counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for r in self.residuals:
            counts[r.region][r.kind] += 1
        return {region: ", ".join(f"{n} {kind}" for kind, n in kinds.items()) for region, kinds in counts.items()}

    def __str__(self) -> str:
        """Per region first (with the total), then what is kept, a module's parameters and
        buffers on one line per region, then what backward recomputes."""
        kinds = self._kinds()
        lines = ["per region:"]
        lines += _table(
            ("region", "kept", "recomputed FLOPs", "kept tensors"),
            [(self._label(reg), human_bytes(kept), human_flops(flop), kinds.get(reg, "-")) for reg, (kept, flop) in self.by_region().items()],
        )
        offloaded = f"; {human_bytes(self.offloaded_bytes)} offloaded to host memory" if self.offloaded_bytes else ""
        lines.append(
            f"total: {self.kept_bytes} bytes ({human_bytes(self.kept_bytes)}) in {len(self.residuals)} tensors{offloaded}; "
            f"backward recomputes {human_flops(self.recompute_flops)}FLOP"
        )
        header = ("region", "kind", "op", "name", "shape", "dtype", "bytes", "source")
        lines += ["", "kept for backward:"] + _table(header, _residual_rows(self.residuals))
        if self.recomputes:
            lines += ["", "recomputed in backward:"]
            grouped: dict[tuple[str, str, str], list[int]] = defaultdict(list)
            for c in self.recomputes:
                grouped[(c.region, _op(c.op), c.source or "-")].append(c.flops)
            lines += _table(
                ("region", "op", "source", "times", "FLOPs"),
                [(reg, op, src, str(len(f)), human_flops(sum(f))) for (reg, op, src), f in grouped.items()],
            )
        if self.replayed:
            lines += ["", "(replayed): the region could not be traced and runs as torch.utils.checkpoint runs it; it keeps "
                      "what it reads from outside, what its policy keeps and the generator states, and backward re-runs the rest"]
        return "\n".join(lines)

    def _label(self, region: str) -> str:
        return f"{region} (replayed)" if region in self.replayed else region


_MODULE_STATE = "self."  # the source of a tensor a module region reads from its module


def _residual_rows(residuals: Sequence[Residual]) -> list[tuple[str, ...]]:
    """One row per kept tensor, except a module region's parameters and buffers: one row
    per region for all of them (kept by reference, they are the model's own memory)."""

    def is_state(r: Residual) -> bool:
        return r.kind == "input" and (r.source or "").startswith(_MODULE_STATE)

    state: dict[str, list[Residual]] = defaultdict(list)
    for r in residuals:
        if is_state(r):
            state[r.region].append(r)
    rows: list[tuple[str, ...]] = []
    for r in residuals:
        if not is_state(r):
            rows.append((r.region, r.kind, _op(r.op), r.name or "-", str(list(r.shape)), _dtype(r.dtype), human_bytes(r.nbytes), r.source or "-"))
        elif r is state[r.region][0]:
            group = state[r.region]
            dtypes = ", ".join(sorted({_dtype(g.dtype) for g in group}))
            total = human_bytes(sum(g.nbytes for g in group))
            rows.append((r.region, "input", "-", "-", f"{len(group)} tensors", dtypes, total, "self.* (parameters and buffers)"))
    return rows


def pyplot(caller: str) -> Any:
    """matplotlib's pyplot, drawing to files (Agg), or an ImportError saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(f"{caller} needs matplotlib: pip install 'remat[plot]'") from None
    return plt


def plot_by_region(report: Report, path: str, title: str = "kept for backward, per region") -> None:
    """A stacked bar per region of what it keeps, by kind (inputs, intermediates, random
    states, offloaded), as a PNG. Needs matplotlib: `pip install 'remat[plot]'`."""
    plt = pyplot("plot_by_region")
    regions = list(report.by_region())
    kinds = list(dict.fromkeys(r.kind for r in report.residuals))
    mib: dict[str, list[float]] = {kind: [0.0] * len(regions) for kind in kinds}
    for r in report.residuals:
        mib[r.kind][regions.index(r.region)] += r.nbytes / 2**20
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(regions) + 2), 4.8))
    bottom = [0.0] * len(regions)
    for kind in kinds:
        ax.bar(regions, mib[kind], bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, mib[kind])]
    ax.set_ylabel("kept for backward (MiB)")
    ax.set_title(title)
    ax.legend()
    ax.tick_params(axis="x", labelrotation=60)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
_measured: contextvars.ContextVar[list[KeptMemory] | None] = contextvars.ContextVar("remat_measured", default=None)


def record(runnable: Runnable) -> None:
    """Called by every remat region when it runs (with its Plan, or Chain of plans); a
    no-op, and cheap, unless a report is being made."""
    sink = _recorder.get()
    if sink is None:
        return
    for plan in runnable.plans():
        found = plan_report(plan)
        sink.add(found.residuals, found.recomputes)


def reporting() -> bool:
    """Whether a report is being made (regions then describe themselves to it)."""
    return _recorder.get() is not None


@contextlib.contextmanager
def observing_replay(region: str) -> Iterator[Observe | None]:
    """For a region about to run replayed: what to tell what it keeps and recomputes, or
    None unless a report is being made or kept memory measured. The regions it calls
    record nothing while it runs: they run again in its recompute, and its own record
    counts their ops."""
    sink, measured = _recorder.get(), _measured.get()
    if sink is None and measured is None:
        yield None
        return

    def observe(residuals: list[Residual], recomputes: list[Recompute], memory: KeptMemory) -> None:
        if sink is not None:
            sink.replayed.add(region)
            sink.add(residuals, recomputes)
        if measured is not None:
            measured.append(memory)

    tokens = _recorder.set(None), _measured.set(None)
    try:
        yield observe
    finally:
        _recorder.reset(tokens[0])
        _measured.reset(tokens[1])


@contextlib.contextmanager
def measuring_replayed() -> Iterator[list[KeptMemory]]:
    """While open, the memory each replayed region call keeps (`saved_tensor_bytes` counts
    it: checkpoint's saved-tensor hooks hide it from autograd's)."""
    kept: list[KeptMemory] = []
    token = _measured.set(kept)
    try:
        yield kept
    finally:
        _measured.reset(token)


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

    Runs `f` forward with every floating-point tensor in `args` requiring a gradient (as
    `torch.func.vjp(f, *args)` would differentiate), without running backward, and with
    the effects of a forward (BatchNorm's statistics are updated once). `print(report(...))`
    shows a table of every kept tensor, what backward recomputes and its FLOPs, and totals
    per region and overall. A region that cannot be traced is described as it runs (as
    torch.utils.checkpoint runs it); its sizes are this process's (a DTensor's are its
    local shard's), so each rank of a parallel model reports its own.
    """
    leaves, spec = optree.tree_flatten(args)  # type: ignore[var-annotated,arg-type]
    moving = {i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())}
    inputs = [x.detach().requires_grad_() if i in moving else x for i, x in enumerate(leaves)]
    with recording() as sink, torch.enable_grad():
        f(*optree.tree_unflatten(spec, inputs), **kwargs)
    return sink


def saved_residuals(f: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """The tensors the remat regions reached by `f(*args, **kwargs)` keep for backward."""
    return report(f, *args, **kwargs).residuals


def print_saved_residuals(f: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Print `report(f, *args, **kwargs)`: the kept tensors, what is recomputed, totals."""
    print(report(f, *args, **kwargs))
