"""Per-sample gradients through checkpointed blocks: DP-SGD with vmap(grad(...)).

Differentially private SGD needs the gradient of every sample on its own: each is clipped
to norm C, the clipped gradients are summed, Gaussian noise of scale sigma*C is added and
the sum is averaged. `torch.func.vmap(torch.func.grad(loss))` computes all of them in one
batched pass. This example trains a small sequence classifier that way, with its blocks
checkpointed by `remat`, and shows:

* remat's per-sample gradients equal those of the same model without remat;
* `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` fails on the same
  computation (it is built on saved-tensor hooks, which `torch.func` refuses);
* the memory kept for backward by the batched forward, with and without remat.

The task: each sequence is random tokens in which one of C "signal" tokens is planted
more often than the others; the label is that token.

    python examples/per_sample_grads.py                  # CPU, under 10 s
    python examples/per_sample_grads.py --device cuda --batch 256 --seq 512 --d-model 256 \\
        --layers 8 --steps 500 --log-every 50
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.func import grad, vmap
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import checkpoint

from remat import policies as P
from remat import remat, saved_tensor_bytes

Params = dict[str, Any]
Block = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def init_params(vocab: int, d: int, layers: int, classes: int, gen: torch.Generator, device: str) -> Params:
    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / math.sqrt(shape[0])).to(device)

    blocks = [{"ln": torch.ones(d, device=device), "w1": randn(d, 4 * d), "b1": torch.zeros(4 * d, device=device),
               "w2": randn(4 * d, d) * 0.5} for _ in range(layers)]
    return {"embed": randn(vocab, d) * 4, "blocks": blocks, "out": randn(d, classes)}


def mlp_block(h: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """A residual per-token MLP: most of the activation memory of this model."""
    z = F.layer_norm(h, h.shape[-1:], p["ln"])
    return h + F.gelu(z @ p["w1"] + p["b1"]) @ p["w2"]


def make_loss(block: Block) -> Callable[[Params, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of ONE sample (a sequence of token ids and its label), blocks run through `block`."""

    def loss(params: Params, tokens: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        h = params["embed"][tokens]
        for p in params["blocks"]:
            h = block(h, p)
        logits = h.mean(0) @ params["out"]
        return F.cross_entropy(logits.unsqueeze(0), label.unsqueeze(0))

    return loss


def per_sample_grads(loss: Callable[..., torch.Tensor], params: Params, x: torch.Tensor, y: torch.Tensor) -> Params:
    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def dp_sgd_step(params: Params, grads: Params, clip: float, sigma: float, lr: float,
                gen: torch.Generator) -> tuple[Params, torch.Tensor]:
    """Clip each sample's gradient to norm `clip`, sum, add N(0, (sigma*clip)^2), average, step."""
    leaves = tree_leaves(grads)
    batch = leaves[0].shape[0]
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in leaves]).sum(0).sqrt()
    scale = (clip / (norms + 1e-6)).clamp(max=1.0)

    def update(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        clipped = torch.einsum("b,b...->...", scale, g)
        noise = torch.randn(p.shape, generator=gen).to(p.device) * sigma * clip
        return p - lr * (clipped + noise) / batch

    return tree_map(update, params, grads), norms


def make_data(n: int, seq: int, vocab: int, classes: int, gen: torch.Generator,
              device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; about 15% of positions replaced by the label's signal token (ids 0..classes-1)."""
    tokens = torch.randint(classes, vocab, (n, seq), generator=gen)
    labels = torch.randint(0, classes, (n,), generator=gen)
    planted = torch.rand(n, seq, generator=gen) < 0.15
    tokens = torch.where(planted, labels[:, None], tokens)
    return tokens.to(device), labels.to(device)


def largest_difference(a: Params, b: Params) -> float:
    return max((x - y).abs().max().item() for x, y in zip(tree_leaves(a), tree_leaves(b)))


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:7.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="nothing_saveable",
                        choices=sorted(n for n in dir(P) if n.endswith("_saveable")))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--clip", type=float, default=1.0, help="per-sample gradient norm bound C")
    parser.add_argument("--sigma", type=float, default=0.5, help="noise multiplier")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    params = init_params(args.vocab, args.d_model, args.layers, args.classes, gen, args.device)
    x, y = make_data(args.batch, args.seq, args.vocab, args.classes, gen, args.device)
    plain_loss = make_loss(mlp_block)
    remat_loss = make_loss(remat(mlp_block, policy=getattr(P, args.policy)))
    print(f"{args.layers} blocks, d_model {args.d_model}, {args.batch} sequences of {args.seq} tokens, "
          f"remat policy {args.policy}, device {args.device}")

    # 1. torch.utils.checkpoint on the same computation.
    def checkpointed(h: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        return checkpoint(mlp_block, h, p, use_reentrant=False)

    try:
        per_sample_grads(make_loss(checkpointed), params, x, y)
        print("torch.utils.checkpoint: vmap(grad(...)) ran")
    except Exception as error:  # noqa: BLE001 - the point is to show what it raises
        print(f"torch.utils.checkpoint under vmap(grad(...)) fails: {type(error).__name__}: "
              f"{str(error).splitlines()[0]}")

    # 2. remat's per-sample gradients against the un-checkpointed model's.
    expected = per_sample_grads(plain_loss, params, x, y)
    got = per_sample_grads(remat_loss, params, x, y)
    print(f"per-sample gradients, remat vs no remat: largest difference {largest_difference(got, expected):.2e}")

    # 3. What the batched forward keeps for backward, with and without remat.
    tracked = tree_map(lambda t: t.detach().requires_grad_(), params)
    kept = {name: saved_tensor_bytes(lambda p, f=f: vmap(f, in_dims=(None, 0, 0))(p, x, y).sum(), tracked)
            for name, f in [("no remat", plain_loss), (f"remat {args.policy}", remat_loss)]}
    param_bytes = sum(t.nbytes for t in tree_leaves(params))
    for name, nbytes in kept.items():
        print(f"kept for backward, {name:26} {mib(nbytes)}  (of which parameters {mib(param_bytes).strip()})")
    print(f"the per-sample gradients themselves: {mib(param_bytes * args.batch)} (batch x parameters)")

    # 4. DP-SGD training with remat'd blocks.
    test_x, test_y = make_data(512, args.seq, args.vocab, args.classes, gen, args.device)

    def test_accuracy(p: Params) -> float:
        with torch.no_grad():
            h = p["embed"][test_x]
            for q in p["blocks"]:
                h = mlp_block(h, q)
            return ((h.mean(1) @ p["out"]).argmax(-1) == test_y).float().mean().item()

    print(f"DP-SGD: clip C={args.clip}, noise sigma={args.sigma}, lr {args.lr}; test accuracy at start "
          f"{test_accuracy(params):.1%}")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = make_data(args.batch, args.seq, args.vocab, args.classes, gen, args.device)
        grads = per_sample_grads(remat_loss, params, x, y)
        params, norms = dp_sgd_step(params, grads, args.clip, args.sigma, args.lr, gen)
        if step % args.log_every == 0 or step == args.steps:
            with torch.no_grad():  # nothing needs a gradient: remat'd blocks simply run
                loss = vmap(remat_loss, in_dims=(None, 0, 0))(params, x, y).mean().item()
            print(f"  step {step:4d}/{args.steps}  loss {loss:.4f}  median per-sample grad norm "
                  f"{norms.median().item():.3f}  clipped {(norms > args.clip).float().mean().item():4.0%}  "
                  f"{time.perf_counter() - start:5.1f}s", flush=True)
    print(f"test accuracy after {args.steps} DP-SGD steps: {test_accuracy(params):.1%}")


if __name__ == "__main__":
    main()
