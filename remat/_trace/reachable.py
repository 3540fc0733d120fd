"""What a traced function's Python does to the objects it can reach.

remat runs a function's Python once, while it traces, and then replays a graph. Whatever
that Python changes in objects it reaches (a list it appends to, an attribute it sets, a
counter in a dict) therefore changes once per trace, not once per call; and whatever it
stores there of its own values holds tracing stand-ins (fake tensors, symbolic sizes),
not values. Both are found here by walking the same objects before and after the trace:
the function's closure, the globals its code names, its bound object or module (with its
submodules), and the objects among its arguments.
"""

from __future__ import annotations

import inspect
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from .._core.sources import is_installed_code, is_user_class
from .._core.torch_internals import SYMBOLIC_SCALARS, FakeTensor

_DEPTH = 6
# A module's own tables: its tensors (read afresh on every call) and its submodules (walked as such).
_MODULE_TABLES = frozenset({"_parameters", "_buffers", "_modules"})
_ATOMS = (torch.Tensor, str, bytes, int, float, complex, bool, type(None), type, types.ModuleType, torch.dtype, torch.device)


def roots_of(fn: Callable[..., Any], objects: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The objects a call of `fn` reaches, by path: its arguments' objects, its bound
    object or module, and (for code outside libraries) its closure and the globals its
    code names."""
    roots = list(objects)
    owner = fn.__self__ if inspect.ismethod(fn) else fn if isinstance(fn, torch.nn.Module) else None
    if owner is not None:
        roots.append(("self", owner))
    function = fn.__func__ if inspect.ismethod(fn) else fn
    if isinstance(function, types.FunctionType) and not is_installed_code(function.__code__):
        roots.extend(_function_items(function))
    return roots


def _function_items(function: types.FunctionType) -> Iterator[tuple[str, Any]]:
    """A function's closure contents and the globals its code names (not modules)."""
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        try:
            yield name, cell.cell_contents
        except ValueError:  # a cell not yet assigned
            continue
    namespace = function.__globals__
    for name in _global_names(function.__code__):
        value = namespace.get(name)
        if value is not None and not isinstance(value, (types.ModuleType, type)):
            yield name, value


def _global_names(code: types.CodeType) -> list[str]:
    names: list[str] = []
    stack = [code]
    while stack:
        current = stack.pop()
        names.extend(current.co_names)
        stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    return list(dict.fromkeys(names))


def _items(value: Any) -> Iterator[tuple[str, Any]] | None:
    """What `value` holds, by key, or None for a value not looked into."""
    if isinstance(value, dict):
        return ((k if isinstance(k, str) else f"[{k!r}]", v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ((f"[{i}]", v) for i, v in enumerate(value))
    if isinstance(value, torch.nn.Module):  # its tensors too: code sets attributes on them (Opacus' counters)
        own = ((k, v) for k, v in vars(value).items() if k not in _MODULE_TABLES)
        tables = (value._parameters, value._buffers)
        tensors = (item for table in tables for item in table.items() if item[1] is not None)
        return iter([*own, *tensors, *value.named_children()])
    if _plain_object(value):
        return iter(vars(value).items())
    return None


def _plain_object(value: Any) -> bool:
    """An object whose attributes are its state: not a function, class or module (their
    state is code), nor a callable or an object of the standard library (a logger's caches)
    other than a SimpleNamespace."""
    if isinstance(value, types.SimpleNamespace):
        return True
    return (
        hasattr(value, "__dict__") and not callable(value)
        and type(value).__module__.partition(".")[0] not in sys.stdlib_module_names
    )


def _join(path: str, key: str) -> str:
    if key.startswith("["):
        return f"{path}{key}"
    return f"{path}.{key}" if path else key


def _walk(roots: list[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Every object reachable from `roots` within a few steps, once each, with its path;
    tensors, numbers and strings are reached but not looked into."""
    seen: set[int] = set()
    stack = [(path, value, 0) for path, value in reversed(roots)]
    while stack:
        path, value, depth = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        yield path, value
        if depth == _DEPTH or isinstance(value, _ATOMS):
            continue
        items = _items(value)
        if items is not None:
            stack.extend((_join(path, key), item, depth + 1) for key, item in reversed(list(items)))


def _state(value: Any) -> Any:
    """What an object holds, by identity: equal before and after only if nothing in it
    was added, removed or replaced."""
    if isinstance(value, list):
        return tuple(map(id, value))
    if isinstance(value, dict):
        return tuple((id(k), id(v)) for k, v in value.items())
    if isinstance(value, set):
        return frozenset(map(id, value))
    if isinstance(value, torch.nn.Module):
        return tuple((k, id(v)) for k, v in vars(value).items() if k not in _MODULE_TABLES) + tuple(
            (k, id(v)) for k, v in value._modules.items()
        )
    if _plain_object(value):
        return tuple((k, id(v)) for k, v in vars(value).items())
    return None


def roots_of_hooks(hooks: Sequence[Any]) -> list[tuple[str, Any]]:
    """What the user's own hooks reach: a function's closure and the globals its code
    names, the object of a method or a callable of a class of the user's. A library's
    hook (pruning's, FSDP's) is left out: its state is the library's to keep."""
    roots: list[tuple[str, Any]] = []
    for hook in hooks:
        name = f"hook {getattr(hook, '__qualname__', type(hook).__qualname__)}"
        if inspect.ismethod(hook):
            if is_user_class(type(hook.__self__)):
                roots.append((name, hook.__self__))
        elif isinstance(hook, types.FunctionType):
            if not is_installed_code(hook.__code__):
                roots.extend((f"{name}: {key}", value) for key, value in _function_items(hook))
        elif is_user_class(type(hook)):
            roots.append((name, hook))
    return roots


def modules_reached(roots: list[tuple[str, Any]]) -> list[torch.nn.Module]:
    """Every module reachable from `roots`, with all of its submodules, once each."""
    found: dict[int, torch.nn.Module] = {}
    for _, value in _walk(roots):
        if isinstance(value, torch.nn.Module) and id(value) not in found:
            found.update((id(m), m) for m in value.modules())
    return list(found.values())


def _contents(value: Any) -> Any:
    """What an object holds, by reference, to put back with `_put_back`."""
    if isinstance(value, list):
        return list(value)
    if isinstance(value, (dict, set)):
        return value.copy()
    if isinstance(value, torch.nn.Module):
        return {k: v for k, v in vars(value).items() if k not in _MODULE_TABLES}, dict(value._modules)
    return dict(vars(value))


def _put_back(value: Any, contents: Any) -> None:
    """Make `value` hold `contents` (what `_contents` read) again, in place."""
    if isinstance(value, list):
        value[:] = contents
    elif isinstance(value, (dict, set)):
        value.clear()
        value.update(contents)
    elif isinstance(value, torch.nn.Module):
        attributes, modules = contents
        _put_back_attributes(vars(value), attributes, keep=_MODULE_TABLES)
        _put_back(value._modules, modules)
    else:
        _put_back_attributes(vars(value), contents, keep=frozenset())


def _put_back_attributes(namespace: dict[str, Any], attributes: dict[str, Any], keep: frozenset[str]) -> None:
    for name in [k for k in namespace if k not in attributes and k not in keep]:
        del namespace[name]
    namespace.update(attributes)


def _bindings(fn: Callable[..., Any]) -> list[tuple[Any, str]]:
    """Where a call of `fn` can rebind a name: its closure cells (`nonlocal`) and the
    globals its code names (`global`), each as (cell, "") or (namespace, name)."""
    function = fn.__func__ if inspect.ismethod(fn) else fn
    if not isinstance(function, types.FunctionType) or is_installed_code(function.__code__):
        return []
    found: list[tuple[Any, str]] = [(cell, "") for cell in function.__closure__ or ()]
    return found + [(function.__globals__, name) for name in _global_names(function.__code__)]


_UNBOUND = object()


def _bound(place: tuple[Any, str]) -> Any:
    holder, name = place
    if name:
        return holder.get(name, _UNBOUND)
    try:
        return holder.cell_contents
    except ValueError:  # a cell not yet assigned
        return _UNBOUND


def _rebind(place: tuple[Any, str], value: Any) -> None:
    holder, name = place
    if name:
        if value is _UNBOUND:
            holder.pop(name, None)
        else:
            holder[name] = value
    elif value is _UNBOUND:
        del holder.cell_contents
    else:
        holder.cell_contents = value


@dataclass
class Snapshot:
    """The state of every mutable object a call reaches, and of the names it can rebind,
    before it runs: to tell what it changed (a trace) or to undo it (a trace that failed,
    a recompute)."""

    states: dict[int, tuple[str, Any, Any, Any]]  # id -> (path, the object, its state, its contents)
    bindings: list[tuple[tuple[Any, str], Any]]  # (a cell or a global's place, what it held)

    @classmethod
    def take(cls, roots: list[tuple[str, Any]], functions: Sequence[Callable[..., Any]] = ()) -> Snapshot:
        """What `roots` reach holds now, and the names `functions` can rebind."""
        states = {}
        for path, value in _walk(roots):
            state = _state(value)
            if state is not None:
                states[id(value)] = (path, value, state, _contents(value))
        bindings = [(place, _bound(place)) for fn in functions for place in _bindings(fn)]
        return cls(states, bindings)

    def changed(self) -> list[str]:
        """What the trace changed in the objects of the snapshot, one phrase each."""
        changes = []
        for path, value, state, _ in self.states.values():
            if _state(value) != state:
                changes.append(_describe_change(path or "an argument", value, state))
        return changes

    def restore(self) -> None:
        """Undo what was done since: every object that changed holds what it held then,
        every name is bound as it was (objects made since and stored there are dropped)."""
        for _, value, state, contents in self.states.values():
            if _state(value) != state:
                _put_back(value, contents)
        for place, value in self.bindings:
            if _bound(place) is not value:
                _rebind(place, value)


def _describe_change(path: str, value: Any, before: Any) -> str:
    if isinstance(value, list):
        grown = len(value) - len(before)
        what = f"{grown} item{'s' if grown > 1 else ''} added" if grown > 0 else "items removed or replaced"
        return f"`{path}` (a list: {what})"
    if isinstance(value, (dict, set)):
        return f"`{path}` (a {type(value).__name__}: items added, removed or replaced)"
    now, then = dict(_state(value)), dict(before)
    names = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))
    return f"`{path}` (attribute{'s' if len(names) != 1 else ''} {', '.join(f'`{n}`' for n in names)} set)"


def stand_in_path(roots: list[tuple[str, Any]]) -> str | None:
    """The path of a tracing stand-in (a fake tensor, or a symbolic size of a template's
    trace) reachable from `roots`, if any."""
    for path, value in _walk(roots):
        if isinstance(value, (FakeTensor, *SYMBOLIC_SCALARS)):
            return path or "an argument"
    return None
