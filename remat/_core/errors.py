"""The errors and warnings remat raises; each message says what went wrong and what to do."""

from __future__ import annotations


class RematError(RuntimeError):
    """remat cannot do what was asked; the message says why and what to do."""


class RematTraceError(RematError):
    """remat could not turn the function into a graph; the message says where and what to do.

    `replayable`: whether running the region as torch.utils.checkpoint does (its Python
    again in backward) gives what the function gives without remat. Not where the failed
    trace itself left stand-in tensors where the caller sees them, nor for a function
    whose Python has an effect a second run would repeat (`.backward()`, mutating an input
    that requires grad)."""

    def __init__(self, message: str, *, replayable: bool = True) -> None:
        super().__init__(message)
        self.replayable = replayable


class RecomputeMismatchError(RuntimeError):
    """A value recomputed in backward differs from the one computed in forward."""


class RematPolicyWarning(UserWarning):
    """A policy refers to an op or a name that the traced function never produces."""


class RematRetraceWarning(UserWarning):
    """A remat'd function traced again and again; the message says what changed."""


class RematFallbackWarning(UserWarning):
    """A region could not be traced and runs as torch.utils.checkpoint runs it; the message says why."""


class RematStateWarning(UserWarning):
    """A remat'd function assigns nonlocal or global state, which runs only when it traces."""
