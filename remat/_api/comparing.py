"""Comparing policies on one function: kept bytes, recompute FLOPs, optionally time and peak."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

import optree
import torch

from .._core.no_remat import NO_REMAT, is_no_remat
from .decorator import remat, using_policy, without_remat
from .measuring import saved_tensor_bytes
from .reports import _table, human_bytes, human_flops, pyplot, report


@dataclass(frozen=True)
class Comparison:
    """One policy's row: what it keeps and recomputes; step time and peak when measured."""

    policy: str
    kept_bytes: int
    recompute_flops: int
    step_seconds: float | None = None  # the median of the measured steps
    peak_bytes: int | None = None  # CUDA only
    step_spread_seconds: float | None = None  # their interquartile range

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


def _measure(
    f: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], repeats: int
) -> tuple[float | None, int | None, float | None]:
    """Median forward+backward seconds, on CUDA the step's peak memory above the start, and
    the seconds' interquartile range."""
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
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return statistics.median(times), peak, quartiles[2] - quartiles[0]


def compare(
    f: Callable[..., Any],
    *args: Any,
    policies: Sequence[Callable[..., bool] | None],
    measure: bool = False,
    repeats: int = 5,
    baseline: bool = True,
    progress: bool | None = None,
    **kwargs: Any,
) -> list[Comparison]:
    """Evaluate several policies on `f(*args, **kwargs)` without running backward.

    Every remat region `f` reaches is given each policy in turn (see `using_policy`); if
    `f` reaches none, `f` itself is rematerialized. Rows hold the bytes autograd keeps for
    the backward of all of `f` (regions and the code around them, measured by storage)
    and the FLOPs backward would recompute; with `measure`, also the median
    forward+backward time and (on CUDA) the peak memory of the step, which does run
    backward. `baseline` adds a "no remat" row measured with plain autograd. `progress`
    (default: when measuring) shows a progress line (tqdm's where it is installed).
    """
    tracked = _requiring_grad(args)
    with using_policy(None):
        has_regions = report(f, *tracked, **kwargs).calls > 0
    rows = []
    untimed: tuple[None, None, None] = (None, None, None)
    steps = [NO_REMAT] * baseline + list(policies)
    for policy in _progress(steps, measure if progress is None else progress):
        if is_no_remat(policy):
            with without_remat():
                kept = saved_tensor_bytes(f, *tracked, **kwargs)
                median, peak, spread = _measure(f, tracked, kwargs, repeats) if measure else untimed
            rows.append(Comparison(NO_REMAT, kept, 0, median, peak, spread))
            continue
        target = f if has_regions else remat(f, policy=policy)
        with using_policy(policy):
            flops = report(target, *tracked, **kwargs).recompute_flops
            kept = saved_tensor_bytes(target, *tracked, **kwargs)  # the whole of f, as for the baseline
            median, peak, spread = _measure(target, tracked, kwargs, repeats) if measure else untimed
        name = repr(policy) if policy is not None else "None (nothing_saveable)"
        rows.append(Comparison(name, kept, flops, median, peak, spread))
    return rows


def _progress(steps: list[Any], show: bool) -> Iterator[Any]:
    """The steps, with a progress line on stderr when `show`: tqdm's where installed."""
    if not show:
        yield from steps
        return
    try:
        from tqdm.auto import tqdm
    except ImportError:
        for k, step in enumerate(steps, 1):
            print(f"remat.compare: {k}/{len(steps)} {step if is_no_remat(step) else repr(step)}", file=sys.stderr)
            yield step
        return
    yield from tqdm(steps, desc="remat.compare", unit="policy")


def _step_text(row: Comparison) -> str:
    if row.step_seconds is None:
        return "-"
    spread = "" if row.step_spread_seconds is None else f" (IQR {row.step_spread_seconds * 1e3:.1f})"
    return f"{row.step_seconds * 1e3:.1f} ms{spread}"


def format_comparison(rows: Sequence[Comparison]) -> str:
    """The rows as a table for people."""
    header = ("policy", "kept", "recompute", "step", "peak")
    table = [
        (
            r.policy,
            human_bytes(r.kept_bytes),
            f"{human_flops(r.recompute_flops)}FLOP",
            _step_text(r),
            "-" if r.peak_bytes is None else human_bytes(r.peak_bytes),
        )
        for r in rows
    ]
    return "\n".join(_table(header, table))


def plot_frontier(rows: Sequence[Comparison], path: str, title: str | None = None) -> None:
    """Draw kept memory against recompute cost (step time when measured, with its
    interquartile range as a bar) as a PNG; the title says which.

    Needs matplotlib: `pip install 'remat[plot]'`.
    """
    plt = pyplot("plot_frontier")
    timed = all(r.step_seconds is not None for r in rows)
    xs = [r.step_seconds * 1e3 if timed else r.recompute_flops / 1e6 for r in rows]  # type: ignore[operator]
    ys = [r.kept_bytes / 2**20 for r in rows]
    points: dict[tuple[float, float], list[str]] = {}
    for x, y, r in zip(xs, ys, rows):  # rows that land on one point share a label
        points.setdefault((round(x, 6), round(y, 6)), []).append(r.policy)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.scatter(xs, ys, color="tab:blue", zorder=3)
    if timed and all(r.step_spread_seconds is not None for r in rows):
        spreads = [r.step_spread_seconds * 1e3 / 2 for r in rows]  # type: ignore[operator]
        ax.errorbar(xs, ys, xerr=spreads, fmt="none", ecolor="tab:blue", alpha=0.5, zorder=2)
    for k, ((x, y), labels) in enumerate(sorted(points.items())):
        ax.annotate(" = ".join(labels), (x, y), textcoords="offset points", xytext=(6, 8 if k % 2 else -12), fontsize=8)
    ax.set_xlabel("forward+backward step, median (ms; bars: interquartile range)" if timed else "recomputed in backward (MFLOP)")
    ax.set_ylabel("kept for backward (MiB)")
    ax.set_title(title or ("memory kept vs step time" if timed else "memory kept vs recompute"))
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
