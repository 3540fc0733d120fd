"""Tracing happens once per signature; what cannot be traced says why and what to do."""

from __future__ import annotations

import pytest
import torch

from remat import RematTraceError, remat
from remat import policies as P

from conftest import assert_close

D = torch.float64


def mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) @ w


def _leaf(*shape: int, dtype: torch.dtype = D, requires_grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


def test_same_signature_does_not_retrace() -> None:
    f = remat(mlp)
    for _ in range(3):
        f(_leaf(2, 3), _leaf(3, 3)).sum().backward()
    assert f.cache_info() == {"hits": 2, "traces": 1, "specialized": 0, "like": 0, "replays": 0, "size": 1, "maxsize": 64}


@pytest.mark.parametrize(
    "change",
    ["shape", "dtype", "requires_grad", "static", "autocast", "transposed"],
)
def test_signature_changes_retrace(change: str) -> None:
    f = remat(lambda x, w, scale: mlp(x, w) * scale)
    f(_leaf(2, 3), _leaf(3, 3), 2.0).sum().backward()
    x, w, scale = _leaf(2, 3), _leaf(3, 3), 2.0
    if change == "shape":
        x = _leaf(4, 3)
    elif change == "dtype":
        x, w = _leaf(2, 3, dtype=torch.float32), _leaf(3, 3, dtype=torch.float32)
    elif change == "requires_grad":
        x = _leaf(2, 3, requires_grad=False)
    elif change == "static":
        scale = 3.0
    elif change == "transposed":
        x = _leaf(3, 2).t()
    if change == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = f(x.float(), w.float(), scale)
    else:
        out = f(x, w, scale)
    out.float().sum().backward()
    assert f.cache_info()["traces"] == 2
    if change == "static":
        assert_close(out, mlp(x, w) * 3.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_new_device_retraces() -> None:
    f = remat(mlp)
    f(_leaf(2, 3), _leaf(3, 3)).sum().backward()
    out = f(_leaf(2, 3).cuda(), _leaf(3, 3).cuda())
    assert out.device.type == "cuda" and f.cache_info()["traces"] == 2


def test_data_dependent_control_flow_names_the_function_and_the_fix() -> None:
    def branchy(x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x

    with pytest.raises(RematTraceError, match=r"branchy.*test_caching_and_errors.py:\d+(?s:.*)static_argnums"):
        remat(branchy, fallback=False)(_leaf(3))


def test_item_names_the_function_and_the_fix() -> None:
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().item()

    with pytest.raises(RematTraceError, match=r"scaled(?s:.*)\.item\(\)(?s:.*)static_argnums"):
        remat(scaled, fallback=False)(_leaf(3))


def test_static_arguments_allow_python_control_flow() -> None:
    def repeat(x: torch.Tensor, n: int, flag: bool) -> torch.Tensor:
        for _ in range(n):
            x = torch.sin(x) if flag else torch.cos(x)
        return x

    f = remat(repeat, policy=P.everything_saveable)
    x = _leaf(3)
    for n, flag in [(2, True), (3, False)]:
        assert_close(torch.autograd.grad(f(x, n, flag).sum(), x), torch.autograd.grad(repeat(x, n, flag).sum(), x))
    g = remat(lambda x, cfg: repeat(x, *cfg), static_argnums=1)
    assert_close(g(x, (2, True)), repeat(x, 2, True))


def test_unhashable_static_leaf_is_a_type_error_naming_the_path() -> None:
    f = remat(lambda x, opts: x * 2)
    with pytest.raises(TypeError, match=r"opts\['cfg'\].*hashable"):
        f(_leaf(3), {"cfg": {1, 2}})


def test_grad_disabled_simply_runs() -> None:
    calls = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(type(x))
        return x * 2

    f = remat(fn)
    with torch.no_grad():
        assert_close(f(_leaf(3)).requires_grad, False)
    assert calls == [torch.Tensor] and f.cache_info()["traces"] == 0


def test_nothing_requiring_grad_runs_the_function() -> None:
    f = remat(mlp)
    x, w = _leaf(2, 3, requires_grad=False), _leaf(3, 3, requires_grad=False)
    assert_close(f(x, w), mlp(x, w))
    assert not f(x, w).requires_grad


def test_outputs_are_pytrees_with_static_and_integer_leaves() -> None:
    def fn(x: torch.Tensor, p: dict[str, torch.Tensor]) -> dict[str, object]:
        y = torch.tanh(x @ p["w"])
        return {"y": y, "argmax": y.argmax(-1), "pair": (y.sum(), None), "label": "ok", "n": 3}

    x, p = _leaf(2, 3), {"w": _leaf(3, 3)}
    out, ref = remat(fn, policy=P.dots_saveable)(x, p), fn(x, p)
    assert out["label"] == "ok" and out["n"] == 3 and out["pair"][1] is None
    assert out["argmax"].dtype == torch.int64 and not out["argmax"].requires_grad
    assert_close(out["y"], ref["y"])
    assert_close(torch.autograd.grad(out["pair"][0], p["w"]), torch.autograd.grad(ref["pair"][0], p["w"]))


def test_integer_and_boolean_inputs() -> None:
    def fn(x: torch.Tensor, idx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, torch.sin(x[idx]), 0.0)

    x, idx, mask = _leaf(5), torch.tensor([0, 2, 2, 4]), torch.tensor([True, False, True, True])
    assert_close(
        torch.autograd.grad(remat(fn)(x, idx, mask).sum(), x), torch.autograd.grad(fn(x, idx, mask).sum(), x)
    )


def test_returning_an_input_and_duplicate_outputs() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = torch.sin(x @ w)
        return x, y, y

    x, w = _leaf(2, 3), _leaf(3, 3)
    got = remat(fn)(x, w)
    want = fn(x, w)
    assert_close(got, want)
    loss = lambda outs: outs[0].sum() + (outs[1] * 2).sum() + outs[2].pow(2).sum()  # noqa: E731
    assert_close(torch.autograd.grad(loss(got), [x, w]), torch.autograd.grad(loss(want), [x, w]))


def test_policy_must_return_a_bool() -> None:
    def maybe(op: object, *args: object, **kwargs: object) -> object:
        return 1

    with pytest.raises(TypeError, match=r"maybe.*returned 1.*aten\."):
        remat(mlp, policy=maybe)(_leaf(2, 3), _leaf(3, 3))


def test_policy_must_be_callable_and_hashable() -> None:
    with pytest.raises(TypeError, match="policy must be a callable"):
        remat(mlp, policy="dots")
