"""The `remat` decorator: split the call, find or build a plan, run it."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import optree
import torch

from ._arguments import Call, positional_names, split_call
from ._executing import Plan, RematFunction
from ._inspecting import record
from ._partitioning import partition, policy_decider, warn_unmatched_references
from ._torch_internals import copy_into, forward_ad_active, nested_gradients
from ._tracing import capture, differentiate, inside_trace, nested_region


def _normalise_argnums(static_argnums: int | Iterable[int]) -> frozenset[int]:
    if isinstance(static_argnums, int):
        return frozenset([static_argnums])
    return frozenset(static_argnums)


def _normalise_argnames(static_argnames: str | Iterable[str]) -> frozenset[str]:
    if isinstance(static_argnames, str):
        return frozenset([static_argnames])
    return frozenset(static_argnames)


_PLAN_STORES: "weakref.WeakKeyDictionary[Any, dict[Any, dict[Any, Plan | None]]]" = weakref.WeakKeyDictionary()


def _plan_store(fn: Callable[..., Any], settings: tuple[Any, ...]) -> dict[Any, Plan | None]:
    """The plans traced for `fn` with these settings, shared by every wrapper of it.

    `remat(block)(x)` or `remat(self.block.forward)(x)` inside a model's forward builds a
    new wrapper per call; keying plans by the module (or function) that owns them lets
    those wrappers reuse one trace. The store dies with its owner.
    """
    owner = fn.__self__ if inspect.ismethod(fn) else fn
    function = fn.__func__ if inspect.ismethod(fn) else None
    try:
        per_owner = _PLAN_STORES.setdefault(owner, {})
    except TypeError:  # not weak-referenceable: plans live with the wrapper
        return {}
    return per_owner.setdefault((function, settings), {})


_NO_REMAT = ("no remat",)
# A policy that replaces every region's own (wrapped in a 1-tuple, since None is a policy),
# or _NO_REMAT to run every region's function as it is.
_OVERRIDE: contextvars.ContextVar[tuple[Any, ...] | None] = contextvars.ContextVar("remat_override", default=None)


@contextlib.contextmanager
def using_policy(policy: Callable[..., bool] | None) -> Iterator[None]:
    """Give every remat region called inside the same policy, whatever its own.

    For experiments: `with using_policy(P.dots_saveable): loss(params, batch)`. Plans
    traced under an override are cached apart from the regions' own.
    """
    token = _OVERRIDE.set((policy,))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


@contextlib.contextmanager
def without_remat() -> Iterator[None]:
    """Run every remat region's function as it is: plain autograd, for comparison."""
    token = _OVERRIDE.set(_NO_REMAT)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def region_name(fn: Callable[..., Any]) -> str:
    if isinstance(fn, torch.nn.Module):
        return type(fn).__qualname__
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


_MISSING: Any = object()


@dataclass
class _PerStorageOffsets:
    """Plans of a function whose graph reads its inputs' storage offsets (`as_strided` on
    an input), one per tuple of offsets; other plans serve inputs at any offset."""

    plans: dict[tuple[int, ...], Plan] = field(default_factory=dict)


class Rematerialized:
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
        self.region = region_name(fn)
        self._names = positional_names(fn)
        self._plans = self._plans_for(policy)
        self._hits = 0
        self._traces = 0
        for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
            if hasattr(fn, attribute):
                setattr(self, attribute, getattr(fn, attribute))
        self.__wrapped__ = fn

    def __repr__(self) -> str:
        return f"remat({self.region}, policy={self.policy!r})"

    def cache_info(self) -> dict[str, int]:
        """Calls that reused a traced plan, traces made, plans held."""
        return {"hits": self._hits, "traces": self._traces, "size": len(self._plans)}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        override = _OVERRIDE.get()
        policy = self.policy if override is None or override is _NO_REMAT else override[0]
        if inside_trace():  # nested in a region being traced: inline, under this region's policy
            with nested_region(policy, self.region):
                return self.fn(*args, **kwargs)
        if override is _NO_REMAT or not torch.is_grad_enabled() or forward_ad_active():
            # Nothing to keep, or forward-mode AD (jvp, jacfwd, hessian), whose tangents an
            # autograd.Function's jvp rule cannot make exact under every nesting of
            # transforms: run the function as it is, exactly as without remat.
            return self.fn(*args, **kwargs)
        plans = self._plans if override is None else self._plans_for(policy)
        call = split_call(self.fn, self._names, args, kwargs, self.static_argnums, self.static_argnames)
        entry = plans.get(call.key, _MISSING)
        if isinstance(entry, _PerStorageOffsets):
            entry = entry.plans.get(call.storage_offsets(), _MISSING)
        if entry is not _MISSING:
            self._hits += 1
            plan = entry
        else:
            plan = self._build(call, policy)
            if plan is not None and plan.captured.reads_storage_offsets:
                per_offsets = plans.setdefault(call.key, _PerStorageOffsets())  # type: ignore[call-overload]
                per_offsets.plans[call.storage_offsets()] = plan
            else:
                plans[call.key] = plan
        if plan is None:  # nothing needs a gradient: there is nothing to checkpoint
            return self.fn(*args, **kwargs)
        record(plan)
        inputs = call.tensors + [call.captured[i] for i in plan.captured.lifted] + plan.captured.by_reference
        results = RematFunction.apply(plan, *inputs)
        self._apply_mutations(plan, inputs, results)
        return self._rebuild_outputs(plan, results)

    def _plans_for(self, policy: Callable[..., bool] | None) -> dict[Any, Plan | None]:
        return _plan_store(self.fn, (policy, self.static_argnums, self.static_argnames, self.debug))

    def _build(self, call: Call, policy: Callable[..., bool] | None) -> Plan | None:
        self._traces += 1
        captured = capture(self.fn, self.region, call, policy)
        diff_inputs = [i for i, needs in enumerate(captured.input_needs_grad) if needs]
        if not diff_inputs:
            return None
        float_outputs = [j for j, differentiable in enumerate(captured.output_differentiable) if differentiable]
        joint = differentiate(captured, diff_inputs, float_outputs)
        n_outputs = captured.n_outputs + len(captured.mutated)
        decide = policy_decider(captured.scopes)
        warn_unmatched_references(captured.scopes, captured.graph.graph)
        part = partition(
            joint, len(captured.input_values), n_outputs, decide, debug=self.debug, mutated=captured.mutated
        )
        plan = Plan(captured=captured, part=part, diff_inputs=diff_inputs, float_outputs=float_outputs, region=self.region)
        if nested_gradients():
            plan.keep_inputs_for_second_order()
        return plan

    @staticmethod
    def _apply_mutations(plan: Plan, inputs: list[torch.Tensor], results: tuple[torch.Tensor, ...]) -> None:
        """Mutations of inputs happen here, once per call, never in recompute."""
        first = plan.captured.n_outputs
        with torch.no_grad():
            for k, index in enumerate(plan.captured.mutated):
                copy_into(inputs[index], results[first + k])

    @staticmethod
    def _rebuild_outputs(plan: Plan, results: tuple[torch.Tensor, ...]) -> Any:
        tensors = iter(results[: plan.captured.n_outputs])
        leaves = [next(tensors) if leaf is None else leaf for leaf in plan.captured.out_static]
        return optree.tree_unflatten(plan.captured.out_spec, leaves)


def remat(
    fn: Callable[..., Any] | None = None,
    *,
    policy: Callable[..., bool] | None = None,
    static_argnums: int | Iterable[int] = (),
    static_argnames: str | Iterable[str] = (),
    debug: bool = False,
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
    """
    if fn is None:
        return functools.partial(
            remat, policy=policy, static_argnums=static_argnums, static_argnames=static_argnames, debug=debug
        )
    wrapped = Rematerialized(fn, policy, static_argnums, static_argnames, debug)
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

    def train(self, mode: bool = True) -> RematerializedModule:
        self.wrapped_module.train(mode)
        self.training = mode
        return self

    def cache_info(self) -> dict[str, int]:
        return self.rematerialized.cache_info()

    def __repr__(self) -> str:
        return f"remat({self.wrapped_module!r}, policy={self.rematerialized.policy!r})"


checkpoint = remat
