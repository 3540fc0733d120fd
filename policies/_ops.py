"""Op groups: the names policies match against, normalised so every spelling agrees.

`aten.mm`, `aten.mm.default`, `torch.ops.aten.mm` and the strings "aten::mm", "aten.mm",
"mm" all name the same op. Matching by overload packet is what makes a policy that names
`aten.mm` impossible to miss (the selective-checkpoint fault of torch.utils.checkpoint).
"""

from __future__ import annotations

from typing import Any, Iterable

OpLike = Any  # an OpOverload, an OpOverloadPacket, or a string such as "aten::mm"


def op_key(op: OpLike) -> str:
    """The canonical "namespace::name" of an op, without its overload."""
    if isinstance(op, str):
        text = op.strip()
        if text.startswith("torch.ops."):
            text = text[len("torch.ops."):]
        if "::" not in text:
            parts = text.split(".")
            text = "aten::" + parts[0] if len(parts) == 1 else parts[0] + "::" + parts[1]
        return text.split(".")[0]
    packet = getattr(op, "overloadpacket", op)
    qualified = getattr(packet, "_qualified_op_name", None)
    if qualified is None:
        raise TypeError(
            f"{op!r} is not an op: name ops as torch.ops.aten.mm, aten.mm.default or 'aten::mm'"
        )
    return qualified


def op_keys(ops: Iterable[OpLike]) -> frozenset[str]:
    return frozenset(op_key(op) for op in ops)


# Matrix multiplies with no batch dimension: leading axes of `x[B,T,D] @ W` are folded into
# rows, so these are what `linear`, `matmul` on 2-D weights and `x @ W` lower to.
DOTS_NO_BATCH: frozenset[str] = op_keys(
    ["aten::mm", "aten::addmm", "aten::mv", "aten::addmv", "aten::dot", "aten::vdot", "aten::_int_mm"]
)

# Matrix multiplies with a batch dimension: batched matmul and einsum('bij,bjk->bik').
DOTS_BATCHED: frozenset[str] = op_keys(["aten::bmm", "aten::baddbmm", "aten::addbmm"])

DOTS: frozenset[str] = DOTS_NO_BATCH | DOTS_BATCHED

# Where each batched dot's batch size sits: (argument index, dimension).
_BATCH_SIZE_AT = {"aten::bmm": 0, "aten::baddbmm": 1}


def has_batch_dims(op: OpLike, args: tuple[Any, ...]) -> bool:
    """Whether a dot really has a batch dimension, judged as JAX judges dot_general: a
    `bmm` with a batch of one (what `einsum('ij,jk->ik')` lowers to) has none."""
    key = op_key(op)
    if key in DOTS_NO_BATCH:
        return False
    position = _BATCH_SIZE_AT.get(key)
    if position is None or len(args) <= position or not hasattr(args[position], "shape"):
        return key in DOTS_BATCHED
    return args[position].shape[0] != 1

# Fused attention kernels (what scaled_dot_product_attention lowers to on each backend).
# Keeping their outputs means attention is not recomputed in backward.
ATTENTION: frozenset[str] = op_keys(
    [
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_fused_attention_overrideable",
        "aten::_flash_attention_forward",
        "aten::_efficient_attention_forward",
        "aten::_native_multi_head_attention",
    ]
)

# Convolutions (conv1d/2d/3d and transposed ones lower to these).
CONVOLUTIONS: frozenset[str] = op_keys(
    [
        "aten::convolution",
        "aten::_convolution",
        "aten::cudnn_convolution",
        "aten::cudnn_convolution_transpose",
        "aten::mkldnn_convolution",
        "aten::miopen_convolution",
        "aten::_slow_conv2d_forward",
        "aten::slow_conv3d_forward",
    ]
)

# Functional collectives: keeping their outputs avoids communicating again in backward.
COLLECTIVES: frozenset[str] = op_keys(
    [
        "_c10d_functional::all_reduce",
        "_c10d_functional::all_reduce_coalesced",
        "_c10d_functional::all_gather_into_tensor",
        "_c10d_functional::all_gather_into_tensor_coalesced",
        "_c10d_functional::reduce_scatter_tensor",
        "_c10d_functional::reduce_scatter_tensor_coalesced",
        "_c10d_functional::all_to_all_single",
        "_c10d_functional::wait_tensor",
    ]
)


GROUPS: dict[str, frozenset[str]] = {
    "DOTS": DOTS,
    "DOTS_NO_BATCH": DOTS_NO_BATCH,
    "DOTS_BATCHED": DOTS_BATCHED,
    "ATTENTION": ATTENTION,
    "CONVOLUTIONS": CONVOLUTIONS,
    "COLLECTIVES": COLLECTIVES,
}


def describe_group(group: frozenset[str]) -> str:
    """A group's name if it is a built-in group, else its ops."""
    for name, members in GROUPS.items():
        if group == members:
            return name
    return " or ".join(sorted(group))
