"""Higher-order derivatives through remat: a physics-informed network and its Hessian.

A small residual MLP u(x, t) learns the heat equation u_t = k u_xx on [0, 1] x [0, 1] with
u(x, 0) = sin(pi x) and u(0, t) = u(1, t) = 0 (exact solution exp(-k pi^2 t) sin(pi x)).
Its loss needs derivatives of the network with respect to its inputs, taken with
`torch.func.vmap(torch.func.jacrev(u))` and `torch.func.vmap(torch.func.hessian(u))`;
training differentiates that again with respect to the weights, and a Hessian-vector
product of the loss (the gradient of <grad loss, v>) goes one order higher still.

remat goes in two places, both checked against the same network without remat:

* "remat each block": every residual block of u is a remat region (transforms outside);
* "remat the residual": the whole PDE residual, transforms included, is one remat region,
  so the weight gradient keeps only its inputs and recomputes the derivatives in backward.

For each it prints the largest difference from no remat in the weight gradient and in a
Hessian-vector product, and the memory kept for backward, both by u alone (first order)
and by the PDE loss. Then it trains with the residual remat'd (Adam, hand-written) and
estimates the loss's sharpness (the top Hessian eigenvalue) by power iteration on
Hessian-vector products.

    python examples/hessian_vector.py                   # CPU, about 12 s
    python examples/hessian_vector.py --device cuda --dtype float32 --width 256 --blocks 6 \\
        --points 8192 --steps 3000 --log-every 250
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any, Callable

import torch
from torch.func import grad, grad_and_value, hessian, jacrev, vmap
from torch.utils._pytree import tree_leaves, tree_map

from remat import policies as P
from remat import remat, saved_tensor_bytes

Params = dict[str, Any]
Block = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
KAPPA = 0.1


def init_params(width: int, blocks: int, gen: torch.Generator, dtype: torch.dtype, device: str) -> Params:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype) / math.sqrt(shape[0])

    def zeros() -> torch.Tensor:
        return torch.zeros(width, dtype=dtype)

    params = {"inp": {"w": randn(2, width) * 2, "b": zeros()},
              "blocks": [{"w1": randn(width, width), "b1": zeros(), "w2": randn(width, width), "b2": zeros()}
                         for _ in range(blocks)],
              "out": randn(width)}
    return tree_map(lambda t: t.to(device), params)


def tanh_block(h: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """A residual block of two tanh layers."""
    return h + torch.tanh(torch.tanh(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])


def u(params: Params, xt: torch.Tensor, block: Block = tanh_block) -> torch.Tensor:
    """The network: points [..., 2] (x, t) to values [...]."""
    h = torch.tanh(xt @ params["inp"]["w"] + params["inp"]["b"])
    for p in params["blocks"]:
        h = block(h, p)
    return h @ params["out"]


def pde_residual(params: Params, pts: torch.Tensor, block: Block = tanh_block) -> torch.Tensor:
    """u_t - k u_xx at each point, the derivatives taken by torch.func."""
    def one(z: torch.Tensor) -> torch.Tensor:
        return u(params, z, block)

    u_t = vmap(jacrev(one))(pts)[:, 1]
    u_xx = vmap(hessian(one))(pts)[:, 0, 0]
    return u_t - KAPPA * u_xx


def pde_residual_autograd(params: Params, pts: torch.Tensor, block: Block = tanh_block) -> torch.Tensor:
    """The same residual with torch.autograd.grad(create_graph=True), which saved-tensor
    hooks (and so `saved_tensor_bytes`) can observe; torch.func.jacrev refuses them."""
    z = pts.detach().requires_grad_()
    (du,) = torch.autograd.grad(u(params, z, block).sum(), z, create_graph=True)
    (d2u,) = torch.autograd.grad(du[:, 0].sum(), z, create_graph=True)
    return du[:, 1] - KAPPA * d2u[:, 0]


def make_loss(residual: Callable[..., torch.Tensor], block: Block,
              data: dict[str, torch.Tensor]) -> Callable[[Params], torch.Tensor]:
    """Mean squared PDE residual plus initial and boundary terms."""
    def loss(params: Params) -> torch.Tensor:
        initial = u(params, data["initial"], block) - torch.sin(math.pi * data["initial"][:, 0])
        boundary = u(params, data["boundary"], block)
        return residual(params, data["interior"], block).pow(2).mean() + initial.pow(2).mean() + boundary.pow(2).mean()

    return loss


def make_data(points: int, gen: torch.Generator, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=dtype)

    edge = points // 4
    initial = torch.stack([rand(edge), torch.zeros(edge, dtype=dtype)], dim=1)
    boundary = torch.stack([(rand(edge) < 0.5).to(dtype), rand(edge)], dim=1)
    return {k: v.to(device) for k, v in {"interior": rand(points, 2), "initial": initial, "boundary": boundary}.items()}


def hvp(loss: Callable[[Params], torch.Tensor], params: Params, v: Params) -> Params:
    """Hessian-vector product: the gradient of <grad loss(params), v> (reverse over reverse)."""
    def directional(p: Params) -> torch.Tensor:
        return sum((g * d).sum() for g, d in zip(tree_leaves(grad(loss)(p)), tree_leaves(v)))

    return grad(directional)(params)


def largest_difference(a: Params, b: Params) -> float:
    return max((x - y).abs().max().item() for x, y in zip(tree_leaves(a), tree_leaves(b)))


def adam(params: Params, grads: Params, state: dict[str, Any], lr: float,
         betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> Params:
    """One Adam step on a pytree of tensors; `state` holds the moments and the step count."""
    b1, b2 = betas
    state["t"] = t = state.get("t", 0) + 1
    zeros = tree_map(torch.zeros_like, params)
    state["m"] = tree_map(lambda m, g: b1 * m + (1 - b1) * g, state.get("m", zeros), grads)
    state["v"] = tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state.get("v", zeros), grads)
    return tree_map(lambda p, m, v: p - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps),
                    params, state["m"], state["v"])


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:8.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="nothing_saveable", help="policy of the remat'd residual",
                        choices=sorted(n for n in dir(P) if n.endswith("_saveable")))
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=2, help="residual blocks of two tanh layers")
    parser.add_argument("--points", type=int, default=256, help="interior collocation points")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--power-iters", type=int, default=10)
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    params = init_params(args.width, args.blocks, gen, dtype, args.device)
    data = make_data(args.points, gen, dtype, args.device)
    print(f"u(x, t): {args.blocks} residual tanh blocks of width {args.width}, {args.points} interior points, "
          f"{args.dtype}, device {args.device}")

    remat_block = remat(tanh_block, policy=P.nothing_saveable)
    remat_residual = remat(pde_residual, policy=getattr(P, args.policy))
    each_block, whole_residual = "remat each block (nothing_saveable)", f"remat the residual ({args.policy})"
    variants: dict[str, tuple[Callable[..., torch.Tensor], Block]] = {
        "no remat": (pde_residual, tanh_block),
        each_block: (pde_residual, remat_block),
        whole_residual: (remat_residual, tanh_block),
    }

    # 1. The same derivatives with and without remat.
    v = tree_map(lambda t: torch.randn(t.shape, generator=gen, dtype=dtype).to(t.device), params)
    reference: dict[str, Params] = {}
    print(f"{'':38} {'grad: largest diff':>19} {'HVP: largest diff':>18}")
    for name, (residual, block) in variants.items():
        loss = make_loss(residual, block, data)
        g, hv = grad(loss)(params), hvp(loss, params, v)
        reference = reference or {"grad": g, "hvp": hv}
        print(f"{name:38} {largest_difference(g, reference['grad']):19.2e} "
              f"{largest_difference(hv, reference['hvp']):18.2e}", flush=True)

    # 2. Memory kept for backward, by u alone and by the PDE loss. Saved-tensor hooks (and so
    # saved_tensor_bytes) cannot see inside torch.func.jacrev, so without a remat'd residual
    # the loss is measured with its input derivatives taken by torch.autograd.grad.
    tracked = tree_map(lambda t: t.detach().requires_grad_(), params)
    measured = {
        "no remat": (tanh_block, make_loss(pde_residual_autograd, tanh_block, data)),
        each_block: (remat_block, make_loss(pde_residual_autograd, remat_block, data)),
        whole_residual: (tanh_block, make_loss(remat_residual, tanh_block, data)),
    }
    print(f"kept for backward{'':21} {'u(points), first order':>22} {'PDE loss':>21}")
    base: dict[str, int] = {}
    for name, (block, loss) in measured.items():
        first = saved_tensor_bytes(lambda p: u(p, data["interior"], block).sum(), tracked)
        full = saved_tensor_bytes(loss, tracked)
        base = base or {"first": first, "full": full}
        print(f"  {name:36} {mib(first)} ({first / base['first']:6.1%}) {mib(full)} ({full / base['full']:6.1%})")
    same = (pde_residual_autograd(params, data["interior"]) - pde_residual(params, data["interior"])).abs().max()
    print(f"  (PDE loss without a remat'd residual: derivatives by torch.autograd.grad(create_graph=True),\n"
          f"   which agree with torch.func's to {same.item():.1e})")

    # 3. Train with the residual remat'd, then estimate the sharpness with HVPs.
    loss = make_loss(remat_residual, tanh_block, data)
    step = grad_and_value(loss)
    state: dict[str, Any] = {}
    start = time.perf_counter()
    print(f"training with the residual remat'd ({args.policy}), Adam lr {args.lr}")
    for i in range(1, args.steps + 1):
        g, value = step(params)
        params = adam(params, g, state, args.lr)
        if i % args.log_every == 0 or i == args.steps:
            print(f"  step {i:5d}/{args.steps}  loss {value.item():.3e}  {time.perf_counter() - start:6.1f}s",
                  flush=True)
    with torch.no_grad():
        axis = torch.linspace(0, 1, 41, dtype=dtype)
        grid = torch.cartesian_prod(axis, axis).to(args.device)
        exact = torch.exp(-KAPPA * math.pi**2 * grid[:, 1]) * torch.sin(math.pi * grid[:, 0])
        error = (u(params, grid) - exact).abs().max().item()
    print(f"largest error against the exact solution on a 41x41 grid: {error:.3e}")

    direction = tree_map(lambda t: torch.randn(t.shape, generator=gen, dtype=dtype).to(t.device), params)
    eigenvalue = torch.tensor(0.0)
    for _ in range(args.power_iters):
        norm = torch.sqrt(sum((d * d).sum() for d in tree_leaves(direction)))
        direction = tree_map(lambda d: d / norm, direction)
        hv = hvp(loss, params, direction)
        eigenvalue = sum((h * d).sum() for h, d in zip(tree_leaves(hv), tree_leaves(direction)))
        direction = hv
    print(f"top Hessian eigenvalue of the loss after {args.power_iters} power iterations: {eigenvalue.item():.4f}")


if __name__ == "__main__":
    main()
