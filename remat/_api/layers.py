"""Per-layer policies: one policy per layer of a stack, from a list, a function or names."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from remat.policies import memory_budget

from .._core.no_remat import is_no_remat
from .decorator import remat

PolicySpec = Any  # a policy, a list of them, a function of the layer index, or {name pattern: policy}


def _is_index_function(spec: Any) -> bool:
    """A function of the layer index takes one positional parameter; a policy takes *args."""
    if not callable(spec) or hasattr(spec, "references"):
        return False
    try:
        params = list(inspect.signature(spec).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD)


def policy_schedule(spec: PolicySpec, layers: int | Sequence[str]) -> list[Any]:
    """One policy per layer.

    `layers` is the number of layers or their names. `spec` is one of:
    a policy (the same for every layer; `None` keeps nothing but inputs);
    a list with one policy per layer;
    a function of the layer index, e.g. `lambda i: P.dots_saveable if i < 6 else None`;
    a mapping to policies from layer indices, `range`s of them, names ("3", or
    "blocks.3" where layers are named by path; a path also names every layer under it,
    "decoder" matches "decoder.0"), or "*" for every layer: the first matching entry
    wins; "no remat" marks layers to leave alone.

    >>> from remat import policies as P
    >>> policy_schedule(lambda i: P.dots_saveable if i < 2 else P.nothing_saveable, 3)
    [dots_saveable, dots_saveable, nothing_saveable]
    """
    names = [str(i) for i in range(layers)] if isinstance(layers, int) else [str(n) for n in layers]
    if isinstance(spec, (list, tuple)):
        if len(spec) != len(names):
            raise ValueError(f"policy_schedule: {len(spec)} policies given for {len(names)} layers")
        return list(spec)
    if isinstance(spec, Mapping):
        schedule = []
        for key in spec:
            _check_key(key)
        for index, name in enumerate(names):
            match = next((p for key, p in spec.items() if _matches(key, index, name)), _MISSING)
            if match is _MISSING:
                raise KeyError(f"policy_schedule: no entry matches layer {name!r}; add it, its index, or '*'")
            schedule.append(match)
        return schedule
    if _is_index_function(spec):
        return [spec(i) for i in range(len(names))]
    return [spec] * len(names)


_MISSING = object()


def _check_key(key: Any) -> None:
    """Keys are indices, ranges, names or "*": a glob such as "1*" would match layer 10 too."""
    if isinstance(key, (int, range)) or key == "*":
        return
    if not isinstance(key, str):
        raise TypeError(f"policy_schedule: a key is a layer index, a range, a name or '*', not {key!r}")
    if any(c in key for c in "*?["):
        raise ValueError(
            f"policy_schedule: {key!r} is a glob pattern, and a pattern like '1*' would match layer 10 too. "
            "Name layers by index ranges (range(1, 4): layers 1, 2 and 3), exact names, a path that holds "
            "them ('blocks' for every 'blocks.<i>'), or '*' for every layer."
        )


def _matches(key: Any, index: int, name: str) -> bool:
    if key == "*":
        return True
    if isinstance(key, int):
        return key == index
    if isinstance(key, range):
        return index in key
    return name == key or name.startswith(key + ".")


def with_budget(schedule: list[Any], budget: int | float | None) -> list[Any]:
    """`budget` (bytes, or a fraction) spread evenly over the layers not marked "no remat"."""
    if budget is None:
        return schedule
    counted = [p for p in schedule if not is_no_remat(p)]
    share = budget if isinstance(budget, float) else budget // max(len(counted), 1)
    return [p if is_no_remat(p) else memory_budget(share) for p in schedule]


def rematerialize_forward(
    module: torch.nn.Module, policy: Any, name: str, dynamic: bool = False, fallback: bool = True
) -> None:
    """Replace `module.forward` by `remat(its forward, policy=...)`, in place (parameter
    names, hooks and the module's place in the model stay as they were); "no remat" puts
    the original back. Called again, it rewraps the original, never a wrapper."""
    original = module.__dict__.get("_remat_original_forward", module.forward)
    module.__dict__["_remat_original_forward"] = original
    if is_no_remat(policy):
        module.forward = original  # type: ignore[method-assign]
    else:
        module.forward = remat(original, policy=policy, name=name, dynamic=dynamic, fallback=fallback)  # type: ignore[method-assign]

def checkpoint_layers(
    layers: torch.nn.ModuleList | Sequence[torch.nn.Module],
    spec: PolicySpec = None,
    prefix: str | None = None,
    budget: int | float | None = None,
    dynamic: bool = False,
    fallback: bool = True,
    *,
    policy: PolicySpec = _MISSING,
) -> list[Any]:
    """Rematerialize each module of a stack with its own policy, in place.

    Each layer's `forward` is replaced by `remat(forward, policy=...)`, so the model's own
    loop (`for block in self.blocks: x = block(x)`) needs no change. Returns the schedule.
    `spec` (or `policy=`, the same) is one policy or one per layer, in any form
    `policy_schedule` takes; `None` keeps nothing but each layer's inputs.
    Names for a mapping `spec` are the layers' indices ("0", "1", ...). Reports name each
    region by its place: `prefix.3` (give the stack's path in the model, e.g.
    `prefix="model.layers"`), else `Block[3]`, so layers' totals stay apart.

    `budget` (bytes, or a fraction of what keeping everything would keep) is spread evenly
    over the layers `spec` does not mark "no remat": each gets `memory_budget(its share)`.
    `dynamic=True` gives every layer `remat(..., dynamic=True)` (sizes that vary, such as
    sequence lengths, are traced symbolic once they change). `fallback=False` makes a
    layer that cannot be traced raise instead of running as torch.utils.checkpoint does.
    """
    if policy is not _MISSING:
        if spec is not None:
            raise TypeError("checkpoint_layers: give the policy once, as the second argument or as policy=")
        spec = policy
    modules = list(layers)
    schedule = with_budget(policy_schedule(spec, len(modules)), budget)
    for index, (module, layer_policy) in enumerate(zip(modules, schedule)):
        name = f"{prefix}.{index}" if prefix else f"{type(module).__qualname__}[{index}]"
        rematerialize_forward(module, layer_policy, name, dynamic, fallback)
    return schedule

