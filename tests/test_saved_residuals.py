"""saved_residuals says exactly what is kept: kind, op, name, source, region, bytes."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from remat import Residual, checkpoint_name, print_saved_residuals, remat, saved_residuals, saved_tensor_bytes
from remat import policies as P

D = torch.float64


def layer(x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    h = checkpoint_name(F.gelu(x @ params["w1"]), "hidden")
    return h @ params["w2"]


def _args() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(4, 3, dtype=D, generator=gen),
        {"w1": torch.randn(3, 5, dtype=D, generator=gen), "w2": torch.randn(5, 3, dtype=D, generator=gen)},
    )


def test_fields_of_inputs_and_intermediates() -> None:
    x, params = _args()
    found = saved_residuals(remat(layer, policy=P.save_only_these_names("hidden")), x, params)
    inputs = {r.source: r for r in found if r.kind == "input"}
    (hidden,) = [r for r in found if r.kind == "intermediate"]
    assert set(inputs) == {"x", "params['w1']", "params['w2']"}
    assert inputs["params['w1']"].shape == (3, 5) and inputs["params['w1']"].op is None
    assert hidden == Residual(
        shape=(4, 5), dtype=D, nbytes=4 * 5 * 8, kind="intermediate", op=torch.ops.aten.gelu.default,
        name="hidden", source=hidden.source, region="layer",
    )
    assert re.fullmatch(r"test_saved_residuals\.py:\d+", hidden.source or "")


def test_only_inputs_that_need_grad_count_and_regions_are_listed() -> None:
    x, params = _args()
    first = remat(layer, policy=P.dots_saveable)
    second = remat(lambda h, p: torch.sin(h) @ p["w1"], policy=P.nothing_saveable)

    def model(x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        return second(first(x, params), params).sum()

    found = saved_residuals(model, x, params)
    assert {r.region for r in found} == {"layer", "test_only_inputs_that_need_grad_count_and_regions_are_listed.<locals>.<lambda>"}
    assert sum(r.nbytes for r in found) > 0


def test_report_equals_measured_bytes() -> None:
    x, params = _args()
    x.requires_grad_()
    params = {k: v.requires_grad_() for k, v in params.items()}
    for policy in (None, P.dots_saveable, P.everything_saveable):
        f = remat(layer, policy=policy)
        assert sum(r.nbytes for r in saved_residuals(f, x, params)) == saved_tensor_bytes(f, x, params)


def test_print_ends_with_the_total(capsys: pytest.CaptureFixture[str]) -> None:
    x, params = _args()
    print_saved_residuals(remat(layer, policy=P.dots_saveable), x, params)
    lines = capsys.readouterr().out.strip().splitlines()
    assert "from the argument x" in lines[0]
    assert any("output of aten.mm.default from test_saved_residuals.py:" in line for line in lines)
    total = sum(r.nbytes for r in saved_residuals(remat(layer, policy=P.dots_saveable), x, params))
    assert lines[-1].startswith(f"total: {total} bytes")


def test_non_tensor_arguments_are_allowed() -> None:
    x, params = _args()
    found = saved_residuals(lambda x, p, scale: remat(layer)(x * scale, p), x, params, 2.0)
    assert [r.kind for r in found].count("input") == 3
