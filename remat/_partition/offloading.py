"""Offloading: a kept value moved to host memory after forward and back before backward.

A policy answers `Offload(dst, src)` for a value; the forward graph then outputs a host
copy of it instead of the value (so the device copy is freed with the forward's other
temporaries), and the backward graph's first nodes bring every offloaded value back to its
device, before anything reads them. On CUDA both copies run on a side stream into and out
of pinned memory, ordered by stream waits and events (see to_host, to_device); on CPU
(host as both sides) they are plain copies, which is how the mechanism is tested without a
GPU. Checked on torch 2.13 CPU only: no GPU has run the CUDA path yet.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx

from remat.policies import Offload

from .._core.torch_internals import transforms_active


def offload_of(decide: Callable[[torch.fx.Node], Any], node: torch.fx.Node, producer: torch.fx.Node) -> Offload | None:
    """The Offload the policy answered for a kept value, when its device is the one to move
    from and it is strided (dense)."""
    answer = decide(producer)
    val = node.meta.get("val")
    if not isinstance(answer, Offload) or not isinstance(val, torch.Tensor) or val.layout != torch.strided:
        return None  # a sparse value stays where it is
    return answer if answer.src is None or answer.src == val.device.type else None


_COPY_STREAMS: dict[torch.device, Any] = {}


def _copy_stream(device: torch.device) -> Any:
    """One side stream per device for offload copies, shared by every region."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def to_host(value: torch.Tensor, dst: str) -> torch.Tensor:
    """A copy of `value` in `dst` memory. From a CUDA device: into pinned memory, on a side
    stream that first waits for the compute stream (so the value is complete), while
    compute goes on; the value's memory is not reused before the copy ends. On the host
    already (or under a torch.func transform): a plain copy."""
    if value.device.type == dst:
        return value.clone()
    if transforms_active() or value.device.type != "cuda":  # an in-place copy would not batch under vmap
        return value.to(dst)
    side = _copy_stream(value.device)
    side.wait_stream(torch.cuda.current_stream(value.device))
    with torch.cuda.stream(side):
        host = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=dst, pin_memory=True)
        host.copy_(value, non_blocking=True)
    value.record_stream(side)
    return host


def to_device(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An offloaded value back on `device`. To CUDA: on the same side stream (so after its
    copy out), and the compute stream waits for an event recorded after this copy, never
    for the whole device."""
    if value.device == device:
        return value
    if transforms_active() or device.type != "cuda":
        return value.to(device)
    side = _copy_stream(device)
    compute = torch.cuda.current_stream(device)
    with torch.cuda.stream(side):
        back = value.to(device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(side)
    compute.wait_event(ready)
    back.record_stream(compute)
    return back


def offloaded_value(node: torch.fx.Node, dst: str) -> Any:
    """The traced value of `node`'s host copy: the same tensor in `dst` memory."""
    val = node.meta["val"]
    return val.new_empty_strided(val.shape, val.stride(), device=dst)
