"""The policy vocabulary: which intermediates a remat region may keep for backward.

A policy is any hashable callable ``policy(op, *args, **kwargs) -> bool``. It is asked
once per forward op of the traced function: ``op`` is the aten op (an ``OpOverload``),
``args`` and ``kwargs`` are the op's arguments with tensors replaced by data-free ``meta``
tensors that carry shape, dtype and strides. A value tagged with ``checkpoint_name`` is
asked with its name as the keyword ``name``. ``True`` means "may be kept": a value is kept
only if the backward pass reads it. Anything but a bool is a TypeError. Collectives
(``COLLECTIVES``) are the exception: their outputs are kept without asking, unless the
policy names them (see ``names_collectives``).

Built-in policies are frozen, hashable values with a readable repr, so they can serve as
cache keys, and they combine: ``a | b`` (either keeps), ``a & b`` (both keep), ``~a``.
Nothing here imports the mechanism in ``remat``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import optree
import torch

from ._ops import (
    ATTENTION,
    COLLECTIVES,
    CONVOLUTIONS,
    DOTS,
    DOTS_BATCHED,
    DOTS_NO_BATCH,
    GROUPS,
    OpLike,
    describe_group,
    has_batch_dims,
    op_key,
    op_keys,
)

Policy = Callable[..., bool]

__all__ = [
    "Policy",
    "PolicyBase",
    "References",
    "references",
    "names_collectives",
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots_with_no_batch_dims",
    "dots_and_attention_saveable",
    "save_only_these_names",
    "save_any_names_but_these",
    "save_anything_except_these_names",
    "save_from_both_policies",
    "save_ops",
    "memory_budget",
    "from_selective_checkpoint",
    "MemoryBudget",
    "Offload",
    "offload_ops",
    "offload_dot_with_no_batch_dims",
    "save_and_offload_only_these_names",
    "keep_outputs_where",
    "output_smaller_than",
    "op_key",
    "op_keys",
    "DOTS",
    "DOTS_NO_BATCH",
    "DOTS_BATCHED",
    "ATTENTION",
    "CONVOLUTIONS",
    "COLLECTIVES",
    "GROUPS",
    "describe_group",
]


@dataclass(frozen=True)
class References:
    """What a policy expects to find in a traced function, so remat can warn when it does
    not: each entry of `ops` is a set of op names of which at least one should occur;
    `names` are checkpoint_names that should occur. `asks_about_collectives`: the policy
    decides about collectives without naming them (torch's selective-checkpoint policies,
    which are asked about every op)."""

    ops: tuple[frozenset[str], ...] = ()
    names: frozenset[str] = frozenset()
    asks_about_collectives: bool = False

    def __or__(self, other: References) -> References:
        return References(
            self.ops + other.ops, self.names | other.names, self.asks_about_collectives or other.asks_about_collectives
        )


def references(policy: Any) -> References:
    """The references of any policy (a plain function makes none)."""
    method = getattr(policy, "references", None)
    return method() if callable(method) else References()


def names_collectives(policy: Any) -> bool:
    """Whether `policy` decides about collectives. Only a policy that names one
    (``save_ops(COLLECTIVES)``, ``~save_ops(COLLECTIVES)``, ``offload_ops`` of one) or one
    made by ``from_selective_checkpoint`` (as torch's) is asked about them; under any other
    remat keeps their outputs, so that backward communicates no more than without remat."""
    refs = references(policy)
    return refs.asks_about_collectives or any(group & COLLECTIVES for group in refs.ops)


def _as_policy(value: Any) -> Policy:
    if not callable(value):
        raise TypeError(f"cannot combine a policy with {value!r}: a policy is a callable policy(op, *args, **kwargs) -> bool")
    return value


class PolicyBase:
    """What every built-in policy shares: combinators and the names it refers to."""

    def __or__(self, other: Policy) -> Policy:
        return _Combined(self, _as_policy(other), either=True)  # type: ignore[arg-type]

    def __ror__(self, other: Policy) -> Policy:
        return _Combined(_as_policy(other), self, either=True)  # type: ignore[arg-type]

    def __and__(self, other: Policy) -> Policy:
        return _Combined(self, _as_policy(other), either=False)  # type: ignore[arg-type]

    def __rand__(self, other: Policy) -> Policy:
        return _Combined(_as_policy(other), self, either=False)  # type: ignore[arg-type]

    def __invert__(self) -> Policy:
        return _Not(self)  # type: ignore[arg-type]

    def references(self) -> References:
        return References()


@dataclass(frozen=True, repr=False)
class _Constant(PolicyBase):
    """Answers the same for every op."""

    answer: bool
    label: str

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return self.answer

    def __repr__(self) -> str:
        return self.label


# Keep every intermediate backward reads: plain autograd's memory, no recompute.
everything_saveable = _Constant(True, "everything_saveable")

# Keep nothing but the inputs: the least memory, the whole forward recomputed.
nothing_saveable = _Constant(False, "nothing_saveable")


@dataclass(frozen=True, repr=False)
class SaveOps(PolicyBase):
    """Keeps the outputs of the listed ops (matched by overload packet)."""

    ops: frozenset[str]
    label: str = ""
    expected: tuple[frozenset[str], ...] = field(default=(), compare=False)
    asks_about_collectives: bool = False  # torch's list of ops to save: a collective not listed is recomputed

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return op_key(op) in self.ops

    def __repr__(self) -> str:
        parts = [describe_group(g) for g in self.expected] if self.expected else sorted(self.ops)
        return self.label or f"save_ops({', '.join(parts)})"

    def references(self) -> References:
        return References(ops=self.expected, asks_about_collectives=self.asks_about_collectives)


def save_ops(*ops: OpLike | frozenset[str]) -> SaveOps:
    """Keep the outputs of these ops and op groups.

    ``save_ops(torch.ops.aten.mm, "aten::bmm")``, ``save_ops(DOTS, ATTENTION, "mylib::fused")``:
    groups are sets of op names, so extending one is adding names to it. remat warns when
    a listed op (or every op of a listed group) never occurs in the traced function.
    """
    expected = tuple(op if isinstance(op, frozenset) else frozenset([op_key(op)]) for op in ops)
    return SaveOps(frozenset().union(*expected), expected=expected)


# Matrix multiplies are the expensive ops: keep their outputs, recompute the cheap rest.
dots_saveable = SaveOps(DOTS, "dots_saveable")
checkpoint_dots = dots_saveable

@dataclass(frozen=True, repr=False)
class _DotsWithoutBatchDims(SaveOps):
    """Keeps dots judged by their real batch dimensions (a `bmm` of a batch of one has none)."""

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return op_key(op) in DOTS and not has_batch_dims(op, args)


# Keep only dots without batch dims (weights times activations), recompute batched ones
# such as attention scores, which grow with sequence length squared.
dots_with_no_batch_dims_saveable = _DotsWithoutBatchDims(DOTS_NO_BATCH, "dots_with_no_batch_dims_saveable")
checkpoint_dots_with_no_batch_dims = dots_with_no_batch_dims_saveable

# The common large-model recipe: keep matmul and fused-attention outputs, recompute the
# cheap elementwise rest (norms, activations, dropout).
dots_and_attention_saveable = SaveOps(DOTS | ATTENTION, "dots_and_attention_saveable")


def _names_repr(function: str, names: frozenset[str]) -> str:
    return f"{function}({', '.join(repr(n) for n in sorted(names))})"


@dataclass(frozen=True, repr=False)
class _NamePolicy(PolicyBase):
    """Decides by checkpoint_name; `unnamed` is the answer for values without a name."""

    names: frozenset[str]
    keep_listed: bool
    unnamed: bool
    function: str

    def __call__(self, op: Any, *args: Any, name: str | None = None, **kwargs: Any) -> bool:
        if name is None:
            return self.unnamed
        return (name in self.names) == self.keep_listed

    def __repr__(self) -> str:
        return _names_repr(self.function, self.names)

    def references(self) -> References:
        return References(names=self.names)


def _name_set(function: str, names: tuple[Any, ...]) -> frozenset[str]:
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"{function}: names must be strings, got {n!r}")
    return frozenset(names)


def save_only_these_names(*names: str) -> Policy:
    """Keep the values tagged with one of these names, nothing else."""
    return _NamePolicy(_name_set("save_only_these_names", names), True, False, "save_only_these_names")


def save_any_names_but_these(*names: str) -> Policy:
    """Keep every named value except these; unnamed values are never kept."""
    return _NamePolicy(_name_set("save_any_names_but_these", names), False, False, "save_any_names_but_these")


def save_anything_except_these_names(*names: str) -> Policy:
    """Keep every value except the ones tagged with these names (named or not)."""
    return _NamePolicy(
        _name_set("save_anything_except_these_names", names), False, True, "save_anything_except_these_names"
    )


@dataclass(frozen=True, repr=False)
class _Combined(PolicyBase):
    """`first | second` (either keeps) or `first & second` (both keep)."""

    first: Policy
    second: Policy
    either: bool

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        answer = self.first(op, *args, **kwargs)
        if answer is self.either:  # decided without asking the second
            return answer
        return self.second(op, *args, **kwargs) if isinstance(answer, bool) else answer

    def __repr__(self) -> str:
        return f"({self.first!r} {'|' if self.either else '&'} {self.second!r})"

    def references(self) -> References:
        return references(self.first) | references(self.second)


@dataclass(frozen=True, repr=False)
class _Not(PolicyBase):
    policy: Policy

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        answer = self.policy(op, *args, **kwargs)
        return (not answer) if isinstance(answer, bool) else answer  # a non-bool stays wrong, and is reported

    def __repr__(self) -> str:
        return f"~{self.policy!r}"

    def references(self) -> References:
        return references(self.policy)


def save_from_both_policies(first: Policy, second: Policy) -> Policy:
    """Keep what either policy keeps (a logical OR; the same as ``first | second``)."""
    return _Combined(_as_policy(first), _as_policy(second), either=True)


def _output_bytes(output: Any) -> int:
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(output) if isinstance(t, torch.Tensor))


@dataclass(frozen=True, repr=False)
class _OutputPredicate(PolicyBase):
    """Decides from the op's output, computed on meta tensors (shapes and dtypes only)."""

    predicate: Callable[[Any], bool]
    label: str

    def __call__(self, op: Any, *args: Any, name: str | None = None, **kwargs: Any) -> bool:
        try:
            output = op(*args, **kwargs)
        except Exception:  # an op without a meta kernel: we cannot know its size, so recompute
            return False
        return bool(self.predicate(output))

    def __repr__(self) -> str:
        return self.label


def keep_outputs_where(predicate: Callable[[Any], bool], label: str | None = None) -> Policy:
    """Keep an op's output when ``predicate(output)`` is true; `output` is a meta tensor
    with the shape and dtype the op produces, or a tuple of them for a multi-output op."""
    return _OutputPredicate(predicate, label or f"keep_outputs_where({getattr(predicate, '__name__', predicate)!s})")


@dataclass(frozen=True)
class _SmallerThan:
    nbytes: int

    def __call__(self, output: Any) -> bool:
        return _output_bytes(output) < self.nbytes


def output_smaller_than(nbytes: int) -> Policy:
    """Keep outputs smaller than `nbytes` (cheap to keep, maybe costly to recompute)."""
    return _OutputPredicate(_SmallerThan(int(nbytes)), f"output_smaller_than({int(nbytes)})")


@dataclass(frozen=True, repr=False)
class MemoryBudget(PolicyBase):
    """A region's policy that chooses what to keep as a whole (see `memory_budget`)."""

    limit: int | float

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        raise TypeError(
            f"{self!r} chooses what a whole region keeps, not op by op: give it to remat as the "
            "region's policy (remat(fn, policy=memory_budget(...))), not inside another policy."
        )

    def __repr__(self) -> str:
        return f"memory_budget({self.limit!r})"


@dataclass(frozen=True, repr=False)
class _SelectiveCheckpoint(PolicyBase):
    """torch's selective-checkpoint `policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy`
    asked as a remat policy: MUST_SAVE and PREFER_SAVE keep, the two RECOMPUTEs do not.
    It is asked about collectives too, as torch's selective checkpoint asks (eager and
    compiled, torch recomputes a collective such a policy does not save)."""

    policy_fn: Callable[..., Any]

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

        kwargs.pop("name", None)  # a checkpoint_name, which torch's policies are never asked with
        answer = self.policy_fn(SelectiveCheckpointContext(is_recompute=False), op, *args, **kwargs)
        if not isinstance(answer, CheckpointPolicy):
            raise TypeError(
                f"{self!r}: the selective-checkpoint policy returned {answer!r} for op {op}; torch's "
                "policy_fn returns a torch.utils.checkpoint.CheckpointPolicy (MUST_SAVE, PREFER_SAVE, "
                "MUST_RECOMPUTE or PREFER_RECOMPUTE)."
            )
        return answer in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)

    def __repr__(self) -> str:
        return f"from_selective_checkpoint({getattr(self.policy_fn, '__qualname__', self.policy_fn)!r})"

    def references(self) -> References:
        return References(asks_about_collectives=True)


def from_selective_checkpoint(policy_fn_or_ops: Callable[..., Any] | Iterable[OpLike]) -> Policy:
    """A remat policy from what torch's `create_selective_checkpoint_contexts` takes.

    ``policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy``: kept where it answers
    MUST_SAVE or PREFER_SAVE. remat asks once per op when it plans the region, never in the
    recompute, so ``ctx.is_recompute`` is always False. A list of ops: keep their outputs
    (as ``save_ops``). The policy sees data-free meta tensors, as every remat policy does.
    As in torch, eager and compiled, a collective either form does not save is recomputed
    (it communicates again in backward); other policies keep collectives unless they name
    them.
    """
    if callable(policy_fn_or_ops):
        return _SelectiveCheckpoint(policy_fn_or_ops)
    listed = save_ops(*policy_fn_or_ops)
    label = f"from_selective_checkpoint([{', '.join(sorted(listed.ops))}])"
    return dataclasses.replace(listed, label=label, asks_about_collectives=True)


def memory_budget(limit: int | float) -> MemoryBudget:
    """Keep what fits in `limit` and recompute the rest, choosing the kept values that leave
    backward the fewest FLOPs to recompute.

    `limit` is a number of bytes (an int) or a fraction in [0, 1] of what keeping every
    value would keep (a float). It counts the region's kept intermediates; its inputs are
    kept anyway. The choice is optimal for up to 12 candidate values and greedy (most FLOPs
    saved per byte first) beyond; `remat.report` shows what was chosen.
    """
    if isinstance(limit, bool) or not isinstance(limit, (int, float)):
        raise TypeError(f"memory_budget: limit must be bytes (an int) or a fraction (a float), got {limit!r}")
    if isinstance(limit, float) and not 0.0 <= limit <= 1.0:
        raise ValueError(f"memory_budget: a fraction must be within [0, 1], got {limit!r}; give bytes as an int")
    if limit < 0:
        raise ValueError(f"memory_budget: bytes must be at least 0, got {limit!r}")
    return MemoryBudget(limit)


@dataclass(frozen=True)
class Offload:
    """A policy's third answer: neither keep the value where it is nor recompute it, but
    move it to `dst` memory ("cpu": host memory, pinned when it comes from an accelerator)
    after forward and back before backward needs it. `src`: only values on that device type
    move (None: any); others are kept where they are."""

    dst: str = "cpu"
    src: str | None = None


@dataclass(frozen=True, repr=False)
class _OffloadOps(PolicyBase):
    """Offload the outputs of the listed ops (dots without batch dimensions only, if
    asked), recompute the rest."""

    ops: frozenset[str]
    answer: Offload
    label: str
    without_batch_dims: bool = False

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op_key(op) in self.ops and not (self.without_batch_dims and has_batch_dims(op, args)):
            return self.answer
        return False

    def __repr__(self) -> str:
        return self.label


def offload_ops(*ops: OpLike | frozenset[str], offload_src: str | None = None, offload_dst: str = "cpu") -> Policy:
    """Offload the outputs of these ops and op groups to `offload_dst` memory; recompute the rest."""
    names = frozenset().union(*(op if isinstance(op, frozenset) else frozenset([op_key(op)]) for op in ops))
    return _OffloadOps(names, Offload(offload_dst, offload_src), f"offload_ops({', '.join(sorted(names))})")


def offload_dot_with_no_batch_dims(offload_src: str | None = None, offload_dst: str = "cpu") -> Policy:
    """JAX's policy of that name: offload dots without batch dimensions, recompute the rest."""
    return _OffloadOps(DOTS, Offload(offload_dst, offload_src), "offload_dot_with_no_batch_dims", without_batch_dims=True)


@dataclass(frozen=True, repr=False)
class _SaveAndOffloadNames(PolicyBase):
    saved: frozenset[str]
    offloaded: frozenset[str]
    answer: Offload

    def __call__(self, op: Any, *args: Any, name: str | None = None, **kwargs: Any) -> Any:
        if name in self.saved:
            return True
        return self.answer if name in self.offloaded else False

    def __repr__(self) -> str:
        return f"save_and_offload_only_these_names({sorted(self.saved)}, {sorted(self.offloaded)})"

    def references(self) -> References:
        return References(names=self.saved | self.offloaded)


def save_and_offload_only_these_names(
    *,
    names_which_can_be_saved: Any,
    names_which_can_be_offloaded: Any,
    offload_src: str | None = None,
    offload_dst: str = "cpu",
) -> Policy:
    """JAX's policy of that name: keep values with the first names, offload values with the
    second, recompute the rest."""
    saved = _name_set("save_and_offload_only_these_names", tuple(names_which_can_be_saved))
    offloaded = _name_set("save_and_offload_only_these_names", tuple(names_which_can_be_offloaded))
    if saved & offloaded:
        raise ValueError(f"save_and_offload_only_these_names: {sorted(saved & offloaded)} are both saved and offloaded")
    return _SaveAndOffloadNames(saved, offloaded, Offload(offload_dst, offload_src))
