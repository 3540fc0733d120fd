"""Tensors a function reaches without being passed them get their gradients, never zeros."""

from __future__ import annotations

import argparse
import types
from typing import Any

import pytest
import torch
from torch.func import grad, vmap

from remat import RematStateWarning, RematTraceError, remat
from remat import policies as P

from conftest import assert_close

D = torch.float64


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4)).to(D)


@pytest.mark.parametrize("policy", [None, P.dots_saveable, P.everything_saveable])
def test_closure_over_module_parameters_backward(policy: object) -> None:
    model, reference = _mlp(), _mlp()
    x = torch.randn(3, 4, dtype=D)
    remat(lambda x: model(x), policy=policy)(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad is not None
        assert_close(p.grad, q.grad)


def test_remat_of_a_module() -> None:
    model, reference = _mlp(), _mlp()
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    wrapped = remat(model, policy=P.dots_saveable)
    wrapped(x).sin().sum().backward()
    gx = x.grad.clone()
    x.grad = None
    reference(x).sin().sum().backward()
    assert_close(gx, x.grad)
    assert all(p.grad is not None for p in model.parameters())
    assert_close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])


def test_closure_over_a_tensor_differentiated_by_an_enclosing_grad() -> None:
    x = torch.randn(3, 4, dtype=D)
    w = torch.randn(4, 4, dtype=D)

    def outer(w: torch.Tensor, use_remat: bool) -> torch.Tensor:
        def inner(x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x @ w) @ w

        f = remat(inner, policy=P.nothing_saveable) if use_remat else inner
        return f(x).pow(2).sum()

    assert_close(grad(outer)(w, True), grad(outer)(w, False))
    second = {flag: grad(lambda w: grad(outer)(w, flag).sum())(w) for flag in (True, False)}
    assert_close(second[True], second[False])


def test_closure_under_per_sample_gradients() -> None:
    xs = torch.randn(5, 4, dtype=D)
    w = torch.randn(4, 4, dtype=D)

    def loss(w: torch.Tensor, x: torch.Tensor, use_remat: bool) -> torch.Tensor:
        f = remat(lambda x: torch.tanh(x @ w)) if use_remat else (lambda x: torch.tanh(x @ w))
        return f(x).sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0, None))
    assert_close(per_sample(w, xs, True), per_sample(w, xs, False))


def test_closure_over_a_batched_tensor() -> None:
    ws = torch.randn(3, 4, 4, dtype=D)
    x = torch.randn(2, 4, dtype=D)

    def run(w: torch.Tensor, use_remat: bool) -> torch.Tensor:
        f = remat(lambda x: torch.sin(x @ w)) if use_remat else (lambda x: torch.sin(x @ w))
        return grad(lambda x: f(x).sum())(x)

    assert_close(vmap(run, in_dims=(0, None))(ws, True), vmap(run, in_dims=(0, None))(ws, False))


def test_rebinding_a_captured_variable_is_seen() -> None:
    w = torch.ones(2, 2, dtype=D)
    f = remat(lambda x: (x @ w).sum())
    x = torch.ones(1, 2, dtype=D, requires_grad=True)
    assert f(x).item() == 4.0
    w = torch.full((2, 2), 3.0, dtype=D)  # noqa: F841 - read by the lambda through its cell
    assert f(x).item() == 12.0
    assert f.cache_info()["traces"] == 1


GLOBAL_WEIGHT = torch.randn(4, 4, dtype=D, requires_grad=True)


def _uses_global(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ GLOBAL_WEIGHT)


def test_global_parameter_gets_its_gradient() -> None:
    x = torch.randn(3, 4, dtype=D)
    GLOBAL_WEIGHT.grad = None
    remat(_uses_global)(x).sum().backward()
    expected = torch.autograd.grad(_uses_global(x).sum(), GLOBAL_WEIGHT)[0]
    assert_close(GLOBAL_WEIGHT.grad, expected)


def test_a_global_under_a_transform_is_a_constant_of_it_as_without_remat() -> None:
    """A notebook's globals: torch.func.grad differentiates its argument, and a global
    tensor is a constant to it (as in JAX); the plain autograd graph still reaches it."""
    x = torch.randn(3, 4, dtype=D)
    GLOBAL_WEIGHT.grad = None
    actual = grad(lambda x: remat(_uses_global)(x).sum())(x)
    assert_close(actual, grad(lambda x: _uses_global(x).sum())(x))


class _Holder:
    weight = torch.randn(4, 4, dtype=D)


HOLDER = _Holder()


def test_a_tensor_behind_an_arbitrary_object_under_a_transform_is_an_error() -> None:
    """remat looks through closures, globals, containers, modules and the attributes of
    instances of the user's classes, not class attributes; under a transform it cannot tell
    whether such a tensor is differentiated."""
    x = torch.randn(3, 4, dtype=D)
    with pytest.raises(RematTraceError, match="Pass it as an argument"):
        grad(lambda x: remat(lambda x: torch.tanh(x @ HOLDER.weight))(x).sum())(x)


class _Settings:
    def __init__(self) -> None:
        self.scale = torch.full((4,), 2.0, dtype=D)


def test_a_tensor_an_instance_of_the_user_s_class_holds_is_read_on_every_call() -> None:
    """An attribute rebound between calls is seen (no retrace: a new input of the same
    signature), one that requires grad gets its gradient, and one an enclosing grad
    differentiates is differentiated, each as without remat."""
    settings = _Settings()

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * settings.scale).sum()

    region = remat(f)
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    assert_close(region(x), f(x))
    settings.scale = torch.full((4,), 3.0, dtype=D)
    assert_close(torch.autograd.grad(region(x), x), torch.autograd.grad(f(x), x))
    assert region.cache_info()["traces"] == 1
    settings.scale = torch.full((4,), -0.5, dtype=D, requires_grad=True)
    assert_close(torch.autograd.grad(region(x), (x, settings.scale)), torch.autograd.grad(f(x), (x, settings.scale)))

    def through(scale: torch.Tensor) -> torch.Tensor:
        settings.scale = scale
        return region(x.detach())

    expected = grad(lambda s: f(x.detach()) if setattr(settings, "scale", s) is None else None)(torch.ones(4, dtype=D))
    assert_close(grad(through)(torch.ones(4, dtype=D)), expected)


class _Frozen:
    table = torch.randn(4, dtype=D)


def test_a_tensor_behind_a_class_attribute_is_held_by_the_plan_and_said_so() -> None:
    """Outside transforms such a tensor is a constant of the trace: the trace warns, naming
    the line and the fix; the values are those without remat, and a change in place is seen."""
    region = remat(lambda x: torch.tanh(x * _Frozen.table))
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    with pytest.warns(RematStateWarning, match=r"reads a \(4,\) torch.float64 tensor at .*test_closures.py:\d+ that is neither"):
        got = region(x)
    assert_close(got, torch.tanh(x * _Frozen.table))
    with torch.no_grad():
        _Frozen.table.mul_(-2.0)
    assert_close(torch.autograd.grad(region(x).sum(), x), torch.autograd.grad(torch.tanh(x * _Frozen.table).sum(), x))


def test_a_rebound_global_is_seen_on_the_next_call() -> None:
    global GLOBAL_SCALE
    f = remat(lambda x: (x * GLOBAL_SCALE).sum())
    x = torch.ones(3, dtype=D, requires_grad=True)
    GLOBAL_SCALE = torch.tensor(2.0, dtype=D, requires_grad=True)
    assert f(x).item() == 6.0
    GLOBAL_SCALE = torch.tensor(5.0, dtype=D, requires_grad=True)
    out = f(x)
    out.backward()
    assert out.item() == 15.0 and GLOBAL_SCALE.grad.item() == 3.0
    assert f.cache_info()["traces"] == 1  # same signature: a new tensor is a new input, not a new plan


GLOBAL_SCALE = torch.tensor(1.0, dtype=D)


def test_changing_a_captured_number_or_module_setting_retraces() -> None:
    scale = 2.0
    f = remat(lambda x: (x * scale).sum())
    x = torch.ones(3, dtype=D, requires_grad=True)
    assert f(x).item() == 6.0
    scale = 5.0  # noqa: F841 - read by the lambda through its cell
    assert f(x).item() == 15.0
    norm = torch.nn.LayerNorm(3, dtype=D)
    g = remat(norm)
    y = torch.randn(2, 3, dtype=D, requires_grad=True)
    g(y)
    norm.eps = 0.5
    assert_close(g(y), torch.nn.functional.layer_norm(y, (3,), norm.weight, norm.bias, 0.5))
    assert f.cache_info()["traces"] == 2 and g.cache_info()["traces"] == 2


class _ClassSettings:
    """Settings kept as class attributes, changed at run time (`_ClassSettings.scale = ...`)."""

    scale = 2.0


class _MoreClassSettings(_ClassSettings):
    shift = 1.0


SETTINGS = types.SimpleNamespace(scale=2.0)
ARGS = argparse.Namespace(scale=2.0)


def _read_namespace(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * SETTINGS.scale


def _read_arguments(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * ARGS.scale


def _read_class(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * _MoreClassSettings.scale + _MoreClassSettings.shift


@pytest.mark.parametrize("fn", [_read_namespace, _read_arguments, _read_class], ids=lambda f: f.__name__)
def test_a_setting_read_from_a_namespace_or_a_class_changed_between_calls_is_seen(fn: Any) -> None:
    """A number read from a `types.SimpleNamespace`, an `argparse.Namespace` or a class of
    the user's code (its own or a base's attribute) is part of what a plan depends on: a
    call after it changed traces again, as eager code reads the new value."""
    x = torch.linspace(-1, 1, 5, dtype=D)
    region = remat(fn)
    try:
        for value in (2.0, 3.0, 0.5):
            SETTINGS.scale = ARGS.scale = _ClassSettings.scale = value
            _MoreClassSettings.shift = value - 1
            a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
            out, expected = region(a), fn(b)
            out.sum().backward()
            expected.sum().backward()
            assert torch.equal(out, expected) and torch.equal(a.grad, b.grad)
    finally:
        SETTINGS.scale = ARGS.scale = _ClassSettings.scale = 2.0
        _MoreClassSettings.shift = 1.0
    assert region.cache_info()["traces"] == 3


def test_functional_call_over_a_rematerialized_module() -> None:
    model, reference = _mlp(), _mlp()
    wrapped = remat(model, policy=P.dots_saveable)
    assert dict(wrapped.named_parameters()).keys() == dict(model.named_parameters()).keys()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(5, 4, dtype=D)

    def objective(m: torch.nn.Module) -> object:
        loss = lambda p, x: torch.func.functional_call(m, p, (x,)).pow(2).sum()  # noqa: E731
        return torch.func.grad(loss)(params, x), vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)

    assert_close(objective(wrapped), objective(reference))
    wrapped.eval()
    assert not model.training and not wrapped.training


GLOBAL_FACTOR = 2.0


class _ReadsAGlobal(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * GLOBAL_FACTOR


@pytest.mark.parametrize("wrap", ["module", "forward"])
def test_a_number_a_module_s_forward_reads_from_its_globals_is_keyed(wrap: str) -> None:
    global GLOBAL_FACTOR
    torch.manual_seed(0)
    module = _ReadsAGlobal()
    f = remat(module if wrap == "module" else module.forward, policy=P.nothing_saveable)
    x = torch.randn(2, 4, dtype=D, requires_grad=True)
    try:
        for factor in (2.0, 3.0, 2.0):
            GLOBAL_FACTOR = factor
            got, expected = f(x), module(x)
            assert torch.equal(got, expected)
            assert_close(torch.autograd.grad(got.sum(), x), torch.autograd.grad(expected.sum(), x))
    finally:
        GLOBAL_FACTOR = 2.0
    assert f.cache_info()["traces"] == 2 and f.cache_info()["hits"] == 1
