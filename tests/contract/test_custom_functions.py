"""Custom torch.autograd.Functions inside a region, under torch.func transforms, against
the same function without remat.

Every Function here has a backward that is not the derivative of its forward's ops
(clipped, scaled, straight-through, or a kernel of its own), so a region that traced the
forward's ops and differentiated them would give another gradient: each test fails if
the Function's own backward is not the one that runs. Outside transforms such a region
runs replayed (tests/contract/test_fallback.py).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.func import grad, vjp, vmap

from remat import RematError, RematFallbackWarning, checkpoint_layers, checkpoint_name, remat
from remat import policies as P

from conftest import BUILT_IN_POLICIES

D = torch.float64


class SavesInput(torch.autograd.Function):
    """tanh, whose backward clips the gradient where |x| >= 1 (not tanh's derivative)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        return torch.tanh(x) * scale

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return g * ctx.scale * (x.abs() < 1).to(g.dtype), None


class SavesOutput(torch.autograd.Function):
    """exp, whose backward is 0.5 * out * g (half the derivative)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.exp(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (out,) = ctx.saved_tensors
        return 0.5 * out * g


class SavesIntermediate(torch.autograd.Function):
    """(x * w).sin() with an intermediate kept; the gradient of w is scaled by 3."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        h = x * w
        return h.sin(), h

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        ctx.save_for_backward(inputs[0], inputs[1], output[1])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, gh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, w, h = ctx.saved_tensors
        total = g * h.cos() + gh
        return total * w, 3 * total * x


class TwoOutputsOneConstant(torch.autograd.Function):
    """(x * 2, argmax of x) with the second marked non-differentiable; straight-through."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return x.round() * 2, x.argmax(-1)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _: Any) -> torch.Tensor:  # type: ignore[override]
        return g * 2  # straight through round


class AttentionLike(torch.autograd.Function):
    """Flash-attention-shaped: keeps the output and a logsumexp, and its backward is its
    own computation from those (here with the softmax's gradient halved)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        scores = q @ k.transpose(-1, -2)
        lse = scores.logsumexp(-1, keepdim=True)
        return (scores - lse).exp() @ v, lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        q, k, v = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        p = (q @ k.transpose(-1, -2) - lse).exp()
        dv = p.transpose(-1, -2) @ g
        dp = g @ v.transpose(-1, -2)
        ds = 0.5 * p * (dp - (g * out).sum(-1, keepdim=True))
        return ds @ k, ds.transpose(-1, -2) @ q, dv


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = SavesInput.apply(x @ w, 1.5)
    e = SavesOutput.apply(h * 0.3)
    s, pre = SavesIntermediate.apply(e, w[0])
    r, index = TwoOutputsOneConstant.apply(s)
    a, _ = AttentionLike.apply(r, pre, h)
    return (a @ w).sin().sum() + index.to(D).sum() * 0


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 4, dtype=D, generator=g), torch.randn(4, 4, dtype=D, generator=g) * 0.5


def _assert_equal(actual: Any, expected: Any) -> None:
    for a, e in zip(torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected), strict=True):
        assert torch.equal(a, e), (a, e)


TRANSFORMS: dict[str, Callable[[Callable[..., torch.Tensor], torch.Tensor, torch.Tensor], Any]] = {
    "grad": lambda f, x, w: grad(f, argnums=(0, 1))(x, w),
    "vjp": lambda f, x, w: vjp(f, x, w)[1](torch.tensor(1.5, dtype=D)),
    "vmap_grad": lambda f, x, w: vmap(grad(f, argnums=(0, 1)), in_dims=(0, None))(torch.stack([x, x.flip(0)]), w),
}


@pytest.mark.parametrize("policy_name", list(BUILT_IN_POLICIES))
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_custom_functions_under_transforms_run_their_own_backward(transform: str, policy_name: str) -> None:
    """Functions that keep inputs, outputs and intermediates, return several outputs and
    non-differentiable ones, and an attention-shaped one: gradients equal no remat, bitwise."""
    x, w = _inputs()
    expected = TRANSFORMS[transform](_block, x, w)
    region = remat(_block, policy=BUILT_IN_POLICIES[policy_name])
    _assert_equal(TRANSFORMS[transform](region, x, w), expected)
    hits = region.cache_info()["hits"]
    _assert_equal(TRANSFORMS[transform](region, x, w), expected)  # from the cache
    assert region.cache_info()["hits"] == hits + 1 and region.cache_info()["replays"] == 0


@pytest.mark.parametrize("policy_name", list(BUILT_IN_POLICIES))
def test_custom_functions_under_backward_replay_with_their_own_backward(policy_name: str) -> None:
    """Outside transforms the same region runs replayed: `.backward()` equals no remat, bitwise."""
    x, w = _inputs()
    expected = torch.autograd.grad(_block(x.requires_grad_(), w.requires_grad_()), (x, w))
    with pytest.warns(RematFallbackWarning, match="SavesInput"):
        actual = torch.autograd.grad(remat(_block, policy=BUILT_IN_POLICIES[policy_name])(x, w), (x, w))
    _assert_equal(actual, expected)


class PairOneConstant(torch.autograd.Function):
    """(x @ w, tanh(x)), the second marked non-differentiable; x's gradient passes straight
    through the matmul, w gets none."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return x @ w, torch.tanh(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _: Any) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return g, None


@pytest.mark.parametrize("join", ["stack", "stack reversed", "cat"])
def test_a_function_whose_outputs_are_first_read_inside_a_list_runs_its_own_backward(join: str) -> None:
    """`torch.stack([a, b])` hands the Function's outputs over in a list: the region still
    sees the Function (and runs replayed) instead of differentiating its forward's ops."""
    x, w = _inputs()

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        pair = list(PairOneConstant.apply(x, w))
        if join == "cat":
            return torch.cat(pair).sin().sum()
        return (x * 3 + torch.stack(pair if join == "stack" else pair[::-1]).mean(0)).sin().sum()

    expected = torch.autograd.grad(f(x.requires_grad_(), w), x)
    with pytest.warns(RematFallbackWarning, match="PairOneConstant"):
        actual = torch.autograd.grad(remat(f)(x, w), x)
    _assert_equal(actual, expected)


class OldStyle(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g


class NoVmapRule(torch.autograd.Function):
    """Passes its gradient through; no vmap rule."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * 2

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g


class DrawsInForward(NoVmapRule):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * torch.rand_like(x)


class WritesItsInput(NoVmapRule):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.mul_(2)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.mark_dirty(inputs[0])


def test_what_torch_refuses_under_transforms_is_refused_as_torch_refuses_it() -> None:
    """Without remat, torch raises for a Function without setup_context under any
    transform, and for one without a vmap rule under vmap: so does a region."""
    x = torch.randn(3, dtype=D)

    def old(x: torch.Tensor) -> torch.Tensor:
        return OldStyle.apply(x.sin()).sum()

    with pytest.raises(RuntimeError, match="setup_context"):
        grad(old)(x)
    with pytest.raises(RematError, match=r"`OldStyle` has no `setup_context`.*torch\.func"):
        grad(remat(old))(x)

    def no_rule(x: torch.Tensor) -> torch.Tensor:
        return NoVmapRule.apply(x.sin()).sum()

    with pytest.raises(RuntimeError, match="vmap"):
        vmap(grad(no_rule))(x[None])
    with pytest.raises(RematError, match=r"`NoVmapRule` has no vmap rule.*generate_vmap_rule"):
        vmap(grad(remat(no_rule)))(x[None])
    assert torch.equal(grad(remat(no_rule))(x), grad(no_rule)(x))  # no vmap: no rule needed


@pytest.mark.parametrize("function", [DrawsInForward, WritesItsInput])
def test_a_function_a_replay_would_not_reproduce_is_refused_naming_it_and_the_fix(function: type) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return function.apply(x.sin()).sum()

    refused = r"(draws random numbers|writes in place into an argument)"
    with pytest.raises(RematError, match=rf"`{function.__name__}` {refused}"):
        grad(remat(f))(torch.randn(3, dtype=D))


_clip = SavesInput.apply  # bound once, as libraries write it (`gelu = GeLUFunction.apply`)


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_a_function_applied_through_an_apply_bound_beforehand_is_traced_as_a_unit(transform: str) -> None:
    x, w = _inputs()

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _clip(x @ w, 1.5).sin().sum()

    region = remat(f, policy=P.nothing_saveable)
    _assert_equal(TRANSFORMS[transform](region, x, w), TRANSFORMS[transform](f, x, w))


class IgnoresItsFirstArgument(torch.autograd.Function):
    """y * 2, whose backward gives x (which the forward never reads) a gradient."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return y * 2

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        (out,) = ctx.saved_tensors
        return g * out, g * 2


def test_an_argument_drawn_at_random_that_only_the_backward_reads_is_refused_naming_it_and_the_fix() -> None:
    """Eager code draws the noise in forward; in a traced graph nothing forward reads it,
    so backward would draw it again from the generator as it is then."""
    x, w = _inputs()

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        noisy = x * torch.rand_like(x)
        return IgnoresItsFirstArgument.apply(noisy, x @ w).sum()

    with pytest.raises(RematError, match=r"`IgnoresItsFirstArgument` does not read its tensor argument 0.*pass it in"):
        grad(remat(f))(x, w)

    def g(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # the same without a draw is traced
        return IgnoresItsFirstArgument.apply(x.sin(), x @ w).sum()

    _assert_equal(grad(remat(g), argnums=(0, 1))(x, w), grad(g, argnums=(0, 1))(x, w))


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_an_input_a_function_and_other_ops_read_gets_eager_s_bf16_gradient_bitwise(transform: str) -> None:
    """Autograd adds an input's gradient terms as their nodes finish: the Function's term
    comes in its place among the others (in bfloat16 another order rounds otherwise)."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 4, generator=g).bfloat16(), torch.randn(4, 4, generator=g).bfloat16()

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.square() + IgnoresItsFirstArgument.apply(x, x @ w) + x.exp()).sum()

    cotangent = torch.tensor(1.5, dtype=torch.bfloat16)
    run = {
        "grad": lambda f: grad(f, argnums=(0, 1))(x, w),
        "vjp": lambda f: vjp(f, x, w)[1](cotangent),
        "vmap_grad": lambda f: vmap(grad(f, argnums=(0, 1)), in_dims=(0, None))(torch.stack([x, x.flip(0)]), w),
    }[transform]
    _assert_equal(run(remat(f, policy=P.nothing_saveable)), run(f))


def test_a_gradient_of_a_gradient_through_a_function_is_refused_naming_it_and_the_fix() -> None:
    """Eager differentiates the Function's backward, whose saved output carries the
    Function's own derivative; a traced backward's would be exp's (twice eager's here)."""
    x, w = _inputs()

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return SavesOutput.apply(x @ w).sum()

    grad(lambda x, w: grad(f)(x, w).sin().sum())(x, w)  # torch runs it
    with pytest.raises(RematError, match=r"gradient of a gradient through .*`SavesOutput`.*inner gradient outside"):
        grad(lambda x, w: grad(remat(f))(x, w).sin().sum())(x, w)



class Doubles(torch.autograd.Function):
    """The same forward as `Halves`, another backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.exp()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return 2 * ctx.saved_tensors[0] * g


class Halves(Doubles):
    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return 0.5 * ctx.saved_tensors[0] * g


def test_regions_whose_graphs_differ_only_in_the_function_do_not_share_a_plan() -> None:
    """Two regions tracing the same ops (the same forward) share a plan when nothing else
    differs; with Functions whose backwards differ, each keeps its own."""
    x = torch.randn(4, dtype=D)
    for function in (Doubles, Halves):
        def f(x: torch.Tensor, function: Any = function) -> torch.Tensor:
            return function.apply(x.sin()).sum()

        _assert_equal(grad(remat(f, policy=P.nothing_saveable))(x), grad(f)(x))


def test_a_function_under_autocast_is_refused_naming_it_and_the_fix() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return SavesOutput.apply(x.sin()).float().sum()

    with pytest.raises(RematError, match=r"`SavesOutput` is applied under autocast.*outside the autocast context"):
        grad(remat(f))(torch.randn(3))


class ReturnsAView(torch.autograd.Function):
    """Its input flattened (a view), the gradient doubled."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view(-1)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.shape = inputs[0].shape

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (g * 2).view(ctx.shape)


class OnceDifferentiable(torch.autograd.Function):
    """x ** k, k and None; a once-differentiable backward that is |x| * g."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, k: int) -> tuple[torch.Tensor, int, None]:  # type: ignore[override]
        return x.pow(k), k, None

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: torch.Tensor, *_: Any) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return g * ctx.saved_tensors[0].abs(), None


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, k, _ = OnceDifferentiable.apply(self.linear(x), 3)
        named = checkpoint_name(y.tanh(), "y")
        return ReturnsAView.apply(named).view(x.shape) * k + inner_region(x)


inner_region = remat(lambda x: torch.sin(x) * 2, policy=P.nothing_saveable)


@pytest.mark.parametrize("policy_name", ["none", "nothing", "dots", "names"])
def test_layers_with_functions_train_functionally_as_without_remat(policy_name: str) -> None:
    """checkpoint_layers, functional_call and grad / vmap(grad): a Function returning a
    view, one with a once-differentiable backward and non-tensor outputs, a name and a
    nested region in the layer."""
    policy = P.save_only_these_names("y") if policy_name == "names" else BUILT_IN_POLICIES[policy_name]
    torch.manual_seed(0)
    reference = torch.nn.Sequential(_Layer(), _Layer())
    model = torch.nn.Sequential(_Layer(), _Layer())
    model.load_state_dict(reference.state_dict())
    checkpoint_layers(model, policy)
    x = torch.randn(4, 6, dtype=D, generator=torch.Generator().manual_seed(1))

    def loss(params: dict[str, torch.Tensor], module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(module, params, (x,)).sin().sum()

    for style, batch in ((grad(loss), x), (vmap(grad(loss), in_dims=(None, None, 0)), x[:, None])):
        expected = style(dict(reference.named_parameters()), reference, batch)
        _assert_equal(style(dict(model.named_parameters()), model, batch), expected)
