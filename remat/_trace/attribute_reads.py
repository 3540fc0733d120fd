"""What a module region's Python reads of its modules while it is traced.

A model's layers are one class with other parameters; what can make one layer trace another
graph than the layer before is what its forward reads of its modules' instance attributes
(`self.sliding_window`, `self.training`, a hook table), since the class, the code and the
globals are the same. While stage 1 runs, each module of the region is given a subclass
that notes every attribute read: the value found in the instance (or that there was none,
so the class's was used). A module like the traced one, with the same values at the same
places, would trace the same graph (`_plans/like_layers`).

What cannot be vouched for makes the trace unshareable: assigning an attribute during the
forward, or reading `__dict__` (or `vars()`) outside torch's own module code.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

ABSENT = ("absent",)  # the instance has no such attribute: the class's is read
_MAX_DEPTH = 4
_ATOMS = (bool, int, str, bytes, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_EXACT_ATOMS = frozenset(_ATOMS)
_EMPTY_FORMS = {kind: (kind, ()) for kind in (dict, collections.OrderedDict, list, tuple)}
_TORCH_MODULE_FILE = os.path.normcase(torch.nn.modules.module.__file__)
_REMAT_DIR = os.path.normcase(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class AttributeReads:
    """What one trace read: (module path, attribute) -> the value's form (`value_form`)."""

    forms: dict[tuple[str, str], Any] = field(default_factory=dict)
    kept: list[Any] = field(default_factory=list)  # objects compared by identity, kept alive
    unshareable: str | None = None  # why another module cannot use this trace


def tree_places(root: torch.nn.Module) -> tuple[dict[str, torch.nn.Module], dict[int, tuple[str, str]]]:
    """The region's modules by path, and each module's, parameter's and buffer's place."""
    modules = dict(root.named_modules())
    places: dict[int, tuple[str, str]] = {}
    for path, module in modules.items():
        places.setdefault(id(module), ("module", path))
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    places.setdefault(id(tensor), ("tensor", f"{path}.{name}"))
    return modules, places


def value_form(value: Any, places: dict[int, tuple[str, str]], kept: list[Any], depth: int = 0) -> Any:
    """A comparable form of a read value: numbers and strings by value, the region's own
    modules and tensors by their place in it, containers item by item, anything else by
    identity (kept alive in `kept`, so an id is not reused)."""
    kind = type(value)
    if kind in _EXACT_ATOMS:  # the common reads first, by exact type (a module or tensor is never one)
        return (kind, value)
    place = places.get(id(value))
    if place is not None:
        return place
    if kind in _EMPTY_FORMS and not value:  # an empty hook table, the most common table read
        return _EMPTY_FORMS[kind]
    if isinstance(value, float):
        return (float, repr(value))  # repr: -0.0 and 0.0 differ, nan equals nan
    if isinstance(value, _ATOMS):
        return (kind, value)
    deeper = depth + 1
    if deeper <= _MAX_DEPTH and (kind is list or kind is tuple):
        return (kind, tuple([value_form(v, places, kept, deeper) for v in value]))
    if deeper <= _MAX_DEPTH and (kind is dict or kind is collections.OrderedDict):
        return (kind, tuple([(value_form(k, places, kept, deeper), value_form(v, places, kept, deeper)) for k, v in value.items()]))
    kept.append(value)
    return ("object", id(value))


def form_now(module: torch.nn.Module, name: str, places: dict[int, tuple[str, str]], kept: list[Any]) -> Any:
    """The form of what reading `module.name` finds in the instance now."""
    return _form_in(object.__getattribute__(module, "__dict__"), name, places, kept)


def _form_in(instance: dict[str, Any], name: str, places: dict[int, tuple[str, str]], kept: list[Any]) -> Any:
    return value_form(instance[name], places, kept) if name in instance else ABSENT


Places = dict[int, tuple[str, str]]
FormCheck = Callable[[Any, Places, list[Any]], bool]
# by module path: the attributes that must be absent, and each present one with its check
ChecksByModule = tuple[tuple[str, frozenset[str], tuple[tuple[str, FormCheck], ...]], ...]


def form_checks(forms: dict[tuple[str, str], Any]) -> ChecksByModule:
    """`forms` grouped by module path, each form made a check (`form_check`), for `hold_forms`."""
    grouped: dict[str, tuple[list[str], list[tuple[str, FormCheck]]]] = {}
    for (path, name), form in forms.items():
        absent, present = grouped.setdefault(path, ([], []))
        if form == ABSENT:
            absent.append(name)
        else:
            present.append((name, form_check(form)))
    return tuple((path, frozenset(absent), tuple(present)) for path, (absent, present) in grouped.items())


def form_check(form: Any, depth: int = 0) -> FormCheck:
    """A function telling whether a value has `form`, i.e. `value_form(value, ...) == form`:
    the common forms (atoms, the region's modules and tensors, empty tables, containers of
    those) compared directly, without making the value's form; any other by `value_form`."""
    kind = form[0] if type(form) is tuple and len(form) == 2 else None
    if kind in _EXACT_ATOMS:
        atom = form[1]
        return lambda value, places, kept: type(value) is kind and value == atom  # type: ignore[no-any-return]
    if kind == "module" or kind == "tensor":
        return lambda value, places, kept: places.get(id(value)) == form
    if kind in _EMPTY_FORMS and form == _EMPTY_FORMS[kind]:
        return lambda value, places, kept: type(value) is kind and not value
    if kind is float:
        text = form[1]
        return lambda value, places, kept: isinstance(value, float) and repr(value) == text
    if kind == "object":  # the same object (kept alive, so its id is not reused) in the same category
        same = form[1]
        return lambda value, places, kept: (
            id(value) == same and same not in places and not (type(value) in _EMPTY_FORMS and not value)
        )
    deeper = depth + 1
    if deeper <= _MAX_DEPTH and (kind is list or kind is tuple):
        items = tuple(form_check(item, deeper) for item in form[1])
        return lambda value, places, kept: (
            type(value) is kind and len(value) == len(items)
            and all(check(item, places, kept) for check, item in zip(items, value, strict=True))
        )
    if deeper <= _MAX_DEPTH and (kind is dict or kind is collections.OrderedDict):
        pairs = tuple((form_check(k, deeper), form_check(v, deeper)) for k, v in form[1])
        return lambda value, places, kept: (
            type(value) is kind and len(value) == len(pairs)
            and all(
                check_key(k, places, kept) and check_value(v, places, kept)
                for (check_key, check_value), (k, v) in zip(pairs, value.items(), strict=True)
            )
        )
    return lambda value, places, kept: value_form(value, places, kept, depth) == form


def hold_forms(checks: ChecksByModule, modules: dict[str, torch.nn.Module], places: Places) -> bool:
    """Whether the modules hold, at every place, what has the form its check was made from
    (`form_checks`), each module's instance dictionary read once."""
    kept: list[Any] = []
    for path, absent, present in checks:
        module = modules.get(path)
        if module is None:
            return False
        instance = object.__getattribute__(module, "__dict__")
        if not instance.keys().isdisjoint(absent):
            return False
        for name, check in present:
            if name not in instance or not check(instance[name], places, kept):
                return False
    return True


class _Recorder:
    def __init__(self, places: dict[int, tuple[str, str]]) -> None:
        self.places = places
        self.thread = threading.get_ident()
        self.by_id: dict[tuple[int, str], Any] = {}
        self.kept: list[Any] = []
        self.unshareable: str | None = None

    def read(self, module: torch.nn.Module, name: str) -> None:
        key = (id(module), name)
        if key in self.by_id or threading.get_ident() != self.thread:
            return
        if name == "__dict__":
            caller = os.path.normcase(sys._getframe(2).f_code.co_filename)
            if caller != _TORCH_MODULE_FILE and not caller.startswith(_REMAT_DIR):
                self.unshareable = f"`{type(module).__name__}` code reads its `__dict__`"
            return
        if name.startswith("__") and name.endswith("__"):
            return
        self.by_id[key] = form_now(module, name, self.places, self.kept)

    def write(self, module: torch.nn.Module, name: str) -> None:
        if threading.get_ident() == self.thread:
            self.unshareable = f"`{type(module).__name__}.forward` assigns `self.{name}`"


_ACTIVE: list[_Recorder] = []  # the recorder of the trace under way (traces hold one lock)
_SUBCLASSES: dict[type, type] = {}


def _recording_subclass(cls: type) -> type:
    """`cls` with attribute reads and writes reported to the active recorder, named as it is."""
    sub = _SUBCLASSES.get(cls)
    if sub is not None:
        return sub

    def __getattribute__(self: Any, name: str) -> Any:
        if _ACTIVE:
            _ACTIVE[-1].read(self, name)
        return cls.__getattribute__(self, name)  # type: ignore[arg-type]

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if _ACTIVE:
            _ACTIVE[-1].write(self, name)
        cls.__setattr__(self, name, value)

    def __delattr__(self: Any, name: str) -> None:
        if _ACTIVE:
            _ACTIVE[-1].write(self, name)
        cls.__delattr__(self, name)

    sub = type(cls.__name__, (cls,), {
        "__getattribute__": __getattribute__, "__setattr__": __setattr__, "__delattr__": __delattr__,
        "__module__": cls.__module__, "__qualname__": cls.__qualname__, "_remat_recording_of": cls,
    })
    _SUBCLASSES[cls] = sub
    return sub


@contextlib.contextmanager
def recording_reads(root: torch.nn.Module) -> Iterator[AttributeReads]:
    """Within (one trace, under the trace lock): every attribute read of a module of `root`
    is noted; on exit the reads are in the yielded record, by module path."""
    modules, places = tree_places(root)
    reads = AttributeReads()
    recorder = _Recorder(places)
    swapped: list[tuple[torch.nn.Module, type]] = []
    try:
        for module in modules.values():
            cls = type(module)
            try:
                object.__setattr__(module, "__class__", _recording_subclass(cls))
            except TypeError as error:  # __slots__ or a class that cannot be subclassed
                reads.unshareable = f"`{cls.__name__}` cannot be watched ({error})"
                break
            swapped.append((module, cls))
        _ACTIVE.append(recorder)
        yield reads
    finally:
        if _ACTIVE and _ACTIVE[-1] is recorder:
            _ACTIVE.pop()
        for module, cls in reversed(swapped):
            object.__setattr__(module, "__class__", cls)
        paths = {id(module): path for path, module in modules.items()}
        reads.forms = {(paths[i], name): form for (i, name), form in recorder.by_id.items() if i in paths}
        reads.kept = recorder.kept
        reads.unshareable = reads.unshareable or recorder.unshareable
