"""What is kept is exactly what backward needs and the policy allows, measured by storage."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from remat import policies as P
from remat import remat, saved_residuals, saved_tensor_bytes
from remat._core.torch_internals import torch_at_least

from conftest import POLICIES
from zoo import ZOO, example

pytestmark = pytest.mark.filterwarnings("ignore::remat.RematPolicyWarning")  # the shared name policies name values some functions lack


def _call(fn: Any, x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    return fn(x, p)


def _requiring_grad(x: torch.Tensor, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return x.clone().requires_grad_(), {k: v.clone().requires_grad_() for k, v in p.items()}


@pytest.mark.parametrize("fn_name", list(ZOO))
def test_everything_saveable_keeps_no_more_than_plain_autograd(fn_name: str) -> None:
    fn, x, p = example(fn_name)
    x, p = _requiring_grad(x, p)
    plain = saved_tensor_bytes(_call, fn, x, p)
    kept = saved_tensor_bytes(_call, remat(fn, policy=P.everything_saveable), x, p)
    assert kept == plain, (kept, plain)  # no more (the contract), no less (nothing recomputed)


@pytest.mark.parametrize("fn_name", list(ZOO))
def test_nothing_saveable_keeps_only_inputs(fn_name: str) -> None:
    fn, x, p = example(fn_name)
    x, p = _requiring_grad(x, p)
    wrapped = remat(fn, policy=P.nothing_saveable)
    report = saved_residuals(wrapped, x, p)
    assert report and all(r.kind == "input" for r in report)
    assert saved_tensor_bytes(_call, wrapped, x, p) == sum(r.nbytes for r in report)
    assert saved_tensor_bytes(_call, wrapped, x, p) < saved_tensor_bytes(_call, fn, x, p)


def _policy_by_function() -> list[Any]:
    """Every policy x every function; the default run keeps two functions per policy (each
    function with several policies), the rest are under the `product` sweep."""
    functions = list(ZOO)
    kept = {(p, functions[(i + k) % len(functions)]) for i, p in enumerate(POLICIES) for k in (0, 3)}
    return [
        pytest.param(p, f, id=f"{p}-{f}", marks=() if (p, f) in kept else pytest.mark.product)
        for p in POLICIES for f in functions
    ]


@pytest.mark.parametrize(("policy_name", "fn_name"), _policy_by_function())
def test_report_matches_measured_storages(policy_name: str, fn_name: str) -> None:
    """Each kept tensor is its own storage: no views of kept values, no two copies."""
    if fn_name == "sdpa_attention" and not torch_at_least("2.13"):
        pytest.skip("torch 2.11's meta function gives CPU SDPA's float64 logsumexp as float32: the report counts half its bytes")
    fn, x, p = example(fn_name)
    x, p = _requiring_grad(x, p)
    wrapped = remat(fn, policy=POLICIES[policy_name])
    storages: dict[int, int] = {}
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        wrapped(x, p)
    assert count == len(storages), "two kept tensors share a storage"
    assert sum(storages.values()) == sum(r.nbytes for r in saved_residuals(wrapped, x, p))


def block(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    return torch.addmm(b2, F.gelu(torch.addmm(b1, x, w1)), w2) + x


def _block_inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 16), (16, 32), (32,), (32, 16), (16,)]
    return [torch.randn(s, dtype=torch.float64, generator=gen).requires_grad_() for s in shapes]


def test_dots_saveable_keeps_only_the_first_addmm_on_a_residual_block() -> None:
    args = _block_inputs()
    report = saved_residuals(remat(block, policy=P.dots_saveable), *args)
    intermediates = [r for r in report if r.kind == "intermediate"]
    assert [(str(r.op), r.shape) for r in intermediates] == [("aten.addmm.default", (8, 32))]
    # the second addmm's output is not read by backward, so it is not kept even though allowed
    assert sorted(r.source for r in report if r.kind == "input") == ["w1", "w2", "x"]


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("use_remat", [False, True])
def test_gradients_only_for_inputs_that_need_them(use_remat: bool) -> None:
    x, w1, b1, w2, b2 = [t.detach() for t in _block_inputs()]
    x.requires_grad_()
    fn = remat(block, policy=P.everything_saveable) if use_remat else block
    out = fn(x, w1, b1, w2, b2).sum()
    with _CountMatmuls() as counter:
        out.backward()
    assert counter.count == 2  # one mm per layer for dx, none for the weights
    assert w1.grad is None and x.grad is not None


class _Outputs(TorchDispatchMode):
    """Weak references to the storage of every op output made while active."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref[torch.UntypedStorage]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append(weakref.ref(t.untyped_storage()))
        return out


@pytest.mark.parametrize("wrap", ["plain", "remat"])
def test_measuring_saved_bytes_leaves_nothing_alive(wrap: str) -> None:
    """saved_tensor_bytes runs `f` under saved-tensor hooks: what it measured must go when the
    caller drops the output. An op that saves its own output (exp) hands the hook a tensor
    whose grad_fn is the node saving it; holding that tensor closed a cycle through C++ that
    gc cannot free, and the whole graph (every activation) lived on for good."""
    x = torch.randn(1000, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).exp() * 3

    g = remat(f) if wrap == "remat" else f
    g(x)  # a first call traces
    with _Outputs() as outputs:
        assert saved_tensor_bytes(g, x) > 0
    gc.collect()
    alive = [s for s in (ref() for ref in outputs.made) if s is not None]
    assert outputs.made and all(s.data_ptr() == x.untyped_storage().data_ptr() for s in alive)  # x's own, no other
