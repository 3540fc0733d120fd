"""torch.utils.checkpoint's call forms, answered by remat regions: `checkpoint(fn, *args)`,
`checkpoint_sequential` and torch.distributed's `apply_activation_checkpointing`.

torch's forms take the function anew on every call (often a new `functools.partial` or
bound method), so each call finds its region in a cache keyed by what the function
really runs (the bound object and its code), never by the wrapper object: a model
checkpointed this way traces once per layer, not once per step.
"""

from __future__ import annotations

import collections
import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts, noop_context_fn

from remat.policies import from_selective_checkpoint

from .._core.errors import RematError
from .decorator import remat
from .layers import rematerialize_forward

_TORCH_KEYWORDS = ("use_reentrant", "context_fn", "determinism_check", "preserve_rng_state")
_REMAT_KEYWORDS = ("policy", "static_argnums", "static_argnames", "debug", "cache_size", "name", "dynamic", "fallback")
_UNSET: Any = object()


def checkpoint(function: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> Any:
    """remat in either of the two forms people know as `checkpoint`.

    JAX's (an alias of `remat`): `checkpoint(fn, policy=...)` or `@checkpoint(policy=...)`
    returns the rematerialized function.

    torch's (`torch.utils.checkpoint.checkpoint`'s signature): `checkpoint(fn, *args,
    use_reentrant=None, context_fn=..., determinism_check="default", debug=False,
    preserve_rng_state=True, **kwargs)` calls `fn(*args, **kwargs)` as a remat region and
    returns its result. It is this form whenever arguments for `fn` follow it (a function
    of no arguments: pass `use_reentrant=False`). `policy=` chooses what is kept (default:
    nothing but the inputs, as torch.utils.checkpoint); `context_fn=functools.partial(
    create_selective_checkpoint_contexts, policy_fn_or_ops)` is read as that policy.
    `use_reentrant` and `preserve_rng_state` are accepted and change nothing: remat has one
    implementation, which gives every input its gradient and replays the random stream
    exactly either way. `debug=True` is remat's (every recomputed value checked against
    the forward's). The region is cached per function (a bound method or `partial` is
    keyed by what it binds), so calling it every step traces once.
    """
    call_form = bool(args) or any(k not in _REMAT_KEYWORDS for k in kwargs)
    if not call_form:
        return remat(function, **kwargs)
    if function is None or not callable(function):
        raise TypeError(
            f"remat.checkpoint: the first argument is the function to run, got {function!r}. "
            "torch's form is checkpoint(fn, *args, **kwargs); JAX's is checkpoint(fn, policy=...)."
        )
    return call_checkpointed(function, args, kwargs)


def call_checkpointed(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`function(*args, **kwargs)` as its cached remat region; the keywords torch's and
    remat's `checkpoint` take are options, the rest go to `function`."""
    kwargs = dict(kwargs)
    options = _options_from(kwargs)
    return region_for(function, **options)(*args, **kwargs)


def _options_from(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take remat's and torch's checkpoint keywords out of `kwargs`: remat's options."""
    options = {k: kwargs.pop(k) for k in _REMAT_KEYWORDS if k in kwargs}
    torch_options = {k: kwargs.pop(k) for k in _TORCH_KEYWORDS if k in kwargs}
    options["policy"] = _policy_of(options.get("policy", _UNSET), torch_options.get("context_fn", noop_context_fn))
    _check_determinism(torch_options.get("determinism_check", "default"))
    return options


def _policy_of(policy: Any, context_fn: Callable[..., Any]) -> Any:
    """The policy given, or the one a selective-checkpoint `context_fn` carries."""
    if context_fn is noop_context_fn:
        return None if policy is _UNSET else policy
    selective = (
        isinstance(context_fn, functools.partial)
        and context_fn.func is create_selective_checkpoint_contexts
        and len(context_fn.args) == 1
    )
    if not selective:
        raise RematError(
            f"remat.checkpoint: context_fn={context_fn!r} is not torch's selective checkpointing. remat runs "
            "a traced graph in backward, not the function under context managers, so it cannot apply "
            "arbitrary contexts. Pass policy= (or functools.partial(create_selective_checkpoint_contexts, "
            "policy_fn_or_ops)), or use torch.utils.checkpoint for this call."
        )
    if policy is not _UNSET:
        raise TypeError("remat.checkpoint: give either policy= or a selective-checkpoint context_fn, not both")
    return from_selective_checkpoint(context_fn.args[0])


def _check_determinism(check: Any) -> None:
    if check not in ("default", "none"):
        raise ValueError(f"remat.checkpoint: determinism_check must be 'default' or 'none', got {check!r}")


# ---------------------------------------------------------------- one region per function


class _Regions:
    """Regions by what a function runs: per owner object, per code and options. The table
    lives on the owner (in its `__dict__`, as `checkpoint_layers`' wrapper does), so a
    model's regions, which hold its bound methods, go with the model: a table held here
    by a weak key would keep it alive through its own values. Owners without a `__dict__`
    (builtins) are few and live for the process; they are held in a bounded table."""

    def __init__(self, bound: int = 256) -> None:
        self._strong: collections.OrderedDict[int, tuple[Any, dict[Any, Any]]] = collections.OrderedDict()
        self._bound = bound

    def table(self, owner: Any) -> dict[Any, Any]:
        attributes = getattr(owner, "__dict__", None)
        if isinstance(attributes, dict):
            return attributes.setdefault(_TABLE, {})  # type: ignore[no-any-return]
        entry = self._strong.get(id(owner))
        if entry is None or entry[0] is not owner:
            entry = self._strong[id(owner)] = (owner, {})
        self._strong.move_to_end(id(owner))
        while len(self._strong) > self._bound:
            self._strong.popitem(last=False)
        return entry[1]


_TABLE = "_remat_regions"
_REGIONS = _Regions()


class _Bound:
    """What a call of `function` runs: the callable to rematerialize, the object that owns it
    (the cache key's holder) and its code, and the arguments a `partial` fixed."""

    def __init__(self, function: Callable[..., Any]) -> None:
        args: tuple[Any, ...] = ()
        keywords: dict[str, Any] = {}
        while isinstance(function, functools.partial):
            args, keywords = (*function.args, *args), {**function.keywords, **keywords}
            function = function.func
        if isinstance(function, types.FunctionType) and args and isinstance(args[0], torch.nn.Module):
            function, args = types.MethodType(function, args[0]), args[1:]  # partial(forward, self): a method
        if isinstance(function, types.MethodType):
            self.owner, self.code = function.__self__, function.__func__
        else:
            self.owner, self.code = function, None
        self.function, self.args, self.keywords = function, args, keywords


def region_for(function: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """The remat region that runs `function` (with a `partial`'s fixed arguments), made on
    first use and kept while what it binds lives."""
    bound = _Bound(function)
    key = (bound.code, _options_key(options))
    table = _REGIONS.table(bound.owner)
    region = table.get(key)
    if region is None:
        region = table[key] = remat(bound.function, **options)
    if not bound.args and not bound.keywords:
        return region  # type: ignore[no-any-return]
    return functools.partial(region, *bound.args, **bound.keywords)


def _options_key(options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, tuple(v) if isinstance(v, (list, set)) else v) for k, v in options.items()))


# ---------------------------------------------------------------- sequences and models


class _Call(torch.nn.Module):
    """A plain function as a step of a sequence of modules."""

    def __init__(self, function: Callable[..., Any]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: Any) -> Any:
        return self.function(x)


def checkpoint_sequential(
    functions: torch.nn.Sequential | Sequence[Callable[..., Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """torch.utils.checkpoint.checkpoint_sequential: run `functions` one after another on
    `input`, in `segments` pieces, each a remat region but the last (which runs as is, as
    torch runs it). Keywords as for `checkpoint` (`policy=`, `preserve_rng_state`...)."""
    steps = list(functions.children()) if isinstance(functions, torch.nn.Sequential) else list(functions)
    if not isinstance(segments, int) or not 0 < segments <= max(len(steps), 1):
        raise ValueError(f"checkpoint_sequential: segments must be between 1 and {len(steps)}, got {segments!r}")
    size = len(steps) // segments
    options = _options_from(kwargs)
    if kwargs:
        raise TypeError(f"checkpoint_sequential: unexpected keyword arguments {sorted(kwargs)}")
    end = 0
    for start in range(0, size * (segments - 1), size):
        end = start + size
        input = _segment(steps[start:end], options)(input)
    for step in steps[end:]:
        input = step(input)
    return input


def _segment(steps: list[Callable[..., Any]], options: dict[str, Any]) -> Callable[..., Any]:
    """The region of consecutive steps, cached on the first step with the others held, so
    the identities in its key stay theirs while it lives."""
    key = ("sequential", tuple(id(s) for s in steps), _options_key(options))
    table = _REGIONS.table(steps[0])
    region = table.get(key)
    if region is None:
        sequence = torch.nn.Sequential(*(s if isinstance(s, torch.nn.Module) else _Call(s) for s in steps))
        region = table[key] = remat(sequence, **options)
    return region  # type: ignore[no-any-return]


def apply_activation_checkpointing(
    model: torch.nn.Module,
    checkpoint_wrapper_fn: Any = None,
    check_fn: Callable[[torch.nn.Module], bool] = lambda _: True,
    auto_wrap_policy: Any = None,
    *,
    policy: Any = None,
    dynamic: bool = False,
    fallback: bool = True,
) -> list[str]:
    """torch.distributed's `apply_activation_checkpointing(model, check_fn=...)`: every
    submodule for which `check_fn` is true (the outermost such; never `model` itself)
    becomes a remat region with `policy`, in place: its forward is replaced, so parameter
    names and the state dict stay as they were (no `_checkpoint_wrapped_module.` in them).
    Returns the paths of the modules it rematerialized. `checkpoint_wrapper_fn` (torch's
    wrapper) is accepted and not used; choose modules with `check_fn`."""
    if checkpoint_wrapper_fn is not None and not _is_torch_wrapper(checkpoint_wrapper_fn):
        raise TypeError(
            f"apply_activation_checkpointing: checkpoint_wrapper_fn={checkpoint_wrapper_fn!r} is not torch's "
            "checkpoint_wrapper; remat makes each chosen module a region itself. Drop it, and pass policy=."
        )
    if auto_wrap_policy is not None:
        raise TypeError(
            "apply_activation_checkpointing: remat chooses modules by check_fn, not auto_wrap_policy; e.g. "
            "check_fn=lambda m: isinstance(m, Block)."
        )
    chosen: list[str] = []
    for path, module in model.named_modules():
        if path and not any(path.startswith(p + ".") for p in chosen) and check_fn(module):
            rematerialize_forward(module, policy, path, dynamic, fallback)
            chosen.append(path)
    return chosen


def _is_torch_wrapper(function: Any) -> bool:
    """torch.distributed's `checkpoint_wrapper`, or a partial of it (known by name: importing
    it would import torch.distributed, which some builds lack)."""
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__name__", None) == "checkpoint_wrapper" and str(
        getattr(function, "__module__", "")
    ).startswith("torch.distributed")
