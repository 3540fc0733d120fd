"""An oracle for what a region keeps for backward that reads nothing of remat's: the memory
the forward allocated that is still alive once nothing but the output's backward graph is
held, found by the garbage collector (tensors a graph keeps from Python: a selective
checkpoint's cache, a DTensor's local shard). A traced region's saved tensors live in C++
autograd nodes, out of its sight: this oracle is for regions that run replayed."""

from __future__ import annotations

import gc
from typing import Any, Callable

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors with memory behind `t`: itself, or a wrapper subclass's inner tensors
    (a DTensor's local shard), read through the subclass protocol, not by ops (which the
    modes below this one would count)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    parts = [getattr(t, name) for name in names]
    return [plain for part in parts if isinstance(part, torch.Tensor) for plain in _plain(part)]


def _memories(value: Any) -> dict[int, tuple[int, int, torch.dtype]]:
    """Where the memory of every tensor in `value` is, with its size, the storage object that
    owns it and the tensor's dtype (memory freed and given to another tensor, such as a Python
    number autograd keeps as a tensor, is most often another storage's, or of another dtype)."""
    found: dict[int, tuple[int, int, torch.dtype]] = {}
    for t in optree.tree_leaves(value):  # type: ignore[arg-type]
        if isinstance(t, torch.Tensor):
            for plain in _plain(t):
                try:
                    storage = plain.untyped_storage()
                    found[storage.data_ptr()] = (storage.nbytes(), storage._cdata, plain.dtype)
                except (RuntimeError, NotImplementedError):  # no memory to read (a fake or meta tensor)
                    continue
    return found


class _Allocations(TorchDispatchMode):
    """Every memory an op's output got that none of its arguments had, with its size."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, tuple[int, int, torch.dtype]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = _memories((args, kwargs))
        self.made.update((memory, size) for memory, size in _memories(out).items() if memory not in given)
        return out


def bytes_kept_for_backward(forward: Callable[[], torch.Tensor], runs: int = 1) -> int:
    """Bytes of the memory `forward()` allocated that its output's backward graph keeps
    alive: the least over `runs` runs (what the graph keeps, it keeps every time; memory a
    run happens to hold a moment longer, a collective's pending work, it does not)."""
    gc.collect()  # what earlier calls left in cycles, so that no address is reused under us
    # Every object alive now is set aside: the collector then walks only what the runs
    # made (a tensor with memory made during a run is a Python object made during it),
    # which keeps this oracle fast late in a large test session.
    gc.freeze()
    try:
        return min(_alive_after(forward) for _ in range(runs))
    finally:
        gc.unfreeze()


def _alive_after(forward: Callable[[], torch.Tensor]) -> int:
    gc.collect()  # what an earlier run left in cycles
    allocations = _Allocations()
    with allocations:
        out = forward()
    graph = out.grad_fn
    del out
    gc.collect()
    alive = _memories([t for t in gc.get_objects() if issubclass(type(t), torch.Tensor)])
    del graph
    # the same address, size and storage: memory an op made, not memory made outside ops
    # (checkpoint's generator state, a number autograd keeps) where a freed output was
    return sum(facts[0] for memory, facts in allocations.made.items() if alive.get(memory) == facts)
