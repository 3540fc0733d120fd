"""Like layers: a module region that holds what another one's trace read takes that plan
without running its own Python.

Sharing by graph (`sharing`) saves a layer the joint trace and the partition, but the
layer still runs stage 1 to find its graph. For a module region, what its Python reads of
its modules is watched while it is traced (`_trace/attribute_reads`). Another module with
the same class, forward, module tree, parameters' and buffers' places and metadata, and
arguments, whose modules hold the same values at every place the trace read (the same
number, the same object, no attribute where there was none), runs the same code on the
same values, so it traces the same graph: it takes the plan with its own tensors, name
and hook tables. A read that differs (a sliding-window layer beside full attention, a
layer in eval mode, a hook on one layer) finds no like layer and traces as before.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .._core.torch_internals import nested_gradients, transforms_active
from .._running.executing import Plan
from .._trace.arguments import Call
from .._trace.attribute_reads import AttributeReads, ChecksByModule, form_checks, hold_forms, tree_places

_MAX_KEYS = 256  # kinds of layer remembered; the least recently used goes first
_MAX_PER_KEY = 8  # plans per kind: layers of one class that read different values


@dataclass
class _Like:
    """A traced region's plan and the values its trace read, by place."""

    plan: weakref.ref[Plan]
    checks: ChecksByModule  # of the forms, by module, as `hold_forms` runs them
    kept: list[Any]  # the objects its forms name by identity, alive while it is
    hook_places: list[str | weakref.ref[torch.nn.Module]]  # each hooked module: its path, or itself if outside


_LIKE: OrderedDict[tuple[Any, ...], list[_Like]] = OrderedDict()
_READS: weakref.WeakKeyDictionary[torch.nn.Module, AttributeReads] = weakref.WeakKeyDictionary()


def region_module(fn: Callable[..., Any]) -> torch.nn.Module | None:
    """The module a region runs (`remat(module)`, `remat(module.forward)`), or None."""
    if isinstance(fn, torch.nn.Module):
        return fn
    if inspect.ismethod(fn) and isinstance(fn.__self__, torch.nn.Module):
        return fn.__self__
    return None


def like_key(fn: Callable[..., Any], root: torch.nn.Module, call: Call, settings: tuple[Any, ...]) -> tuple[Any, ...]:
    """What like modules have equal: the code, the module tree, the call's key but for the
    modules' settings (compared by what the trace read of them instead), the settings of
    the region and the transforms around it."""
    code = fn.__func__ if inspect.ismethod(fn) else type(fn)
    structure = tuple((path, type(module)) for path, module in root.named_modules())
    return (
        code, structure, tuple(call.captured_paths), call.key_without_own_settings(), settings, transforms_active(),
        nested_gradients(),
    )


def note_reads(root: torch.nn.Module, reads: AttributeReads) -> None:
    """Add one trace's reads to what the module's traces have read: a plan made without a
    trace (from a shape template) is offered with the reads of the traces before it."""
    seen = _READS.get(root)
    if seen is None:
        _READS[root] = seen = AttributeReads()
    seen.forms.update(reads.forms)
    seen.kept.extend(reads.kept)
    seen.unshareable = seen.unshareable or reads.unshareable


def offer(key: tuple[Any, ...], root: torch.nn.Module, plan: Any) -> None:
    """Let like modules take `plan`, when what made it can be vouched for."""
    reads = _READS.get(root)
    if not isinstance(plan, Plan) or reads is None or reads.unshareable is not None:
        return
    stage_one = plan.stage_one
    if stage_one.by_reference or stage_one.hook_calls or stage_one.reads_storage_offsets or stage_one.changes_state or (
        stage_one.units  # custom Functions: which one a layer applies is not among the reads
    ):
        return  # tensors, hooks or state of this module's own, or a graph for its tensors' storage offsets
    _, places = tree_places(root)
    hook_places: list[str | weakref.ref[torch.nn.Module]] = []
    for ref, _ids in stage_one.hooks.modules if stage_one.hooks is not None else ():
        module = ref()
        if module is None:
            return
        place = places.get(id(module))
        hook_places.append(place[1] if place is not None and place[0] == "module" else ref)
    likes = [like for like in _LIKE.pop(key, []) if like.plan() is not None][-(_MAX_PER_KEY - 1) :]
    likes.append(_Like(weakref.ref(plan), form_checks(reads.forms), list(reads.kept), hook_places))
    _LIKE[key] = likes
    while len(_LIKE) > _MAX_KEYS:
        _LIKE.popitem(last=False)


def like_plan(key: tuple[Any, ...], root: torch.nn.Module, region: str) -> Plan | None:
    """The plan of a module like `root` whose trace read what `root` holds, made `root`'s."""
    likes = _LIKE.get(key)
    if not likes:
        return None
    _LIKE.move_to_end(key)
    modules, places = tree_places(root)
    for like in likes:
        plan = like.plan()
        if plan is None:
            continue
        if hold_forms(like.checks, modules, places):
            return _for_module(plan, like, modules, region)
    return None


def _for_module(plan: Plan, like: _Like, modules: dict[str, torch.nn.Module], region: str) -> Plan | None:
    stage_one = plan.stage_one
    hooks = stage_one.hooks
    if hooks is not None:
        hooked = [modules.get(place) if isinstance(place, str) else place() for place in like.hook_places]
        if any(module is None for module in hooked):
            return None
        hooks = hooks.for_modules(hooked)  # type: ignore[arg-type]
    scopes = [dataclasses.replace(stage_one.scopes[0], region=region), *stage_one.scopes[1:]]
    return plan.for_capture(dataclasses.replace(stage_one, scopes=scopes, hooks=hooks), region)


def clear_like_layers() -> None:
    _LIKE.clear()
    _READS.clear()
