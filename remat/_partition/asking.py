"""Asking a policy: the one place remat calls one, for eager graphs and compiled ones
alike. A policy sees metadata only (meta tensors, meta as a factory's device) and must
answer True (may keep), False (recompute) or an Offload. A collective's output is kept
without asking a policy that does not name collectives."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from remat.policies import COLLECTIVES, Offload, describe_group, names_collectives, op_key, references

from .._core.errors import RematPolicyWarning
from .._core.logs import warn_at_user_line
from .._core.nodes import SCOPE_KEY, meta_arguments, node_name
from .._core.torch_internals import OpOverload
from .._trace.records import Scope

Decide = Callable[[torch.fx.Node], "bool | Offload"]  # may keep / recompute / keep in host memory


def policy_decider(scopes: Sequence[Scope]) -> Decide:
    """Ask the policy governing each node (its innermost remat region's) about it, with
    data-free meta tensors; insist on a bool. A region without a policy keeps nothing."""

    def decide(node: torch.fx.Node) -> bool:
        return ask(scopes[node.meta.get("custom", {}).get(SCOPE_KEY, 0)].policy, node)

    return decide


def ask(policy: Callable[..., bool] | None, node: torch.fx.Node) -> bool:
    """`policy`'s answer for `node`, asked with data-free meta tensors; insist on a bool.
    No policy keeps nothing but a collective's output."""
    if policy is None:
        return kept_unasked(None, node.target)
    args, kwargs = meta_arguments(node)
    return answer_of(policy, node.target, args, kwargs, node_name(node))


_META = torch.device("meta")


def kept_unasked(policy: Callable[..., Any] | None, op: Any) -> bool:
    """Whether `op`'s output is kept without asking `policy`: a collective's is, unless the
    policy names collectives. Recomputing one communicates again in backward (under
    sequence parallelism, the whole sequence gathered a second time)."""
    if getattr(op, "namespace", None) != "_c10d_functional":
        return False
    return op_key(op) in COLLECTIVES and not names_collectives(policy)


def answer_of(policy: Callable[..., bool], op: Any, args: Any, kwargs: dict[str, Any], name: str | None) -> bool:
    """`policy`'s answer for `op` called with (meta) `args`, its output tagged `name`;
    insist on a bool or an Offload. The policy runs with meta as the default device, so
    one that runs the op to see its output never computes anything (nor draws from a
    generator). A collective it does not name is kept unasked."""
    if kept_unasked(policy, op):
        return True
    if name is not None:
        kwargs = {**kwargs, "name": name}
    if "device" in kwargs:  # a factory's device: the policy sees metadata only, as for tensors
        kwargs = {**kwargs, "device": _META}
    with torch.device(_META):  # a policy that runs the op (a factory too) runs it on meta tensors
        answer = policy(op, *args, **kwargs)
    if not isinstance(answer, (bool, Offload)):
        if isinstance(answer, CheckpointPolicy):
            raise TypeError(
                f"remat policy {policy!r} returned {answer!r}: it looks like a torch selective-checkpoint "
                "policy_fn(ctx, op, *args, **kwargs), whose signature differs from remat's "
                "policy(op, *args, **kwargs) -> bool. Pass policies.from_selective_checkpoint(policy_fn)."
            )
        raise TypeError(
            f"remat policy {policy!r} returned {answer!r} ({type(answer).__name__}) for op {op}; "
            "a policy must return True (may keep), False (recompute) or policies.Offload(...) (move to host)."
        )
    return answer  # type: ignore[return-value]


def warn_unmatched_references(scopes: Sequence[Scope], graph: torch.fx.Graph) -> None:
    """Warn when a policy names ops or checkpoint_names that never occur in its region:
    such a policy silently keeps nothing of what its author meant."""
    ops: dict[int, set[str]] = {k: set() for k in range(len(scopes))}
    names: dict[int, set[str]] = {k: set() for k in range(len(scopes))}
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, OpOverload):
            scope = node.meta.get("custom", {}).get(SCOPE_KEY, 0)
            ops[scope].add(op_key(node.target))
            if node_name(node) is not None:
                names[scope].add(node_name(node))  # type: ignore[arg-type]
    for k, scope in enumerate(scopes):
        refs = references(scope.policy)
        missing_ops = [describe_group(group) for group in refs.ops if not group & ops[k]]
        missing_names = sorted(refs.names - names[k])
        if missing_ops:
            warn_at_user_line(
                f"remat({scope.region}): policy {scope.policy!r} names ops that never occur in the traced "
                f"function: {', '.join(missing_ops)}. Ops that occur: {', '.join(sorted(ops[k])) or 'none'}.",
                RematPolicyWarning,
            )
        if missing_names:
            warn_at_user_line(
                f"remat({scope.region}): policy {scope.policy!r} names values that never occur: "
                f"{', '.join(map(repr, missing_names))}. checkpoint_names that occur: "
                f"{', '.join(map(repr, sorted(names[k]))) or 'none'}.",
                RematPolicyWarning,
            )
