"""The graph rewrites, in the order they run: stage 1's (on the traced function, around
functionalization) and the joint graph's (on the parts of the joint graph that the
partitioner has told apart). Each pass is named and documented in `passes` or `mutations`;
this module is the one place that says which run, and when."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx

from .failures import refuse_opaque_objects
from .mutations import functionalize_remaining_mutations
from .passes import (
    autocast_casts_of_leaves_cached,
    drop_saved_value_detaches,
    grad_free_values_as_constants,
    index_fill_as_where,
    inner_backwards_as_eager,
    random_fills_in_memory_order,
    random_from_as_random_to,
    random_likes_in_traced_layout,
    rrelu_as_product,
    shape_only_factories,
)


def stage_one_passes(
    gm: torch.fx.GraphModule,
    leaves_needing_grad: Sequence[bool],
    functionalize: Callable[[torch.fx.GraphModule], torch.fx.GraphModule],
    fn_name: str,
) -> torch.fx.GraphModule:
    """Stage 1's traced graph, rewritten: what must be read before functionalization (memory
    order of random fills, autocast's cast cache, grad-free values, inner backwards), then
    `functionalize`, then what functionalization leaves (grad-free values read through a
    written view, remaining in-place writes, rrelu's noise, `random.from`). Returns the new
    graph; refuses one that holds an opaque object."""
    refuse_opaque_objects(gm, fn_name)
    random_fills_in_memory_order(gm)
    random_likes_in_traced_layout(gm)
    autocast_casts_of_leaves_cached(gm, leaves_needing_grad)
    grad_free_values_as_constants(gm)
    inner_backwards_as_eager(gm)
    gm = functionalize(gm)
    # again: a write with grad off through a view of a tensor is read afterwards through the
    # tensor, which functionalization turns into a read of the written value (a scatter)
    grad_free_values_as_constants(gm)
    functionalize_remaining_mutations(gm, fn_name)
    rrelu_as_product(gm)
    random_from_as_random_to(gm)
    return gm


def joint_passes(graph: torch.fx.Graph, forward: set[torch.fx.Node], backward: set[torch.fx.Node]) -> None:
    """The joint graph's rewrites, once its forward and backward nodes are known: factories
    that read a value only for its shape stop keeping it alive, backward reads saved values
    rather than autograd's detaches of them, and `index_fill` with a tensor value batches
    correctly under vmap. The caller recomputes which nodes backward needs afterwards."""
    shape_only_factories(graph, [n for n in graph.nodes if n in backward])
    shape_only_factories(graph, [n for n in graph.nodes if n in forward], readers=backward)
    drop_saved_value_detaches(graph, [n for n in graph.nodes if n in backward])
    index_fill_as_where(graph, [n for n in graph.nodes if n in backward])
