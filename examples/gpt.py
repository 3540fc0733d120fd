"""GPT: train a character-level transformer functionally, with a remat policy per block.

A small GPT (an `nn.Module`) learns the text in `examples/data/harbour.txt`. Its blocks
are called through `remat` with a policy chosen per block, and it is trained the
`torch.func` way: the parameters live in a dict, `torch.func.functional_call` runs the
module with them, `torch.func.grad_and_value` differentiates the loss, and Adam is a few
lines of tensor arithmetic on the dict. `torch.utils.checkpoint` cannot do this (it is
built on saved-tensor hooks, which `torch.func.grad` refuses); `remat` can.

`--policy P --every K` checkpoints blocks K, 2K, ... with the policy P (any
`*_saveable` policy in `remat.policies`) and calls the others plainly. `--compare` trains the same seed under
several schedules and prints the loss curves side by side, the memory each keeps for
backward and the largest difference between the curves: remat changes what is kept,
not what is computed.

    python examples/gpt.py                                     # CPU, about 10 s
    python examples/gpt.py --policy nothing_saveable --every 1
    python examples/gpt.py --compare                           # CPU, about 45 s
    python examples/gpt.py --device cuda --layers 12 --d-model 768 --heads 12 --seq 256 \\
        --batch 32 --steps 2000 --log-every 100 --compare
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from remat import policies as P
from remat import remat, saved_tensor_bytes

DATA = Path(__file__).resolve().parent / "data" / "harbour.txt"
PLAIN = "plain"  # a block called without remat
POLICIES = {name: getattr(P, name) for name in dir(P) if name.endswith("_saveable")}

Params = dict[str, torch.Tensor]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a gelu MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, a stack of blocks, a final norm and a linear head."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.block_fns: list[Callable[[torch.Tensor], torch.Tensor]] = list(self.blocks)

    def set_schedule(self, schedule: list[str]) -> None:
        """schedule[i] names the policy of block i (from remat.policies), or "plain"."""
        self.block_fns = [
            block if name == PLAIN else remat(block, policy=POLICIES[name])
            for block, name in zip(self.blocks, schedule)
        ]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for fn in self.block_fns:
            x = fn(x)
        return self.head(self.ln(x))


def every_kth(policy: str, every: int, layers: int) -> list[str]:
    """`policy` on blocks every, 2*every, ... (counting from 1); the rest plain."""
    return [policy if (i + 1) % every == 0 else PLAIN for i in range(layers)]


def adam(params: Params, grads: Params, state: dict[str, Any], lr: float,
         betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-8) -> Params:
    """One Adam step on a dict of tensors; `state` holds the moments and the step count."""
    b1, b2 = betas
    state["t"] = t = state.get("t", 0) + 1
    m = state.setdefault("m", {k: torch.zeros_like(p) for k, p in params.items()})
    v = state.setdefault("v", {k: torch.zeros_like(p) for k, p in params.items()})
    new = {}
    for k, p in params.items():
        m[k] = b1 * m[k] + (1 - b1) * grads[k]
        v[k] = b2 * v[k] + (1 - b2) * grads[k] ** 2
        step = lr * (m[k] / (1 - b1**t)) / ((v[k] / (1 - b2**t)).sqrt() + eps)
        new[k] = p - step
    return new


class Text:
    """The characters of a text file as token ids, with random training windows."""

    def __init__(self, path: Path, device: str) -> None:
        text = path.read_text()
        self.chars = sorted(set(text))
        self.ids = torch.tensor([self.chars.index(c) for c in text], device=device)
        split = int(0.9 * len(self.ids))
        self.train, self.val = self.ids[:split], self.ids[split:]

    def batch(self, split: str, seq: int, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.train if split == "train" else self.val
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen).tolist()
        window = torch.stack([data[s : s + seq + 1] for s in starts])
        return window[:, :-1], window[:, 1:]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


def make_loss(model: GPT) -> Callable[[Params, torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = torch.func.functional_call(model, params, (x,))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    return loss


def kept_for_backward(model: GPT, params: Params, text: Text, args: argparse.Namespace) -> int:
    """Bytes autograd keeps for backward in one training step of `model` as scheduled now."""
    x, y = text.batch("train", args.seq, args.batch, torch.Generator().manual_seed(1))
    tracked = {k: p.detach().requires_grad_() for k, p in params.items()}
    return saved_tensor_bytes(make_loss(model), tracked, x, y)


def train(schedule: list[str], text: Text, args: argparse.Namespace, label: str) -> dict[str, Any]:
    """Train from seed `args.seed` with this schedule; return the loss curve, kept bytes,
    median step time, validation loss, the model and its trained parameters."""
    torch.manual_seed(args.seed)
    model = GPT(len(text.chars), args.d_model, args.heads, args.layers, args.seq).to(args.device)
    model.set_schedule(schedule)
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss_fn = make_loss(model)
    step = torch.func.grad_and_value(loss_fn)
    gen = torch.Generator().manual_seed(args.seed)
    state: dict[str, Any] = {}
    curve: dict[int, float] = {}
    times = []
    start = time.perf_counter()
    for i in range(1, args.steps + 1):
        x, y = text.batch("train", args.seq, args.batch, gen)
        tick = time.perf_counter()
        grads, loss = step(params, x, y)
        params = adam(params, grads, state, args.lr)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - tick)
        if i % args.log_every == 0 or i == args.steps:
            curve[i] = loss.item()
            print(f"  [{label}] step {i:5d}/{args.steps}  loss {curve[i]:.4f}  "
                  f"{time.perf_counter() - start:6.1f}s", flush=True)
    kept = kept_for_backward(model, params, text, args)
    with torch.no_grad():  # nothing needs a gradient, so remat'd blocks simply run
        vx, vy = text.batch("val", args.seq, args.batch, gen)
        val = loss_fn(params, vx, vy).item()
    return {"curve": curve, "kept": kept, "step_ms": statistics.median(times[1:] or times) * 1e3,
            "val": val, "model": model, "params": params}


def sample(model: GPT, params: Params, text: Text, prompt: str, n: int, seq: int) -> str:
    """Sample `n` characters after `prompt` (temperature 0.8, seeded)."""
    gen = torch.Generator().manual_seed(0)
    ids = [text.chars.index(c) for c in prompt if c in text.chars]
    device = text.ids.device
    with torch.no_grad():
        for _ in range(n):
            idx = torch.tensor([ids[-seq:]], device=device)
            logits = torch.func.functional_call(model, params, (idx,))[0, -1]
            probs = torch.softmax(logits.float().cpu() / 0.8, dim=-1)
            ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    return text.decode(ids)


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:8.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="dots_saveable", choices=sorted(POLICIES))
    parser.add_argument("--every", type=int, default=2, help="checkpoint every k-th block")
    parser.add_argument("--compare", action="store_true", help="train under several schedules")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample", type=int, default=160, help="characters to sample at the end")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    text = Text(DATA, args.device)
    longest = min(len(text.train), len(text.val)) - 2
    if args.seq > longest:
        parser.error(
            f"--seq {args.seq} is longer than the text allows: {DATA.name} has {len(text.train)} training and "
            f"{len(text.val)} validation characters, so windows of at most {longest} fit. Use --seq {longest} or less."
        )
    chosen = every_kth(args.policy, args.every, args.layers)
    print(f"{len(text.ids)} characters, vocabulary {len(text.chars)}; {args.layers} blocks, "
          f"d_model {args.d_model}, seq {args.seq}, batch {args.batch}, device {args.device}")

    if not args.compare:
        print(f"schedule: {', '.join(chosen)}")
        run = train(chosen, text, args, label=args.policy)
        run["model"].set_schedule([PLAIN] * args.layers)  # the same model without remat, for reference
        plain_kept = kept_for_backward(run["model"], run["params"], text, args)
        print(f"kept for backward: {mib(run['kept'])} with this schedule, {mib(plain_kept)} without remat "
              f"({run['kept'] / plain_kept:.1%})")
        print(f"final train loss {run['curve'][args.steps]:.4f}, validation loss {run['val']:.4f}, "
              f"median step {run['step_ms']:.1f} ms")
        if args.sample:
            print("sample:", sample(run["model"], run["params"], text, "The clock", args.sample, args.seq))
        return

    schedules = {
        "no remat": [PLAIN] * args.layers,
        "everything_saveable": ["everything_saveable"] * args.layers,
        "dots_saveable": ["dots_saveable"] * args.layers,
        "nothing_saveable": ["nothing_saveable"] * args.layers,
        f"{args.policy} every {args.every}": chosen,
    }
    runs = {}
    for label, schedule in schedules.items():
        print(f"training: {label} ({', '.join(schedule)})", flush=True)
        runs[label] = train(schedule, text, args, label)
    labels = list(runs)
    width = max(12, *(len(n) for n in labels))
    print("\nloss curves (same seed, same batches)")
    print(f"{'step':>6} " + " ".join(f"{n:>{width}}" for n in labels))
    for step in runs[labels[0]]["curve"]:
        print(f"{step:>6} " + " ".join(f"{runs[n]['curve'][step]:>{width}.6f}" for n in labels))
    print(f"\n{'schedule':{width}} {'kept for backward':>22} {'step time':>10} {'val loss':>9}")
    base = runs["no remat"]["kept"]
    for n in labels:
        r = runs[n]
        print(f"{n:{width}} {mib(r['kept'])} ({r['kept'] / base:6.1%}) {r['step_ms']:8.1f}ms {r['val']:9.4f}")
    reference = runs["no remat"]["curve"]
    spread = max(abs(r["curve"][s] - reference[s]) for r in runs.values() for s in reference)
    print(f"largest difference from the no-remat loss curve: {spread:.2e}")


if __name__ == "__main__":
    main()
