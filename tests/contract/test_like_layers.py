"""Like layers take a traced layer's plan without running their Python (remat/_plans/like_layers.py).

Oracles: the same model without remat (loss and every gradient, bitwise in float64), and
which layers traced: a layer whose modules hold what the traced layer's forward read takes
its plan; a layer that differs in anything its forward reads (a private attribute, an
object, eval mode, a hook, an attribute the forward assigns) traces its own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import remat
from remat import policies as P

D = torch.float64


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    remat.clear_cache()
    yield
    remat.clear_cache()


class Scaled(torch.nn.Module):
    """A layer whose graph depends on a private attribute (not a module setting remat keys on)."""

    def __init__(self, scale: float, mode: Any = None) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, dtype=D)
        self._scale = scale
        self._mode = mode if mode is not None else "tanh"
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.lin(x)) * self._scale
        return torch.tanh(y) if self._mode == "tanh" else torch.sigmoid(y)


def _run(layers: torch.nn.ModuleList, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in layers.parameters():
        p.grad = None
    y = x
    for layer in layers:
        y = layer(y)
    loss = (y**2).sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in layers.parameters()]  # type: ignore[union-attr]


def _against_no_remat(layers: torch.nn.ModuleList, policy: Any = P.dots_saveable, shape: tuple[int, ...] = (3, 8)) -> list[dict[str, int]]:
    """Checkpoint `layers`, compare a step with a step without remat, return each layer's cache_info."""
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=D, requires_grad=True)  # every layer's input needs a gradient, as in a model
    expected = _run(layers, x)
    remat.checkpoint_layers(layers, policy)
    got = _run(layers, x)
    assert torch.equal(got[0], expected[0])
    for g, e in zip(got[1], expected[1]):
        assert torch.equal(g, e)
    return [layer.forward.cache_info() for layer in layers]


def test_like_layers_trace_once() -> None:
    torch.manual_seed(0)
    infos = _against_no_remat(torch.nn.ModuleList(Scaled(1.5) for _ in range(4)))
    assert [(i["traces"], i["like"]) for i in infos] == [(1, 0), (0, 1), (0, 1), (0, 1)]


class Normed(torch.nn.Module):
    """Random draws and buffers a layer updates: each layer's own, once per step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, dtype=D)
        self.norm = torch.nn.BatchNorm1d(8, dtype=D)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.norm(self.lin(x))))


def test_like_layers_draw_and_update_their_own_state() -> None:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Normed() for _ in range(3))
    x = torch.randn(5, 8, dtype=D, requires_grad=True)
    torch.manual_seed(1)
    expected = _run(layers, x)
    stats = [b.clone() for b in layers.buffers()]
    for layer in layers:  # back to the buffers before the step
        layer.norm.reset_running_stats()
    remat.checkpoint_layers(layers, P.nothing_saveable)
    torch.manual_seed(1)
    got = _run(layers, x)
    assert torch.equal(got[0], expected[0]) and all(torch.equal(g, e) for g, e in zip(got[1], expected[1]))
    assert all(torch.equal(b, s) for b, s in zip(layers.buffers(), stats))
    assert [layer.forward.cache_info()["like"] for layer in layers] == [0, 1, 1]


class Masked(Scaled):
    """Keeps a tensor of its own as a plain attribute (not a buffer): an input, like its parameters."""

    def __init__(self, fill: float) -> None:
        super().__init__(1.0)
        self.mask = torch.full((8,), fill, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.mask


def test_layers_with_their_own_tensor_attributes_read_their_own() -> None:
    """Such a tensor is read as an input in the trace (a stand-in), whose form is its
    identity: each layer traces its own plan, and a rebound attribute is seen."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Masked(fill) for fill in (0.5, -2.0, 3.0))
    infos = _against_no_remat(layers)
    assert [(i["traces"], i["like"]) for i in infos] == [(1, 0), (1, 0), (1, 0)]
    layers[2].mask = torch.full((8,), 7.0, dtype=D)  # rebound after sharing: read on the next call
    x = torch.randn(3, 8, dtype=D, requires_grad=True)
    got = _run(layers, x)
    for layer in layers:
        del layer.forward  # the class's forward again: no remat
    expected = _run(layers, x)
    assert torch.equal(got[0], expected[0]) and all(torch.equal(g, e) for g, e in zip(got[1], expected[1]))


def test_a_private_attribute_the_forward_reads_keeps_layers_apart() -> None:
    torch.manual_seed(0)
    infos = _against_no_remat(torch.nn.ModuleList([Scaled(1.5), Scaled(2.0), Scaled(1.5), Scaled(2.0)]))
    assert [(i["traces"], i["like"]) for i in infos] == [(1, 0), (1, 0), (0, 1), (0, 1)]


def test_objects_are_compared_by_identity() -> None:
    class Mode:
        def __eq__(self, other: object) -> bool:
            return other == "tanh"  # equal to "tanh", and yet another object

        __hash__ = object.__hash__

    same = "sigmoid"
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Scaled(1.0, same), Scaled(1.0, same), Scaled(1.0, Mode()), Scaled(1.0, Mode())])
    infos = _against_no_remat(layers)
    assert [(i["traces"], i["like"]) for i in infos] == [(1, 0), (0, 1), (1, 0), (1, 0)]


def test_eval_mode_and_dropout_keep_layers_apart() -> None:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Scaled(1.0) for _ in range(3))
    layers[1].drop.eval()
    infos = _against_no_remat(layers)
    assert [(i["traces"], i["like"]) for i in infos] == [(1, 0), (1, 0), (0, 1)]


def test_a_hook_on_one_layer_keeps_it_apart_and_runs_on_every_call() -> None:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Scaled(1.0) for _ in range(3))
    seen: list[torch.Tensor] = []
    layers[1].lin.register_forward_hook(lambda module, args, out: seen.append(out.detach().clone()))
    infos = _against_no_remat(layers)
    assert [(i["traces"], i["like"]) for i in infos] == [(1, 0), (1, 0), (0, 1)]
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])  # once without remat, once with


def test_a_hook_added_after_sharing_makes_the_plan_stale() -> None:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Scaled(1.0) for _ in range(3))
    _against_no_remat(layers)
    seen: list[torch.Tensor] = []
    layers[2].lin.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    x = torch.randn(3, 8, dtype=D, requires_grad=True)
    _run(layers, x)
    assert len(seen) == 1 and not isinstance(seen[0], torch._subclasses.FakeTensor)


class Assigning(Scaled):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_scale = self._scale  # Python state the forward writes: not vouched for
        return super().forward(x)


class ReadingDict(Scaled):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * vars(self).get("_extra", 1.0)


LOG: list[int] = []


class Appending(Scaled):
    def __init__(self, scale: float) -> None:
        super().__init__(scale)
        self.log = LOG  # the same list in every layer: equal by identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(x.shape[0])  # state the forward changes (remat warns): each layer traces its own
        return super().forward(x)


@pytest.mark.parametrize("cls", [Assigning, ReadingDict, Appending])
@pytest.mark.filterwarnings("ignore::remat.RematStateWarning")
def test_forwards_that_cannot_be_vouched_for_trace_each_layer(cls: type) -> None:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(cls(1.0) for _ in range(3))
    layers[2]._extra = 3.0
    infos = _against_no_remat(layers)
    assert [(i["traces"], i["like"]) for i in infos] == [(1, 0)] * 3


def test_a_changed_setting_finds_its_own_like() -> None:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Scaled(1.0) for _ in range(3))
    _against_no_remat(layers)
    x = torch.randn(3, 8, dtype=D, requires_grad=True)
    for layer in layers:
        layer.drop.eval()  # a module setting: every layer's key changes
    with remat.without_remat():
        expected = _run(layers, x)
    got = _run(layers, x)
    assert torch.equal(got[0], expected[0]) and all(torch.equal(g, e) for g, e in zip(got[1], expected[1]))
    assert [(layer.forward.cache_info()["traces"], layer.forward.cache_info()["like"]) for layer in layers] == [(2, 0), (0, 2), (0, 2)]


FACTOR = 2.0


class Global(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * FACTOR  # a global the trace freezes: in the key, never compared away


def test_a_changed_global_is_not_taken_from_a_like_layer() -> None:
    global FACTOR
    torch.manual_seed(0)
    first, second = Global(), Global()
    x = torch.randn(3, 8, dtype=D, requires_grad=True)
    region = remat.remat(first.forward, policy=P.dots_saveable)  # as checkpoint_layers wraps a layer
    region(x).sum().backward()
    FACTOR = 3.0
    try:
        other = remat.remat(second.forward, policy=P.dots_saveable)
        assert torch.equal(other(x), second(x))
        assert other.cache_info()["like"] == 0
    finally:
        FACTOR = 2.0


def test_a_new_length_is_planned_once_for_all_like_layers() -> None:
    class Mixing(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8, dtype=D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.lin(x))
            return h + torch.softmax(h @ h.transpose(-1, -2), -1) @ h

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Mixing() for _ in range(3))
    _against_no_remat(layers, shape=(2, 5, 8))
    for length in (7, 9, 11):
        x = torch.randn(2, length, 8, dtype=D, requires_grad=True)
        with remat.without_remat():
            expected = _run(layers, x)
        got = _run(layers, x)
        assert torch.equal(got[0], expected[0]) and all(torch.equal(g, e) for g, e in zip(got[1], expected[1]))
    infos = [layer.forward.cache_info() for layer in layers]
    assert [i["like"] for i in infos] == [0, 4, 4]
    assert infos[1]["traces"] == infos[2]["traces"] == 0


def _hf_model(name: str, **config: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = getattr(transformers, f"{name}Config")(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, use_cache=False, **config,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, f"{name}Model")(cfg).to(D)


def _hf_against_no_remat(model: Any) -> list[dict[str, int]]:
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(ids).last_hidden_state.pow(2).sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    expected = step()
    remat.checkpoint_layers(model.layers, P.dots_saveable)
    got = step()
    assert torch.equal(got[0], expected[0]) and len(got[1]) == len(expected[1])
    assert all(torch.equal(g, e) for g, e in zip(got[1], expected[1]))
    return [layer.forward.cache_info() for layer in model.layers]


def test_llama_layers_trace_once() -> None:
    infos = _hf_against_no_remat(_hf_model("Llama"))
    assert [(i["traces"], i["like"]) for i in infos] == [(1, 0), (0, 1), (0, 1), (0, 1)]


def test_sliding_window_and_full_attention_layers_never_share() -> None:
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    model = _hf_model("Qwen2", layer_types=layer_types, sliding_window=4, use_sliding_window=True, max_window_layers=4)
    read = [layer.self_attn.sliding_window for layer in model.layers]
    assert read[0] != read[1] and read[0] == read[2]
    infos = _hf_against_no_remat(model)
    assert [(i["traces"], i["like"]) for i in infos] == [(1, 0), (1, 0), (0, 1), (0, 1)]
