"""Property: random small functions give no-remat values and gradients under every policy,
random ops and in-place ops included."""

from __future__ import annotations

import math
import os
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from remat import remat

from conftest import POLICIES, assert_close

pytestmark = pytest.mark.filterwarnings("ignore::remat.RematPolicyWarning")  # the shared name policies name values some functions lack

D = torch.float64
Op = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]

# Every op maps [2, 3, 4] tensors to a [2, 3, 4] tensor, so any sequence of them composes.
POOL: dict[str, Op] = {
    "matmul": lambda a, b, p: a @ p["w"],
    "linear": lambda a, b, p: F.linear(a, p["w"], p["bias"]),
    "bmm": lambda a, b, p: (a @ b.transpose(-1, -2)) @ b / math.sqrt(4),
    "einsum": lambda a, b, p: torch.einsum("bij,bkj,bkl->bil", a, b, a) / 8,
    "mul": lambda a, b, p: a * b,
    "add": lambda a, b, p: a + b,
    "sin": lambda a, b, p: torch.sin(a),
    "tanh": lambda a, b, p: torch.tanh(a),
    "sigmoid_mul": lambda a, b, p: torch.sigmoid(a) * b,
    "exp_neg_square": lambda a, b, p: torch.exp(-a * a),
    "center": lambda a, b, p: a - a.mean(-1, keepdim=True),
    "sum_gate": lambda a, b, p: a * torch.sigmoid(b.sum(-1, keepdim=True)),
    "max": lambda a, b, p: a * a.amax(1, keepdim=True),
    "transpose": lambda a, b, p: a.transpose(0, 1).reshape(3, 8).t().reshape(2, 4, 3).transpose(1, 2) * 1.0,
    "view_roll": lambda a, b, p: torch.cat([a[..., 1:], a[..., :1]], dim=-1),
    "softmax": lambda a, b, p: torch.softmax(a, dim=-1),
    "layer_norm": lambda a, b, p: F.layer_norm(a, (4,), p["g"], p["bias"]),
    "index": lambda a, b, p: a[:, torch.tensor([2, 0, 1])] * b,
    "gelu": lambda a, b, p: F.gelu(a),
    "dropout": lambda a, b, p: F.dropout(a, p=0.3, training=True),
    "noise": lambda a, b, p: a + torch.randn_like(a) * 0.1,
    "inplace": lambda a, b, p: (a * 1.0).mul_(b).tanh_(),
}

steps = st.lists(
    st.tuples(st.sampled_from(sorted(POOL)), st.integers(0, 10), st.integers(0, 10)), min_size=1, max_size=6
)


def build(program: list[tuple[str, int, int]]) -> Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]:
    def fn(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        values = [x, torch.tanh(x)]
        for name, i, j in program:
            values.append(POOL[name](values[i % len(values)], values[j % len(values)], p))
        return values[-1] + values[-2]

    return fn


def random_functions_match_no_remat(program: list[tuple[str, int, int]], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 4, dtype=D, generator=gen, requires_grad=True)
    p = {
        "w": torch.randn(4, 4, dtype=D, generator=gen, requires_grad=True),
        "bias": torch.randn(4, dtype=D, generator=gen, requires_grad=True),
        "g": torch.randn(4, dtype=D, generator=gen, requires_grad=True),
    }
    fn = build(program)
    cot = torch.randn(2, 3, 4, dtype=D, generator=gen)

    def run(f: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
        torch.manual_seed(seed)  # random ops draw the same numbers with and without remat
        out = f(x, p)
        grads = torch.autograd.grad((out * cot).sum(), [x, *p.values()], materialize_grads=True)
        return out, grads, torch.rand(2)  # and leave the global stream at the same place

    expected = run(fn)
    for policy in POLICIES.values():
        f = remat(fn, policy=policy)
        assert_close(run(f), expected)
        torch.manual_seed(seed)
        assert_close(torch.func.grad(lambda p: (f(x, p) * cot).sum())(p), dict(zip(p, expected[1][1:])))


def _with_examples(n: int) -> Callable[[], None]:
    return settings(max_examples=n, deadline=None)(given(program=steps, seed=st.integers(0, 2**16))(random_functions_match_no_remat))


test_random_functions_match_no_remat_under_every_policy = _with_examples(3)
test_many_random_functions_match_no_remat = pytest.mark.properties(
    _with_examples(int(os.environ.get("REMAT_PROPERTY_EXAMPLES", "30")))
)
