#!/usr/bin/env python
"""remat's `memory_budget` against torch.compile's `activation_memory_budget`, in one run.

Both answer the same question for a GPT block (bench_remat.py's `gpt_sdpa`, one block per
layer): keep at most a fraction of the activations, recompute the rest, and recompute as
little as possible. remat's fraction is of what keeping every intermediate would keep;
torch's is of what its default min-cut partition would keep. The two fractions therefore
mean different byte counts, so the comparison is the frontier: for every torch point, the
least recompute remat reaches while keeping no more bytes.

Counted the same way on both sides:
  kept bytes       distinct storages saved for backward through saved-tensor hooks, leaves
                   (input and parameters) excluded.
  recomputed FLOPs matmul and attention FLOPs of a forward+backward step (torch's formula
                   table, bench_remat's counter) less those of the same step without any
                   checkpointing.

torch's side is `torch.compile(block, fullgraph=True)` with AOTAutograd and the min-cut
partitioner inductor uses (`compiler="inductor"`), its forward and backward graphs run as
FX graphs so that the FLOP counter sees every op; the bytes inductor itself keeps are
measured too, to show the partition is the one inductor would compile.

    python bench/budget_vs_torch.py --threads 1 --markdown bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_remat as B  # noqa: E402

import remat  # noqa: E402
from remat import policies as P  # noqa: E402

SECTION_START, SECTION_END = B.GENERATED_SECTIONS[1]
SIZE = B.Size(4, 256, 128, 4, "float32", 0, 0, 0, "bench_compile's size")
SMOKE_SIZE = B.Size(2, 128, 32, 2, "float32", 0, 0, 0, "the test's size")
FRACTIONS = (0.0, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)
SMOKE_FRACTIONS = (0.0, 0.5, 1.0)


class _Counting:
    """A compiled function's graphs run under bench_remat's FLOP counter."""

    def __init__(self) -> None:
        self.flops = 0

    def compiler(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        def run(args: list[Any]) -> Any:
            with B._FlopCounter() as counter:
                out = gm(*args)
            self.flops += counter.flops
            return out

        run._boxed_call = True  # type: ignore[attr-defined]
        return run


def _torch_point(wl: B.Workload, fraction: float, baseline_flops: int) -> dict[str, Any]:
    """torch's partition at `fraction`: kept bytes (FX graphs and inductor) and recompute."""
    counting = _Counting()
    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    backend = aot_autograd(fw_compiler=counting.compiler, bw_compiler=counting.compiler, partition_fn=partition)
    with torch._functorch.config.patch(activation_memory_budget=fraction):
        torch._dynamo.reset()
        counted = torch.compile(wl.block, fullgraph=True, backend=backend)
        B.step(counted, wl)  # compiles
        counting.flops = 0
        grads = B.step(counted, wl)
        flops = counting.flops
        kept = B.saved_bytes(B.stack_of(counted), wl)
        torch._dynamo.reset()
        inductor = torch.compile(wl.block, fullgraph=True, backend="inductor")
        B.step(inductor, wl)
        kept_inductor = B.saved_bytes(B.stack_of(inductor), wl)
        torch._dynamo.reset()
    return {"fraction": fraction, "kept_bytes": kept, "inductor_kept_bytes": kept_inductor,
            "recomputed_flops": flops - baseline_flops, "grads": grads}


def _remat_point(wl: B.Workload, fraction: float | int, baseline_flops: int) -> dict[str, Any]:
    """remat's partition at `fraction` (or a number of bytes per region): kept bytes, recompute."""
    region = remat.remat(wl.block, policy=P.memory_budget(fraction))
    grads = B.step(region, wl)
    flops = B.step_flops(region, wl)["flops"]
    return {"fraction": fraction, "kept_bytes": B.saved_bytes(B.stack_of(region), wl),
            "recomputed_flops": flops - baseline_flops, "grads": grads}


def _worst_error(grads: tuple[torch.Tensor, ...], reference: tuple[torch.Tensor, ...]) -> float:
    return max((g - r).abs().max().item() / (r.abs().max().item() or 1.0) for g, r in zip(grads, reference))


def _best_within(points: list[dict[str, Any]], kept: int) -> dict[str, Any] | None:
    """The point recomputing least among those keeping at most `kept` bytes."""
    fitting = [p for p in points if p["kept_bytes"] <= kept]
    return min(fitting, key=lambda p: p["recomputed_flops"]) if fitting else None


def measure(device: torch.device, size: B.Size, fractions: tuple[float, ...]) -> dict[str, Any]:
    wl = B.build_workload("gpt_sdpa", size, device, seed=0)
    reference = B.step(wl.block, wl)
    baseline = B.step_flops(wl.block, wl)["flops"]
    sides: dict[str, list[dict[str, Any]]] = {"remat": [], "torch": []}
    for fraction in fractions:
        for side, point in (("remat", _remat_point), ("torch", _torch_point)):
            p = point(wl, fraction, baseline)
            p["max_rel_grad_err"] = _worst_error(p.pop("grads"), reference)
            sides[side].append(p)
            B.log(f"{side} {fraction}: kept {p['kept_bytes'] / 2**20:.2f} MiB, recomputed {p['recomputed_flops'] / 1e9:.3f} GFLOP")
    kept_plain = B.saved_bytes(B.stack_of(wl.block), wl)
    # remat's budget in bytes counts a region's intermediates (its inputs are kept anyway):
    # torch's kept bytes less what keeping nothing keeps (the later layers' inputs), per layer.
    inputs_only = sides["remat"][0]["kept_bytes"]
    matched = []
    for t in sides["torch"]:
        p = _remat_point(wl, max(0, (t["kept_bytes"] - inputs_only) // size.layers), baseline)
        p["max_rel_grad_err"] = _worst_error(p.pop("grads"), reference)
        matched.append(p)
    comparison = []
    for t in sides["torch"]:
        r = _best_within(sides["remat"] + matched, t["kept_bytes"])
        comparison.append({"torch_fraction": t["fraction"], "torch_kept_bytes": t["kept_bytes"],
                           "torch_recomputed_flops": t["recomputed_flops"],
                           "remat_fraction": r and r["fraction"], "remat_kept_bytes": r and r["kept_bytes"],
                           "remat_recomputed_flops": r and r["recomputed_flops"],
                           "met": r is not None and r["recomputed_flops"] <= t["recomputed_flops"]})
    return {"size": size.__dict__, "baseline_flops": baseline, "plain_kept_bytes": kept_plain,
            "remat": sides["remat"], "torch": sides["torch"], "remat_at_torch_bytes": matched, "comparison": comparison}


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.2f}"


def _gflop(n: int | None) -> str:
    return "" if n is None else f"{n / 1e9:.3f}"


def _budget(limit: float | int | None) -> str:
    if limit is None:
        return ""
    return f"{limit / 2**10:.0f} KiB" if isinstance(limit, int) else str(limit)


def render(result: dict[str, Any]) -> str:
    m = result["measure"]
    size = m["size"]
    lines = [
        SECTION_START,
        "## A memory budget against torch.compile's",
        "",
        f"Generated by {result.get('by', '`bench/budget_vs_torch.py`')} ({result['elapsed_s']:.0f} s), torch {result['torch']}, remat at "
        f"{result['git']}, torch threads {result['threads']}. `gpt_sdpa`, {size['layers']} layers, d_model "
        f"{size['d_model']}, seq {size['seq']}, batch {size['batch']}, float32, one region (or one compiled block) per "
        f"layer. remat: `remat(block, policy=memory_budget(f))`; torch: `torch.compile(block, fullgraph=True)` with "
        "`torch._functorch.config.activation_memory_budget = f`, partitioned by the min-cut partitioner inductor "
        "uses. Kept bytes: storages saved for backward (saved-tensor hooks), leaves excluded; no checkpointing keeps "
        f"{_mib(m['plain_kept_bytes'])} MiB. Recomputed: matmul and attention GFLOP of a step less the "
        f"{_gflop(m['baseline_flops'])} GFLOP of a step without checkpointing. The fractions mean different things "
        "(remat: of keeping every intermediate; torch: of its default partition), so compare at equal bytes.",
        "",
        "| f | remat kept MiB | remat recomputed GFLOP | torch kept MiB | torch kept MiB (inductor) | torch recomputed GFLOP | grads max rel err remat / torch |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, t in zip(m["remat"], m["torch"]):
        lines.append(
            f"| {r['fraction']} | {_mib(r['kept_bytes'])} | {_gflop(r['recomputed_flops'])} | {_mib(t['kept_bytes'])} | "
            f"{_mib(t['inductor_kept_bytes'])} | {_gflop(t['recomputed_flops'])} | "
            f"{r['max_rel_grad_err']:.0e} / {t['max_rel_grad_err']:.0e} |"
        )
    lines += [
        "",
        "**At equal kept bytes.** For each torch point, the remat point that keeps no more bytes and recomputes least, "
        "among the fractions above and `memory_budget(bytes)` given torch's kept bytes per layer (less the layer "
        "inputs, which a region keeps anyway). Goal: remat recomputes no more.",
        "",
        "| torch f | torch kept MiB | torch recomputed GFLOP | remat budget | remat kept MiB | remat recomputed GFLOP | remat recomputes no more |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in m["comparison"]:
        lines.append(
            f"| {c['torch_fraction']} | {_mib(c['torch_kept_bytes'])} | {_gflop(c['torch_recomputed_flops'])} | "
            f"{_budget(c['remat_fraction'])} | {_mib(c['remat_kept_bytes'])} | "
            f"{_gflop(c['remat_recomputed_flops'])} | {'yes' if c['met'] else 'no'} |"
        )
    lines += ["", SECTION_END]
    return "\n".join(lines)


def run(device: torch.device, size: B.Size, fractions: tuple[float, ...], by: str | None = None) -> dict[str, Any]:
    """measure() with what the section's header states (torch, code, threads, time; `by`:
    the script that ran it, when not this one)."""
    started = time.perf_counter()
    result: dict[str, Any] = {"torch": torch.__version__, "git": B.git_state(), "threads": torch.get_num_threads(),
                              "measure": measure(device, size, fractions)}
    result["elapsed_s"] = time.perf_counter() - started
    if by is not None:
        result["by"] = by
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--smoke", action="store_true", help="a tiny size and three fractions (the test's run)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    device = torch.device(args.device)
    result = run(device, SMOKE_SIZE if args.smoke else SIZE, SMOKE_FRACTIONS if args.smoke else FRACTIONS)
    out = args.out or HERE / f"results-budget-{device.type}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    B.log(f"wrote {out}")
    if args.markdown:
        B.replace_section(args.markdown, render(result), (SECTION_START, SECTION_END))
        B.log(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
