"""The one value that means "run this region as plain autograd, no remat": an entry of a
`checkpoint_layers` schedule, the override `without_remat()` sets, and that override's
process-wide copy that code compiled by torch.compile reads."""

from __future__ import annotations

from typing import Any, Final

NO_REMAT: Final = "no remat"


def is_no_remat(value: Any) -> bool:
    return isinstance(value, str) and value == NO_REMAT
