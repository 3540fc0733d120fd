"""remat under torch.compile and with varying sequence lengths, against torch's own
checkpointing, measured in one run.

Rows (the blocks are bench_remat.py's GPT block with SDPA attention):
  compile     eager vs torch.compile(fullgraph=True, inductor) for no checkpointing,
              torch.utils.checkpoint, its selective variant keeping matmuls, and remat
              nothing_saveable / dots_saveable: step time (interleaved rounds) and bytes kept
              for backward.
  lengths     a training loop over a list of sequence lengths: total time, remat traces and
              dynamo compiles, eager and compiled.
  overhead    per-call cost of a cache hit on a tiny function, on a 13-module Sequential as a
              module region and as a function region, and on a Llama layer (bench/overhead.py).
  trace       first-call time of a transformers LlamaDecoderLayer and its phases
              (bench/trace_time.py).
  budget      memory_budget(f) against torch.compile's activation_memory_budget (runs
              bench/budget_vs_torch.py's measurement and writes its section too).

    python bench/bench_compile.py --threads 1 --markdown bench/RESULTS.md

writes bench/results-compile-<device>.json and replaces the section of RESULTS.md between
its markers (bench_remat.py keeps that section when it rewrites the file).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch._functorch.config
import torch._inductor.config
from torch._dynamo.utils import counters

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_remat as B  # noqa: E402
import budget_vs_torch as BT  # noqa: E402
import overhead as O  # noqa: E402
import trace_time as T  # noqa: E402

import remat  # noqa: E402
from remat import policies as P  # noqa: E402

SECTION_START, SECTION_END = B.SECTION_START, B.SECTION_END
replace_section = B.replace_section

COMPILE_SIZE = B.Size(4, 256, 128, 4, "float32", 9, 2, 0, "bench_remat's cpu size")
LENGTHS_SIZE = B.Size(2, 128, 0, 2, "float32", 0, 0, 0, "variable-length loop")


def _variants(block: Callable[..., torch.Tensor], device: torch.device) -> dict[str, Callable[..., torch.Tensor]]:
    """The variants of bench_remat that have a compiled counterpart (torch_remat excluded)."""
    names = ("none", "tuc", "tuc_sac_dots", "remat_nothing_saveable", "remat_dots_saveable")
    return {v.name: v.call for v in B.build_variants(block, with_torch_remat=False, device=device) if v.name in names}


def _step_ms(forward: Callable[..., torch.Tensor], wl: B.Workload, clock: str) -> float:
    now = time.process_time if clock == "cpu" else time.perf_counter
    gc.collect()
    start = now()
    out = forward(wl.x, wl.layers)
    torch.autograd.grad(out, wl.leaves, grad_outputs=wl.cotangent)
    return (now() - start) * 1e3


def measure_compile(device: torch.device, clock: str, repeats: int) -> dict[str, Any]:
    wl = B.build_workload("gpt_sdpa", COMPILE_SIZE, device, seed=0)
    reference = B.step(wl.block, wl)
    rows: dict[str, dict[str, Any]] = {}
    runs: dict[str, Callable[..., torch.Tensor]] = {}
    for name, call in _variants(wl.block, wl.x.device).items():
        for compiled in (False, True):
            key = f"{name} ({'compiled' if compiled else 'eager'})"
            forward = B.stack_of(call)
            if compiled:
                forward = torch.compile(forward, fullgraph=True, backend="inductor")
            start = time.perf_counter()
            grads = torch.autograd.grad(forward(wl.x, wl.layers), wl.leaves, grad_outputs=wl.cotangent)
            first_ms = (time.perf_counter() - start) * 1e3
            worst = max((g - r).abs().max().item() / (r.abs().max().item() or 1.0) for g, r in zip(grads, reference))
            del grads
            kept = B.saved_bytes(forward, wl) if compiled else B.kept_bytes(call, wl, device)["kept_bytes"]
            rows[key] = {"variant": name, "compiled": compiled, "kept_bytes": kept, "first_call_ms": first_ms,
                         "max_rel_grad_err": worst, "step_ms": []}
            runs[key] = forward
            B.log(f"compile: {key}: first call {first_ms:.0f} ms, kept {kept / 2**20:.2f} MiB")
    keys = list(runs)
    for r in range(repeats + 1):  # round 0 warms up
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:
            ms = _step_ms(runs[key], wl, clock)
            if r:
                rows[key]["step_ms"].append(ms)
    for row in rows.values():
        row["median_ms"] = statistics.median(row["step_ms"])
    return {"size": COMPILE_SIZE.__dict__, "clock": clock, "rows": rows}


def measure_lengths(device: torch.device, lengths: list[int]) -> dict[str, Any]:
    """One pass of a training loop over `lengths` (a batch per length); every variant sees
    the same batches. Counts remat traces and dynamo's compiled graphs."""
    size = LENGTHS_SIZE
    base = B.build_workload("gpt_sdpa", B.Size(size.layers, size.d_model, max(lengths), size.batch, "float32", 0, 0, 0, ""), device, 0)
    batches = [base.x[:, :n].detach().clone().requires_grad_() for n in lengths]
    rows: dict[str, Any] = {}
    for name, call in _variants(base.block, base.x.device).items():
        if name == "none":
            continue
        for compiled in (False, True):
            torch._dynamo.reset()
            counters.clear()
            remat.clear_cache()
            forward = B.stack_of(call)
            if compiled:
                forward = torch.compile(forward, fullgraph=True, backend="inductor")
            wrapped = getattr(call, "cache_info", None)
            total = _loop(forward, batches, base.layers)
            key = f"{name} ({'compiled' if compiled else 'eager'})"
            rows[key] = {
                "variant": name, "compiled": compiled, "total_s": total,
                "remat_traces": wrapped()["traces"] if wrapped and not compiled else None,
                "remat_specialized": wrapped()["specialized"] if wrapped and not compiled else None,
                "dynamo_graphs": int(counters["stats"]["unique_graphs"]) if compiled else None,
            }
            B.log(f"lengths: {key}: {total:.1f} s {rows[key]}")
    torch._dynamo.reset()
    counters.clear()
    dynamic = remat.remat(base.block, policy=P.dots_saveable, dynamic=True)
    rows["dynamic"] = {"variant": "remat_dots_saveable", "total_s": _loop(B.stack_of(dynamic), batches, base.layers),
                       "dynamo_graphs": int(counters["stats"]["unique_graphs"])}
    B.log(f"lengths: remat dots_saveable dynamic=True (eager): {rows['dynamic']}")
    return {"lengths": lengths, "layers": size.layers, "d_model": size.d_model, "batch": size.batch, "rows": rows}


def _loop(forward: Callable[..., torch.Tensor], batches: list[torch.Tensor], layers: list[dict[str, torch.Tensor]]) -> float:
    """Seconds for one training pass over `batches`, gradients of inputs and parameters."""
    gc.collect()
    start = time.perf_counter()
    for x in batches:
        out = forward(x, layers)
        torch.autograd.grad(out.pow(2).mean(), [x, *[t for p in layers for t in p.values()]])
    return time.perf_counter() - start


def _eager_and_compiled(rows: dict[str, dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(label, eager row, compiled row) per variant, in measuring order."""
    for name in dict.fromkeys(row["variant"] for row in rows.values()):
        yield B.LABELS[name], rows[f"{name} (eager)"], rows[f"{name} (compiled)"]


def render(result: dict[str, Any]) -> str:
    c = result["compile"]
    size = c["size"]
    lines = [
        SECTION_START,
        "## torch.compile, variable sequence lengths, per-call overhead, first call",
        "",
        f"Generated by `bench/bench_compile.py` ({result['elapsed_s']:.0f} s) on {result['machine']}, torch "
        f"{result['torch']}, remat at {result['git']}, torch threads {result['threads']}; load average at start "
        f"{result['load'][0]:.1f}, at end {result['load'][1]:.1f}.",
        "",
        f"**Compiled vs eager.** `gpt_sdpa`, {size['layers']} layers, d_model {size['d_model']}, seq {size['seq']}, "
        f"batch {size['batch']}, float32; compiled = `torch.compile(stack, fullgraph=True, backend=\"inductor\")`; "
        f"median of {len(next(iter(c['rows'].values()))['step_ms'])} interleaved rounds, {c['clock']} clock. "
        "Kept bytes: eager rows count bench_remat's exact way (storages the forward made that are still alive); "
        "compiled rows count the storages the compiled graph saves for backward (saved-tensor hooks), leaves excluded.",
        "",
        "| variant | eager ms | compiled ms | compiled × eager | eager kept MiB | compiled kept MiB | grads max rel err (compiled) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, eager, compiled in _eager_and_compiled(c["rows"]):
        lines.append(
            f"| {label} | {eager['median_ms']:.1f} | {compiled['median_ms']:.1f} | "
            f"{compiled['median_ms'] / eager['median_ms']:.2f} | {eager['kept_bytes'] / 2**20:.2f} | "
            f"{compiled['kept_bytes'] / 2**20:.2f} | {compiled['max_rel_grad_err']:.0e} |"
        )
    v = result["lengths"]
    lines += [
        "",
        f"**Variable sequence lengths.** One pass over {len(v['lengths'])} batches with lengths "
        f"{min(v['lengths'])}-{max(v['lengths'])} ({len(set(v['lengths']))} distinct), gpt_sdpa {v['layers']} layers, "
        f"d_model {v['d_model']}, batch {v['batch']}, wall clock, compilation included (inductor's caches "
        "off, so no variant reuses another's); traces: remat's traces of the block (eager; the second length's is "
        "the template with the length symbolic) and, in brackets, plans specialized from that template without "
        "tracing; dynamo graphs compiled (compiled).",
        "",
        "| variant | eager total s | eager remat traces | compiled total s | compiled graphs |",
        "|---|---:|---:|---:|---:|",
    ]
    dynamic = v["rows"]["dynamic"]
    for label, eager, compiled in _eager_and_compiled({k: row for k, row in v["rows"].items() if k != "dynamic"}):
        traces = "" if eager["remat_traces"] is None else str(eager["remat_traces"])
        if eager.get("remat_specialized") is not None:
            traces += f" (+{eager['remat_specialized']} specialized)"
        lines.append(f"| {label} | {eager['total_s']:.2f} | {traces} | {compiled['total_s']:.2f} | {compiled['dynamo_graphs']} |")
    lines.append(f"| remat dots_saveable, `dynamic=True` (eager model) | {dynamic['total_s']:.2f} | {dynamic['dynamo_graphs']} graphs |  |  |")
    lines += ["", "**Per-call overhead of a cache hit** (bench/overhead.py's measurement, same run):", ""]
    lines += O.render_table(result["overhead"])
    tiny = result["overhead"]
    function_ratio = tiny["overhead (remat None)"]["min_us"] / tiny["overhead (hand-written Function)"]["min_us"]
    lines += ["", f"A function region's overhead is {function_ratio:.2f}x a hand-written autograd.Function's (min; goal at most 1.3x)."]
    if "overhead_module" in result:
        module = result["overhead_module"]
        gap = module["module - function"]
        lines += ["", "A module region against a function region over the same computation: a 13-module `nn.Sequential` "
                  "(seven Linear(8, 8), tanh between), its 14 parameters passed as arguments to the function "
                  f"(module - function: min {gap['min_us']:.1f} µs, median {gap['median_us']:.1f} µs; goal: within 15 µs):", ""]
        lines += O.render_table(module, title="13-module Sequential, forward + backward")
    if "overhead_layer" in result:
        layer = ", ".join(f"{k} {v}" for k, v in O.LAYER.items())
        lines += ["", f"The same on a transformers `LlamaDecoderLayer` ({layer}; `everything_saveable` recomputes "
                  "nothing, so its row minus plain is remat's own cost per call):", ""]
        lines += O.render_table(result["overhead_layer"], title="LlamaDecoderLayer, forward + backward")
    lines += [
        "",
        "**First call (trace time)** of a transformers `LlamaDecoderLayer` (hidden 256, 8 heads, seq 128, batch 2, "
        "`dots_saveable`, one thread; bench/trace_time.py's measurement, same run, "
        f"{result['trace']['repeat']} repetitions): a fresh process's first layer, a new layer after another was "
        "traced and dropped, and a new layer while one like it is alive (its modules hold what that layer's trace "
        "read, so it takes that plan without tracing). Phases: "
        "stage 1 (`capture`), the joint forward+backward trace (`differentiate`), `partition`, and the rest "
        "(first run, layout check, splitting). \"second call\" is the next call of the same layer.",
        "",
    ]
    lines += T.render_table(result["trace"])
    deep = T.render_deep(result["trace"])
    if deep:
        lines += [
            "",
            "**First training step of a deep model** (bench/trace_time.py, same run): a transformers `LlamaModel` of 32 "
            "such layers under `checkpoint_layers(model.layers, dots_saveable)`, one step (forward and backward) at each "
            "sequence length, batch 2, 3 fresh models. Per length: what the first step there costs beyond a planned step "
            "(the median of 5: against the least of them, the spread of step times would count as planning), "
            "what the first layer's first call there costs beyond a planned call, and their ratio (the goal: "
            "at most 2); this process's CPU time, so other processes' load is not counted; each length first runs one step "
            "without remat, so what any first step at new sizes pays (the allocator, kernels) is not counted as planning. The last column is the ratio with like layers turned off, every layer tracing its stage-1 graph "
            "(one model).",
            "",
        ]
        lines += deep
    lines += ["", SECTION_END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clock", choices=B.CLOCKS, default="cpu")
    parser.add_argument("--repeats", type=int, default=COMPILE_SIZE.repeats)
    parser.add_argument("--lengths", type=int, default=24, help="batches in the variable-length loop")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # Each variant pays for its own compilation: no reuse of graphs another variant (or an
    # earlier run) compiled, so the loop's total times compare.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    device = torch.device(args.device)
    started, load = time.perf_counter(), [os.getloadavg()[0]]
    draw = random.Random(0)
    lengths = [draw.randrange(32, 129) for _ in range(args.lengths)]
    result: dict[str, Any] = {
        "machine": B.machine_info(device)["cpu_model"], "torch": torch.__version__, "git": B.git_state(),
        "threads": torch.get_num_threads(),
        "compile": measure_compile(device, args.clock, args.repeats),
        "lengths": measure_lengths(device, lengths),
        "overhead": O.measure_tiny(rounds=7, calls=500),
        "overhead_module": O.measure_module(rounds=7, calls=300),
        "overhead_layer": O.measure_layer(rounds=15, calls=50),
        "trace": T.measure(repeat=5),
    }
    budget = BT.run(device, BT.SIZE, BT.FRACTIONS, by="`bench/bench_compile.py`, in the same run as the overhead and first-call rows")
    load.append(os.getloadavg()[0])
    result["load"], result["elapsed_s"] = load, time.perf_counter() - started
    out = args.out or HERE / f"results-compile-{device.type}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    budget_out = HERE / f"results-budget-{device.type}.json"
    budget_out.write_text(json.dumps(budget, indent=1) + "\n")
    B.log(f"wrote {out} and {budget_out}")
    if args.markdown:
        replace_section(args.markdown, render(result))
        B.replace_section(args.markdown, BT.render(budget), (BT.SECTION_START, BT.SECTION_END))
        B.log(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
