"""Outputs nobody differentiates and inputs no output depends on, as eager autograd treats
them: an output without a gradient contributes nothing (not zeros), an input that gets no
gradient gets None, and autograd never reaches back through it. Each against the same
code without remat (float64)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.func import grad, jacrev

from remat import remat
from remat import policies as P

from conftest import assert_close

D = torch.float64
POLICIES = {"none": None, "nothing": P.nothing_saveable, "everything": P.everything_saveable}


def _singular(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x.sqrt()  # sqrt's derivative at 0 is infinite


def _hypot(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.sin(), torch.hypot(x, 0 * x)


def _x() -> torch.Tensor:
    return torch.tensor([0.0, 1.0, 2.0], dtype=D)


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("fn", [_singular, _hypot], ids=lambda f: f.__name__)
def test_an_unused_output_does_not_poison_the_gradient(fn: Callable[..., Any], policy_name: str) -> None:
    """A zero cotangent times an infinite derivative would be NaN; eager autograd never
    runs the unused output's derivative."""
    region = remat(fn, policy=POLICIES[policy_name])

    def backward(f: Callable[..., Any]) -> torch.Tensor:
        x = _x().requires_grad_()
        f(x)[0].sum().backward()
        return x.grad  # type: ignore[return-value]

    assert_close(backward(region), backward(fn))
    assert_close(grad(lambda x: region(x)[0].sum())(_x()), grad(lambda x: fn(x)[0].sum())(_x()))
    assert_close(jacrev(lambda x: region(x)[0])(_x()), jacrev(lambda x: fn(x)[0])(_x()))


def test_an_input_that_gets_no_gradient_gets_none() -> None:
    """`g2` does not read `u`: autograd never calls `g1`'s backward, and `a.grad` stays None
    (an optimizer step then leaves `a` alone, as in eager code)."""
    g1 = remat(lambda a: a.sin())
    g2 = remat(lambda u, b: b * 2)
    a = torch.randn(3, dtype=D, requires_grad=True)
    b = torch.randn(3, dtype=D, requires_grad=True)
    g2(g1(a), b).sum().backward()
    assert a.grad is None
    assert_close(b.grad, torch.full((3,), 2.0, dtype=D))


def test_a_returned_input_the_region_does_not_use_gets_none() -> None:
    region = remat(lambda a, b: (a.sin(), b))
    a = torch.randn(3, dtype=D, requires_grad=True)
    b = torch.randn(3, dtype=D, requires_grad=True)
    region(a, b)[0].sum().backward()
    assert b.grad is None and a.grad is not None


def test_an_unused_input_changed_in_place_before_the_call() -> None:
    """Eager code never backpropagates into `t`, whose history an in-place change broke."""
    def run(f: Callable[..., torch.Tensor]) -> torch.Tensor:
        x = torch.arange(4, dtype=D).requires_grad_()
        t = x.exp()
        t.mul_(2)
        f(x, t).sum().backward()
        return x.grad  # type: ignore[return-value]

    f = lambda a, b: a.sin()  # noqa: E731
    assert_close(run(remat(f)), run(f))


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_vmap_with_unbatched_inputs_counts_each_gradient_once(policy_name: str) -> None:
    """An output computed only from an input vmap does not batch, differentiated outside the
    vmap: its gradient is counted once, as in eager code (not once per batch element)."""
    xs = torch.randn(3, 4, dtype=D)
    p = torch.randn(4, dtype=D)
    f = lambda p, x: (p.sin(), x * p)  # noqa: E731
    region = remat(f, policy=POLICIES[policy_name])

    def loss(fn: Callable[..., Any]) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda p: sum(o.pow(2).sum() for o in torch.func.vmap(fn, in_dims=(None, 0))(p, xs))

    assert_close(grad(loss(region))(p), grad(loss(f))(p))
    leaf = p.clone().requires_grad_()
    loss(region)(leaf).backward()
    assert_close(leaf.grad, grad(loss(f))(p))
    per_sample = torch.func.vmap(grad(lambda p, x: region(p, x)[1].sum() + region(p, x)[0].sum()), in_dims=(None, 0))
    expected = torch.func.vmap(grad(lambda p, x: f(p, x)[1].sum() + f(p, x)[0].sum()), in_dims=(None, 0))
    assert_close(per_sample(p, xs), expected(p, xs))


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_second_order_through_layer_norm_returned_beside_its_input(policy_name: str) -> None:
    """layer_norm's mean and rstd are outputs nobody differentiates: a second order never
    asks for their derivative (which torch does not implement)."""
    def loss(fn: Callable[..., Any]) -> Callable[[torch.Tensor], torch.Tensor]:
        def inner(x: torch.Tensor) -> torch.Tensor:
            normed, same = fn(x)
            return (normed.sin() * same).sum()
        return inner

    f = lambda x: (torch.nn.functional.layer_norm(x, (4,)), x)  # noqa: E731
    x = torch.randn(3, 4, dtype=D)
    second = lambda fn: grad(lambda x: grad(loss(fn))(x).pow(2).sum())(x)  # noqa: E731
    assert_close(second(remat(f, policy=POLICIES[policy_name])), second(f))
