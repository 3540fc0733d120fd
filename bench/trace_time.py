#!/usr/bin/env python
"""First-call (trace) time of a transformers LlamaDecoderLayer under remat, and where it goes.

    python bench/trace_time.py                 # 5 fresh processes + 5 new layers in one process
    python bench/trace_time.py --json out.json

The layer is the one issue 12 names: hidden 256, 8 heads, seq 128, batch 2, random init,
`dots_saveable`, sdpa attention, one torch thread. Three figures:
- first call in a fresh process (remat and transformers imported, the layer built, nothing
  traced yet): what a user's first step pays for its first layer;
- a new layer's first call in a process that traced another layer, since dropped: process-
  wide warm-up and torch's fake-tensor cache are shared, the plan is not;
- a new layer's first call while another layer like it is alive (a model's further layers):
  its modules hold what the other's trace read, so it takes that plan without tracing.
Then new sequence lengths of a layer traced at 128: the second length traces the template
(the length symbolic), later ones are specialized from it without tracing. Then a whole
model: the first training step of a 32-layer LlamaModel (same layer sizes) under
`checkpoint_layers`, against its first layer's first call in that step, at the first
sequence length and at three new ones; and the same with like layers turned off (each
layer traces), for comparison.
The phases are timed by wrapping remat's own stage functions (bench-only instrumentation):
stage 1 (`capture`: the function traced on fake tensors, then its passes), the joint
forward+backward trace (`differentiate`), the partition, and the rest (the first run with
its layout check, splitting, caching). Every figure is one first call; the table gives
min and median over the repetitions.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

PHASES = ("capture", "differentiate", "partition")
_TIMES: dict[str, float] = {}  # seconds per phase since the last clear


def _instrument() -> None:
    """Accumulate wall time per phase in _TIMES (remat's own functions, wrapped where
    they are called: stage 1 by `_plans/templates`, the others by `_api/decorator`), once per process."""
    import remat._api.decorator
    import remat._plans.templates

    callers = {"capture": remat._plans.templates, "differentiate": remat._api.decorator, "partition": remat._api.decorator}
    if getattr(remat._plans.templates.capture, "_bench_timed", False):
        return

    for name in PHASES:
        module = callers[name]
        original = getattr(module, name)

        def timed(*args: Any, _original: Callable[..., Any] = original, _name: str = name, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                _TIMES[_name] = _TIMES.get(_name, 0.0) + time.perf_counter() - start

        wrapped = functools.wraps(original)(timed)
        wrapped._bench_timed = True  # type: ignore[attr-defined]
        setattr(module, name, wrapped)


def _layer_and_call(seq: int = 128, hidden: int = 256, heads: int = 8, batch: int = 2) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """A new transformers LlamaDecoderLayer (random init, sdpa) and a call of it on fixed inputs."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 43 // 16, num_attention_heads=heads, num_key_value_heads=heads,
        num_hidden_layers=1, vocab_size=100, attn_implementation="sdpa",
    )
    x = torch.randn(batch, seq, hidden, requires_grad=True)
    positions = torch.arange(seq)[None].expand(batch, -1)
    cos, sin = LlamaRotaryEmbedding(config)(x, positions)

    def new_layer() -> Any:
        return LlamaDecoderLayer(config, 0)

    def call(layer: Any) -> Any:
        return layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=positions)

    return new_layer, call


def one_first_call(kind: str) -> dict[str, float]:
    """Seconds of one first call (and its phases): "fresh", "warm" (after another layer's
    first call, that layer dropped) or "shared" (that layer kept alive)."""
    import torch

    import remat
    from remat import policies as P

    torch.set_num_threads(1)
    torch.manual_seed(0)
    new_layer, call = _layer_and_call()
    other = remat.remat(new_layer(), policy=P.dots_saveable) if kind != "fresh" else None
    if other is not None:
        call(other)
    if kind == "warm":
        del other
        gc.collect()  # its plan goes with it (plans are shared while a region holds them)
    _instrument()
    _TIMES.clear()
    region = remat.remat(new_layer(), policy=P.dots_saveable)
    start = time.perf_counter()
    call(region)
    total = time.perf_counter() - start
    info = region.cache_info()
    assert (info["traces"], info["like"]) == ((0, 1) if kind == "shared" else (1, 0)), info
    times = {p: _TIMES.get(p, 0.0) for p in PHASES}
    start = time.perf_counter()
    call(region)
    times["second call"] = time.perf_counter() - start
    times["total"] = total
    times["rest"] = total - sum(times[p] for p in PHASES)
    return times


def new_lengths(repeat: int) -> dict[str, list[float]]:
    """Seconds of the first call at a new sequence length of a layer traced at 128: the
    second length (remat traces the template, the length symbolic: made to happen there,
    not after per-length traces have cost as much, as by default) and each later one
    (specialized from it, nothing traced); and a call at a length already seen. Run last:
    it changes remat's template price for the process."""
    import torch

    import remat
    from remat._plans import templates as _specializing
    from remat import policies as P

    torch.set_num_threads(1)
    torch.manual_seed(0)
    _specializing.TEMPLATE_COST_RATIO = 0.0  # the template at the second length (by default: once traces cost as much)
    new_layer, _ = _layer_and_call()
    times: dict[str, list[float]] = {"template": [], "specialized": [], "hit": []}
    for r in range(repeat):
        remat.clear_cache()
        region = remat.remat(new_layer(), policy=P.dots_saveable)
        _layer_and_call(128)[1](region)
        for seq, kind in ((120, "template"), (100 + r, "specialized"), (110 + r, "specialized"), (110 + r, "hit")):
            call = _layer_and_call(seq)[1]
            start = time.perf_counter()
            call(region)
            times[kind].append(time.perf_counter() - start)
        info = region.cache_info()
        assert (info["traces"], info["specialized"], info["hits"]) == (2, 3, 1), info
    return times


# steps at a length once planned, whose median a first step is compared with: one first step
# against the least of five would count the spread of step times (tens of ms on a 600 ms
# step of this machine) as planning
PLANNED_STEPS = 5


def deep_model(layers: int = 32, repeat: int = 3, like_layers: bool = True) -> dict[str, dict[str, float]]:
    """Per sequence length (128, then three new ones): seconds of a model's first training
    step there beyond a step once planned (median of PLANNED_STEPS), and of its first layer's
    first call there beyond a planned call (the median likewise); their ratio is what a step's planning costs in
    first-layer traces. Timed on this process's CPU clock (one torch thread), which other
    processes' load does not count; each length is first run once without remat, so that
    what any first step at new sizes pays (the allocator's first blocks of those sizes,
    kernels' first calls: 0 to 190 ms of CPU in trial runs of the model without remat) is
    not counted as remat's planning. `like_layers=False`: each layer traces (bench-only switch). The template is made
    at the second length, as in `new_lengths` (which leaves the process so)."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaModel

    import remat
    import remat._api.decorator as decorator
    from remat._plans import templates as _specializing
    from remat import policies as P

    torch.set_num_threads(1)
    _specializing.TEMPLATE_COST_RATIO = 0.0
    like_plan = decorator.like_plan
    if not like_layers:
        decorator.like_plan = lambda *args: None
    config = LlamaConfig(
        hidden_size=256, intermediate_size=256 * 43 // 16, num_attention_heads=8, num_key_value_heads=8,
        num_hidden_layers=layers, vocab_size=100, use_cache=False, attn_implementation="sdpa",
    )
    extra: dict[int, list[tuple[float, float]]] = {}
    try:
        for r in range(repeat):
            remat.clear_cache()
            torch.manual_seed(r)
            model = LlamaModel(config)
            remat.checkpoint_layers(model.layers, P.dots_saveable)
            first = model.layers[0].forward
            calls: list[float] = []

            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.process_time()
                try:
                    return first(*args, **kwargs)
                finally:
                    calls.append(time.process_time() - start)

            model.layers[0].forward = timed

            def step(model: Any, seq: int) -> float:
                ids = torch.randint(0, 100, (2, seq))
                start = time.process_time()
                model(ids).last_hidden_state.sum().backward()
                return time.process_time() - start

            for seq in (128, 120, 100 + r, 110 + r):
                with remat.without_remat():  # the allocator and the kernels meet the new sizes here
                    step(model, seq)
                calls.pop()
                planning = step(model, seq)
                planned = statistics.median(step(model, seq) for _ in range(PLANNED_STEPS))
                extra.setdefault(seq if seq in (128, 120) else seq - r, []).append(
                    (planning - planned, calls[-PLANNED_STEPS - 1] - statistics.median(calls[-PLANNED_STEPS:]))
                )
            del model
            gc.collect()
    finally:
        decorator.like_plan = like_plan
    return {
        str(seq): {
            "step_extra_ms": 1e3 * statistics.median(s for s, _ in runs),
            "layer_extra_ms": 1e3 * statistics.median(f for _, f in runs),
            "ratio_median": statistics.median(s / f for s, f in runs),
            "ratio_max": max(s / f for s, f in runs),
        }
        for seq, runs in extra.items()
    }


def summary(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    keys = ["total", *PHASES, "rest", "second call"]
    ms = {k: [1e3 * r[k] for r in runs] for k in keys}
    return {k: {"min_ms": min(v), "median_ms": statistics.median(v)} for k, v in ms.items()}


KINDS = {"fresh": "fresh process", "warm": "new layer, warm process", "shared": "new layer like a live one (takes its plan, no trace)"}


def measure(repeat: int) -> dict[str, Any]:
    """Every kind of first call, `repeat` times each ("fresh" in child processes)."""
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    for _ in range(repeat):
        out = subprocess.run([sys.executable, __file__, "--child", "fresh"], capture_output=True, text=True, check=True)
        runs["fresh"].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for kind in ("warm", "shared"):
        runs[kind] = [one_first_call(kind) for _ in range(repeat)]
    lengths = {
        kind: {"min_ms": 1e3 * min(v), "median_ms": 1e3 * statistics.median(v)} for kind, v in new_lengths(repeat).items()
    }
    return {
        "repeat": repeat, "load_average": os.getloadavg()[0], **{KINDS[k]: summary(v) for k, v in runs.items()},
        "new lengths": lengths, "deep model": deep_model(), "deep model, like layers off": deep_model(repeat=1, like_layers=False),
    }


def render_table(result: dict[str, Any]) -> list[str]:
    """Markdown rows: ms per first call and its phases, min (median)."""
    columns = ["total", *PHASES, "rest", "second call"]
    lines = ["| first call of a LlamaDecoderLayer, ms: min (median) | " + " | ".join(columns) + " |"]
    lines.append("|---|" + "---:|" * len(columns))
    for name in KINDS.values():
        row = result[name]
        lines.append(f"| {name} | " + " | ".join(f"{row[k]['min_ms']:.0f} ({row[k]['median_ms']:.0f})" for k in columns) + " |")
    lengths = result.get("new lengths")
    if lengths:
        names = {
            "template": "new length after 128: the second (traces the template, length symbolic)",
            "specialized": "new length after that (specialized from the template, no trace)",
            "hit": "a length seen before (for comparison)",
        }
        for kind, name in names.items():
            row = lengths[kind]
            lines.append(f"| {name} | {row['min_ms']:.0f} ({row['median_ms']:.0f}) |" + " |" * (len(columns) - 1))
    return lines


DEEP_LENGTHS = {"128": "first length, 128", "120": "second length, 120", "100": "third length", "110": "fourth length"}


def render_deep(result: dict[str, Any]) -> list[str]:
    """Markdown rows: a 32-layer model's first step at each length against its first layer's first call."""
    on, off = result.get("deep model"), result.get("deep model, like layers off")
    if not on:
        return []
    lines = [
        "| 32-layer LlamaModel, first step at a length | step beyond a planned step, ms | first layer's first call beyond a planned call, ms | ratio, median (max) | ratio, each layer traced |",
        "|---|---:|---:|---:|---:|",
    ]
    for seq, name in DEEP_LENGTHS.items():
        row, base = on[seq], (off or {}).get(seq)
        lines.append(
            f"| {name} | {row['step_extra_ms']:.0f} | {row['layer_extra_ms']:.0f} | {row['ratio_median']:.2f} ({row['ratio_max']:.2f}) | "
            + (f"{base['ratio_median']:.2f} |" if base else " |")
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--child", choices=["fresh"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_first_call("fresh")))
        return
    import torch

    result = {"torch": torch.__version__, **measure(args.repeat)}
    print(f"torch {result['torch']}, 1 thread, {args.repeat} repetitions, load average {result['load_average']:.2f}")
    print("\n".join(render_table(result) + [""] + render_deep(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
