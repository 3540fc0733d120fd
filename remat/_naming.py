"""`checkpoint_name`: tag values so that policies can refer to them by name."""

from __future__ import annotations

from typing import TypeVar

import optree
import torch

from ._torch_internals import tracing_node

NAME_KEY = "remat_name"
T = TypeVar("T")


def checkpoint_name(x: T, name: str) -> T:
    """Tag every tensor in the pytree `x` with `name`; returns `x` unchanged.

    Outside a remat trace this is the identity (free, differentiable, fine under vmap).
    While remat traces a function, the name is written on the graph node that produced
    the tensor, where `save_only_these_names("name")` and friends look for it.

    >>> import torch
    >>> from remat import checkpoint_name
    >>> h = checkpoint_name(torch.ones(2), "h")
    >>> h.tolist()
    [1.0, 1.0]
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"checkpoint_name: name must be a non-empty string, got {name!r}")
    for leaf in optree.tree_leaves(x):
        if isinstance(leaf, torch.Tensor):
            node = tracing_node(leaf)
            if node is not None:
                node.meta["custom"] = {**node.meta.get("custom", {}), NAME_KEY: name}
    return x


def node_name(node: torch.fx.Node) -> str | None:
    """The checkpoint_name written on a traced node, if any."""
    return node.meta.get("custom", {}).get(NAME_KEY)
