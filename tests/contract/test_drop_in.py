"""remat where torch.utils.checkpoint's call forms are: `checkpoint(fn, *args, **kwargs)`,
selective checkpointing's `policy_fn` and `context_fn`, `checkpoint_sequential`,
`apply_activation_checkpointing`, and whole models (`checkpoint_model`).

Oracles: the same code without remat (float64, dropout on, the same seed), and
torch.utils.checkpoint's own functions where they compute the same thing.
"""

from __future__ import annotations

import copy
import functools
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat
from remat import RematError
from remat import policies as P
from remat._api.torch_style import region_for

from conftest import assert_close

D = torch.float64
aten = torch.ops.aten


def _block(x: torch.Tensor, w: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    return torch.nn.functional.dropout(torch.tanh(x @ w), p=0.3) * scale @ w.t()


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=g, dtype=D, requires_grad=True)
    w = torch.randn(6, 6, generator=g, dtype=D, requires_grad=True)
    return x, w


def _step(call: object, steps: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Loss and gradients of `steps` calls, each with a new partial (as callers pass them)."""
    x, w = _inputs()
    torch.manual_seed(7)
    losses = []
    for _ in range(steps):
        loss = call(x, w).sum()  # type: ignore[operator]
        loss.backward()
        losses.append(loss.detach())
    return losses, [x.grad, w.grad]  # type: ignore[list-item]


def test_checkpoint_in_torch_s_call_form_equals_no_remat_and_traces_once() -> None:
    expected = _step(lambda x, w: _block(x, w, scale=2.0))
    actual = _step(lambda x, w: remat.checkpoint(functools.partial(_block, scale=2.0), x, w, use_reentrant=False))
    assert all(torch.equal(a, b) for a, b in zip(actual[0] + actual[1], expected[0] + expected[1]))
    info = region_for(_block, policy=None).cache_info()  # type: ignore[attr-defined]
    assert info["traces"] == 1 and info["hits"] == 2, info


def test_checkpoint_reads_torch_s_keywords_as_what_they_mean() -> None:
    x, w = _inputs()
    expected = _block(x, w)
    for keywords in (
        {"use_reentrant": True},
        {"use_reentrant": False, "preserve_rng_state": False},
        {"determinism_check": "none", "debug": True},
    ):
        torch.manual_seed(3)
        reference = _block(x, w)
        torch.manual_seed(3)
        assert torch.equal(remat.checkpoint(_block, x, w, **keywords), reference), keywords
    with pytest.raises(ValueError, match="determinism_check"):
        remat.checkpoint(_block, x, w, determinism_check="sometimes")
    with pytest.raises(RematError, match="not torch's selective checkpointing"):
        remat.checkpoint(_block, x, w, context_fn=lambda: (torch.no_grad(), torch.no_grad()))
    assert expected.shape == (4, 6)


def test_checkpoint_without_arguments_is_jax_s_alias_of_remat() -> None:
    wrapped = remat.checkpoint(_block, policy=P.dots_saveable)
    assert isinstance(wrapped, remat.Rematerialized) and wrapped.policy is P.dots_saveable
    decorated = remat.checkpoint(policy=P.nothing_saveable)(_block)
    assert isinstance(decorated, remat.Rematerialized)
    with pytest.raises(TypeError, match="first argument is the function"):
        remat.checkpoint(torch.ones(2), torch.ones(2))


def _keep_mm(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op == aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def _kept(policy: object) -> list[tuple[str, tuple[int, ...]]]:
    x, w = _inputs()
    return sorted((str(r.op), tuple(r.shape)) for r in remat.saved_residuals(remat.remat(_block, policy=policy), x, w))


def test_a_selective_checkpoint_policy_keeps_what_the_same_remat_policy_keeps() -> None:
    """torch's policy_fn, its op list, and its context_fn each keep what save_ops(mm) keeps."""
    native = _kept(P.save_ops(aten.mm))
    assert any("mm" in op for op, _ in native)
    assert _kept(P.from_selective_checkpoint(_keep_mm)) == native
    assert _kept(P.from_selective_checkpoint([aten.mm.default])) == native
    context_fn = functools.partial(create_selective_checkpoint_contexts, _keep_mm)
    x, w = _inputs()
    torch.manual_seed(5)
    reference = _block(x, w)
    torch.manual_seed(5)
    assert torch.equal(remat.checkpoint(_block, x, w, context_fn=context_fn, use_reentrant=False), reference)
    region = region_for(_block, policy=P.from_selective_checkpoint(_keep_mm))
    assert sorted((str(r.op), tuple(r.shape)) for r in remat.saved_residuals(region, x, w)) == native


def test_a_torch_policy_fn_passed_as_a_remat_policy_is_refused_naming_the_adapter() -> None:
    x, w = _inputs()
    with pytest.raises(TypeError, match="from_selective_checkpoint"):
        remat.remat(_block, policy=_keep_mm)(x, w)


def _sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(6, 6), nn.Tanh(), nn.Dropout(0.2))]).to(D)


@pytest.mark.parametrize("segments", [1, 2, 4])
def test_checkpoint_sequential_equals_torch_s_and_no_remat(segments: int) -> None:
    model = _sequential()
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(5, 6, dtype=D)
    results = []
    for run in (
        lambda: model(x),
        lambda: remat.checkpoint_sequential(ours, segments, x, use_reentrant=False),
        lambda: torch.utils.checkpoint.checkpoint_sequential(theirs, segments, x, use_reentrant=False),
    ):
        torch.manual_seed(11)
        for _ in range(2):
            run().sum().backward()
        results.append(torch.rand(3))  # where the random stream is afterwards
    for m in (ours, theirs):
        assert_close([p.grad for p in m.parameters()], [p.grad for p in model.parameters()])
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(m.parameters(), model.parameters()))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(6, 12), nn.Linear(12, 6), nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.relu(self.up(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 6)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _train(model: nn.Module, steps: int = 2) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    x = torch.randn(5, 6, dtype=D, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(13)
    losses = []
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
    return losses, {n: p.grad for n, p in model.named_parameters()}  # type: ignore[misc]


def test_apply_activation_checkpointing_keeps_names_and_equals_no_remat() -> None:
    torch.manual_seed(0)
    reference = _Net().to(D)
    model = copy.deepcopy(reference)
    keys = list(model.state_dict())
    chosen = remat.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, _Block), policy=P.dots_saveable)
    assert chosen == ["blocks.0", "blocks.1", "blocks.2"]
    assert list(model.state_dict()) == keys  # no wrapper module in the names
    (losses, grads), (ref_losses, ref_grads) = _train(model), _train(reference)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    assert all(block.forward.cache_info()["hits"] >= 1 for block in model.blocks)
    with pytest.raises(TypeError, match="check_fn"):
        remat.apply_activation_checkpointing(model, auto_wrap_policy=object())


def test_checkpoint_model_finds_the_stack_of_like_layers() -> None:
    torch.manual_seed(0)
    reference = _Net().to(D)
    model = copy.deepcopy(reference)
    schedule = remat.checkpoint_model(model, {range(1, 3): P.dots_saveable, "*": "no remat"})
    assert schedule == {"blocks.0": "no remat", "blocks.1": P.dots_saveable, "blocks.2": P.dots_saveable}
    (losses, grads), (ref_losses, ref_grads) = _train(model), _train(reference)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    assert not hasattr(model.blocks[0].forward, "cache_info")
    assert model.blocks[2].forward.cache_info()["hits"] >= 1
    with pytest.raises(ValueError, match="checkpoint_layers"):
        remat.checkpoint_model(nn.Linear(2, 2), P.dots_saveable)


def test_checkpoint_layers_takes_the_policy_as_a_keyword_and_specs_name_layers_exactly() -> None:
    model = _Net().to(D)
    assert remat.checkpoint_layers(model.blocks, policy=P.dots_saveable) == [P.dots_saveable] * 3
    with pytest.raises(TypeError, match="once"):
        remat.checkpoint_layers(model.blocks, P.dots_saveable, policy=P.dots_saveable)
    names = [f"blocks.{i}" for i in range(12)]
    schedule = remat.policy_schedule({"blocks.1": P.dots_saveable, "*": None}, names)
    assert schedule == [None, P.dots_saveable] + [None] * 10  # not blocks.10 and blocks.11
    with pytest.raises(ValueError, match="range"):
        remat.policy_schedule({"blocks.1*": P.dots_saveable}, names)


# ---------------------------------------------------------------- torch's own checkpoint tests, ported
# The behaviours torch's test/test_utils.py (TestCheckpoint) checks of torch.utils.checkpoint
# that concern results, run against remat's drop-in. Not ported: how often the forward's
# Python runs (remat runs it once, when it traces, not again in backward), reentrant-only
# errors, and device-state helpers.


def _ported_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(), nn.Linear(20, 5), nn.ReLU())


class _ModuleListNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module_list = nn.ModuleList(_ported_model())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.module_list:
            x = layer(x)
        return x


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("form", ["sequential", "children", "module_list", "module_list_children"])
def test_ported_checkpoint_sequential_equals_no_checkpointing(form: str, use_reentrant: bool) -> None:
    model: nn.Module = _ModuleListNet() if form.startswith("module_list") else _ported_model()
    functions = {
        "sequential": model, "children": list(model.children()),
        "module_list": getattr(model, "module_list", None), "module_list_children": list(getattr(model, "module_list", [])),
    }[form]
    x = torch.randn(1, 100, requires_grad=True)
    out = model(x)
    out.sum().backward()
    expected = (out.detach(), x.grad, [p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
    model.zero_grad()
    y = x.detach().requires_grad_()
    out = remat.checkpoint_sequential(functions, 2, y, use_reentrant=use_reentrant)
    out.sum().backward()
    actual = (out.detach(), y.grad, [p.grad for p in model.parameters()])
    assert_close(actual, expected, rtol=0, atol=0)


def test_ported_gradients_of_gradients_through_checkpoint_sequential() -> None:
    model = _ported_model()
    x = torch.randn(1, 100, requires_grad=True)
    ones = torch.ones(1, 5)
    expected = torch.autograd.grad(model(x), x, ones, create_graph=True)
    out = remat.checkpoint_sequential(list(model.children()), 2, x, use_reentrant=False)
    assert torch.equal(out, model(x))
    actual = torch.autograd.grad(out, x, ones, create_graph=True)
    assert_close(actual, expected, rtol=0, atol=0)


def test_ported_checkpoint_sequential_refuses_several_inputs_and_none() -> None:
    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return a, b

    a, b = torch.randn(1, 4, requires_grad=True), torch.randn(1, 4, requires_grad=True)
    with pytest.raises(TypeError):
        remat.checkpoint_sequential(nn.Sequential(Two()), 1, a, b)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        remat.checkpoint_sequential(nn.Sequential(Two()), 1)  # type: ignore[call-arg]


def test_ported_a_dropout_inside_after_one_outside_draws_as_without_checkpointing() -> None:
    first, second = nn.Dropout(), nn.Dropout()
    for _ in range(5):
        x = torch.randn(20000).requires_grad_()
        state = torch.get_rng_state()
        remat.checkpoint(second, first(x), use_reentrant=True).sum().backward()
        with_checkpoint, x.grad = x.grad, None
        torch.set_rng_state(state)
        second(first(x)).sum().backward()
        assert torch.equal(with_checkpoint, x.grad)


def _mixed(t1: torch.Tensor, t2: torch.Tensor, scale: int, t3: torch.Tensor) -> tuple[object, ...]:
    t4 = t1 + t2 * t3
    t5 = t1 * t2 + t3
    t4 *= scale
    t5 *= scale
    return scale, t4, None, True, t5, "bar", t1


def test_ported_non_tensor_arguments_and_outputs() -> None:
    t1, t2, t3 = torch.rand(10, requires_grad=True), torch.rand(10, requires_grad=True), torch.rand(10)
    result = remat.checkpoint(_mixed, t1, t2, 7, t3, use_reentrant=True)
    expected = _mixed(t1, t2, 7, t3)
    assert result[0] == 7 and result[2] is None and result[3] is True and result[5] == "bar"
    for k in (1, 4, 6):
        assert torch.equal(result[k], expected[k])  # type: ignore[arg-type]
    result[1].sum().backward(retain_graph=True)
    result[4].sum().backward(retain_graph=True)
    result[6].sum().backward()
    actual, t1.grad, t2.grad = (t1.grad, t2.grad), None, None
    torch.autograd.backward([expected[1].sum(), expected[4].sum(), expected[6].sum()])  # type: ignore[union-attr]
    assert_close(actual, (t1.grad, t2.grad))
    assert remat.checkpoint(lambda a, b: a if b is None else a + b, t1, None, use_reentrant=True) is not None


def test_ported_no_tensors_at_all() -> None:
    assert remat.checkpoint(_mixed, 0.25, 0.5, 3, 0.75, use_reentrant=True) == _mixed(0.25, 0.5, 3, 0.75)  # type: ignore[arg-type]


def test_ported_an_output_that_needs_no_gradient_beside_one_that_does() -> None:
    x, y = torch.randn(1, 4, requires_grad=True), torch.randn(1, 4)
    out = remat.checkpoint(lambda a, b: (a * 2, b), x, y, use_reentrant=True)
    out[0].sum().backward()
    assert torch.equal(x.grad, torch.full((1, 4), 2.0)) and not out[1].requires_grad


def test_the_call_form_composes_with_torch_func_where_torch_s_checkpoint_cannot() -> None:
    """grad and vmap(grad) through remat.checkpoint's call form equal no remat; torch's own
    checkpoint raises under them (saved-tensor hooks)."""
    x, w = _inputs()
    x, w = x.detach(), w.detach()

    def loss(w: torch.Tensor, x: torch.Tensor, call: object) -> torch.Tensor:
        return call(x, w).pow(2).sum()  # type: ignore[operator]

    def deterministic(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w) @ w.t()

    ours = lambda x, w: remat.checkpoint(deterministic, x, w, use_reentrant=False)  # noqa: E731
    theirs = lambda x, w: torch.utils.checkpoint.checkpoint(deterministic, x, w, use_reentrant=False)  # noqa: E731
    assert torch.equal(torch.func.grad(loss)(w, x, ours), torch.func.grad(loss)(w, x, deterministic))
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, None))
    assert_close(per_sample(w, x, ours), per_sample(w, x, deterministic), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="saved tensor hooks"):
        torch.func.grad(loss)(w, x, theirs)


def test_a_layer_checkpointed_through_the_call_form_is_freed_with_its_regions() -> None:
    """The region cache keyed by a layer lives on the layer: deleting the model frees it
    (a table held by remat, whose regions hold the layer's bound methods, kept it alive)."""
    layer = _Block().to(D)
    alive = weakref.ref(layer)
    x = torch.randn(2, 6, dtype=D)
    for _ in range(2):
        remat.checkpoint(functools.partial(_Block.forward, layer), x, use_reentrant=False).sum().backward()
    del layer
    gc.collect()
    assert alive() is None
