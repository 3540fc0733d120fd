"""Call labels: what each op call of a replayed region was given, told by how its
tensors were computed, so that selective checkpointing hands a kept value only to the
recompute's call that was given what the forward's was (`CallLabels`), and which calls it
counts at all (`counted`). Public torch only (op schemas, autograd nodes, dispatch-level
op objects); torch's selective-checkpoint modes that use these labels are in
`torch_internals`."""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch


@functools.cache
def waits() -> frozenset[Any]:
    """The ops that wait for a collective and return its output (torch 2.13: a kept
    collective's output, handed out anew, is not the object they were given)."""
    found = set()
    for namespace in ("_c10d_functional", "c10d_functional"):
        try:
            found.add(getattr(torch.ops, namespace).wait_tensor.default)
        except (AttributeError, RuntimeError):
            continue
    return frozenset(found)


def autocast_may_cache(func: Any, args: tuple[Any, ...]) -> bool:
    """Whether an op call is a cast that autocast may serve from its cast cache instead of
    running it: a cast of a leaf that requires grad and is no view (torch 2.13,
    autocast_mode.h `cached_cast`, which also asks for float32 and a lower target dtype;
    any cast of such a leaf is taken here). Whether it runs depends on what the cache held,
    not on the code: a region's forward may find a parameter's cast there (made by an
    earlier use in the same autocast block) and its recompute not, or the other way round
    (a backward inside the block finds the forward's), so selective checkpointing, which
    matches the recompute's calls of an op to the forward's by count, must not count it.
    Recomputing such a cast gives the same bits."""
    if func is not torch.ops.aten._to_copy.default or not args or not isinstance(args[0], torch.Tensor):
        return False
    t = args[0]
    return t.is_leaf and t.requires_grad and t._base is None


class CallLabels:
    """What each op call of a replayed region was given, told by how its tensors were
    computed: a number per distinct computation (an op and what it was given, down to the
    region's inputs; a random draw also by its count, two draws alike differ; a tensor
    written in place anew after the write), the same in the forward and the recompute, so
    calls the two run in another number or order (an owner such as FSDP viewing parameters
    in forward only) do not confuse it. From outside the region: the object itself for a
    leaf that requires grad (a parameter; the recompute is given the same one), the dtype
    of a wrapped Python number; any other tensor (an input, which may be made anew as a
    DTensor's local tensor is; a buffer; a collective's output) is unseen, and so is what
    is computed from it, so a call is checked by its parameters, numbers and the
    computations it was given that start from them.
    Selective checkpointing matches the recompute's n-th call of an op to the forward's
    n-th by count alone: where the recompute runs other calls than the forward (Python
    state read differently in backward, a cache outside the region that serves the
    forward's values), a kept value would be handed out for another call, a silently wrong
    gradient. A kept value is handed out only to a call given what the forward's was."""

    def __init__(self, transparent: frozenset[Any], numbered: Callable[[Any, Any, Any], bool]) -> None:
        self.transparent, self.numbered = transparent, numbered
        self.made_by = _ByTensor()  # how each tensor was computed
        self.written = _ByTensor()  # the same, after a write in this run
        self.numbers: dict[Any, int] = {}  # a computation described -> its number (told as ("#", number))
        self.given: dict[tuple[Any, int], tuple[Any, ...]] = {}  # (cache key, index) -> what the forward's got

    def start(self) -> None:
        """A run (the forward, or a recompute) starts from the tensors as the region got them."""
        self.written = _ByTensor()

    def take(self, func: Any, args: Any, kwargs: Any) -> tuple[list[Any], tuple[Any, ...], Any]:
        """A call's leaves and what it was given; for a call selective checkpointing neither
        counts nor keeps (`counted`), also its output, run and recorded here (else NOT_RUN)."""
        leaves = _leaves((args, kwargs))
        given = self.describe(leaves)
        if counted(func, args):
            return leaves, given, NOT_RUN
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, leaves, given, out, None)
        return leaves, given, out

    def describe(self, leaves: list[Any]) -> tuple[Any, ...]:
        """What a call was given: the leaves of its arguments (`_leaves((args, kwargs))`), told."""
        return tuple(self._origin(v) for v in leaves)

    def _origin(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value if isinstance(value, _PLAIN) else type(value).__qualname__
        made = self.written.get(value)
        if made is None:
            made = self.made_by.get(value)
        if made is not None:
            return made
        leaf = _cast_leaf(value)
        if leaf is not None:  # a cast autocast took from its cache, made before the region
            return self._number(("cast", self._origin(leaf), value.dtype))
        if value.is_leaf and value.requires_grad:  # a parameter: the recompute is given the same one
            return ("outside", id(value))
        if value.dim() == 0 and not value.requires_grad:  # a Python number, wrapped anew on every call
            return ("number", value.dtype, value.device)
        return _UNSEEN

    def _number(self, description: Any) -> tuple[str, int]:
        return ("#", self.numbers.setdefault(description, len(self.numbers)))

    def record(
        self, func: Any, args: Any, kwargs: Any, leaves: list[Any], given: tuple[Any, ...], out: Any, index: int | None
    ) -> None:
        """How `out`, and what the call wrote in place, were computed."""
        described: Any = None  # a transparent op's output is told as its input
        if unchecked(func) or any(g is _UNSEEN for g in given):  # unseen, and so what is computed from it
            described = _UNSEEN
        elif func in self.transparent:
            pass
        elif autocast_may_cache(func, args):
            described = ("cast", given[0], out.dtype)
        else:
            described = (func, given, index if index is not None and self.numbered(func, args, kwargs) else None)
        inputs = {id(t) for t in leaves if isinstance(t, torch.Tensor)}
        for position, t in enumerate(_leaves(out)):
            if isinstance(t, torch.Tensor) and id(t) not in inputs:
                if described is None or described is _UNSEEN:
                    self.made_by.put(t, (given[0] if given else _UNSEEN) if described is None else _UNSEEN)
                elif described[0] == "cast":  # as a cast autocast took from its cache is told
                    self.made_by.put(t, self._number(described))
                else:
                    self.made_by.put(t, self._number((described, position)))
        for position, t in enumerate(_written_tensors(func, args, kwargs)):
            self.written.put(t, _UNSEEN if described is _UNSEEN else self._number((described, "written", position)))


_UNSEEN = ("unseen",)  # a tensor made where no mode sees it
NOT_RUN = object()  # `CallLabels.take` left the call to the mode


def counted(op: Any, args: Any) -> bool:
    """Whether selective checkpointing counts (and may keep) a call: not `SAC_IGNORED_OPS`
    (detach and the like), nor a cast autocast may take from its cache."""
    return op not in sac_ignored_ops() and not autocast_may_cache(op, args)


@functools.cache
def sac_ignored_ops() -> frozenset[Any]:
    from torch.utils.checkpoint import SAC_IGNORED_OPS

    return frozenset(SAC_IGNORED_OPS)


class _ByTensor:
    """A value per tensor, held without keeping the tensor alive: by its id, checked
    against a weak reference (cheaper per op than a WeakTensorKeyDictionary's lookup)."""

    def __init__(self) -> None:
        self.values: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}

    def get(self, t: torch.Tensor) -> Any:
        found = self.values.get(id(t))
        return found[1] if found is not None and found[0]() is t else None

    def put(self, t: torch.Tensor, value: Any) -> None:
        self.values[id(t)] = (weakref.ref(t), value)


def _written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op writes in place, as its schema says."""
    found = []
    for i, name in _written_arguments(func):
        value = args[i] if i < len(args) else kwargs.get(name)
        found += [t for t in _leaves(value) if isinstance(t, torch.Tensor)]
    return found


@functools.cache
def _written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """The positions and names of the arguments `func` writes in place, as its schema says."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return ()
    return tuple(
        (i, argument.name)
        for i, argument in enumerate(schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


def _cast_leaf(t: torch.Tensor) -> torch.Tensor | None:
    """The leaf `t` is a cast of, where autograd recorded it so (a cast autocast caches:
    its node is ToCopyBackward0, whose next is the leaf's AccumulateGrad; torch 2.13)."""
    node = t.grad_fn
    if node is None or type(node).__name__ != "ToCopyBackward0" or not node.next_functions:
        return None
    variable = getattr(node.next_functions[0][0], "variable", None)
    return variable if isinstance(variable, torch.Tensor) else None


def unchecked(func: Any) -> bool:
    """Ops whose kept output is handed out whatever they were given: collectives and their
    waits (c10d's ops and their functional forms: their buffers are made anew where no mode
    sees it, and owners such as FSDP run them differently in backward) and profiler marks."""
    return getattr(func, "namespace", None) in ("c10d", "_c10d_functional", "c10d_functional", "profiler")


_PLAIN = (int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _leaves(value: Any) -> list[Any]:
    """The leaves of an op's arguments or outputs (tuples and lists of tensors, numbers, sizes)."""
    if isinstance(value, dict):
        value = list(value.values())
    elif not isinstance(value, (tuple, list)):
        return [value]
    found: list[Any] = []
    for item in value:
        if isinstance(item, (tuple, list, dict)):
            found += _leaves(item)
        else:
            found.append(item)
    return found
