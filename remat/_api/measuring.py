"""Measuring: the bytes autograd really keeps for backward, counted by storage."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Callable, Hashable

import torch

from .._core.torch_internals import autograd_engine_running
from .._running.replaying import replay_starting
from .reports import measuring_replayed


def saved_tensor_bytes(f: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Run `f` under plain autograd and sum the distinct storages kept for backward.

    Counts what the graph of `f`'s outputs still holds when `f` returns (a backward run
    inside `f` frees what it saved, and that is not counted); views of one storage count
    once. Works for any function, with or without remat, so the two can be compared. The
    outputs of `f` are dropped before returning. A region remat replays is counted by what
    it reports keeping (its inputs, kept values and generator state). Other code that
    installs saved-tensor hooks of its own (torch.utils.checkpoint, inside a replayed
    region too) keeps what those hooks keep out of sight: such a call warns that the count
    misses it.
    """
    held: list[weakref.ref[_Held]] = []

    def pack(t: torch.Tensor) -> _Held:
        # Detached: a saved output comes with its grad_fn, the node saving it, and holding
        # that would close a cycle through C++ (node -> saved variable -> holder -> tensor ->
        # node) that no gc.collect() frees: every graph measured would live on.
        holder = _Held(t.detach())
        held.append(weakref.ref(holder))
        return holder

    with torch.autograd.graph.saved_tensors_hooks(pack, _Held.unpack), _hooks_entered() as inner, \
            measuring_replayed() as replayed:
        outputs = f(*args, **kwargs)
    if inner:
        warnings.warn(
            f"saved_tensor_bytes: the function installed saved-tensor hooks of its own ({', '.join(sorted(inner))}); "
            "what they keep (torch.utils.checkpoint's saved inputs and kept values) is not counted. To count a "
            "remat region, use remat.report; to compare with torch.utils.checkpoint, measure CUDA peak memory.",
            UserWarning,
            stacklevel=2,
        )
    storages: dict[Hashable, int] = {}
    for ref in held:
        holder = ref()
        if holder is not None:  # autograd still holds it: the outputs' graph needs it
            storage = holder.tensor.untyped_storage()
            storages[(holder.tensor.device, storage.data_ptr())] = storage.nbytes()
    for kept in replayed:
        if kept.alive():  # the outputs' graph holds the call's backward
            storages.update(kept.storages)
    del outputs
    return sum(storages.values())


@contextlib.contextmanager
def _hooks_entered() -> Iterator[set[str]]:
    """The names of the saved-tensor hook contexts entered while it is open (checked on
    torch 2.13: torch.utils.checkpoint's hooks subclass `saved_tensors_hooks`, whose
    `__enter__` every one of them runs)."""
    entered: set[str] = set()
    hooks = torch.autograd.graph.saved_tensors_hooks
    original = hooks.__enter__

    def noting(self: Any) -> Any:
        # a replayed region's own hooks (what it keeps is counted apart) and hooks a backward
        # inside the function enters to recompute (what they save, that backward reads) are not
        if not replay_starting() and not autograd_engine_running():
            entered.add(type(self).__qualname__)
        return original(self)

    hooks.__enter__ = noting  # type: ignore[method-assign]
    try:
        yield entered
    finally:
        hooks.__enter__ = original  # type: ignore[method-assign]


class _Held:
    """What autograd stores for a saved tensor while measuring: alive exactly as long as
    autograd keeps the saved tensor."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def unpack(self) -> torch.Tensor:
        return self.tensor
