"""Splitting one call into traced tensors and static everything-else, and its cache key.

Tensor leaves of the argument pytrees become graph inputs; every other leaf is static
(part of the cache key, so it must be hashable). Tensors the function reaches through its
closure (captured tensors, nn.Module parameters and buffers) are collected per call, so a
tensor that an enclosing torch.func transform differentiates is passed in, never baked in.
"""

from __future__ import annotations

import argparse
import contextlib
import dis
import functools
import inspect
import itertools
import operator
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import optree
import torch

from .._core.errors import RematStateWarning, RematTraceError
from .._core.locking import TRACE_LOCK
from .._core.sources import is_installed_code, is_user_class
from .._core.torch_internals import (
    autocast_state,
    factory_defaults,
    is_expanded_weight,
    is_transform_wrapped,
    kernel_choices,
    nested_gradients,
    transform_levels,
    transforms_active,
)


@dataclass(frozen=True, repr=False)
class _Static:
    """A whole argument declared static through static_argnums/static_argnames."""

    value: Any

    def __repr__(self) -> str:  # as the value (what a retrace warning says changed)
        return repr(self.value)


@dataclass
class Call:
    """One call, split: the tensors to trace with and how to put the arguments back."""

    tensors: list[torch.Tensor]
    tensor_paths: Sequence[str]
    captured: list[torch.Tensor]
    captured_paths: list[str]
    captured_setters: list[Callable[[Any], None] | None]
    static_leaves: list[Any]
    spec: Any
    tensor_positions: Sequence[int]
    key: tuple[Any, ...]
    leaf_paths: Sequence[str] = ()  # readable path of every leaf
    # for arguments that are one tensor object passed more than once, each argument's first
    # position (`aliases`); None when every argument is a tensor of its own
    aliases: tuple[int, ...] | None = None

    def objects(self) -> list[tuple[str, Any]]:
        """The static leaves that are objects (not tensors, numbers or strings), by path:
        what a function could store values in."""
        return [
            (path, leaf.value if isinstance(leaf, _Static) else leaf)
            for path, leaf in zip(self.leaf_paths, self.static_leaves)
            if not isinstance(leaf, torch.Tensor) and not isinstance(leaf.value if isinstance(leaf, _Static) else leaf, _PLAIN)
        ]

    def key_without_sizes(self) -> tuple[Any, ...]:
        """The cache key with each tensor's shape and strides reduced to its number of
        dimensions: calls that differ only in sizes (and layouts) share it."""
        key = list(self.key)
        n_leaves = len(self.static_leaves)
        for index in [1 + p for p in self.tensor_positions] + [1 + n_leaves + j for j in range(len(self.captured))]:
            shape, _, *rest = key[index]
            key[index] = (len(shape), *rest)
        return tuple(key)

    def key_without_own_settings(self) -> tuple[Any, ...]:
        """The cache key without the settings of the region's own modules (`collect_captured`'s
        flags under "self"), which like modules compare by what their trace read instead
        (`_plans/like_layers`); values read from the closure or globals stay."""
        at = 1 + len(self.static_leaves) + len(self.captured)
        flags = tuple(f for f in self.key[at] if not (len(f) == 4 and f[0] == "self"))
        return (*self.key[:at], flags, *self.key[at + 1 :])

    def key_labels(self) -> list[str]:
        """What each part of `key` stands for, to say what changed between traces."""
        return [
            "the arguments' structure",
            *(f"argument {p}" for p in self.leaf_paths),
            *(f"captured {p or 'tensor'}" for p in self.captured_paths),
            "values read from the closure or module settings",
            "grad mode",
            "torch.func transforms",
            "nested gradients",
            "autocast",
            "kernel choices (torch.backends: SDPA backends, cuDNN, oneDNN, deterministic algorithms)",
            "default dtype and device of factories",
            "which arguments are one tensor",
        ]

    def storage_offsets(self) -> tuple[int, ...]:
        """Where each tensor starts in its storage (the graph of `as_strided` depends on it)."""
        return tuple(_storage_offset(t) for t in (*self.tensors, *self.captured))

    def rebuild(self, tensors: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The (args, kwargs) of this call with `tensors` in place of its tensor leaves."""
        leaves = list(self.static_leaves)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        leaves = [leaf.value if isinstance(leaf, _Static) else leaf for leaf in leaves]
        args, kwargs = optree.tree_unflatten(self.spec, leaves)
        return tuple(args), dict(kwargs)

    @contextlib.contextmanager
    def substituted(self, replacements: Sequence[Any]) -> Iterator[None]:
        """Put `replacements` where the captured tensors live (closure cells, module
        parameters), for the duration of a trace; tuple-held ones stay as they are."""
        done = []
        _SUBSTITUTING.count += 1
        try:
            for setter, original, new in zip(self.captured_setters, self.captured, replacements):
                if setter is not None:
                    setter(new)
                    done.append((setter, original))
            yield
        finally:
            for setter, original in reversed(done):
                setter(original)
            _SUBSTITUTING.count += 1


def _storage_offset(t: torch.Tensor) -> int:
    try:
        return int(t.storage_offset())
    except RuntimeError:  # no storage (sparse)
        return 0


def format_path(root: str, keys: Sequence[Any]) -> str:
    return root + "".join(f"[{k!r}]" for k in keys)


def positional_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The names of `fn`'s positional parameters, for readable argument paths."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        return tuple(p.name for p in inspect.signature(target).parameters.values() if p.kind in positional)
    except (TypeError, ValueError):
        return ()


def tensor_signature(t: torch.Tensor) -> tuple[Any, ...]:
    """What a traced graph depends on: shape, strides, dtype, device, needs-grad."""
    try:
        stride: tuple[int, ...] | None = t.stride()  # a tuple already
    except RuntimeError:
        stride = None
    return (tuple(t.shape), stride, t.dtype, t.device, needs_grad(t))


def needs_grad(t: torch.Tensor) -> bool:
    """Whether any autograd level (plain, or an enclosing torch.func transform) tracks `t`."""
    if t.requires_grad:  # only floating and complex tensors can
        return True
    if not (t.is_floating_point() or t.is_complex()):
        return False
    return any(level.requires_grad for level in transform_levels(t)[1:])


def split_call(
    fn: Callable[..., Any],
    names: tuple[str, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    static_argnums: frozenset[int],
    static_argnames: frozenset[str],
    memo: CaptureMemo | None = None,
) -> Call:
    """Flatten (args, kwargs) into tensors and static leaves; collect captured tensors
    (through `memo`, the caller's CaptureMemo of `fn`, when given)."""
    if not kwargs and not static_argnums:
        call = _split_tensor_args(fn, names, args, memo)
        if call is not None:
            return call
    return _split_flattened(fn, names, args, kwargs, static_argnums, static_argnames, memo)


def _split_flattened(
    fn: Callable[..., Any],
    names: tuple[str, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    static_argnums: frozenset[int],
    static_argnames: frozenset[str],
    memo: CaptureMemo | None = None,
) -> Call:
    """split_call for any call: flattens the arguments with optree."""
    args = tuple(_Static(a) if (i in static_argnums or i - len(args) in static_argnums) else a for i, a in enumerate(args))
    kwargs = {k: _Static(v) if k in static_argnames else v for k, v in kwargs.items()}
    paths, leaves, spec = optree.tree_flatten_with_path((args, kwargs))  # type: ignore[var-annotated,arg-type]
    transforms = transforms_active()
    tensors: list[torch.Tensor] = []
    tensor_paths: list[str] = []
    positions: list[int] = []
    key: list[Any] = [spec]
    leaf_paths: list[str] = []
    for position, (path, leaf) in enumerate(zip(paths, leaves)):
        if path[0] == 1:
            root = str(path[1])
        else:
            root = names[path[1]] if path[1] < len(names) else f"args[{path[1]}]"
        readable = format_path(root, path[2:])
        leaf_paths.append(readable)
        if isinstance(leaf, torch.Tensor):
            _refuse_unstrided(fn, readable, leaf, transforms)
            tensors.append(leaf)
            tensor_paths.append(readable)
            positions.append(position)
            key.append(tensor_signature(leaf))
        else:
            try:
                hash(leaf)
            except TypeError:
                kind = type(leaf.value if isinstance(leaf, _Static) else leaf).__name__
                raise TypeError(
                    f"remat({_qualname(fn)}): argument {readable} is a {kind}, which is "
                    "neither a tensor nor hashable. Non-tensor arguments are static (part of the "
                    "cache key), so they must be hashable: pass a tuple instead of a list, or make "
                    "it a pytree of tensors."
                ) from None
            key.append((type(leaf), leaf))
    return _with_captured(fn, tensors, tensor_paths, leaves, spec, positions, key, leaf_paths, memo)


# Tensor types optree flattens as leaves (it registers neither); a subclass of them might
# be registered as a pytree node, so it takes the general path.
_LEAF_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _split_tensor_args(
    fn: Callable[..., Any], names: tuple[str, ...], args: tuple[Any, ...], memo: CaptureMemo | None = None
) -> Call | None:
    """The common call, `f(x, w)` with plain strided tensors only: the Call (and key)
    _split_flattened builds, without flattening. None for any other call."""
    key: list[Any] = [None]
    for arg in args:
        if type(arg) not in _LEAF_TENSORS or arg.layout != torch.strided:
            return None  # the general path flattens it (or refuses an unstrided tensor)
        key.append(tensor_signature(arg))
    spec, paths, positions = _positional_layout(names, len(args))
    if transforms_active():  # a transform's wrapper may hold what cannot be traced (a DTensor)
        for path, arg in zip(paths, args, strict=True):
            _refuse_unstrided(fn, path, arg, True)
    key[0] = spec
    return _with_captured(fn, list(args), paths, list(args), spec, positions, key, paths, memo)


@functools.lru_cache(maxsize=1024)
def _positional_layout(names: tuple[str, ...], n: int) -> tuple[Any, tuple[str, ...], tuple[int, ...]]:
    """What flattening `(args, {})` gives for `n` positional leaves: the tree structure,
    each leaf's readable path, and the leaves' positions."""
    spec = optree.tree_structure((tuple(object() for _ in range(n)), {}))  # type: ignore[arg-type]
    return spec, tuple(names[i] if i < len(names) else f"args[{i}]" for i in range(n)), tuple(range(n))


def _with_captured(
    fn: Callable[..., Any],
    tensors: list[torch.Tensor],
    tensor_paths: Sequence[str],
    leaves: list[Any],
    spec: Any,
    positions: Sequence[int],
    key: list[Any],
    leaf_paths: Sequence[str],
    memo: CaptureMemo | None,
) -> Call:
    """The Call of split arguments, with what `fn` captures and the state a trace depends
    on added to the key (shared by both ways of splitting)."""
    captured, captured_paths, captured_setters, flags = _collect_consistently(fn, memo)
    transforms = transforms_active()
    for captured_path, tensor in zip(captured_paths, captured):
        if transforms or type(tensor) not in _PLAIN_TENSORS or tensor.layout is not torch.strided:
            _refuse_unstrided(fn, captured_path, tensor, transforms)  # (what it lets through is checked inline)
        key.append(tensor_signature(tensor))
    key.append(flags)
    key.append(torch.is_grad_enabled())
    key.append(transforms)  # eager code runs some ops otherwise under torch.func (dropout)
    key.append(transforms and nested_gradients())  # no transforms: no nesting, and a cheaper answer
    key.append(autocast_state())
    key.append(kernel_choices())  # which fused kernels composites pick (attention, batch norm)
    key.append(factory_defaults())  # the dtype and device `torch.ones(3)` gets
    same = aliases(tensors)
    key.append(same)
    return Call(
        tensors, tensor_paths, captured, captured_paths, captured_setters, leaves, spec, positions, tuple(key),
        leaf_paths, same,
    )


def aliases(tensors: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    """For a call that passes one tensor object as several arguments (`f(x, x)`), each
    argument's first position; None when they are all distinct. The trace then gives those
    arguments one stand-in, as eager code has one tensor: a write through one is seen
    through the others, and autograd adds the gradients of all their uses in one place."""
    if len(tensors) < 3:  # the common calls, answered without a set
        return (0, 0) if len(tensors) == 2 and tensors[0] is tensors[1] else None
    ids = [id(t) for t in tensors]
    if len(set(ids)) == len(ids):
        return None
    first: dict[int, int] = {}
    return tuple(first.setdefault(i, k) for k, i in enumerate(ids))


class _Substitutions:
    """Counts up at every start and end of a trace's substitution of stand-ins where
    functions find their captured tensors (only ever under TRACE_LOCK): odd while one is in
    progress, and changed if one happened in between two reads."""

    def __init__(self) -> None:
        self.count = 0


_SUBSTITUTING = _Substitutions()


Collected = tuple[list[torch.Tensor], list[str], list["Setter | None"], tuple[Any, ...]]


class CaptureMemo:
    """What collect_captured last found for one plain function, with the objects it read
    to find it (its code, closure cells' contents, the globals its code names). While
    each is the same object and none is one collect_captured walks into (containers,
    modules, partials, methods, the user's functions), the same walk would find the same
    things: a call reads those objects and compares identities instead of walking. For a
    module, or a module's bound method (what `checkpoint_layers` wraps), the module's part
    of the walk is checked by a ModuleSnapshot instead."""

    __slots__ = ("last", "last_module")

    def __init__(self) -> None:
        # a function's roots, what the walk found, and snapshots of the modules among the roots
        self.last: tuple[tuple[Any, ...], Collected, tuple[ModuleSnapshot, ...]] | None = None  # swapped atomically
        # for a module or its bound method: the same, by ModuleSnapshot and the method's roots
        self.last_module: tuple[ModuleSnapshot, tuple[Any, ...], Collected] | None = None

    def lookup_module(self, module: torch.nn.Module, roots: tuple[Any, ...]) -> Collected | None:
        last = self.last_module
        if (
            last is not None and last[0].module is module and len(last[1]) == len(roots)
            and all(map(operator.is_, last[1], roots)) and last[0].unchanged()
        ):
            return last[2]
        return None

    def lookup(self, roots: tuple[Any, ...]) -> Collected | None:
        last = self.last
        if last is not None and len(last[0]) == len(roots) and all(map(operator.is_, last[0], roots)):
            if not last[2] or all(snapshot.unchanged() for snapshot in last[2]):
                return last[1]
        return None


_ABSENT = object()


def _roots(fn: types.FunctionType) -> tuple[Any, ...] | None:
    """The objects collect_captured reads to walk `fn`: its code, globals, closure cells'
    contents and the globals its code names (None while a cell is unassigned)."""
    code = fn.__code__
    namespace = fn.__globals__
    try:
        contents = [cell.cell_contents for cell in fn.__closure__ or ()]
    except ValueError:
        return None
    return (code, namespace, *contents, *[namespace.get(name, _ABSENT) for name in _names_of(code).globals])


def _module_snapshots(roots: tuple[Any, ...]) -> tuple[ModuleSnapshot, ...] | None:
    """Snapshots of the modules among a function's roots (a closure over a model's block,
    `lambda t: block(t)`), or None where the walk goes into another kind of object (a
    container, a partial, a user function or object), which nothing watches."""
    walked = {id(root): root for root in roots[2:] if _walked_into(root)}
    if not all(isinstance(root, torch.nn.Module) for root in walked.values()):
        return None
    return tuple(ModuleSnapshot(module) for module in walked.values())


def _module_and_roots(fn: Callable[..., Any]) -> tuple[torch.nn.Module, tuple[Any, ...]] | None:
    """For a module, or a module's bound method whose function is a plain one: the module
    a ModuleSnapshot watches, and the other objects the walk of `fn` reads (the method's
    function and, unless it is installed code, which the walk does not look into, the
    objects `_roots` names). None where the walk goes further (a closure or global it
    walks into)."""
    if isinstance(fn, torch.nn.Module):
        return fn, ()
    if type(fn) is not types.MethodType or not isinstance(fn.__self__, torch.nn.Module):
        return None
    function = fn.__func__
    if type(function) is not types.FunctionType:
        return None
    if is_installed_code(function.__code__):
        return fn.__self__, (function,)
    roots = _roots(function)
    if roots is None or any(map(_walked_into, roots[2:])):
        return None
    return fn.__self__, (function, *roots)


def _forward_globals(module: torch.nn.Module) -> tuple[dict[str, Any], tuple[str, ...]] | None:
    """The globals namespace of a module's own forward (the user's code, not a library's)
    and the global names it reads: a region of the module itself keys on their values,
    as a region of the bound forward does."""
    forward = getattr(type(module), "forward", None)
    if not isinstance(forward, types.FunctionType) or is_installed_code(forward.__code__):
        return None
    return forward.__globals__, _names_of(forward.__code__).globals


def _walked_into(value: Any) -> bool:
    """Whether collect_captured looks inside `value` (see its visit)."""
    if isinstance(value, types.FunctionType):
        return not is_installed_code(value.__code__)
    return (
        isinstance(value, (torch.nn.Module, list, dict, tuple, functools.partial, types.MethodType))
        or _is_user_object(value) or _is_user_class(value)
    )


def _is_user_class(value: Any) -> bool:
    """A class of the user's code: the walk reads the numbers and strings it holds."""
    return isinstance(value, type) and is_user_class(value)


def _is_user_object(value: Any) -> bool:
    """An instance of a class of the user's code with a `__dict__` (not a class or function),
    or a namespace (`types.SimpleNamespace`, `argparse.Namespace`, where configurations are
    kept): the walk reads its attributes, where the user may keep tensors and settings."""
    if type(value) in _NAMESPACES:
        return True
    return hasattr(value, "__dict__") and not isinstance(value, type) and is_user_class(type(value))


_NAMESPACES = (types.SimpleNamespace, argparse.Namespace)


class ModuleSnapshot:
    """What a walk of a module reads, kept to tell cheaply whether a new walk would find the
    same: the globals the module's forward reads (by identity), its submodules (in
    `modules()` order), their types and `__dict__`s, those dicts' sizes and the values under
    every name but nn.Module's own (public ones are settings, compared by value, as the
    cache key compares them; tensors kept as plain attributes, by identity), and the names
    and objects of their parameter, buffer and submodule tables (the same count, and the
    same object under each name: a stand-in a trace puts in a table, or a replaced
    parameter, differs; the same objects under the same names in another order are the
    same walk's, its paths reordered). Each comparison runs over every submodule at once,
    in C; when every attribute is the same object, the by-value comparisons are skipped."""

    __slots__ = (
        "module", "subs", "types", "dicts", "lengths", "watchers", "watched", "readers", "values", "tensors", "tables",
        "sizes", "filled", "entries", "objects", "globals", "global_values",
    )

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.globals = _forward_globals(module)
        self.global_values = self._global_values()
        self.subs = list(module.modules())
        self.types = list(map(type, self.subs))
        self.dicts = list(map(vars, self.subs))
        self.lengths = list(map(len, self.dicts))
        # per module: the values under its own names, then its three tables, read in one pass
        self.watchers = [_reader((*(k for k in d if k not in _MODULE_INTERNALS), *_TABLE_NAMES)) for d in self.dicts]
        self.watched = list(itertools.chain.from_iterable(map(operator.call, self.watchers, self.dicts)))
        self.tensors = _tensor_attributes(self.dicts)
        self.readers = [_reader(tuple(k for k in d if k[0] != "_")) for d in self.dicts]
        self.values = list(map(operator.call, self.readers, self.dicts))
        self.tables = list(itertools.chain.from_iterable(map(_TABLES, self.dicts)))
        self.sizes = list(map(len, self.tables))
        self.filled = [table for table in self.tables if table]  # the tables not empty
        self.entries = [_reader(tuple(table)) for table in self.filled]
        self.objects = list(itertools.chain.from_iterable(map(operator.call, self.entries, self.filled)))

    def _global_values(self) -> list[Any]:
        if self.globals is None:
            return []
        namespace, names = self.globals
        return [namespace.get(name, _ABSENT) for name in names]

    def unchanged(self) -> bool:
        if self.globals is not None and not all(map(operator.is_, self._global_values(), self.global_values)):
            return False
        dicts = list(map(vars, self.subs))
        if list(map(type, self.subs)) != self.types or not all(map(operator.is_, dicts, self.dicts)):
            return False
        if list(map(len, dicts)) != self.lengths:
            return False
        try:  # as many attributes, each name read before still there: the same names (see _MODULE_INTERNALS)
            watched = list(itertools.chain.from_iterable(map(operator.call, self.watchers, dicts)))
        except KeyError:
            return False
        if not all(map(operator.is_, watched, self.watched)) and not self._same_settings(dicts):
            return False
        # the same table objects now (checked above): their sizes, and the same object under each name
        if list(map(len, self.tables)) != self.sizes:
            return False
        try:
            objects = itertools.chain.from_iterable(map(operator.call, self.entries, self.filled))
            return all(map(operator.is_, objects, self.objects))
        except KeyError:  # a name is gone
            return False

    def _same_settings(self, dicts: list[dict[str, Any]]) -> bool:
        """Where some attribute is another object than before: the same tables, settings
        equal by value, the same tensor attributes under the same names."""
        tables = list(itertools.chain.from_iterable(map(_TABLES, dicts)))
        if not all(map(operator.is_, tables, self.tables)):
            return False
        try:
            if list(map(operator.call, self.readers, dicts)) != self.values:
                return False
        except Exception:  # a value whose comparison raises (a tensor attribute): walk again
            return False
        names, tensors = _tensor_attributes(dicts)
        return names == self.tensors[0] and all(map(operator.is_, tensors, self.tensors[1]))


_TABLE_NAMES = ("_parameters", "_buffers", "_modules")
_TABLES = operator.itemgetter(*_TABLE_NAMES)


# What every nn.Module's __init__ puts in its __dict__ (hook tables, the parameter, buffer
# and submodule tables), `training` aside: what a walk reads of a module besides those
# tables is the rest (settings, and tensors kept as plain attributes). Code does not delete
# these, so a snapshot counts them and reads the rest by name.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}


def _tensor_attribute(name: str, value: Any) -> bool:
    """A tensor a module keeps as a plain attribute (outside its tables): an input the walk collects."""
    return isinstance(value, torch.Tensor) and name not in _MODULE_INTERNALS


def _tensor_attributes(dicts: list[dict[str, Any]]) -> tuple[list[str], list[torch.Tensor]]:
    """The names and objects of the modules' tensor attributes, in the walk's order."""
    pairs = [(k, v) for d in dicts for k, v in d.items() if _tensor_attribute(k, v)]
    return [k for k, _ in pairs], [v for _, v in pairs]


def _reader(keys: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """Reads the values under `keys` from a dict, as a tuple (in C: one key is read twice,
    so that itemgetter gives a tuple)."""
    if not keys:
        return lambda d: ()
    return operator.itemgetter(*keys) if len(keys) > 1 else operator.itemgetter(keys[0], keys[0])


def _collect_consistently(fn: Callable[..., Any], memo: CaptureMemo | None = None) -> Collected:
    """collect_captured, never in the middle of another thread's trace (which would hand
    out its stand-ins): lock-free unless a substitution started or ended meanwhile. With
    a memo, a plain function whose reachable objects are unchanged is not walked again,
    nor a module, or a module's bound method, whose ModuleSnapshot (and, for the method,
    its function's roots) is unchanged (a stand-in put in its closure is another object,
    so it never matches)."""
    roots = _roots(fn) if memo is not None and type(fn) is types.FunctionType else None
    watched = None
    if roots is not None:
        found = memo.lookup(roots)  # type: ignore[union-attr]
        if found is not None:
            return found
        watched = _module_snapshots(roots)
    snapshot = None
    parts = _module_and_roots(fn) if memo is not None and roots is None else None
    if parts is not None:
        found = memo.lookup_module(*parts)  # type: ignore[union-attr]
        if found is not None:
            return found
        snapshot = ModuleSnapshot(parts[0])
    before = _SUBSTITUTING.count
    found = collect_captured(fn)
    if before % 2 == 0 and _SUBSTITUTING.count == before:
        if watched is not None and all(snapshot.unchanged() for snapshot in watched):
            memo.last = (roots, found, watched)  # type: ignore[union-attr,assignment]
        elif snapshot is not None and snapshot.unchanged():  # the walk read what the snapshot holds
            memo.last_module = (snapshot, parts[1], found)  # type: ignore[union-attr,index]
        return found
    with TRACE_LOCK:
        return collect_captured(fn)


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
# what `__torch_function__` is on torch.Tensor and on nn.Parameter (which turns it off): a
# subclass with another runs Python of its own on every torch call
_PLAIN_TORCH_FUNCTIONS = (
    torch.Tensor.__torch_function__.__func__,  # type: ignore[attr-defined]
    torch.nn.Parameter.__torch_function__,
)


def _refuse_unstrided(fn: Callable[..., Any], path: str, t: torch.Tensor, transforms: bool) -> None:
    """Sparse and other unstrided tensors, ExpandedWeights and tensor subclasses with their
    own dispatch (DTensor) have no fake stand-in remat can trace with. `transforms`: a
    torch.func transform is active, under which a DTensor is a plain-looking wrapper."""
    if type(t) in _PLAIN_TENSORS:  # the common case, asked per argument and captured tensor on every call
        if t.layout is not torch.strided:
            _refuse_layout(fn, path, t)
        if transforms and is_transform_wrapped(t):  # look beneath the wrapper
            inner = transform_levels(t)[-1]
            if type(inner) not in _PLAIN_TENSORS:
                _refuse_unstrided(fn, path, inner, False)
        return
    if is_expanded_weight(t):  # it answers no attribute read (`.layout` raises)
        raise RematTraceError(
            f"remat({_qualname(fn)}): {path} is an ExpandedWeight (per-sample gradients: "
            "`call_for_per_sample_grads`, Opacus' \"ew\" mode), which remat cannot trace. For a traced "
            "region use torch.func: `vmap(grad(loss))` over the samples."
        )
    if type(t).__torch_dispatch__ is not _PLAIN_DISPATCH:
        raise RematTraceError(
            f"remat({_qualname(fn)}): {path} is a {type(t).__name__}, a tensor subclass with its own dispatch "
            "(such as DTensor for tensor parallelism), and remat traces plain tensors only. Without a torch.func "
            "transform, such a region runs as torch.utils.checkpoint runs it; under one it cannot run."
        )
    torch_function = type(t).__torch_function__
    if getattr(torch_function, "__func__", torch_function) not in _PLAIN_TORCH_FUNCTIONS:
        raise RematTraceError(
            f"remat({_qualname(fn)}): {path} is a {type(t).__name__}, a tensor subclass with its own "
            "__torch_function__, which runs Python of its own on every torch call; remat traces the ops of plain "
            "tensors, which would leave that Python out. Without a torch.func transform, such a region runs as "
            "torch.utils.checkpoint runs it; under one it cannot run. Where the region needs none of that Python, "
            "pass a plain tensor (`t.as_subclass(torch.Tensor)`) to trace it."
        )
    if t.layout != torch.strided:
        _refuse_layout(fn, path, t)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _refuse_layout(fn: Callable[..., Any], path: str, t: torch.Tensor) -> None:
    raise RematTraceError(
        f"remat({_qualname(fn)}): argument {path} is a {t.layout} tensor; remat traces strided "
        "(dense) tensors only. Convert it with `.to_dense()` before the call, or keep the sparse "
        "op outside the remat'd function."
    )


Setter = Callable[[Any], None]
_PLAIN = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)


class _PlainTypes(dict[type, bool]):
    """Whether values of a type are plain (`_PLAIN`), decided once per type: reading a
    module's settings on every call asks it of each attribute, and `isinstance` falls back
    to a custom `__getattribute__` (transformers' configs) for every non-plain one."""

    def __missing__(self, kind: type) -> bool:
        self[kind] = plain = issubclass(kind, _PLAIN)
        return plain


_IS_PLAIN = _PlainTypes()


def _item_setter(container: Any, key: Any) -> Setter:
    def set_item(value: Any) -> None:
        container[key] = value

    return set_item


def _cell_setter(cell: Any) -> Setter:
    def set_cell(value: Any) -> None:
        cell.cell_contents = value

    return set_cell


def collect_captured(fn: Callable[..., Any]) -> Collected:
    """Tensors `fn` can reach without being passed them: each with a path and a setter.

    Looks through closures, bound methods, functools.partial, containers and nn.Modules
    (parameters, buffers, training flags). The setter puts another tensor in the same
    place (None where the container is immutable), so tracing can substitute its own.
    Also returns the plain values (numbers, strings, module settings such as `training`
    or `eps`) it can read, which tracing freezes, so they belong in the cache key.
    """
    found: list[torch.Tensor] = []
    paths: list[str] = []
    setters: list[Setter | None] = []
    flags: list[Any] = []
    seen: set[int] = set()

    def visit(value: Any, path: str, setter: Setter | None, depth: int) -> None:
        if depth > 6 or id(value) in seen or type(value) is types.ModuleType:  # a module (`torch`): nothing to visit
            return
        seen.add(id(value))
        if isinstance(value, types.FunctionType):  # inspect.isfunction, first as the most common
            if is_installed_code(value.__code__):
                return
            names = _names_of(value.__code__)
            for name, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
                try:
                    contents = cell.cell_contents
                except ValueError:  # a cell not yet assigned
                    continue
                if name not in names.written:  # state the function updates is not an input
                    visit(contents, name, _cell_setter(cell), depth + 1)
            namespace = value.__globals__
            for name in names.globals:  # looked up on every call: a rebound global is seen
                if name in namespace and name not in names.written and type(namespace[name]) is not types.ModuleType:
                    visit(namespace[name], name, _item_setter(namespace, name), depth + 1)
        elif isinstance(value, torch.Tensor):
            found.append(value)
            paths.append(path)
            setters.append(setter)
        elif isinstance(value, torch.nn.Module):
            is_plain = _IS_PLAIN
            for sub_name, sub in value.named_modules():
                settings = [(k, v) for k, v in vars(sub).items() if k[0] != "_" and is_plain[type(v)]]
                flags.append((path, sub_name, type(sub), tuple(settings)))
                prefix = f"{path}.{sub_name}" if sub_name else path
                for table in (sub._parameters, sub._buffers):
                    for name, tensor in table.items():
                        if tensor is not None and id(tensor) not in seen:  # a tied weight is one input
                            seen.add(id(tensor))
                            found.append(tensor)
                            paths.append(f"{prefix}.{name}")
                            setters.append(_item_setter(table, name))
                for name, attribute in vars(sub).items():  # a tensor kept as a plain attribute is read too
                    if _tensor_attribute(name, attribute) and id(attribute) not in seen:
                        seen.add(id(attribute))
                        found.append(attribute)
                        paths.append(f"{prefix}.{name}")
                        setters.append(_item_setter(vars(sub), name))
            reads = _forward_globals(value) if depth == 0 else None
            if reads is not None:  # remat(module): its forward's globals are frozen by the trace too
                namespace, names = reads
                for name in names:
                    read = namespace.get(name, _ABSENT)
                    if read is not _ABSENT and is_plain[type(read)]:
                        flags.append((name, read))
        elif isinstance(value, (list, dict)):
            items = enumerate(value) if isinstance(value, list) else value.items()
            for k, item in items:
                visit(item, format_path(path, [k]), _item_setter(value, k), depth + 1)
        elif isinstance(value, tuple):
            for i, item in enumerate(value):
                visit(item, format_path(path, [i]), None, depth + 1)
        elif isinstance(value, functools.partial):
            visit(value.func, path, None, depth + 1)
            visit(value.args, f"{path}.args", None, depth + 1)
            visit(value.keywords, f"{path}.keywords", None, depth + 1)
        elif isinstance(value, types.MethodType):  # inspect.ismethod
            visit(value.__self__, "self", None, depth + 1)
            visit(value.__func__, path, None, depth + 1)
        elif isinstance(value, _PLAIN):
            flags.append((path, value))  # a number or string read from a closure is traced in
        elif _is_user_object(value):  # an object of the user's class: its attributes, as a dict's items
            attributes = vars(value)
            for k, item in attributes.items():
                visit(item, f"{path}.{k}", _item_setter(attributes, k), depth + 1)
        elif _is_user_class(value):  # a class of the user's code: the settings it holds (`Config.scale`)
            is_plain = _IS_PLAIN
            for klass in value.__mro__:
                if klass is not object and is_user_class(klass):
                    held = tuple((k, v) for k, v in vars(klass).items() if k[0] != "_" and is_plain[type(v)])
                    flags.append((path, klass.__qualname__, held))

    visit(fn, "self" if isinstance(fn, torch.nn.Module) else "", None, 0)
    return found, paths, setters, tuple(flags)


@dataclass(frozen=True)
class _Names:
    globals: tuple[str, ...]  # global names the code (and code nested in it) may read
    written: frozenset[str]  # nonlocal and global names it assigns


@functools.lru_cache(maxsize=4096)
def _names_of(code: types.CodeType) -> _Names:
    """What a function's code reads from its globals and what state it assigns."""
    names: list[str] = []
    written: set[str] = set()
    stack = [code]
    while stack:
        current = stack.pop()
        names.extend(current.co_names)
        written.update(
            i.argval for i in dis.get_instructions(current) if i.opname in ("STORE_DEREF", "STORE_GLOBAL")
            and (i.argval in current.co_freevars or i.opname == "STORE_GLOBAL")
        )
        stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    if written:
        warnings.warn_explicit(
            f"remat: `{getattr(code, 'co_qualname', code.co_name)}` assigns "
            f"{', '.join(f'`{n}`' for n in sorted(written))} (nonlocal or global). remat runs Python code "
            "when it traces, not on every call, so such an assignment happens once per trace and the "
            "graph uses the value it saw then. Keep state outside the remat'd function, or pass it "
            "as an argument and return the new value.",
            RematStateWarning,
            code.co_filename,
            code.co_firstlineno,
        )
    return _Names(tuple(dict.fromkeys(names)), frozenset(written))


def _qualname(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__
