"""The cache hit's fast paths agree with the general ones they stand in for.

A fast path that built a different key than the general path would mean a wrong cache
hit (a plan traced for other inputs: silently wrong gradients) or needless retraces. So
the common call's split (all positional arguments plain strided tensors) is compared,
field by field, with the general optree split over many kinds of calls. No timing here.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

import pytest
import torch

import remat
from remat._trace.arguments import (
    Call,
    CaptureMemo,
    _collect_consistently,
    _split_flattened,
    _split_tensor_args,
    collect_captured,
    positional_names,
    split_call,
)

SCALE = torch.tensor(2.0, requires_grad=True)
OFFSET = 3


def two(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


def reads_globals(x: torch.Tensor) -> torch.Tensor:
    return x * SCALE + OFFSET


def variadic(*xs: torch.Tensor) -> torch.Tensor:
    return sum(xs)  # type: ignore[return-value]


def make_closure(weight: torch.Tensor, power: int) -> Callable[..., torch.Tensor]:
    def closure(x: torch.Tensor) -> torch.Tensor:
        return (x @ weight) ** power

    return closure


def _fields(call: Call) -> dict[str, Any]:
    """Every field of a Call, sequences as lists (the fast path shares tuples)."""
    out = {}
    for f in dataclasses.fields(call):
        value = getattr(call, f.name)
        if f.name == "captured_setters":
            value = [s is None for s in value]  # fresh closures per call: compare where there is one
        elif isinstance(value, (list, tuple)) and f.name != "key":
            value = list(value)
        out[f.name] = value
    return out


def _assert_same_split(fn: Callable[..., Any], *args: Any) -> Call:
    names = positional_names(fn)
    fast = _split_tensor_args(fn, names, args)
    slow = _split_flattened(fn, names, args, {}, frozenset(), frozenset())
    assert fast is not None
    fast_fields, slow_fields = _fields(fast), _fields(slow)
    tensors_fast = [id(t) for t in fast_fields.pop("tensors") + fast_fields.pop("static_leaves")]
    tensors_slow = [id(t) for t in slow_fields.pop("tensors") + slow_fields.pop("static_leaves")]
    assert tensors_fast == tensors_slow
    assert [id(t) for t in fast_fields.pop("captured")] == [id(t) for t in slow_fields.pop("captured")]
    assert fast_fields == slow_fields
    assert hash(fast.key) == hash(slow.key)
    assert fast.storage_offsets() == slow.storage_offsets()
    assert fast.key_labels() == slow.key_labels()
    return fast


def _tensors() -> list[torch.Tensor]:
    base = torch.randn(6, 6)
    return [
        torch.randn(4, 4),
        torch.randn(4, 4, requires_grad=True),
        torch.randn(4, 4, dtype=torch.float64, requires_grad=True),
        torch.randn(4, 4, dtype=torch.complex64, requires_grad=True),
        torch.ones(4, 4, dtype=torch.int64),
        torch.ones(4, 4, dtype=torch.bool),
        torch.randn(4, 4).t(),  # transposed strides
        torch.randn(1, 4).expand(4, 4),  # zero strides
        base[1:5, 2:6],  # a view at a storage offset
        torch.nn.Parameter(torch.randn(4, 4)),
        torch.randn(()),  # 0-d
        torch.randn(0, 4),  # empty
        torch.randn(4, 4, device="meta"),
        torch.randn(2, 3, 4).permute(2, 0, 1),
    ]


@pytest.mark.parametrize("i", range(14))
@pytest.mark.parametrize("j", [0, 1, 6, 9])
def test_fast_and_general_split_agree_on_tensor_kinds(i: int, j: int) -> None:
    tensors = _tensors()
    _assert_same_split(two, tensors[i], tensors[j])


def test_fast_and_general_split_agree_on_closures_globals_and_arity() -> None:
    x = torch.randn(3, 3, requires_grad=True)
    _assert_same_split(reads_globals, x)
    _assert_same_split(make_closure(torch.randn(3, 3, requires_grad=True), 2), x)
    _assert_same_split(torch.nn.Linear(3, 3), x)
    for n in (0, 1, 2, 5):
        _assert_same_split(variadic, *[torch.randn(2) for _ in range(n)])
    _assert_same_split(two, *[torch.randn(2, 2) for _ in range(3)])  # more than its names: args[2]


def test_fast_and_general_split_agree_under_modes_and_transforms() -> None:
    x = torch.randn(3, 3, requires_grad=True)
    w = torch.randn(3, 3)
    with torch.no_grad():
        _assert_same_split(two, x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same_split(two, x, w)
    keys, labels = [], []

    def under(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        call = _assert_same_split(two, x, w)
        keys.append(call.key)
        labels[:] = call.key_labels()
        return (x * w).sum()

    torch.func.grad(under)(x.detach(), w)  # x wrapped at a grad level: needs grad there only
    torch.func.grad(torch.func.grad(lambda x: under(x, w)))(torch.tensor(1.5))
    torch.func.vmap(lambda x: under(x, w[0]))(torch.randn(2, 3))
    transforms, nested = labels.index("torch.func transforms"), labels.index("nested gradients")
    assert len(keys) == 3 and all(k[transforms] for k in keys)  # transforms were active
    assert keys[0][1][-1] is True  # the wrapped x needs grad at its level
    assert keys[1][nested] is True


def test_fast_and_general_split_agree_on_one_tensor_passed_as_several_arguments() -> None:
    x, w = torch.randn(3, 3, requires_grad=True), torch.randn(3, 3)
    assert _assert_same_split(two, x, x).aliases == (0, 0)
    assert _assert_same_split(variadic, x, w, x, w).aliases == (0, 1, 0, 1)
    assert _assert_same_split(two, x, w).aliases is None
    assert _assert_same_split(two, x, x).key != _assert_same_split(two, x, x.clone()).key


def test_fast_path_declines_what_it_does_not_cover() -> None:
    names = positional_names(two)
    x = torch.randn(2, 2)

    class Sub(torch.Tensor):
        pass

    for args in [(x, 3), (x, None), (x, (x, x)), (x, x.to_sparse()), (x, x.as_subclass(Sub))]:
        assert _split_tensor_args(two, names, args) is None


def test_split_call_takes_the_general_path_for_static_and_keyword_arguments() -> None:
    x = torch.randn(2, 2)
    names = positional_names(two)
    by_keyword = split_call(two, names, (x,), {"w": x}, frozenset(), frozenset())
    assert by_keyword.leaf_paths == ["x", "w"]
    static = split_call(two, names, (x, x), {}, frozenset([1]), frozenset())
    assert len(static.tensors) == 1


def test_unstrided_tensors_are_still_refused() -> None:
    f = remat.remat(two, fallback=False)
    x = torch.randn(2, 2, requires_grad=True)
    with pytest.raises(remat.RematError, match="sparse"):
        f(x, x.detach().to_sparse())


def test_results_match_plain_autograd_across_layouts_on_cache_hits() -> None:
    """Inputs that differ only in strides or storage offset get their own plans, and every
    cache hit gives plain autograd's gradients."""
    f = remat.remat(two, policy=remat.policies.dots_saveable)
    base = torch.randn(6, 6)
    for _ in range(2):  # the second round hits the cache
        for x in (torch.randn(4, 4), torch.randn(4, 4).t(), base[1:5, 2:6], torch.randn(1, 4).expand(4, 4)):
            x = x.detach().requires_grad_()
            w = torch.randn(4, 4, requires_grad=True)
            out = f(x, w)
            expected = two(x, w)
            torch.testing.assert_close(out, expected)
            grads = torch.autograd.grad(out.sum(), (x, w))
            torch.testing.assert_close(grads, torch.autograd.grad(expected.sum(), (x, w)))
    assert f.cache_info()["hits"] >= 4


# The capture memo: a plain function whose reachable objects are the same objects as on
# the call before is not walked again. The walk itself (collect_captured) is the oracle.
LAYERS = [torch.randn(3, 3, dtype=torch.float64, requires_grad=True)]
WEIGHT = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
POWER = 2


def _reads_list_global_and_number(x: torch.Tensor) -> torch.Tensor:
    return ((x @ LAYERS[0]) @ WEIGHT).sum() ** POWER


def _reads_global_and_number(x: torch.Tensor) -> torch.Tensor:
    return (x @ WEIGHT).sum() ** POWER


def _collected(found: Any) -> tuple[Any, ...]:
    tensors, paths, setters, flags = found
    return [id(t) for t in tensors], list(paths), [s is None for s in setters], flags


def test_the_capture_memo_sees_every_change_the_walk_sees() -> None:
    global WEIGHT, POWER
    memo = CaptureMemo()
    inner_weight = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)

    def inner(x: torch.Tensor) -> torch.Tensor:
        return x @ inner_weight

    def outer(x: torch.Tensor) -> torch.Tensor:  # its closure holds a function of the user's: walked into
        return inner(x).sum()

    def check(fn: Callable[..., Any]) -> None:
        assert _collected(_collect_consistently(fn, memo)) == _collected(collect_captured(fn))

    saved = LAYERS[0], WEIGHT, POWER
    try:
        for fn in (_reads_global_and_number, _reads_list_global_and_number, outer):
            memo = CaptureMemo()
            check(fn)
            check(fn)  # unchanged: served by the memo where it may be
            LAYERS[0] = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)  # inside a list
            check(fn)
            WEIGHT = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)  # a rebound global
            check(fn)
            POWER = 3  # a number read from the globals
            check(fn)
            inner_weight = torch.randn(3, 3, dtype=torch.float64)  # noqa: F841 - read by inner's cell
            check(fn)
            assert (memo.last is not None) == (fn is _reads_global_and_number)  # the others are walked into
    finally:
        LAYERS[0], WEIGHT, POWER = saved


def test_memoized_captures_give_plain_autograd_gradients_after_changes() -> None:
    """The memo serves the same tensors; their signatures are still read on every call, so
    a captured tensor whose requires_grad changed in place gets its own plan."""
    global WEIGHT
    saved = WEIGHT

    def reads_weight(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ WEIGHT).sum()

    try:
        f = remat.remat(reads_weight)
        x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
        for change in (None, "rebind", "no grad", "grad again"):
            if change == "rebind":
                WEIGHT = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
            elif change == "no grad":
                WEIGHT.requires_grad_(False)
            elif change == "grad again":
                WEIGHT.requires_grad_(True)
            inputs = (x, WEIGHT) if WEIGHT.requires_grad else (x,)
            actual = torch.autograd.grad(f(x), inputs)
            expected = torch.autograd.grad(reads_weight(x), inputs)
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)
        assert f._captures.last is not None  # the memo was in use
    finally:
        WEIGHT = saved


class _Mode(enum.IntEnum):
    DOUBLE = 2
    TRIPLE = 3


class _Settings:
    """Like transformers' configs: attribute reads go through a custom __getattribute__."""

    def __getattribute__(self, name: str) -> Any:
        return object.__getattribute__(self, name)


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.mode = _Mode.DOUBLE  # a plain setting of a subclass of int
        self.config = _Settings()  # not a setting

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weight * int(self.mode)).sum()


def test_a_module_setting_of_a_subclass_of_a_plain_type_is_in_the_key() -> None:
    module = _Scaled()
    f = remat.remat(module)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    for mode in (_Mode.DOUBLE, _Mode.TRIPLE, _Mode.DOUBLE):
        module.mode = mode
        torch.testing.assert_close(torch.autograd.grad(f(x), x), torch.autograd.grad(module(x), x), rtol=0, atol=0)
    assert f.cache_info()["traces"] == 2


def test_direct_code_runs_a_graph_as_fx_code_does() -> None:
    """The code cache hits run (each aten op through its C++ entry point), as remat writes
    it and as fx writes it, against fx's own module for the same graph: overloads, keyword
    and list arguments, a float constant, a multi-output op and its items; a graph's first
    run, node by node, hands every placeholder and call to the check in graph order; a
    graph remat does not write (a constant attribute) runs through fx's code."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from remat._running.graph_code import _fx_direct_code, _source, direct_code, run_checked_nodes

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.cat([x @ w, x.t()], dim=0).to(torch.float64)
        values, indices = torch.max(y, dim=1)
        return y.sum(dim=[0], keepdim=True), torch.add(y, 1, alpha=2), values, indices, y * 0.5

    x, w = torch.randn(3, 3), torch.randn(3, 3)
    gm = make_fx(f)(x, w)
    written, by_fx = direct_code(gm), _fx_direct_code(gm)
    assert "ops" not in written.__code__.co_names and "ops" not in by_fx.func.__code__.co_names  # type: ignore[attr-defined]
    for actual_written, actual_fx, expected in zip(written(x, w), by_fx(x, w), gm(x, w), strict=True):
        torch.testing.assert_close(actual_written, expected, rtol=0, atol=0)
        torch.testing.assert_close(actual_fx, expected, rtol=0, atol=0)
    seen: list[torch.fx.Node] = []
    ran, outputs = run_checked_nodes(gm, lambda node, value: seen.append(node) or value, (x, w))
    assert ran
    for actual, expected in zip(outputs, gm(x, w), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert seen == [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function")]
    with_attribute = torch.fx.symbolic_trace(torch.nn.Linear(3, 3))  # get_attr nodes: fx's code
    assert _source(with_attribute.graph) is None
    assert run_checked_nodes(with_attribute, lambda n, v: v, (x,)) == (False, None)
    torch.testing.assert_close(direct_code(with_attribute)(x), with_attribute(x), rtol=0, atol=0)
