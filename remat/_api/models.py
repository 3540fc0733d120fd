"""A whole model in one line: `checkpoint_model` finds its layers and makes each a region.

A Hugging Face transformers model is checkpointed through its own switch (the one
`gradient_checkpointing_enable` turns), with remat as the checkpoint function: the model
then does what it does under its own checkpointing (the key/value cache turned off with its
warning, module hooks outside the region) and each layer runs as a remat region named by
its path, traced once. Any other model: its stacks of like layers (a `ModuleList` or
`Sequential` of modules of one class, as timm's and torchvision's blocks are) become
regions in place, as `checkpoint_layers` makes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._core.no_remat import is_no_remat
from .layers import PolicySpec, checkpoint_layers, policy_schedule, with_budget
from .torch_style import call_checkpointed

_HF_LAYER = "GradientCheckpointingLayer"  # transformers' base class of checkpointable layers


def checkpoint_model(
    model: torch.nn.Module,
    spec: PolicySpec = None,
    *,
    policy: PolicySpec = None,
    budget: int | float | None = None,
    dynamic: bool = False,
    fallback: bool = True,
) -> dict[str, Any]:
    """Rematerialize every layer of `model`, each with its policy; returns {layer path: policy}.

    `spec` (or `policy=`) is one policy, one per layer, or a mapping by layer index, range,
    path ("model.layers.3", or "model.layers" for all of them) or "*", as
    `policy_schedule` reads it; `None` keeps nothing but each layer's inputs. `budget` is
    spread over the layers as in `checkpoint_layers`.

    For a transformers model it uses the model's own checkpointing switch with remat in
    place of torch.utils.checkpoint (the model's `activation_checkpointing_disable()` turns
    it off again); in training the model turns its key/value cache off, with its own warning, as
    under its own checkpointing. Other models: each stack of like layers, and the children
    of an `nn.Sequential` model, in place.
    """
    if policy is not None:
        if spec is not None:
            raise TypeError("checkpoint_model: give the policy once, as the second argument or as policy=")
        spec = policy
    if _is_transformers_model(model):
        return _through_transformers_switch(model, spec, budget, dynamic, fallback)
    stacks = _stacks(model)
    if not stacks:
        raise ValueError(
            f"checkpoint_model: found no stack of layers in {type(model).__name__} (a ModuleList or Sequential "
            "of modules of one class). Name the layers yourself: remat.checkpoint_layers(model.blocks, policy), "
            "or remat.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block), policy=...)."
        )
    names = [f"{path}.{i}" if path else str(i) for path, stack in stacks for i in range(len(stack))]
    schedule = with_budget(policy_schedule(spec, names), budget)
    chosen: dict[str, Any] = {}
    for path, stack in stacks:
        mine = schedule[len(chosen) : len(chosen) + len(stack)]
        checkpoint_layers(stack, mine, prefix=path or None, dynamic=dynamic, fallback=fallback)
        chosen.update(zip(names[len(chosen) : len(chosen) + len(stack)], mine))
    return chosen


def _is_transformers_model(model: torch.nn.Module) -> bool:
    return callable(getattr(model, "_set_gradient_checkpointing", None)) and bool(
        getattr(model, "supports_gradient_checkpointing", False)
    )


def _stacks(model: torch.nn.Module) -> list[tuple[str, list[torch.nn.Module]]]:
    """(path, layers) of each outermost stack of like layers (a ModuleList of modules of one
    class, or a Sequential of two or more); an `nn.Sequential` model's children are its
    one stack."""
    if type(model) is torch.nn.Sequential:
        return [("", list(model))]
    found: list[tuple[str, list[torch.nn.Module]]] = []
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p, _ in found) or not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        layers = list(module)
        least = 1 if isinstance(module, torch.nn.ModuleList) else 2  # a Sequential of one is a wrapper, not a stack
        if len(layers) >= least and len({type(layer) for layer in layers}) == 1:
            found.append((path, layers))
    return found


class _LayerCheckpoint:
    """What a transformers layer calls as its checkpoint function: `(partial(forward, layer,
    **kwargs), *args)`, run as the layer's remat region (cached by the layer and its
    forward, never by the new partial each call brings)."""

    def __init__(self, policy: Any, name: str | None, dynamic: bool, fallback: bool) -> None:
        self.options = {"policy": policy, "dynamic": dynamic, "fallback": fallback}
        if name is not None:
            self.options["name"] = name

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return call_checkpointed(function, args, {**kwargs, **self.options})


def _through_transformers_switch(
    model: torch.nn.Module, spec: PolicySpec, budget: int | float | None, dynamic: bool, fallback: bool
) -> dict[str, Any]:
    layers = [(path, m) for path, m in model.named_modules() if any(c.__name__ == _HF_LAYER for c in type(m).__mro__)]
    names = [path for path, _ in layers]
    schedule = with_budget(policy_schedule(spec, names), budget) if layers else []
    default = schedule[0] if schedule and not is_no_remat(schedule[0]) else None
    model._set_gradient_checkpointing(  # type: ignore[operator]
        enable=True, gradient_checkpointing_func=_LayerCheckpoint(default, None, dynamic, fallback)
    )
    for (path, layer), layer_policy in zip(layers, schedule):
        if is_no_remat(layer_policy):
            layer.gradient_checkpointing = False
        else:
            layer._gradient_checkpointing_func = _LayerCheckpoint(layer_policy, path, dynamic, fallback)
    return dict(zip(names, schedule))
