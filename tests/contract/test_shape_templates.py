"""Shape templates (remat/_plans/templates.py): a region called at a new size of a dimension
that changed before traces once with that dimension symbolic; later sizes are specialized
from that trace without running the function.

Oracles: the same code without remat at every size (values, gradients, random draws), a
fresh trace at the same size (what it keeps), and the counts of traces and specialized
plans. The sweep over torch's OpInfo samples at other sizes is in test_opinfo.py.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import model_zoo as Z
import pytest
import torch

import remat
from remat import clear_cache, saved_residuals, saved_tensor_bytes
from remat._plans import templates as _specializing
from remat import policies as P
from remat import remat as rematerialize
from remat._core.torch_internals import symbolic_templates_work

from conftest import assert_close

D = torch.float64
pytestmark = pytest.mark.skipif(
    not symbolic_templates_work(), reason="torch 2.11 fixes every size of a symbolic trace under remat's dispatch modes"
)


@pytest.fixture(autouse=True)
def _templates_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A template as soon as a size changes (by default one is traced when per-size traces
    have cost as much: test_a_template_is_traced_once_per_size_traces_cost_as_much)."""
    monkeypatch.setattr(_specializing, "TEMPLATE_COST_RATIO", 0.0)


LENGTHS = (8, 12, 5, 15, 2, 3)  # 8 traced, 12 traces the template, the others from it (model_zoo's models take 16 at most)


def _leaf(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def _step(f: Callable[..., torch.Tensor], *args: torch.Tensor) -> tuple[Any, ...]:
    torch.manual_seed(1)
    out = f(*args)
    grads = torch.autograd.grad((out * out).sum(), [a for a in args if a.requires_grad])
    return out, grads, torch.rand(3)  # the random stream after forward and backward


@pytest.mark.models
@pytest.mark.parametrize("family", ["llama-sdpa", "llama-eager", "gpt2-eager", "bert-sdpa"])
@pytest.mark.parametrize("policy", [P.nothing_saveable, P.dots_saveable], ids=["nothing", "dots"])
def test_a_transformers_model_at_many_lengths_matches_no_remat(family: str, policy: Any) -> None:
    name, attn = family.split("-")
    torch.manual_seed(0)
    reference = getattr(Z, name)(attn)  # two layers, dropout on, training mode
    model = copy.deepcopy(reference)
    layers = {"llama": lambda m: m.model.layers, "gpt2": lambda m: m.transformer.h, "bert": lambda m: m.bert.encoder.layer}[name](model)
    remat.checkpoint_layers(layers, policy)
    assert len(layers) == 2

    def step(m: torch.nn.Module, length: int) -> tuple[Any, ...]:
        ids = torch.randint(0, Z.VOCAB, (Z.BATCH, length), generator=torch.Generator().manual_seed(length))
        torch.manual_seed(1)
        loss = m(input_ids=ids, labels=ids).loss
        return loss, torch.autograd.grad(loss, list(m.parameters())), torch.rand(3)

    for length in LENGTHS:
        assert_close(step(model, length), step(reference, length))
    first, *further = [layer.forward.cache_info() for layer in layers]
    assert (first["traces"], first["specialized"], first["like"]) == (2, 5, 0), first  # 8, and the template at 12
    for info in further:  # a like layer takes the first layer's plan at each length
        assert (info["traces"], info["specialized"], info["like"]) == (0, 0, len(LENGTHS)), info


def test_a_branch_on_a_size_is_guarded() -> None:
    """The template traced at size 5 took the `cos` branch: sizes above 6 fail its guard
    and are traced as they are (a template that ignored its guards gives cos there), as is
    size 1 (torch specializes sizes 0 and 1: a template's sizes are at least 2)."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = x @ w
        return y.sin() if x.shape[0] > 6 else y.cos()

    region = rematerialize(f, policy=P.nothing_saveable)
    w = _leaf(3, 3, seed=0)
    for n in (4, 5, 9, 6, 2, 10, 1):
        x = _leaf(n, 3, seed=n)
        assert_close(_step(region, x, w), _step(f, x, w))
    assert region.cache_info()["traces"] == 5  # 4, the template at 5, 9, 10, 1
    assert region.cache_info()["specialized"] == 3  # 5, 6, 2


def test_sizes_the_function_needs_equal_stay_equal() -> None:
    region = rematerialize(lambda x, y: (x * y).tanh() @ y.t(), policy=P.dots_saveable)
    for n in (3, 5, 7, 4):
        x, y = _leaf(n, 4, seed=n), _leaf(n, 4, seed=n + 1)
        assert_close(_step(region, x, y), _step(lambda a, b: (a * b).tanh() @ b.t(), x, y))
    assert region.cache_info()["specialized"] == 3
    with pytest.raises(RuntimeError, match="broadcast"):  # as without remat
        region(_leaf(6, 4, seed=0), _leaf(8, 4, seed=1))


def test_two_dimensions_changing_after_a_template_trace_a_wider_one() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x @ w, dim=-1) @ w.t()

    region = rematerialize(f, policy=P.nothing_saveable)
    for batch, length in ((2, 4), (2, 6), (2, 7), (3, 5), (5, 9), (4, 2)):
        x, w = _leaf(batch, length, 3, seed=batch * length), _leaf(3, 5, seed=0)
        assert_close(_step(region, x, w), _step(f, x, w))
    # (2, 4) traced; (2, 6) the template in dim 1; (2, 7) from it; (3, 5) a template in both; then from it
    assert region.cache_info()["traces"] == 3 and region.cache_info()["specialized"] == 5


def test_random_ops_and_layouts_at_specialized_sizes_match_no_remat() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(x @ w, p=0.3)
        return (h + torch.randn_like(h)).relu() @ w.t()

    region = rematerialize(f, policy=P.dots_saveable)
    w = _leaf(3, 3, seed=0)
    for n in (4, 6, 9, 11):
        x = _leaf(3, n, seed=n).transpose(0, 1).detach().requires_grad_()  # not contiguous: strides (1, n)
        assert_close(_step(region, x, w), _step(f, x, w))
    assert region.cache_info()["specialized"] == 3


def test_batch_norm_at_specialized_batch_sizes_updates_running_statistics_as_eager() -> None:
    """BatchNorm's running variance is corrected by n / (n - 1), a float computed from the
    batch size: at each size its own value (a template that kept the traced one would not)."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.GELU()).double()
    model = copy.deepcopy(reference)
    region = rematerialize(model, policy=P.dots_saveable)
    for batch in (2, 4, 3, 6):
        x = _leaf(batch, 3, 6, 6, seed=batch)
        assert_close(_step(region, x), _step(reference, x))
        assert torch.equal(model[1].running_var, reference[1].running_var)
        assert torch.equal(model[1].running_mean, reference[1].running_mean)
        assert torch.equal(model[1].num_batches_tracked, reference[1].num_batches_tracked)
    assert region.cache_info()["specialized"] == 3


def test_a_function_storing_a_size_keeps_ints_and_traces_each() -> None:
    """A symbolic trace would leave a symbolic size in an object the function writes to:
    that size is traced as it is instead (the object then holds the int, as after any
    trace)."""

    class State:
        length: Any = None

    state = State()

    def f(x: torch.Tensor) -> torch.Tensor:
        state.length = x.shape[0]
        return x.sin() * 2

    region = rematerialize(f)
    for n in (3, 4, 5):
        out = region(_leaf(n, 2, seed=n))
        assert out.shape == (n, 2) and type(state.length) is int and state.length == n
    assert region.cache_info()["specialized"] == 0


def test_a_function_returning_a_size_traces_each() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return x.sin() * 2, x.shape[0]

    region = rematerialize(f)
    for n in (3, 4, 5):
        out, size = region(_leaf(n, 2, seed=n))
        assert size == n and type(size) is int and out.shape == (n, 2)
    assert region.cache_info()["traces"] == 3 and region.cache_info()["specialized"] == 0


@pytest.mark.parametrize("policy", [P.nothing_saveable, P.dots_saveable, P.everything_saveable], ids=["nothing", "dots", "everything"])
def test_a_specialized_plan_keeps_what_a_fresh_trace_at_that_size_keeps(policy: Any) -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ w).tanh() @ w.t()

    w = _leaf(8, 8, seed=0)
    region = rematerialize(f, policy=policy)
    for n in (4, 6):
        region(_leaf(n, 8, seed=n), w)
    x = _leaf(11, 8, seed=11)
    specialized = (saved_residuals(region, x, w), saved_tensor_bytes(region, x, w))
    assert region.cache_info()["specialized"] == 2
    clear_cache(f)
    fresh = rematerialize(f, policy=policy)
    assert (saved_residuals(fresh, x, w), saved_tensor_bytes(fresh, x, w)) == specialized
    assert fresh.cache_info()["specialized"] == 0


def test_no_template_under_torch_func_transforms() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).tanh().sum()

    region = rematerialize(f, policy=P.nothing_saveable)
    w = _leaf(3, 3, seed=0)
    for n in (3, 4, 5):
        x = _leaf(n, 3, seed=n)
        assert_close(torch.func.grad(region, argnums=1)(x, w), torch.func.grad(f, argnums=1)(x, w))
    assert region.cache_info()["specialized"] == 0


def test_a_template_is_traced_once_per_size_traces_cost_as_much(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ski rental: each build reads the clock twice, one tick apart, so every trace costs
    1 and the template 3 of them; sizes 2, 3, 4 are traced (rent 3), the fourth size traces
    the template, later ones are specialized. A like region sharing the first one's plans
    prices the template by the plain trace it shares, not by its own cheaper stage 1."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(_specializing, "TEMPLATE_COST_RATIO", 3.0)
    monkeypatch.setattr(_specializing, "_clock", lambda: float(next(ticks)))

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ w) @ w.t()

    region = rematerialize(f, policy=P.dots_saveable)
    w = _leaf(3, 3, seed=0)
    for n in range(2, 9):
        x = _leaf(n, 3, seed=n)
        assert_close(_step(region, x, w), _step(f, x, w))
    assert region.cache_info()["traces"] == 4  # 2, 3, 4, and the template at 5
    assert region.cache_info()["specialized"] == 4  # 5, 6, 7, 8
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_specializing, "TEMPLATE_COST_RATIO", 1e9)  # a template never pays
        never = rematerialize(lambda x, w: f(x, w) * 2, policy=P.dots_saveable)
        for n in range(2, 9):
            never(_leaf(n, 3, seed=n), w)
        assert never.cache_info()["traces"] == 7 and never.cache_info()["specialized"] == 0
