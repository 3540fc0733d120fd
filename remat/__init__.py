"""remat: JAX-style functional rematerialization (activation checkpointing) for PyTorch.

`remat(fn, policy=...)` keeps for backward only what the policy allows and recomputes the
rest, under `.backward()` and every torch.func transform.
"""

from __future__ import annotations

from . import policies
from ._debugging import RecomputeMismatchError
from ._executing import RematError
from ._inspecting import Residual, print_saved_residuals, saved_residuals
from ._measuring import saved_tensor_bytes
from ._naming import checkpoint_name
from ._remat import Rematerialized, checkpoint, remat
from ._tracing import RematTraceError

__all__ = [
    "remat",
    "checkpoint",
    "checkpoint_name",
    "saved_residuals",
    "print_saved_residuals",
    "saved_tensor_bytes",
    "Residual",
    "Rematerialized",
    "RematError",
    "RematTraceError",
    "RecomputeMismatchError",
    "policies",
]
__version__ = "0.1.0"
