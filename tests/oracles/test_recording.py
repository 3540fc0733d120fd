"""Both traces, stage 1 (the user's function) and the joint forward+backward, are recorded
by remat's light tracer (remat/_trace/recording.py) instead of make_fx where it can be; make_fx
is the oracle: for torch's OpInfo samples and for real models, every graph the recorder
makes must be the graph make_fx makes (tests/support/recording_oracle.py), and what the recorder
leaves to make_fx must still match no remat. Gradients through recorded graphs are
checked everywhere else in the suite."""

from __future__ import annotations

import os

import model_zoo as Z
import pytest
import torch
from opinfo_cases import OPS, make_case, samples
from recording_oracle import refuse_recording, run_compared

import remat
import remat._trace.tracing
from remat import RematError
from remat import policies as P

from conftest import assert_close


@pytest.mark.opinfo
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("op_name", list(OPS))
def test_recorded_joint_is_make_fx_joint_for_opinfo_samples(op_name: str, record_property: pytest.RecordProperty) -> None:
    """The first sample of every OpInfo op (and its non-contiguous copy), forward and
    backward through remat: each stage-1 graph and joint the recorder makes equals make_fx's."""
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
            rows.append(("recorder", "refused by remat"))
            continue
        rows += [(f"{trace} recorder", outcome) for trace, outcome in outcomes]
    record_property("opinfo", rows)


def _model_step(case: Z.Case) -> None:
    torch.manual_seed(0)
    model = case.build()
    remat.checkpoint_layers(case.layers(model), P.dots_saveable)
    batch = case.batch(Z.BATCH)
    case.loss(model(**case.model_kwargs(batch)), batch).backward()


@pytest.mark.models
@pytest.mark.parametrize("case", Z.HF_CASES + Z.OWN_CASES, ids=lambda c: c.name)
def test_recorded_joint_is_make_fx_joint_for_models(case: Z.Case) -> None:
    """Llama, GPT-2, BERT (sdpa and eager, dropout on) and our own models: every layer's
    stage-1 graph and joint are recorded, none left to make_fx, and each equals make_fx's."""
    outcomes = run_compared(lambda: _model_step(case))
    assert {trace for trace, _ in outcomes} == {"stage 1", "joint"}, outcomes
    assert {outcome for _, outcome in outcomes} == {"recorded"}, outcomes


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
        assert outcomes == [("stage 1", "recorded"), ("joint", "recorded")]
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
    a region with one is traced by make_fx (stage 1 and the joint), and its gradients are
    no remat's."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return _scaled_sin(x.exp()).sum()

    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(f(x), x)
    got: list[tuple[torch.Tensor, ...]] = []
    outcomes = run_compared(lambda: got.append(torch.autograd.grad(remat.remat(f)(x), x)))
    assert outcomes == [("stage 1", "make_fx"), ("joint", "make_fx")]
    assert_close(got[0], expected)


def test_an_error_in_a_recorded_joint_is_make_fx_s_error() -> None:
    """A derivative that cannot run without data (scatter_reduce's product reads a value
    in the form torch.func differentiates) fails with the same error with the recorder as
    with make_fx alone: the recorder hands what it cannot do to make_fx, whose error remat
    reports."""
    def f(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x.scatter_reduce(0, index, x, "prod").sum()

    x = torch.randn(3, 3, dtype=torch.float64)
    index = torch.tensor([[0, 1, 0], [1, 0, 1], [0, 0, 1]])
    messages = []
    for use_recorder in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if not use_recorder:
                mp.setattr(remat._trace.tracing, "record_graph", refuse_recording)
            with pytest.raises(RematError, match=r"derivative of `aten.scatter_reduce`.*runs `aten._local_scalar_dense`") as error:
                torch.func.grad(remat.remat(f))(x, index)
            messages.append(str(error.value))
    assert messages[0] == messages[1]


@pytest.mark.skipif(os.environ.get("REMAT_COMPARE_TRACES") == "1", reason="comparing traces runs every body once more")
def test_the_function_body_runs_once_per_trace_and_twice_when_left_to_make_fx_halfway() -> None:
    """Stage 1 runs the user's function under the recorder; make_fx runs it again only where
    the recorder gives up partway (here a custom op after some recorded ops). Either way the
    gradients are no remat's."""
    runs = {"plain": 0, "custom": 0}

    def plain(x: torch.Tensor) -> torch.Tensor:
        runs["plain"] += 1
        return (x.sin() * x).sum()

    def custom(x: torch.Tensor) -> torch.Tensor:
        runs["custom"] += 1
        return _scaled_sin(x.sin() * x).sum()

    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    for name, fn in (("plain", plain), ("custom", custom)):
        expected = torch.autograd.grad(fn(x), x)
        runs[name] = 0
        assert_close(torch.autograd.grad(remat.remat(fn)(x), x), expected)
    assert runs == {"plain": 1, "custom": 2}


_GLOBAL_WEIGHT = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))


def test_a_parameter_read_from_a_global_is_recorded_as_make_fx_records_it() -> None:
    """An nn.Parameter the function reaches neither through its arguments nor its closure
    (a module global): make_fx holds it as a `_param_constant` attribute, and so does the
    recorder; remat then passes it by reference, so it gets its gradient."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x @ _GLOBAL_WEIGHT).tanh().sum()

    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(f(x), (x, _GLOBAL_WEIGHT))
    got: list[tuple[torch.Tensor, ...]] = []
    outcomes = run_compared(lambda: got.append(torch.autograd.grad(remat.remat(f)(x), (x, _GLOBAL_WEIGHT))))
    assert outcomes == [("stage 1", "recorded"), ("joint", "recorded")]
    assert_close(got[0], expected)


def test_an_op_called_from_cpp_is_recorded_with_the_arguments_make_fx_sees() -> None:
    """embedding_bag's kernel calls `_embedding_bag` from C++ with an absent
    `per_sample_weights`, which reaches a dispatch mode as an explicit None (and `sparse`
    before it); make_fx, below remat's annotating mode, gets the call as that mode passes it
    on from Python, trailing defaults left out. The recorder, with no mode above it, must
    record the same arguments."""
    weight = torch.randn(10, 3, dtype=torch.float64, requires_grad=True)
    index, offsets = torch.tensor([1, 2, 4, 5, 4, 3]), torch.tensor([0, 3])

    def f(w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding_bag(index, w, offsets, mode="mean").pow(2).sum()

    got: list[tuple[torch.Tensor, ...]] = []
    outcomes = run_compared(lambda: got.append(torch.autograd.grad(remat.remat(f)(weight), weight)))
    assert outcomes == [("stage 1", "recorded"), ("joint", "recorded")]
    assert_close(got[0], torch.autograd.grad(f(weight), weight))


def test_fx_is_tracing_while_recording_as_under_make_fx() -> None:
    """fx's "is tracing" flag is set while recording, as make_fx sets it (torch.compile'd
    code reads it, and runs uncompiled under a trace): a function that branches on it gives
    make_fx's graph (the traced branch, as any fx trace would; not eager's)."""
    import torch.fx._symbolic_trace as symbolic_trace

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() if symbolic_trace.is_fx_symbolic_tracing() else x.cos()).sum()

    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    outcomes = run_compared(lambda: torch.autograd.grad(remat.remat(f)(x), x))
    assert outcomes == [("stage 1", "recorded"), ("joint", "recorded")]


def test_a_traced_function_is_freed_without_a_garbage_collection() -> None:
    """Tracing leaves no reference cycle through the user's function: dropping it and its
    region frees it (and the plans cached on it) at once, as plain Python would."""
    import gc
    import weakref

    def make() -> object:
        def f(x: torch.Tensor) -> torch.Tensor:
            return (x.sin() * x).sum()
        return f

    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        f = make()
        region = remat.remat(f)
        region(x).backward()
        alive = weakref.ref(f)
        del f, region
        assert alive() is None
    finally:
        gc.enable()
