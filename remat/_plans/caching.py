"""The plan cache: per function, bounded, shared by every wrapper of the function.

Tracing holds one process-wide lock (make_fx keeps process-wide state, and tracing puts
stand-ins where the function finds its captured tensors); a call that finds its plan takes
no lock. A function that keeps tracing gets a `RematRetraceWarning` saying what changed.
"""

from __future__ import annotations

import inspect
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .._core.errors import RematRetraceWarning
from .._core.locking import TRACE_LOCK
from .._core.logs import warn_at_user_line
from .._core.torch_internals import drop_fake_cache_entries
from .like_layers import clear_like_layers
from .sharing import clear_shared_plans

if TYPE_CHECKING:
    from .templates import Templates

DEFAULT_CACHE_SIZE = 64  # plans per function and policy; the least recently used goes first
RETRACE_WARNING_AFTER = 8  # traces of one function before the first warning (then 16, 32, ...)

MISSING: Any = object()


@dataclass
class _PerStorageOffsets:
    """Plans of a function whose graph reads its inputs' storage offsets (`as_strided` on
    an input), one per tuple of offsets; other plans serve inputs at any offset."""

    plans: dict[tuple[int, ...], Any] = field(default_factory=dict)


@dataclass
class PlanCache:
    """The plans of one function under one set of settings, least recently used first."""

    region: str
    maxsize: int = DEFAULT_CACHE_SIZE
    plans: OrderedDict[Any, Any] = field(default_factory=OrderedDict)
    traces: int = 0
    _warned_at: int = 0
    _last: tuple[tuple[Any, ...], Sequence[str]] | None = None
    templates: Templates | None = None  # the function's shape templates, made on first trace
    # the most recently used key and its plan: already last in LRU order, so a call with the
    # same signature as the one before (a training loop) needs no dict lookup or reordering
    _recent: tuple[tuple[Any, ...], Any] | None = None

    def lookup(self, key: tuple[Any, ...], storage_offsets: Callable[[], tuple[int, ...]]) -> Any:
        """The plan for `key` (a Plan, or None when nothing needs a gradient), or MISSING."""
        recent = self._recent
        if recent is not None and recent[0] == key:
            return recent[1]
        entry = self.plans.get(key, MISSING)
        if entry is MISSING:
            return MISSING
        try:
            self.plans.move_to_end(key)
        except KeyError:  # evicted by another thread meanwhile
            pass
        if isinstance(entry, _PerStorageOffsets):
            return entry.plans.get(storage_offsets(), MISSING)
        self._recent = (key, entry)
        return entry

    def store(
        self, key: tuple[Any, ...], labels: Sequence[str], plan: Any, storage_offsets: tuple[int, ...] | None, traced: bool = True
    ) -> None:
        """Keep `plan` (per storage offsets when given), evict the oldest beyond `maxsize`,
        and warn when this function has traced many times (`traced`: the plan came from a
        trace, not from a template of another size)."""
        if storage_offsets is not None:
            entry = self.plans.get(key)
            if not isinstance(entry, _PerStorageOffsets):
                entry = _PerStorageOffsets()
            entry.plans[storage_offsets] = plan
            plan = entry
        self._recent = None  # the entry it named may be evicted below
        self.plans[key] = plan
        self.plans.move_to_end(key)
        while len(self.plans) > self.maxsize:
            self.plans.popitem(last=False)
        if not traced:
            return
        self.traces += 1
        previous, self._last = self._last, (key, labels)
        if self.traces >= RETRACE_WARNING_AFTER and self.traces >= 2 * self._warned_at:
            self._warned_at = self.traces
            advice = (
                "Only tensor sizes changed: remat(fn, dynamic=True) (checkpoint_layers(..., dynamic=True)) traces "
                "a symbolic size once instead."
                if _only_sizes_changed(previous, key)
                else "Each new signature (shapes, dtypes, static values, closure values) costs a trace. Make "
                "varying Python values tensors, or pass them as static arguments only when they take few values."
            )
            warn_at_user_line(
                f"remat({self.region}) has traced {self.traces} times; {_what_changed(previous, key, labels)}. {advice}",
                RematRetraceWarning,
            )

    def why_traced(self, key: tuple[Any, ...], labels: Sequence[str]) -> str:
        """Why a call of this key is traced, for the log: the first, or what changed."""
        if self._last is None:
            return "first call"
        return _what_changed(self._last, key, labels).replace("the last trace differed from the one before", "the call differs from the last trace")

    def clear(self) -> None:
        self.plans.clear()
        self.traces, self._warned_at, self._last, self.templates, self._recent = 0, 0, None, None, None


def _what_changed(previous: tuple[tuple[Any, ...], Sequence[str]] | None, key: tuple[Any, ...], labels: Sequence[str]) -> str:
    """Which parts of the cache key differ from the previous trace's, for people."""
    if previous is None or len(previous[0]) != len(key):
        return "the arguments' structure changed"
    changes = [
        f"{label}: {_describe_part(old)} -> {_describe_part(new)}"
        for label, old, new in zip(labels, previous[0], key)
        if old != new
    ]
    return "the last trace differed from the one before in " + "; ".join(changes[:4]) if changes else "nothing changed"


def _is_tensor_signature(part: Any) -> bool:
    return isinstance(part, tuple) and len(part) == 5 and isinstance(part[0], tuple)


def _only_sizes_changed(previous: tuple[tuple[Any, ...], Sequence[str]] | None, key: tuple[Any, ...]) -> bool:
    """Whether the key differs from the previous trace's only in tensor sizes (and strides)."""
    if previous is None or len(previous[0]) != len(key):
        return False
    changed = [(old, new) for old, new in zip(previous[0], key) if old != new]
    return bool(changed) and all(
        _is_tensor_signature(old) and _is_tensor_signature(new) and len(old[0]) == len(new[0]) and old[2:] == new[2:]
        for old, new in changed
    )


def _describe_part(part: Any) -> str:
    """A key part: a tensor signature (shape, strides, dtype, device, needs grad), a static
    value as (type, value), or anything else."""
    if _is_tensor_signature(part):
        shape, _, dtype, device, needs = part
        return f"{str(dtype).replace('torch.', '')}{list(shape)} on {device}{', needs grad' if needs else ''}"
    if isinstance(part, tuple) and len(part) == 2 and isinstance(part[0], type):
        return repr(part[1])
    return repr(part)[:80]


_STORES: weakref.WeakKeyDictionary[Any, dict[Any, PlanCache]] = weakref.WeakKeyDictionary()
_UNOWNED: weakref.WeakSet[PlanCache] = weakref.WeakSet()  # caches of functions without weak references


def plan_cache(fn: Callable[..., Any], settings: tuple[Any, ...], region: str, maxsize: int) -> PlanCache:
    """The cache of `fn` under `settings`, shared by every wrapper of it.

    `remat(block)(x)` or `remat(self.block.forward)(x)` inside a model's forward builds a
    new wrapper per call; keying plans by the module (or function) that owns them lets
    those wrappers reuse one trace. The cache dies with its owner.
    """
    owner = fn.__self__ if inspect.ismethod(fn) else fn
    function = fn.__func__ if inspect.ismethod(fn) else None
    with TRACE_LOCK:
        try:
            per_owner = _STORES.setdefault(owner, {})
        except TypeError:  # not weak-referenceable: the cache lives with the wrapper
            cache = PlanCache(region, maxsize)
            _UNOWNED.add(cache)
            return cache
        cache = per_owner.setdefault((function, settings), PlanCache(region, maxsize))
        cache.maxsize = maxsize
        return cache


def clear_cache(fn: Callable[..., Any] | None = None) -> None:
    """Drop the traced plans of every remat'd function, or of `fn` (a function, a bound
    method, a module, or a remat wrapper of one). The next call traces again. Without
    `fn`, also what remat's traces left in torch's fake-tensor cache."""
    fn = getattr(fn, "__wrapped__", fn)
    with TRACE_LOCK:
        if fn is None:
            caches = [c for per_owner in list(_STORES.values()) for c in per_owner.values()] + list(_UNOWNED)
        else:
            owner = fn.__self__ if inspect.ismethod(fn) else fn
            caches = list(_STORES.get(owner, {}).values())
        for cache in caches:
            cache.clear()
        if fn is None:
            clear_shared_plans()
            clear_like_layers()
            drop_fake_cache_entries()
