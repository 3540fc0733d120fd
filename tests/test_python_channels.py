"""What the user's Python does inside a region besides aten ops, each channel captured in the
graph or refused by name, against the same code without remat (float64).

remat runs a function's Python once, on fake tensors, and replays the aten graph it
recorded. Grad mode, module hooks, tensor hooks, generator state, side effects and the
ops a policy runs to decide are not aten ops of that graph: each test here checks one of
them against eager code, under every transform the channel meets.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import remat as remat_package
from remat import RematTraceError, remat
from remat import policies as P

from conftest import assert_close
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


GRAD_MODES = {
    "no_grad": _no_grad_block,
    "set_grad_enabled": _set_grad_enabled_false,
    "inference_mode": _inference_mode,
    "no_grad_helper": _no_grad_helper,
    "enable_grad_inside": _enable_grad_inside_no_grad,
}


@pytest.mark.parametrize("transform", CHANNEL_TRANSFORMS)
@pytest.mark.parametrize("policy_name", list(CHANNEL_POLICIES))
@pytest.mark.parametrize("fn_name", list(GRAD_MODES))
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


def test_an_in_place_change_with_grad_off_of_a_tracked_value_is_refused() -> None:
    """Eager autograd differentiates a later read as if the value had not changed: no
    functional graph says that, so remat refuses and names the line."""
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        with torch.no_grad():
            y.clamp_(-1, 1)
        return (y * x).sum()

    x = torch.randn(5, dtype=D, requires_grad=True)
    with pytest.raises(RematTraceError, match=r"test_python_channels.py:\d+ it changes .* in place with grad disabled \(aten.clamp_.default\)"):
        remat(f)(x)


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


# --- what a policy runs -----------------------------------------------------------------


class _RunsTheOp:
    """A user policy that runs the op to look at its output, as `keep_outputs_where` does."""

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        kwargs.pop("name", None)
        out = op(*args, **kwargs)
        return isinstance(out, torch.Tensor) and out.device.type == "meta" and out.numel() < 16


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
        remat(fn)(x)
    with pytest.raises(RematTraceError, match="would be dropped"):
        torch.func.grad(remat(fn))(x.detach())


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


def test_a_computed_tensor_stored_where_the_caller_sees_it_is_refused() -> None:
    box: dict[str, torch.Tensor] = {}

    def stores(x: torch.Tensor) -> torch.Tensor:
        h = x.sin()
        box["h"] = h
        return h.sum()

    with pytest.raises(RematTraceError, match=r"stores a tensor it computes in `box\['h'\]`|stores a tensor it computes in `box.h`"):
        remat(stores)(torch.randn(3, dtype=D, requires_grad=True))


def test_an_output_object_optree_does_not_flatten_is_refused() -> None:
    def returns_holder(x: torch.Tensor) -> Any:
        return x.sin(), _Holder(x.cos())

    with pytest.raises(RematTraceError, match=r"output 1 is a _Holder holding a tensor.*register_pytree_node"):
        remat(returns_holder)(torch.randn(3, dtype=D, requires_grad=True))
