"""The policy vocabulary: which intermediates a remat region may keep for backward.

A policy is any callable ``policy(op, *args, **kwargs) -> bool``. It is asked once per
forward op of the traced function: ``op`` is the aten op (an ``OpOverload``), ``args`` and
``kwargs`` are the op's arguments with tensors replaced by data-free ``meta`` tensors that
carry shape, dtype and strides. A value tagged with ``checkpoint_name`` is asked with its
name as the keyword ``name``. ``True`` means "may be kept": a value is kept only if the
backward pass reads it. Anything but a bool is a TypeError.

Built-in policies are frozen, hashable values with a readable repr, so they can serve as
cache keys. Nothing here imports the mechanism in ``remat``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ._ops import ATTENTION, COLLECTIVES, CONVOLUTIONS, DOTS, DOTS_BATCHED, DOTS_NO_BATCH, OpLike, op_key, op_keys

Policy = Callable[..., bool]

__all__ = [
    "Policy",
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots_with_no_batch_dims",
    "save_only_these_names",
    "save_any_names_but_these",
    "save_anything_except_these_names",
    "save_from_both_policies",
    "save_ops",
    "dots_and_attention_saveable",
    "op_key",
    "op_keys",
    "DOTS",
    "DOTS_NO_BATCH",
    "DOTS_BATCHED",
    "ATTENTION",
    "CONVOLUTIONS",
    "COLLECTIVES",
]


@dataclass(frozen=True)
class _Constant:
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


@dataclass(frozen=True)
class SaveOps:
    """Keeps the outputs of the listed ops (matched by overload packet)."""

    ops: frozenset[str]
    label: str = ""

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return op_key(op) in self.ops

    def __repr__(self) -> str:
        return self.label or f"save_ops({', '.join(sorted(self.ops))})"


def save_ops(*ops: OpLike | frozenset[str]) -> SaveOps:
    """Keep the outputs of these ops and op groups.

    ``save_ops(torch.ops.aten.mm, "aten::bmm")``, ``save_ops(DOTS, ATTENTION, "mylib::fused")``:
    groups are sets of op names, so extending one is adding names to it.
    """
    keys: set[str] = set()
    for op in ops:
        keys |= op if isinstance(op, frozenset) else {op_key(op)}
    return SaveOps(frozenset(keys))


# Matrix multiplies are the expensive ops: keep their outputs, recompute the cheap rest.
dots_saveable = SaveOps(DOTS, "dots_saveable")
checkpoint_dots = dots_saveable

# Keep only dots without batch dims (weights times activations), recompute batched ones
# such as attention scores, which grow with sequence length squared.
dots_with_no_batch_dims_saveable = SaveOps(DOTS_NO_BATCH, "dots_with_no_batch_dims_saveable")
checkpoint_dots_with_no_batch_dims = dots_with_no_batch_dims_saveable


# The common large-model recipe: keep matmul and fused-attention outputs, recompute the
# cheap elementwise rest (norms, activations, dropout).
dots_and_attention_saveable = SaveOps(DOTS | ATTENTION, "dots_and_attention_saveable")


def _names_repr(function: str, names: frozenset[str]) -> str:
    return f"{function}({', '.join(repr(n) for n in sorted(names))})"


@dataclass(frozen=True)
class _SaveOnlyNames:
    names: frozenset[str]

    def __call__(self, op: Any, *args: Any, name: str | None = None, **kwargs: Any) -> bool:
        return name is not None and name in self.names

    def __repr__(self) -> str:
        return _names_repr("save_only_these_names", self.names)


@dataclass(frozen=True)
class _SaveAnyNamesBut:
    names: frozenset[str]

    def __call__(self, op: Any, *args: Any, name: str | None = None, **kwargs: Any) -> bool:
        return name is not None and name not in self.names

    def __repr__(self) -> str:
        return _names_repr("save_any_names_but_these", self.names)


@dataclass(frozen=True)
class _SaveAnythingExcept:
    names: frozenset[str]

    def __call__(self, op: Any, *args: Any, name: str | None = None, **kwargs: Any) -> bool:
        return name not in self.names

    def __repr__(self) -> str:
        return _names_repr("save_anything_except_these_names", self.names)


def _name_set(function: str, names: tuple[Any, ...]) -> frozenset[str]:
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"{function}: names must be strings, got {n!r}")
    return frozenset(names)


def save_only_these_names(*names: str) -> Policy:
    """Keep the values tagged with one of these names, nothing else."""
    return _SaveOnlyNames(_name_set("save_only_these_names", names))


def save_any_names_but_these(*names: str) -> Policy:
    """Keep every named value except these; unnamed values are never kept."""
    return _SaveAnyNamesBut(_name_set("save_any_names_but_these", names))


def save_anything_except_these_names(*names: str) -> Policy:
    """Keep every value except the ones tagged with these names (named or not)."""
    return _SaveAnythingExcept(_name_set("save_anything_except_these_names", names))


@dataclass(frozen=True)
class _Either:
    first: Policy
    second: Policy

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return self.first(op, *args, **kwargs) or self.second(op, *args, **kwargs)

    def __repr__(self) -> str:
        return f"save_from_both_policies({self.first!r}, {self.second!r})"


def save_from_both_policies(first: Policy, second: Policy) -> Policy:
    """Keep what either policy keeps (a logical OR)."""
    return _Either(first, second)
