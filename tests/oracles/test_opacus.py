"""Opacus' per-sample gradients with remat'd layers, against the same model without remat.

Opacus (differential privacy) computes each example's gradient in one of three ways: module
hooks (a forward hook keeps each layer's input, a full backward hook turns the layer's
output gradient into per-sample gradients, a counter on every parameter tells when a
backward is complete), the same hooks with torch.func per layer, and torch's
ExpandedWeights. A region holding hooked layers or ExpandedWeights cannot be traced, so it
replays as torch.utils.checkpoint runs it; the recompute runs the forward hooks again, and
must leave what they change (the kept inputs, the counters on the parameters) as the
forward left it. torch.utils.checkpoint does not: its recompute counts each parameter's
forward twice and the first layer of a checkpointed block gets no per-sample gradient.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

import remat

from conftest import BUILT_IN_POLICIES

opacus_grad_sample = pytest.importorskip("opacus.grad_sample")

pytestmark = [pytest.mark.models, pytest.mark.filterwarnings("ignore::remat.RematFallbackWarning")]

D = torch.float64
# Opacus' modes: (its grad-sample module class, options)
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "hooks": ("hooks", {}),
    "functorch": ("hooks", {"force_functorch": True}),
    "ew": ("ew", {}),
}


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    block = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Dropout(0.2), torch.nn.Tanh(), torch.nn.Linear(8, 8)
    )
    return torch.nn.Sequential(torch.nn.Linear(6, 8), block, torch.nn.ReLU(), torch.nn.Linear(8, 3)).to(D)


def _per_sample_steps(model: torch.nn.Module, mode: str, steps: int = 2) -> list[dict[str, torch.Tensor]]:
    """Each step's per-sample gradients and gradients, by parameter name (the wrapper's
    names are the wrapped module's)."""
    kind, options = MODES[mode]
    wrapped = opacus_grad_sample.get_gsm_class(kind)(model, loss_reduction="sum", **options)
    names = {id(p): n.replace("wrapped_module.", "") for n, p in model.named_parameters()}
    seen = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(5, 6, dtype=D, generator=generator)
        y = torch.randint(0, 3, (5,), generator=generator)
        torch.manual_seed(100 + step)  # dropout's masks
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's note on full backward hooks of the first layer
            torch.nn.functional.cross_entropy(wrapped(x), y, reduction="sum").backward()
        found: dict[str, torch.Tensor] = {}
        for p in model.parameters():
            for what in ("grad_sample", "grad"):
                value = getattr(p, what, None)
                if value is not None:
                    found[f"{names[id(p)]}.{what}"] = value.detach().clone()
            p.grad = None
            p.grad_sample = None
        found["random stream after"] = torch.rand(3, dtype=D)
        seen.append(found)
    return seen


@pytest.mark.parametrize("policy_name", list(BUILT_IN_POLICIES))
@pytest.mark.parametrize("mode", list(MODES))
def test_opacus_per_sample_gradients_equal_no_remat(mode: str, policy_name: str) -> None:
    """Bitwise: the replayed region runs eager's ops in eager's order."""
    reference = _model()
    model = copy.deepcopy(reference)
    model[1] = remat.remat(model[1], policy=BUILT_IN_POLICIES[policy_name])
    expected = _per_sample_steps(reference, mode)
    actual = _per_sample_steps(model, mode)
    for got, want in zip(actual, expected):
        assert got.keys() == want.keys()
        assert any(key.endswith("grad_sample") for key in want)
        for key in want:
            assert torch.equal(got[key], want[key]), key
