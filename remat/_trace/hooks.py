"""Module forward hooks inside a region: recorded while traced, called on every call.

A module's forward pre-hooks and forward hooks are Python that runs around its forward.
remat runs a region's Python once, on stand-in tensors, so a hook run there would see
stand-ins, and only on the first call (Hugging Face records attentions, hidden states and
MoE router logits this way). So while a region is traced, each hook that fires is not
called but recorded with the values it receives; those values become outputs of the
region's graph, and after the graph runs, on every call, each hook is called in the order
eager code calls it, with the real values: tracked by autograd, so gradients flow back
through what a hook collects (an auxiliary loss from router logits).

A hook that returns a replacement for the module's inputs or output would change the
graph; it is refused on the call where it does so. A hook given a tensor the function
changes in place afterwards is refused too: it runs after the graph, where the value it
saw is gone. Hooks registered or removed after a trace make the plan stale (`HookSet`).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import optree
import torch

from .._core.errors import RematError, RematTraceError
from .._core.torch_internals import (
    GLOBAL_FORWARD_HOOK_TABLES,
    FakeTensor,
    calling_modules_through,
    global_forward_hook_table,
    hook_registrations,
    reparametrizing_hooks,
)

_TABLES = ("_forward_pre_hooks", "_forward_hooks")  # a module's own, in the order _call_impl reads them
TENSOR = object()  # where a hook's argument is a value of the graph


@dataclass(frozen=True)
class HookCall:
    """One hook call of a traced region: which hook, on which module, with what."""

    module: weakref.ref[torch.nn.Module]
    table: str  # where the hook is registered: a module table of _TABLES, or a global one
    hook_id: int
    spec: Any  # the structure of the hook's arguments after the module
    leaves: tuple[Any, ...]  # their leaves; TENSOR where a tensor output of the graph goes
    outputs: tuple[int, ...]  # for each TENSOR leaf, its place among the region's hook outputs
    label: str  # the hook and the module, for errors

    def hook(self, module: torch.nn.Module) -> Any:
        """The hook registered under this id now (None once removed)."""
        table = getattr(module, self.table) if self.table in _TABLES else global_forward_hook_table(self.table)
        return table.get(self.hook_id)


@dataclass
class HookSet:
    """The hooks of every module a trace called, to tell when a plan is stale: a hook
    registered or removed since on one of them would not be (or would be) called."""

    modules: list[tuple[weakref.ref[torch.nn.Module], tuple[tuple[int, ...], ...]]]
    global_ids: tuple[tuple[int, ...], ...]
    registrations: int  # torch's hook-handle counter then: unchanged, nothing can have been added

    def current(self) -> bool:
        count = hook_registrations()
        if count == self.registrations:
            return True
        now = all((m := ref()) is None or _hook_ids(m) == ids for ref, ids in self.modules) and _global_ids() == self.global_ids
        if now:
            self.registrations = count  # the next call need not look again
        return now

    def for_modules(self, modules: Sequence[torch.nn.Module]) -> HookSet:
        """This check for other modules, one in place of each of this set's (a like layer's
        modules), with the hooks they have now and the global hooks as traced."""
        return HookSet([(weakref.ref(m), _hook_ids(m)) for m in modules], self.global_ids, self.registrations)


def _hook_ids(module: torch.nn.Module) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(getattr(module, table)) for table in _TABLES)


def _global_ids() -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(global_forward_hook_table(name)) for name in GLOBAL_FORWARD_HOOK_TABLES)


class _StandIn:
    """What a hook table holds while a region is traced: records the call instead of
    making it (in the tracing thread; elsewhere it calls the hook)."""

    def __init__(self, recorder: HookRecorder, table: str, hook_id: int, hook: Any) -> None:
        self.recorder, self.table, self.hook_id, self.hook = recorder, table, hook_id, hook

    def __call__(self, module: torch.nn.Module, *arguments: Any) -> None:
        if _RECORDING.get() is not self.recorder:
            return self.hook(module, *arguments)  # type: ignore[no-any-return]
        self.recorder.record(self, module, arguments)
        return None


_RECORDING: contextvars.ContextVar[HookRecorder | None] = contextvars.ContextVar("remat_hooks", default=None)


class HookRecorder:
    """Records, while a region is traced, the hook calls of every module it calls."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        """(Again, when a trace restarts.)"""
        self.calls: list[HookCall] = []
        self.tensors: list[tuple[torch.Tensor, int, str]] = []  # each hook output, its version then, its hook
        self.seen: dict[int, tuple[weakref.ref[torch.nn.Module], tuple[tuple[int, ...], ...]]] = {}
        self.global_ids = _global_ids()
        self.registrations = hook_registrations()

    def record(self, stand_in: _StandIn, module: torch.nn.Module, arguments: tuple[Any, ...]) -> None:
        label = f"forward {'pre-' if 'pre' in stand_in.table else ''}hook {_name(stand_in.hook)} on {type(module).__name__}"
        if "pre" in stand_in.table and isinstance(stand_in.hook, reparametrizing_hooks()):
            raise RematTraceError(
                f"the {label} sets the module's `{getattr(stand_in.hook, 'name', 'weight')}`, computed from its "
                "parameters, before each forward (torch.nn.utils.weight_norm, spectral_norm or prune), and remat calls "
                "a region's hooks after its graph, where the forward has read the old value. Such a region runs as "
                "torch.utils.checkpoint runs it. To trace it, use torch.nn.utils.parametrizations.weight_norm or "
                "spectral_norm (parametrizations, which remat traces), or make pruning permanent with "
                "`torch.nn.utils.prune.remove`"
            )
        leaves, spec = optree.tree_flatten(arguments, none_is_leaf=True)  # type: ignore[arg-type]
        kept: list[Any] = []
        outputs: list[int] = []
        for leaf in leaves:
            if isinstance(leaf, FakeTensor):
                outputs.append(len(self.tensors))
                self.tensors.append((leaf, leaf._version, label))
                kept.append(TENSOR)
            else:
                kept.append(leaf)
        self.calls.append(HookCall(weakref.ref(module), stand_in.table, stand_in.hook_id, spec, tuple(kept), tuple(outputs), label))

    def outputs(self) -> list[torch.Tensor]:
        """The tensors the hooks were given, as the region's extra outputs; refused where
        the function changed one in place after its hook saw it."""
        for tensor, version, label in self.tensors:
            if tensor._version != version:
                raise RematTraceError(
                    f"the {label} is given a tensor that the function then changes in place. remat calls a "
                    "region's hooks after its graph has run, where that tensor no longer holds what the hook "
                    "saw. Make the change out of place (`out = out + identity`, `inplace=False`), or register "
                    "the hook outside the remat'd function"
                )
        return [tensor for tensor, _, _ in self.tensors]

    def hook_set(self) -> HookSet:
        return HookSet(list(self.seen.values()), self.global_ids, self.registrations)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Within: every module called records its hooks' calls here."""
        token = _RECORDING.set(self)
        try:
            with calling_modules_through(self._call):
                yield
        finally:
            _RECORDING.reset(token)

    def _call(self, original: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        """Module._call_impl while recording: the module's own hooks are stand-ins for the call."""
        if _RECORDING.get() is not self:
            return original(module, *args, **kwargs)
        self.seen.setdefault(id(module), (weakref.ref(module), _hook_ids(module)))
        swapped = [_swap_in(self, getattr(module, table), table) for table in _TABLES]
        swapped += [_swap_in(self, global_forward_hook_table(name), name) for name in GLOBAL_FORWARD_HOOK_TABLES]
        try:
            return original(module, *args, **kwargs)
        finally:
            for entry in reversed(swapped):
                _swap_out(entry)


def _swap_in(recorder: HookRecorder, table: dict[int, Any], name: str) -> tuple[dict[int, Any], list[tuple[int, Any, _StandIn]]]:
    """Stand-ins in place of the table's hooks (in place: the table keeps its order)."""
    done = []
    for hook_id, hook in list(table.items()):
        if not isinstance(hook, _StandIn):
            stand_in = _StandIn(recorder, name, hook_id, hook)
            table[hook_id] = stand_in
            done.append((hook_id, hook, stand_in))
    return table, done


def _swap_out(swapped: tuple[dict[int, Any], list[tuple[int, Any, _StandIn]]]) -> None:
    table, done = swapped
    for hook_id, hook, stand_in in done:
        if table.get(hook_id) is stand_in:
            table[hook_id] = hook


def _name(hook: Any) -> str:
    return f"`{getattr(hook, '__qualname__', None) or type(hook).__qualname__}`"


def _unchanged(result: Any, arguments: tuple[Any, ...], pre: bool) -> bool:
    """Whether a hook's result leaves the module's inputs or output as they are: None, or
    what it was given (`dict.setdefault(k, out)` returns `out`)."""
    if result is None:
        return True
    if not pre:
        return result is arguments[-1]
    args = arguments[0]
    if isinstance(result, tuple) and len(result) == 2 and len(arguments) == 2:
        return result[0] is args and result[1] is arguments[1]
    return result is args or (len(args) == 1 and result is args[0])


def call_hooks(calls: Sequence[HookCall], values: Sequence[torch.Tensor], region: str) -> None:
    """Call each recorded hook that is still registered, in order, with the real values."""
    for call in calls:
        module = call.module()
        hook = call.hook(module) if module is not None else None
        if module is None or hook is None:
            continue
        tensors = iter(call.outputs)
        leaves = [values[next(tensors)] if leaf is TENSOR else leaf for leaf in call.leaves]
        arguments = optree.tree_unflatten(call.spec, leaves)
        pre = "pre" in call.table
        before = _tensor_state(module) if pre else None
        if not _unchanged(hook(module, *arguments), arguments, pre):
            raise RematError(
                f"remat({region}): the {call.label} returned a value, which in eager code replaces the "
                "module's inputs or output. remat calls a region's hooks after its graph, so the replacement "
                "cannot change what the graph computed. Make the change inside the module's forward, or "
                "register the hook on a module outside the remat'd function."
            )
        if before is not None and (changed := _changed_tensors(before, _tensor_state(module))):
            raise RematError(
                f"remat({region}): the {call.label} changes the module's {changed}, a tensor its forward may read, "
                "before the forward. remat calls a region's hooks after its graph, so the graph has read it as it "
                "was before the hook. Make the change inside the module's forward, or register the hook on a "
                "module outside the remat'd function."
            )


def _tensor_state(module: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """The module's own tensors (parameters, buffers, tensor attributes), each by name with
    its identity and version: what a forward pre-hook may change for the forward to read."""
    found = {name: t for name, t in vars(module).items() if isinstance(t, torch.Tensor)}
    for table in (module._parameters, module._buffers):
        found.update((name, t) for name, t in table.items() if t is not None)
    return {name: (id(t), t._version) for name, t in found.items()}


def _changed_tensors(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> str:
    """`attr`, `attr2` for the tensors rebound, added or changed in place in between."""
    names = sorted(before.keys() | after.keys())
    return ", ".join(f"`{name}`" for name in names if before.get(name) != after.get(name))


def forward_hooks(modules: Sequence[torch.nn.Module]) -> list[Any]:
    """The forward hooks and pre-hooks of `modules`, then the global ones: the Python that
    calls of these modules run around their forwards."""
    hooks = [hook for module in modules for table in _TABLES for hook in getattr(module, table).values()]
    return hooks + [hook for name in GLOBAL_FORWARD_HOOK_TABLES for hook in global_forward_hook_table(name).values()]
