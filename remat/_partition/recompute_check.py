"""Debug mode: backward checks that every recomputed value equals the forward's.

A mismatch means recompute is not a faithful replay: an input changed between forward and
backward (e.g. through `.data`), an op is nondeterministic, or a custom op draws random
numbers without declaring it. Each would silently corrupt gradients.
"""

from __future__ import annotations

import torch

from .._core.errors import RecomputeMismatchError
from .._core.torch_internals import unwrap_transforms


def check_recomputed(recomputed: torch.Tensor, original: torch.Tensor, where: str) -> torch.Tensor:
    """Return `recomputed`, raising if it differs from `original` (the forward's value)."""
    a, b = unwrap_transforms(recomputed), unwrap_transforms(original)
    if a.shape != b.shape:  # batched differently under vmap: nothing to compare plainly
        return recomputed
    try:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, equal_nan=True)
    except AssertionError as error:
        detail = str(error).strip().splitlines()
        raise RecomputeMismatchError(
            f"remat debug: recomputing {where} in backward gave a different value than forward "
            f"({'; '.join(line.strip() for line in detail[1:4] if line.strip())}). Gradients would be "
            "wrong. Causes: an input changed between forward and backward, a nondeterministic op, "
            "or a custom op that draws random numbers. Keep this value with the policy "
            "(e.g. save_ops) or make the op deterministic."
        ) from None
    return recomputed
