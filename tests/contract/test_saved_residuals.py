"""saved_residuals says exactly what is kept: kind, op, name, source, region, bytes."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from remat import Residual, checkpoint_name, print_saved_residuals, remat, report, saved_residuals, saved_tensor_bytes
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
    assert hidden.source == f"test_saved_residuals.py:{layer.__code__.co_firstlineno + 1}"  # gelu's line


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


def test_print_is_a_table_with_recompute_costs_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    """The per-region summary and the total first, then what is kept, then what is recomputed."""
    x, params = _args()
    print_saved_residuals(remat(layer, policy=P.dots_saveable), x, params)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "per region:" and lines[1].split() == ["region", "kept", "recomputed", "FLOPs", "kept", "tensors"]
    kept_at = lines.index("kept for backward:")
    assert lines[kept_at + 1].split() == ["region", "kind", "op", "name", "shape", "dtype", "bytes", "source"]
    assert any(line.split()[:3] == ["layer", "input", "-"] and line.endswith("x") for line in lines)
    assert any("aten.mm.default" in line and "test_saved_residuals.py:" in line for line in lines)
    gelu = next(line for line in lines if line.startswith("layer") and "aten.gelu.default" in line)
    assert gelu.split()[-1] == "20"  # 4x5 elements, one FLOP each
    total = report(remat(layer, policy=P.dots_saveable), x, params)
    assert next(line for line in lines if line.startswith("total:")).startswith(f"total: {total.kept_bytes} bytes")
    assert lines.index(next(line for line in lines if line.startswith("total:"))) < kept_at
    assert total.recompute_flops == 20 and total.by_region() == {"layer": (total.kept_bytes, 20)}
    assert total.by_region()["layer"].recompute_flops == 20


def test_recompute_flops_count_matmuls_with_torch_formulas() -> None:
    x, params = _args()
    nothing = report(remat(layer, policy=P.nothing_saveable), x, params)
    everything = report(remat(layer, policy=P.everything_saveable), x, params)
    mm = 2 * 4 * 3 * 5  # x[4,3] @ w1[3,5]
    assert nothing.recompute_flops == mm + 20 and everything.recompute_flops == 0
    assert nothing.kept_bytes < everything.kept_bytes


def test_non_tensor_arguments_are_allowed() -> None:
    x, params = _args()
    found = saved_residuals(lambda x, p, scale: remat(layer)(x * scale, p), x, params, 2.0)
    assert [r.kind for r in found].count("input") == 3


def test_saved_tensor_bytes_says_when_the_code_keeps_tensors_out_of_its_sight() -> None:
    """torch.utils.checkpoint keeps what it saves through hooks of its own, which the count
    cannot see: the call warns. A traced remat region and plain code do not."""
    x, params = _args()
    x.requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        saved_tensor_bytes(layer, x, params)
        saved_tensor_bytes(remat(layer, policy=P.dots_saveable), x, params)
    with pytest.warns(UserWarning, match="saved-tensor hooks of its own .*not counted"):
        saved_tensor_bytes(lambda x: torch.utils.checkpoint.checkpoint(layer, x, params, use_reentrant=False), x)
