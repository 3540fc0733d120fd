"""Quickstart: checkpoint a small functional transformer and watch the memory go down.

Trains the same tiny character-level transformer (parameters in a dict, blocks called
through `remat`) with several policies, from the same seed, and prints for each the bytes
autograd keeps for backward, the median step time and the loss. The losses agree to the
last digit: remat changes what is kept, never what is computed.

    python examples/quickstart.py                 # CPU, a few seconds
    python examples/quickstart.py --device cuda --d-model 1024 --layers 12 --seq 512
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from remat import policies as P
from remat import remat, saved_tensor_bytes

TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 40
VOCAB = sorted(set(TEXT))

Params = dict[str, Any]


def init_params(vocab: int, d: int, layers: int, gen: torch.Generator, device: str) -> Params:
    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    def block() -> dict[str, torch.Tensor]:
        return {
            "ln1": torch.ones(d, device=device), "ln2": torch.ones(d, device=device),
            "qkv": randn(d, 3 * d, scale=d**-0.5), "proj": randn(d, d, scale=d**-0.5),
            "fc1": randn(d, 4 * d, scale=d**-0.5), "fc2": randn(4 * d, d, scale=(4 * d) ** -0.5),
        }

    return {"embed": randn(vocab, d, scale=0.02), "blocks": [block() for _ in range(layers)]}


def transformer_block(x: torch.Tensor, p: dict[str, torch.Tensor], heads: int) -> torch.Tensor:
    """Pre-norm GPT block: causal self-attention and a gelu MLP, each with a residual."""
    b, t, d = x.shape
    h = F.layer_norm(x, (d,), p["ln1"])
    q, k, v = (h @ p["qkv"]).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // heads)
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
    attn = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v
    x = x + attn.transpose(1, 2).reshape(b, t, d) @ p["proj"]
    h = F.layer_norm(x, (d,), p["ln2"])
    return x + F.gelu(h @ p["fc1"]) @ p["fc2"]


def make_loss(block_fns: list[Callable[..., torch.Tensor]]) -> Callable[[Params, torch.Tensor], torch.Tensor]:
    def loss(params: Params, tokens: torch.Tensor) -> torch.Tensor:
        x = params["embed"][tokens[:, :-1]]
        for fn, p in zip(block_fns, params["blocks"]):
            x = fn(x, p)
        logits = x @ params["embed"].t()
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return loss


def batches(seq: int, batch: int, gen: torch.Generator, device: str) -> Callable[[], torch.Tensor]:
    data = torch.tensor([VOCAB.index(c) for c in TEXT])

    def next_batch() -> torch.Tensor:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        return torch.stack([data[s : s + seq + 1] for s in starts]).to(device)

    return next_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    def blocks_with(policy: Any) -> list[Callable[..., torch.Tensor]]:
        fn = remat(transformer_block, policy=policy, static_argnums=2)
        return [lambda x, p: fn(x, p, args.heads)] * args.layers

    half = args.layers // 2
    mixed = [remat(transformer_block, policy=P.dots_saveable, static_argnums=2)] * half + [
        remat(transformer_block, policy=P.nothing_saveable, static_argnums=2)
    ] * (args.layers - half)
    variants: dict[str, list[Callable[..., torch.Tensor]]] = {
        "no remat": [lambda x, p: transformer_block(x, p, args.heads)] * args.layers,
        "everything_saveable": blocks_with(P.everything_saveable),
        "dots_saveable": blocks_with(P.dots_saveable),
        "nothing_saveable": blocks_with(P.nothing_saveable),
        "dots first half, nothing after": [lambda x, p, f=f: f(x, p, args.heads) for f in mixed],
    }

    print(f"{'policy':32} {'kept for backward':>24} {'step time':>10} {'final loss':>12}")
    baseline: dict[str, float] = {}
    losses = []
    for name, block_fns in variants.items():
        gen = torch.Generator().manual_seed(0)
        params = init_params(len(VOCAB), args.d_model, args.layers, gen, args.device)
        next_batch = batches(args.seq, args.batch, gen, args.device)
        loss_fn = make_loss(block_fns)
        step = torch.func.grad_and_value(loss_fn)
        times, loss = [], torch.tensor(0.0)
        for _ in range(args.steps):
            tokens = next_batch()
            start = time.perf_counter()
            grads, loss = step(params, tokens)
            params = torch.utils._pytree.tree_map(lambda p, g: p - args.lr * g, params, grads)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        tracked = torch.utils._pytree.tree_map(lambda p: p.detach().requires_grad_(), params)
        kept = saved_tensor_bytes(loss_fn, tracked, next_batch())
        step_ms = statistics.median(times[1:] or times) * 1e3
        baseline.setdefault("kept", kept)
        losses.append(loss.item())
        share = kept / baseline["kept"]
        print(f"{name:32} {kept / 2**20:9.2f} MiB ({share:6.1%}) {step_ms:8.1f}ms {loss.item():12.6f}", flush=True)
    spread = max(losses) - min(losses)
    print(f"largest difference between final losses: {spread:.2e}")


if __name__ == "__main__":
    main()
