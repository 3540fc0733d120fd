"""What remat says while it works: `logging.getLogger("remat")`, and warnings that point at
the user's line.

Each trace (why, and how long it took), specialization, plan taken from a like layer,
replay and retrace is logged at INFO. `REMAT_LOG=info` (or `debug`, `warning`) in the
environment prints them to stderr; otherwise the logger is left to the application's
logging configuration, as a library's should be.
"""

from __future__ import annotations

import logging
import os
import sys
import types
import warnings

from .sources import is_installed_code, is_machinery_file

logger = logging.getLogger("remat")


def _configure_from_environment() -> None:
    level = os.environ.get("REMAT_LOG", "").strip().upper()
    if not level:
        return
    if level in ("1", "TRUE", "YES", "ON"):
        level = "INFO"
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[remat] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(getattr(logging, level, logging.INFO))


_configure_from_environment()


def warn_at_user_line(message: str, category: type[Warning]) -> None:
    """`warnings.warn` pointing at the user's line that called into the region: the first
    frame outside torch, remat and installed packages (a transformers model's layer loop,
    nn.Module's call), or where there is none, the first outside torch and remat."""
    frame: types.FrameType | None = sys._getframe(1)
    level, fallback = 1, None  # stack levels from here; the first frame outside torch and remat
    while frame is not None:
        if not is_machinery_file(frame.f_code.co_filename):
            if not is_installed_code(frame.f_code):
                break
            fallback = fallback or level
        frame, level = frame.f_back, level + 1
    level = level if frame is not None else fallback or 1
    warnings.warn(message, category, stacklevel=level + 1)
