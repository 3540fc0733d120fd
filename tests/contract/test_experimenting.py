"""Instruments for selective recomputation: reports, compare, per-layer policies, combinators, warnings."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from remat import (
    RematPolicyWarning,
    checkpoint_layers,
    checkpoint_name,
    compare,
    format_comparison,
    plot_by_region,
    plot_frontier,
    policy_schedule,
    remat,
    report,
    saved_residuals,
    using_policy,
)
from remat import policies as P

from conftest import assert_close

D = torch.float64


def block(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    h = checkpoint_name(F.gelu(F.layer_norm(x, (x.shape[-1],)) @ p["w1"]), "hidden")
    return x + h @ p["w2"]


def _params(layers: int = 4) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [{"w1": torch.randn(8, 32, dtype=D, generator=gen), "w2": torch.randn(32, 8, dtype=D, generator=gen) / 6} for _ in range(layers)]


def _stack(block_fns: list[Any]) -> Any:
    def loss(x: torch.Tensor, params: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        for fn, p in zip(block_fns, params):
            x = fn(x, p)
        return x.pow(2).sum()

    return loss


X = torch.randn(16, 8, dtype=D, generator=torch.Generator().manual_seed(1))


def test_report_totals_per_region_and_overall() -> None:
    first, second = remat(block, policy=P.dots_saveable), remat(lambda x, p: torch.tanh(block(x, p)), policy=None)
    found = report(_stack([first, second]), X, _params(2))
    regions = found.by_region()
    assert set(regions) == {"block", "test_report_totals_per_region_and_overall.<locals>.<lambda>"}
    assert sum(kept for kept, _ in regions.values()) == found.kept_bytes
    assert sum(flop for _, flop in regions.values()) == found.recompute_flops > 0
    text = str(found)
    assert text.startswith("per region:") and "kept for backward:" in text and "recomputed in backward:" in text
    assert text.index("total:") < text.index("kept for backward:") < text.index("recomputed in backward:")


def test_compare_orders_policies_by_memory_and_recompute(tmp_path: Path) -> None:
    loss = _stack([remat(block)] * 4)
    rows = compare(loss, X, _params(), policies=[P.nothing_saveable, P.dots_saveable, P.everything_saveable], measure=True, repeats=1)
    by_name = {r.policy: r for r in rows}
    nothing, dots, everything, plain = (by_name[k] for k in ("nothing_saveable", "dots_saveable", "everything_saveable", "no remat"))
    assert nothing.kept_bytes < dots.kept_bytes < everything.kept_bytes == plain.kept_bytes
    assert nothing.recompute_flops > dots.recompute_flops > everything.recompute_flops == 0
    assert all(r.step_seconds is not None and r.step_seconds > 0 for r in rows)
    assert set(rows[0].as_dict()) == {"policy", "kept_bytes", "recompute_flops", "step_seconds", "peak_bytes", "step_spread_seconds"}
    assert all(r.step_spread_seconds is not None and r.step_spread_seconds >= 0 for r in rows)
    assert format_comparison(rows).splitlines()[0].split() == ["policy", "kept", "recompute", "step", "peak"]
    pytest.importorskip("matplotlib")
    plot_frontier(rows, str(tmp_path / "frontier.png"))
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_wraps_a_function_without_regions() -> None:
    rows = compare(lambda x, p: block(x, p).sum(), X, _params(1)[0], policies=[P.nothing_saveable, P.everything_saveable])
    assert rows[1].kept_bytes < rows[2].kept_bytes == rows[0].kept_bytes


def test_using_policy_overrides_every_region_and_is_cached_apart() -> None:
    f = remat(block, policy=P.nothing_saveable)
    x = X.clone().requires_grad_()
    with using_policy(P.everything_saveable):
        overridden = saved_residuals(f, x, _params(1)[0])
    own = saved_residuals(f, x, _params(1)[0])
    assert sum(r.nbytes for r in overridden) > sum(r.nbytes for r in own)
    assert all(r.kind == "input" for r in own)


def test_policy_schedule_forms() -> None:
    d, n = P.dots_saveable, P.nothing_saveable
    assert policy_schedule(d, 3) == [d, d, d]
    assert policy_schedule([d, n, None], 3) == [d, n, None]
    assert policy_schedule(lambda i: d if i < 2 else n, 4) == [d, d, n, n]
    assert policy_schedule({"0": n, "blocks.10": d, "*": None}, ["blocks.0", "blocks.10", "blocks.2"]) == [None, d, None]
    assert policy_schedule({range(1, 3): d, "blocks": n}, ["blocks.0", "blocks.1", "blocks.2"]) == [n, d, d]
    assert policy_schedule({0: n, "*": d}, 2) == [n, d]
    with pytest.raises(ValueError, match="3 policies given for 2 layers"):
        policy_schedule([d, d, d], 2)
    with pytest.raises(KeyError, match="no entry matches layer '1'"):
        policy_schedule({"0": d}, 2)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 32, dtype=D), torch.nn.Linear(32, 8, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def test_checkpoint_layers_gives_each_layer_its_policy() -> None:
    torch.manual_seed(0)
    plain = torch.nn.Sequential(*[Block() for _ in range(4)])
    model = torch.nn.Sequential(*[Block() for _ in range(4)])
    model.load_state_dict(plain.state_dict())
    schedule = checkpoint_layers(model, lambda i: P.dots_saveable if i < 2 else P.nothing_saveable)
    assert schedule == [P.dots_saveable] * 2 + [P.nothing_saveable] * 2
    x = X.clone().requires_grad_()
    kept = saved_residuals(lambda x: model(x).sum(), x)
    assert len([r for r in kept if r.kind == "intermediate"]) == 2  # fc1's addmm output in each of the first two layers
    model(x).pow(2).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    plain(x).pow(2).sum().backward()
    assert_close((gx, [p.grad for p in model.parameters()]), (x.grad, [p.grad for p in plain.parameters()]))
    checkpoint_layers(model, {"0": "no remat", "*": P.everything_saveable})
    assert model[0].forward == model[0].__dict__["_remat_original_forward"]


def test_reports_name_each_layer_by_its_place_and_keep_their_totals_apart() -> None:
    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layers = (torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(3))
            self.blocks = torch.nn.ModuleList(layers).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    model = Stack()
    x = torch.randn(2, 6, dtype=D, requires_grad=True)
    expected = model(x)
    checkpoint_layers(model.blocks, [P.dots_saveable, P.nothing_saveable, P.everything_saveable], prefix="blocks")
    assert_close(model(x), expected)
    totals = report(lambda x: model(x).sum(), x).by_region()
    assert list(totals) == ["blocks.0", "blocks.1", "blocks.2"]
    kept = [bytes_kept for bytes_kept, _ in totals.values()]
    assert kept[0] > kept[1] and kept[2] > kept[1]  # each layer's own policy, not one row for all
    checkpoint_layers(model.blocks, P.dots_saveable)
    assert list(report(lambda x: model(x).sum(), x).by_region()) == ["Sequential[0]", "Sequential[1]", "Sequential[2]"]
    with pytest.raises(TypeError, match="name must be a non-empty string"):
        remat(block, name="")


def _ops_kept(policy: Any) -> list[str]:
    x = X.clone().requires_grad_()
    return sorted(P.op_key(r.op) for r in saved_residuals(remat(block, policy=policy), x, _params(1)[0]) if r.kind == "intermediate")


def test_combinators() -> None:
    dots, gelu = P.dots_saveable, P.save_ops("aten::gelu")
    # (the second matmul's output is allowed too, but backward never reads it)
    assert _ops_kept(dots | gelu) == _ops_kept(P.save_from_both_policies(dots, gelu)) == ["aten::gelu", "aten::mm"]
    assert _ops_kept(dots & gelu) == []
    assert "aten::mm" not in _ops_kept(~dots) and "aten::gelu" in _ops_kept(~dots)
    keep_mean = lambda op, *args, **kwargs: P.op_key(op) == "aten::native_layer_norm"  # noqa: E731
    assert _ops_kept(keep_mean | dots) == _ops_kept(dots | keep_mean)
    assert repr(dots | ~gelu) == "(dots_saveable | ~save_ops(aten::gelu))"


def test_predicate_on_output_size() -> None:
    small = _ops_kept(P.output_smaller_than(2048))  # layer_norm's outputs (1280 bytes), not [16, 32] ones (4096)
    assert set(small) == {"aten::native_layer_norm"}
    big = P.keep_outputs_where(lambda out: isinstance(out, torch.Tensor) and out.shape[-1] == 32, "width 32")
    assert _ops_kept(big) == ["aten::gelu", "aten::mm"] and repr(big) == "width 32"


def test_unmatched_op_or_name_warns_with_what_occurs() -> None:
    x = X.clone().requires_grad_()
    with pytest.warns(RematPolicyWarning, match=r"aten::mmm.*Ops that occur: .*aten::mm"):
        remat(block, policy=P.save_ops("aten::mmm"))(x, _params(1)[0])
    with pytest.warns(RematPolicyWarning, match=r"'hiden'.*checkpoint_names that occur: 'hidden'"):
        remat(block, policy=P.save_only_these_names("hiden"))(x, _params(1)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat(block, policy=P.save_ops(torch.ops.aten.mm) | P.save_only_these_names("hidden"))(x, _params(1)[0])


def test_reports_at_model_scale_put_each_layer_first_and_a_module_s_state_on_one_line(tmp_path: Path) -> None:
    """A layer stack's report: one summary row per layer, labeled totals, a module region's
    parameters and buffers as one row per layer (not one per tensor), and a bar chart."""
    model = torch.nn.Sequential(*[Block() for _ in range(3)])
    checkpoint_layers(model, P.dots_saveable, prefix="blocks")
    x = X.clone().requires_grad_()
    found = report(lambda x: model(x).sum(), x)
    totals = found.by_region()
    assert list(totals) == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(t == (t.kept_bytes, t.recompute_flops) for t in totals.values())
    assert sum(t.kept_bytes for t in totals.values()) == found.kept_bytes
    lines = str(found).splitlines()
    summary = lines[2:5]
    assert [line.split()[0] for line in summary] == ["blocks.0", "blocks.1", "blocks.2"]
    state = [r for r in found.residuals if r.kind == "input" and (r.source or "").startswith("self.")]
    assert len(state) > 3  # several parameters per layer ...
    rows = [line for line in lines if "self.* (parameters and buffers)" in line]
    assert len(rows) == 3  # ... shown as one row per layer
    assert not any(line.rstrip().endswith(".weight") for line in lines)
    pytest.importorskip("matplotlib")
    plot_by_region(found, str(tmp_path / "layers.png"))
    assert (tmp_path / "layers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
