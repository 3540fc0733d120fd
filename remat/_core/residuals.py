"""What a region keeps for backward and what its backward recomputes, one record each:
built where a region is planned (traced) or runs (replayed), gathered by remat.report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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
