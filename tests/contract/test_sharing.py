"""Plans shared between regions whose traced graphs are the same (remat/_plans/sharing.py).

Oracles: the same code without remat (values, gradients, random draws), and how many joint
forward+backward graphs remat traced: one for layers that are the same computation, one
each for regions that differ in anything the graph depends on.
"""

from __future__ import annotations

import copy
import gc
from typing import Any, Callable

import model_zoo as Z
import pytest
import torch
import torch.nn.functional as F

import remat
from remat import clear_cache, saved_residuals
from remat._api import decorator as _remat
from remat import policies as P
from remat import remat as rematerialize
from remat._api.reports import recording
from remat._core.torch_internals import torch_at_least

from conftest import assert_close

D = torch.float64


@pytest.fixture
def joint_traces(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The regions whose joint forward+backward graph remat traces for a plan, in order
    (not the joints a plan traces again for a gradient laid out otherwise, as `.sum()`'s)."""
    traced: list[str] = []
    differentiate = _remat.differentiate

    def counted(captured: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("tangent_strides"):
            traced.append(captured.scopes[0].region)
        return differentiate(captured, *args, **kwargs)

    monkeypatch.setattr(_remat, "differentiate", counted)
    clear_cache()  # plans shared by earlier tests would hide these tests' traces
    return traced


def _grads(f: Callable[..., torch.Tensor], *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    out = f(*args)
    return (out, *torch.autograd.grad(out.sum(), [a for a in args if a.requires_grad]))


def _leaf(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(seed)).requires_grad_()


@pytest.mark.models
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_layers_of_a_transformers_llama_share_one_plan(joint_traces: list[str], attn: str) -> None:
    torch.manual_seed(0)
    reference = Z.llama(attn)  # two decoder layers, attention dropout on, training mode
    model = copy.deepcopy(reference)
    remat.checkpoint_layers(model.model.layers, P.dots_saveable, prefix="layers")
    batch = Z._tokens(Z.BATCH)

    def step(m: torch.nn.Module) -> tuple[Any, ...]:
        torch.manual_seed(1)
        loss = m(**batch).loss
        grads = torch.autograd.grad(loss, list(m.parameters()))
        return loss, grads, torch.rand(3)  # the random stream after forward and backward

    assert_close(step(model), step(reference))
    assert joint_traces == ["layers.0"]  # layers.1 is like layers.0: it takes its plan, no trace
    assert [(i["traces"], i["like"]) for i in (layer.forward.cache_info() for layer in model.model.layers)] == [(1, 0), (0, 1)]
    with recording() as report:
        model(**batch)
    assert {r.region for r in report.residuals if r.kind == "intermediate"} == {"layers.0", "layers.1"}


def test_closures_over_other_tensors_share_and_each_uses_its_own(joint_traces: list[str]) -> None:
    def make(w: torch.Tensor, b: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        def block(x: torch.Tensor) -> torch.Tensor:
            return F.gelu(x @ w + b).tanh() @ w.t()

        return block

    x = _leaf(4, 3, seed=0)
    regions = []  # alive, as a model's layers are: a plan is shared while a region holds it
    for s in (1, 2, 3):
        w, b = _leaf(3, 3, seed=s), _leaf(3, seed=s + 10)
        block = make(w, b)
        regions.append(rematerialize(block, policy=P.dots_saveable))
        out = regions[-1](x)
        expected = block(x)
        assert_close(out, expected)
        assert_close(torch.autograd.grad(out.sum(), (x, w, b)), torch.autograd.grad(expected.sum(), (x, w, b)))
    assert len(joint_traces) == 1


def test_tensors_held_in_tuples_are_each_regions_own(joint_traces: list[str]) -> None:
    """A tensor a function reaches through a tuple is passed to the graph by reference (no
    setter can swap it): a region sharing another's plan passes its own."""
    x = _leaf(4, 3, seed=0)
    regions = []
    for s in (1, 2):
        params = (_leaf(3, 3, seed=s), _leaf(3, seed=s + 10))

        def block(x: torch.Tensor, params: tuple[torch.Tensor, torch.Tensor] = params) -> torch.Tensor:
            return torch.tanh(x @ params[0] + params[1]) @ params[0]

        regions.append(rematerialize(block, policy=P.dots_saveable))
        out, expected = regions[-1](x), block(x)
        assert_close(out, expected)
        assert_close(torch.autograd.grad(out.sum(), (x, *params)), torch.autograd.grad(expected.sum(), (x, *params)))
    assert len(joint_traces) == 1


@pytest.mark.parametrize(
    "variants",
    [
        pytest.param([0.5, -0.5, 0.0, -0.0], id="constants, signed zeros too"),
        pytest.param([0.1, 0.3], id="dropout probability"),
    ],
)
def test_regions_that_differ_in_a_constant_do_not_share(joint_traces: list[str], variants: list[float]) -> None:
    x, w = _leaf(5, 4, seed=0), _leaf(4, 4, seed=1)
    for i, c in enumerate(variants):
        def block(x: torch.Tensor, w: torch.Tensor, c: float = c) -> torch.Tensor:
            h = torch.tanh(x @ w)
            return F.dropout(h, c) if c in (0.1, 0.3) else h * c

        torch.manual_seed(i)
        got = _grads(rematerialize(block), x, w)
        torch.manual_seed(i)
        expected = _grads(block, x, w)
        assert_close(got, expected)
        assert torch.equal(torch.signbit(got[0]), torch.signbit(expected[0]))  # -0.0 stays -0.0
    assert len(joint_traces) == len(variants)


def test_regions_that_differ_in_policy_dtype_or_training_mode_do_not_share(joint_traces: list[str]) -> None:
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w) @ w

    x, w = _leaf(4, 4, seed=0), _leaf(4, 4, seed=1)
    for policy in (None, P.dots_saveable, P.everything_saveable):
        assert_close(_grads(rematerialize(block, policy=policy), x, w), _grads(block, x, w))
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    assert_close(_grads(rematerialize(block), x32, w32), _grads(block, x32, w32))
    assert len(joint_traces) == 4

    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).to(D)
    traced = len(joint_traces)
    for training in (True, False):
        layer.train(training)
        torch.manual_seed(0)
        got = _grads(rematerialize(copy.deepcopy(layer)), x)
        torch.manual_seed(0)
        assert_close(got, _grads(layer, x))
    assert len(joint_traces) == traced + 2


def test_tensors_made_inside_or_generators_passed_in_keep_regions_apart(joint_traces: list[str]) -> None:
    """A tensor constant made inside the function lives on its graph, and a generator is
    state of its own: graphs that hold either are planned one by one."""
    x = _leaf(2, 3, seed=0)
    for values in ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]):
        def scaled(x: torch.Tensor, values: list[float] = values) -> torch.Tensor:
            return torch.sin(x) * torch.tensor(values, dtype=D)

        assert_close(_grads(rematerialize(scaled), x), _grads(scaled, x))
    assert len(joint_traces) == 2
    if not torch_at_least("2.13"):  # torch 2.11's make_fx cannot record a Generator argument (test_exactness)
        return

    for seed in (0, 1):
        generator = torch.Generator().manual_seed(seed)

        def noisy(x: torch.Tensor, generator: torch.Generator = generator) -> torch.Tensor:
            return torch.sin(x) * torch.rand(x.shape, dtype=D, generator=generator)

        state = generator.get_state()
        got = _grads(rematerialize(noisy), x)
        generator.set_state(state)
        assert_close(got, _grads(noisy, x))
    assert len(joint_traces) == 4


def test_nested_regions_with_other_policies_do_not_share(joint_traces: list[str]) -> None:
    x, w = _leaf(4, 4, seed=0), _leaf(4, 4, seed=1)
    for inner_policy in (P.dots_saveable, P.nothing_saveable):
        inner = rematerialize(lambda x, w: torch.tanh(x @ w) @ w, policy=inner_policy)

        def outer(x: torch.Tensor, w: torch.Tensor, inner: Any = inner) -> torch.Tensor:
            return torch.sin(inner(x, w))

        with remat.without_remat():  # the reference: every region runs as plain code
            expected = _grads(outer, x, w)
        assert_close(_grads(rematerialize(outer, policy=P.everything_saveable), x, w), expected)
    assert len(joint_traces) == 2


def test_inputs_at_other_storage_offsets_do_not_share_a_graph_that_reads_them(joint_traces: list[str]) -> None:
    def strided(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x.as_strided((2, 2), (1, 2)))

    base = _leaf(12, seed=0)
    for start in (0, 3):
        view = base[start:]
        assert_close(_grads(rematerialize(strided), view), _grads(strided, view))
    assert len(joint_traces) == 2


def test_a_shared_plan_reports_and_errs_under_its_own_region_name(joint_traces: list[str]) -> None:
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w) @ w

    x, w = _leaf(4, 4, seed=0), _leaf(4, 4, seed=1)
    first = saved_residuals(rematerialize(block, policy=P.dots_saveable, name="first"), x, w)
    second = saved_residuals(rematerialize(block, policy=P.dots_saveable, name="second"), x, w)
    assert joint_traces == ["first"]
    assert {r.region for r in first} == {"first"} and {r.region for r in second} == {"second"}
    assert [(r.shape, r.kind, r.op, r.source) for r in first] == [(r.shape, r.kind, r.op, r.source) for r in second]


def test_clear_cache_drops_shared_plans(joint_traces: list[str]) -> None:
    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x).sin()

    x = _leaf(3, seed=0)
    rematerialize(block, name="a")(x)
    rematerialize(block, name="b")(x)
    clear_cache()
    rematerialize(block, name="c")(x)
    assert joint_traces == ["a", "c"]


def test_a_plan_is_shared_only_while_a_region_holds_it(joint_traces: list[str]) -> None:
    x, w = _leaf(2, 3, seed=0), _leaf(3, 3, seed=1)

    def make() -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: torch.tanh(x @ w)

    first = rematerialize(make(), name="first")
    first(x)
    rematerialize(make(), name="second")(x)  # shares first's plan
    del first
    gc.collect()
    rematerialize(make(), name="third")(x)  # first's function and its plans are gone
    assert joint_traces == ["first", "third"]


def test_layers_that_update_buffers_share_and_each_updates_its_own(joint_traces: list[str]) -> None:
    """BatchNorm's running statistics are inputs the region writes after its forward: a
    layer sharing another's plan updates its own buffers, once, as eager does."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(*[
        torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.BatchNorm2d(3), torch.nn.ReLU()) for _ in range(3)
    ]).to(D).train()
    model = copy.deepcopy(reference)
    remat.checkpoint_layers(model, P.dots_saveable, prefix="blocks")
    x = _leaf(2, 3, 5, 5, seed=0)
    for m in (model, reference):
        for _ in range(2):  # two steps: the second call of each layer is a cache hit
            m(x).square().mean().backward()
    assert joint_traces == ["blocks.0"]
    assert_close({k: p.grad for k, p in model.named_parameters()}, {k: p.grad for k, p in reference.named_parameters()})
    for (name, buffer), expected in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(buffer, expected), name  # running statistics, and num_batches_tracked == 2
