"""Replaying: a region remat cannot trace runs as torch.utils.checkpoint runs it.

Where a function cannot become a graph (shapes that depend on data looped over in Python,
a custom autograd.Function, a hook in backward...) and no torch.func transform is active,
the region runs under non-reentrant `torch.utils.checkpoint`: its Python runs in forward
and again in backward to recompute what was not kept. What makes that exact:

- the region's policy is asked op by op (torch's selective checkpointing), with the same
  meta tensors as in a trace; a `checkpoint_name` is a named copy the policy can keep;
- the random stream is checkpoint's own (the default generators' states restored for
  the recompute), and a generator the region is given (`generator=`) is restored as the
  memory below is; random ops are recomputed whatever the policy says, since a kept draw
  would leave the recompute's later draws reading the numbers it took;
- tensors the region changes in place that it did not make (BatchNorm's running
  statistics, a counter) are recorded before their first change in forward; the
  recompute starts from those values and they are put back after it, so such state is
  updated once, as without remat (checkpoint alone updates it twice); memory a copy or a
  fill writes is left as the forward left it (the recompute writes it again, or reads it
  as the forward did: FSDP's gathered parameters);
- the recompute's Python sees what the forward saw and leaves no trace where remat can
  see: the objects the region and the user's forward hooks reach, and the names they can
  rebind, hold, while it runs, what they held when the forward started (a cache the
  forward filled is empty again), and afterwards what they held before it;
- a kept value serves every recompute, so a gradient of a gradient runs as in eager code.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, get_device_states

from remat.policies import MemoryBudget, nothing_saveable

from .._core.errors import RematError, RematStateWarning
from .._core.nodes import draws_random, generators_of, overwrites, writes_in_place, written_values
from .._core.residuals import Recompute, Residual
from .._core.torch_internals import (
    SacEntry,
    dispatch_modes_off,
    inner_tensors,
    local_tensor,
    replays_supported,
    selective_checkpoint_contexts,
    torch_function_state,
    torch_function_state_now,
)
from .._partition.compiling import NAMED_COPY, Decisions
from .._partition.costs import nbytes_of, op_flops
from .._trace.failures import user_line
from .._trace.hooks import forward_hooks
from .._trace.randomness import PythonRandomStates, python_random_states, set_python_random_states
from .._trace.reachable import Snapshot, modules_reached, roots_of, roots_of_hooks

# Where a replayed region's forward is: checkpoint entering its own hooks, or the region's code
_STARTING, _RUNNING = "starting", "running"
_REPLAYING: contextvars.ContextVar[str | None] = contextvars.ContextVar("remat_replaying", default=None)


def replaying() -> bool:
    """Whether a replayed region runs (`checkpoint_name` then makes a named copy)."""
    return _REPLAYING.get() is not None


def replay_starting() -> bool:
    """Whether a replayed region is entering its own saved-tensor hooks, before its code
    runs: hooks entered then are remat's, hooks entered by its code are the user's."""
    return _REPLAYING.get() == _STARTING


@dataclass(frozen=True)
class KeptMemory:
    """The memory one replayed call keeps for backward, by where it is (device and
    address; a generator state by its place in the call) with its bytes, as
    `saved_tensor_bytes` counts storages. It is kept while the call's backward graph is."""

    storages: dict[Hashable, int]
    graph: weakref.ref[Any]  # the call's recompute context, which its backward graph holds

    def alive(self) -> bool:
        return self.graph() is not None


# told what one replayed call keeps, what its backward recomputes, and the memory it keeps
Observe = Callable[[list[Residual], list[Recompute], KeptMemory], None]


_REPLAYS_SUPPORTED = replays_supported()


def replay(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    policy: Callable[..., Any] | None,
    region: str,
    observe: Observe | None = None,
) -> Any:
    """`fn(*args, **kwargs)` as a checkpointed region under `policy`, op by op; `observe`
    (for remat.report) is told what the call keeps and what its backward recomputes."""
    if not _REPLAYS_SUPPORTED:
        raise RematError(
            f"remat({region}) cannot be traced, so it must run replayed (as torch.utils.checkpoint runs it), "
            f"which needs torch 2.13 or newer; this is torch {torch.__version__}. Upgrade torch, or make the "
            "region traceable (the RematFallbackWarning before this says why it is not)."
        )
    roots = roots_of(fn, [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items()))
    observed = None
    if observe is not None:
        observed = functools.partial(_Observed, region, _input_names(fn, args, kwargs, roots), _rng_states(args), observe)
    contexts = functools.partial(_contexts, policy, region, fn, roots, observed)
    function = functools.partial(fn, **kwargs) if kwargs else fn  # checkpoint's own keywords stay the function's
    token = _REPLAYING.set(_STARTING)
    try:
        running = _code_running(function)
        return checkpoint(running, *args, use_reentrant=False, context_fn=contexts, preserve_rng_state=True)
    finally:
        _REPLAYING.reset(token)


def _code_running(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, marking its forward call as the region's code running (its recompute in
    backward runs as before, unmarked)."""

    def run(*args: Any) -> Any:
        if _REPLAYING.get() != _STARTING:
            return function(*args)
        token = _REPLAYING.set(_RUNNING)
        try:
            return function(*args)
        finally:
            _REPLAYING.reset(token)

    return run


def replays_op_by_op(policy: Callable[..., Any] | None) -> bool:
    """Whether a replayed region asks `policy` op by op: not for a policy that keeps
    nothing, nor for a memory budget (it chooses by tracing; a replayed region under one
    keeps the least it can), unless the region may communicate: a collective's output is
    kept under those too."""
    if policy is None or policy is nothing_saveable or isinstance(policy, MemoryBudget):
        return _communicating()
    return True


def _communicating() -> bool:
    """Whether collectives can run in this process (a default process group exists)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _contexts(
    policy: Callable[..., Any] | None,
    region: str,
    fn: Callable[..., Any],
    roots: list[tuple[str, Any]],
    observed: Callable[[_ReplayDecisions | None, _ExternalWrites, weakref.ref[Any]], _Observed] | None,
) -> tuple[Any, Any]:
    """checkpoint's (forward, recompute) contexts for one call of the region."""
    python = _PythonState(fn, roots)
    asked = nothing_saveable if policy is None or isinstance(policy, MemoryBudget) else policy  # the least it can
    decisions = _ReplayDecisions(asked, region) if replays_op_by_op(policy) else None
    forward, recompute = _Reentrant(python.forward), _Reentrant(python.recompute)
    writes = _ExternalWrites(region, decisions)
    caching: tuple[Any, ...] = ()  # selective checkpointing's cache: filled in forward, read in the recompute
    reading: tuple[Any, ...] = ()
    if decisions is not None:
        # a name's copy is not made in the recompute; random draws are told apart by their count
        decisions.caching, cached = selective_checkpoint_contexts(decisions, (NAMED_COPY,), draws_random)
        caching, reading = (decisions.caching,), (_Diverging(cached, region), cached)
    # The recompute runs inside backward, and `t.backward()` on a tensor subclass `t` runs the
    # whole backward inside the subclass's `__torch_function__`, where subclasses' own are off:
    # a region given a subclass with its own (one that changes what an op gives) would
    # recompute other values than its forward computed, as torch.utils.checkpoint does. So the
    # recompute handles `__torch_function__` as the forward did.
    seen = _SeenTorchFunctionState()
    as_seen = _Reentrant(lambda: torch_function_state(seen.state))
    recomputing = _Entered(as_seen, recompute, _Rewound(writes), *reading)
    watching = () if observed is None else (observed(decisions, writes, weakref.ref(recomputing)),)  # innermost: sees ops first
    return _Entered(seen, forward, *caching, writes, *watching), recomputing


class _SeenTorchFunctionState:
    """Notes how `__torch_function__` was handled when the forward ran."""

    def __init__(self) -> None:
        self.state: Any = None

    def __enter__(self) -> None:
        self.state = torch_function_state_now()

    def __exit__(self, *exc: Any) -> None:
        return None


class _Entered:
    """Context managers entered in order and left in reverse, re-enterable (checkpoint
    enters the recompute context once per recompute)."""

    def __init__(self, *managers: Any) -> None:
        self.managers = managers

    def __enter__(self) -> None:
        for manager in self.managers:
            manager.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for manager in reversed(self.managers):
            manager.__exit__(*exc)


class _Reentrant:
    """A context manager made anew by `make` each time it is entered."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self.entered: list[Any] = []

    def __enter__(self) -> None:
        manager = self.make()
        manager.__enter__()
        self.entered.append(manager)

    def __exit__(self, *exc: Any) -> Any:
        return self.entered.pop().__exit__(*exc)


class _Diverging:
    """Warns, as the recompute ends, where it gave an op call other values than the forward
    gave it, so that a kept value was recomputed instead (`selective_checkpoint_contexts`)."""

    def __init__(self, cached: Any, region: str) -> None:
        self.cached, self.region = cached, region

    def __enter__(self) -> None:
        self.cached.diverged = None

    def __exit__(self, *exc: Any) -> None:
        if self.cached.diverged is not None:  # also when it stops early, having recomputed what backward needs
            warnings.warn(
                f"remat({self.region}): in backward, the region's Python gave {self.cached.diverged} other values "
                "than in its forward (state it reads changed between forward and backward, or a cache outside "
                "the region served the forward's values). remat computed that value again instead of handing out "
                "the one it kept, so the gradient is right, but keeping it was memory spent for nothing. Keep "
                "such state in the region's arguments or modules, so that backward sees what forward saw.",
                RematStateWarning,
                stacklevel=2,
            )


class _ReplayDecisions(Decisions):
    """The policy asked op by op in eager code. An Offload answer keeps the value on its
    device (a replayed region moves nothing). A name is asked about when the named copy
    runs, as under compile: kept, the value of the op that produced it is kept (or the
    copy, where that op had several outputs). An op that writes in place is never kept
    (the recompute writes again, from the values before), and a kept value the region
    later changes in place is recomputed instead (selective checkpointing would give the
    changed value, or refuse). A random op is never kept: the recompute draws again from
    the restored generators, and a draw it skipped would shift every later one (a name
    given to a random op's output keeps the named copy)."""

    def __init__(self, policy: Callable[..., Any] | None, region: str) -> None:
        super().__init__(policy, region)
        self.caching: Any = None  # the caching mode these decisions serve
        self.kept: dict[tuple[torch.device, int], list[SacEntry]] = {}
        # the last single-output op call of each storage, for a name given to its output
        self.made_by: dict[tuple[torch.device, int], tuple[weakref.ref[torch.Tensor], SacEntry]] = {}
        self.names: dict[tuple[Any, int], str] = {}  # (cache key, index) of a call kept by the name of its output

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if writes_in_place(op) or draws_random(op, args, kwargs):
            return CheckpointPolicy.PREFER_RECOMPUTE
        out = ctx.op_output
        if op is NAMED_COPY:
            return self._named(op, args[0], args[1])
        tag = super().__call__(ctx, op, *args, **kwargs)
        single = _has_storage(out)
        if tag is CheckpointPolicy.MUST_SAVE or single:
            entry = SacEntry(self.caching, op, args)
            if single:
                self.made_by[_storage_key(out)] = (weakref.ref(out), entry)
            if tag is CheckpointPolicy.MUST_SAVE:
                for value in optree.tree_leaves(out):  # type: ignore[arg-type]
                    if _has_storage(value):
                        self.kept.setdefault(_storage_key(value), []).append(entry)
        return tag

    def _named(self, op: Any, value: torch.Tensor, name: str) -> CheckpointPolicy:
        if self.answer(op, (value,), {}, name) is not CheckpointPolicy.MUST_SAVE or not _has_storage(value):
            return CheckpointPolicy.PREFER_RECOMPUTE
        key = _storage_key(value)
        made = self.made_by.get(key)
        if made is None or made[0]() is not value:
            return CheckpointPolicy.MUST_SAVE  # not one op's only output: keep the copy
        made[1].keep(value)
        self.names[made[1].key, made[1].index] = name
        self.kept.setdefault(key, []).append(made[1])
        return CheckpointPolicy.PREFER_RECOMPUTE

    def tag(self, op: Any, answer: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if answer else CheckpointPolicy.PREFER_RECOMPUTE

    def written(self, key: tuple[torch.device, int]) -> None:
        """The region changes memory `key` in place: what was kept there is recomputed."""
        for entry in self.kept.pop(key, ()):
            entry.forget()
        self.made_by.pop(key, None)


class _Observed(TorchDispatchMode):
    """While a replayed region runs forward under remat.report, what it keeps for backward
    and what its backward recomputes, at this rank's sizes (a DTensor by its local tensor):
    - what it reads from memory it did not make, kept by reference (the recompute reads it
      again): its arguments, its modules' parameters and buffers, what its closure holds;
    - the outputs of the calls the policy kept (the cache the recompute takes them from),
      except memory their owner freed after the forward (FSDP's gathered parameters);
    - the generator states checkpoint keeps to replay the random stream, and those of the
      generators the region is given (`generator=`), which remat keeps to rewind them;
    - every other op call, run again in backward."""

    def __init__(
        self,
        region: str,
        names: dict[tuple[torch.device, int], str],
        rng: list[torch.Tensor],
        observe: Observe,
        decisions: _ReplayDecisions | None,
        writes: _ExternalWrites,
        graph: weakref.ref[Any],
    ) -> None:
        super().__init__()
        self.region, self.names, self.rng, self.observe, self.decisions = region, names, rng, observe, decisions
        self.writes, self.graph = writes, graph
        self.made: set[tuple[torch.device, int]] = set()
        self.reads: dict[tuple[torch.device, int], torch.Tensor] = {}
        # (op, its outputs, the user's line, FLOPs, its cache entry, the name a named copy gives)
        self.calls: list[tuple[Any, list[torch.Tensor], str | None, int, SacEntry | None, str | None]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # no tensor op runs below: every mode under this one would count it
        given = _plain_tensors((args, kwargs))
        keys = [_memory_of(t) for t in given]
        for key, tensor in zip(keys, given):
            if key is not None and key not in self.made:
                self.reads.setdefault(key, tensor)
        outs = _plain_tensors(out)
        self.made.update(key for key in map(_memory_of, outs) if key is not None and key not in keys)
        flops = op_flops(func, lambda: (_locals(args), _locals(kwargs)), outs)
        caching = None if self.decisions is None else self.decisions.caching
        entry = None if caching is None else SacEntry.of_call(caching, func, args)
        name = args[1] if func is NAMED_COPY else None
        self.calls.append((func, outs, user_line(replay.__code__), flops, entry, name))
        return out

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if exc[0] is None:
            residuals, memory = self._residuals()
            self.observe(residuals, self._recomputes(), KeptMemory(memory, self.graph))

    def _residuals(self) -> tuple[list[Residual], dict[Hashable, int]]:
        """What the call keeps, and the memory that holds it."""
        memory: dict[Hashable, int] = {}

        def residual(t: torch.Tensor, kind: str, op: Any, name: str | None, source: str | None) -> Residual:
            key = _memory_of(t) if kind != "rng" else None  # checkpoint's own copy of a state is elsewhere
            memory[key or (id(self.graph), len(memory))] = t.untyped_storage().nbytes() if key else t.nbytes
            return Residual(tuple(t.shape), t.dtype, nbytes_of(tuple(t.shape), t.dtype), kind, op, name, source, self.region)

        kept = [residual(t, "input", None, None, self.names.get(key)) for key, t in self.reads.items()]
        # memory kept twice (an op's output and its alias) is kept once; where each is now (an
        # owner that frees and gathers again, as FSDP does, moves it outside any op)
        counted = {_memory_of(t) for t in self.reads.values()}
        names = {} if self.decisions is None else self.decisions.names
        for func, outs, source, _, entry, copy_name in self.calls:
            if entry is None or not entry.kept():
                continue
            name = names.get((entry.key, entry.index), copy_name)
            for t in outs:
                key = _memory_of(t)
                if _freed(t) or (key is not None and key in counted):
                    continue
                counted.add(key)
                kept.append(residual(t, "intermediate", func, name, source))
        kept.extend(residual(state, "rng", None, None, "generator state") for state in self.rng)
        given = [state for _, state in self.writes.generators.values()]  # what the recompute rewinds to
        kept.extend(residual(state, "rng", None, None, "given generator's state") for state in given)
        return kept, memory

    def _recomputes(self) -> list[Recompute]:
        return [
            Recompute(func, source, flops, self.region)
            for func, _, source, flops, entry, _ in self.calls
            if entry is None or not entry.kept()
        ]


def _plain_tensors(value: Any) -> list[torch.Tensor]:
    """The plain tensors holding the memory of the tensors in `value` (a DTensor's shard)."""
    return [inner for t in optree.tree_leaves(value) if isinstance(t, torch.Tensor) for inner in inner_tensors(t)]  # type: ignore[arg-type]


def _freed(t: torch.Tensor) -> bool:
    """Whether the owner of `t`'s memory freed it after making it (FSDP frees the parameters
    it gathered once a layer's forward is done): a value so kept holds no memory."""
    return _has_storage(t) and t.numel() > 0 and t.untyped_storage().nbytes() == 0


def _locals(value: Any) -> Any:
    """`value` with each DTensor as this rank's shard (for FLOPs at this rank's sizes)."""
    return optree.tree_map(lambda v: local_tensor(v) if isinstance(v, torch.Tensor) else v, value)  # type: ignore[arg-type]


def _memory_of(t: torch.Tensor) -> tuple[torch.device, int] | None:
    """The memory of a plain dense tensor, or None."""
    return _storage_key(t) if _has_storage(t) else None


def _input_names(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], roots: list[tuple[str, Any]]
) -> dict[tuple[torch.device, int], str]:
    """Where each tensor a region can read from comes from, by its memory: the argument's
    name (as a traced region's report names it), `self.` and a module's parameter or
    buffer name, a closure's name."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
        named = list(bound.items())
    except (TypeError, ValueError):  # no signature to bind to: by position
        named = [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
    names: dict[tuple[torch.device, int], str] = {}
    for path, value in named + [root for root in roots if not root[0].startswith("args[") and root[0] not in kwargs]:
        if isinstance(value, torch.nn.Module):
            tensors = [*value.named_parameters(), *value.named_buffers()]
            leaves = [(f"{path}.{name}", t) for name, t in tensors]
        else:
            paths, values, _ = optree.tree_flatten_with_path(value)  # type: ignore[arg-type]
            leaves = [(path + "".join(f"[{p!r}]" for p in at), v) for at, v in zip(paths, values)]
        for where, t in leaves:
            for inner in _plain_tensors(t):
                if (key := _memory_of(inner)) is not None:
                    names.setdefault(key, where)
    return names


def _rng_states(args: tuple[Any, ...]) -> list[torch.Tensor]:
    """The generator states checkpoint keeps for a call (preserve_rng_state): the CPU
    generator's, and that of each accelerator holding an argument."""
    return [torch.get_rng_state(), *get_device_states(*args)[1]]


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


def _has_storage(value: Any) -> bool:
    """A plain dense tensor with memory (a storage remat can key and copy)."""
    return type(value) in (torch.Tensor, torch.nn.Parameter) and value.layout == torch.strided and value.device.type != "meta"


Key = tuple[torch.device, int]


class _ExternalWrites(TorchDispatchMode):
    """While the region runs forward: the storages it allocates, and for each tensor it
    changes in place that it did not allocate, that storage's bytes before the first
    change (a tensor held by a module, a closure or the caller); for each generator it is
    given explicitly, its state before its first draw. `sources`: for each storage the
    region made or overwrote, the storages it did not make whose values that one's were
    computed from."""

    def __init__(self, region: str, decisions: _ReplayDecisions | None) -> None:
        super().__init__()
        self.region = region
        self.decisions = decisions
        self.made: set[Key] = set()
        self.before: dict[Key, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}  # by id: (generator, state before)
        self.sources: dict[Key, frozenset[Key]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for generator in generators_of(args, kwargs):
            if id(generator) not in self.generators:
                self.generators[id(generator)] = (generator, generator.get_state())
        leaves: list[Any] = optree.tree_leaves(written_values(func, args, kwargs))  # type: ignore[arg-type]
        written = [t for t in leaves if isinstance(t, torch.Tensor)]
        overwritten = overwrites(func)
        given = {_storage_key(t) for t in optree.tree_leaves((args, kwargs)) if _has_storage(t)}  # type: ignore[arg-type]
        unread = {_storage_key(t) for t in written if _has_storage(t)} if overwritten else set()  # `out=` is not read
        sources = frozenset().union(*(self.sources.get(key, (key,)) for key in given - unread))
        for tensor in written:
            self._remember(func, tensor, overwritten, sources)
        out = func(*args, **kwargs)
        for value in optree.tree_leaves(out):  # type: ignore[arg-type]
            if _has_storage(value) and _storage_key(value) not in given:  # new memory, not a view or a write
                self.made.add(_storage_key(value))
                self.sources[_storage_key(value)] = sources
        return out

    def _remember(self, func: Any, tensor: torch.Tensor, overwritten: bool, sources: frozenset[Key]) -> None:
        try:
            key = _storage_key(tensor)
        except (RuntimeError, NotImplementedError):
            raise RematError(
                f"remat({self.region}): the region cannot be traced, so it runs as torch.utils.checkpoint runs it, "
                f"and {func} changes in place a {type(tensor).__name__} it did not make, whose memory remat cannot "
                "read to restore it for the recompute (which would change it a second time). Make the change "
                "outside the region, or out of place."
            ) from None
        if self.decisions is not None:
            self.decisions.written(key)
        self.sources[key] = sources if overwritten else sources | self.sources.get(key, {key})
        if (overwritten and key not in sources) or key in self.made or key in self.before:
            # a copy or a fill computes the same from the same inputs whatever the memory held: the
            # recompute starts from what the forward left (an FSDP all-gather the recompute does
            # not repeat left the parameters there). Not where what is written was computed from
            # this memory's earlier values (spectral_norm's power iteration: `v` from `u`, then
            # `u` from `v`, with `out=`): the recompute would start from the new ones
            return
        storage = tensor.untyped_storage()
        with dispatch_modes_off():  # remat's own copy: selective checkpointing's count of the region's ops skips it
            self.before[key] = (storage, storage.clone())


class _Rewound:
    """The recompute's context: the storages and generators the forward changed hold their
    values from before the forward while it runs, and their values from now once it is done."""

    def __init__(self, writes: _ExternalWrites) -> None:
        self.writes = writes
        self.after: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        self.generators_after: list[tuple[torch.Generator, torch.Tensor]] = []

    def __enter__(self) -> None:
        self.after = [(storage, storage.clone()) for storage, _ in self.writes.before.values()]
        for storage, before in self.writes.before.values():
            _copy_back(storage, before)
        self.generators_after = [(g, g.get_state()) for g, _ in self.writes.generators.values()]
        for generator, state in self.writes.generators.values():
            generator.set_state(state)

    def __exit__(self, *exc: Any) -> None:
        for storage, after in self.after:
            _copy_back(storage, after)
        for generator, state in self.generators_after:
            generator.set_state(state)
        self.after, self.generators_after = [], []


def _copy_back(storage: torch.UntypedStorage, saved: torch.UntypedStorage) -> None:
    """`saved`'s bytes into `storage`, unless its owner resized it since (FSDP frees a
    layer's gathered parameters after its forward): then its memory is the owner's."""
    if storage.nbytes() == saved.nbytes():
        storage.copy_(saved)


class _PythonState:
    """The region's Python state for the recompute, as `_Rewound` is for its tensors: the
    objects it reaches and the names it can rebind hold, while the recompute runs, what
    they held when the forward started (a cache the forward filled is empty again), and
    afterwards what they held before the recompute. The forward hooks of its modules run
    in the recompute as in the forward (one that sets what the forward reads, as pruning's
    and FSDP's do, must), and what the user's hooks reach is held the same way. Python's
    `random` and numpy's global generator, too: the recompute draws what the forward drew
    (a layer the forward skipped is skipped again), and they go on from where they were."""

    def __init__(self, fn: Callable[..., Any], roots: list[tuple[str, Any]]) -> None:
        modules = modules_reached(roots)
        hooks = forward_hooks(modules)
        self.roots = roots + roots_of_hooks(hooks)
        self.functions = [fn, *(hook for hook in hooks if isinstance(hook, types.FunctionType))]
        self.before: Snapshot | None = None
        self.draws: PythonRandomStates | None = None
        self.tables = _TensorTables(modules)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self.before = Snapshot.take(self.roots, self.functions)
        self.draws = python_random_states()
        self.tables.forward_starts()
        yield
        self.tables.forward_ends()

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        now, draws = Snapshot.take(self.roots, self.functions), python_random_states()
        if self.before is not None:
            self.before.restore()
        if self.draws is not None:
            set_python_random_states(self.draws)
        try:
            with self.tables.recompute():
                yield
        finally:
            now.restore()
            set_python_random_states(draws)


_Held = list[tuple[dict[str, Any], dict[str, Any]]]  # (a module's parameter or buffer table, what it held)


class _TensorTables:
    """Which tensors the region's modules hold under their parameter and buffer names, for
    the recompute. `functional_call` (and ExpandedWeights, through it) put other tensors
    there for the length of one call, and backward comes after that call: the recompute
    must run with the tensors the forward ran with, or it recomputes other values (a
    silently wrong gradient, as torch.utils.checkpoint gives). So a name whose tensor
    changed since the forward ended holds, while the recompute runs, the tensor it held
    when the forward started. Except the parameters of FSDP's modules: FSDP gathers and
    frees them around each call, and its hooks, which run again in the recompute, keep
    their own account of which it holds."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        managed = _fsdp_managed(modules)
        self.tables = [table for m in modules for table in (m._parameters, m._buffers) if table and not (
            table is m._parameters and m in managed)]
        self.start: _Held = []
        self.end: _Held = []

    def _held(self) -> _Held:
        return [(table, dict(table)) for table in self.tables]

    def forward_starts(self) -> None:
        self.start = self._held()

    def forward_ends(self) -> None:
        self.end = self._held()

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        put_back: list[tuple[dict[str, Any], str, Any]] = []  # (table, name, what it holds now)
        for (table, start), (_, end) in zip(self.start, self.end):
            for name, then in start.items():
                now = table.get(name)
                if now is not then and now is not end.get(name):
                    put_back.append((table, name, now))
                    table[name] = then
        try:
            yield
        finally:
            for table, name, now in put_back:
                table[name] = now


def _fsdp_managed(modules: list[torch.nn.Module]) -> set[torch.nn.Module]:
    """The modules whose parameters FSDP (fully_shard) manages: each FSDP module and the
    modules under it that are not FSDP modules of their own."""
    if not torch.distributed.is_available():
        return set()
    from torch.distributed.fsdp import FSDPModule

    managed: set[torch.nn.Module] = set()
    for module in modules:
        if isinstance(module, FSDPModule):
            managed.update(module.modules())
    return managed


def replay_note(policy: Callable[..., Any] | None) -> str:
    """What a replayed region does under `policy` that a traced one does otherwise."""
    if isinstance(policy, MemoryBudget):
        return f" Under {policy!r} it recomputes everything but collectives (a budget chooses what to keep by tracing)."
    return " A value the policy offloads stays on its device." if policy is not None else ""
