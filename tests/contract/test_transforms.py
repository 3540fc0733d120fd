"""Every policy x every function x every transform equals the same function without remat
(the default run: a pairwise cover of the three; the full product under the `product` marker)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.func import functional_call, grad, grad_and_value, hessian, jacfwd, jacrev, jvp, vjp, vmap

from remat import remat

from conftest import POLICIES, assert_close, pairwise_in_default
from zoo import ZOO, example

pytestmark = pytest.mark.filterwarnings("ignore::remat.RematPolicyWarning")  # the shared name policies name values some functions lack

Fn = Callable[..., torch.Tensor]
_WRAPPED: dict[tuple[str, str], Any] = {}


def wrapped(fn_name: str, policy_name: str) -> Any:
    """One remat wrapper per (function, policy), shared by all transforms (exercises the cache)."""
    key = (fn_name, policy_name)
    if key not in _WRAPPED:
        _WRAPPED[key] = remat(ZOO[fn_name][0], policy=POLICIES[policy_name])
    return _WRAPPED[key]


def cotangent(out: torch.Tensor) -> torch.Tensor:
    """A fixed, non-symmetric cotangent (no randomness, so it is fine inside vmap)."""
    return torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).mul(0.7).sin()


def loss(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    out = fn(x, p)
    return (out * cotangent(out)).sum() + out.pow(2).sum() * 0.1


def leaf_copies(x: torch.Tensor, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return x.clone().requires_grad_(), {k: v.clone().requires_grad_() for k, v in p.items()}


def t_backward(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor]) -> Any:
    x, p = leaf_copies(x, p)
    out = fn(x, p)
    loss(lambda *_: out, x, p).backward()
    return out.detach(), x.grad, {k: v.grad for k, v in p.items()}


def t_double_backward(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor]) -> Any:
    x, p = leaf_copies(x, p)
    gx, *gp = torch.autograd.grad(loss(fn, x, p), [x, *p.values()], create_graph=True)
    second = sum((g * g).sum() for g in [gx, *gp])
    return torch.autograd.grad(second, [x, *p.values()])


def t_autograd_grad(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor]) -> Any:
    x, p = leaf_copies(x, p)
    return torch.autograd.grad(loss(fn, x, p), [x, *p.values()])


def t_grad(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor]) -> Any:
    return grad(lambda x, p: loss(fn, x, p), argnums=(0, 1))(x, p)


def t_grad_and_value(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor]) -> Any:
    return grad_and_value(lambda p: loss(fn, x, p))(p)


def t_vjp(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor]) -> Any:
    out, pullback = vjp(fn, x, p)
    return out, pullback(cotangent(out))


def t_jacrev(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor]) -> Any:
    return jacrev(fn, argnums=0)(x, p)


def t_jvp(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor]) -> Any:
    gen = torch.Generator().manual_seed(3)
    tx = torch.randn(x.shape, dtype=x.dtype, generator=gen)
    tp = {k: torch.randn(v.shape, dtype=v.dtype, generator=gen) for k, v in p.items()}
    return jvp(fn, (x, p), (tx, tp))


def t_jacfwd(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor]) -> Any:
    return jacfwd(fn, argnums=0)(x, p)


def t_hessian(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor]) -> Any:
    return hessian(lambda x: loss(fn, x, p))(x)


def t_vmap(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor]) -> Any:
    xs = torch.stack([x, x * 0.5 + 1, -x])
    return vmap(fn, in_dims=(0, None))(xs, p)


def t_vmap_grad(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor]) -> Any:
    xs = torch.stack([x, x * 0.5 + 1, -x])
    return vmap(grad(lambda x, p: loss(fn, x, p), argnums=1), in_dims=(0, None))(xs, p)


def t_grad_vmap(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor]) -> Any:
    xs = torch.stack([x, x * 0.5 + 1, -x])
    return grad(lambda p: vmap(lambda x: loss(fn, x, p))(xs).sum())(p)


def t_grad_grad(fn: Fn, x: torch.Tensor, p: dict[str, torch.Tensor]) -> Any:
    def inner(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        gx = grad(lambda x, p: loss(fn, x, p), argnums=0)(x, p)
        return (gx * torch.cos(gx)).sum()

    return grad(inner, argnums=(0, 1))(x, p)


TRANSFORMS = {
    name[2:]: f for name, f in dict(globals()).items() if name.startswith("t_") and callable(f)
}


@pytest.mark.parametrize(("policy_name", "fn_name", "transform"), pairwise_in_default(list(POLICIES), list(ZOO), list(TRANSFORMS)))
def test_matches_no_remat(policy_name: str, fn_name: str, transform: str) -> None:
    fn, x, p = example(fn_name)
    try:
        expected = TRANSFORMS[transform](fn, x, p)
    except (RuntimeError, NotImplementedError) as error:
        # torch itself lacks this (e.g. forward AD of CPU flash attention): remat must fail too
        with pytest.raises(type(error)):
            TRANSFORMS[transform](wrapped(fn_name, policy_name), x, p)
        return
    actual = TRANSFORMS[transform](wrapped(fn_name, policy_name), x, p)
    assert_close(actual, expected)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8, dtype=torch.float64)
        self.fc2 = torch.nn.Linear(8, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Net(torch.nn.Module):
    def __init__(self, policy: Any, use_remat: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(2)])
        self.policy, self.use_remat = policy, use_remat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = remat(block.forward, policy=self.policy)(x) if self.use_remat else block(x)
        return x


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_functional_call_over_module(policy_name: str) -> None:
    torch.manual_seed(0)
    plain = Net(POLICIES[policy_name], use_remat=False)
    checkpointed = Net(POLICIES[policy_name], use_remat=True)
    checkpointed.load_state_dict(plain.state_dict())
    params = {k: v.detach() for k, v in plain.named_parameters()}
    x = torch.randn(3, 4, dtype=torch.float64)

    def run(model: torch.nn.Module) -> Any:
        def objective(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return functional_call(model, params, (x,)).pow(2).sum()

        per_sample = vmap(grad(objective), in_dims=(None, 0))(params, x.unsqueeze(1))
        return grad_and_value(objective)(params, x), per_sample

    assert_close(run(checkpointed), run(plain))


def test_loop_of_layers_with_a_policy_per_layer() -> None:
    from remat import policies as P

    fn, x, p = example("mlp")
    layer_policies = [P.nothing_saveable, P.dots_saveable, P.everything_saveable, None]
    layers = [remat(fn, policy=pol) for pol in layer_policies]
    keys = ["w1", "b1", "w2", "b2"]
    stack = [{k: p[k] * (i + 1) for k in keys} for i in range(len(layers))]

    def run(layer_fns: list[Fn], stack: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        h = x
        for f, params in zip(layer_fns, stack):
            h = f(h, params) + h
        return h.pow(2).sum()

    expected = grad_and_value(lambda s: run([fn] * len(layers), s))(stack)
    actual = grad_and_value(lambda s: run(layers, s))(stack)
    assert_close(actual, expected)
    assert_close(t_backward(lambda x, p: run(layers, stack) * x.sum() + p["b1"].sum(), x, p),
                 t_backward(lambda x, p: run([fn] * 4, stack) * x.sum() + p["b1"].sum(), x, p))
