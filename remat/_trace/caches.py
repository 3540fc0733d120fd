"""Library caches a traced function fills with tracing stand-ins.

A function can keep what it computes where no walk of the objects it reaches finds it:
`functools.lru_cache` (and `functools.cache`) hold a decorated function's results inside
the wrapper (transformers' OmDet-Turbo caches its anchors so, other models their position
tables). Run while remat traces, such a function caches a fake tensor, and every later
call, with or without remat, is handed that stand-in instead of a value: eager code then
returns fake tensors, and a replay or another trace of the region fails. After each trace
attempt remat finds the caches that took in a value the attempt computed and empties them
(`cache_clear`), so the next call computes the value again, as a cache that never held it
would. Only when a value the attempt computed outlived it (a trace that stores none leaves
none alive) are the caches looked into: found by one walk of the objects the garbage
collector tracks (tens of ms in a large process), done again only when modules were
imported since the last walk (a cache made later, one per instance, is found at the next
walk).
"""

from __future__ import annotations

import functools
import gc
import sys
import weakref
from typing import Any, Iterable

import torch

_WRAPPER = functools._lru_cache_wrapper  # functools' own public decorators make these
_FOUND: list[weakref.ref[Any]] = []
_FOUND_WITH = [-1]  # how many modules were imported when the caches were last found


def _caches() -> list[Any]:
    """The live lru_cache wrappers of the process."""
    if len(sys.modules) != _FOUND_WITH[0]:
        _FOUND[:] = [weakref.ref(o) for o in gc.get_objects() if type(o) is _WRAPPER]
        _FOUND_WITH[0] = len(sys.modules)
    return [cache for cache in (ref() for ref in _FOUND) if cache is not None]


def empty_caches_holding(made: Iterable[weakref.ref[torch.Tensor]], inputs: Iterable[torch.Tensor]) -> list[str]:
    """Empty each lru cache that holds one of the tensors `made` refers to (a trace
    attempt's values, `inputs` aside: an in-place op hands back its input); their names.
    Nothing is looked up while none of those tensors outlived the attempt, the common case."""
    alive = {id(t) for t in (ref() for ref in made) if t is not None}
    alive.difference_update(map(id, inputs))
    if not alive:
        return []
    emptied: list[str] = []
    for cache in _caches():
        if any(id(t) in alive for t in _cached_tensors(cache)):
            cache.cache_clear()
            emptied.append(_name(cache))
    return emptied


def _cached_tensors(cache: Any) -> list[torch.Tensor]:
    """The tensors among a cache's results, in tuples and lists one level down too: read
    through what the garbage collector sees the wrapper hold (its table, and a bounded
    cache's entries' keys and results; no public API lists them)."""
    held = gc.get_referents(cache)
    for item in list(held):
        if type(item) is dict:
            held += item.values()
    tensors = []
    for item in held:
        if isinstance(item, torch.Tensor):
            tensors.append(item)
        elif type(item) in (tuple, list):
            tensors += [x for x in item if isinstance(x, torch.Tensor)]
    return tensors


def _name(cache: Any) -> str:
    return f"{getattr(cache, '__module__', '?')}.{getattr(cache, '__qualname__', repr(cache))}"
