"""Randomness: recompute draws exactly what the forward drew.

A random op that backward recomputes is replayed from the generator state captured just
before it ran in forward: a few bytes (16 on CUDA, 5056 for the CPU Mersenne twister)
instead of its output. Replay restores the generator afterwards, so the global random
stream after a call is where it would be without remat.
"""

from __future__ import annotations

from typing import Any

import torch

from ._torch_internals import unwrap_transforms

RNG_KEY = "remat_rng"


def _generator(device: torch.device, generator: torch.Generator | None) -> torch.Generator:
    if generator is not None:
        return generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    if device.type == "cpu":
        return torch.default_generator
    raise NotImplementedError(f"remat cannot replay random ops on {device.type} yet; keep them with the policy")


def capture_rng_state(device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """The generator state a random op on `device` is about to use."""
    return _generator(device, generator).get_state()


def replay_random(state: torch.Tensor, rng_device: torch.device, op: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Run random `op` from `state`, leaving the generator as it was."""
    gen = _generator(rng_device, kwargs.get("generator"))
    current = gen.get_state()
    gen.set_state(unwrap_transforms(state))  # under vmap the saved state arrives wrapped
    try:
        return op(*args, **kwargs)
    finally:
        gen.set_state(current)


def state_shape(device: torch.device) -> tuple[int, ...]:
    if device.type == "cuda" and not torch.cuda.is_available():
        return (16,)
    return tuple(_generator(device, None).get_state().shape)


def global_generator_states() -> list[torch.Tensor]:
    """The states of the default generators (CPU, and CUDA devices once initialised)."""
    states = [torch.default_generator.get_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += [g.get_state() for g in torch.cuda.default_generators]
    return states


def restore_global_generator_states(states: list[torch.Tensor]) -> None:
    torch.default_generator.set_state(states[0])
    for generator, state in zip(torch.cuda.default_generators if len(states) > 1 else (), states[1:]):
        generator.set_state(state)
