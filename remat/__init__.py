"""remat: JAX-style functional rematerialization (activation checkpointing) for PyTorch.

`remat(fn, policy=...)` keeps for backward only what the policy allows and recomputes the
rest, under `.backward()` and every torch.func transform.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path


def _policies_of_the_checkout(error: ImportError) -> types.ModuleType:
    """`remat.policies` when Python imported remat from a source checkout (started in the
    repository, remat installed elsewhere or not at all): there the vocabulary lives in
    policies/ beside remat/, which an install maps to remat/policies."""
    folder = Path(__file__).resolve().parent.parent / "policies"
    spec = importlib.util.spec_from_file_location(
        f"{__name__}.policies", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if not (folder / "__init__.py").is_file() or spec is None or spec.loader is None:
        raise error
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


try:
    from . import policies
except ImportError as _error:
    policies = _policies_of_the_checkout(_error)
from ._api.comparing import Comparison, compare, format_comparison, plot_frontier
from ._api.decorator import Rematerialized, RematerializedModule, remat, using_policy, without_remat
from ._api.layers import checkpoint_layers, policy_schedule
from ._api.measuring import saved_tensor_bytes
from ._api.models import checkpoint_model
from ._api.naming import checkpoint_name
from ._api.reports import (
    Recompute,
    RegionTotals,
    Report,
    Residual,
    plot_by_region,
    print_saved_residuals,
    report,
    saved_residuals,
)
from ._api.torch_style import apply_activation_checkpointing, checkpoint, checkpoint_sequential
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
    "plot_by_region",
    "RegionTotals",
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
    "checkpoint_model",
    "checkpoint_sequential",
    "apply_activation_checkpointing",
]
__version__ = "0.1.0"
