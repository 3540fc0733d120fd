"""The joint forward+backward trace is recorded by remat's light tracer (remat/_recording.py)
instead of make_fx where it can be; make_fx is the oracle: for torch's OpInfo samples and
for real models, every joint graph the recorder makes must be the graph make_fx makes
(tests/recording_oracle.py), and what the recorder leaves to make_fx must still match no
remat. Gradients through recorded joints are checked everywhere else in the suite."""

from __future__ import annotations

import model_zoo as Z
import pytest
import torch
from opinfo_cases import OPS, make_case, samples
from recording_oracle import refuse_recording, run_compared

import remat
import remat._tracing
from remat import RematError
from remat import policies as P

from conftest import assert_close


@pytest.mark.opinfo
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("op_name", list(OPS))
def test_recorded_joint_is_make_fx_joint_for_opinfo_samples(op_name: str, record_property: pytest.RecordProperty) -> None:
    """The first sample of every OpInfo op (and its non-contiguous copy), forward and
    backward through remat: each joint the recorder makes equals make_fx's."""
    rows = []
    chosen = list(samples(OPS[op_name]))
    for sample in chosen[:1] + chosen[1:][-1:]:
        case = make_case(OPS[op_name], sample)
        if case is None:
            continue
        primals = [p.clone().requires_grad_() for p in case.primals]
        try:
            case.fn(*primals)
        except Exception:  # torch itself cannot: nothing to trace
            continue
        region = remat.remat(case.fn, policy=P.nothing_saveable)

        def forward_and_backward() -> None:
            floating, _ = region(*primals)
            if floating:
                sum(o.real.sum() for o in floating).backward()

        try:
            outcomes = run_compared(forward_and_backward)
        except RematError:
            rows.append(("joint recorder", "refused"))
            continue
        rows += [("joint recorder", outcome) for outcome in outcomes]
    record_property("opinfo", rows)


def _model_step(case: Z.Case) -> None:
    torch.manual_seed(0)
    model = case.build()
    remat.checkpoint_layers(case.layers(model), P.dots_saveable)
    batch = case.batch(Z.BATCH)
    case.loss(model(**case.model_kwargs(batch)), batch).backward()


@pytest.mark.parametrize("case", Z.HF_CASES + Z.OWN_CASES, ids=lambda c: c.name)
def test_recorded_joint_is_make_fx_joint_for_models(case: Z.Case) -> None:
    """Llama, GPT-2, BERT (sdpa and eager, dropout on) and our own models: every layer's
    joint is recorded, none left to make_fx, and each equals make_fx's."""
    outcomes = run_compared(lambda: _model_step(case))
    assert outcomes and set(outcomes) == {"recorded"}, outcomes


def test_constants_in_the_graph_are_recorded_as_make_fx_records_them() -> None:
    """A tensor made inside the function from data (`torch.tensor`: a constant the graph
    holds) and one it closes over: recorded, the same graph as make_fx's, and the
    gradients of no remat."""
    scale = torch.tensor([1.5, -2.0, 0.5], dtype=torch.float64)

    def f(x: torch.Tensor) -> torch.Tensor:
        return (torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64) * x.sin() * scale).exp().sum(0)

    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    cotangent = torch.ones(3, dtype=torch.float64)
    expected = torch.autograd.grad(f(x), x, cotangent)
    for policy in (P.nothing_saveable, P.everything_saveable):
        got: list[tuple[torch.Tensor, ...]] = []
        outcomes = run_compared(lambda: got.append(torch.autograd.grad(remat.remat(f, policy=policy)(x), x, cotangent)))
        assert outcomes == ["recorded"]
        assert_close(got[0], expected)


@torch.library.custom_op("remat_test::scaled_sin", mutates_args=())
def _scaled_sin(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 3


@_scaled_sin.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _scaled_sin_backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
    return grad * ctx.saved_tensors[0].cos() * 3  # type: ignore[attr-defined]


_scaled_sin.register_autograd(_scaled_sin_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


def test_a_custom_op_is_left_to_make_fx_and_matches_no_remat() -> None:
    """A custom op's derivative is Python, which may treat the recorder unlike make_fx:
    a region with one is traced by make_fx, and its gradients are no remat's."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return _scaled_sin(x.exp()).sum()

    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(f(x), x)
    got: list[tuple[torch.Tensor, ...]] = []
    outcomes = run_compared(lambda: got.append(torch.autograd.grad(remat.remat(f)(x), x)))
    assert outcomes == ["make_fx"]
    assert_close(got[0], expected)


def test_an_error_in_a_recorded_joint_is_make_fx_s_error() -> None:
    """A derivative that cannot run without data (scatter_reduce's product reads a value)
    fails with the same error with the recorder as with make_fx alone: the recorder hands
    what it cannot do to make_fx, whose error remat reports."""
    def f(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x.scatter_reduce(0, index, x, "prod").sum()

    x = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[0, 1, 0], [1, 0, 1], [0, 0, 1]])
    messages = []
    for use_recorder in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if not use_recorder:
                mp.setattr(remat._tracing, "record", refuse_recording)
            with pytest.raises(RematError, match=r"derivative of `aten.scatter_reduce`.*runs `aten._local_scalar_dense`") as error:
                remat.remat(f)(x, index)
            messages.append(str(error.value))
    assert messages[0] == messages[1]
