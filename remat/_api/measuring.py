"""Measuring: the bytes autograd really keeps for backward, counted by storage."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch


def saved_tensor_bytes(f: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Run `f` under plain autograd and sum the distinct storages kept for backward.

    Counts what the graph of `f`'s outputs still holds when `f` returns (a backward run
    inside `f` frees what it saved, and that is not counted); views of one storage count
    once. Works for any function, with or without remat, so the two can be compared. The
    outputs of `f` are dropped before returning.
    """
    held: list[weakref.ref[_Held]] = []

    def pack(t: torch.Tensor) -> _Held:
        holder = _Held(t)
        held.append(weakref.ref(holder))
        return holder

    with torch.autograd.graph.saved_tensors_hooks(pack, _Held.unpack):
        outputs = f(*args, **kwargs)
    storages: dict[tuple[Any, int], int] = {}
    for ref in held:
        holder = ref()
        if holder is not None:  # autograd still holds it: the outputs' graph needs it
            storage = holder.tensor.untyped_storage()
            storages[(holder.tensor.device, storage.data_ptr())] = storage.nbytes()
    del outputs
    return sum(storages.values())


class _Held:
    """What autograd stores for a saved tensor while measuring: alive exactly as long as
    autograd keeps the saved tensor."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def unpack(self) -> torch.Tensor:
        return self.tensor
