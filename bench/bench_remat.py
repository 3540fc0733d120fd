#!/usr/bin/env python
"""Benchmark remat against torch.utils.checkpoint (plain and selective) in one process.

Every variant runs the same pure block functions, `block(x, params)`, over a stack of
layers, so the only difference between two rows is how activations are checkpointed.
For each workload and variant it measures the forward+backward step time (median over
interleaved rounds, so drift on a shared machine hits every variant alike), the bytes kept
for backward after the forward, the matmul FLOPs of a step, the CUDA peak of a step, and
checks the gradients against no checkpointing. It also times remat's first-call trace
and its per-call overhead on a cache hit, then judges the project's targets.

    python bench/bench_remat.py --size cpu                     # writes bench/results-cpu.json
    python bench/bench_remat.py --size cpu --threads 1 --clock cpu --markdown bench/RESULTS.md
    python bench/bench_remat.py --from-json bench/results-cpu.json --markdown bench/RESULTS.md
    bash bench/run_cuda.sh                                     # the cuda size, on a GPU machine

The second line is how the committed CPU results were taken on a shared 2-core machine
(see bench/NOTES.md). Progress goes to stderr; results go to the JSON file (and the
markdown, when asked).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import optree
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

import remat
from remat import policies as P

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_VERSION = 1
HEAD_DIM = 64  # GPT-2's head width; heads = d_model // HEAD_DIM keeps blocks free of non-tensor arguments

# How close to `none` the gradients must be, as max |g - g_none| / max |g_none| per tensor.
# Recompute replays the same kernels, so differences come only from decomposed vs fused
# kernels and summation order: a few ulps of the dtype, amplified by depth.
GRAD_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
# A recompute-only overhead is "close to its FLOP cost" when what is left after the FLOP
# estimate (non-matmul recompute, framework work, noise) is at most this share of a `none` step.
EXCESS_OVER_FLOPS_LIMIT = 0.10
# The per-call overhead of remat on a cache hit is "small" below this share of one block's step.
CACHE_HIT_LIMIT = 0.05
# dots_with_no_batch_dims_saveable against no checkpointing: at least this much less kept, at most this much slower.
DOTS_NO_BATCH_LESS_KEPT, DOTS_NO_BATCH_MORE_TIME = 0.60, 0.05


# --------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Size:
    """The shapes of one benchmark size, and its default repetitions."""

    layers: int
    d_model: int
    seq: int
    batch: int
    dtype: str
    repeats: int
    warmup: int
    tiny_calls: int  # calls per timed batch in the cache-hit overhead measurement
    note: str


SIZES: dict[str, Size] = {
    "tiny": Size(2, 64, 8, 1, "float32", 1, 0, 50, "smoke test: seconds"),
    "cpu": Size(4, 256, 128, 4, "float32", 15, 2, 300, "about a minute on 2 cores"),
    # 24 GPT-2-style layers of width 2048 (32 heads of 64) at 2048 tokens, batch 4, bf16.
    # Scaled from the kept bytes measured at the cpu size, no checkpointing keeps per layer
    # about 16 activations of B*T*D (0.5 GiB) plus, for explicit attention, the softmax
    # output of B*H*T*T (1 GiB): about 36 GiB for 24 layers, plus 2.4 GB of parameters and
    # twice that in gradients (the checked one and the reference): fits an 80 GiB GPU.
    "cuda": Size(24, 2048, 2048, 4, "bfloat16", 10, 3, 300, "one 80+ GiB GPU"),
}


# --------------------------------------------------------------------------- workloads
# Blocks are pure functions of (x, params): the same function serves every variant.


def residual_mlp(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """x + W2 gelu(W1 layernorm(x)): the MLP half of a transformer block, alone a workload."""
    h = F.layer_norm(x, x.shape[-1:], p["mlp_ln_w"], p["mlp_ln_b"])
    return x + F.linear(F.gelu(F.linear(h, p["mlp_w1"], p["mlp_b1"])), p["mlp_w2"], p["mlp_b2"])


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention through the fused kernel (not a dot to any policy: see DESIGN.md)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention spelled out: two batched matmuls (bmm) around a masked softmax."""
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


def residual_attention(
    x: torch.Tensor, p: dict[str, torch.Tensor], attend: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """x + W_o attend(qkv(layernorm(x))): the attention half of a GPT block."""
    b, t, d = x.shape
    h = F.layer_norm(x, (d,), p["attn_ln_w"], p["attn_ln_b"])
    q, k, v = (
        part.view(b, t, d // HEAD_DIM, HEAD_DIM).transpose(1, 2)
        for part in F.linear(h, p["attn_w_qkv"], p["attn_b_qkv"]).split(d, dim=-1)
    )
    a = attend(q, k, v).transpose(1, 2).reshape(b, t, d)
    return x + F.linear(a, p["attn_w_o"], p["attn_b_o"])


def gpt_block_sdpa(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """GPT block, attention through scaled_dot_product_attention."""
    return residual_mlp(residual_attention(x, p, sdpa_attention), p)


def gpt_block_matmul(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """GPT block, attention through explicit matmuls and softmax."""
    return residual_mlp(residual_attention(x, p, matmul_attention), p)


def mlp_param_shapes(d: int) -> dict[str, tuple[int, ...]]:
    return {
        "mlp_ln_w": (d,), "mlp_ln_b": (d,),
        "mlp_w1": (4 * d, d), "mlp_b1": (4 * d,),
        "mlp_w2": (d, 4 * d), "mlp_b2": (d,),
    }


def gpt_param_shapes(d: int) -> dict[str, tuple[int, ...]]:
    return {
        "attn_ln_w": (d,), "attn_ln_b": (d,),
        "attn_w_qkv": (3 * d, d), "attn_b_qkv": (3 * d,),
        "attn_w_o": (d, d), "attn_b_o": (d,),
        **mlp_param_shapes(d),
    }


@dataclass(frozen=True)
class WorkloadSpec:
    """What a workload is made of: its block function and the shapes of one layer's parameters."""

    block: Callable[..., torch.Tensor]
    param_shapes: Callable[[int], dict[str, tuple[int, ...]]]
    description: str


WORKLOADS: dict[str, WorkloadSpec] = {
    "mlp": WorkloadSpec(residual_mlp, mlp_param_shapes, "residual MLP blocks: x + W2 gelu(W1 layernorm(x))"),
    "gpt_sdpa": WorkloadSpec(gpt_block_sdpa, gpt_param_shapes, "GPT blocks, causal attention via scaled_dot_product_attention"),
    "gpt_matmul": WorkloadSpec(gpt_block_matmul, gpt_param_shapes, "GPT blocks, causal attention via explicit matmul + softmax"),
}


@dataclass
class Workload:
    """A stack of one block function over per-layer parameter dicts, with its input."""

    name: str
    description: str
    block: Callable[..., torch.Tensor]
    layers: list[dict[str, torch.Tensor]]
    x: torch.Tensor
    cotangent: torch.Tensor

    @property
    def leaves(self) -> list[torch.Tensor]:
        """Every tensor the step differentiates: the input and all parameters."""
        return [self.x] + [t for p in self.layers for t in p.values()]


def build_workload(name: str, size: Size, device: torch.device, seed: int) -> Workload:
    """Any workload at any size: leaf tensors drawn from one seeded generator, so every
    variant (and every run) sees the same numbers. Weights have std 0.02, layernorm
    scales are near 1, the input and the output cotangent have std 1."""
    spec = WORKLOADS[name]
    dtype = getattr(torch, size.dtype)
    gen = torch.Generator().manual_seed(seed)

    def draw(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std + mean).to(device=device, dtype=dtype)

    layers = [
        {k: draw(s, 0.02, mean=1.0 if k.endswith("ln_w") else 0.0).requires_grad_() for k, s in spec.param_shapes(size.d_model).items()}
        for _ in range(size.layers)
    ]
    activations = (size.batch, size.seq, size.d_model)
    return Workload(name, spec.description, spec.block, layers, draw(activations, 1.0).requires_grad_(), draw(activations, 1.0))


# --------------------------------------------------------------------------- variants

SAC_DOTS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


def sac_dots_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing's spelling of dots_saveable: keep matmul outputs.

    Matched by overload packet, so `aten.mm.default` and any other overload both count.
    """
    if getattr(op, "overloadpacket", None) in SAC_DOTS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


REMAT_POLICIES = {
    "nothing_saveable": P.nothing_saveable,
    "dots_saveable": P.dots_saveable,
    "dots_with_no_batch_dims_saveable": P.dots_with_no_batch_dims_saveable,
    "everything_saveable": P.everything_saveable,
    "memory_budget_0.5": P.memory_budget(0.5),
}
# Offload only where there is a device to offload from: on CPU it would copy host to host.
OFFLOAD_POLICIES = {"offload_dot_with_no_batch_dims": P.offload_dot_with_no_batch_dims(offload_src="cuda")}

# variant -> the variant it is measured against (same memory/recompute trade-off).
PEERS = {
    "remat_nothing_saveable": "tuc",
    "remat_dots_saveable": "tuc_sac_dots",
    "torch_remat": "tuc",
}

LABELS = {
    "none": "no checkpointing",
    "tuc": "torch.utils.checkpoint (non-reentrant)",
    "tuc_sac_dots": "torch.utils.checkpoint + SAC (save mm/addmm/bmm/baddbmm)",
    "torch_remat": "torch_remat.checkpoint (no annotations)",
    **{f"remat_{name}": f"remat {name}" for name in (*REMAT_POLICIES, *OFFLOAD_POLICIES)},
}


@dataclass
class Variant:
    """One way to call a block: `call(x, params) -> y`."""

    name: str
    call: Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
    remat_policy: str | None = None


def torch_remat_status() -> dict[str, Any]:
    """Whether the region-based peer `torch_remat` can be benchmarked here (never installed by us)."""
    try:
        import torch_remat  # type: ignore[import-not-found]
    except ImportError as error:
        return {"available": False, "note": f"torch_remat is not installed ({error}); not measured"}
    return {"available": True, "version": getattr(torch_remat, "__version__", "unknown"), "note": ""}


def build_variants(block: Callable[..., torch.Tensor], with_torch_remat: bool, device: torch.device) -> list[Variant]:
    """Every variant over one block function; remat wrappers are created once, called per block."""
    sac_context = functools.partial(create_selective_checkpoint_contexts, sac_dots_policy)
    variants = [
        Variant("none", block),
        Variant("tuc", lambda x, p: checkpoint(block, x, p, use_reentrant=False)),
        Variant("tuc_sac_dots", lambda x, p: checkpoint(block, x, p, use_reentrant=False, context_fn=sac_context)),
    ]
    policies = {**REMAT_POLICIES, **(OFFLOAD_POLICIES if device.type == "cuda" else {})}
    for name, policy in policies.items():
        variants.append(Variant(f"remat_{name}", remat.remat(block, policy=policy), remat_policy=name))
    if with_torch_remat:
        import torch_remat  # type: ignore[import-not-found]

        variants.append(Variant("torch_remat", lambda x, p: torch_remat.checkpoint(region_name=block.__name__)(block)(x, p)))
    return variants


# --------------------------------------------------------------------------- one step


def forward(call: Callable[..., torch.Tensor], wl: Workload) -> torch.Tensor:
    """The stack: `call` once per layer, so a checkpoint wraps each block separately."""
    h = wl.x
    for p in wl.layers:
        h = call(h, p)
    return h


def step(call: Callable[..., torch.Tensor], wl: Workload) -> tuple[torch.Tensor, ...]:
    """One training step's autograd work: forward, then gradients of every leaf."""
    out = forward(call, wl)
    return torch.autograd.grad(out, wl.leaves, grad_outputs=wl.cotangent)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS = ("wall", "cpu")


def timed_step(call: Callable[..., torch.Tensor], wl: Workload, device: torch.device) -> dict[str, float]:
    """Milliseconds for one step by both clocks, the previous step's garbage collected first.

    "wall" is elapsed time. "cpu" is this process's CPU time: with one torch thread it is
    the work the step did, whatever else the machine runs (on a shared machine, other
    processes stretch wall time, and with several threads they stall OpenMP barriers).
    """
    gc.collect()
    synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    out = forward(call, wl)
    synchronize(device)
    forward_wall = time.perf_counter()
    grads = torch.autograd.grad(out, wl.leaves, grad_outputs=wl.cotangent)
    synchronize(device)
    end = time.perf_counter()
    elapsed = {"wall": (end - wall) * 1e3, "cpu": (time.process_time() - cpu) * 1e3, "forward_wall": (forward_wall - wall) * 1e3}
    del out, grads
    return elapsed


def grad_check(call: Callable[..., torch.Tensor], wl: Workload, reference: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Worst relative gradient error against `none` over all leaves."""
    grads = step(call, wl)
    worst = 0.0
    for g, ref in zip(grads, reference):
        scale = ref.abs().max().item() or 1.0
        worst = max(worst, (g.float() - ref.float()).abs().max().item() / scale)
    tolerance = GRAD_TOLERANCE[wl.x.dtype]
    return {"ok": worst <= tolerance, "max_rel_err": worst, "tolerance": tolerance}


# --------------------------------------------------------------------------- memory


class _ForwardStorages(TorchDispatchMode):
    """Weak references to the storage of every op output produced while active.

    A storage's Python object lives as long as its C++ storage does, so after the forward
    the live references are exactly the memory allocated by the forward and still held,
    whoever holds it: autograd's saved tensors, checkpoint frames, SAC caches or remat's
    residuals. The same count therefore applies to every variant.
    """

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[weakref.ref[Any], int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in optree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                self.refs.append((weakref.ref(storage), storage.nbytes()))
        return out

    def live_bytes(self, exclude: Sequence[torch.Tensor] = (), device_type: str | None = None) -> int:
        """Bytes of the distinct live storages (on `device_type` when given), less those of
        `exclude` (which existed before)."""
        excluded = {t.untyped_storage().data_ptr() for t in exclude}
        live: dict[int, int] = {}
        for ref, nbytes in self.refs:
            storage = ref()
            if storage is None or not nbytes or storage.data_ptr() in excluded:
                continue
            if device_type is None or storage.device.type == device_type:
                live[storage.data_ptr()] = nbytes
        return sum(live.values())


def kept_bytes(call: Callable[..., torch.Tensor], wl: Workload, device: torch.device) -> dict[str, Any]:
    """Bytes held for backward after the forward, measured three ways.

    `kept_bytes`: storages the forward's ops produced that are still alive while only the
    output is held, less the output and the leaves (views of parameters are op outputs too):
    exact, and the same for every variant.
    `saved_tensor_bytes`: remat.saved_tensor_bytes, which sees what autograd saves through
    saved-tensor hooks, so it is blind to what torch.utils.checkpoint keeps behind its own
    hooks; it also counts the inputs and parameters kept by reference.
    `kept_allocated_bytes` (CUDA): allocator growth across the forward, output excluded.
    `kept_host_bytes` (CUDA): the part of `kept_bytes` waiting in host memory (offloaded).
    """
    gc.collect()
    synchronize(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with _ForwardStorages() as tracker:
        out = forward(call, wl)
    gc.collect()
    result: dict[str, Any] = {"kept_bytes": tracker.live_bytes(exclude=[out, *wl.leaves])}
    if device.type == "cuda":
        synchronize(device)
        result["kept_allocated_bytes"] = torch.cuda.memory_allocated(device) - before - out.untyped_storage().nbytes()
        result["kept_host_bytes"] = tracker.live_bytes(exclude=[out, *wl.leaves], device_type="cpu")
    del out, tracker
    gc.collect()
    with warnings.catch_warnings():  # it warns for the peers' own hooks: this table says what it misses
        warnings.simplefilter("ignore", UserWarning)
        result["saved_tensor_bytes"] = remat.saved_tensor_bytes(forward, call, wl)
    gc.collect()
    return result


def cuda_peak_bytes(call: Callable[..., torch.Tensor], wl: Workload, device: torch.device) -> int:
    """Peak allocated during one step, above what was held before it (parameters, inputs)."""
    gc.collect()
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    grads = step(call, wl)
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del grads
    return peak


# --------------------------------------------------------------------------- FLOPs


def _cpu_flash_flops(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward_flops(grad: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad, query, key, value)


# torch's table knows the CUDA attention kernels but not the CPU flash kernel: same formulas.
_FLOP_FORMULAS = {
    **flop_registry,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(_cpu_flash_flops),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: shape_wrapper(_cpu_flash_backward_flops),
}


class _FlopCounter(TorchDispatchMode):
    """Sums torch's FLOP formulas over every op run while active.

    torch's FlopCounterMode also tracks nn.Modules with multi-grad hooks, which
    torch.autograd.grad refuses on leaf inputs (and remat runs its graphs as GraphModules),
    so only its formula table is used here.
    """

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        formula = _FLOP_FORMULAS.get(func.overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


def step_flops(call: Callable[..., torch.Tensor], wl: Workload) -> dict[str, int]:
    """Matmul and attention FLOPs of one step (recompute included, causal masking ignored),
    and how many aten ops the step ran (recompute and framework ops included)."""
    with _FlopCounter() as counter:
        grads = step(call, wl)
    del grads
    return {"flops": counter.flops, "aten_ops": counter.ops}


# --------------------------------------------------------------------------- where time goes


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """The profiler's native library prints start/stop lines to fd 2; keep progress readable."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _profiled_step(call: Callable[..., torch.Tensor], wl: Workload) -> dict[str, float]:
    with _native_stderr_silenced(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        grads = step(call, wl)
        total = (time.perf_counter() - start) * 1e3
    del grads
    kernels = sum(
        e.self_cpu_time_total for e in prof.events()
        if e.name.startswith("aten::") and not any(c.name == e.name for c in e.cpu_children)
    ) / 1e3
    return {"profiled_step_ms": total, "kernel_ms": kernels, "outside_kernels_ms": total - kernels}


def kernel_split(call: Callable[..., torch.Tensor], wl: Workload, samples: int = 3) -> dict[str, float]:
    """A profiled CPU step split into time inside aten kernels and time outside them
    (Python, the autograd engine, saved-tensor hooks, dispatch modes, graph interpretation).

    An op re-entered through a Python dispatch mode (SAC) shows as an aten event holding a
    child of the same name; only the innermost counts as kernel time, the outer one's own
    time is the mode's Python work. Of `samples` profiled steps the fastest is kept, the
    one least disturbed by the rest of the machine.
    """
    return min((_profiled_step(call, wl) for _ in range(samples)), key=lambda split: split["profiled_step_ms"])


# --------------------------------------------------------------------------- remat's own costs


def trace_cost(wrapped: remat.Rematerialized, wl: Workload, device: torch.device) -> dict[str, Any]:
    """A new wrapper's first call (traces) vs its second (cache hit): one block, forward only.

    Must run before anything else calls `wrapped`; `traced` confirms the first call traced.
    """
    times = []
    for _ in range(2):
        synchronize(device)
        start = time.perf_counter()
        out = wrapped(wl.x, wl.layers[0])
        synchronize(device)
        times.append(time.perf_counter() - start)
        del out
    return {"first_call_ms": times[0] * 1e3, "cached_call_ms": times[1] * 1e3,
            "trace_ms": (times[0] - times[1]) * 1e3, "traced": wrapped.cache_info()["traces"] == 1}


def tiny_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Small enough that a step is all framework overhead."""
    return torch.tanh(x @ w)


def per_call_us(fn: Callable[..., torch.Tensor], args: Sequence[torch.Tensor], calls: int, batches: int, clock: str) -> float:
    """Median over batches of microseconds per forward+backward call, by `clock`."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    device = args[0].device
    cotangent = torch.ones_like(fn(*args))
    for _ in range(max(calls // 10, 1)):
        torch.autograd.grad(fn(*args), args, cotangent)
    samples = []
    for _ in range(batches):
        synchronize(device)
        start = now()
        for _ in range(calls):
            torch.autograd.grad(fn(*args), args, cotangent)
        synchronize(device)
        samples.append((now() - start) / calls * 1e6)
    return statistics.median(samples)


def cache_hit_overhead(device: torch.device, calls: int, clock: str) -> dict[str, Any]:
    """remat's per-call cost on a cache hit: a tiny function with and without it.

    Uses everything_saveable so nothing is recomputed and the difference is machinery
    alone; torch.utils.checkpoint on the same function is given for scale.
    """
    x = torch.randn(8, 8, device=device, requires_grad=True)
    w = torch.randn(8, 8, device=device, requires_grad=True)
    wrapped = remat.remat(tiny_fn, policy=P.everything_saveable)
    plain = per_call_us(tiny_fn, (x, w), calls, 5, clock)
    with_remat = per_call_us(wrapped, (x, w), calls, 5, clock)
    with_tuc = per_call_us(lambda a, b: checkpoint(tiny_fn, a, b, use_reentrant=False), (x, w), calls, 5, clock)
    return {
        "function": "tanh(x @ w), x and w float32[8, 8], forward + backward",
        "clock": clock,
        "remat_policy": "everything_saveable",
        "calls_per_batch": calls,
        "plain_us": plain,
        "remat_us": with_remat,
        "remat_overhead_us": with_remat - plain,
        "tuc_us": with_tuc,
        "tuc_overhead_us": with_tuc - plain,
        "remat_cache": wrapped.cache_info(),
    }


# --------------------------------------------------------------------------- running a workload


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def timing_rounds(
    variants: list[Variant], wl: Workload, device: torch.device, warmup: int, repeats: int, clock: str
) -> dict[str, dict[str, list[float]]]:
    """Interleaved rounds: each round times every variant once, so drift is shared; the
    starting variant rotates, so no variant always runs right after the same neighbour."""
    times: dict[str, dict[str, list[float]]] = {v.name: {c: [] for c in (*CLOCKS, "forward_wall")} for v in variants}
    rounds = warmup + repeats
    for r in range(rounds):
        phase = "warm-up" if r < warmup else "timed"
        for v in variants[r % len(variants):] + variants[: r % len(variants)]:
            elapsed = timed_step(v.call, wl, device)
            if r >= warmup:
                for c, ms in elapsed.items():
                    times[v.name][c].append(ms)
        last = ", ".join(f"{v.name} {times[v.name][clock][-1]:.1f}" for v in variants) if r >= warmup else ""
        log(f"{wl.name}: round {r + 1}/{rounds} ({phase}) {last + f' ms ({clock})' if last else ''}")
    return times


def measure_workload(name: str, size: Size, device: torch.device, args: argparse.Namespace, with_torch_remat: bool) -> dict[str, Any]:
    """All figures for one workload: correctness first, then memory, FLOPs, time, tracing."""
    wl = build_workload(name, size, device, args.seed)
    variants = build_variants(wl.block, with_torch_remat, device)
    log(f"{name}: {wl.description}; {size.layers} layers, d_model {size.d_model}, seq {size.seq}, batch {size.batch}, {size.dtype}")
    reference = [g.detach().clone() for g in step(wl.block, wl)]
    gc.collect()  # earlier workloads' garbage must not be frozen with what lives on
    gc.freeze()  # what exists now lives to the end of this workload: keep it out of every later gc.collect()
    rows: dict[str, dict[str, Any]] = {}
    ok: list[Variant] = []
    traces: dict[str, Any] = {}
    for v in variants:
        row: dict[str, Any] = {"label": LABELS[v.name], "peer": PEERS.get(v.name), "error": None}
        rows[v.name] = row
        try:
            if v.remat_policy is not None:
                traces[v.remat_policy] = trace_cost(v.call, wl, device)  # type: ignore[arg-type]
                log(f"{name}: {v.name}: first call traced in {traces[v.remat_policy]['trace_ms']:.0f} ms")
            row["grad_check"] = grad_check(v.call, wl, reference)
            row.update(kept_bytes(v.call, wl, device))
            row.update(step_flops(v.call, wl))
            if device.type == "cpu":
                row.update(kernel_split(v.call, wl))
            if device.type == "cuda":
                row["cuda_peak_bytes"] = cuda_peak_bytes(v.call, wl, device)
            ok.append(v)
        except Exception as error:  # noqa: BLE001 - one failing variant must not hide the others
            row["error"] = f"{type(error).__name__}: {error}"
            row["traceback"] = traceback.format_exc()
            log(f"{name}: {v.name} FAILED: {row['error']}")
        if row["error"] is not None:
            # Outside the handler: the exception and its traceback's frames (holding the failed
            # step's tensors) are gone now, so their memory can go back before the next variant.
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        log(
            f"{name}: {v.name}: grads {'ok' if row['grad_check']['ok'] else 'MISMATCH'} "
            f"(max rel err {row['grad_check']['max_rel_err']:.1e}), kept {row['kept_bytes'] / 2**10:.1f} KiB"
        )
    gc.collect()  # garbage first: gc.freeze() would keep cyclic garbage (and its GPU tensors) forever
    gc.freeze()  # remat's traced plans too
    times = timing_rounds(ok, wl, device, args.warmup, args.repeats, args.clock)
    for v in ok:
        row = rows[v.name]
        for c in CLOCKS:
            row[f"{c}_ms_all"] = times[v.name][c]
            row[f"{c}_ms"] = statistics.median(times[v.name][c])
        row["forward_wall_ms"] = statistics.median(times[v.name]["forward_wall"])
        row["step_ms_all"] = times[v.name][args.clock]  # the clock the figures and targets use
        row["step_ms"] = row[f"{args.clock}_ms"]
        row["step_ms_min"] = min(row["step_ms_all"])
    derive_ratios(rows)
    gc.unfreeze()  # this workload's model, plans and any garbage become collectable again
    gc.collect()
    return {
        "description": wl.description,
        "block_function": wl.block.__name__,
        "variants": rows,
        "trace": traces,
        "block_step_ms": rows["none"]["step_ms"] / size.layers,
    }


def _iqr(samples: Sequence[float]) -> float:
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q3 - q1


def derive_ratios(rows: dict[str, dict[str, Any]]) -> None:
    """Ratios to `none` and to the peer, and how the extra time compares to the extra FLOPs."""
    base = rows["none"]
    rate = base["flops"] / base["step_ms"]  # FLOPs per ms that a `none` step achieves
    for row in rows.values():
        if row.get("step_ms") is None:
            continue
        row["ratio_vs_none"] = row["step_ms"] / base["step_ms"]
        peer = rows.get(row["peer"] or "", {})
        row["ratio_vs_peer"] = row["step_ms"] / peer["step_ms"] if peer.get("step_ms") else None
        row["kept_vs_peer"] = row["kept_bytes"] / peer["kept_bytes"] if peer.get("kept_bytes") else None
        row["spread"] = (max(row["step_ms_all"]) - min(row["step_ms_all"])) / row["step_ms"]
        row["iqr_rel"] = _iqr(row["step_ms_all"]) / row["step_ms"]
        row["extra_flops"] = row["flops"] - base["flops"]
        row["overhead_ms"] = row["step_ms"] - base["step_ms"]
        row["recompute_estimate_ms"] = row["extra_flops"] / rate
        row["excess_ms"] = row["overhead_ms"] - row["recompute_estimate_ms"]


# --------------------------------------------------------------------------- targets


@dataclass
class Target:
    """One target judged on one workload; `detail` says in numbers what decided a miss, or
    that a time comparison was decided by less than the run's noise."""

    name: str
    workload: str
    met: bool
    numbers: dict[str, Any]
    detail: str = ""


def _peer_target(name: str, workload: str, rows: dict[str, Any], variant: str, peer: str, strict: bool) -> Target:
    """remat against its peer on time and bytes: `strict` asks for better, else no worse."""
    r, p = rows[variant], rows[peer]
    better = (lambda a, b: a < b) if strict else (lambda a, b: a <= b)
    time_ok, bytes_ok = better(r["step_ms"], p["step_ms"]), better(r["kept_bytes"], p["kept_bytes"])
    noise = max(r["iqr_rel"], p["iqr_rel"])
    margin = r["ratio_vs_peer"] - 1
    within = f"within this run's noise (IQR {noise:.1%} of the median)"
    detail = []
    if not time_ok:
        detail.append(f"{margin:.1%} slower than {peer}" + (f", {within}" if margin <= noise else ""))
    elif abs(margin) <= noise:
        detail.append(f"time decided by {abs(margin):.1%}, {within}")
    if not bytes_ok:
        detail.append(f"keeps {r['kept_bytes'] - p['kept_bytes']} bytes more than {peer}")
    numbers = {"time_ratio": r["ratio_vs_peer"], "remat_kept_bytes": r["kept_bytes"],
               "peer_kept_bytes": p["kept_bytes"], "noise_iqr": noise}
    return Target(name, workload, time_ok and bytes_ok, numbers, "; ".join(detail))


def judge_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The project's targets, each True/False with the numbers it was decided on."""
    targets: list[Target] = []
    overhead_us = results["cache_hit_overhead"]["remat_overhead_us"]
    for wname, w in results["workloads"].items():
        rows = w["variants"]

        def timed(*names: str) -> bool:
            return all(rows.get(n, {}).get("step_ms") is not None for n in names)

        if timed("remat_nothing_saveable", "tuc"):
            targets.append(_peer_target("nothing_saveable at most as slow as torch.utils.checkpoint, keeping no more bytes",
                                        wname, rows, "remat_nothing_saveable", "tuc", strict=False))
        if timed("remat_dots_saveable", "tuc_sac_dots"):
            targets.append(_peer_target("dots_saveable faster than SAC(dots) and keeping fewer bytes",
                                        wname, rows, "remat_dots_saveable", "tuc_sac_dots", strict=True))
        none_ms = rows["none"]["step_ms"]
        for policy in ("nothing_saveable", "dots_saveable"):
            if not timed(f"remat_{policy}"):
                continue
            row = rows[f"remat_{policy}"]
            share = row["excess_ms"] / none_ms
            targets.append(Target(
                f"{policy}: overhead over none close to the recomputed FLOPs "
                f"(excess at most {EXCESS_OVER_FLOPS_LIMIT:.0%} of a none step)",
                wname,
                share <= EXCESS_OVER_FLOPS_LIMIT,
                {"overhead_ms": row["overhead_ms"], "recompute_estimate_ms": row["recompute_estimate_ms"],
                 "excess_ms": row["excess_ms"], "excess_share_of_none": share, "extra_gflops": row["extra_flops"] / 1e9},
                "" if share <= EXCESS_OVER_FLOPS_LIMIT else
                f"{row['excess_ms']:.1f} ms beyond the matmul recompute ({share:.0%} of a none step): "
                "non-matmul recompute and per-op framework work",
            ))
        if timed("remat_dots_with_no_batch_dims_saveable", "none"):
            row = rows["remat_dots_with_no_batch_dims_saveable"]
            less, slower = 1 - row["kept_bytes"] / rows["none"]["kept_bytes"], row["ratio_vs_none"] - 1
            met = less >= DOTS_NO_BATCH_LESS_KEPT and slower <= DOTS_NO_BATCH_MORE_TIME
            targets.append(Target(
                f"dots_with_no_batch_dims_saveable keeps at least {DOTS_NO_BATCH_LESS_KEPT:.0%} less than none "
                f"at most {DOTS_NO_BATCH_MORE_TIME:.0%} slower",
                wname, met, {"kept_less_share": less, "slower_share": slower},
                "" if met else f"keeps {less:.0%} less, {slower:.1%} slower than none",
            ))
        block_us = w["block_step_ms"] * 1e3
        small = overhead_us <= CACHE_HIT_LIMIT * block_us
        targets.append(Target(
            f"cache-hit overhead small against one block's step (at most {CACHE_HIT_LIMIT:.0%})",
            wname,
            small,
            {"overhead_us": overhead_us, "block_step_us": block_us, "share": overhead_us / block_us},
            "" if small else f"{overhead_us:.0f} µs per call is {overhead_us / block_us:.0%} of a {block_us:.0f} µs block step",
        ))
    return [asdict(t) for t in targets]


# --------------------------------------------------------------------------- environment


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": os.getloadavg(),
    }
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        info["cpu_model"] = fields.get("Model name", "").strip()
    except (OSError, subprocess.SubprocessError):
        info["cpu_model"] = platform.processor()
    try:
        info["nproc"] = int(subprocess.run(["nproc"], capture_output=True, text=True, timeout=10).stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        info["nproc"] = os.cpu_count()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = props.total_memory / 2**30
        info["cuda"] = torch.version.cuda
    info["remat_git"] = git_state()
    return info


def git_state() -> str:
    """The remat commit measured, and whether the tree had uncommitted changes (read-only)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "remat", "policies"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}{' + uncommitted changes in remat/ or policies/' if dirty else ''}" if head else "unknown"


KEPT_BYTES_METHOD = (
    "kept_bytes: during the forward a TorchDispatchMode holds a weak reference to the storage of every "
    "op output; after the forward, with only the output held, the distinct storages still alive are "
    "what is kept for backward (by autograd, checkpoint frames, SAC caches or remat residuals). The "
    "output's own storage is excluded; inputs and parameters (allocated before the forward) are not "
    "counted. saved_tensor_bytes: remat.saved_tensor_bytes, which sees only tensors saved through "
    "saved-tensor hooks, so it cannot see inside torch.utils.checkpoint (whose own hooks take "
    "precedence) and it counts inputs/parameters kept by reference."
)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    base = SIZES[args.size]
    size = Size(**{**asdict(base), "repeats": args.repeats if args.repeats is not None else base.repeats,
                   "warmup": args.warmup if args.warmup is not None else base.warmup})
    args.repeats, args.warmup = size.repeats, size.warmup
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    peer = torch_remat_status()
    if not peer["available"]:
        log(peer["note"])
    results: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "size": args.size,
        "clock": args.clock,
        "config": asdict(size),
        "device": str(device),
        "machine": machine_info(device),
        "torch_remat": peer,
        "kept_bytes_method": KEPT_BYTES_METHOD,
        "flops_method": "torch.utils.flop_counter's formulas summed by a TorchDispatchMode over one step (mm, addmm, bmm, baddbmm, attention kernels; causal masking not discounted)",
        "workloads": {},
    }
    log(f"cache-hit overhead: tiny function, {size.tiny_calls} calls x 5 batches")
    results["cache_hit_overhead"] = cache_hit_overhead(device, size.tiny_calls, args.clock)
    for name in args.workloads:
        results["workloads"][name] = measure_workload(name, size, device, args, peer["available"])
        results["targets"] = judge_targets(results)
        results["elapsed_s"] = time.perf_counter() - started
        results["machine"]["load_average_at_end"] = os.getloadavg()
        write_json(results, args.out)  # a run cut short (a lent GPU's time limit) keeps its finished workloads
    return results


def write_json(results: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")


# --------------------------------------------------------------------------- markdown

MIB = 2**20


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def render_result(r: dict[str, Any]) -> list[str]:
    """One result file as a markdown section."""
    m, c, clock = r["machine"], r["config"], r["clock"]
    other = "cpu" if clock == "wall" else "wall"
    spreads = [row["spread"] for w in r["workloads"].values() for row in w["variants"].values() if "spread" in row]
    lines = [
        f"## Size `{r['size']}` on {r['device']}",
        "",
        f"- Machine: {m.get('cpu_model', '?')}, nproc {m.get('nproc')}, torch threads {m.get('torch_threads')}"
        + (f"; GPU {m['gpu']} ({m['gpu_memory_gib']:.0f} GiB), CUDA {m['cuda']}" if "gpu" in m else ""),
        f"- torch {m['torch']}, Python {m['python']}, {m['platform']}; remat at {m.get('remat_git', '?')}",
        f"- Shapes: {c['layers']} layers, d_model {c['d_model']} ({c['d_model'] // HEAD_DIM} × {HEAD_DIM}-wide heads), "
        f"seq {c['seq']}, batch {c['batch']}, {c['dtype']}; median of {c['repeats']} interleaved rounds after {c['warmup']} warm-up",
        f"- Command: `{r['command']}` ({r['elapsed_s']:.0f} s)",
        f"- Clock: step times are medians of the {clock} clock"
        + (" (this process's CPU time: on a shared machine, time other processes take is not counted)" if clock == "cpu" else "")
        + f"; the {other} clock is shown too. Load average at start {m['load_average_at_start'][0]:.1f}, at end "
        f"{m['load_average_at_end'][0]:.1f}; widest spread (max−min)/median of any row {max(spreads, default=0):.2f}.",
        f"- torch_remat: {r['torch_remat']['note'] or 'installed, version ' + r['torch_remat'].get('version', '?')}",
        "",
        f"| workload | variant | step ms ({clock}) | × none | × peer | {other} ms | outside kernels ms | kept MiB | saved_tensor_bytes MiB | extra GFLOP | grads ok (max rel err) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for wname, w in r["workloads"].items():
        for vname, row in w["variants"].items():
            if row.get("error"):
                lines.append(f"| {wname} | {row['label']} | error: {row['error'][:80]} | | | | | | | | |")
                continue
            peer = f"{row['ratio_vs_peer']:.2f} (vs {row['peer']})" if row.get("ratio_vs_peer") else ""
            grads = f"{'yes' if row['grad_check']['ok'] else '**NO**'} ({row['grad_check']['max_rel_err']:.0e})"
            lines.append(
                f"| {wname} | {row['label']} | {_fmt(row.get('step_ms'), '.1f')} | {_fmt(row.get('ratio_vs_none'), '.2f')} | {peer} | {_fmt(row.get(f'{other}_ms'), '.1f')} | {_fmt(row.get('outside_kernels_ms'), '.1f')} "
                f"| {row['kept_bytes'] / MIB:.2f} | {row['saved_tensor_bytes'] / MIB:.2f} | {_fmt(row.get('extra_flops', 0) / 1e9, '.2f')} | {grads} |"
            )
    if r["device"].startswith("cuda"):
        lines += ["", "CUDA memory per variant (MiB): the peak of one step above what was held before it "
                  "(`torch.cuda.max_memory_allocated`), the allocator's growth over the forward (what the "
                  "device keeps for backward), and what waits in pinned host memory:", "",
                  "| workload | variant | CUDA peak | device kept | host kept |", "|---|---|---:|---:|---:|"]
        for wname, w in r["workloads"].items():
            for row in w["variants"].values():
                if row.get("error"):
                    continue
                cells = [row.get("cuda_peak_bytes"), row.get("kept_allocated_bytes"), row.get("kept_host_bytes")]
                mib = " | ".join(_fmt(c / MIB if c is not None else None, ".0f") for c in cells)
                lines.append(f"| {wname} | {row['label']} | {mib} |")
    oh = r["cache_hit_overhead"]
    traced = list(dict.fromkeys(p for w in r["workloads"].values() for p in w["trace"]))
    lines += [
        "",
        "### remat's own costs",
        "",
        "First call of a new wrapper (traces) minus its second call (cache hit), one block, forward only, wall ms:",
        "",
        "| workload | " + " | ".join(traced) + " | one block's `none` step |",
        "|---|" + "---:|" * (len(traced) + 1),
    ]
    for wname, w in r["workloads"].items():
        ms = " | ".join(_fmt(w["trace"][p]["trace_ms"] if p in w["trace"] else None, ".0f") for p in traced)
        lines.append(f"| {wname} | {ms} | {w['block_step_ms']:.1f} |")
    lines += [
        "",
        f"Cache hit, {oh['function']}, median µs per call ({oh['clock']} clock): plain {oh['plain_us']:.0f}, "
        f"remat({oh['remat_policy']}) {oh['remat_us']:.0f} (+{oh['remat_overhead_us']:.0f}), "
        f"torch.utils.checkpoint {oh['tuc_us']:.0f} (+{oh['tuc_overhead_us']:.0f}).",
        "",
        "### Targets",
        "",
    ]
    for t in r["targets"]:
        numbers = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in t["numbers"].items())
        detail = f" {'Note' if t['met'] else '**Why**'}: {t['detail']}." if t["detail"] else ""
        lines.append(f"- {'MET' if t['met'] else '**MISSED**'}: {t['name']} [{t['workload']}]: {numbers}.{detail}")
    lines += ["", f"How bytes are counted: {r['kept_bytes_method']}", "", f"FLOPs: {r['flops_method']}.", ""]
    return lines


def render_markdown(results: list[dict[str, Any]], sources: list[str], notes: str) -> str:
    """RESULTS.md: every number comes from the JSON files; `notes` is the hand-written analysis."""
    lines = [
        "# remat benchmark results",
        "",
        f"Generated by `bench/bench_remat.py --markdown` from {', '.join(f'`{s}`' for s in sources)}; "
        "edit `bench/NOTES.md` for the analysis, never the numbers.",
        "",
        "Variants per block: none; torch.utils.checkpoint non-reentrant (peer of remat nothing_saveable); "
        "torch.utils.checkpoint + selective checkpointing keeping mm/addmm/bmm/baddbmm (peer of remat "
        "dots_saveable); remat with each built-in policy, memory_budget(0.5) and (on CUDA) "
        "offload_dot_with_no_batch_dims. '× peer' compares with that peer; 'kept MiB' is "
        "the exact count described under each table; 'extra GFLOP' is matmul/attention work beyond `none` "
        "(the recompute); 'outside kernels ms' is the part of one profiled step spent outside aten kernels "
        "(Python, autograd engine, hooks, dispatch modes; CPU runs only).",
        "",
    ]
    if not any(r["device"].startswith("cuda") for r in results):
        lines += ["**CUDA sizes: not yet measured.** Run `bash bench/run_cuda.sh` on a machine with an 80+ GiB GPU "
                  "and regenerate this file.", ""]
    for r in results:
        lines += render_result(r)
    if notes.strip():
        lines += [notes.strip(), ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default=None, help="default: cuda on a GPU, else cpu")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default per size)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default per size)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's, all cores)")
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="which clock step times and targets use: wall (default) or this process's CPU time "
                             "(for a shared CPU machine, with --threads 1); both are recorded")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results-<device>.json)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write this markdown summary")
    parser.add_argument("--from-json", type=Path, nargs="+", default=None,
                        help="do not measure: render --markdown from these result files")
    parser.add_argument("--notes", type=Path, default=ROOT / "bench" / "NOTES.md", help="analysis appended to the markdown")
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.device.startswith("cuda"):
        parser.error("--clock cpu measures host CPU time; on CUDA use wall")
    if args.size is None:
        args.size = "cuda" if args.device.startswith("cuda") else "cpu"
    if args.out is None:
        device_type = torch.device(args.device).type
        suffix = "" if args.size in ("cpu", "cuda") else f"-{args.size}"
        args.out = ROOT / "bench" / f"results-{device_type}{suffix}.json"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        if args.markdown is None:
            raise SystemExit("--from-json needs --markdown")
        results = [json.loads(p.read_text()) for p in args.from_json]
        sources = [str(p) for p in args.from_json]
    else:
        result = run(args)
        write_json(result, args.out)
        log(f"wrote {args.out} ({result['elapsed_s']:.0f} s)")
        for t in result["targets"]:
            log(f"target {'met' if t['met'] else 'MISSED'}: {t['name']} [{t['workload']}] {t['detail']}")
        results, sources = [result], [str(args.out)]
    if args.markdown is not None:
        notes = args.notes.read_text() if args.notes and args.notes.exists() else ""
        text = render_markdown(results, [_relative(s) for s in sources], notes)
        args.markdown.write_text(text + kept_section(args.markdown))
        log(f"wrote {args.markdown}")
    return 0


# bench_compile.py and budget_vs_torch.py write their own sections of RESULTS.md between
# these markers; rewriting the file keeps them.
SECTION_START = "<!-- bench_compile.py: start -->"
SECTION_END = "<!-- bench_compile.py: end -->"
GENERATED_SECTIONS = ((SECTION_START, SECTION_END), ("<!-- budget_vs_torch.py: start -->", "<!-- budget_vs_torch.py: end -->"))


def kept_section(markdown: Path) -> str:
    """The other scripts' sections of an existing markdown file, or nothing."""
    text = markdown.read_text() if markdown.exists() else ""
    kept = ""
    for start, end in GENERATED_SECTIONS:
        if start in text:
            kept += "\n" + start + text.split(start, 1)[1].split(end, 1)[0] + end + "\n"
    return kept


def replace_section(markdown: Path, section: str, markers: tuple[str, str] = (SECTION_START, SECTION_END)) -> None:
    """Replace the section between `markers` in `markdown` (or append it)."""
    start, end = markers
    text = markdown.read_text() if markdown.exists() else ""
    if start in text:
        before, rest = text.split(start, 1)
        text = before + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    markdown.write_text(text)


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path



def stack_of(call: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The whole stack's forward from one layer's `call(x, params)`."""
    def forward(x: torch.Tensor, layers: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        for p in layers:
            x = call(x, p)
        return x

    return forward


def saved_bytes(forward: Callable[..., torch.Tensor], wl: Workload) -> int:
    """Distinct storages autograd saves for backward, less the leaves (inputs, parameters).
    Seen through saved-tensor hooks, so it counts compiled graphs (one autograd node that
    saves through them) but not what eager torch.utils.checkpoint keeps behind its own
    hooks: for eager rows bench_remat's exact count is used instead."""
    leaves = {t.untyped_storage().data_ptr() for t in wl.leaves}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in leaves:
            storages[storage.data_ptr()] = storage.nbytes()
        return t.detach()  # not t: a saved output's grad_fn is the node saving it, a cycle no gc frees

    gc.collect()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(wl.x, wl.layers)
    del out
    return sum(storages.values())


if __name__ == "__main__":
    sys.exit(main())
