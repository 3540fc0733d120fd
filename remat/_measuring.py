"""Measuring: the bytes autograd really keeps for backward, counted by storage."""

from __future__ import annotations

from typing import Any, Callable

import torch


def saved_tensor_bytes(f: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Run `f` under plain autograd and sum the distinct storages saved for backward.

    Works for any function, with or without remat, so the two can be compared. Views of
    one storage count once. The outputs of `f` are dropped before returning.
    """
    storages: dict[tuple[Any, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[(t.device, storage.data_ptr())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        f(*args, **kwargs)
    return sum(storages.values())
