"""Policy sweep: per-layer remat schedules on a transformer stack, memory against time.

Trains a stack of transformer blocks (an ordinary `nn.Module`, `loss.backward()` and
`torch.optim.SGD`: no torch.func here) under several per-layer schedules:

* no remat, and every layer with `nothing_saveable`, `dots_saveable` or `everything_saveable`;
* `dots_saveable` on the first half of the layers, `nothing_saveable` on the rest;
* every other layer remat'd with `nothing_saveable`, the others plain;
* a names-based policy: the blocks tag values with `checkpoint_name` ("qkv", "attn_out",
  "mlp_hidden") and `save_only_these_names("qkv", "attn_out")` keeps the qkv projection
  and the attention's output, and recomputes the rest (scores and softmax, the MLP).

For each it prints the memory autograd keeps for backward (`remat.saved_tensor_bytes`),
the median step time, and the recompute it causes, counted in one training step against
no remat: the extra matmul FLOPs (`torch.utils.flop_counter.FlopCounterMode`) and the
extra aten ops that compute something (views and copies not counted). `--plot out.png`
draws kept memory against step time (needs matplotlib: `pip install matplotlib`; without
it the example prints a note).

    python examples/policy_sweep.py                     # CPU, about 10 s
    python examples/policy_sweep.py --plot sweep.png
    python examples/policy_sweep.py --device cuda --layers 24 --d-model 1024 --heads 16 \\
        --seq 1024 --batch 8 --steps 10 --plot sweep.png
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from remat import checkpoint_layers, checkpoint_name, saved_tensor_bytes
from remat import policies as P

NO_REMAT = "no remat"  # what checkpoint_layers reads as "leave this layer alone"


class Block(nn.Module):
    """Pre-norm transformer block whose interesting values carry checkpoint names."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = checkpoint_name(self.qkv(self.ln1(x)), "qkv")
        q, k, v = qkv.view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v
        attn = checkpoint_name(attn.transpose(1, 2).reshape(b, t, d), "attn_out")
        x = x + self.proj(attn)
        hidden = checkpoint_name(self.fc1(self.ln2(x)), "mlp_hidden")
        return x + self.fc2(F.gelu(hidden))


class Stack(nn.Module):
    """Embedding, blocks (each given its own policy by `remat.checkpoint_layers`), head."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def set_schedule(self, spec: Any) -> None:
        """A policy, a list, a function of the layer index or {name pattern: policy}."""
        checkpoint_layers(self.blocks, spec)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:  # unchanged by checkpoint_layers
            x = block(x)
        return self.head(x)


def schedules(layers: int) -> dict[str, Any]:
    """Per-layer schedules in each form `remat.policy_schedule` takes."""
    return {
        "no remat": NO_REMAT,
        "all nothing_saveable": P.nothing_saveable,
        "all dots_saveable": P.dots_saveable,
        "all everything_saveable": P.everything_saveable,
        "dots first half, nothing after": lambda i: P.dots_saveable if i < layers // 2 else P.nothing_saveable,
        "every other layer nothing": [P.nothing_saveable if i % 2 else NO_REMAT for i in range(layers)],
        "names: qkv + attn_out": {"*": P.save_only_these_names("qkv", "attn_out")},
    }


aten = torch.ops.aten
NOT_COMPUTE = {aten.detach, aten.clone, aten._unsafe_view, aten.alias, aten.copy_, aten._to_copy,
               aten.lift_fresh, aten.unbind, aten.split, aten.split_with_sizes}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that compute something (not views, not copies) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view and func.overloadpacket not in NOT_COMPUTE:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def measure(model: Stack, schedule: Any, args: argparse.Namespace, label: str) -> dict[str, float]:
    """Kept bytes, median step time, matmul FLOPs and aten ops of one training step."""
    model.set_schedule(schedule)
    gen = torch.Generator().manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def batch() -> torch.Tensor:
        return torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(args.device)

    def loss_of(tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def train_step(tokens: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(tokens)
        loss.backward()
        optimizer.step()
        return loss.item()

    times = []
    for i in range(args.warmup + args.steps):
        tokens = batch()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(tokens)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    tokens = batch()
    flops, ops = FlopCounterMode(display=False), OpCounter()
    with flops, ops:
        loss = loss_of(tokens)
        loss.backward()
    model.zero_grad(set_to_none=True)
    kept = saved_tensor_bytes(loss_of, tokens)
    print(f"  measured {label}", flush=True)
    return {"kept": kept, "ms": statistics.median(times) * 1e3, "flops": flops.get_total_flops(), "ops": ops.calls}


def plot(results: dict[str, dict[str, float]], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"note: matplotlib is not installed, so {path} was not drawn (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        ax.scatter(r["kept"] / 2**20, r["ms"], s=40)
        ax.annotate(name, (r["kept"] / 2**20, r["ms"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("kept for backward (MiB)")
    ax.set_ylabel("median step time (ms)")
    ax.set_title("remat schedules: memory kept for backward vs step time")
    ax.grid(alpha=0.3)
    ax.margins(x=0.2, y=0.1)  # room for the labels
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per schedule")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one traces)")
    parser.add_argument("--plot", metavar="PNG", help="draw kept memory against step time")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Stack(args.vocab, args.d_model, args.heads, args.layers).to(args.device)
    print(f"{args.layers} blocks, d_model {args.d_model}, seq {args.seq}, batch {args.batch}, device {args.device}")
    results = {name: measure(model, schedule, args, name) for name, schedule in schedules(args.layers).items()}

    base = results["no remat"]
    width = max(len(n) for n in results)
    print(f"\n{'schedule':{width}} {'kept for backward':>21} {'step time':>10} "
          f"{'recomputed FLOPs':>17} {'recomputed ops':>15}")
    for name, r in results.items():
        extra = (r["flops"] - base["flops"]) / base["flops"]
        print(f"{name:{width}} {r['kept'] / 2**20:8.2f} MiB ({r['kept'] / base['kept']:6.1%}) {r['ms']:8.1f}ms "
              f"{extra:+16.1%} {r['ops'] - base['ops']:+15d}")
    print(f"(one training step without remat: {base['flops'] / 1e9:.2f} GFLOP in matmuls, {base['ops']} compute ops)")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
