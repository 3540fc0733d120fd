"""Under torch.compile: a region becomes torch's own selective activation checkpointing.

Dynamo cannot trace remat's eager machinery (its tracer, its autograd.Function over fx
graphs), but it traces `torch.utils.checkpoint` with a selective-checkpoint context into
one graph, and AOTAutograd's partitioner then keeps exactly the values tagged "save" and
recomputes the rest. So under compile a region asks its policy op by op, with the same
data-free meta tensors as in eager, and tags each op with the answer: one vocabulary,
eager and compiled. What the partitioner does with random ops (replays their RNG state)
and mutations (applied once, after forward) is torch's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from remat.policies import MemoryBudget, Offload

from .._core.errors import RematError
from .._core.no_remat import NO_REMAT
from .._core.nodes import meta_arguments, meta_like, producer
from .._core.torch_internals import (
    dispatch_modes_off,
    graph_breaks_are_errors,
    selective_checkpoint_compile_notice_off,
    tracing_node,
    transforms_active_while_compiling,
)
from .asking import answer_of, kept_unasked


@torch.library.custom_op("remat::checkpoint_name", mutates_args=())
def _named_copy(x: torch.Tensor, name: str) -> torch.Tensor:
    """Under compile, `checkpoint_name` is this op, so the selective-checkpoint policy sees
    the name; its output is a copy (custom ops may not return their input)."""
    return x.clone()


@_named_copy.register_fake
def _(x: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _backward_of_named_copy(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


_named_copy.register_autograd(_backward_of_named_copy)
NAMED_COPY = torch.ops.remat.checkpoint_name.default


def name_under_compile(x: Any, name: str) -> Any:
    """`checkpoint_name` while dynamo traces: every tensor leaf through the naming op
    (none under without_remat(), where nothing reads names)."""
    if compiled_override() == NO_REMAT:
        return x
    return named_copies(x, name)


def named_copies(x: Any, name: str) -> Any:
    """Every tensor leaf of `x` through the naming op."""
    return pytree.tree_map(lambda leaf: _named_copy(leaf, name) if isinstance(leaf, torch.Tensor) else leaf, x)


class Decisions:
    """The selective-checkpoint policy function: the region's policy asked about each op.

    A name (the `remat::checkpoint_name` op) is asked about as in eager: with the op that
    produced the named value and its arguments, and the answer is written on that op's
    node, overriding the unnamed answer it got; the named copy itself is recomputed (a
    clone), so the kept value is the producer's output, as in eager.
    """

    def __init__(self, policy: Callable[..., Any] | None, region: str) -> None:
        self.policy = policy
        self.region = region

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if isinstance(self.policy, MemoryBudget):  # reached under fullgraph only: see call_under_compile
            raise budget_under_compile(self.policy, self.region)
        if getattr(op, "is_view", False):  # a view is remade from its base, as in eager
            return CheckpointPolicy.PREFER_RECOMPUTE
        if self.policy is None:  # keeps nothing but a collective's output
            return self.tag(op, kept_unasked(None, op))
        if op is NAMED_COPY:
            self._name(self.policy, args[0], args[1])
            return CheckpointPolicy.PREFER_RECOMPUTE
        return self.answer(op, args, kwargs, None)

    def answer(self, op: Any, args: Any, kwargs: dict[str, Any], name: str | None) -> CheckpointPolicy:
        """The policy's answer for `op` on `args` (real or traced tensors, seen as meta)."""
        with dispatch_modes_off():  # meta tensors made here must not enter the traced graph
            meta_args, meta_kwargs = pytree.tree_map(meta_like, (args, kwargs))
            return self.tag(op, answer_of(self.policy, op, meta_args, meta_kwargs, name))  # type: ignore[arg-type]

    def _name(self, policy: Callable[..., Any], value: torch.Tensor, name: str) -> None:
        node = tracing_node(value)
        if node is None or node.op != "call_function":  # a pass that builds no graph, or an input
            return
        op_node = producer(node)
        with dispatch_modes_off():
            meta_args, meta_kwargs = meta_arguments(op_node)
            tag = self.tag(op_node.target, answer_of(policy, op_node.target, meta_args, meta_kwargs, name))
        for tagged in [op_node, *(user for user in op_node.users if producer(user) is op_node)]:
            tagged.meta["recompute"] = tag  # a multi-output op and its items alike, as torch tags them

    def tag(self, op: Any, answer: Any) -> CheckpointPolicy:
        if isinstance(answer, Offload):
            raise RematError(
                f"remat({self.region}): policy {self.policy!r} offloads the output of {op} to host memory, "
                "which remat does only in eager mode, not under torch.compile. Keep or recompute it under "
                "compile (e.g. dots_with_no_batch_dims_saveable for offload_dot_with_no_batch_dims)."
            )
        return CheckpointPolicy.MUST_SAVE if answer else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context(policy: Callable[..., Any] | None, region: str) -> Callable[[], Any]:
    """The checkpoint `context_fn` that tags each op with `policy`'s answer. Built once per
    region, outside the traced code: dynamo needs it as a constant it can guard on."""
    return functools.partial(create_selective_checkpoint_contexts, Decisions(policy, region))


def call_under_compile(
    fn: Callable[..., Any], policy: Callable[..., Any] | None, region: str, context: Callable[[], Any],
    args: tuple[Any, ...], kwargs: dict[str, Any], eagerly: Callable[..., Any],
) -> Any:
    """Run `fn` as a torch.utils.checkpoint region whose ops `context` tags; a region with a
    memory budget runs `eagerly` instead, outside the compiled graph (not under fullgraph)."""
    if transforms_active_while_compiling():
        raise RematError(
            f"remat({region}): torch.compile of a torch.func transform (grad, vjp, vmap...) over remat regions is "
            "not supported: under compile a region is torch.utils.checkpoint, which torch.func transforms "
            "refuse. Either compile without the transform (torch.compile the model, then .backward()), or "
            "run the transform eagerly, where remat composes with every torch.func transform."
        )
    if isinstance(policy, MemoryBudget) and not graph_breaks_are_errors():
        return _outside_compile(eagerly, args, kwargs)
    # under fullgraph the policy function raises it instead, while AOTAutograd traces: dynamo
    # would hide an error raised here behind its own "observed exception"; the backend's
    # failure names the RematError first and carries it as `inner_exception`
    # the region's own `debug=` must reach it, not checkpoint (a loop: torch 2.11's dynamo cannot trace `keys() & set`)
    if any(name in _CHECKPOINT_OWN_ARGUMENTS for name in kwargs):
        fn, kwargs = functools.partial(fn, **kwargs), {}
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context, **kwargs)


@torch.compiler.disable
def _outside_compile(eagerly: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`eagerly(*args, **kwargs)` as eager code: dynamo breaks its graph at this call and
    compiles none of the frames under it (remat's own tracing, the region's graphs)."""
    return eagerly(*args, **kwargs)


def budget_under_compile(policy: MemoryBudget, region: str) -> RematError:
    return RematError(
        f"remat({region}): {policy!r} chooses what a whole region keeps by tracing it, which remat does "
        "only in eager mode, not under torch.compile(fullgraph=True). Under compile use an op-by-op policy "
        "(e.g. dots_saveable), or torch._functorch.config.activation_memory_budget, torch's own budget for "
        "compiled graphs; without fullgraph, torch.compile runs a budgeted region eagerly."
    )


_CHECKPOINT_OWN_ARGUMENTS = frozenset(inspect.signature(checkpoint).parameters) - {"function", "args", "kwargs"}


# Dynamo cannot read a ContextVar (remat's override of every region's policy), so code
# compiled by torch.compile reads this process-wide copy instead: (policy, its selective
# context built here, outside traced code), or NO_REMAT. Dynamo guards on it and
# recompiles when it changes.
_override: tuple[Any, ...] | str | None = None


def compiled_override() -> tuple[Any, ...] | str | None:
    return _override


@contextlib.contextmanager
def overriding_under_compile(policy: Callable[..., Any] | None, no_remat: bool) -> Iterator[None]:
    global _override
    previous = _override
    _override = NO_REMAT if no_remat else (policy, selective_context(policy, "using_policy"))
    try:
        yield
    finally:
        _override = previous


def compiled_region(call: Callable[[tuple[Any, ...], dict[str, Any]], Any], region: str) -> Callable[..., Any]:
    """`call(args, kwargs)` under torch.compile with the aot_eager backend (no code
    generation) and automatic dynamic shapes, in a function of its own: dynamo caches
    compiled code per code object, so each region gets a fresh one (else every region
    would share one cache and its recompile limit)."""

    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return call(args, kwargs)

    own = types.FunctionType(run.__code__.replace(co_name=f"remat_{region}"[:80]), run.__globals__, closure=run.__closure__)
    compiled = torch.compile(own, backend="aot_eager")

    def quiet(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with selective_checkpoint_compile_notice_off():  # the user compiled nothing: torch's notice is not for them
            return compiled(args, kwargs)

    return quiet
