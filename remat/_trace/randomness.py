"""Randomness: recompute draws exactly what the forward drew.

A random op that backward recomputes is replayed from the generator state captured just
before it ran in forward: a few bytes (16 on CUDA, 5056 for the CPU Mersenne twister)
instead of its output. Replay restores the generator afterwards, so the global random
stream after a call is where it would be without remat.
"""

from __future__ import annotations

import operator
import random
import secrets
import sys
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx

from .._core.errors import RematTraceError
from .._core.nodes import RNG_STREAM_KEY, is_random
from .._core.torch_internals import below_a_vmap_refusing_randomness, dispatch_modes_off, unwrap_transforms

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
        with below_a_vmap_refusing_randomness(args):  # jacrev's vmap of the backward
            return op(*args, **kwargs)
    finally:
        gen.set_state(current)


def state_shape(device: torch.device) -> tuple[int, ...]:
    if device.type == "cuda" and not torch.cuda.is_available():
        return (16,)
    return tuple(_generator(device, None).get_state().shape)


PythonRandomStates = tuple[Any, Any]


def python_random_states() -> PythonRandomStates:
    """The states of Python's `random` module and of numpy's global generator (when numpy
    is imported): draws from them (`random.random() < p` deciding to skip a layer,
    `np.random.uniform`) are Python a graph cannot hold."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), numpy.random.get_state() if numpy is not None else None


def set_python_random_states(states: PythonRandomStates) -> None:
    random.setstate(states[0])
    numpy = sys.modules.get("numpy")
    if numpy is not None and states[1] is not None:
        numpy.random.set_state(states[1])


def python_random_drawn(before: PythonRandomStates) -> bool:
    """Whether Python's or numpy's global generator drew since `before` was read."""
    now = python_random_states()
    if now[0] != before[0]:
        return True
    if now[1] is None or before[1] is None:
        return now[1] is not before[1]
    (kind, keys, position, *gauss), (kind_then, keys_then, position_then, *gauss_then) = now[1], before[1]
    return (kind, position, gauss) != (kind_then, position_then, gauss_then) or bool((keys != keys_then).any())


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


# --- the function's own reseeding ------------------------------------------------------
#
# A random op traced on fake tensors draws nothing, so the generators' states say, while a
# function is traced, only what its Python did to them: `torch.manual_seed`, `set_rng_state`,
# `fork_rng` and `freeze_rng_state` restoring a saved state. To read that, the trace starts
# each generator at a fresh marker state and moves it to another marker after each random
# op; the state a random op then finds says which stream it draws from: the caller's
# (continuing from the region's start or from an earlier draw, as restored by fork_rng) or
# one the function seeded. The forward graph replays exactly that (`stream_steps`).

Source = tuple[Any, ...]  # ("start",) | ("after", draw) | ("seeded", state)


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


def _tracked_generators() -> dict[str, torch.Generator]:
    generators = {"cpu": torch.default_generator}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        generators.update({f"cuda:{i}": g for i, g in enumerate(torch.cuda.default_generators)})
    return generators


def _fresh_state(key: str, state: torch.Tensor) -> bool:
    """Whether `state` is one a seed gives (`manual_seed(s)`), not a stream's later state."""
    if key.startswith("cuda"):
        return bool(state.view(torch.int64)[1] == 0)  # (seed, offset)
    probe = torch.Generator().set_state(state)
    return torch.equal(torch.Generator().manual_seed(probe.initial_seed()).get_state(), state)


class SetStateRead(RematTraceError):
    """The function set a generator to a state that no seed gives: a graph would replay
    the state it saw when traced."""

    def __init__(self, device: str) -> None:
        super().__init__(
            f"it puts the {device} random generator at a state that no seed gives (`torch.set_rng_state(state)` "
            "with a state saved outside the function, or a draw on a real tensor) while traced. remat replays what "
            "the function does to the generators as it saw it when tracing, so every call would get that one "
            "state. Seed inside the function (`torch.manual_seed(n)`), or set the state before calling it"
        )


class DrawTracker:
    """While a function is traced: the stream each of its random ops draws from."""

    def __init__(self) -> None:
        self.generators = _tracked_generators()
        self.saved = {key: g.get_state() for key, g in self.generators.items()}
        self.start()

    def start(self) -> None:
        """(Again, when a trace restarts:) every generator at a marker for the region's start."""
        self.markers: dict[str, list[tuple[torch.Tensor, Source]]] = {key: [] for key in self.generators}
        self.draws = 0
        for key in self.generators:
            self._mark(key, ("start",))

    def _mark(self, key: str, meaning: Source) -> None:
        generator = self.generators[key]
        generator.manual_seed(secrets.randbits(62) | 1 << 62)  # a seed no program picks
        self.markers[key].append((generator.get_state(), meaning))

    def _source(self, key: str) -> Source:
        state = self.generators[key].get_state()
        for marker, meaning in reversed(self.markers[key]):
            if torch.equal(marker, state):
                return meaning
        if not _fresh_state(key, state):
            raise SetStateRead(key)
        return ("seeded", state)

    def drew(self, device: torch.device) -> tuple[int, str, Source] | None:
        """A random op on `device` was traced: (its draw number, its generator, the stream it
        draws from); None for a device without a tracked generator. (Called as the trace
        records the op: the states are compared with the trace's modes off.)"""
        key = _device_key(device)
        if key not in self.generators:
            return None
        with dispatch_modes_off():
            source = self._source(key)
            draw = self.draws
            self.draws += 1
            self._mark(key, ("after", draw))
        return draw, key, source

    def end(self) -> dict[str, Source]:
        """Where each generator's stream stands when the function returns."""
        return {key: self._source(key) for key in self.generators}

    def restore(self) -> None:
        for key, generator in self.generators.items():
            generator.set_state(self.saved[key])


def generator_state(key: str) -> torch.Tensor:
    """A forward graph's step: the state of a default generator now."""
    return _generator(torch.device(key), None).get_state()


def set_generator_state(key: str, state: torch.Tensor) -> None:
    """A forward graph's step: put a default generator at `state`."""
    _generator(torch.device(key), None).set_state(unwrap_transforms(state))


@dataclass(frozen=True)
class StreamSteps:
    """What a forward graph does to replay the function's reseeding: before some draws,
    and when it ends, it puts a generator at a seeded state or at one it read earlier
    (at the start, or right after a draw)."""

    before: dict[int, tuple[str, Source]]  # draw -> (generator, the stream it draws from)
    at_end: dict[str, Source]
    read_after: frozenset[int | None]  # draws after which (None: at the start) a state is read


def stream_steps(draws: list[tuple[int, str, Source]], end: dict[str, Source]) -> StreamSteps | None:
    """The steps that make `draws` (in graph order) and the state at the end what the
    traced function's Python made them; None when every draw continues the stream."""
    last: dict[str, int | None] = {}
    before: dict[int, tuple[str, Source]] = {}
    for draw, key, source in draws:
        if source != _continuing(last.get(key)):
            before[draw] = (key, source)
        last[key] = draw
    at_end = {key: source for key, source in end.items() if source != _continuing(last.get(key))}
    if not before and not at_end:
        return None
    reads = [*(source for _, source in before.values()), *at_end.values()]
    read_after = frozenset(None if s[0] == "start" else s[1] for s in reads if s[0] != "seeded")
    return StreamSteps(before, at_end, read_after)


def recorded_draws(nodes: Iterable[torch.fx.Node]) -> dict[int, tuple[torch.fx.Node, str, Source]]:
    """The random ops among `nodes` by draw number (the first node of each, in order), with
    the generator and the stream each draws from, as the trace recorded them."""
    draws: dict[int, tuple[torch.fx.Node, str, Source]] = {}
    for node in nodes:
        drawn = node.meta.get("custom", {}).get(RNG_STREAM_KEY)
        if drawn is not None and node.op == "call_function" and node.target is not operator.getitem and is_random(node):
            draws.setdefault(drawn[0], (node, drawn[1], drawn[2]))
    return draws


def steps_of(nodes: Iterable[torch.fx.Node], end: dict[str, Source]) -> StreamSteps | None:
    """`stream_steps` of the random ops among `nodes`."""
    return stream_steps([(draw, key, source) for draw, (_, key, source) in sorted(recorded_draws(nodes).items())], end)


def _continuing(last_draw: int | None) -> Source:
    return ("start",) if last_draw is None else ("after", last_draw)
