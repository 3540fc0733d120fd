"""The errors remat raises; each message says what went wrong and what to do."""

from __future__ import annotations


class RematError(RuntimeError):
    """remat cannot do what was asked; the message says why and what to do."""


class RematTraceError(RematError):
    """remat could not turn the function into a graph; the message says where and what to do."""
