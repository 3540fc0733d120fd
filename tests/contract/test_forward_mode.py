"""Forward-mode AD and its nestings with reverse mode equal the same function without remat.

Under forward-mode AD a region runs its function as it is (nothing is rematerialized
there), so every nesting is exact; these are the nestings that once went wrong.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.func import grad, hessian, jacrev, jvp, vmap

from remat import remat

from conftest import POLICIES, assert_close

D = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::remat.RematPolicyWarning")


def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sin(x * w)


def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


def _scalars() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.tensor(0.7, dtype=D), torch.tensor(1.3, dtype=D), torch.tensor(1.0, dtype=D)


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_grad_of_second_forward_derivative(policy_name: str) -> None:
    x, w, one = _scalars()

    def second(fn: Any, w: torch.Tensor) -> torch.Tensor:
        return jvp(lambda y: jvp(lambda z: fn(z, w), (y,), (one,))[1], (x,), (one,))[1]

    g = remat(f, policy=POLICIES[policy_name])
    assert_close(grad(lambda w: second(g, w))(w), grad(lambda w: second(f, w))(w))


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_grad_of_hessian(policy_name: str) -> None:
    x, w = torch.randn(4, 2, dtype=D), torch.randn(2, 3, dtype=D)
    total = lambda fn: lambda x, w: fn(x, w).sum()  # noqa: E731
    g = remat(layer, policy=POLICIES[policy_name])
    assert_close(
        grad(lambda w: hessian(total(g))(x, w).sum())(w), grad(lambda w: hessian(total(layer))(x, w).sum())(w)
    )


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_forward_over_reverse_through_vmap_of_jacrev(policy_name: str) -> None:
    w, x = torch.randn(2, 2, dtype=D), torch.randn(4, 2, dtype=D)
    g = remat(layer, policy=POLICIES[policy_name])

    def hvp(fn: Any) -> Any:
        loss = lambda w: vmap(jacrev(lambda z: fn(z, w).sum()))(x).sum()  # noqa: E731
        return jvp(grad(loss), (w,), (torch.ones_like(w),))

    assert_close(hvp(g), hvp(layer))
