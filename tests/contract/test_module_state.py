"""A module region reads its module afresh on every call: what changes between calls (a
parameter replaced, a buffer, a setting, a submodule, the training flag, a tensor kept
as a plain attribute) changes the result as it does without remat. Each case against the same module
run without remat, values and every gradient (float64). remat skips re-walking a module
whose state is unchanged, so these are the cases that walk must not miss."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from remat import checkpoint_layers, remat
from remat import policies as P

from conftest import BUILT_IN_POLICIES, assert_close, pairwise_in_default

D = torch.float64


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 4, dtype=D), torch.nn.Tanh(), torch.nn.LayerNorm(4, dtype=D), torch.nn.Linear(4, 2, dtype=D)
    )


def _step(model: torch.nn.Module, region: Callable[..., Any], x: torch.Tensor) -> tuple[Any, ...]:
    """Output and gradients (input and every parameter) of region(x).sum()."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = region(x)
    out.sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def _replace_weight(m: torch.nn.Sequential) -> None:
    m[0].weight = torch.nn.Parameter(torch.randn(4, 4, dtype=D))


def _set_weight_in_place(m: torch.nn.Sequential) -> None:
    with torch.no_grad():
        m[0].weight.mul_(2.0)


def _change_eps(m: torch.nn.Sequential) -> None:
    m[2].eps = 0.5


def _replace_submodule(m: torch.nn.Sequential) -> None:
    m[1] = torch.nn.Sigmoid()


def _add_submodule(m: torch.nn.Sequential) -> None:
    m.append(torch.nn.Tanh())


def _rename_parameter(m: torch.nn.Sequential) -> None:
    """The same tensor under another key of the table: the walk's paths change."""
    table = m[3]._parameters
    table["bias"], table["weight"] = table.pop("weight"), table.pop("bias")
    m[3].forward = lambda x: torch.nn.functional.linear(x, m[3]._parameters["bias"], m[3]._parameters["weight"])


def _add_buffer_read_by_forward(m: torch.nn.Sequential) -> None:
    class Shift(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("shift", torch.full((2,), 0.25, dtype=D))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.shift

    m.append(Shift())


def _replace_buffer(m: torch.nn.Sequential) -> None:
    m[-1].shift = torch.full((2,), -1.0, dtype=D)


def _unregistered_tensor_attribute(m: torch.nn.Sequential) -> None:
    m[2].scale = torch.tensor([3.0], dtype=D)  # a plain attribute: walked past, compared without error


class _Scaled(torch.nn.Module):
    """Reads tensors kept as plain attributes (not registered buffers), public and private,
    one of them unset (None) at first."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.full((2,), 2.0, dtype=D)
        self._shift = torch.full((2,), 0.5, dtype=D)
        self._extra: torch.Tensor | None = None
        self.note = "unread"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (x * self.scale + self._shift) * getattr(self, "factor", 1.0)
        return out if self._extra is None else out * self._extra


def _add_module_reading_tensor_attributes(m: torch.nn.Sequential) -> None:
    m.append(_Scaled())


def _rebind_private_tensor_attribute(m: torch.nn.Sequential) -> None:
    m[-1]._shift = torch.full((2,), -3.0, dtype=D)


def _rebind_public_tensor_attribute_to_an_equal_one(m: torch.nn.Sequential) -> None:
    m[-1].scale = m[-1].scale.clone()  # equal values, another object: the next change is to it alone


def _fill_tensor_attribute_in_place(m: torch.nn.Sequential) -> None:
    m[-1].scale.fill_(-1.5)


def _set_tensor_attribute_that_was_none(m: torch.nn.Sequential) -> None:
    m[-1]._extra = torch.full((2,), 4.0, dtype=D)


def _swap_one_setting_for_another(m: torch.nn.Sequential) -> None:
    del m[-1].note
    m[-1].factor = 3.0  # as many attributes as before, under other names


def _eval(m: torch.nn.Sequential) -> None:
    m.eval()


CHANGES: dict[str, list[Callable[[torch.nn.Sequential], None]]] = {
    "replace_weight": [_replace_weight],
    "weight_in_place": [_set_weight_in_place],
    "change_eps": [_change_eps],
    "replace_submodule": [_replace_submodule],
    "add_submodule": [_add_submodule],
    "rename_parameter": [_rename_parameter],
    "add_then_replace_buffer": [_add_buffer_read_by_forward, _replace_buffer],
    "tensor_attribute": [_unregistered_tensor_attribute],
    "tensor_attributes_read_by_forward": [
        _add_module_reading_tensor_attributes, _rebind_private_tensor_attribute,
        _rebind_public_tensor_attribute_to_an_equal_one, _fill_tensor_attribute_in_place,
        _set_tensor_attribute_that_was_none,
    ],
    "swap_setting": [_add_module_reading_tensor_attributes, _swap_one_setting_for_another],
    "eval": [_eval],
}


@pytest.mark.parametrize(
    ("of", "change", "policy_name"),
    pairwise_in_default(["module", "bound_forward", "closure"], list(CHANGES), ["none", "nothing", "dots"]),
)
def test_a_change_between_calls_is_seen_as_without_remat(of: str, change: str, policy_name: str) -> None:
    """`of`: a region of the module, of its bound `forward` (what checkpoint_layers wraps),
    or of a function that closes over it (`checkpoint(lambda t: block(t), x)`)."""
    policy = BUILT_IN_POLICIES[policy_name]
    model = _model()
    wrapped = {"module": model, "bound_forward": model.forward, "closure": lambda t: model(t)}[of]
    region = remat(wrapped, policy=policy)
    x = torch.randn(3, 4, dtype=D)
    for _ in range(3):  # warm: traced, then runs from the plan
        assert_close(_step(model, region, x), _step(model, model, x))
    for apply in CHANGES[change]:
        apply(model)
        for _ in range(2):
            assert_close(_step(model, region, x), _step(model, model, x))


def test_dropout_follows_train_and_eval() -> None:
    """Dropout's training flag, flipped between calls: the random stream and values as without remat."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=D), torch.nn.Dropout(0.5))
    region = remat(model, policy=P.nothing_saveable)
    x = torch.randn(3, 4, dtype=D)
    for mode in ("train", "eval", "train", "eval"):
        getattr(model, mode)()
        torch.manual_seed(1)
        expected = _step(model, model, x)
        torch.manual_seed(1)
        assert_close(_step(model, region, x), expected)


_OFFSET = torch.zeros(2, dtype=D)


class _Block(torch.nn.Module):
    """A layer of the user's code: its forward reads a global tensor and a setting."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2, dtype=D)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + _OFFSET


def _rebind_global(block: _Block) -> None:
    global _OFFSET
    _OFFSET = torch.randn(2, dtype=D)


def _change_scale(block: _Block) -> None:
    block.scale = 3.0


def _replace_block_weight(block: _Block) -> None:
    block.lin.weight = torch.nn.Parameter(torch.randn(2, 4, dtype=D))


@pytest.mark.parametrize("change", [_rebind_global, _change_scale, _replace_block_weight], ids=lambda f: f.__name__[1:])
def test_a_layer_under_checkpoint_layers_sees_changes_as_without_remat(change: Callable[[_Block], None]) -> None:
    """checkpoint_layers wraps each layer's bound forward: a global its code reads, a setting
    and a parameter, changed between calls, change the result as they do without remat."""
    torch.manual_seed(0)
    block = _Block()
    checkpoint_layers([block], P.nothing_saveable)
    eager = lambda x: _Block.forward(block, x)  # noqa: E731
    x = torch.randn(3, 4, dtype=D)
    for _ in range(3):
        assert_close(_step(block, block, x), _step(block, eager, x))
    change(block)
    for _ in range(2):
        assert_close(_step(block, block, x), _step(block, eager, x))


_SHIFT = torch.zeros(2, dtype=D)


class _Shifting(_Block):
    def shifted(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + _SHIFT


def test_a_region_of_another_bound_method_sees_its_globals_rebound() -> None:
    """A region of a module's method other than `forward` reads that method's globals
    afresh: a tensor rebound there between calls is seen."""
    global _SHIFT
    torch.manual_seed(0)
    block = _Shifting()
    region = remat(block.shifted, policy=P.nothing_saveable)
    eager = lambda x: _Shifting.shifted(block, x)  # noqa: E731
    x = torch.randn(3, 4, dtype=D)
    for _ in range(3):
        assert_close(_step(block, region, x), _step(block, eager, x))
    _SHIFT = torch.randn(2, dtype=D)
    assert_close(_step(block, region, x), _step(block, eager, x))
