"""remat's own op, for what eager autograd does that no aten op expresses.

`remat::value_with_grad_of(value, source)` is `value`, differentiated as if it were
`source`: what eager code gets from an in-place change made with grad disabled
(`with torch.no_grad(): norm.clamp_min_(eps)`, as `cosine_similarity` does inside), whose
later readers see the new values while autograd still differentiates the old tensor. The
value is exact (a copy), unlike `source + (value - source).detach()`, which rounds and
turns an infinite `source` into NaN. Its derivative is an autograd.Function torch.func
can transform (a custom op's own autograd formula is not, in torch 2.13).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .torch_internals import below_autograd, transforms_active

_LIBRARY = torch.library.Library("remat", "DEF")
_LIBRARY.define("value_with_grad_of(Tensor value, Tensor source) -> Tensor")
VALUE_WITH_GRAD_OF = torch.ops.remat.value_with_grad_of.default


def _value(value: Tensor, source: Tensor) -> Tensor:
    return value.clone()


def _fake(value: Tensor, source: Tensor) -> Tensor:
    return torch.empty_like(value)


class _ValueWithGradOf(torch.autograd.Function):
    @staticmethod
    def forward(value: Tensor, source: Tensor) -> Tensor:
        return VALUE_WITH_GRAD_OF(value, source)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        return None, grad


def _autograd(keyset: Any, value: Tensor, source: Tensor) -> Tensor:
    if not (torch.is_grad_enabled() and source.requires_grad):
        return VALUE_WITH_GRAD_OF.redispatch(below_autograd(keyset), value, source)  # type: ignore[no-any-return]
    if transforms_active():
        return _as_aten_ops(value, source)
    return _ValueWithGradOf.apply(value, source)  # type: ignore[no-any-return]


def _as_aten_ops(value: Tensor, source: Tensor) -> Tensor:
    """The op in aten ops, for torch.func, which cannot run an autograd.Function from an
    op's Autograd kernel: the same value; the gradient of `source`, except where `source`
    is not finite, where none flows. Only a graph remat runs that torch.func differentiates
    itself gets here (the graphs remat differentiates get the exact Function)."""
    plain = source.detach()
    exact = value.detach() - (plain - source)  # x - x is +0 and v - 0 is v, for finite x
    return torch.where(torch.isfinite(plain), exact, value.detach())


def _batched(info: Any, in_dims: tuple[int | None, int | None], value: Tensor, source: Tensor) -> tuple[Tensor, int]:
    n = info.batch_size
    value_dim, source_dim = in_dims
    value = value.movedim(value_dim, 0) if value_dim is not None else value.expand(n, *value.shape)
    source = source.movedim(source_dim, 0) if source_dim is not None else source.expand(n, *source.shape)
    return VALUE_WITH_GRAD_OF(value, source), 0


_LIBRARY.impl("value_with_grad_of", _value, "CompositeExplicitAutograd")
_LIBRARY.impl("value_with_grad_of", _autograd, "Autograd", with_keyset=True)
torch.library.register_fake("remat::value_with_grad_of", _fake, lib=_LIBRARY)
torch.library.register_vmap("remat::value_with_grad_of", _batched, lib=_LIBRARY)
