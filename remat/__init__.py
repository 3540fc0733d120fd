"""remat: JAX-style functional rematerialization (activation checkpointing) for PyTorch.

`remat(fn, policy=...)` keeps for backward only what the policy allows and recomputes the
rest, under `.backward()` and every torch.func transform.
"""

from __future__ import annotations

from . import policies
from ._api.comparing import Comparison, compare, format_comparison, plot_frontier
from ._api.decorator import Rematerialized, RematerializedModule, checkpoint, remat, using_policy, without_remat
from ._api.layers import checkpoint_layers, policy_schedule
from ._api.measuring import saved_tensor_bytes
from ._api.naming import checkpoint_name
from ._api.reports import Recompute, Report, Residual, print_saved_residuals, report, saved_residuals
from ._core.errors import (
    RecomputeMismatchError,
    RematError,
    RematFallbackWarning,
    RematPolicyWarning,
    RematRetraceWarning,
    RematStateWarning,
    RematTraceError,
)
from ._plans.caching import clear_cache

__all__ = [
    "remat",
    "checkpoint",
    "checkpoint_name",
    "saved_residuals",
    "print_saved_residuals",
    "saved_tensor_bytes",
    "Residual",
    "Report",
    "Recompute",
    "report",
    "Rematerialized",
    "RematerializedModule",
    "RematError",
    "RematTraceError",
    "RecomputeMismatchError",
    "RematPolicyWarning",
    "RematRetraceWarning",
    "RematFallbackWarning",
    "RematStateWarning",
    "clear_cache",
    "policies",
    "using_policy",
    "without_remat",
    "compare",
    "Comparison",
    "format_comparison",
    "plot_frontier",
    "policy_schedule",
    "checkpoint_layers",
]
__version__ = "0.1.0"
