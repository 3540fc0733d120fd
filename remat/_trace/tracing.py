"""Tracing: from the user's Python function to aten graphs.

Stage 1 (`capture`) runs the function once on fake tensors, traced, then functionalized:
the result is a pure aten graph whose inputs are the call's tensors and the captured
tensors it read, whose outputs are its tensor outputs followed by the new values of any
inputs it mutated. Stage 2 (`differentiate`) replays that graph under autograd and traces
it with its backward into one joint forward+backward graph, which the partitioner splits.
Both traces are recorded by `recording`'s light tracer, or made by make_fx where that
one leaves them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import operator
import sys
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import optree
import torch
import torch.fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .._core.errors import RematStateWarning, RematTraceError
from .._core.nodes import (
    AS_STRIDED_OPS,
    AUTOCAST_CAST_KEY,
    BACKWARD_KEY,
    DIFFERENTIABLE_KEY,
    FILL_LIKE_KEY,
    FILL_PERMUTED_KEY,
    GRAD_OFF_KEY,
    GRADIENT_COUNT_KEY,
    RNG_STREAM_KEY,
    SCOPE_KEY,
    SOURCE_KEY,
    USE_ALIAS_KEY,
    USER_DETACH_KEY,
    annotate,
    comes_after,
    is_random,
    is_view,
    producer,
    source_line,
    view_root,
)
from .._core.torch_internals import (
    any_autocast_enabled,
    any_vmap_active,
    autocast_cache_off,
    autocast_nesting,
    autocast_off,
    autograd_engine_running,
    fake_of_layout,
    grad_disabled_by_code,
    nested_gradients,
    new_fake_mode,
    preserve_node_meta,
    symbolic_stand_in,
    trace_on_fakes,
    tracing_isolated,
    transforms_active,
    unwrap_transforms,
)
from .arguments import Call, needs_grad
from .caches import empty_caches_holding
from .failures import CustomFunctionUsed, backward_failure, custom_function_behind, trace_failure, user_line
from .functions import (
    UNIT_INPUTS,
    UNIT_MARKERS,
    UNIT_OUTPUT,
    UnitRecorder,
    check_units,
    interiors,
    leaving_unit,
    unit_entry,
)
from .hooks import HookCall, HookRecorder
from .mutations import in_place_writes, outputs_for_mutations
from .passes import (
    grad_free_write_as_value_with_grad,
    writes_in_place,
    writes_out_of_place,
)
from .pipelines import stage_one_passes
from .randomness import RNG_KEY, DrawTracker, python_random_drawn, python_random_states, set_python_random_states
from .reachable import Snapshot, roots_of, stand_in_path
from .recording import active_recorder, record_graph, traced_node
from .records import Scope, StageOne

# While a function is being traced: the regions met so far and the index of the innermost
# active one. None when not tracing.
_TRACING: contextvars.ContextVar[tuple[list[Scope], int] | None] = contextvars.ContextVar("remat_tracing", default=None)


def inside_trace() -> bool:
    """True while remat traces a function: a nested remat region then runs inline."""
    return _TRACING.get() is not None


@contextlib.contextmanager
def nested_region(policy: Callable[..., bool] | None, region: str) -> Iterator[None]:
    """Ops traced inside belong to this nested region and are governed by its policy."""
    state = _TRACING.get()
    assert state is not None, "nested_region outside a trace"
    scopes = state[0]
    scopes.append(Scope(policy, region))
    token = _TRACING.set((scopes, len(scopes) - 1))
    try:
        yield
    finally:
        _TRACING.reset(token)


@contextlib.contextmanager
def _tracing_region(scope: Scope) -> Iterator[list[Scope]]:
    scopes = [scope]
    token = _TRACING.set((scopes, 0))
    try:
        yield scopes
    finally:
        _TRACING.reset(token)


_LINEAR = torch.nn.functional.linear
# The user's own conversions: the casts they make are theirs, not autocast's.
_CONVERSIONS = frozenset({
    torch.Tensor.to, torch.Tensor.type, torch.Tensor.type_as, torch.Tensor.float, torch.Tensor.double,
    torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.cpu, torch.Tensor.cuda,
})


class _GuardTracing(TorchFunctionMode):
    """Refuses, while tracing, what would make a silently wrong graph: reading data that
    fake tensors do not have (`.numpy()`, `.tolist()`), tensor hooks (a graph holds none),
    and values made by a custom torch.autograd.Function, whose forward traces but whose
    hand-written backward does not. Notes the grad mode of each call the function makes."""

    _REFUSED = {
        torch.Tensor.numpy: ".numpy()", torch.Tensor.tolist: ".tolist()", torch.Tensor.__array__: "numpy conversion",
        torch.Tensor.__repr__: "printing a tensor (`print(x)`)",
        torch.Tensor.__format__: "formatting a tensor (`f'{x}'`)",
    }
    _DROPOUTS = {torch.nn.functional.dropout, torch.dropout}
    _DETACHES = {torch.Tensor.detach, torch.detach}
    _TENSOR_HOOKS = {
        torch.Tensor.register_hook: ".register_hook(...)",
        torch.Tensor.register_post_accumulate_grad_hook: ".register_post_accumulate_grad_hook(...)",
        torch.Tensor.retain_grad: ".retain_grad()",
    }

    def __init__(self, transformed: bool, eager_caches: bool, default_dtype: torch.dtype) -> None:
        super().__init__()
        self.transformed = transformed
        self.grad_off = False  # the call being run was made with grad disabled
        # The call being run is under autocast and not the user's own cast (`.to`): then the
        # lifetime of autocast's cast cache it runs in (a number; 0 with the cache off), else None.
        self.autocasting: int | None = None
        # A value whose autocast casts in the call being run are not cached: under torch.func,
        # `linear` runs as a matmul with its weight's transpose, a view autocast never caches.
        self.uncached: torch.fx.Node | None = None
        self._cache_lifetimes = 0  # autocast cast-cache lifetimes met: each opens when no autocast context was
        self._in_autocast = False
        # Whether eager code caches casts (read before the trace turns the cache off, so
        # that casts are ops it sees, which an autocast context opened inside inherits; one
        # opened with cache_enabled=False inside the function is not told apart).
        self._eager_caches = eager_caches
        self._default_dtype = default_dtype  # the call's

    def refuse_changed_default_dtype(self) -> None:
        """A graph makes tensors (`torch.ones(3)`, `arange`) in the default dtype of the call
        that runs it: one the function changes is not in the graph."""
        now = torch.get_default_dtype()
        if now is not self._default_dtype:
            raise RematTraceError(
                f"torch's default dtype was changed inside the region (torch.set_default_dtype), from "
                f"{self._default_dtype} to {now}; a traced graph makes its tensors in the caller's default dtype. "
                "Set the default dtype outside the remat'd function, or pass `dtype=` to what makes tensors"
            )

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.refuse_changed_default_dtype()
        what = self._REFUSED.get(func)
        if what is not None:
            raise RematTraceError(f"{what} reads a tensor's data, which tracing does not have")
        hook = self._TENSOR_HOOKS.get(func)
        if hook is not None:
            raise RematTraceError(
                f"`{hook}` on a tensor inside the region would be dropped: remat traces the function once "
                "and replays a graph, which holds no tensor hooks, so the gradient would be computed as if the "
                "hook were not there. Register the hook outside the remat'd function (on its inputs or "
                "outputs), or split the function there into two remat regions and hook the value between them"
            )
        if func is torch.Tensor.backward:
            raise RematTraceError(
                "`.backward()` accumulates into `.grad` as a side effect, which a traced graph cannot "
                "repeat; use `torch.autograd.grad(..., create_graph=True)` (or torch.func.grad) inside the "
                "region and return the gradients",
                replayable=False,  # a second run (the recompute) would accumulate again
            )
        if not leaving_unit():  # a unit's outputs leave it through their markers (`functions`)
            arguments: list[Any] = optree.tree_leaves((args, kwargs or {}))  # type: ignore[arg-type]
            for arg in arguments:  # in lists too (`torch.stack([a, b])`)
                refuse_custom_function(arg)
        if self.transformed and func in self._DROPOUTS:
            return _dropout_as_under_transforms(func, *args, **kwargs)
        previous = self.grad_off, self.autocasting, self.uncached
        self.grad_off = not torch.is_grad_enabled()
        if self.transformed and func is _LINEAR and len(args) > 1 and isinstance(args[1], torch.Tensor):
            self.uncached = traced_node(args[1])
        autocasting = any_autocast_enabled()
        if autocasting or self._cache_lifetimes:
            self._note_cache_lifetime()
        self.autocasting = self._cast_cache() if autocasting and func not in _CONVERSIONS else None
        try:
            with autocast_cache_off() if autocasting else contextlib.nullcontext():  # every cast an op of the trace
                out = func(*args, **kwargs)
        finally:
            self.grad_off, self.autocasting, self.uncached = previous
        if func in self._DETACHES and isinstance(out, torch.Tensor):
            annotate(traced_node(out), USER_DETACH_KEY, True, producer_too=False)
        return out

    def _note_cache_lifetime(self) -> None:
        """Eager autocast keeps one cast cache from when the first autocast context opens
        until the last one closes; casts of a parameter are shared within one lifetime only."""
        nested = autocast_nesting() > 0
        if nested and not self._in_autocast:
            self._cache_lifetimes += 1
        self._in_autocast = nested

    def _cast_cache(self) -> int:
        """Which lifetime of autocast's cast cache this call runs in (0: the cache is off)."""
        return self._cache_lifetimes if self._eager_caches or torch.is_autocast_cache_enabled() else 0


def _dropout_as_under_transforms(func: Any, input: torch.Tensor, p: float = 0.5, *rest: Any, **kwargs: Any) -> torch.Tensor:
    """Dropout as eager code runs it under torch.func transforms, where it draws its mask in
    logical order, not in the memory order of its input (torch 2.13: they differ for a
    non-contiguous input, such as attention's output with batch_first)."""
    names = ["training", "inplace"] if func is torch.nn.functional.dropout else ["train"]
    options = dict(zip(names, rest), **kwargs)
    train = options.get("training", options.get("train", True))
    if not train or p == 0 or options.get("inplace", False):
        return func(input, p, *rest, **kwargs)
    if p == 1:
        return input * torch.zeros((), dtype=input.dtype, device=input.device)
    noise = torch.empty((), dtype=input.dtype, device=input.device).expand(input.shape)
    return input * torch.ops.aten.bernoulli.p(noise, 1 - p).div_(1 - p)


def refuse_custom_function(value: Any) -> None:
    function = custom_function_behind(value)
    if function is not None:
        raise CustomFunctionUsed(function)


def _annotating(
    guard: _GuardTracing, draws: DrawTracker, made: list[weakref.ref[torch.Tensor]]
) -> contextlib.AbstractContextManager[Any]:
    """While the user's function runs (called from the function that calls it, where the
    user's lines end): every op it runs gets its user line and scope written on its nodes,
    by remat's recorder when it records the trace, else by a mode of its own above make_fx's."""
    annotator = _Annotator(sys._getframe(1).f_code, guard, draws, made)
    recorder = active_recorder()
    return recorder.reporting_ops(annotator) if recorder is not None else _AnnotatingMode(annotator)


class _Annotator:
    """Writes on the nodes of each op the function runs the user's file:line and, inside a
    nested region, its scope."""

    def __init__(
        self, boundary: types.CodeType, guard: _GuardTracing, draws: DrawTracker, made: list[weakref.ref[torch.Tensor]]
    ) -> None:
        self.boundary = boundary  # the frame that calls the user's function: user lines end there
        self.guard = guard  # knows the grad mode of the user's call that runs the op
        self.draws = draws
        self.scanned: torch.fx.Node | None = None  # the last node looked at for random draws
        self.made = made  # what the function's ops gave it

    def __call__(self, nodes: list[torch.fx.Node | None], tensors: list[torch.Tensor]) -> None:
        if not nodes:  # a size or device query (the autograd engine and fake tensors make many)
            return
        self.made += map(weakref.ref, tensors)
        line = user_line(self.boundary)
        state = _TRACING.get()
        scope = state[1] if state is not None else 0
        in_backward = autograd_engine_running()  # the function runs torch.autograd.grad / .backward
        grad_off = not in_backward and (self.guard.grad_off or grad_disabled_by_code())  # no_grad, inference_mode...
        autocasting = self.guard.autocasting
        for node in nodes:
            if line is not None:
                annotate(node, SOURCE_KEY, line, overwrite=False)
            if scope:
                annotate(node, SCOPE_KEY, scope, overwrite=False)
            if in_backward:
                annotate(node, BACKWARD_KEY, torch.is_grad_enabled(), producer_too=False)
            elif grad_off:
                annotate(node, GRAD_OFF_KEY, True)
            if autocasting is not None and node.target is torch.ops.aten._to_copy.default:
                cached = node.args[0] is not self.guard.uncached
                annotate(node, AUTOCAST_CAST_KEY, autocasting if cached else 0, producer_too=False)
        self._note_draws(next((n.graph for n in nodes if n is not None), None))

    def _note_draws(self, graph: torch.fx.Graph | None) -> None:
        """Each random op recorded since the last op (decompositions' included) gets the
        stream it draws from, read off the generators now, before the function's next line."""
        if graph is None:
            return
        node = self.scanned.next if self.scanned is not None else next(iter(graph.nodes))
        while node.op != "root":
            random = node.op == "call_function" and node.target is not operator.getitem and is_random(node)
            if random and "generator" not in node.kwargs and "val" in node.meta:
                drawn = self.draws.drew(_value_device(node.meta["val"]))
                if drawn is not None:
                    annotate(node, RNG_STREAM_KEY, drawn, producer_too=False)
            self.scanned = node
            node = node.next


def _value_device(value: Any) -> torch.device:
    return (value[0] if isinstance(value, (tuple, list)) else value).device


class _AnnotatingMode(TorchDispatchMode):
    """The annotator as a dispatch mode, above make_fx's: it sees each op the function runs
    (not the ops of the decompositions make_fx runs below it)."""

    def __init__(self, annotator: _Annotator) -> None:
        super().__init__()
        self.annotator = annotator

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [leaf for leaf in optree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]
        self.annotator([traced_node(t) for t in tensors], tensors)
        return out


def _fake_like(mode: Any, t: torch.Tensor) -> torch.Tensor:
    """A fake with `t`'s shape, strides and storage offset (which `as_strided` reads); in a
    symbolic trace, a real tensor's marked dimensions are symbols."""
    stand_in = symbolic_stand_in(t)
    if stand_in is not None:  # its own fake, not the one torch memoizes for `t` (an input may repeat)
        t = stand_in
    try:
        stride = tuple(t.stride())
        offset = t.storage_offset()
    except RuntimeError:  # no strides (sparse): a plain dense stand-in
        with mode:
            return torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)
    return fake_of_layout(mode, tuple(t.shape), stride, offset, t.dtype, t.device)


def _fake_tangent(mode: Any, t: torch.Tensor, strides: tuple[int, ...] | None = None) -> torch.Tensor:
    with mode:
        if strides is None:
            return torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)
        return torch.empty_strided(tuple(t.shape), strides, dtype=t.dtype, device=t.device)


def capture(fn: Callable[..., Any], fn_name: str, call: Call, policy: Callable[..., bool] | None) -> StageOne:
    """Stage 1: trace `fn` on fake versions of the call's tensors and captured tensors."""
    out_info: dict[str, Any] = {}
    n_explicit = len(call.tensors)
    slotted = [i for i, setter in enumerate(call.captured_setters) if setter is not None]

    def flat_fn(*tensors: torch.Tensor) -> list[torch.Tensor]:
        explicit = tensors[:n_explicit]
        if call.aliases is not None:  # one tensor passed as several arguments: one stand-in
            explicit = tuple(explicit[k] for k in call.aliases)
        args, kwargs = call.rebuild(explicit)
        replacements = list(call.captured)
        for i, t in zip(slotted, tensors[n_explicit:]):
            replacements[i] = t
        guard = _GuardTracing(under_transform, eager_caches, default_dtype)
        units_recording = units.recording() if units is not None else contextlib.nullcontext()
        with call.substituted(replacements), _annotating(guard, draws, made), guard, hooks.recording(), units_recording:
            out = fn(*args, **kwargs)
            out_info["grad_enabled_after"] = torch.is_grad_enabled()  # `torch.set_grad_enabled(False)` left on
            guard.refuse_changed_default_dtype()
        leaves, spec = optree.tree_flatten(out)
        for leaf in leaves:
            refuse_custom_function(leaf)
        out_info["spec"] = spec
        out_info["static"] = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        tensors_out = [x for x in leaves if isinstance(x, torch.Tensor)] + hooks.outputs()  # what the hooks are given
        out_info["differentiable"] = [x.requires_grad for x in tensors_out]  # as eager autograd says
        return tensors_out

    under_transform = transforms_active()
    # under a transform, where the region must be traced, a custom Function is a unit of its own
    units = UnitRecorder(vmapped=any_vmap_active(), nested=nested_gradients()) if under_transform else None
    eager_caches = torch.is_autocast_cache_enabled()
    # each run of the Python starts as the call did, whatever the last run left
    grad_enabled, default_dtype = torch.is_grad_enabled(), torch.get_default_dtype()
    # eager autocast casts a leaf that requires grad once per (outer) autocast context
    with tracing_isolated(), _tracing_region(Scope(policy, fn_name)) as scopes:
        mode = new_fake_mode()
        originals = list(call.tensors) + [call.captured[i] for i in slotted]
        # Fakes need grad where the real tensors do: composite ops choose their lowering by
        # it (embedding_bag's forward-only kernel has no derivative).
        fakes = [_fake_like(mode, t).requires_grad_(needs_grad(t)) for t in originals]
        roots = roots_of(fn, call.objects())
        before = Snapshot.take(roots, [fn])
        draws = DrawTracker()
        hooks = HookRecorder()
        made: list[weakref.ref[torch.Tensor]] = []  # what the function's ops gave it

        def as_called() -> None:  # the grad mode and default dtype the call began in
            torch.set_grad_enabled(grad_enabled)
            torch.set_default_dtype(default_dtype)

        def restart() -> None:  # what a run the recorder gave up on noted
            as_called()
            _empty_caches_holding_stand_ins(fn_name, fn, made, fakes)
            del scopes[1:]
            draws.start()
            hooks.start()
            if units is not None:
                units.start()

        python_draws = python_random_states()
        try:
            gm = _recorded_or_traced(flat_fn, fakes, mode, restart=restart)
            rng_end = draws.end()
        except Exception as error:
            before.restore()  # what the attempt changed held stand-ins; a replay runs the Python again
            failure = trace_failure(fn_name, error)
            if failure is error:  # the user's own exception (or torch's, as eager would raise)
                raise
            raise failure from error
        finally:
            as_called()  # the plan runs as the call began; the call sets the grad mode fn left
            draws.restore()
            _empty_caches_holding_stand_ins(fn_name, fn, made, fakes)
            # Python's and numpy's generators as the call found them: the trace draws nothing
            # eager code would (torch's fake process-group work draws an id from `random`)
            python_drew = python_random_drawn(python_draws)
            if python_drew:
                set_python_random_states(python_draws)
        try:
            _refuse_stand_ins(fn_name, roots, out_info["static"], hooks.calls)
        except RematTraceError as error:
            before.restore()
            if stand_in_path(roots) is not None:  # somewhere the snapshot did not reach: it stays
                error.replayable = False
            raise
        changes = before.changed()
        _warn_changes(fn_name, fn, changes)
    if units is not None and units.units:
        check_units(gm.graph, units.units)
    _reject_data_dependent_ops(gm, fn_name)
    _grad_free_writes_as_values_with_grad(gm, fn_name, [f.requires_grad for f in fakes])
    _number_random_ops(gm)
    inputs = _GraphInputs(lifted=[], by_reference=[], paths=list(call.tensor_paths),
                          needs_grad=[needs_grad(t) for t in call.tensors])
    _keep_used_captured(gm, n_explicit, call, slotted, inputs)
    _lift_constants(gm, call, fn_name, under_transform, inputs)
    writes = in_place_writes(gm)
    gm = stage_one_passes(gm, [needs_grad(t) and t.is_leaf for t in originals], functionalized, fn_name)
    mutated = outputs_for_mutations(gm, fn_name, inputs.paths, inputs.needs_grad)
    gm.recompile()
    if python_drew:  # after the refusals that name an op (a process-group call draws too)
        raise RematTraceError(
            f"remat({fn_name}) draws from Python's `random` module or numpy's global generator "
            "(`random.random() < p` deciding to skip a layer, `np.random.uniform`), which a graph cannot hold: "
            "a trace would keep the draw it saw for every call. Such a region runs as torch.utils.checkpoint "
            "runs it, its recompute drawing what its forward drew; under a torch.func transform it cannot run. "
            "To trace it, draw with torch (`torch.rand(())`) and use the value in tensor ops (`torch.where`), "
            "or make the decision outside the region."
        )
    return StageOne(
        graph=gm,
        n_explicit=n_explicit,
        lifted=inputs.lifted,
        by_reference=inputs.by_reference,
        input_paths=inputs.paths,
        out_spec=out_info["spec"],
        out_static=out_info["static"],
        n_outputs=sum(1 for x in out_info["static"] if x is None) + len(hooks.tensors),
        n_hook_outputs=len(hooks.tensors),
        hook_calls=hooks.calls,
        hooks=hooks.hook_set() if hooks.seen else None,
        output_differentiable=out_info["differentiable"],
        mutated=mutated,
        input_needs_grad=inputs.needs_grad,
        scopes=scopes,
        rng_end=rng_end,
        input_values=[n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"],
        fills_like=any(n.meta.get("custom", {}).get(FILL_LIKE_KEY) for n in gm.graph.nodes),
        fills_permuted=any(n.meta.get("custom", {}).get(FILL_PERMUTED_KEY) for n in gm.graph.nodes),
        reads_storage_offsets=_reads_storage_offsets(gm),
        changes_state=bool(changes),
        units=dict(units.units) if units is not None else {},
        in_place_writes=writes,
        grad_enabled_after=out_info["grad_enabled_after"],
    )


@dataclass
class _GraphInputs:
    """The stage-1 graph's inputs, gathered while they are made: the call's tensors come
    first; then the captured tensors the graph uses (`lifted`, indices into Call.captured)
    and the constants it reads that it holds by reference; for every input, its path and
    whether it needs grad."""

    lifted: list[int]
    by_reference: list[torch.Tensor]
    paths: list[str]
    needs_grad: list[bool]


def _reads_storage_offsets(gm: torch.fx.GraphModule) -> bool:
    """Whether an `as_strided` reads a graph input (directly or through views): its result
    then depends on where the input starts in its storage, not only on its shape."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "overloadpacket", None) in AS_STRIDED_OPS:
            source = node.args[0]
            if isinstance(source, torch.fx.Node) and view_root(source).op == "placeholder":
                return True
    return False


def _empty_caches_holding_stand_ins(
    fn_name: str, fn: Callable[..., Any], made: list[Any], inputs: list[torch.Tensor]
) -> None:
    """Empty the lru caches the trace attempt filled with its stand-ins (`caches`), and
    warn once per region and cache."""
    for name in empty_caches_holding(made, inputs):
        _warn_once(fn_name, fn, name, (
            f"remat: `{fn_name}` caches a tensor it computes in `{name}` (a functools.lru_cache) while traced, "
            "where that cache would hold a tracing stand-in, not a value; remat emptied the cache, so its next "
            f"call computes the value again. To keep its values, call `{name.rsplit('.', 1)[-1]}` outside the "
            "remat'd function and pass the result in."
        ))


def _refuse_stand_ins(fn_name: str, roots: list[tuple[str, Any]], out_static: list[Any], hook_calls: list[HookCall]) -> None:
    """A function that stores a value it computes in an object it was given or closes over
    (a key/value cache's `update`, `self.last_attention = a`), or returns one inside an
    object optree does not flatten, would leave tracing stand-ins there: refuse, naming where."""
    found = stand_in_path(roots)
    if found is not None:
        raise RematTraceError(
            f"remat could not trace `{fn_name}`: it stores a tensor it computes in `{found}`. remat "
            "traces the function once with stand-in tensors and then runs a graph, so that object "
            "would hold stand-ins, not values. Return the value instead of storing it (for Hugging "
            "Face models in training: `use_cache=False`, as their own gradient checkpointing sets)."
        )
    for hook_call in hook_calls:
        if stand_in_path([("", hook_call.leaves)]) is not None:
            raise RematTraceError(
                f"remat could not trace `{fn_name}`: the {hook_call.label} is given a size computed while "
                "traced, which remat cannot pass on to it as a value."
            )
    for k, leaf in enumerate(out_static):
        if leaf is not None and stand_in_path([("", leaf)]) is not None:
            raise RematTraceError(
                f"remat could not trace `{fn_name}`: its output {k} is a {type(leaf).__name__} holding a tensor, "
                "which optree does not flatten, so remat would return it as it was traced, holding stand-ins. "
                "Return tensors in tuples, lists, dicts or namedtuples, or register the class with "
                "optree.register_pytree_node."
            )


_WARNED_CHANGES: set[tuple[Any, str]] = set()  # (the region's code, or name, and what changed)


def _warn_changes(fn_name: str, fn: Callable[..., Any], changes: list[str]) -> None:
    """Warn, once per region and object, that the function changed an object it reaches
    while traced: the change happens once per trace, not once per call."""
    for change in changes:
        _warn_once(fn_name, fn, change, (
            f"remat: `{fn_name}` changes {change} while traced. remat runs a function's Python when it "
            "traces it, not on every call, so this change happens once per trace. Keep such state outside "
            "the remat'd function, or return the new value."
        ))


def _warn_once(fn_name: str, fn: Callable[..., Any], what: str, message: str) -> None:
    """A RematStateWarning about `what`, once per region, at the function's first line."""
    code = _code_of(fn)
    key = (fn_name if code is None else code, what)
    if key in _WARNED_CHANGES:
        return
    _WARNED_CHANGES.add(key)
    if code is None:
        warnings.warn(message, RematStateWarning, stacklevel=6)
    else:
        warnings.warn_explicit(message, RematStateWarning, code.co_filename, code.co_firstlineno)


def _code_of(fn: Callable[..., Any]) -> types.CodeType | None:
    function = fn.__func__ if inspect.ismethod(fn) else type(fn).forward if isinstance(fn, torch.nn.Module) else fn
    return getattr(function, "__code__", None)


def _keep_used_captured(gm: torch.fx.GraphModule, n_explicit: int, call: Call, slotted: list[int], inputs: _GraphInputs) -> None:
    """Captured tensors the function never read are dropped from the graph's inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][n_explicit:]
    for index, node in zip(slotted, placeholders):
        if node.users:
            inputs.lifted.append(index)
            inputs.paths.append(call.captured_paths[index])
            inputs.needs_grad.append(needs_grad(call.captured[index]))
        else:
            gm.graph.erase_node(node)


def _number_random_ops(gm: torch.fx.GraphModule) -> None:
    """Give each random op an index that survives retracing, to match replays to states."""
    random_ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem and is_random(n)]
    for index, node in enumerate(random_ops):
        annotate(node, RNG_KEY, index, producer_too=False)


def _reject_data_dependent_ops(gm: torch.fx.GraphModule, fn_name: str) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten._local_scalar_dense.default:
            where = source_line(node) or "an unknown line"
            raise RematTraceError(
                f"remat could not trace `{fn_name}`: it reads a tensor's value as a Python number "
                f"(`.item()`, `float(t)`, `int(t)`) at {where}. A remat'd function is traced once "
                "without data, so such a value would be frozen. Pass it as a static argument "
                "(`static_argnums`/`static_argnames`) or keep it a tensor."
            )


def _grad_free_writes_as_values_with_grad(gm: torch.fx.GraphModule, fn_name: str, needs: Sequence[bool]) -> None:
    """An in-place op run with grad disabled on a value autograd tracks changes its data
    behind autograd's back: eager code's later reads see the new values, differentiated as
    the old tensor (`cosine_similarity` clamps its norms so). Each such write read later
    (with grad on, or by a further write) becomes a value with the old tensor's gradient;
    refused where a view shares the tensor's memory (the write would reach it, and its
    gradient, too)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tracked = {node for node, need in zip(placeholders, needs) if need}
    wrote = {  # an in-place op's result -> the tensor it wrote
        n: n.args[0] for n in gm.graph.nodes
        if n.op == "call_function" and writes_in_place(n) and isinstance(n.args[0], torch.fx.Node)
    }

    def tensor_of(node: torch.fx.Node) -> torch.fx.Node:
        while node in wrote:
            node = wrote[node]
        return node

    for node in list(gm.graph.nodes):
        writes = node in wrote
        if node.op != "call_function" or not any(tensor_of(i) in tracked for i in node.all_input_nodes):
            continue
        custom = node.meta.get("custom", {})
        if not custom.get(GRAD_OFF_KEY) and not custom.get(USER_DETACH_KEY):
            tracked.add(node)
            if writes:
                tracked.add(tensor_of(node))
            continue
        if not writes or tensor_of(node) not in tracked:
            continue
        written = tensor_of(node)
        aliases = [written, *(n for n in wrote if tensor_of(n) is written)]
        later = [
            u for a in aliases for u in a.users
            if u is not node and u.op in ("call_function", "output") and comes_after(gm.graph, u, node)
        ]
        if not any(
            u.op == "output" or not u.meta.get("custom", {}).get(GRAD_OFF_KEY) or (u in wrote and wrote[u] in aliases)
            for u in later
        ):
            continue
        if is_view(written) or any(is_view(u) for a in aliases for u in a.users):
            raise RematTraceError(
                f"remat could not trace `{fn_name}`: at {source_line(node) or 'an unknown line'} it changes "
                f"a tensor autograd tracks in place with grad disabled ({node.target}), and a view shares that "
                "tensor's memory. Eager autograd differentiates the changed tensor and its views as if nothing "
                "had changed, which a traced graph cannot express through views. Make the change out of place "
                "(`y = y.clamp(...)` under no_grad gives a constant), or apply it outside the remat'd function."
            )
        tracked.add(grad_free_write_as_value_with_grad(gm.graph, node, written, aliases, later))
        wrote.update((u, u.args[0]) for u in later if u in wrote)  # later writes now write the new value


def _insert_placeholder(gm: torch.fx.GraphModule, name: str, example: Any) -> torch.fx.Node:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    if anchor is None:
        with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
            node = gm.graph.placeholder(name)
    else:
        with gm.graph.inserting_after(anchor):
            node = gm.graph.placeholder(name)
    node.meta["val"] = example
    return node


def _lift_constants(gm: torch.fx.GraphModule, call: Call, fn_name: str, under_transform: bool, inputs: _GraphInputs) -> None:
    """Turn captured tensors, which a trace records as constants, into graph inputs."""
    by_identity = {
        id(unwrap_transforms(t)): i for i, t in enumerate(call.captured) if call.captured_setters[i] is None
    }
    fresh = {
        n.args[0]
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.lift_fresh_copy.default
    }
    mode = new_fake_mode()
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or node in fresh:
            continue
        value = getattr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        index = by_identity.get(id(value))
        if index is not None:
            original = call.captured[index]
            if tuple(original.shape) != tuple(value.shape):
                raise RematTraceError(
                    f"remat({fn_name}) reads `{call.captured_paths[index]}`, held in a tuple in its "
                    "closure, and that tensor is batched by an enclosing vmap. Pass it to the function "
                    "as an argument, or hold it in a list or dict."
                )
            inputs.lifted.append(index)
            inputs.needs_grad.append(needs_grad(original))
            path = call.captured_paths[index]
        elif value.requires_grad and not under_transform:
            inputs.by_reference.append(value)
            inputs.needs_grad.append(True)
            path = f"<captured tensor {tuple(value.shape)}>"
        elif under_transform and (value.is_floating_point() or value.is_complex()):
            raise RematTraceError(
                f"remat({fn_name}) reads a tensor of shape {tuple(value.shape)} that is neither an "
                "argument nor reachable from its closure (a global or an attribute chain?). Under a "
                "torch.func transform remat cannot tell whether it is being differentiated, and "
                "treating it as a constant could silently zero its gradient. Pass it as an argument."
            )
        else:
            _warn_frozen(fn_name, node, value)
            continue
        placeholder = _insert_placeholder(gm, f"captured_{len(inputs.paths)}", _fake_like(mode, value))
        inputs.paths.append(path)
        node.replace_all_uses_with(placeholder)
        gm.graph.erase_node(node)
    gm.graph.lint()


def _warn_frozen(fn_name: str, node: torch.fx.Node, value: torch.Tensor) -> None:
    """A tensor the function read that is neither an argument nor found by the closure walk
    (a class attribute, an object of an installed library): the plan holds that tensor
    object, so a tensor rebound there later is not seen. Said once per trace."""
    where = next((line for user in node.users if (line := source_line(user)) is not None), None)
    warnings.warn(
        f"remat({fn_name}) reads a {tuple(value.shape)} {value.dtype} tensor"
        f"{f' at {where}' if where else ''} that is neither an argument nor reachable from its closure, "
        "globals or modules (a class attribute, or an object of a library?). The traced plan holds that tensor "
        "object: changes to it in place are seen, but a tensor put in its place later is not. Pass it as an "
        "argument, or keep it where remat reads it on every call (a module buffer or attribute, a closure, a "
        "global, an attribute of an instance of your own class).",
        RematStateWarning,
        stacklevel=2,
    )


def differentiate(
    stage_one: StageOne,
    diff_inputs: Sequence[int],
    float_outputs: Sequence[int],
    create_graph: bool = True,
    by_use: bool = True,
    whole: frozenset[int] = frozenset(),
    tangent_strides: Sequence[tuple[int, ...] | None] = (),
) -> torch.fx.GraphModule:
    """Stage 2: one graph computing the outputs and the vjp w.r.t. `diff_inputs`.

    With `create_graph`, the backward autograd runs when it builds a graph (torch.func's
    transforms, a double backward), else the one `.backward()` runs: some derivatives are
    other ops in the two (SiLU's is `silu_backward` in one, its composite formula in the
    other), so each is traced where eager code runs it, for the same rounding.

    With `by_use`, an input the graph uses more than once gets one gradient per use, in
    the order eager autograd adds them up (`_Uses`): remat's autograd.Function takes such
    an input once per use, so that autograd adds these contributions to the input's
    gradient one by one, after or before contributions from outside the region, as it
    does without remat (the same sum, rounded as eager rounds it), except inputs in
    `whole`, which get one. Each split input's placeholder notes its number of
    gradients (`gradient_count`).

    Inputs: every stage-1 input, then one tangent per output in `float_outputs`, traced
    contiguous, or with its `tangent_strides` where given (a gradient autograd hands over
    laid out otherwise: derivatives then run on it as eager's do).
    Outputs: every stage-1 output, then the gradients of each input in `diff_inputs`.
    """
    g1 = stage_one.graph
    n_inputs = len(stage_one.input_values)
    out_values = graph_output_values(g1)

    blame: list[torch.fx.Node] = []  # the forward node whose derivative runs now
    hooks: list[Any] = []
    uses = _Uses(g1, diff_inputs, whole) if by_use else None

    def joint(*flat: torch.Tensor) -> list[torch.Tensor]:
        primals, tangents = flat[:n_inputs], flat[n_inputs:]
        with torch.enable_grad(), preserve_node_meta():
            outs = _MarkDifferentiable(g1, blame, hooks, uses, stage_one.units).run(*primals)
            wrt = [primals[i] for i in diff_inputs] if uses is None else uses.differentiated(primals)
            pairs = [(outs[i], t) for i, t in zip(float_outputs, tangents) if outs[i].requires_grad]
            grads = torch.autograd.grad(
                [o for o, _ in pairs],
                wrt,
                [t for _, t in pairs],
                create_graph=create_graph,
                allow_unused=True,  # an input the outputs do not depend on gets None, as in eager
            ) if pairs else [None for _ in wrt]
        return [*outs, *(grads if uses is None else uses.gradients(list(grads)))]

    with tracing_isolated(), autocast_off():
        mode = new_fake_mode()
        examples = [_fake_like(mode, v) for v in stage_one.input_values]
        for i in diff_inputs:
            examples[i].requires_grad_(True)
        # tangents are traced contiguous (Plan.cotangent makes the real ones so) or as laid out
        strides = list(tangent_strides) or [None] * len(float_outputs)
        examples += [_fake_tangent(mode, out_values[i], s) for i, s in zip(float_outputs, strides, strict=True)]
        try:
            traced = _recorded_or_traced(joint, examples, mode, restart=functools.partial(_restart_joint, blame, uses))
        except Exception as error:  # a derivative that cannot run without data
            node = blame[-1] if blame else None
            source = source_line(node) if node is not None else None
            failure = backward_failure(
                stage_one.scopes[0].region if stage_one.scopes else "the region", error, node.target if node is not None else None, source
            )
            if failure is error:
                raise
            raise failure from error
        finally:
            for hook in hooks:
                hook.remove()
        joint_gm = functionalized(traced)
        if uses is not None:
            uses.finish(joint_gm)
        return joint_gm


def _restart_joint(blame: list[torch.fx.Node], uses: _Uses | None) -> None:
    blame.clear()
    if uses is not None:
        uses.start()


class _Uses:
    """Each use of an input the stage-1 graph uses more than once, as a value of its own.

    Autograd adds the gradient contributions an input receives one at a time, as the
    nodes that use it finish their backward (and, within a node, in the order of its
    inputs). Differentiating with respect to a separate alias per use gives each
    contribution; the nodes' finishing order, noted by hooks, orders them. The aliases
    are taken out of the graph afterwards (they are the input itself)."""

    def __init__(self, g1: torch.fx.GraphModule, diff_inputs: Sequence[int], whole: frozenset[int] = frozenset()) -> None:
        placeholders = [n for n in g1.graph.nodes if n.op == "placeholder"]
        counts: dict[torch.fx.Node, int] = {}

        def count(arg: torch.fx.Node) -> torch.fx.Node:  # every node in the arguments, lists included
            counts[arg] = counts.get(arg, 0) + 1
            return arg

        for node in g1.graph.nodes:
            if node.op in ("call_function", "output"):  # an input returned as an output is a use too
                torch.fx.node.map_arg((node.args, node.kwargs), count)
        self.diff_inputs = list(diff_inputs)
        self.split = {placeholders[i]: i for i in diff_inputs if counts.get(placeholders[i], 0) > 1 and i not in whole}
        # the ops (and the output) that read one
        self.users = {u for p in self.split for u in p.users if u.op in ("call_function", "output")}
        self.output = next(n for n in g1.graph.nodes if n.op == "output")
        self.start()

    def start(self) -> None:
        """(Again, when the trace restarts.)"""
        self.aliases: dict[int, list[tuple[torch.Tensor, torch.fx.Node, int]]] = {i: [] for i in self.split.values()}
        self.finished: list[torch.fx.Node] = []
        self.counts: list[int] = []  # per input in diff_inputs, its gradients (set by `gradients`)

    def argument(self, value: torch.Tensor, placeholder: torch.fx.Node, user: torch.fx.Node) -> torch.Tensor:
        """The value `user` reads for one use of `placeholder`: an alias of its own."""
        index = self.split[placeholder]
        alias = torch.ops.aten.alias.default(value)
        annotate(traced_node(alias), USE_ALIAS_KEY, True)
        self.aliases[index].append((alias, user, len(self.aliases[index])))
        return alias

    def note_finished(self, node: torch.fx.Node, *_: Any) -> None:
        self.finished.append(node)

    def differentiated(self, primals: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What autograd differentiates with respect to: each input, or each of its uses."""
        wrt: list[torch.Tensor] = []
        for i in self.diff_inputs:
            aliases = self.aliases.get(i)
            wrt += [a for a, _, _ in aliases] if aliases else [primals[i]]
        return wrt

    def gradients(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The graph's gradient outputs: per input, its uses' gradients in the order eager
        autograd adds them (uses that get none left out; None if none gets one)."""
        # a returned input's gradient comes from the region's users, whose backward ran first
        order = {node: k for k, node in enumerate(self.finished)} | {self.output: -1}
        result: list[torch.Tensor | None] = []
        self.counts = []
        at = 0
        for i in self.diff_inputs:
            aliases = self.aliases.get(i)
            if not aliases:
                result.append(grads[at])
                self.counts.append(1)
                at += 1
                continue
            mine = grads[at : at + len(aliases)]
            at += len(aliases)
            ranked = sorted(
                (order.get(user, len(order)), position, grad)
                for (_, user, position), grad in zip(aliases, mine)
                if grad is not None
            )
            result += [grad for _, _, grad in ranked] or [None]
            self.counts.append(max(len(ranked), 1))
        return result

    def finish(self, gm: torch.fx.GraphModule) -> None:
        """Take the aliases out of the traced graph and note each input's gradient count
        on its placeholder."""
        for node in list(gm.graph.nodes):
            if node.meta.get("custom", {}).get(USE_ALIAS_KEY):
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
        gm.recompile()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, count in zip(self.diff_inputs, self.counts):
            if count > 1:
                annotate(placeholders[i], GRADIENT_COUNT_KEY, count)


def gradient_count(joint: torch.fx.GraphModule, index: int) -> int:
    """How many gradients the joint graph gives input `index` (see `differentiate`)."""
    placeholder = [n for n in joint.graph.nodes if n.op == "placeholder"][index]
    return int(placeholder.meta.get("custom", {}).get(GRADIENT_COUNT_KEY, 1))


def _recorded_or_traced(
    fn: Callable[..., Any], examples: list[torch.Tensor], mode: Any, restart: Callable[[], None]
) -> torch.fx.GraphModule:
    """The graph of `fn(*examples)` from the light recorder (`recording`), or from make_fx
    where the recorder leaves it (symbolic sizes, custom ops...) or fails, after `restart`
    undoes what the first run noted: errors are make_fx's own."""
    try:
        return record_graph(fn, examples, mode)
    except Exception:
        restart()
    return trace_on_fakes(fn)(*examples)


def functionalized(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` retraced with every in-place op replaced by its out-of-place form.

    Autograd's backward formulas write in place (`diagonal(g).mul_(0.5)` in qr's); a graph
    with in-place ops is wrong once its dead-looking writes are pruned, and not vmap-safe.
    A graph whose only writes are to fresh, unaliased values is rewritten in place instead
    (`writes_out_of_place`; the retrace costs as much as tracing), and one without writes
    is returned as it is.
    """
    if writes_out_of_place(gm):
        return gm

    def run(*flat: torch.Tensor) -> Any:
        with preserve_node_meta():
            return _Refunctionalizing(gm).run(*flat)

    with tracing_isolated(), autocast_off():
        mode = new_fake_mode()
        examples = [_fake_like(mode, n.meta["val"]) for n in gm.graph.nodes if n.op == "placeholder"]
        return trace_on_fakes(
            torch.func.functionalize(run, remove="mutations"),
            decomposition_table={torch.ops.aten.copy.default: _differentiable_copy},
        )(*examples)


def _differentiable_copy(target: torch.Tensor, source: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """`aten.copy` (what functionalization makes of `copy_`, as in `out[:, 0] = x`) has no
    derivative: the same values as a `where` that takes all of them from `source`, which
    autograd differentiates as it does `copy_` (zero gradient for `target`)."""
    value = torch.ops.aten._to_copy.default(source, dtype=target.dtype, device=target.device).expand(target.shape)
    everywhere = torch.ops.aten.new_ones.default(target, target.shape, dtype=torch.bool)
    return torch.ops.aten.where.self(everywhere, value, target)


class _CarryMeta(torch.fx.Interpreter):
    """Runs a graph while it is retraced, giving each new node the facts (source line,
    scope, name, random index...) written on the node it comes from; an output of a
    multi-output op gets its own item's facts."""

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        custom = n.meta.get("custom")
        if custom:
            for leaf in optree.tree_leaves(out):  # type: ignore[arg-type]
                if isinstance(leaf, torch.Tensor):
                    node = traced_node(leaf)
                    if node is not None:
                        node.meta["custom"] = {**node.meta.get("custom", {}), **custom}
        return out


class _Refunctionalizing(_CarryMeta):
    """The retrace that functionalizes: a value written in place becomes a new value, which
    the out-of-place op may lay out otherwise than the write left it (a masked fill of a
    transposed tensor), so a `view` traced on the old layout becomes `reshape` where it
    can no longer view: the same values."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is torch.ops.aten.view.default:
            try:
                return target(*args, **kwargs)
            except (RuntimeError, ValueError):
                return torch.ops.aten.reshape.default(*args, **kwargs)
        return super().call_function(target, args, kwargs)


def _blame(blame: list[torch.fx.Node], node: torch.fx.Node, grads: Any) -> None:
    blame.append(node)


class _MarkDifferentiable(_CarryMeta):
    """Runs a graph under autograd and notes which values it tracks.

    Some op outputs are not differentiable (layer_norm's mean and rstd, max's indices,
    dropout's mask); when kept, they must be kept as non-differentiable values. Each op's
    autograd node appends the op's graph node to `blame` when its derivative starts, so a
    derivative that fails can be traced back to the op and the user's line.
    """

    def __init__(
        self, gm: torch.fx.GraphModule, blame: list[torch.fx.Node], hooks: list[Any], uses: _Uses | None = None,
        units: dict[int, Any] | None = None,
    ) -> None:
        super().__init__(gm)
        self.blame = blame
        self.hooks = hooks  # removed after the trace: a hook on an autograd node would keep its graph alive
        self.uses = uses
        # custom Functions (`functions`): their forwards' ops are not run, the Function is
        self.units = units or {}
        self.inside_units = set().union(*interiors(gm.graph).values()) if self.units else set()
        self.entered: dict[int, list[torch.Tensor]] = {}
        self.applied: dict[int, list[Any]] = {}

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target in UNIT_MARKERS:
            unit = args[1]
            if target is not UNIT_OUTPUT:
                self.entered[unit] = list(args[0])
                return list(args[0])
            if unit not in self.applied:
                self.applied[unit] = self.units[unit].apply(self.entered[unit])
                self._note_unit_finished(unit)
            return self.applied[unit][args[2]]
        return super().call_function(target, args, kwargs)

    def _note_unit_finished(self, unit: int) -> None:
        """The unit's inputs marker is the use of an input that the Function reads: that
        use's gradient arrives when the Function's backward finishes (the marker's own
        aliases are what autograd differentiates with respect to, so their nodes never run)."""
        uses = self.uses
        entry = unit_entry(self.graph, unit)
        if uses is None or entry not in uses.users:
            return
        outputs = [t for t in self.applied[unit] if isinstance(t, torch.Tensor)]
        node = next((t.grad_fn for t in outputs if t.grad_fn is not None), None)
        if node is not None:
            self.hooks.append(node.register_hook(functools.partial(uses.note_finished, entry)))

    def fetch_args_kwargs_from_env(self, n: torch.fx.Node) -> tuple[Any, dict[str, Any]]:
        uses = self.uses
        if uses is None or n not in uses.users:
            return super().fetch_args_kwargs_from_env(n)

        def load(node: torch.fx.Node) -> Any:  # in argument order: autograd's order of the node's inputs
            value = self.env[node]
            return uses.argument(value, node, n) if node in uses.split else value

        return torch.fx.node.map_arg(n.args, load), torch.fx.node.map_arg(n.kwargs, load)  # type: ignore[return-value]

    def run_node(self, n: torch.fx.Node) -> Any:
        if n in self.inside_units:
            return None
        out = super().run_node(n)
        # every output of a multi-output op too: a part of a chained region may read an
        # op's first output only, and keep the others (layer_norm's mean) without an item node
        for leaf in optree.tree_leaves(out) if not isinstance(out, torch.Tensor) else (out,):  # type: ignore[arg-type]
            if isinstance(leaf, torch.Tensor):
                annotate(traced_node(leaf), DIFFERENTIABLE_KEY, bool(leaf.requires_grad), producer_too=False)
        if isinstance(out, torch.Tensor):
            if out.grad_fn is not None and n.op == "call_function":
                self.hooks.append(out.grad_fn.register_prehook(functools.partial(_blame, self.blame, producer(n))))
        uses = self.uses
        if uses is not None and n in uses.users and n.op == "call_function" and n.target is not UNIT_INPUTS:
            # note when its backward finishes (a unit's: `_note_unit_finished`)
            first = next((t for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)  # type: ignore[arg-type]
            if first is not None and first.grad_fn is not None:
                self.hooks.append(first.grad_fn.register_hook(functools.partial(uses.note_finished, n)))
        return out


def graph_output_values(gm: torch.fx.GraphModule) -> list[Any]:
    """The example values (fake tensors) of a traced graph's outputs."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return [arg.meta["val"] for arg in output.args[0]]


def vjp_of_graph(
    forward: torch.fx.GraphModule,
    input_values: Sequence[Any],
    diff_inputs: Sequence[int],
    cotangent_outputs: Sequence[int],
    gradient_counts: Sequence[int],
    tangent_strides: Sequence[tuple[int, ...] | None] = (),
) -> torch.fx.GraphModule:
    """A joint graph for an already partitioned forward graph (used for higher-order grads):
    an input gets one gradient per use, as in the first-order joint graph, where its counts
    (`gradient_counts`, per input in `diff_inputs`) are the same; else one in all. Tangents
    as `differentiate` traces them (`tangent_strides`)."""
    shim = StageOne(
        graph=forward, n_explicit=len(input_values), lifted=[], by_reference=[], input_paths=[],
        out_spec=None, out_static=[], n_outputs=0, mutated=[], input_values=list(input_values),
    )
    if any(count > 1 for count in gradient_counts):
        joint = differentiate(shim, diff_inputs, cotangent_outputs, by_use=True, tangent_strides=tangent_strides)
        if [gradient_count(joint, i) for i in diff_inputs] == list(gradient_counts):
            return joint
    return differentiate(shim, diff_inputs, cotangent_outputs, by_use=False, tangent_strides=tangent_strides)
