"""A region remat cannot trace runs as torch.utils.checkpoint runs it (its Python again in
backward): the oracle is the same function without remat, bitwise (the same ops run, in
the same order), under every built-in policy, with the random stream and in-place state
(BatchNorm statistics, counters) as without remat, the policy asked op by op, a warning
once per region, and an error under torch.func transforms or with fallback=False."""

from __future__ import annotations

import types
import warnings
from typing import Any, Callable

import optree
import pytest
import torch
import torch.nn.utils.prune
from support.kept_memory import bytes_kept_for_backward
from torch.utils._python_dispatch import TorchDispatchMode

from remat import (
    RematFallbackWarning,
    RematStateWarning,
    RematTraceError,
    checkpoint_name,
    compare,
    remat,
    report,
    saved_tensor_bytes,
)
from remat import policies as P

from conftest import BUILT_IN_POLICIES, pairwise_in_default

POLICIES = {**BUILT_IN_POLICIES, "names": P.save_only_these_names("h"), "offload": P.offload_dot_with_no_batch_dims()}


class _Straight(torch.autograd.Function):
    """A straight-through estimator: saves nothing, its backward passes the gradient on."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.round()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class _Attention(torch.autograd.Function):
    """Flash-attention-shaped: saves its inputs, its output and a logsumexp; the backward is
    its own formula; a second output (the logsumexp) is marked non-differentiable."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = q @ k.transpose(-1, -2)
        lse = scores.logsumexp(-1, keepdim=True)
        out = (scores - lse).exp() @ v
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, out, lse = ctx.saved_tensors
        p = (q @ k.transpose(-1, -2) - lse).exp()
        dv = p.transpose(-1, -2) @ g
        dp = g @ v.transpose(-1, -2)
        ds = p * (dp - (g * out).sum(-1, keepdim=True))
        return ds @ k, ds.transpose(-1, -2) @ q, dv


def _data_dependent(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = checkpoint_name(torch.sin(x @ w), "h")
    return (h[h > 0] ** 2).sum() + h.sum()


def _reads_a_number(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = checkpoint_name(torch.sin(x @ w), "h")
    return (h * h.sum().item()).sum()


def _custom_functions(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = checkpoint_name(torch.sin(x @ w), "h")
    out, lse = _Attention.apply(h, x, x.cos())
    return (_Straight.apply(out * 3) * out).sum() + lse.sum().detach()


def _tensor_hook(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = checkpoint_name(torch.sin(x @ w), "h")
    h.register_hook(lambda g: g * 2)
    return (h.relu() @ w).sum()


def _in_place_after_a_kept_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dots_saveable keeps `x @ w`, which the region then changes in place (relu_ as in
    torchvision's inplace ReLUs); nonzero makes it untraceable."""
    h = x @ w
    h.relu_()
    h = h * 2
    h.add_(1)
    return (h[h > 1.5].sum() + (h @ w).sum()) * x.shape[0]


def _random_draws(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A draw whose output a policy may keep (bernoulli, named) before one it recomputes
    (an in-place fill): were the first kept, the recompute's fill would draw its numbers."""
    h = (x @ w).t().reshape(x.shape)
    h.register_hook(lambda g: g * 2)
    mask = checkpoint_name(torch.bernoulli(torch.full_like(h, 0.6)), "h")
    return (h * torch.empty_like(h).uniform_() - h).sum() + (w * mask[:4]).sum()


def _a_kept_view(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A name on a view's output: the view op's output is what a policy keeps, handed out
    to each recompute as a view of what that recompute's view op was given."""
    h = checkpoint_name(x.t(), "h")
    v = torch.exp(x @ w)
    v.register_hook(lambda g: g * 2)
    return (torch.tanh(h) * v.t()).sum()


_GENERATOR = torch.Generator()  # reseeded before each run


def _a_generator_given(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Draws from a generator of the user's (`generator=`), which the recompute draws from
    again, out of place and in place."""
    h = checkpoint_name(torch.sin(x @ w), "h")
    h.register_hook(lambda g: g * 2)
    noise = torch.rand(h.shape, dtype=h.dtype, generator=_GENERATOR)
    return (h * noise * torch.empty_like(h).uniform_(generator=_GENERATOR)).sum()


FUNCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "data-dependent shape": _data_dependent,
    ".item()": _reads_a_number,
    "custom autograd.Functions": _custom_functions,
    "tensor hook inside": _tensor_hook,
    "in place after a kept matmul": _in_place_after_a_kept_matmul,
    "random draws": _random_draws,
    "a generator given": _a_generator_given,
}


def _grads(f: Callable[..., torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The output and gradients, and the random streams after them (the default's and the user's generator's)."""
    torch.manual_seed(0)
    _GENERATOR.manual_seed(0)
    x = torch.randn(6, 4, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 4, dtype=dtype, requires_grad=True)
    out = f(x, w)
    out.backward()
    streams = torch.rand(2, dtype=dtype), torch.rand(2, dtype=dtype, generator=_GENERATOR)
    return (out.detach(), x.grad, w.grad, *streams)  # type: ignore[return-value]


def _assert_bitwise(actual: Any, expected: Any) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and torch.equal(a, e), (a, e)


_DTYPES = {"float64": torch.float64, "float32": torch.float32}


@pytest.mark.parametrize(
    ("name", "policy_name", "dtype_name"), pairwise_in_default(list(FUNCTIONS), list(POLICIES), list(_DTYPES))
)
def test_an_untraceable_region_is_bitwise_as_without_remat(name: str, policy_name: str, dtype_name: str) -> None:
    f, dtype = FUNCTIONS[name], _DTYPES[dtype_name]
    region = remat(f, policy=POLICIES[policy_name])
    expected = _grads(f, dtype)
    with pytest.warns(RematFallbackWarning, match=r"(?s)could not be traced.*Why: .*fallback=False"):
        _assert_bitwise(_grads(region, dtype), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per region: the second call says nothing, nor traces
        _assert_bitwise(_grads(region, dtype), expected)
    assert region.cache_info()["traces"] == 1 and region.cache_info()["replays"] == 2


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_under_a_transform_or_with_fallback_off_an_untraceable_region_raises(name: str) -> None:
    f = FUNCTIONS[name]
    x, w = torch.randn(6, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(RematTraceError):
        torch.func.grad(remat(f), argnums=1)(x, w)
    with pytest.raises(RematTraceError):
        remat(f, fallback=False)(x, w.requires_grad_())


def _second_order(f: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
    """Two gradients of one output with create_graph (two recomputes of the region), then a
    backward through both: every value and the random streams after them."""
    torch.manual_seed(0)
    _GENERATOR.manual_seed(0)
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    out = f(x, w)
    first = torch.autograd.grad(out, (x, w), create_graph=True)
    again = torch.autograd.grad(out, (x, w), create_graph=True)
    sum((g * g.detach().cos()).sum() for g in (*first, *again)).backward()  # type: ignore[union-attr]
    streams = torch.rand(2, dtype=torch.float64), torch.rand(2, dtype=torch.float64, generator=_GENERATOR)
    return [out.detach(), *(g.detach() for g in (*first, *again)), x.grad, w.grad, *streams]  # type: ignore[list-item]


def _cover(every: int) -> list[Any]:
    """(function, policy) cases: every function and every policy in the default run (one
    case in `every` along each diagonal), the whole product under `product`."""
    return [
        pytest.param(
            name, policy_name, id=f"{name}-{policy_name}", marks=() if (i + j) % every == 0 else pytest.mark.product
        )
        for i, name in enumerate(FUNCTIONS)
        for j, policy_name in enumerate(POLICIES)
    ]


@pytest.mark.parametrize("name, policy_name", [*_cover(3), ("a kept view", "everything"), ("a kept view", "names")])
def test_every_recompute_of_a_replayed_region_for_gradients_of_gradients_is_as_without_remat(
    name: str, policy_name: str
) -> None:
    """A kept value serves each recompute (two here, and a backward through both), each
    given its own alias, so that a kept view's output becomes a view in each."""
    f = {**FUNCTIONS, "a kept view": _a_kept_view}[name]
    expected = _second_order(f)
    with pytest.warns(RematFallbackWarning):
        actual = _second_order(remat(f, policy=POLICIES[policy_name]))
    _assert_bitwise(actual, expected)


def _grads_under_autocast(
    f: Callable[..., torch.Tensor], cast_before: bool, backward_inside: bool
) -> tuple[torch.Tensor, ...]:
    """As `_grads`, in float32 under bfloat16 autocast. Autocast casts a leaf that requires
    grad once per block (its cast cache), other tensors at each use: cast before the region
    in the same block, the region's forward finds leaf `w`'s cast there; with backward
    inside the block, the recompute finds the forward's and casts only `x` (no leaf).
    Square: a cast taken for another has its shape."""
    torch.manual_seed(0)
    _GENERATOR.manual_seed(0)
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        earlier = (x @ w).float().sum() if cast_before else 0
        out = f(x * 1, w).float() + earlier
        if backward_inside:
            out.backward()
    if not backward_inside:
        out.backward()
    streams = torch.rand(2), torch.rand(2, generator=_GENERATOR)
    return (out.detach(), x.grad, w.grad, *streams)  # type: ignore[return-value]


_AUTOCAST_CASES = [case for case in _cover(3) if case.values[0] != "custom autograd.Functions"]  # not autocast-ready


@pytest.mark.parametrize(("name", "policy_name"), _AUTOCAST_CASES)
def test_an_untraceable_region_under_autocast_is_bitwise_whatever_its_cast_cache_holds(
    name: str, policy_name: str
) -> None:
    """A kept value is matched to its op's call in the recompute by count; autocast's cast
    cache makes a parameter's cast run in the forward and not in the recompute, or the other
    way round. Such casts are recomputed, so no kept value is taken for another's (a silent
    wrong gradient) and the recompute's calls are its forward's."""
    f = FUNCTIONS[name]
    region = remat(f, policy=POLICIES[policy_name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematFallbackWarning)
        for cast_before, backward_inside in [(False, False), (False, True), (True, False), (True, True)]:
            expected = _grads_under_autocast(f, cast_before, backward_inside)
            _assert_bitwise(_grads_under_autocast(region, cast_before, backward_inside), expected)


class _Library:
    """A library's own cache, out of remat's reach: the recompute finds the forward's tensor
    there and does not run the `full` the forward ran (real tensors only: a trace's are not kept)."""

    cache: dict[float, torch.Tensor] = {}

    @classmethod
    def filled(cls, value: float) -> torch.Tensor:
        found = cls.cache.get(value)
        if found is None:
            found = torch.full((4, 4), value, dtype=torch.float64)
            if type(found) is torch.Tensor:
                cls.cache[value] = found
        return found


_filled = _Library.filled


def _reads_a_library_cache(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = w * _filled(2.0)  # the forward's first `full`; not run in the recompute
    b = w * torch.full((4, 4), 3.0, dtype=w.dtype)  # the forward's second, the recompute's first
    h = x @ (a + b.sin())
    return h[h > 0].sum()  # untraceable: replayed


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_a_recompute_that_runs_other_calls_than_its_forward_is_exact(policy_name: str) -> None:
    """Selective checkpointing matches the recompute's calls of an op to the forward's by
    count: one call fewer, and a kept `full(2.0)` would be handed out for `full(3.0)` (a
    silently wrong gradient under torch's own selective checkpointing). A kept value goes
    only to the call given what the forward's was; another is computed, with a warning."""
    _Library.cache.clear()
    expected = _grads(_reads_a_library_cache, torch.float64)
    region = remat(_reads_a_library_cache, policy=POLICIES[policy_name])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _Library.cache.clear()
            _assert_bitwise(_grads(region, torch.float64), expected)
    diverged = [w for w in caught if w.category is RematStateWarning and "gave aten.full" in str(w.message)]
    assert bool(diverged) == (policy_name == "everything")  # the only policy here that keeps `full`


_REPORTED = _cover(3)


@pytest.mark.parametrize(("name", "policy_name"), _REPORTED)
def test_a_report_says_what_an_untraceable_region_keeps_as_its_backward_graph_holds_it(name: str, policy_name: str) -> None:
    """The report's kept intermediates are, byte for byte, the memory the forward made that
    the backward graph holds (found by the garbage collector); the inputs it reads are kept
    by reference, by name; the generator state checkpoint keeps; every op not kept is
    recomputed; and the region still trains as without remat."""
    region = remat(FUNCTIONS[name], policy=POLICIES[policy_name])
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    with pytest.warns(RematFallbackWarning):
        found = report(region, x, w)
    assert found.replayed == {region.region} and found.calls == 1
    kept = sum(r.nbytes for r in found.residuals if r.kind == "intermediate")
    assert kept == bytes_kept_for_backward(lambda: region(x, w))
    inputs = [(r.source, r.shape) for r in found.residuals if r.kind == "input"]
    assert inputs == [("x", (6, 4)), ("w", (4, 4))]
    states = 2 if name == "a generator given" else 1  # checkpoint's, and the given generator's
    assert [r.nbytes for r in found.residuals if r.kind == "rng"] == [torch.get_rng_state().numel()] * states
    names = {r.name for r in found.residuals if r.kind == "intermediate"}
    keeps_h = policy_name in ("names", "everything") and name != "in place after a kept matmul"
    assert names <= {"h", None} and ("h" in names) == keeps_h
    if kept == 0:  # nothing kept: backward runs the whole forward again, a matmul at least
        assert any(c.op is torch.ops.aten.mm.default for c in found.recomputes)
    assert f"{region.region} (replayed)" in str(found)
    torch.manual_seed(0)
    _assert_bitwise(_grads(region, torch.float64), (torch.manual_seed(0), _grads(FUNCTIONS[name], torch.float64))[1])


_MEASURED = _cover(5)  # each function and policy once by default: the garbage collector's count is slow


@pytest.mark.parametrize(("name", "policy_name"), _MEASURED)
def test_saved_tensor_bytes_and_compare_count_what_replayed_regions_keep(name: str, policy_name: str) -> None:
    """What a function with replayed regions keeps for backward, as `saved_tensor_bytes` and
    `compare` count it: the memory its forward made that the backward graph holds (the
    garbage collector's count), the inputs its regions read (each memory once) and
    checkpoint's generator state per call, without a warning; a call whose output is
    dropped keeps nothing."""
    region = remat(FUNCTIONS[name], policy=POLICIES[policy_name])
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def twice(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return region(x, w) + region(x * 2, w).sin()

    def dropped(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        region(x, w)
        return x.sin().sum()

    with pytest.warns(RematFallbackWarning):
        region(x, w)
    state = torch.get_rng_state().numel() * (2 if name == "a generator given" else 1)
    expected = bytes_kept_for_backward(lambda: twice(x, w), runs=3) + x.nbytes + w.nbytes + 2 * state
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing goes uncounted
        assert saved_tensor_bytes(twice, x, w) == expected
        assert saved_tensor_bytes(dropped, x, w) == x.nbytes
        rows = compare(twice, x, w, policies=[POLICIES[policy_name]], baseline=False)
    assert rows[0].kept_bytes == expected


def test_saved_tensor_bytes_warns_of_a_checkpoint_inside_a_replayed_region() -> None:
    """A replayed region's own checkpoint is counted; a torch.utils.checkpoint its code
    calls keeps what it saves out of sight, and the count says so (nested replayed regions
    and a replay's recompute do not warn)."""
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def untraceable(x: torch.Tensor) -> torch.Tensor:
        h = (x @ w).tanh()
        return h[(h.sum(-1) > 0).nonzero()[:, 0]].sum() + h.sum()

    checkpointed = remat(lambda x: torch.utils.checkpoint.checkpoint(untraceable, x, use_reentrant=False))
    nested = remat(lambda x: remat(untraceable)(x.sin()).cos())
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematFallbackWarning)
        checkpointed(x), nested(x)  # their first calls try to trace
        with pytest.warns(UserWarning, match="saved-tensor hooks of its own .*not counted"):
            saved_tensor_bytes(checkpointed, x)
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", RematFallbackWarning)
        saved_tensor_bytes(nested, x)
        saved_tensor_bytes(lambda x: torch.autograd.grad(nested(x), x, create_graph=True)[0].sum(), x)


class _Block(torch.nn.Module):
    """BatchNorm (running statistics updated in place), a counter updated in place and
    read, dropout, a full backward hook, and a data-dependent shape."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.norm = torch.nn.BatchNorm1d(4, dtype=torch.float64)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.hooked: list[torch.Tensor] = []
        self.linear.register_full_backward_hook(lambda m, grad_in, grad_out: self.hooked.append(grad_out[0].sum()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)  # and read after: the recompute must see the value the forward saw
        h = torch.nn.functional.dropout(self.norm(self.linear(x)), 0.3) * self.calls
        rows = (h.sum(-1) > 0).nonzero()[:, 0]
        return h.sum() + h[rows].pow(2).sum()


def _train(block: torch.nn.Module, original: _Block, steps: int = 3) -> list[Any]:
    seen = []
    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    for step in range(steps):
        torch.manual_seed(step)
        block(x).backward()
        seen.append([t.detach().clone() for t in (x.grad, *(p.grad for p in original.parameters()))])
        seen.append([b.clone() for b in original.buffers()] + [torch.rand(3)])  # state, and the stream after
    seen.append(torch.stack(original.hooked))
    return seen


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_module_state_random_stream_and_backward_hooks_are_as_without_remat(policy_name: str) -> None:
    """torch.utils.checkpoint alone updates BatchNorm's statistics and the counter twice
    per step; a replayed region once, as without remat."""
    torch.manual_seed(0)
    reference, block = _Block(), _Block()
    block.load_state_dict(reference.state_dict())
    expected = _train(reference, reference)
    with pytest.warns(RematFallbackWarning, match=r"aten\.nonzero|full backward hook"):
        actual = _train(remat(block, policy=POLICIES[policy_name]), block)
    for a, e in zip(actual, expected):
        _assert_bitwise(a, e)
    assert block.calls.item() == 3 and block.norm.num_batches_tracked.item() == 3


class _BackwardOps(TorchDispatchMode):
    """Counts the ops autograd runs in backward (a recompute's too)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _backward_ops(f: Callable[..., torch.Tensor]) -> list[str]:
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    out = f(x, w)
    with _BackwardOps() as counted:
        out.backward()
    return counted.ops


def test_a_replayed_region_asks_its_policy_op_by_op() -> None:
    """What the policy keeps is not recomputed in backward: dots_saveable recomputes no
    matmul, save_only_these_names("h") not the named sin, nothing_saveable both."""
    eager = _backward_ops(_data_dependent)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematFallbackWarning)
        nothing = _backward_ops(remat(_data_dependent, policy=P.nothing_saveable))
        dots = _backward_ops(remat(_data_dependent, policy=P.dots_saveable))
        named = _backward_ops(remat(_data_dependent, policy=P.save_only_these_names("h")))
    assert eager.count("sin") == 0 and nothing.count("sin") == 1 and dots.count("sin") == 1 and named.count("sin") == 0
    assert nothing.count("mm") == eager.count("mm") + 1 and dots.count("mm") == eager.count("mm")


def test_with_fallback_off_a_custom_function_is_refused_naming_it_the_line_and_the_fix() -> None:
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RematTraceError, match=r"custom torch.autograd.Function `.*Straight`.*test_fallback.py:\d+.*custom_op"):
        remat(lambda x: _Straight.apply(x * 2).sum(), fallback=False)(x)


def test_what_a_second_run_would_repeat_is_refused_even_by_replay() -> None:
    """`.backward()` inside a region accumulates `.grad`; a replay would do it twice."""
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)

    def steps(x: torch.Tensor) -> torch.Tensor:
        (x * w).sum().backward(retain_graph=True)
        return x.sin().sum()

    with pytest.raises(RematTraceError, match=r"\.backward\(\)"):
        remat(steps)(torch.randn(3, dtype=torch.float64, requires_grad=True))


def test_expanded_weights_per_sample_gradients_are_as_without_remat() -> None:
    """`call_for_per_sample_grads` (Opacus' "ew" mode) hands a region ExpandedWeights,
    which remat cannot trace: the region replays, and every per-sample gradient is exact."""
    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=torch.float64), torch.nn.Tanh(), torch.nn.Linear(4, 2, dtype=torch.float64))
    x = torch.randn(5, 4, dtype=torch.float64)
    call_for_per_sample_grads(model)(x).sum().backward()
    expected = [p.grad_sample.clone() for p in model.parameters()]  # type: ignore[attr-defined]
    for p in model.parameters():
        del p.grad_sample  # type: ignore[attr-defined]
    rematted = torch.nn.Sequential(remat(model[0], policy=P.dots_saveable), model[1], remat(model[2]))
    with pytest.warns(RematFallbackWarning, match="ExpandedWeight"):
        call_for_per_sample_grads(rematted)(x).sum().backward()
    _assert_bitwise([p.grad_sample for p in model.parameters()], expected)  # type: ignore[attr-defined]


class _Untraceable(torch.nn.Module):
    """Two Linears and a buffer, with a shape that depends on data: a region that replays."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.b = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.register_buffer("scale", torch.ones(4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x))) * self.scale
        return h[h > 0].sum() + h.pow(2).sum()


@pytest.mark.parametrize("kind", ["tensors", "parameters"])
@pytest.mark.parametrize("policy_name", ["none", "nothing", "dots"])
def test_a_replayed_region_under_functional_call_recomputes_with_the_call_s_tensors(kind: str, policy_name: str) -> None:
    """functional_call puts other tensors in the module for one call, and backward comes
    after it: the recompute runs with the tensors the forward ran with (torch.utils.checkpoint
    recomputes with the module's own, a silently wrong gradient)."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(_Untraceable())
    model = torch.nn.Sequential(remat(reference[0], policy=BUILT_IN_POLICIES[policy_name]))
    seen = []
    for module in (reference, model):
        tensors = {k: v.detach() * 2 + 0.1 for k, v in reference.state_dict().items()}
        tensors = {k: torch.nn.Parameter(v) if kind == "parameters" else v.requires_grad_() for k, v in tensors.items()}
        x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RematFallbackWarning)
            torch.func.functional_call(module, tensors, (x,)).backward()
        seen.append([tensors[k].grad for k in sorted(tensors)])
    assert all(g is not None for g in seen[0])
    _assert_bitwise(seen[1], seen[0])
    assert all(p.grad is None for p in reference.parameters())


class _Hooked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.act = torch.nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


def _python_effects(policy: Any, use_remat: bool) -> list[Any]:
    """A replayed region that touches Python state every way it can: forward hooks that
    look (a module's, a pre-hook, a global one) and one that replaces the module's output,
    a list it appends to, an attribute and a nonlocal it sets, and a cache object it is
    given, fills and reads. Two steps, each a gradient and a gradient of that gradient."""
    torch.manual_seed(0)
    module = _Hooked()
    records: dict[str, Any] = {"looked": [], "pre": [], "global": [], "appended": []}
    state = types.SimpleNamespace(calls=0)
    count = 0
    module.linear.register_forward_hook(lambda m, args, out: records["looked"].append(out.detach().clone()))
    module.linear.register_forward_pre_hook(lambda m, args: records["pre"].append(args[0].shape))
    module.act.register_forward_hook(lambda m, args, out: out * 2)  # the recompute must replace it too

    def region(x: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        nonlocal count
        count += 1
        state.calls += 1
        h = module(x)
        records["appended"].append(len(cache))
        cache.append(h)
        h = h * len(cache)  # the recompute must see the cache as the forward did
        rows = (h.sum(-1) > 0).nonzero()[:, 0]  # untraceable: the region replays
        return h.sum() + h[rows].pow(2).sum()

    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: records["global"].append(type(m).__name__))
    f = remat(region, policy=policy) if use_remat else region
    params = list(module.parameters())
    seen: list[Any] = []
    try:
        for step in range(2):
            x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step), requires_grad=True)
            cache: list[torch.Tensor] = []
            out = f(x, cache)
            first = torch.autograd.grad(out, [x, *params], create_graph=True)
            second = torch.autograd.grad(sum(g.pow(2).sum() for g in first), [x, *params])
            seen += [out.detach(), [g.detach() for g in first], second, [c.detach() for c in cache]]
    finally:
        handle.remove()
    return seen + [records, state.calls, count]


@pytest.mark.parametrize("policy_name", ["none", "nothing", "everything", "dots"])
def test_a_replayed_region_s_python_runs_once_per_call_as_without_remat(policy_name: str) -> None:
    """torch.utils.checkpoint runs a region's Python again in backward: its hooks record
    twice, its appends and counters count twice, and a cache the forward filled is seen
    filled by the recompute (a different value, a wrong gradient). A replayed region's
    recompute sees the Python state the forward saw, and leaves every object it and its
    hooks reach as the forward left it; a kept value serves a second backward."""
    expected = _python_effects(None, use_remat=False)
    with pytest.warns(RematFallbackWarning, match="nonzero"):
        actual = _python_effects(POLICIES[policy_name], use_remat=True)
    assert actual[-1] == expected[-1] == 2 and actual[-2] == expected[-2] == 2
    assert actual[-3]["pre"] == expected[-3]["pre"] and actual[-3]["global"] == expected[-3]["global"]
    assert actual[-3]["appended"] == expected[-3]["appended"] == [0, 0]
    for a, e in zip(optree.tree_leaves(actual[:-3]), optree.tree_leaves(expected[:-3])):  # type: ignore[arg-type]
        assert torch.equal(a, e)
    _assert_bitwise(actual[-3]["looked"], expected[-3]["looked"])


def test_a_failed_trace_leaves_no_stand_ins_and_no_changes() -> None:
    """The trace ran the Python on stand-ins before it failed: what it appended and set is
    taken back, so the replay's forward makes each change once, with real values."""
    seen: list[Any] = []
    holder = types.SimpleNamespace(last=None)

    def region(x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        seen.append(h)
        holder.last = h
        return h[h > 0].sum()

    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    with pytest.warns(RematFallbackWarning):
        out = remat(region)(x)
    assert len(seen) == 1 and type(seen[0]) is torch.Tensor and holder.last is seen[0]
    out.backward()
    assert len(seen) == 1 and holder.last is seen[0]
    assert torch.equal(x.grad, (x.sin() > 0) * x.cos())  # type: ignore[arg-type]


class _Pruned(torch.nn.Module):
    """torch's pruning recomputes `weight` from `weight_orig` in a forward pre-hook that
    sets it as a plain attribute and returns nothing, which replays (so would the
    data-dependent shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4, dtype=torch.float64)
        torch.nn.utils.prune.l1_unstructured(self.linear, "weight", amount=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.linear(x))
        return h.sum() + h[h > 0].pow(2).sum()


@pytest.mark.parametrize("policy_name", ["none", "dots"])
def test_a_hook_that_sets_what_the_forward_reads_runs_in_the_recompute(policy_name: str) -> None:
    """The recompute sees the module as the forward did: its attributes as they were when
    the forward started, and the pre-hook that sets `weight` runs again, from the
    `weight_orig` an optimizer step between calls changed; every step's gradients equal
    no remat."""
    torch.manual_seed(0)
    reference, block = _Pruned(), _Pruned()
    block.load_state_dict(reference.state_dict())
    seen = []
    with pytest.warns(RematFallbackWarning, match="pre-hook `L1Unstructured` on Linear sets the module's `weight`"):
        for model, run in ((reference, reference), (block, remat(block, policy=POLICIES[policy_name]))):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
                run(x).backward()
                seen.append([p.grad.clone() for p in model.parameters()])
                optimizer.step()
                optimizer.zero_grad()
    for a, e in zip(seen[3:], seen[:3]):
        _assert_bitwise(a, e)
