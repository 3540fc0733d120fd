"""What the user's Python does inside a region besides aten ops, each channel captured in the
graph or refused by name, against the same code without remat (float64).

remat runs a function's Python once, on fake tensors, and replays the aten graph it
recorded. Grad mode, module hooks, tensor hooks, generator state, side effects and the
ops a policy runs to decide are not aten ops of that graph: each test here checks one of
them against eager code, under every transform the channel meets.
"""

from __future__ import annotations

import functools
import random
import warnings
from typing import Any, Callable

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch.testing._internal.common_utils import freeze_rng_state

import remat as remat_package
from remat import RematError, RematTraceError, remat
from remat import policies as P

from conftest import assert_close, pairwise_in_default
from test_transforms import TRANSFORMS

D = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::remat.RematPolicyWarning")

Fn = Callable[..., torch.Tensor]
CHANNEL_POLICIES = {
    "none": None, "nothing": P.nothing_saveable, "everything": P.everything_saveable, "dots": P.dots_saveable,
}
CHANNEL_TRANSFORMS = ["backward", "double_backward", "grad", "vjp", "jacrev", "vmap_grad", "grad_vmap", "grad_grad"]


def _params() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, dtype=D, generator=gen)
    return x, {"w": torch.randn(4, 4, dtype=D, generator=gen), "b": torch.randn(4, dtype=D, generator=gen)}


def _compare(fn: Fn, policy_name: str, transform: str) -> None:
    x, p = _params()
    run = TRANSFORMS[transform]
    assert_close(run(remat(fn, policy=CHANNEL_POLICIES[policy_name]), x, p), run(fn, x, p), rtol=1e-10, atol=1e-12)


# --- grad mode --------------------------------------------------------------------------


def _no_grad_block(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    h = x @ p["w"]
    with torch.no_grad():
        scale = h.sin() * 3 + p["b"]
    return (h * scale + p["b"]).tanh()


def _set_grad_enabled_false(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    h = x @ p["w"]
    with torch.set_grad_enabled(False):
        gate = torch.sigmoid(h + p["b"])
    return (h + p["b"]).cos() * gate


def _inference_mode(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        shift = (x @ p["w"]).mean(-1, keepdim=True)
    return (x @ p["w"] + p["b"]) - shift  # a sum saves no tensor, as inference tensors require


@torch.no_grad()
def _constant_of(h: torch.Tensor) -> torch.Tensor:
    return F.softmax(h, dim=-1)


def _no_grad_helper(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    h = x @ p["w"] + p["b"]
    return h * _constant_of(h)


def _enable_grad_inside_no_grad(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    h = x @ p["w"]
    with torch.no_grad():
        constant = h.exp()
        with torch.enable_grad():
            tracked = (h * p["b"]).sin()
        also_constant = tracked * 2
    return h * constant.tanh() + tracked + also_constant.cos()


def _norm_clamped_in_place(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """What `cosine_similarity` does inside: later reads see the clamped values,
    differentiated as the norm before the clamp."""
    norm = (x @ p["w"]).norm(dim=-1, keepdim=True).clone()
    with torch.no_grad():
        norm.clamp_min_(2.0)
    return (x + p["b"]) / norm


def _changed_twice_in_place(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    h = x @ p["w"]
    with torch.no_grad():
        h.mul_(0.5).clamp_(-0.6, 0.6)
    h.add_(p["b"])  # then changed with grad on
    with torch.no_grad():
        h.tanh_()
    return h * x.sin()


def _changed_in_place_after_a_read(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    h = (x @ p["w"] * p["b"]).sin()
    before = h * 1.5  # read before the change: the old values
    with torch.no_grad():
        h.clamp_max_(0.2)
    return h + before.cos()


GRAD_MODES = {
    "no_grad": _no_grad_block,
    "set_grad_enabled": _set_grad_enabled_false,
    "inference_mode": _inference_mode,
    "no_grad_helper": _no_grad_helper,
    "enable_grad_inside": _enable_grad_inside_no_grad,
    "norm_clamped_in_place": _norm_clamped_in_place,
    "changed_twice_in_place": _changed_twice_in_place,
    "changed_in_place_after_a_read": _changed_in_place_after_a_read,
}


@pytest.mark.parametrize(
    ("fn_name", "policy_name", "transform"), pairwise_in_default(list(GRAD_MODES), list(CHANNEL_POLICIES), list(CHANNEL_TRANSFORMS))
)
def test_values_computed_with_grad_off_are_constants_of_backward(fn_name: str, policy_name: str, transform: str) -> None:
    _compare(GRAD_MODES[fn_name], policy_name, transform)


def test_an_output_computed_with_grad_off_does_not_require_grad() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            stats = x.mean()
        return x.sin(), stats

    x = torch.randn(4, dtype=D, requires_grad=True)
    out, stats = remat(f)(x)
    assert out.requires_grad and not stats.requires_grad
    assert_close(stats, x.mean().detach())


def _leaves_grad_off(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = (x @ w).tanh()
    torch.set_grad_enabled(False)  # not undone: the caller goes on with grad off
    return h * x, h.sum()


class _Doubled(torch.autograd.Function):
    """A hand-written backward remat cannot trace under `.backward()`: the region replays."""

    @staticmethod
    def forward(a: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return a * 2

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * 2


def _grad_off_by_call_after_a_custom_function(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = _Doubled.apply(x @ w)
    torch.set_grad_enabled(False)  # the trace gives up after this line; the replay starts as the call did
    stats = h.mean()
    torch.set_grad_enabled(True)
    return h.sin() * stats


@pytest.mark.parametrize("fn", [_leaves_grad_off, _grad_off_by_call_after_a_custom_function], ids=lambda f: f.__name__)
@pytest.mark.parametrize("policy_name", ["none", "dots"])
def test_the_grad_mode_a_function_leaves_is_its_caller_s_on_every_call(fn: Fn, policy_name: str) -> None:
    """`torch.set_grad_enabled(False)` called (not a `with` block) sets the caller's grad
    mode: what the function leaves, each call leaves, traced or planned, and a trace that
    gives up (to replay the region) after such a call starts the Python again in the
    caller's grad mode, not in the one the attempt left."""
    region = remat(fn, policy=CHANNEL_POLICIES[policy_name])

    def observed(f: Fn) -> list[Any]:
        seen: list[Any] = []
        for _ in range(2):  # traced (or replayed), then planned
            x, p = _params()
            x.requires_grad_()
            torch.set_grad_enabled(True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", remat_package.RematFallbackWarning)
                out = f(x, p["w"])
            left = torch.is_grad_enabled()
            torch.set_grad_enabled(True)
            outs = out if isinstance(out, tuple) else (out,)
            needs = [o.requires_grad for o in outs]
            grads = torch.autograd.grad(outs[0].sum(), x) if needs[0] else ()
            seen += [left, needs, [o.detach() for o in outs], grads]
        return seen

    try:
        assert_close(observed(region), observed(fn), rtol=0, atol=0)
    finally:
        torch.set_grad_enabled(True)


def _sets_the_default_dtype(x: torch.Tensor) -> torch.Tensor:
    torch.set_default_dtype(torch.float64)
    scale = torch.full((3,), 1 / 3)  # float64 in eager code: the default the line above set
    torch.set_default_dtype(torch.float32)
    return x.sin() * scale


def test_a_default_dtype_changed_inside_a_region_runs_as_eager_or_is_refused_naming_it() -> None:
    """A graph makes its tensors in the default dtype of the call that runs it, so a change
    inside the function is not in the graph: the region runs replayed, as eager code does
    (same dtypes, same values, same gradient), and with `fallback=False` the error names
    `torch.set_default_dtype` and the fix. The caller's default dtype is left as it was."""
    x = torch.randn(3, requires_grad=True)
    expected = _sets_the_default_dtype(x)
    expected_grad = torch.autograd.grad(expected.sum(), x)
    for _ in range(2):
        with pytest.warns(remat_package.RematFallbackWarning, match="set_default_dtype"):
            out = remat(_sets_the_default_dtype)(x)
        assert out.dtype is torch.float64 and torch.get_default_dtype() is torch.float32
        assert_close((out, torch.autograd.grad(out.sum(), x)), (expected, expected_grad), rtol=0, atol=0)
    with pytest.raises(RematTraceError, match=r"default dtype was changed .*torch\.set_default_dtype.* outside"):
        remat(_sets_the_default_dtype, fallback=False)(x)
    assert torch.get_default_dtype() is torch.float32


def test_an_in_place_change_with_grad_off_keeps_its_exact_value() -> None:
    """The changed value is the value eager code reads, bit for bit, also where the old one
    is infinite (a straight-through `x + (v - x).detach()` would read NaN there)."""
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = x * 2
        with torch.no_grad():
            y.nan_to_num_(posinf=1.0).clamp_max_(0.5)
        return y * w

    x = torch.tensor([1.0, float("inf"), -3.0, 0.2, -0.0], dtype=D)
    w = torch.randn(5, dtype=D)
    for policy in CHANNEL_POLICIES.values():
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        f(a, w).sum().backward()
        remat(f, policy=policy)(b, w).sum().backward()
        assert torch.equal(f(x, w), remat(f, policy=policy)(x, w))
        assert torch.equal(a.grad, b.grad)  # finite where x is infinite: 2 w


def test_an_in_place_change_with_grad_off_through_a_view_is_refused() -> None:
    """A write with grad off that a view shares reaches the view and its gradient too,
    which remat does not express: refused, naming the line."""
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        row = y[0]
        with torch.no_grad():
            y.clamp_(-1, 1)
        return (row * x[0]).sum() + y.sum()

    x = torch.randn(3, 5, dtype=D, requires_grad=True)
    with pytest.raises(RematTraceError, match=r"test_python_channels.py:\d+ it changes .* in place with grad disabled \(aten.clamp_.default\), and a view"):
        remat(f, fallback=False)(x)


def test_an_in_place_change_with_grad_off_nobody_reads_after_is_exact() -> None:
    """An input updated under no_grad and not read again (a step taken inside the region)."""
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = (x.sin() + w).sum()  # reads w, saves nothing of it
        with torch.no_grad():
            w.mul_(0.5)
        return out

    x = torch.randn(4, dtype=D, requires_grad=True)
    w_eager, w_remat = torch.randn(4, dtype=D), None
    w_remat = w_eager.clone()
    f(x, w_eager).backward()
    expected = x.grad.clone()
    x.grad = None
    remat(f)(x, w_remat).backward()
    assert_close((x.grad, w_remat), (expected, w_eager))


# --- arguments that share memory -------------------------------------------------------


def _two_uses(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(a @ w) * b + torch.sin(b) * a


@pytest.mark.parametrize("policy_name", list(CHANNEL_POLICIES))
@pytest.mark.parametrize("transform", ["backward", "grad", "vmap_grad"])
def test_one_tensor_passed_as_several_arguments_gets_eager_s_gradient_bitwise(policy_name: str, transform: str) -> None:
    """`f(x, x, w)`: eager code has one tensor, whose gradient gathers every use's term in
    one place, in autograd's order; remat traces such a call with one stand-in for both
    arguments, so its terms add in that order too (bfloat16, bitwise)."""
    gen = torch.Generator().manual_seed(0)
    x, w, cot = (torch.randn(*shape, generator=gen).to(torch.bfloat16) for shape in ((3, 4), (4, 4), (3, 4)))

    def run(region: Fn) -> Any:
        def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return (region(x, x, w) * cot).sum()

        if transform == "backward":
            a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
            loss(a, b).backward()
            return a.grad, b.grad
        if transform == "grad":
            return torch.func.grad(loss, argnums=(0, 1))(x, w)
        return torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(0, None))(torch.stack([x, -x]), w)

    expected, actual = run(_two_uses), run(remat(_two_uses, policy=CHANNEL_POLICIES[policy_name]))
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


@pytest.mark.parametrize("policy_name", list(CHANNEL_POLICIES))
@pytest.mark.parametrize("second", ["itself", "a row", "its transpose"])
def test_a_write_into_one_argument_is_seen_through_another_that_shares_its_memory(
    policy_name: str, second: str
) -> None:
    """`f(x, x, w)`, `f(x, x[0], w)`, `f(x, x.T, w)` writing into the second argument: eager
    code reads the write through the first. One tensor passed twice is one input of the
    graph; tensors that share memory otherwise make the region run as it is."""
    def f(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        b.mul_(2)
        return torch.tanh((a + b) @ w)

    def run(region: Fn) -> tuple[torch.Tensor, ...]:
        x = torch.arange(9, dtype=D).reshape(3, 3) / 9
        w = torch.linspace(-1, 1, 9, dtype=D).reshape(3, 3).requires_grad_()
        b = {"itself": x, "a row": x[0], "its transpose": x.T}[second]
        out = region(x, b, w)
        out.sum().backward()
        return out, x, w.grad

    expected = run(f)
    for _ in range(2):  # the trace's call, then a cached plan's
        actual = run(remat(f, policy=CHANNEL_POLICIES[policy_name]))
        assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


@pytest.mark.parametrize("policy_name", list(CHANNEL_POLICIES))
def test_a_buffer_two_calls_update_gives_each_call_s_backward_the_value_it_read(policy_name: str) -> None:
    """A region that updates a buffer with grad off and reads it, called twice before one
    backward: eager autograd refuses (the first call's saved buffer was changed in place
    since); remat keeps what a write with grad off computes as a value of the call, so each
    call's backward reads what it read, as eager code reading a copy of the buffer does."""
    def make(copy: bool) -> tuple[Fn, torch.Tensor]:
        stats = torch.ones(4, dtype=D)

        def f(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                stats.mul_(0.9).add_(x.mean(0) * 0.1)
            return torch.tanh(x) * (stats.clone() if copy else stats)

        return f, stats

    def run(region: Fn) -> tuple[torch.Tensor, ...]:
        x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(0)).requires_grad_()
        (region(x) + region(x * 2)).sum().backward()
        return (x.grad,)

    f, _ = make(copy=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(f)
    f, expected_stats = make(copy=True)
    expected = run(f)
    f, stats = make(copy=False)
    actual = run(remat(f, policy=CHANNEL_POLICIES[policy_name]))
    assert_close((actual, stats), (expected, expected_stats), rtol=0, atol=0)


# --- tensor subclasses -------------------------------------------------------------------


class _DoubledTanh(torch.Tensor):
    """A `__torch_function__` subclass whose Python changes what an op gives: `tanh` doubled."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 2 if func is torch.tanh else out


class _OwnParameter(torch.nn.Parameter):
    """A Parameter subclass (as quantization libraries make): torch functions see a plain tensor."""


def _tanh_layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) * w.sum()


@pytest.mark.parametrize("policy_name", list(CHANNEL_POLICIES))
@pytest.mark.parametrize("where", ["argument", "captured"])
def test_a_torch_function_subclass_runs_its_python_as_in_eager_code(policy_name: str, where: str) -> None:
    """A tensor subclass with its own `__torch_function__` runs Python on every torch call
    that a trace of plain tensors would leave out: the region runs replayed (its Python
    again in backward, with the subclass), saying so; under a torch.func transform it is
    refused, naming the tensor."""
    gen = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(3, 4, dtype=D, generator=gen), torch.randn(4, 4, dtype=D, generator=gen)

    def run(region: Callable[[Fn], Fn]) -> tuple[torch.Tensor, ...]:
        x = x0.clone().as_subclass(_DoubledTanh).requires_grad_()
        w = w0.clone().requires_grad_()
        if where == "argument":
            out = region(_tanh_layer)(x, w)
        else:
            out = region(lambda w: _tanh_layer(x, w))(w)
        out.sum().backward()  # on a subclass tensor: the whole backward runs with subclasses' own off
        return out.as_subclass(torch.Tensor).detach(), x.grad, w.grad

    expected = run(lambda fn: fn)
    with pytest.warns(remat_package.RematFallbackWarning, match="a tensor subclass with its own __torch_function__"):
        actual = run(lambda fn: remat(fn, policy=CHANNEL_POLICIES[policy_name]))
    assert_close(actual, expected, rtol=0, atol=0)
    x = x0.as_subclass(_DoubledTanh)
    with pytest.raises(RematTraceError, match=r"x is a _DoubledTanh, a tensor subclass with its own __torch_fu"):
        torch.func.grad(lambda w: remat(_tanh_layer)(x, w))(w0)


def test_a_parameter_subclass_is_traced_as_a_parameter() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 4, dtype=D, generator=gen), torch.randn(4, 4, dtype=D, generator=gen)
    own, plain = _OwnParameter(w.clone()), torch.nn.Parameter(w.clone())
    with warnings.catch_warnings():
        warnings.simplefilter("error", remat_package.RematFallbackWarning)
        remat(_tanh_layer)(x, own).sum().backward()
    _tanh_layer(x, plain).sum().backward()
    assert torch.equal(own.grad, plain.grad)


# --- what a policy runs -----------------------------------------------------------------


class _RunsTheOp:
    """A user policy that runs the op to look at its output, as `keep_outputs_where` does."""

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        kwargs.pop("name", None)
        out = op(*args, **kwargs)
        return isinstance(out, torch.Tensor) and out.device.type == "meta" and out.numel() < 16

    def __repr__(self) -> str:  # a test id that is the same in every process
        return "_RunsTheOp()"


@pytest.mark.parametrize("policy", [P.output_smaller_than(100), P.keep_outputs_where(lambda out: True), _RunsTheOp()], ids=repr)
def test_a_policy_that_runs_the_op_sees_metadata_only(policy: Any) -> None:
    """Factories included: asked about `randn(3, 3)`, a policy running it would draw from
    the global generator while remat traces (the first call's values and the stream after
    would differ) and allocate real memory."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * torch.randn(3, 3, dtype=D) + torch.rand(3, 3, dtype=D, device="cpu")

    x = torch.randn(3, 3, dtype=D, requires_grad=True)
    r = remat(f, policy=policy)
    runs = []
    for fn in (f, r, r):
        torch.manual_seed(0)
        out = fn(x)
        (g,) = torch.autograd.grad(out.pow(2).sum(), x)
        runs.append((out.detach(), g, torch.rand(3)))
    assert_close(runs[1], runs[0])
    assert_close(runs[2], runs[0])


# --- tensor hooks -----------------------------------------------------------------------


def _hook_on_intermediate(x: torch.Tensor) -> torch.Tensor:
    h = x.sin()
    h.register_hook(lambda g: g * 2)
    return (h**2).sum()


def _retain_grad(x: torch.Tensor) -> torch.Tensor:
    h = x.sin()
    h.retain_grad()
    return (h**2).sum()


def _hook_on_input(x: torch.Tensor) -> torch.Tensor:
    x.register_post_accumulate_grad_hook(lambda t: None)
    return x.sin().sum()


@pytest.mark.parametrize("fn", [_hook_on_intermediate, _retain_grad, _hook_on_input], ids=lambda f: f.__name__)
def test_a_tensor_hook_inside_a_region_is_refused_naming_the_line(fn: Fn) -> None:
    """A graph holds no tensor hooks: the gradient would silently be the one without it."""
    x = torch.randn(5, dtype=D, requires_grad=True)
    with pytest.raises(RematTraceError, match=r"test_python_channels.py:\d+ .*would be dropped.*outside the remat'd function"):
        remat(fn, fallback=False)(x)
    with pytest.raises(RematTraceError, match="would be dropped"):  # under a transform: no replay
        torch.func.grad(remat(fn))(x.detach())


def _tanh_then_sin(x: torch.Tensor, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two outputs: tanh's derivative reads its output, sin's reads its input."""
    h = torch.tanh(x @ p["w"])
    return h, (h + p["b"]).sin()


def _softmax_of_matmul(x: torch.Tensor, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    h = x @ p["w"]
    return torch.softmax(h, -1), h.exp()


# Neither expects None: a hook on one of a region's outputs does not run when backward
# reaches the region through its other outputs only, as eager code's separate nodes do not.
OUTPUT_HOOKS = {
    "counts": lambda calls: lambda g: calls.append(g.detach().clone()),
    "doubles": lambda calls: lambda g: g * 2,
}


@pytest.mark.parametrize("hooked", ["first", "second", "both", "retain_grad"])
@pytest.mark.parametrize("hook", list(OUTPUT_HOOKS))
@pytest.mark.parametrize("policy_name", list(CHANNEL_POLICIES))
@pytest.mark.parametrize("fn", [_tanh_then_sin, _softmax_of_matmul], ids=lambda f: f.__name__)
def test_a_hook_on_a_region_s_output_in_a_gradient_of_a_gradient(
    fn: Any, policy_name: str, hook: str, hooked: str
) -> None:
    """A tensor hook (or retain_grad) the caller puts on a region's output runs in a gradient
    of a gradient as in eager code: where the output's own op saved the output for its
    derivative (tanh, softmax, exp), the second backward passes the output, so its hook runs
    again, and a hook that changes the gradient changes the second gradient."""

    def run(f: Any) -> tuple[list[list[torch.Tensor]], Any]:
        x, p = _params()
        x.requires_grad_()
        t = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1))
        a, b = f(x * 2, p)
        targets = {"first": [a], "second": [b], "both": [a, b], "retain_grad": [a, b]}[hooked]
        calls: list[list[torch.Tensor]] = [[] for _ in targets]
        for out, seen in zip(targets, calls, strict=True):
            if hooked == "retain_grad":
                out.retain_grad()
            else:
                out.register_hook(OUTPUT_HOOKS[hook](seen))
        (g,) = torch.autograd.grad((a * a.detach()).sum() + (b * b.detach()).sum(), [x], create_graph=True)
        (g * t).sum().backward()
        return calls, (g.detach(), x.grad, *[out.grad for out in targets if hooked == "retain_grad"])

    eager_calls, eager = run(fn)
    calls, got = run(remat(fn, policy=CHANNEL_POLICIES[policy_name]))
    assert_close(got, eager)  # a recomputed output's second-order terms may meet in another order: an ulp
    assert_close(calls, eager_calls)


@pytest.mark.parametrize("policy_name", list(CHANNEL_POLICIES))
def test_a_hook_on_an_output_backward_does_not_reach_does_not_run(policy_name: str) -> None:
    """Backward through one output of a region runs the region's node; a hook on another
    output does not run then (torch would call it with None), as in eager code."""

    def run(f: Any) -> Any:
        x, p = _params()
        x.requires_grad_()
        a, b = f(x, p)
        calls: list[torch.Tensor] = []
        b.register_hook(lambda g: calls.append(g * 2))
        a.pow(2).sum().backward()
        return calls, x.grad

    region = remat(_softmax_of_matmul, policy=CHANNEL_POLICIES[policy_name])  # two outputs of one node
    assert_close(run(region), run(_softmax_of_matmul), rtol=0, atol=0)


def _returns_its_input(x: torch.Tensor, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return x, (x @ p["w"]).exp()


def _returns_a_value_twice(x: torch.Tensor, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    h = torch.tanh(x @ p["w"])
    return h, h, h.sin()


@pytest.mark.parametrize("order", ["first", "second"])
@pytest.mark.parametrize("policy_name", list(CHANNEL_POLICIES))
@pytest.mark.parametrize("fn", [_returns_its_input, _returns_a_value_twice], ids=lambda f: f.__name__)
def test_an_output_returned_as_is_is_eager_s_object_and_its_hooks_see_every_gradient(
    fn: Any, policy_name: str, order: str
) -> None:
    """An input returned unchanged is that input, a value returned twice one object: a hook
    on it changes every gradient that reaches it, as in eager code (not only the share of
    the one output it was put on)."""

    def run(f: Any) -> Any:
        x, p = _params()
        x.requires_grad_()
        u = x * 1
        outs = f(u, p)
        identities = (outs[0] is u, outs[0] is outs[1])
        for out in outs:
            out.register_hook(lambda g: g * 3)
        loss = sum((out * out.detach().cos()).sum() for out in outs) + (u * 2).sum()
        if order == "first":
            loss.backward()
            return identities, x.grad
        (g,) = torch.autograd.grad(loss, [x], create_graph=True)
        (g * g).sum().backward()
        return identities, g.detach(), x.grad

    expected = run(fn)
    assert_close(run(remat(fn, policy=CHANNEL_POLICIES[policy_name])), expected, rtol=0, atol=0)


@pytest.mark.parametrize("watch", ["hook", "retain_grad"])
def test_a_hooked_output_changed_in_place_before_a_gradient_of_a_gradient_raises_as_torch_does(watch: str) -> None:
    """Eager's derivative of `tanh` reads its saved output, changed since: torch raises; remat
    would read the changed tensor, so it raises too, naming the output and the fix."""

    def run(f: Any) -> None:
        x = torch.randn(3, dtype=D, requires_grad=True)
        out = f(x * 2)
        if watch == "hook":
            out.register_hook(lambda g: g * 2)
        else:
            out.retain_grad()
        out.mul_(3)
        (g,) = torch.autograd.grad(out.sum(), [x], create_graph=True)
        g.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(torch.tanh)
    with pytest.raises(RematError, match=r"output 0 carries a tensor hook .*modified in place since.*clone"):
        run(remat(torch.tanh))


def test_a_hooked_output_nothing_holds_before_a_gradient_of_a_gradient_is_refused_naming_the_fix() -> None:
    """Eager's `tanh` saved its output, so the second backward passes the hook; remat's
    graph cannot reach an output that is gone: an error, not a gradient without the hook."""

    def run(f: Any) -> torch.Tensor:
        x = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(0)).requires_grad_()
        out = f(x * 2)
        out.register_hook(lambda g: g * 2)
        y = out * 3  # `out` itself is dropped below: only eager's saved copy holds it
        del out
        (g,) = torch.autograd.grad(y.sum(), [x], create_graph=True)
        (g * g).sum().backward()
        assert x.grad is not None
        return x.grad

    run(torch.tanh)  # eager code runs
    with pytest.raises(RematError, match=r"output 0 carries a tensor hook .*no longer held by anything.*Keep a ref"):
        run(remat(torch.tanh))
    kept = remat(torch.tanh, policy=P.everything_saveable)  # a policy that keeps the output reads it
    assert_close(run(kept), run(torch.tanh), rtol=0, atol=0)


# --- Python side effects ----------------------------------------------------------------

_GLOBAL_LOG: list[int] = []


class _Counter:
    def __init__(self) -> None:
        self.calls = 0
        self.seen: dict[str, int] = {}


def _side_effects() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    log: list[int] = []
    counter = _Counter()

    def appends(x: torch.Tensor) -> torch.Tensor:
        log.append(1)
        return x.sin().sum()

    def sets_attribute(x: torch.Tensor) -> torch.Tensor:
        counter.calls = counter.calls + 1
        return x.sin().sum()

    def sets_item(x: torch.Tensor) -> torch.Tensor:
        counter.seen["x"] = x.dim()
        return x.sin().sum()

    def appends_to_global(x: torch.Tensor) -> torch.Tensor:
        _GLOBAL_LOG.append(x.dim())
        return x.sin().sum()

    return {"appends": appends, "sets_attribute": sets_attribute, "sets_item": sets_item, "global": appends_to_global}


@pytest.mark.parametrize("kind", list(_side_effects()))
def test_a_python_side_effect_warns_once_naming_what_changed(kind: str) -> None:
    """The change happens once per trace, not per call: a RematStateWarning says so, naming
    the object, at the function's line, once per region."""
    fn = _side_effects()[kind]
    r = remat(fn)
    x = torch.randn(3, dtype=D, requires_grad=True)
    with pytest.warns(remat_package.RematStateWarning, match=r"changes `.*` \(.*\) while traced") as caught:
        r(x).backward()
    assert all(w.filename == __file__ for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("error", remat_package.RematStateWarning)
        r(x).backward()  # traced already: no new warning
        r(x[:2]).backward()  # a new trace of the same region: warned already


def test_a_function_without_side_effects_does_not_warn() -> None:
    state = {"scale": 2.0}
    layer = torch.nn.Linear(3, 3, dtype=D)

    def f(x: torch.Tensor) -> torch.Tensor:
        return layer(x * state["scale"]).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error", remat_package.RematStateWarning)
        remat(f)(torch.randn(2, 3, dtype=D, requires_grad=True)).backward()


# --- no stand-in escapes ----------------------------------------------------------------


class _Holder:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


def _stores_in(box: dict[str, torch.Tensor]) -> Fn:
    def stores(x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        box["h"] = h
        return (h * x).tanh().sum()

    return stores


@pytest.mark.parametrize("policy_name", ["none", "dots"])
def test_a_computed_tensor_stored_where_the_caller_sees_it_is_replayed_as_eager(policy_name: str) -> None:
    """The trace's stand-ins are taken back out, the region replays, and the caller sees
    the forward's own tensor (the recompute's is not left there), as without remat."""
    x = torch.randn(3, dtype=D)
    seen = []
    for use_remat in (False, True):
        box: dict[str, torch.Tensor] = {}
        fn = _stores_in(box)
        f = remat(fn, policy=CHANNEL_POLICIES[policy_name]) if use_remat else fn
        xs = x.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", remat_package.RematFallbackWarning)
            out = f(xs)
        stored = box["h"]
        (out + stored.sum()).backward()  # through the region and through what it stored
        seen.append((out.detach(), xs.grad, stored.detach(), box["h"] is stored, list(box)))
    assert_close(seen[1], seen[0], rtol=0, atol=0)


def test_a_computed_tensor_stored_where_the_caller_sees_it_is_refused_when_traced() -> None:
    box: dict[str, torch.Tensor] = {}
    match = r"stores a tensor it computes in `box\['h'\]`|stores a tensor it computes in `box.h`"
    with pytest.raises(RematTraceError, match=match):
        remat(_stores_in(box), fallback=False)(torch.randn(3, dtype=D, requires_grad=True))
    assert box == {}  # the trace's stand-in is not left there
    with pytest.raises(RematTraceError, match=match):
        torch.func.grad(remat(_stores_in(box)))(torch.randn(3, dtype=D))
    assert box == {}


@functools.lru_cache(maxsize=8)
def _table(n: int) -> torch.Tensor:
    """A position table cached by a library function, as models cache theirs."""
    return torch.arange(n, dtype=D).mul(0.5).exp().sin()


@functools.cache
def _pair(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(n, dtype=D) * 0.25
    return angles.cos(), angles.sin()


class _Anchored(torch.nn.Module):
    """A module whose method is cached per instance and argument (OmDet-Turbo's anchors)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, dtype=D)

    @functools.lru_cache(maxsize=4)  # noqa: B019 (a cached method, as the library writes it)
    def anchors(self, n: int) -> torch.Tensor:
        return torch.linspace(-1, 1, n, dtype=D).tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = _pair(x.shape[-1])
        return self.proj(x * _table(x.shape[-1]) + self.anchors(x.shape[-1])) * cos + sin


def _cached_values_are_real() -> bool:
    values = [_table(4), *_pair(4), _Anchored().anchors(4)]
    return all(type(v) is torch.Tensor for v in values)


@pytest.mark.parametrize("policy_name", list(CHANNEL_POLICIES))
@pytest.mark.parametrize("transform", ["backward", "grad", "vmap_grad"])
def test_a_library_cache_filled_while_traced_is_emptied_and_exact(policy_name: str, transform: str) -> None:
    """functools caches (a function's, a tuple-valued one's, a method's) that the region
    fills while remat traces it hold no stand-in afterwards: the region's values and
    gradients, and what eager code gets from the caches after, equal eager code's."""
    torch.manual_seed(0)
    module = _Anchored()
    x = torch.randn(3, 4, dtype=D)
    run = TRANSFORMS[transform]
    for cache in (_table, _pair, _Anchored.anchors):
        cache.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat_package.RematStateWarning)
        actual = run(lambda t, p: remat(module, policy=CHANNEL_POLICIES[policy_name])(t).sum(), x, {})
        assert _cached_values_are_real()
        again = run(lambda t, p: remat(module, policy=CHANNEL_POLICIES[policy_name])(t).sum(), x, {})
    expected = run(lambda t, p: module(t).sum(), x, {})
    assert_close(actual, expected, rtol=0, atol=0)
    assert_close(again, expected, rtol=0, atol=0)


def test_emptying_a_library_cache_is_said_once_per_region_naming_the_cache() -> None:
    def positions(x: torch.Tensor) -> torch.Tensor:
        cos, sin = _pair(x.shape[-1])
        return (x * _table(x.shape[-1])).tanh() * cos + sin

    _table.cache_clear()
    _pair.cache_clear()
    region = remat(positions)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (4, 5):  # a new size: traced again, the caches filled and emptied again
            region(torch.randn(2, n, dtype=D, requires_grad=True)).sum().backward()
    said = [str(w.message) for w in caught if issubclass(w.category, remat_package.RematStateWarning)]
    assert len(said) == 2 and all("remat emptied the cache" in m for m in said), said
    assert {m.split("`")[3].rsplit(".", 1)[-1] for m in said} == {"_table", "_pair"}
    assert _cached_values_are_real()


def test_a_library_cache_filled_by_a_trace_that_fails_holds_no_stand_in_for_the_replay() -> None:
    """A region remat cannot trace (a value-dependent shape) runs replayed; the cache its
    failed trace filled is emptied first, so the replay and later eager calls get values."""
    def routed(x: torch.Tensor) -> torch.Tensor:
        y = x * _table(x.shape[-1])
        return y[y > 0].sum() + y.tanh().sum()

    _table.cache_clear()
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat_package.RematFallbackWarning)
        warnings.simplefilter("ignore", remat_package.RematStateWarning)
        actual = remat(routed)(x)
    assert _cached_values_are_real()
    expected = routed(x)
    assert_close((actual, torch.autograd.grad(actual, x)), (expected, torch.autograd.grad(expected, x)), rtol=0, atol=0)


def test_an_output_object_optree_does_not_flatten_is_refused() -> None:
    def returns_holder(x: torch.Tensor) -> Any:
        return x.sin(), _Holder(x.cos())

    with pytest.raises(RematTraceError, match=r"output 1 is a _Holder holding a tensor.*register_pytree_node"):
        remat(returns_holder, fallback=False)(torch.randn(3, dtype=D, requires_grad=True))


# --- generator state --------------------------------------------------------------------


def _fork_and_reseed(x: torch.Tensor) -> torch.Tensor:
    a = F.dropout(x, 0.5)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        b = F.dropout(x, 0.5) * torch.rand_like(x)
    return (a * b * torch.rand_like(x)).sin()


def _freeze_and_reseed(x: torch.Tensor) -> torch.Tensor:
    """What OpInfo's `wrapper_set_seed` does around every random op it tests."""
    with freeze_rng_state():
        torch.manual_seed(42)
        return F.dropout(x, 0.3) * torch.rand_like(x)


def _same_mask_twice(x: torch.Tensor) -> torch.Tensor:
    state = torch.get_rng_state()
    a = F.dropout(x, 0.5)
    torch.set_rng_state(state)
    return a * F.dropout(x.cos(), 0.5) + torch.rand_like(x)


def _reseed_without_restore(x: torch.Tensor) -> torch.Tensor:
    y = x * torch.rand_like(x)
    torch.manual_seed(3)
    return y * torch.rand_like(x)


def _reseed_at_the_end(x: torch.Tensor) -> torch.Tensor:
    y = x.exp() * torch.rand_like(x)
    torch.manual_seed(5)
    return y


RESEEDING = {
    "fork_rng": _fork_and_reseed,
    "freeze_rng_state": _freeze_and_reseed,
    "same_mask_twice": _same_mask_twice,
    "without_restore": _reseed_without_restore,
    "at_the_end": _reseed_at_the_end,
}


def _seeded_runs(fn: Fn, transform: str) -> list[Any]:
    """Two calls, each from the same seed: values, gradients and the stream afterwards."""
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        x = torch.randn(4, 5, dtype=D)
        if transform == "backward":
            leaf = x.clone().requires_grad_()
            out = fn(leaf)
            (out**2).sum().backward()
            result: Any = (out.detach(), leaf.grad)
        elif transform == "grad":
            result = torch.func.grad_and_value(lambda x: (fn(x) ** 2).sum())(x)
        else:
            xs = torch.stack([x, x.cos(), -x])
            result = torch.func.vmap(torch.func.grad(lambda x: (fn(x) ** 2).sum()), randomness=transform)(xs)
        runs.append((result, torch.rand(3)))
    return runs


@pytest.mark.parametrize("transform", ["backward", "grad", "different", "same"])
@pytest.mark.parametrize("policy_name", ["none", "everything"])
@pytest.mark.parametrize("fn_name", list(RESEEDING))
def test_reseeding_inside_a_region_is_replayed(fn_name: str, policy_name: str, transform: str) -> None:
    """A draw after `manual_seed`, `fork_rng`, `freeze_rng_state` or `set_rng_state` of a
    state read inside draws what eager code draws, recompute too, and the stream after the
    call is where eager code leaves it."""
    fn = RESEEDING[fn_name]
    region = remat(fn, policy=CHANNEL_POLICIES[policy_name])
    assert_close(_seeded_runs(region, transform), _seeded_runs(fn, transform))


def test_a_generator_state_set_from_outside_is_refused() -> None:
    """A state saved outside the region and set inside: a graph would replay the state it
    saw when traced on every call, whatever the caller saved since."""
    saved = (torch.get_rng_state(),)  # in a tuple: read as it is, not traced as an input

    def f(x: torch.Tensor) -> torch.Tensor:
        torch.set_rng_state(saved[0])
        return x * torch.rand_like(x)

    x = torch.randn(3, dtype=D, requires_grad=True)
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    with pytest.raises(RematTraceError, match=r"a state that no seed gives.*torch.manual_seed\(n\)"):
        remat(f, fallback=False)(x)
    assert torch.equal(torch.rand(2), expected)  # the trace left the stream as it was


def _layer_drop(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if random.random() < 0.5:  # LayerDrop as some libraries write it
        return x * 1
    return x + torch.tanh(x @ w)


def _numpy_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) * float(numpy.random.uniform(0.5, 1.5))


@pytest.mark.parametrize("policy_name", list(CHANNEL_POLICIES))
@pytest.mark.parametrize("fn", [_layer_drop, _numpy_scale], ids=lambda f: f.__name__)
def test_a_draw_from_python_s_or_numpy_s_generator_runs_replayed_drawing_as_eager(fn: Fn, policy_name: str) -> None:
    """Python's `random` and numpy's global generator are Python a graph cannot hold (a
    trace would keep its draw for every call): the region runs replayed, saying so, and
    its recompute draws what its forward drew (torch.utils.checkpoint draws anew there);
    under a torch.func transform it is refused, naming the generators."""
    def run(region: Fn) -> list[Any]:
        random.seed(0)
        numpy.random.seed(0)
        w = torch.linspace(-1, 1, 16, dtype=D).reshape(4, 4).requires_grad_()
        seen: list[Any] = []
        for step in range(6):
            x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(step)).requires_grad_()
            out = region(x, w)
            out.pow(2).sum().backward()
            seen += [out.detach(), x.grad]
        return [*seen, w.grad, random.random(), float(numpy.random.rand())]

    with pytest.warns(remat_package.RematFallbackWarning, match="Python's `random` module or numpy's global generator"):
        actual = run(remat(fn, policy=CHANNEL_POLICIES[policy_name]))
    assert_close(actual, run(fn), rtol=0, atol=0)
    with pytest.raises(RematTraceError, match="draws from Python's `random` module or numpy's global generator"):
        torch.func.grad(lambda x: remat(fn)(x, torch.eye(4, dtype=D)).sum())(torch.ones(3, 4, dtype=D))


@pytest.mark.parametrize("how", ["print", "format"])
def test_printing_a_tensor_inside_a_region_prints_its_value(how: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Printing or formatting a tensor reads its value, which a trace on stand-ins does not
    have (it would print a FakeTensor, once): the region runs replayed and prints what
    eager code prints."""
    def f(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x)
        print(h.sum()) if how == "print" else print(f"{h.sum():.4f}")
        return h * x

    x = torch.linspace(-1, 1, 4, dtype=D, requires_grad=True)
    f(x)
    expected = capsys.readouterr().out
    with pytest.warns(remat_package.RematFallbackWarning, match="printing a tensor|formatting a tensor"):
        remat(f)(x)
    printed = capsys.readouterr().out
    assert printed.endswith(expected) and "FakeTensor" not in printed


# --- module hooks -----------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(4, 6, dtype=D)
        self.act = torch.nn.Tanh()
        self.down = torch.nn.Linear(6, 4, dtype=D)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(self.act(self.up(x))))


def _hooked_block(kind: str) -> tuple[_Block, list[Any], Callable[[], None]]:
    """A block whose submodules record what their hooks are given, in order."""
    torch.manual_seed(0)
    block = _Block()
    seen: list[Any] = []
    handles = []
    if kind == "forward":
        handles.append(block.up.register_forward_hook(lambda m, args, out: seen.append(("up", out))))
        handles.append(block.drop.register_forward_hook(lambda m, args, out: seen.append(("drop", args[0], out))))
    elif kind == "pre":
        handles.append(block.down.register_forward_pre_hook(lambda m, args: seen.append(("down", args[0]))))
    elif kind == "kwargs":
        handles.append(block.act.register_forward_pre_hook(lambda m, args, kwargs: seen.append(("pre", args[0], kwargs)), with_kwargs=True))
        handles.append(block.act.register_forward_hook(lambda m, args, kwargs, out: seen.append(("act", out)), with_kwargs=True))
    elif kind == "global":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def record_linear(m: torch.nn.Module, args: Any, out: Any) -> None:
            if isinstance(m, torch.nn.Linear):
                seen.append(("linear", out))

        handles.append(register_module_forward_hook(record_linear))
        handles.append(register_module_forward_pre_hook(lambda m, args: seen.append(("called", type(m).__name__))))
    return block, seen, lambda: [h.remove() for h in handles]


def _hooked_runs(kind: str, use_remat: bool, policy_name: str) -> Any:
    """Three calls; each loss reads what the hooks collected, so gradients flow through it."""
    block, seen, remove = _hooked_block(kind)
    region = remat(block, policy=CHANNEL_POLICIES[policy_name]) if use_remat else block
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    runs = []
    try:
        for _ in range(3):
            torch.manual_seed(1)
            del seen[:]
            out = region(x)
            collected = [t for entry in seen for t in entry[1:] if isinstance(t, torch.Tensor)]
            assert all(type(t) is torch.Tensor for t in collected), [type(t) for t in collected]
            loss = out.pow(2).sum() + sum((t * t.cos()).sum() for t in collected)
            grads = torch.autograd.grad(loss, [x, *block.parameters()])
            labels = [tuple(e if isinstance(e, str) else type(e).__name__ for e in entry) for entry in seen]
            runs.append((out.detach(), [t.detach() for t in collected], labels, grads, torch.rand(2)))
    finally:
        remove()
    return runs


@pytest.mark.parametrize("policy_name", list(CHANNEL_POLICIES))
@pytest.mark.parametrize("kind", ["forward", "pre", "kwargs", "global"])
def test_module_hooks_inside_a_region_run_on_every_call_with_real_values(kind: str, policy_name: str) -> None:
    """Forward and pre-hooks of the modules a region calls (their own and global ones) run
    on every call, in eager order, given real tensors tracked by autograd."""
    assert_close(_hooked_runs(kind, True, policy_name), _hooked_runs(kind, False, policy_name))


def test_module_hooks_under_torch_func_grad() -> None:
    """Under torch.func.grad what a hook collects is part of the differentiated function."""
    def loss_of(use_remat: bool) -> Any:
        block, seen, remove = _hooked_block("forward")
        region = remat(block, policy=P.nothing_saveable) if use_remat else block
        params = dict(block.named_parameters())

        def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            del seen[:]
            out = torch.func.functional_call(region, p, (x,))
            return out.sum() + sum(entry[1].pow(2).sum() for entry in seen)

        torch.manual_seed(1)
        try:
            return [torch.func.grad(loss)(params, torch.randn(3, 4, dtype=D)) for _ in range(2)]
        finally:
            remove()

    assert_close(loss_of(True), loss_of(False))


def test_a_hook_registered_or_removed_after_a_call_is_seen() -> None:
    block, seen, remove = _hooked_block("none")
    region = remat(block)
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    region(x).sum().backward()
    handle = block.down.register_forward_hook(lambda m, args, out: seen.append(out))
    region(x).sum().backward()
    assert len(seen) == 1 and type(seen[0]) is torch.Tensor
    handle.remove()
    region(x).sum().backward()
    assert len(seen) == 1


def test_a_hook_that_replaces_the_output_is_refused() -> None:
    block, _, _ = _hooked_block("none")
    block.act.register_forward_hook(lambda m, args, out: out * 2)
    with pytest.raises(remat_package.RematError, match=r"forward hook `.*<lambda>` on Tanh returned a value"):
        remat(block)(torch.randn(3, 4, dtype=D, requires_grad=True))


def test_a_hook_given_a_tensor_changed_in_place_afterwards_is_refused() -> None:
    """The hook runs after the graph, where the value it was given is gone."""
    seen: list[torch.Tensor] = []
    layer = torch.nn.Linear(4, 4, dtype=D)
    layer.register_forward_hook(lambda m, args, out: seen.append(out.sum()))

    def f(x: torch.Tensor) -> torch.Tensor:
        out = layer(x)
        out += 1
        return out.relu()

    with pytest.raises(RematTraceError, match=r"forward hook .* on Linear is given a tensor that the function then changes in place"):
        remat(f, fallback=False)(torch.randn(3, 4, dtype=D, requires_grad=True))


def test_a_hook_that_returns_what_it_was_given_changes_nothing() -> None:
    """`dict.setdefault(key, out)` returns `out`: eager code keeps the output as it is."""
    kept: dict[str, torch.Tensor] = {}
    layer = torch.nn.Linear(4, 4, dtype=D)
    layer.register_forward_hook(lambda m, args, out: kept.setdefault("out", out))
    layer.register_forward_pre_hook(lambda m, args: args)
    x = torch.randn(2, 4, dtype=D, requires_grad=True)
    out = remat(lambda x: layer(x).tanh())(x)
    assert_close(out, layer(x).tanh())
    assert type(kept["out"]) is torch.Tensor


def test_a_full_backward_hook_inside_a_region_is_refused_naming_it() -> None:
    block = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=D), torch.nn.Tanh())
    block[0].register_full_backward_hook(lambda m, grad_in, grad_out: None)
    with pytest.raises(RematTraceError, match=r"full backward hook .* outside the remat'd function"):
        remat(block, fallback=False)(torch.randn(2, 4, dtype=D, requires_grad=True))


def _reparametrized(kind: str) -> torch.nn.Module:
    import torch.nn.utils.parametrizations as parametrizations
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 6, dtype=D), torch.nn.Tanh(), torch.nn.Linear(6, 4, dtype=D))
    if kind == "weight_norm":
        torch.nn.utils.weight_norm(block[0])
    elif kind == "spectral_norm":
        torch.nn.utils.spectral_norm(block[0])
        torch.nn.utils.spectral_norm(block[2], n_power_iterations=2)
    elif kind == "prune":
        prune.l1_unstructured(block[0], "weight", amount=0.5)
    elif kind == "parametrizations.spectral_norm":
        parametrizations.spectral_norm(block[0])
    else:
        parametrizations.weight_norm(block[0])
    return block


@pytest.mark.parametrize("policy_name", list(CHANNEL_POLICIES))
@pytest.mark.parametrize(
    "kind", ["weight_norm", "spectral_norm", "prune", "parametrizations.spectral_norm", "parametrizations.weight_norm"]
)
def test_weights_reparametrized_before_each_forward_train_as_in_eager_code(kind: str, policy_name: str) -> None:
    """torch.nn.utils.weight_norm, spectral_norm and prune set a module's weight, computed
    from its parameters, in a forward pre-hook (spectral_norm also steps its power
    iteration in place, with `out=`). remat calls a region's hooks after its graph, so such
    a region runs replayed, its recompute starting from the vectors as they were before the
    forward (torch.utils.checkpoint starts from the stepped ones: another gradient). The
    parametrizations of torch.nn.utils.parametrizations are traced. Three optimizer steps:
    outputs, gradients and buffers as without remat."""
    def train(use_remat: bool) -> list[torch.Tensor]:
        block = _reparametrized(kind)
        step = remat(block, policy=CHANNEL_POLICIES[policy_name]) if use_remat else block
        optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
        x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1))
        seen: list[torch.Tensor] = []
        for _ in range(3):
            optimizer.zero_grad()
            out = step(x)
            out.pow(2).sum().backward()
            seen += [out.detach(), *(p.grad.clone() for p in block.parameters()), *(b.clone() for b in block.buffers())]
            optimizer.step()
        return seen

    hooked = not kind.startswith("parametrizations")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = train(use_remat=True)
    said = [str(w.message) for w in caught if issubclass(w.category, remat_package.RematFallbackWarning)]
    assert bool(said) == hooked and all("sets the module's `weight`" in text for text in said)
    assert_close(actual, train(use_remat=False), rtol=1e-12, atol=1e-14)


class _Gate(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4, dtype=D)
        self.register_buffer("scale", torch.ones(4, dtype=D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def _rebinds(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
    module.scale = args[0].detach().abs().mean(0)


def _writes(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
    with torch.no_grad():
        module.scale.copy_(args[0].abs().mean(0))


@pytest.mark.parametrize("hook", [_rebinds, _writes], ids=lambda h: h.__name__)
def test_a_pre_hook_that_changes_what_the_forward_reads_is_refused_naming_it(hook: Callable[..., None]) -> None:
    """A forward pre-hook of a module inside a region that sets or writes a tensor of the
    module: remat calls hooks after the region's graph, which has read the tensor as it
    was, so the first call raises, naming the hook, the module and the tensor."""
    gate = _Gate()
    gate.register_forward_pre_hook(hook)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=D), gate)
    x = torch.randn(3, 4, dtype=D)
    with pytest.raises(RematError, match=rf"forward pre-hook `{hook.__name__}` on _Gate changes the module's `scale`"):
        remat(block)(x)


# ---------------------------------------------------------------- kernel switches


def _attention(q: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, q, q, is_causal=True).sin()


def test_a_call_under_other_kernel_switches_runs_the_kernels_eager_code_runs() -> None:
    """`sdpa_kernel` (and torch.backends' switches) choose which op scaled_dot_product_attention
    traces to: the flash kernel on CPU, or its math decomposition. The same wrapper called
    under another choice must run the other kernels, bit for bit as eager code does."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    f = remat(_attention)
    q = torch.randn(2, 2, 16, 8, requires_grad=True)  # float32: the two kernels round differently
    for kernel in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
        with sdpa_kernel(kernel):
            expected = _attention(q)
            actual = f(q)
            assert torch.equal(actual, expected), kernel
            assert torch.equal(*(torch.autograd.grad(out.sum(), q)[0] for out in (actual, expected))), kernel
    assert f.cache_info()["traces"] == 2  # one per choice; the third call finds the first plan
    outputs = []
    for kernel in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        with sdpa_kernel(kernel):
            outputs.append(_attention(q))
    assert not torch.equal(*outputs)  # the choice matters here: a stale plan could not pass


def _factory(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.linspace(0, 1, 3) * x).sin(), torch.ones(2)


def test_a_call_under_another_default_dtype_or_device_makes_what_eager_code_makes() -> None:
    """A factory not told its dtype or device (`torch.ones(2)`) takes the defaults of the
    call: `set_default_dtype`, `with torch.device(...)`. The same wrapper under other
    defaults must make what eager code makes, not what the first call's trace wrote."""
    f = remat(_factory)
    x = torch.randn(3, dtype=D, requires_grad=True)
    previous = torch.get_default_dtype()
    try:
        for default in (torch.float32, torch.float64, torch.float32):
            torch.set_default_dtype(default)
            actual, expected = f(x), _factory(x)
            assert_close(actual, expected)
            assert_close(torch.autograd.grad(actual[0].sum(), x), torch.autograd.grad(expected[0].sum(), x))
    finally:
        torch.set_default_dtype(previous)
    assert f.cache_info()["traces"] == 2  # float32, float64

    def made(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sin(), torch.ones(2)

    g = remat(made)
    assert g(x)[1].device.type == "cpu"
    with torch.device("meta"):
        assert g(x)[1].device.type == made(x)[1].device.type == "meta"
    assert g(x)[1].device.type == "cpu"
    assert g.cache_info()["traces"] == 2  # and one under the device context


def _contract(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.einsum("ij,jk,kl->il", a, b, c)


def test_einsum_contracts_in_the_order_its_switch_says_at_the_call() -> None:
    """`torch.backends.opt_einsum.enabled` decides einsum's contraction order when it is
    called: (a b) c or a (b c) round differently in float32."""
    f = remat(_contract)
    a, b, c = (torch.randn(s, requires_grad=True) for s in [(40, 3), (3, 50), (50, 60)])
    results = []
    with torch.backends.opt_einsum.flags(enabled=True):
        assert torch.equal(f(a, b, c), _contract(a, b, c))
        results.append(_contract(a, b, c))
    with torch.backends.opt_einsum.flags(enabled=False):
        actual, expected = f(a, b, c), _contract(a, b, c)
        assert torch.equal(actual, expected)
        assert_close(torch.autograd.grad(actual.sum(), [a, b, c]), torch.autograd.grad(expected.sum(), [a, b, c]))
        results.append(expected)
    assert not torch.equal(*results)  # the order matters here: a stale plan could not pass
