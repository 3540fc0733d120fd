#!/usr/bin/env python
"""Per-call overhead of remat on a cache hit: a tiny function, forward + backward.

    python bench/overhead.py                      # 7 rounds x 500 calls, one torch thread
    python bench/overhead.py --profile            # also cProfile 2,000 remat calls
    python bench/overhead.py --json out.json

Variants run in interleaved rounds (the order rotates each round), so load from other
processes hits every variant alike; min and median are per call over the rounds.
overhead = variant - plain, the time remat's own Python adds to one region call. The
"hand-written Function" row does by hand what remat does with policy None (an
autograd.Function keeping the inputs and recomputing in backward): the floor for any
design built on a Python autograd.Function, measured in the same run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

import remat
from remat import policies as P


def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


class HandWritten(torch.autograd.Function):
    """What `remat(f, policy=None)` does, written by hand: keep the inputs, recompute
    tanh(x @ w) in backward. The floor for any design built on a Python autograd.Function.
    Written with `ctx` in `forward`, as most hand-written Functions are: with a separate
    `setup_context`, `Function.apply` binds its arguments with `inspect.signature` on every
    call (torch 2.13), about 30 µs more per call here."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return torch.tanh(x @ w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        pre = (1 - torch.tanh(x @ w) ** 2) * grad
        return pre @ w.t(), x.t() @ pre


def variants(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], None]]:
    """One forward+backward step per variant, each warmed up (remat has traced)."""
    remat_none = remat.remat(f, policy=None, name="f_none")
    remat_dots = remat.remat(f, policy=P.dots_saveable, name="f_dots")
    steps = {
        "plain": lambda: f(x, w).sum().backward(),
        "remat None": lambda: remat_none(x, w).sum().backward(),
        "remat dots": lambda: remat_dots(x, w).sum().backward(),
        "checkpoint": lambda: checkpoint(f, x, w, use_reentrant=False).sum().backward(),
        "hand-written Function": lambda: HandWritten.apply(x, w).sum().backward(),
    }
    for step in steps.values():
        for _ in range(20):
            step()
    return steps


def per_call_us(step: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - start) / calls * 1e6


def measure(steps: dict[str, Callable[[], None]], rounds: int, calls: int) -> dict[str, dict[str, float]]:
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(per_call_us(steps[name], calls))
    return {name: {"min_us": min(t), "median_us": statistics.median(t)} for name, t in times.items()}


def profile(step: Callable[[], None], calls: int, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    out = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(top)
    return out.getvalue()


def measure_tiny(rounds: int, calls: int) -> dict[str, dict[str, float]]:
    """Every variant on 4x4 float32 inputs, and remat's overhead over plain (min, median)."""
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    results = measure(variants(x, w), rounds, calls)
    for policy in ("remat None", "remat dots", "hand-written Function"):
        results[f"overhead ({policy})"] = {k: results[policy][k] - results["plain"][k] for k in ("min_us", "median_us")}
    return results


def _sequential() -> torch.nn.Sequential:
    """13 modules: seven small Linears with tanh between them."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(7):
        layers += [torch.nn.Linear(8, 8)] + ([torch.nn.Tanh()] if i < 6 else [])
    return torch.nn.Sequential(*layers)


def _sequential_as_function(x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
    """The same computation as `_sequential()`, its parameters passed in."""
    for i in range(7):
        x = torch.nn.functional.linear(x, weights[2 * i], weights[2 * i + 1])
        if i < 6:
            x = torch.tanh(x)
    return x


def measure_module(rounds: int, calls: int) -> dict[str, dict[str, float]]:
    """A module region against a function region over the same computation: what remat
    adds for reading a module (its parameters, buffers, settings and hooks) on each call."""
    model = _sequential()
    x = torch.randn(2, 8, requires_grad=True)
    weights = list(model.parameters())
    module_region = remat.remat(model, policy=None)
    function_region = remat.remat(_sequential_as_function, policy=None)
    steps = {
        "plain": lambda: model(x).sum().backward(),
        "remat(module)": lambda: module_region(x).sum().backward(),
        "remat(function)": lambda: function_region(x, *weights).sum().backward(),
        "checkpoint": lambda: checkpoint(model, x, use_reentrant=False).sum().backward(),
    }
    for step in steps.values():
        for _ in range(20):
            step()
    results = measure(steps, rounds, calls)
    for name in ("remat(module)", "remat(function)"):
        results[f"overhead ({name})"] = {k: results[name][k] - results["plain"][k] for k in ("min_us", "median_us")}
    results["module - function"] = {
        k: results["remat(module)"][k] - results["remat(function)"][k] for k in ("min_us", "median_us")
    }
    return results


LAYER = {"seq": 16, "hidden": 64, "heads": 4, "batch": 1}


def measure_layer(rounds: int, calls: int) -> dict[str, dict[str, float]]:
    """The same on a real layer, small enough that remat's own cost shows: a transformers
    LlamaDecoderLayer (`LAYER`), forward + backward. `everything_saveable` recomputes
    nothing, so remat - plain is all remat's own: the key (arguments, the module's
    parameters and settings), and the layer's backward run as one traced graph from Python
    where plain autograd runs C++ nodes."""
    from trace_time import _layer_and_call

    torch.manual_seed(0)
    new_layer, call = _layer_and_call(**LAYER)
    layer = new_layer()
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
    everything = remat.remat(layer, policy=P.everything_saveable)
    dots = remat.remat(layer, policy=P.dots_saveable)
    stacked = new_layer()  # the same layer under checkpoint_layers, which wraps its bound forward
    stacked.load_state_dict(layer.state_dict())
    remat.checkpoint_layers([stacked], P.everything_saveable)
    steps = {
        "plain": lambda: first(call(layer)).sum().backward(),
        "remat everything_saveable": lambda: first(call(everything)).sum().backward(),
        "checkpoint_layers everything_saveable": lambda: first(call(stacked)).sum().backward(),
        "remat dots_saveable": lambda: first(call(dots)).sum().backward(),
        "checkpoint": lambda: first(checkpoint(call, layer, use_reentrant=False)).sum().backward(),
    }
    for step in steps.values():
        for _ in range(5):
            step()
    results = measure(steps, rounds, calls)
    for name in ("remat everything_saveable", "checkpoint_layers everything_saveable"):
        results[f"overhead ({name})"] = {k: results[name][k] - results["plain"][k] for k in ("min_us", "median_us")}
    return results


def render_table(results: dict[str, dict[str, float]], title: str = "`tanh(x @ w)`, 4x4, forward + backward") -> list[str]:
    """Markdown rows: µs per forward+backward call, and the overhead rows."""
    lines = [f"| {title} | min µs | median µs |", "|---|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name}{' - plain' if name.startswith('overhead') else ''} | {r['min_us']:.1f} | {r['median_us']:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--profile", action="store_true", help="cProfile 2,000 calls of remat (policy None)")
    parser.add_argument("--layer", action="store_true", help=f"also a transformers LlamaDecoderLayer {LAYER}")
    parser.add_argument("--module", action="store_true", help="also a 13-module nn.Sequential, as a module and as a function")
    parser.add_argument("--profile-module", action="store_true", help="cProfile 2,000 calls of the module region")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = measure_tiny(args.rounds, args.calls)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds x {args.calls} calls, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'variant':<34} {'min µs':>8} {'median µs':>10}")
    if args.module:
        results.update({f"module: {name}": r for name, r in measure_module(args.rounds, args.calls).items()})
    if args.layer:
        results.update({f"layer: {name}": r for name, r in measure_layer(args.rounds, max(args.calls // 10, 1)).items()})
    for name, r in results.items():
        print(f"{name:<34} {r['min_us']:8.1f} {r['median_us']:10.1f}")
    if args.profile:
        x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
        print(profile(variants(x, w)["remat None"], 2000, top=15))
    if args.profile_module:
        model, x = _sequential(), torch.randn(2, 8, requires_grad=True)
        region = remat.remat(model, policy=None)
        print(profile(lambda: region(x).sum().backward(), 2000, top=25))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"torch": torch.__version__, "threads": args.threads, "rounds": args.rounds,
                       "calls": args.calls, "loadavg": os.getloadavg()[0], "results": results}, out, indent=2)


if __name__ == "__main__":
    main()
