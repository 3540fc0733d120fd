"""Comparing policies on one function: kept bytes, recompute FLOPs, optionally time and peak."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import optree
import torch

from .decorator import remat, using_policy, without_remat
from .measuring import saved_tensor_bytes
from .reports import _table, human_bytes, human_flops, report


@dataclass(frozen=True)
class Comparison:
    """One policy's row: what it keeps and recomputes; step time and peak when measured."""

    policy: str
    kept_bytes: int
    recompute_flops: int
    step_seconds: float | None = None
    peak_bytes: int | None = None  # CUDA only

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _requiring_grad(args: tuple[Any, ...]) -> tuple[Any, ...]:
    def track(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
            return x.detach().requires_grad_()
        return x

    return optree.tree_map(track, args)  # type: ignore[arg-type,return-value]


def _step(f: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    results: Any = f(*args, **kwargs)
    outputs = [x for x in optree.tree_leaves(results) if isinstance(x, torch.Tensor) and x.requires_grad]
    if outputs:
        torch.autograd.backward([o.float().sum() for o in outputs])


def _device(args: tuple[Any, ...]) -> torch.device:
    leaves: list[Any] = optree.tree_leaves(args)  # type: ignore[arg-type]
    return next((x.device for x in leaves if isinstance(x, torch.Tensor)), torch.device("cpu"))


def _measure(f: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], repeats: int) -> tuple[float, int | None]:
    """Median forward+backward seconds, and on CUDA the step's peak memory above the start."""
    device = _device(args)
    cuda = device.type == "cuda"
    _step(f, args, kwargs)  # warm-up, and the trace
    times, peak = [], None
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start_memory = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        _step(f, args, kwargs)
        if cuda:
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - start_memory
        times.append(time.perf_counter() - start)
    return statistics.median(times), peak


def compare(
    f: Callable[..., Any],
    *args: Any,
    policies: Sequence[Callable[..., bool] | None],
    measure: bool = False,
    repeats: int = 5,
    baseline: bool = True,
    **kwargs: Any,
) -> list[Comparison]:
    """Evaluate several policies on `f(*args, **kwargs)` without running backward.

    Every remat region `f` reaches is given each policy in turn (see `using_policy`); if
    `f` reaches none, `f` itself is rematerialized. Rows hold the bytes autograd keeps for
    the backward of all of `f` (regions and the code around them, measured by storage)
    and the FLOPs backward would recompute; with `measure`, also the median
    forward+backward time and (on CUDA) the peak memory of the step, which does run
    backward. `baseline` adds a "no remat" row measured with plain autograd.
    """
    tracked = _requiring_grad(args)
    with using_policy(None):
        has_regions = report(f, *tracked, **kwargs).calls > 0
    rows = []
    if baseline:
        with without_remat():
            kept = saved_tensor_bytes(f, *tracked, **kwargs)
            timing = _measure(f, tracked, kwargs, repeats) if measure else (None, None)
        rows.append(Comparison("no remat", kept, 0, *timing))
    for policy in policies:
        target = f if has_regions else remat(f, policy=policy)
        with using_policy(policy):
            flops = report(target, *tracked, **kwargs).recompute_flops
            kept = saved_tensor_bytes(target, *tracked, **kwargs)  # the whole of f, as for the baseline
            timing = _measure(target, tracked, kwargs, repeats) if measure else (None, None)
        rows.append(Comparison(repr(policy) if policy is not None else "None (nothing_saveable)", kept, flops, *timing))
    return rows


def format_comparison(rows: Sequence[Comparison]) -> str:
    """The rows as a table for people."""
    header = ("policy", "kept", "recompute", "step", "peak")
    table = [
        (
            r.policy,
            human_bytes(r.kept_bytes),
            f"{human_flops(r.recompute_flops)}FLOP",
            "-" if r.step_seconds is None else f"{r.step_seconds * 1e3:.1f} ms",
            "-" if r.peak_bytes is None else human_bytes(r.peak_bytes),
        )
        for r in rows
    ]
    return "\n".join(_table(header, table))


def plot_frontier(rows: Sequence[Comparison], path: str, title: str = "memory kept vs recompute") -> None:
    """Draw kept memory against recompute cost (step time when measured) as a PNG.

    Needs matplotlib: `pip install 'remat[plot]'`.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plot_frontier needs matplotlib: pip install 'remat[plot]'") from None
    timed = all(r.step_seconds is not None for r in rows)
    xs = [r.step_seconds * 1e3 if timed else r.recompute_flops / 1e6 for r in rows]  # type: ignore[operator]
    ys = [r.kept_bytes / 2**20 for r in rows]
    points: dict[tuple[float, float], list[str]] = {}
    for x, y, r in zip(xs, ys, rows):  # rows that land on one point share a label
        points.setdefault((round(x, 6), round(y, 6)), []).append(r.policy)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.scatter(xs, ys, color="tab:blue", zorder=3)
    for k, ((x, y), labels) in enumerate(sorted(points.items())):
        ax.annotate(" = ".join(labels), (x, y), textcoords="offset points", xytext=(6, 8 if k % 2 else -12), fontsize=8)
    ax.set_xlabel("forward+backward step (ms)" if timed else "recomputed in backward (MFLOP)")
    ax.set_ylabel("kept for backward (MiB)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
