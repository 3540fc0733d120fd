"""`checkpoint_name`: tag values so that policies can refer to them by name."""

from __future__ import annotations

from typing import TypeVar

import optree
import torch

from .._core.nodes import NAME_KEY, annotate
from .._partition.compiling import named_copies
from .._running.replaying import replaying
from .._trace.recording import traced_node

T = TypeVar("T")


def checkpoint_name(x: T, name: str) -> T:
    """Tag every tensor in the pytree `x` with `name`; returns `x` unchanged.

    Outside a remat trace this is the identity (free, differentiable, fine under vmap).
    While remat traces a function, the name is written on the graph node that produced
    the tensor, where `save_only_these_names("name")` and friends look for it.
    Under torch.compile it is the op `remat::checkpoint_name` (a copy), through which the
    name reaches the node that produced the tensor, as in eager. In a region remat could
    not trace (run as torch.utils.checkpoint runs it) it is that op too: the policy keeps
    the named copy.

    >>> import torch
    >>> from remat import checkpoint_name
    >>> h = checkpoint_name(torch.ones(2), "h")
    >>> h.tolist()
    [1.0, 1.0]
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"checkpoint_name: name must be a non-empty string, got {name!r}")
    if torch.compiler.is_compiling():
        from .._partition.compiling import name_under_compile

        return name_under_compile(x, name)  # type: ignore[no-any-return]
    if replaying():
        return named_copies(x, name)  # type: ignore[no-any-return]
    for leaf in optree.tree_leaves(x):  # type: ignore[var-annotated,arg-type]
        if isinstance(leaf, torch.Tensor):
            annotate(traced_node(leaf), NAME_KEY, name)
    return x
