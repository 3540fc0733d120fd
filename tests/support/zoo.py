"""Small functions to rematerialize, with their example inputs (float64, tiny shapes).

Each entry takes (x, params) and returns a tensor. They cover the op families policies
care about: addmm/mm (dots without batch dims), bmm/einsum (batched dots), layer_norm,
softmax, gelu, residual adds, pure elementwise chains and checkpoint_name.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from remat import checkpoint_name

D = torch.float64


def mlp(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    h = F.gelu(x @ p["w1"] + p["b1"])
    return torch.tanh(h @ p["w2"] + p["b2"])


def attention(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
    scores = checkpoint_name(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), "scores")
    return torch.softmax(scores, dim=-1) @ v


def multi_head(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    q = torch.einsum("btd,hde->bhte", x, p["wq"])
    k = torch.einsum("btd,hde->bhte", x, p["wk"])
    v = torch.einsum("btd,hde->bhte", x, p["wv"])
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    out = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(scores, dim=-1), v)
    return torch.einsum("bhte,hed->btd", out, p["wo"])


def transformer_block(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    d = x.shape[-1]
    h = F.layer_norm(x, (d,), p["ln1_w"], p["ln1_b"])
    x = x + attention(h, p) @ p["wo"]
    h = F.layer_norm(x, (d,), p["ln2_w"], p["ln2_b"])
    h = checkpoint_name(F.gelu(F.linear(h, p["fc1"], p["fc1_b"])), "h")
    return x + F.linear(h, p["fc2"], p["fc2_b"])


def elementwise(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    y = torch.sin(x) * torch.exp(-x * x) + p["a"]
    y = torch.sigmoid(y) * torch.tanh(y * p["a"])
    return y.pow(3) + torch.cos(y)


def named(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    h = checkpoint_name(x @ p["w1"], "h")
    g = checkpoint_name(torch.sin(h) * h, "g")
    return torch.tanh(g @ p["w2"]) + checkpoint_name(g.sum(-1, keepdim=True), "s")


def sdpa_attention(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    b, t, d = x.shape
    q, k, v = (F.linear(x, p["qkv"]).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.layer_norm(x + out.transpose(1, 2).reshape(b, t, d) @ p["wo"], (d,))


def _params(**shapes: tuple[int, ...]) -> Callable[[torch.Generator], dict[str, torch.Tensor]]:
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        return {k: torch.randn(s, dtype=D, generator=gen) * 0.5 for k, s in shapes.items()}

    return make


# name -> (function, x shape, params factory)
ZOO: dict[str, tuple[Callable[..., torch.Tensor], tuple[int, ...], Callable[[torch.Generator], dict[str, torch.Tensor]]]] = {
    "mlp": (mlp, (3, 4), _params(w1=(4, 6), b1=(6,), w2=(6, 4), b2=(4,))),
    "attention": (attention, (2, 3, 4), _params(wq=(4, 4), wk=(4, 4), wv=(4, 4))),
    "multi_head": (multi_head, (2, 3, 4), _params(wq=(2, 4, 3), wk=(2, 4, 3), wv=(2, 4, 3), wo=(2, 3, 4))),
    "transformer_block": (
        transformer_block,
        (2, 3, 4),
        _params(
            ln1_w=(4,), ln1_b=(4,), wq=(4, 4), wk=(4, 4), wv=(4, 4), wo=(4, 4),
            ln2_w=(4,), ln2_b=(4,), fc1=(8, 4), fc1_b=(8,), fc2=(4, 8), fc2_b=(4,),
        ),
    ),
    "sdpa_attention": (sdpa_attention, (2, 3, 4), _params(qkv=(12, 4), wo=(4, 4))),
    "elementwise": (elementwise, (3, 4), _params(a=(4,))),
    "named": (named, (3, 4), _params(w1=(4, 5), w2=(5, 4))),
}


def example(name: str, seed: int = 0) -> tuple[Callable[..., torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    fn, x_shape, make_params = ZOO[name]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, dtype=D, generator=gen)
    return fn, x, make_params(gen)
