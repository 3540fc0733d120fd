"""The `remat` decorator: split the call, find or build a plan, run it."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import logging
import time
from typing import Any, Callable, Generic, Iterable, Iterator, ParamSpec, Sequence, TypeVar, overload

import optree
import torch

from remat.policies import MemoryBudget

from .._core.errors import RematFallbackWarning, RematTraceError
from .._core.locking import TRACE_LOCK
from .._core.logs import logger, warn_at_user_line
from .._core.no_remat import NO_REMAT, is_no_remat
from .._core.torch_internals import (
    copy_into,
    dispatch_modes_off,
    fake_tensor_cache_bounded,
    forward_ad_active,
    nested_gradients,
    transforms_active,
)
from .._partition.asking import policy_decider, warn_unmatched_references
from .._partition.budget import budget_of
from .._partition.compiling import (
    call_under_compile,
    compiled_override,
    compiled_region,
    overriding_under_compile,
    selective_context,
)
from .._partition.partitioning import Partition, partition
from .._plans.caching import DEFAULT_CACHE_SIZE, MISSING, PlanCache, clear_cache, plan_cache
from .._plans.like_layers import like_key, like_plan, note_reads, offer, region_module
from .._plans.sharing import graph_signature, share_plan, shared_plan
from .._plans.templates import Graphs, Templates
from .._running.chaining import Chain, Runnable, split_at_outputs, why_unsplit
from .._running.executing import Plan, as_returned, eager_under_transforms, writes_into_shared_memory
from .._running.replaying import replay, replay_note
from .._trace.arguments import Call, CaptureMemo, positional_names, split_call
from .._trace.attribute_reads import recording_reads
from .._trace.hooks import call_hooks
from .._trace.records import StageOne
from .._trace.tracing import differentiate, gradient_count, inside_trace, nested_region
from .reports import observing_replay, record, reporting


def _normalise_argnums(static_argnums: int | Iterable[int]) -> frozenset[int]:
    if isinstance(static_argnums, int):
        return frozenset([static_argnums])
    return frozenset(static_argnums)


def _normalise_argnames(static_argnames: str | Iterable[str]) -> frozenset[str]:
    if isinstance(static_argnames, str):
        return frozenset([static_argnames])
    return frozenset(static_argnames)


# A policy that replaces every region's own (wrapped in a 1-tuple, since None is a policy),
# or NO_REMAT to run every region's function as it is.
_OVERRIDE: contextvars.ContextVar[tuple[Any, ...] | str | None] = contextvars.ContextVar("remat_override", default=None)


@contextlib.contextmanager
def _overriding(value: tuple[Any, ...] | str) -> Iterator[None]:
    token = _OVERRIDE.set(value)
    with overriding_under_compile(None if is_no_remat(value) else value[0], is_no_remat(value)):
        try:
            yield
        finally:
            _OVERRIDE.reset(token)


@contextlib.contextmanager
def using_policy(policy: Callable[..., bool] | None) -> Iterator[None]:
    """Give every remat region called inside the same policy, whatever its own.

    For experiments: `with using_policy(P.dots_saveable): loss(params, batch)`. Plans
    traced under an override are cached apart from the regions' own. Call it outside
    torch.compile'd code; compiled code sees it process-wide, not per thread.
    """
    with _overriding((policy,)):
        yield


@contextlib.contextmanager
def without_remat() -> Iterator[None]:
    """Run every remat region's function as it is: plain autograd, for comparison."""
    with _overriding(NO_REMAT):
        yield


def _hooks_as_traced(plan: Runnable | None) -> bool:
    """Whether the modules a plan's trace called have the hooks they had then."""
    hooks = plan.stage_one.hooks if plan is not None else None
    return hooks is None or hooks.current()


def region_name(fn: Callable[..., Any]) -> str:
    if isinstance(fn, torch.nn.Module):
        return type(fn).__qualname__
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


_P = ParamSpec("_P")
_R = TypeVar("_R")
_M = TypeVar("_M", bound=torch.nn.Module)


class Rematerialized(Generic[_P, _R]):
    """A function that recomputes, in backward, what its policy did not keep.

    Built by `remat`; call it like the function it wraps. `cache_info()` says how often it
    traced.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        policy: Callable[..., bool] | None,
        static_argnums: int | Iterable[int],
        static_argnames: str | Iterable[str],
        debug: bool = False,
        cache_size: int = DEFAULT_CACHE_SIZE,
        name: str | None = None,
        dynamic: bool = False,
        fallback: bool = True,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"remat: expected a function or nn.Module to wrap, got {fn!r}")
        if policy is not None and not callable(policy):
            raise TypeError(
                f"remat: policy must be a callable policy(op, *args, **kwargs) -> bool such as "
                f"remat.policies.dots_saveable, got {policy!r}"
            )
        try:
            hash(policy)
        except TypeError:
            raise TypeError(
                f"remat: policy {policy!r} is not hashable; policies are cache keys. Use a frozen "
                "dataclass or a plain function."
            ) from None
        self.fn = fn
        self.policy = policy
        self.static_argnums = _normalise_argnums(static_argnums)
        self.static_argnames = _normalise_argnames(static_argnames)
        self.debug = debug
        if not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"remat: cache_size must be a positive int (plans kept per function), got {cache_size!r}")
        self.cache_size = cache_size
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"remat: name must be a non-empty string (the region's name in reports), got {name!r}")
        self.region = name or region_name(fn)
        self._names = positional_names(fn)
        self._captures = CaptureMemo()
        self._compile_context = selective_context(policy, self.region)
        if not isinstance(dynamic, bool):
            raise TypeError(f"remat: dynamic must be True or False, got {dynamic!r}")
        if dynamic and (debug or isinstance(policy, MemoryBudget)):
            raise ValueError(
                f"remat({self.region}): dynamic=True runs the region through torch.compile's lowering, where "
                f"{'debug=True' if debug else repr(policy)} cannot apply (it needs remat's own trace of the region). "
                "Drop dynamic=True, or use an op-by-op policy without debug."
            )
        self.dynamic = dynamic
        if not isinstance(fallback, bool):
            raise TypeError(f"remat: fallback must be True or False, got {fallback!r}")
        self.fallback = fallback
        # call keys that could not be traced (why), the newest cache_size of them: a key can hold
        # an argument object by identity (a new cache object each step), which it keeps alive
        self._replayed: collections.OrderedDict[Any, str] = collections.OrderedDict()
        self._dynamic_region: Callable[..., Any] | None = None
        self._plans = self._plans_for(policy)
        self._hits = 0
        self._traces = 0
        self._specialized = 0
        self._like = 0
        self._replays = 0
        for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
            if hasattr(fn, attribute):
                setattr(self, attribute, getattr(fn, attribute))
        self.__wrapped__ = fn

    def __repr__(self) -> str:
        return f"remat({self.region}, policy={self.policy!r})"

    def cache_info(self) -> dict[str, int]:
        """Calls of this wrapper that reused a plan, traces of its function it made, plans
        it made for a new size from a symbolic trace (`_plans/templates`: a template traced once,
        then no trace), plans it took from a like module without tracing (`_plans/like_layers`),
        calls it ran as torch.utils.checkpoint does because they could not be traced, plans its function holds (shared with other wrappers of the same
        function), and the bound."""
        return {
            "hits": self._hits, "traces": self._traces, "specialized": self._specialized, "like": self._like,
            "replays": self._replays, "size": len(self._plans.plans), "maxsize": self.cache_size,
        }

    def clear_cache(self) -> None:
        """Drop this function's traced plans; the next call traces again."""
        clear_cache(self.fn)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its plans (traced graphs are a cache, rebuilt on first call)."""
        state = dict(self.__dict__)
        del state["_plans"]
        state["_dynamic_region"] = None
        state["_captures"] = CaptureMemo()  # holds setters (closures), and is a cache
        state["_hits"] = state["_traces"] = state["_specialized"] = state["_replays"] = 0
        state["_replayed"] = collections.OrderedDict()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._plans = self._plans_for(self.policy)

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch.compiler.is_compiling():  # dynamo traces this: lower to torch's selective checkpointing
            return self._call_under_compile(args, kwargs)
        override = _OVERRIDE.get()
        policy = self.policy if override is None or is_no_remat(override) else override[0]
        if inside_trace():  # nested in a region being traced: inline, under this region's policy
            with nested_region(policy, self.region):
                return self.fn(*args, **kwargs)
        if is_no_remat(override) or not torch.is_grad_enabled() or forward_ad_active():
            # Nothing to keep, or forward-mode AD (jvp, jacfwd, hessian), whose tangents an
            # autograd.Function's jvp rule cannot make exact under every nesting of
            # transforms: run the function as it is, exactly as without remat.
            return self.fn(*args, **kwargs)
        if self.dynamic and not isinstance(policy, MemoryBudget) and not transforms_active() and not reporting():
            return self._call_dynamic(args, kwargs)  # (a budget, a transform or a report: traced here, per shape)
        plans = self._plans if override is None else self._plans_for(policy)
        try:
            call = split_call(self.fn, self._names, args, kwargs, self.static_argnums, self.static_argnames, self._captures)
        except RematTraceError as error:  # a tensor remat cannot trace with (sparse, ExpandedWeight)
            if not self._replays_instead(error):
                raise
            self._say_replayed(error, policy)
            return self._replay(policy, args, kwargs)
        plan = plans.lookup(call.key, call.storage_offsets)
        if plan is not MISSING and not _hooks_as_traced(plan):
            plan = MISSING
        if plan is not MISSING:
            self._hits += 1
        elif self._replayed and call.key in self._replayed:
            return self._replay(policy, args, kwargs)
        else:
            with TRACE_LOCK:  # one trace at a time in the process; another thread may have built it
                plan = plans.lookup(call.key, call.storage_offsets)
                if plan is MISSING or not _hooks_as_traced(plan):
                    try:
                        plan, traced = self._logged_build(call, policy, plans)
                    except RematTraceError as error:
                        if not self._replays_instead(error):
                            raise
                        self._say_replayed(error, policy)
                        self._replayed[call.key] = str(error)
                        if len(self._replayed) > self.cache_size:
                            self._replayed.popitem(last=False)
                        plan = MISSING
                    else:
                        offsets = call.storage_offsets() if plan is not None and plan.stage_one.reads_storage_offsets else None
                        plans.store(call.key, call.key_labels(), plan, offsets, traced)
            if plan is MISSING:  # outside the lock: the replay runs the function (other regions trace in it)
                return self._replay(policy, args, kwargs)
        if plan is None:  # nothing needs a gradient: there is nothing to checkpoint
            return self.fn(*args, **kwargs)
        stage_one = plan.stage_one
        inputs = stage_one.graph_inputs(call)
        if eager_under_transforms(stage_one, inputs) or writes_into_shared_memory(stage_one, inputs):  # rare: see there
            return self.fn(*args, **kwargs)
        record(plan)
        results = plan.apply(inputs)
        if stage_one.returned_as_is:
            results = as_returned(results, inputs, stage_one.returned_as_is)
        if stage_one.mutated:
            self._apply_mutations(plan, inputs, results)
        if stage_one.hook_calls:
            hooked = results[stage_one.n_outputs - stage_one.n_hook_outputs : stage_one.n_outputs]
            call_hooks(stage_one.hook_calls, hooked, self.region)
        if not stage_one.grad_enabled_after:  # the function turns grad off for its caller, as when it runs
            torch.set_grad_enabled(False)
        if stage_one.n_outputs == 1 and stage_one.out_spec.is_leaf():  # one tensor: no tree to rebuild
            return results[0]
        return self._rebuild_outputs(plan, results)

    def _replays_instead(self, error: RematTraceError) -> bool:
        """Whether a region whose trace failed so runs as torch.utils.checkpoint does
        instead: not under a torch.func transform (whose levels a replay in backward would
        not see; the error then says so), nor with `fallback=False`, nor where a second run
        of its Python differs."""
        if not (self.fallback and error.replayable):
            return False
        if transforms_active():
            error.add_note(
                f"(remat({self.region}) runs such a region as torch.utils.checkpoint does outside torch.func transforms; "
                "under a transform it must be traced)"
            )
            return False
        return True

    def _say_replayed(self, error: RematTraceError, policy: Callable[..., bool] | None) -> None:
        """Say once per region that it runs replayed, and why."""
        logger.info("remat(%s): runs replayed, as torch.utils.checkpoint runs it: %s", self.region, str(error).splitlines()[0])
        if not self._replays:
            warn_at_user_line(
                f"remat({self.region}) could not be traced, so it runs as torch.utils.checkpoint does (its Python "
                f"again in backward, the policy asked op by op). Why: {error}\n"
                f"Gradients, the random stream and in-place updates (BatchNorm statistics) are as without remat; "
                f"torch.func transforms over this region raise.{replay_note(policy)} "
                "Pass fallback=False to raise instead.",
                RematFallbackWarning,
            )

    def _replay(self, policy: Callable[..., bool] | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._replays += 1
        with observing_replay(self.region) as observe:
            return replay(self.fn, args, kwargs, policy, self.region, observe)

    def _call_under_compile(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        override = compiled_override()
        if is_no_remat(override):  # without_remat()
            return self.fn(*args, **kwargs)
        policy, context = (self.policy, self._compile_context) if override is None else override
        return call_under_compile(self.fn, policy, self.region, context, args, kwargs, self)

    def _call_dynamic(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """dynamic=True: the region through torch.compile (aot_eager: torch's own tracing
        and partitioner, no code generation), lowered as under any torch.compile, so a
        size that changes is traced symbolic on its second value (automatic dynamic
        shapes) instead of once per value."""
        if self._dynamic_region is None:
            self._dynamic_region = compiled_region(self._call_under_compile, self.region)
        self._hits += 1
        return self._dynamic_region(args, kwargs)

    def _plans_for(self, policy: Callable[..., bool] | None) -> PlanCache:
        settings = (policy, self.static_argnums, self.static_argnames, self.debug, self.region)
        return plan_cache(self.fn, settings, self.region, self.cache_size)

    def _logged_build(self, call: Call, policy: Callable[..., bool] | None, plans: PlanCache) -> tuple[Runnable | None, bool]:
        """`_build`, saying in remat's log what it did, why and how long it took."""
        if not logger.isEnabledFor(logging.INFO):
            return self._build(call, policy, plans)
        why = plans.why_traced(call.key, call.key_labels())
        like, specialized, start = self._like, self._specialized, time.perf_counter()
        plan, traced = self._build(call, policy, plans)
        how = (
            "took the plan of a like layer" if self._like > like
            else "specialized its symbolic trace" if self._specialized > specialized
            else "traced" if traced else "planned from a template"
        )
        logger.info("remat(%s): %s in %.0f ms (%s)", self.region, how, (time.perf_counter() - start) * 1e3, why)
        return plan, traced

    def _build(self, call: Call, policy: Callable[..., bool] | None, plans: PlanCache) -> tuple[Runnable | None, bool]:
        """The plan for this call, and whether the function was traced for it (not when
        a template of an earlier size served)."""
        root = region_module(self.fn)
        like = None if root is None else like_key(self.fn, root, call, (policy, self.static_argnums, self.static_argnames, self.debug))
        if like is not None:
            plan = like_plan(like, root, self.region)  # type: ignore[arg-type]
            if plan is not None:  # a module like this one traced what this one would: no trace
                self._like += 1
                return plan, False
        self._traces += 1
        reading = contextlib.nullcontext(None) if root is None else recording_reads(root)
        with fake_tensor_cache_bounded(), dispatch_modes_off():  # the caller's modes see the region run, not its trace
            with reading as reads:
                if plans.templates is None:
                    plans.templates = Templates(plans.maxsize)
                graphs = plans.templates.graphs_for(self.fn, self.region, call, policy)
            if reads is not None:
                note_reads(root, reads)  # type: ignore[arg-type]
            plan, traced = self._planned(graphs)
        if like is not None:
            offer(like, root, plan)  # type: ignore[arg-type]
        return plan, traced

    def _planned(self, graphs: Graphs) -> tuple[Runnable | None, bool]:
        """The plan for a call's graphs: another region's with the same graph, or a new one."""
        stage_one, joint, traced = graphs.stage_one, graphs.joint, graphs.traced
        self._traces -= not traced
        self._specialized += joint is not None
        warn_unmatched_references(stage_one.scopes, stage_one.graph.graph)
        signature = graph_signature(stage_one)
        key = None if signature is None else (signature, self.debug, transforms_active(), nested_gradients())
        shared = None if key is None else shared_plan(key)
        if shared is not None:  # another region traced the same graph: reuse its partition
            graphs.charge(shared.trace_seconds)
            return shared.for_capture(stage_one, self.region), traced
        plan = self._plan(stage_one, stage_one.mutated, joint)
        trace_seconds = graphs.charge(None)
        if key is not None and isinstance(plan, Plan):
            plan.trace_seconds = trace_seconds
            share_plan(key, plan)
        return plan, traced

    def _plan(
        self,
        stage_one: StageOne,
        updated: Sequence[int],
        joint: torch.fx.GraphModule | None = None,
        whole: frozenset[int] = frozenset(),
    ) -> Runnable | None:
        """A Plan for the captured graph, or, outside torch.func transforms, a Chain of plans
        where outputs feed other outputs. `updated`: the inputs the region updates after its
        forward; `joint`: the forward+backward graph when a template gave it; `whole`: inputs that get one
        gradient, not one per use (`differentiate`). In a chain, an input the second plan
        reads before the first does gets one from each plan: autograd runs the second's
        backward first, so its gradient reaches the input first, where eager's comes
        last; one sum from each plan adds in an order that cannot matter for two terms."""
        diff_inputs = [i for i, needs in enumerate(stage_one.input_needs_grad) if needs]
        if not diff_inputs:
            return None
        # templates are never chains; under a torch.func transform, which takes no gradient with
        # respect to an output, one node adds an input's gradient terms in eager's order
        halves = split_at_outputs(stage_one) if joint is None and not transforms_active() else None
        if halves is not None:
            first, rest, first_positions, read_by_rest_first, n_shared = halves
            whole = whole | read_by_rest_first
            parts = [self._plan(half, updated, whole=whole) for half in (first, rest)]
            return Chain(stage_one, *parts, first_positions, n_shared)  # type: ignore[arg-type]
        unsplit = why_unsplit(stage_one) if joint is None and not transforms_active() else None
        if unsplit is not None:
            raise RematTraceError(
                f"remat({self.region}): some of its outputs are computed from its other outputs, and {unsplit}; as "
                "one autograd node it would hide that dependence (a gradient with respect to those outputs, their "
                "hooks and retain_grad would miss it). To keep it traced, compute the outputs the others are "
                "computed from in a region of their own."
            )  # under a torch.func transform no gradient is taken with respect to an output: it stays one node
        float_outputs = [j for j, differentiable in enumerate(stage_one.output_differentiable) if differentiable]
        builds_graph = transforms_active()  # torch.func differentiates a backward as a graph; .backward() does not
        n_outputs = stage_one.n_outputs + len(stage_one.mutated)
        decide = policy_decider(stage_one.scopes)
        budget, nested, debug = budget_of(stage_one.scopes), nested_gradients(), self.debug

        def split(joint: torch.fx.GraphModule) -> Partition:  # (a closure over no region: plans outlive them)
            return partition(
                joint, len(stage_one.input_values), n_outputs, decide, debug=debug, mutated=updated,
                budget=budget, offload=not nested, rng_end=stage_one.rng_end, second_order=nested,
            )

        def relayout(strides: tuple[tuple[int, ...] | None, ...]) -> Partition:
            """The same partition, of the joint traced with tangents of these strides."""
            laid_out = differentiate(
                stage_one, diff_inputs, float_outputs, builds_graph, whole=whole, tangent_strides=strides
            )
            return split(laid_out)

        if joint is None:
            joint = differentiate(stage_one, diff_inputs, float_outputs, create_graph=builds_graph, whole=whole)
        gradient_counts = [gradient_count(joint, i) for i in diff_inputs]
        part = split(joint)
        plan = Plan(
            stage_one=stage_one, part=part, diff_inputs=diff_inputs, float_outputs=float_outputs, region=self.region,
            builds_graph=builds_graph, gradient_counts=gradient_counts,
            relayout=relayout if not debug and not part.offloaded else None,
        )
        if nested_gradients():
            plan.keep_inputs_for_second_order()
        return plan

    @staticmethod
    def _apply_mutations(plan: Runnable, inputs: list[torch.Tensor], results: Sequence[torch.Tensor]) -> None:
        """Mutations of inputs happen here, once per call, never in recompute."""
        first = plan.stage_one.n_outputs
        with torch.no_grad():
            for k, index in enumerate(plan.stage_one.mutated):
                copy_into(inputs[index], results[first + k])

    @staticmethod
    def _rebuild_outputs(plan: Runnable, results: Sequence[torch.Tensor]) -> Any:
        tensors = iter(results[: plan.stage_one.n_outputs])
        leaves = [next(tensors) if leaf is None else leaf for leaf in plan.stage_one.out_static]
        return optree.tree_unflatten(plan.stage_one.out_spec, leaves)


@overload
def remat(
    fn: _M, *, policy: Callable[..., bool] | None = None, static_argnums: int | Iterable[int] = (),
    static_argnames: str | Iterable[str] = (), debug: bool = False, cache_size: int = DEFAULT_CACHE_SIZE,
    name: str | None = None, dynamic: bool = False, fallback: bool = True,
) -> RematerializedModule: ...
@overload
def remat(
    fn: Callable[_P, _R], *, policy: Callable[..., bool] | None = None, static_argnums: int | Iterable[int] = (),
    static_argnames: str | Iterable[str] = (), debug: bool = False, cache_size: int = DEFAULT_CACHE_SIZE,
    name: str | None = None, dynamic: bool = False, fallback: bool = True,
) -> Rematerialized[_P, _R]: ...
@overload
def remat(
    fn: None = None, *, policy: Callable[..., bool] | None = None, static_argnums: int | Iterable[int] = (),
    static_argnames: str | Iterable[str] = (), debug: bool = False, cache_size: int = DEFAULT_CACHE_SIZE,
    name: str | None = None, dynamic: bool = False, fallback: bool = True,
) -> Callable[[Callable[_P, _R]], Rematerialized[_P, _R]]: ...
def remat(
    fn: Callable[..., Any] | None = None,
    *,
    policy: Callable[..., bool] | None = None,
    static_argnums: int | Iterable[int] = (),
    static_argnames: str | Iterable[str] = (),
    debug: bool = False,
    cache_size: int = DEFAULT_CACHE_SIZE,
    name: str | None = None,
    dynamic: bool = False,
    fallback: bool = True,
) -> Any:
    """Rematerialize `fn`: keep only what `policy` allows for backward, recompute the rest.

    Works under `.backward()` and every torch.func transform (grad, vjp, jacrev, jvp,
    jacfwd, hessian, vmap, functional_call). `fn` takes and returns pytrees of tensors;
    non-tensor leaves are static. `policy=None` keeps nothing but the inputs.

    >>> import torch
    >>> from remat import remat, policies
    >>> @remat(policy=policies.dots_saveable)
    ... def block(x, w):
    ...     return torch.tanh(x @ w)
    >>> x = torch.randn(4, 3, requires_grad=True)
    >>> block(x, torch.randn(3, 3)).sum().backward()
    >>> x.grad.shape
    torch.Size([4, 3])

    A function whose Python control flow depends on an argument's value must make that
    argument static: `remat(f, static_argnums=(1,))`.

    `debug=True` makes backward check every recomputed value against the forward's and
    raise `RecomputeMismatchError` naming the op and line on a difference (it keeps those
    values, so it costs memory; off by default, and then free).

    Plans are cached per function and policy, at most `cache_size` of them (least recently
    used first out); `remat.clear_cache()` drops them, and a function that keeps tracing
    gets a `RematRetraceWarning` saying what changed between its traces.

    `name` names the region in reports and errors (default: the function's qualified name);
    `checkpoint_layers` names each layer by its place in the stack.

    `dynamic=True` is for inputs whose sizes vary (sequence lengths): outside torch.func
    transforms the region runs through torch.compile's machinery (aot_eager backend, the
    lowering used under torch.compile), which traces a size symbolic once it has changed,
    so many lengths cost two traces, not one each. Under torch.func transforms it traces
    per shape as usual.

    A call remat cannot trace (shapes that depend on data, a custom autograd.Function, a
    backward hook inside) runs as `torch.utils.checkpoint` runs it, its Python again in
    backward, with the policy asked op by op, the random stream and in-place updates as
    without remat, and a `RematFallbackWarning` saying why, once per region; under a
    torch.func transform it raises. `fallback=False` raises instead of replaying.
    """
    if fn is None:
        return functools.partial(
            remat, policy=policy, static_argnums=static_argnums, static_argnames=static_argnames, debug=debug,
            cache_size=cache_size, name=name, dynamic=dynamic, fallback=fallback,
        )
    wrapped = Rematerialized(fn, policy, static_argnums, static_argnames, debug, cache_size, name, dynamic, fallback)
    return RematerializedModule(fn, wrapped) if isinstance(fn, torch.nn.Module) else wrapped


class RematerializedModule(torch.nn.Module):
    """`remat(module)`: an nn.Module that shares the wrapped module's parameters, buffers
    and submodules under the same names, so `functional_call`, `state_dict`, optimizers
    and `.to()` see the original; calling it runs the module through remat."""

    wrapped_module: torch.nn.Module
    rematerialized: Rematerialized

    def __init__(self, module: torch.nn.Module, rematerialized: Rematerialized) -> None:
        super().__init__()
        for table in ("_parameters", "_buffers", "_modules"):
            self.__dict__[table] = getattr(module, table)  # the same dicts: one set of tensors
        self.__dict__["wrapped_module"] = module
        self.__dict__["rematerialized"] = rematerialized
        self.training = module.training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.rematerialized(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Transparent: global module hooks fire for the wrapped module (called inside), not
        for this wrapper too; hooks registered on the wrapper itself run as on any module."""
        if self._forward_pre_hooks or self._forward_hooks or self._backward_pre_hooks or self._backward_hooks:
            return super().__call__(*args, **kwargs)
        return self.rematerialized(*args, **kwargs)  # what forward does, one call fewer

    def train(self, mode: bool = True) -> RematerializedModule:
        self.wrapped_module.train(mode)
        self.training = mode
        return self

    def cache_info(self) -> dict[str, int]:
        return self.rematerialized.cache_info()

    def __repr__(self) -> str:
        return f"remat({self.wrapped_module!r}, policy={self.rematerialized.policy!r})"

