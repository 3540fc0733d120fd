"""Costs: how many FLOPs recomputing a traced op takes, from shapes alone.

Matrix multiplies, convolutions and attention use torch's own FLOP formulas
(torch.utils.flop_counter); every other op is counted as one FLOP per output element,
and views as free.
"""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch
import torch.fx
from torch.utils.flop_counter import flop_registry

from .._core.nodes import is_view, meta_arguments
from .._core.torch_internals import OpOverload

_aten = torch.ops.aten
# Ops torch's registry does not list but whose formula is that of a listed one (torch 2.13).
_SAME_FORMULA = {_aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention}


def _elements(value: Any) -> int:
    return sum(t.numel() for t in optree.tree_leaves(value) if isinstance(t, torch.Tensor))


def flops(node: torch.fx.Node) -> int:
    """FLOPs to run `node` once (0 for views and non-ops)."""
    if node.op != "call_function" or not isinstance(node.target, OpOverload) or is_view(node):
        return 0
    return op_flops(node.target, lambda: meta_arguments(node), node.meta.get("val"))


def op_flops(op: OpOverload, arguments: Callable[[], tuple[Any, dict[str, Any]]], out: Any) -> int:
    """FLOPs of one call of `op` giving `out`; `arguments()` gives its arguments (tensors
    read for their shapes only), asked for only where torch has a formula for the op."""
    if op.is_view:
        return 0
    formula = flop_registry.get(_SAME_FORMULA.get(op.overloadpacket, op.overloadpacket))
    if formula is not None:
        args, kwargs = arguments()
        try:
            return int(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not fit these arguments: fall back to the size
            pass
    return _elements(out)


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of this shape and dtype."""
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


def value_bytes(value: Any) -> int:
    """Bytes of a traced value (0 for what is not a tensor)."""
    return nbytes_of(tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else 0
