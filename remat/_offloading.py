"""Offloading: a kept value moved to host memory after forward and back before backward.

A policy answers `Offload(dst, src)` for a value; the forward graph then outputs a host
copy of it instead of the value (so the device copy is freed with the forward's other
temporaries), and the backward graph's first nodes bring every offloaded value back to its
device, before anything reads them. Both copies are issued on the current stream, in
order with the kernels around them: on CUDA the host side is pinned and the copies are
non-blocking, so the host does not wait; on CPU (host as both sides) they are plain copies,
which is how the mechanism is tested without a GPU.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx

from remat.policies import Offload

from ._torch_internals import transforms_active


def offload_of(decide: Callable[[torch.fx.Node], Any], node: torch.fx.Node, producer: torch.fx.Node) -> Offload | None:
    """The Offload the policy answered for a kept value, when its device is the one to move from."""
    answer = decide(producer)
    val = node.meta.get("val")
    if not isinstance(answer, Offload) or not isinstance(val, torch.Tensor):
        return None
    return answer if answer.src is None or answer.src == val.device.type else None


def to_host(value: torch.Tensor, dst: str) -> torch.Tensor:
    """A copy of `value` in `dst` memory: pinned host memory when it comes from an
    accelerator (an asynchronous copy), a plain copy when it is already on the host."""
    if value.device.type == dst:
        return value.clone()
    if transforms_active() or not torch.cuda.is_available():  # an in-place copy would not batch under vmap
        return value.to(dst)
    host = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=dst, pin_memory=True)
    host.copy_(value, non_blocking=True)
    return host


def to_device(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An offloaded value back on `device` (asynchronous from pinned memory)."""
    return value if value.device == device else value.to(device, non_blocking=True)


def offloaded_value(node: torch.fx.Node, dst: str) -> Any:
    """The traced value of `node`'s host copy: the same tensor in `dst` memory."""
    val = node.meta["val"]
    return val.new_empty_strided(val.shape, val.stride(), device=dst)
