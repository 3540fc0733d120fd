"""Inspecting: what remat regions keep for backward, listed for people."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import optree
import torch

if TYPE_CHECKING:
    from ._executing import Plan


@dataclass(frozen=True)
class Residual:
    """One tensor a remat region keeps alive for its backward pass."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    kind: str  # "input" (kept by reference), "intermediate" (computed and kept), or "rng" (a generator state to replay a random op)
    op: Any  # the aten op that produced it; None for inputs
    name: str | None  # its checkpoint_name, if any
    source: str | None  # argument path for inputs, the user's file:line for intermediates
    region: str  # qualified name of the remat'd function

    def describe(self) -> str:
        what = {
            "input": f"from the argument {self.source}",
            "rng": f"generator state to replay {self.op}",
            "debug": f"debug copy of {self.op}",
        }.get(self.kind, f"output of {self.op}")
        if self.kind != "input" and self.source:
            what += f" from {self.source}"
        if self.name:
            what += f" named {self.name!r}"
        dtype = str(self.dtype).replace("torch.", "")
        return f"{dtype}{list(self.shape)} {_human(self.nbytes)} {what} [{self.region}]"


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{nbytes} B"


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for s in shape:
        count *= s
    return count * dtype.itemsize


def residuals_of(plan: Plan) -> list[Residual]:
    """The residuals of one plan: kept inputs, then kept intermediates."""
    captured = plan.captured
    found = []
    for i in plan.part.saved_inputs:
        val = captured.input_values[i]
        shape = tuple(val.shape)
        found.append(Residual(shape, val.dtype, _nbytes(shape, val.dtype), "input", None, None, captured.input_paths[i], plan.region))
    for kept in plan.part.kept:
        found.append(
            Residual(
                kept.shape, kept.dtype, _nbytes(kept.shape, kept.dtype), kept.kind, kept.op, kept.name, kept.source,
                captured.scopes[kept.scope].region,
            )
        )
    return found


_recorder: contextvars.ContextVar[list[Residual] | None] = contextvars.ContextVar("remat_recorder", default=None)


def record(plan: Plan) -> None:
    """Called by every remat region when it runs; a no-op unless saved_residuals listens."""
    sink = _recorder.get()
    if sink is not None:
        sink.extend(residuals_of(plan))


@contextlib.contextmanager
def _recording() -> Iterator[list[Residual]]:
    sink: list[Residual] = []
    token = _recorder.set(sink)
    try:
        yield sink
    finally:
        _recorder.reset(token)


def saved_residuals(f: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """What the remat regions reached by `f(*args, **kwargs)` keep for backward.

    Differentiates with respect to every floating-point tensor in `args` (as
    `torch.func.vjp(f, *args)` would) without running backward.
    """
    leaves, spec = optree.tree_flatten(args)
    moving = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())]

    def g(*values: torch.Tensor) -> Any:
        full = list(leaves)
        for i, v in zip(moving, values):
            full[i] = v
        out = f(*optree.tree_unflatten(spec, full), **kwargs)
        return [x for x in optree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]

    with _recording() as sink:
        torch.func.vjp(g, *[leaves[i] for i in moving])
    return sink


def print_saved_residuals(f: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Print `saved_residuals(f, *args, **kwargs)`, one line each, then the total bytes."""
    found = saved_residuals(f, *args, **kwargs)
    for r in found:
        print(r.describe())
    print(f"total: {sum(r.nbytes for r in found)} bytes ({_human(sum(r.nbytes for r in found))}) in {len(found)} tensors")
