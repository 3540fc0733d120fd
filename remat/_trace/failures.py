"""Failures while tracing, turned into errors that name the op, the user's line and the fix.

remat traces a function once on tensors without data. torch then raises one of a few
internal errors, deep in its own frames; each is rewritten here to say which op, which
line of the user's code, why it cannot be traced and what to do instead.
"""

from __future__ import annotations

import os
import sys
import traceback
import types
from typing import Any, Sequence

import torch

from .._core.errors import RematError, RematTraceError
from .._core.nodes import source_line
from .._core.sources import is_machinery_file
from .._core.torch_internals import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
    is_custom_op_autograd,
)

_STATIC_HINT = (
    "remat traces the function once on tensors without data, so Python control flow on "
    "tensor values (`if x.sum() > 0`), `.item()`, `.tolist()` and `.numpy()` cannot run "
    "inside it. Make such values static with `remat(fn, static_argnums=...)` / "
    "`static_argnames=...` (pass them as Python numbers), use tensor ops such as "
    "`torch.where` instead of `if`, or move that code outside the remat'd function."
)


def user_frame(frames: Sequence[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame outside torch, optree and remat: the user's line."""
    for frame in reversed(frames):
        if not is_machinery_file(frame.filename):
            return frame
    return None


def user_line(boundary: types.CodeType) -> str | None:
    """`file:line` of the innermost calling frame outside torch, optree and remat, read off
    the live frames (no source lookup, unlike traceback.extract_stack: it runs per traced op);
    None if there is none below `boundary`, the frame that calls the traced function (an op
    of a torch module called as the function: the frames above belong to the trace)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not boundary:
        filename = frame.f_code.co_filename
        if not is_machinery_file(filename):
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


def describe_frame(frame: traceback.FrameSummary | None) -> str:
    if frame is None:
        return "an unknown line"
    return f"{os.path.basename(frame.filename)}:{frame.lineno} (`{(frame.line or '').strip()}`)"


class CustomFunctionUsed(Exception):
    """Raised while tracing when a value comes out of a custom torch.autograd.Function."""

    def __init__(self, function: type) -> None:
        super().__init__(function.__qualname__)
        self.function = function


def custom_function_behind(value: Any) -> type | None:
    """The custom torch.autograd.Function that produced tensor `value`, if any."""
    grad_fn = getattr(value, "grad_fn", None)
    if isinstance(grad_fn, torch.autograd.function.BackwardCFunction):
        function: type = grad_fn._forward_cls  # type: ignore[attr-defined]
        return None if is_custom_op_autograd(function) else function
    return None


def _data_dependence(error: BaseException) -> tuple[str, Any] | None:
    """("shape" or "value", op) when `error` (or what caused it) is torch saying that an op
    needs the data: an output whose shape depends on values, or a value read as a number."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, DynamicOutputShapeException):
            return "shape", current.func
        if isinstance(current, DataDependentOutputException):
            return "value", current.func
        current = current.__cause__ or current.__context__
    return None


def _op_name(op: Any) -> str:
    packet = getattr(op, "overloadpacket", None)
    return f"aten.{packet.__name__}" if packet is not None else str(op)


def data_dependence_advice(kind: str, op: Any) -> str:
    """Why `op` cannot be traced without data, and what to do."""
    if kind == "shape":
        return (
            f"`{_op_name(op)}` returns a tensor whose shape depends on the values of its inputs, "
            "and remat traces the function once without data. Call it outside the remat'd "
            "function and pass its result in, or use a fixed-shape form (e.g. "
            "`torch.where(mask, x, 0)` instead of `x[mask]` or `masked_select`)."
        )
    return (
        f"`{_op_name(op)}` reads tensor values as a Python value (a check such as `torch.equal`, "
        "`.item()`, or a size taken from data), and remat traces the function once without data. "
        "Call it outside the remat'd function and pass its result in, or pass the value as a "
        "static argument (`static_argnums`/`static_argnames`)."
    )


def trace_failure(fn_name: str, error: BaseException) -> BaseException:
    """The error to raise when running `fn_name` on data-free tensors raised `error`: a
    RematTraceError where tracing is what failed (a value read as a number, a shape that
    depends on values, a custom autograd.Function), else `error` itself, which the same
    call without remat raises too, with a note saying where remat met it."""
    where = describe_frame(user_frame(traceback.extract_tb(error.__traceback__)))
    if isinstance(error, CustomFunctionUsed) and error.function.__qualname__ == "BackwardHookFunction":
        return RematTraceError(
            f"remat could not trace `{fn_name}`: a module it calls has a full backward hook "
            "(`register_full_backward_hook` or `register_full_backward_pre_hook`), which runs in backward "
            "on the module's gradients; a region's backward is one traced graph, where that hook cannot run. "
            "Register the hook on a module outside the remat'd function (or on the region's own module "
            "when it is `remat(module)`'s wrapper), or use a tensor hook on the region's outputs."
        )
    if isinstance(error, CustomFunctionUsed):
        return RematTraceError(
            f"remat could not trace `{fn_name}`: it uses the custom torch.autograd.Function "
            f"`{error.function.__qualname__}` (its result is read at {where}), whose hand-written backward "
            "remat cannot trace. Register the operation with torch.library.custom_op and register_autograd "
            "(remat traces those, and policies can name them with save_ops), or apply remat to the code "
            "inside the Function instead."
        )
    dependence = _data_dependence(error)
    if dependence is not None:
        return RematTraceError(f"remat could not trace `{fn_name}` at {where}: {data_dependence_advice(*dependence)}")
    if "leaf Variable that requires grad is being used in an in-place operation" in str(error):
        return RematTraceError(
            f"remat could not trace `{fn_name}`: it mutates in place an input that requires grad, at {where}. "
            "Return the new value instead of mutating the input.",
            replayable=False,
        )
    if isinstance(error, RematError) or _is_tracing_limit(error):
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        hint = f"\n{_STATIC_HINT}" if _is_tracing_limit(error) or "data" in first_line else ""
        replayable = getattr(error, "replayable", True)
        return RematTraceError(f"remat could not trace `{fn_name}` at {where}: {first_line}{hint}", replayable=replayable)
    if hasattr(error, "add_note"):
        error.add_note(f"(raised while remat traced `{fn_name}`, at {where}; the same call without remat raises it too)")
    return error


def _is_tracing_limit(error: BaseException) -> bool:
    """Whether torch raised `error` because the tensors are fakes (no data, no kernel)."""
    fake_errors = (UnsupportedFakeTensorException, UnsupportedOperatorException)
    if isinstance(error, NotImplementedError) and str(error).startswith("argument of type"):
        return True  # the fx tracer cannot record such an argument (a Generator on torch 2.11)
    return isinstance(error, fake_errors) or any(
        text in str(error)
        for text in ("FakeTensor", "data pointer", "meta tensor", "Meta tensor", "data is not allocated")
    )


def backward_failure(fn_name: str, error: BaseException, blamed: Any, source: str | None) -> BaseException:
    """The error to raise when tracing the backward of `fn_name` raised `error` inside the
    derivative of op `blamed` (None if unknown), which ran at `source`."""
    culprit = f"the derivative of `{_op_name(blamed)}` (at {source or 'an unknown line'})" if blamed is not None else "its backward pass"
    dependence = _data_dependence(error)
    if dependence is None and not isinstance(error, RematError) and not _is_tracing_limit(error):
        if hasattr(error, "add_note"):  # the user's own code raised it (a custom op's backward)
            error.add_note(f"(raised while remat traced the backward of `{fn_name}`: {culprit}; remat traces backward when forward first runs)")
        return error  # type: ignore[return-value]
    if dependence is not None:
        kind, op = dependence
        return RematTraceError(
            f"remat could not differentiate `{fn_name}`: {culprit} runs `{_op_name(op)}`, which "
            f"{'returns a shape that depends on values' if kind == 'shape' else 'reads tensor values as a Python value'}, "
            "and remat traces the backward once without data. Call that op outside the remat'd "
            "function (its inputs and output then pass through as tensors)."
        )
    return RematTraceError(
        f"remat could not differentiate `{fn_name}`: {culprit} failed while traced without data: "
        f"{str(error).splitlines()[0] if str(error) else type(error).__name__}. Call that op outside the remat'd function."
    )


def refuse_opaque_objects(gm: torch.fx.GraphModule, fn_name: str) -> None:
    """Refuse (replayably) a graph whose ops take a torch.classes object, such as the
    process group `torch.distributed.all_reduce` passes to its op: a graph remat replays
    cannot hold one (torch fails comparing it while running the graph)."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        held = [getattr(gm, str(a.target), None) for a in node.all_input_nodes if a.op == "get_attr"]
        opaque = [value for value in held if _is_opaque(value)]
        if opaque:
            where = source_line(node) or "an unknown line"
            raise RematTraceError(
                f"remat could not trace `{fn_name}` at {where}: `{node.target}` takes a "
                f"{type(opaque[0]).__name__} (a process group or another torch.classes "
                "object), which a traced graph cannot hold. Functional collectives "
                "(torch.distributed._functional_collectives: all_reduce, all_gather_tensor, ...) trace, and "
                "their outputs are kept for backward."
            )


def _is_opaque(value: Any) -> bool:
    return isinstance(value, torch.ScriptObject) or type(value).__name__ == "FakeScriptObject"
