"""Runs one generated program with and without remat and compares everything it observes.

tests/support/differential.py generates the programs; this file is copied verbatim into every
repro file it writes, so a repro runs exactly the comparison that failed. A program is a
`make_program(use_remat)` that returns its transforms (named calls), the Python state it
fills (hook records, side effects) and a function that undoes its global registrations.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

import remat

RTOL, ATOL = 1e-7, 1e-9  # float64 programs; an exact one (bfloat16, autocast) is compared bitwise
# A low-precision program where the README says remat is not bitwise (a backward run inside
# the autocast block, prod's derivative) is compared within bf16 rounding instead: EXACT is
# then the string "bf16" (its reason beside it in the program).
BF16_RTOL, BF16_ATOL = 2**-6, 1e-2

# Constructs remat refuses with a RematError naming what to do, each with what the refusal
# must say (README, "Python inside a region" and "Known limits"): a tensor hook inside a
# region; a tensor it computes stored in a list the caller sees; an in-place op on a strided
# view under vmap, whose functional form (as_strided_scatter) torch cannot batch; under a
# torch.func transform, a gradient of a gradient through a custom autograd.Function, an
# argument of one computed from random draws that only its backward reads, or one applied
# under autocast.
REFUSAL_ALLOWED = {
    "tensor_hook": ("would be dropped",),
    "append_tensor": ("stores a tensor it computes",),
    "inplace_view": ("under a torch.func transform, torch could not run an op of the graph",),
    "custom_function": (
        "a gradient of a gradient through the custom torch.autograd.Function",
        "that argument is computed from random draws: only the Function's backward reads it",
        "is applied under autocast, whose casts remat cannot replay inside a unit",
    ),
}
# Refusals the README names as limits, whatever the program's constructs: a double backward
# (`create_graph=True`) that needs an input the first-order backward did not keep, or a
# region's output, with a hook, that nothing holds any more.
DOCUMENTED_REFUSALS = (
    "this second-order gradient (a backward of a backward) needs",
    "carries a tensor hook (or retain_grad), and this backward builds a graph",
)
# Constructs whose Python state may differ once remat has said so with a RematStateWarning.
WARNING_ALLOWED = frozenset({"list_append", "append_tensor", "attr_set", "nonlocal_assign"})
# State that only those constructs write: what a warned program may get wrong.
SIDE_EFFECT_STATE = frozenset({"effects", "state"})
ACCEPTABLE = frozenset({"pass", "both_raise", "refused", "warned"})

Transforms = list[tuple[str, Callable[[], Any]]]
MakeProgram = Callable[[bool], tuple[Transforms, dict[str, Any], Callable[[], None]]]


class NotPlain:
    """Stands for a tensor that is not a plain torch.Tensor, such as a FakeTensor that a
    trace left in a hook's record: it equals no real tensor."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return f"<{self.kind}, not a plain torch.Tensor>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NotPlain) and other.kind == self.kind


def plain_tensor(t: torch.Tensor) -> torch.Tensor | NotPlain:
    """A detached copy of `t`'s value. Tensors that escaped a torch.func transform (a hook's
    argument under grad or vmap) are unwrapped level by level, a vmapped one with its batch
    dimension first; any level that is not a plain torch.Tensor makes it NotPlain."""
    functorch = torch._C._functorch
    bdims = []
    while True:
        if type(t) is not torch.Tensor:
            return NotPlain(type(t).__name__)
        if not functorch.is_functorch_wrapped_tensor(t):
            break
        if functorch.is_batchedtensor(t):
            bdims.append(functorch.maybe_get_bdim(t))
        t = functorch.get_unwrapped(t)
    value = t.detach().clone()
    return value.movedim(bdims[0], 0) if len(bdims) == 1 else value


def snapshot(value: Any) -> Any:
    """What `value` holds now, as plain data: containers copied, tensors copied by
    plain_tensor, namespaces as dicts, getters (a nonlocal's value) called."""
    if isinstance(value, torch.Tensor):
        return plain_tensor(value)
    if isinstance(value, (list, tuple)):
        return [snapshot(v) for v in value]
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, types.SimpleNamespace):
        return snapshot(vars(value))
    if callable(value):
        return snapshot(value())
    return value


class Run(NamedTuple):
    calls: list[dict[str, Any]]  # per call: its results and every observed record afterwards
    error: BaseException | None  # what stopped the run
    state_warnings: list[str]  # RematStateWarning messages


def run(make_program: MakeProgram, use_remat: bool) -> Run:
    """Each transform called twice (the second call reuses what the first traced), with
    the program's records and a draw from the global generator after every call."""
    calls: list[dict[str, Any]] = []
    error = None
    grad_mode = torch.is_grad_enabled()
    close: Callable[[], None] | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            transforms, observed, close = make_program(use_remat)
            for name, call in transforms:
                for i in (1, 2):
                    results = snapshot(call())
                    record = {"call": f"{name} #{i}", "results": results}
                    record.update({k: snapshot(v) for k, v in observed.items()})
                    record["random stream"] = torch.rand(4, dtype=torch.float64)
                    calls.append(record)
        except Exception as e:  # noqa: BLE001 - an exception is an outcome to compare
            error = e
        finally:
            if close is not None:
                close()
            torch.set_grad_enabled(grad_mode)
    state_warnings = [str(w.message) for w in caught if issubclass(w.category, remat.RematStateWarning)]
    return Run(calls, error, state_warnings)


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        text = f"tensor {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        if value.is_floating_point() and value.numel():
            text += f" (max |value| {value.abs().max().item():.4g})"
        return text
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}


def ulps(eager: torch.Tensor, rematted: torch.Tensor) -> int | None:
    """The largest distance in units in the last place between elements of two same-dtype
    tensors that are finite and of one sign, or None where there are none or no such dtype."""
    if eager.dtype not in BITS:
        return None
    both = eager.isfinite() & rematted.isfinite() & (eager.signbit() == rematted.signbit())
    if not bool(both.any()):
        return None
    bits = BITS[eager.dtype]
    far = (eager[both].view(bits).long() - rematted[both].view(bits).long()).abs()
    return int(far.max())


def difference(path: str, eager: Any, rematted: Any, exact: bool | str = False) -> str | None:
    """The first place where two snapshots differ, or None: tensors by dtype, shape and
    value (NaN where eager has NaN; equal if `exact`, else close), containers by length and
    then element by element."""
    if isinstance(eager, torch.Tensor) and isinstance(rematted, torch.Tensor):
        if eager.dtype != rematted.dtype or eager.shape != rematted.shape:
            return f"{path}: eager {describe(eager)}, remat {describe(rematted)}"
        if exact is True:  # torch.equal, but NaN where eager is NaN
            close = rematted == eager
            if eager.is_floating_point():
                close |= eager.isnan() & rematted.isnan()
        elif exact == "bf16":
            close = torch.isclose(rematted.double(), eager.double(), rtol=BF16_RTOL, atol=BF16_ATOL, equal_nan=True)
        else:
            close = torch.isclose(rematted, eager, rtol=RTOL, atol=ATOL, equal_nan=True)
        if bool(close.all()):
            return None
        bad = (~close).nonzero()[0].tolist()
        e, r = eager[tuple(bad)].item(), rematted[tuple(bad)].item()
        count = f"{int((~close).sum())} of {close.numel()} elements differ"
        text = f"{path}: {count}, first at {bad}: eager {e:.10g}, remat {r:.10g}"
        if exact is True:
            far = ulps(eager[~close], rematted[~close])
            dtype = str(eager.dtype).removeprefix("torch.")
            text += f" ({dtype}, bitwise{f'; at most {far} ulp apart' if far is not None else ''})"
        return text
    if isinstance(eager, torch.Tensor) or isinstance(rematted, torch.Tensor):
        return f"{path}: eager {describe(eager)}, remat {describe(rematted)}"
    if isinstance(eager, list) and isinstance(rematted, list):
        if len(eager) != len(rematted):
            return f"{path}: eager has {len(eager)} items, remat {len(rematted)}"
        for i, (e, r) in enumerate(zip(eager, rematted)):
            found = difference(f"{path}[{i}]", e, r, exact)
            if found:
                return found
        return None
    if isinstance(eager, dict) and isinstance(rematted, dict):
        if eager.keys() != rematted.keys():
            return f"{path}: eager keys {sorted(eager)}, remat {sorted(rematted)}"
        for k in eager:
            found = difference(f"{path}[{k!r}]", eager[k], rematted[k], exact)
            if found:
                return found
        return None
    if eager != rematted:
        return f"{path}: eager {describe(eager)}, remat {describe(rematted)}"
    return None


def first_difference(
    eager: Run, rematted: Run, skip: frozenset[str] = frozenset(), exact: bool | str = False
) -> str | None:
    """Call by call, every record but those in `skip`."""
    for e, r in zip(eager.calls, rematted.calls):
        for key in e:
            if key not in skip:
                found = difference(f"{e['call']}: {key}", e[key], r[key], exact)
                if found:
                    return found
    return None


def brief(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= 300 else text[:297] + "..."


def classify(eager: Run, rematted: Run, constructs: frozenset[str], exact: bool | str = False) -> tuple[str, str]:
    """The outcome ('pass', 'both_raise', 'refused', 'warned' or 'fail') and what decided it;
    tensors compared bitwise if `exact`."""
    if eager.error is not None:
        if rematted.error is not None:
            return "both_raise", f"eager: {brief(eager.error)}; remat: {brief(rematted.error)}"
        return "fail", f"eager raised {brief(eager.error)}; remat did not"
    if rematted.error is not None:
        if isinstance(rematted.error, remat.RematError):
            said = str(rematted.error)
            allowed = sorted(c for c in constructs & REFUSAL_ALLOWED.keys() if any(r in said for r in REFUSAL_ALLOWED[c]))
            allowed += [f"documented: {r}" for r in DOCUMENTED_REFUSALS if r in str(rematted.error)]
            if allowed:
                return "refused", f"refused ({', '.join(allowed)}): {brief(rematted.error)}"
            return "fail", f"refused, no construct allows it: {brief(rematted.error)}"
        return "fail", f"remat raised {brief(rematted.error)}"
    if rematted.state_warnings:
        if not constructs & WARNING_ALLOWED:
            return "fail", f"RematStateWarning for a program without side effects: {rematted.state_warnings[0][:200]}"
        found = first_difference(eager, rematted, skip=SIDE_EFFECT_STATE, exact=exact)
        return ("fail", found) if found else ("warned", rematted.state_warnings[0][:200])
    found = first_difference(eager, rematted, exact=exact)
    return ("fail", found) if found else ("pass", "")


def check(make_program: MakeProgram, constructs: frozenset[str], exact: bool | str = False) -> tuple[str, str]:
    """Runs the program without remat (the oracle), then with remat, and classifies. An
    `exact` program (bfloat16, autocast) is compared bitwise: remat runs the aten ops eager
    code runs, in the same dtypes and order, so rounding cannot part them; in float64 the
    tolerance is what leaves room for a sum that a graph orders otherwise."""
    eager = run(make_program, use_remat=False)
    rematted = run(make_program, use_remat=True)
    return classify(eager, rematted, constructs, exact)
