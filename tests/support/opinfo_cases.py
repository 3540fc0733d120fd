"""torch's own op database as the oracle for remat: each op's sample inputs, run through a
transform with and without remat, must give the same values and gradients.

`run_case` returns what happened: "pass", "refused" (a RematError, which must name the
op), "torch-cant" (the same call without remat raises: nothing to compare) or raises an
AssertionError for a wrong result or any other error. The tests in test_opinfo.py drive it;
`python tests/support/opinfo_cases.py` runs the whole sweep and prints the counts.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import optree
import torch
import torch.testing._internal.common_methods_invocations as cmi
from torch.func import grad, vjp, vmap
from torch.testing._internal.common_methods_invocations import op_db

from remat import RematError, remat
from remat._plans import templates as _specializing
from remat import policies as P
from remat._core.torch_internals import torch_at_least

D = torch.float64
# OpInfo's samples run as torch ships them: random ops through its `wrapper_set_seed`, which
# reseeds inside the function (in `freeze_rng_state`); remat replays that reseeding.

def offload_everything(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Every kept value waits in host memory (on CPU the host is both sides)."""
    return P.Offload()


POLICIES = {
    "nothing": P.nothing_saveable,
    "everything": P.everything_saveable,
    "dots": P.dots_saveable,
    "budget": P.memory_budget(0.5),
    "offload": offload_everything,
}
SAMPLES_PER_OP = 3  # the first samples, plus a non-contiguous copy of the first


def op_id(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


OPS = {op_id(op): op for op in op_db if op.supports_autograd and D in op.supported_dtypes("cpu")}

# Ops remat cannot trace, each with the reason: refused with a RematError naming the op
# under torch.func transforms, replayed (run as torch.utils.checkpoint runs them) under
# `.backward()`. A refusal or a replay of any other op fails the sweep.
KNOWN_REFUSALS = {
    "masked_select": "output shape depends on the values of the mask",
    "combinations": "lowers to masked_select: output shape depends on values",
    "linalg.lstsq": "the CPU driver's outputs have value-dependent shapes (rank, residuals)",
    "linalg.lstsq.grad_oriented": "the CPU driver's outputs have value-dependent shapes",
    "nn.functional.ctc_loss": "target lengths are read as Python numbers",
    "cov": "checks its weights with aten.equal (reads values)",
    "corrcoef": "lowers to cov, which checks its weights with aten.equal",
    "nn.functional.gaussian_nll_loss": "checks var >= 0 by reading values",
    "scatter_reduce.prod": "its derivative reads values (counts zeros with .item())",
    "index_reduce.prod": "its derivative reads values (counts zeros with .item())",
    "narrow": "a tensor `start` is read as a Python number",
    "tensor_split": "tensor indices are read as Python numbers",
    "index_fill": "its derivative deduplicates the indices (aten._unique: value-dependent shape)",
    "index_put": "the derivative of a boolean-mask index runs nonzero (value-dependent shape)",
    "as_strided": "under vmap: its functional derivative uses as_strided_scatter, which has no batching rule",
    "as_strided.partial_views": "under vmap: as_strided_scatter has no batching rule",
    "as_strided_copy": "under vmap: as_strided_scatter has no batching rule",
    "sparse.sampled_addmm": "sparse inputs: remat traces strided tensors only",
    "sparse.mm.reduce": "sparse inputs: remat traces strided tensors only",
}
if not torch_at_least("2.13"):  # the GPU machine's torch 2.11
    KNOWN_REFUSALS["quantile"] = KNOWN_REFUSALS["nanquantile"] = "torch 2.11's quantile checks values with aten.equal"


@dataclass
class Case:
    """One sample of one op as a function of its differentiable tensors."""

    fn: Callable[..., tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]
    primals: list[torch.Tensor]


def samples(op: Any) -> Iterator[Any]:
    taken = []
    for sample in op.sample_inputs("cpu", D, requires_grad=True):
        taken.append(sample)
        if len(taken) == SAMPLES_PER_OP:
            break
    yield from taken
    if taken:
        try:
            yield taken[0].noncontiguous()
        except RuntimeError:  # sparse inputs have no strides
            pass


def make_case(op: Any, sample: Any) -> Case | None:
    """f(*differentiable tensors) -> (floating outputs, other tensor outputs); every other
    tensor of the sample is closed over, as a user's function closes over its buffers."""
    leaves, spec = optree.tree_flatten((sample.input, sample.args, sample.kwargs))  # type: ignore[arg-type]
    diff = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not diff:
        return None

    def fn(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        full = list(leaves)
        for i, t in zip(diff, tensors):
            full[i] = t
        inp, args, kwargs = optree.tree_unflatten(spec, full)
        out = sample.output_process_fn_grad(op(inp, *args, **kwargs))
        tensors_out = [x for x in optree.tree_leaves(out) if isinstance(x, torch.Tensor)]  # type: ignore[arg-type]
        floating = tuple(x for x in tensors_out if x.is_floating_point() or x.is_complex())
        return floating, tuple(x for x in tensors_out if not (x.is_floating_point() or x.is_complex()))

    return Case(fn, [leaves[i].detach() for i in diff])


def _cotangents(outputs: tuple[torch.Tensor, ...], seed: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outputs)


def _weighted_sum(outputs: tuple[torch.Tensor, ...], weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    total = torch.zeros((), dtype=D)
    for o, w in zip(outputs, weights):
        total = total + (o * w).sum().real
    return total


def _seeded(run: Callable[[], Any]) -> Any:
    """`run()` from a fixed seed, and where the global random stream is afterwards."""
    torch.manual_seed(0)
    result = run()
    return result, torch.rand(2)


def transform_vjp(f: Callable[..., Any], case: Case) -> Any:
    def run() -> Any:
        out, pullback, aux = vjp(f, *case.primals, has_aux=True)
        return out, aux, pullback(_cotangents(out))

    return _seeded(run)


def transform_backward(f: Callable[..., Any], case: Case) -> Any:
    def run() -> Any:
        leaves = [p.clone().requires_grad_() for p in case.primals]
        out, aux = f(*leaves)
        tracked = [o for o in out if o.requires_grad]
        grads = torch.autograd.grad(tracked, leaves, _cotangents(tuple(tracked)), allow_unused=True) if tracked else ()
        return [o.detach() for o in out], aux, grads

    return _seeded(run)


def transform_vmap_grad(f: Callable[..., Any], case: Case) -> Any:
    """Per-sample gradients: a batch of two (the same sample, different cotangents)."""
    out, _ = f(*case.primals)
    weights = tuple(torch.stack([w, 2 * w]) for w in _cotangents(out))

    def loss(first: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return _weighted_sum(f(first, *case.primals[1:])[0], weights)

    first = torch.stack([case.primals[0], case.primals[0]])
    return _seeded(lambda: vmap(grad(loss), in_dims=(0, 0), randomness="different")(first, weights))


def transform_grad_grad(f: Callable[..., Any], case: Case) -> Any:
    """Second order: the gradient of <grad f, v>."""
    out, _ = f(*case.primals)
    weights = _cotangents(out)
    directions = _cotangents(tuple(case.primals), seed=2)
    argnums = tuple(range(len(case.primals)))

    def first_order(*primals: torch.Tensor) -> torch.Tensor:
        grads = grad(lambda *p: _weighted_sum(f(*p)[0], weights), argnums=argnums)(*primals)
        return sum((g * v).sum() for g, v in zip(grads, directions))  # type: ignore[return-value]

    return _seeded(lambda: grad(first_order, argnums=argnums)(*case.primals))


ALL, FIRST, FIRST_AND_NONCONTIGUOUS = "all", "first", "first and non-contiguous"
# name: (runner, {policy: which samples}). nothing_saveable recomputes the whole forward in
# backward, the most demanding case; the other policies run on the first sample.
TRANSFORMS: dict[str, tuple[Callable[..., Any], dict[str, str]]] = {
    "vjp": (transform_vjp, {"nothing": ALL, "everything": FIRST, "dots": FIRST, "budget": FIRST, "offload": FIRST}),
    "backward": (transform_backward, {"nothing": FIRST_AND_NONCONTIGUOUS}),
    "vmap_grad": (transform_vmap_grad, {"nothing": FIRST}),
    "grad_grad": (transform_grad_grad, {"nothing": FIRST, "everything": FIRST}),
}


def _selected(which: str, index: int, last: int) -> bool:
    return which == ALL or index == 0 or (which == FIRST_AND_NONCONTIGUOUS and index == last)


def run_case(op_name: str, transform: str) -> list[tuple[str, str, str]]:
    """Every selected sample of one op under one transform and its policies.

    Returns (sample index, policy, outcome) rows; raises AssertionError on a wrong result,
    an unexpected error, or a refusal that does not name the op or is not listed."""
    op = OPS[op_name]
    runner, selection = TRANSFORMS[transform]
    rows = []
    chosen = list(samples(op))
    for index, sample in enumerate(chosen):
        policies = [p for p, which in selection.items() if _selected(which, index, len(chosen) - 1)]
        case = make_case(op, sample) if policies else None
        if case is None:
            continue
        try:
            expected = runner(case.fn, case)
        except Exception:  # torch itself cannot do this: nothing to compare
            rows.append((str(index), "-", "torch-cant"))
            continue
        for policy in policies:
            where = f"{op_name}, {transform}, sample {index}, {policy}"
            region = remat(case.fn, policy=POLICIES[policy])
            matched = _matches(op_name, where, lambda: runner(region, case), expected)
            rows.append((str(index), policy, _replayed(op_name, where, region) if matched else "refused"))
    return rows


def _replayed(op_name: str, where: str, region: Any, matched: str = "pass") -> str:
    """`matched`, or "replayed" where the region could not be traced and ran as
    torch.utils.checkpoint runs it (only a known refusal may)."""
    if not region.cache_info()["replays"]:
        return matched
    if op_name not in KNOWN_REFUSALS:
        raise AssertionError(f"{where}: replayed (could not be traced), and not a known refusal")
    return "replayed"


def _matches(op_name: str, where: str, run: Callable[[], Any], expected: Any) -> bool:
    """Run remat's side: True when it matches no remat, False when remat refused (a known
    refusal); AssertionError for a wrong result, an unknown refusal or any other error."""
    try:
        actual = run()
    except RematError as error:
        if op_name not in KNOWN_REFUSALS:
            raise AssertionError(f"{where}: refused, and not a known refusal: {error}") from error
        return False
    except Exception as error:
        raise AssertionError(f"{where}: raised {type(error).__name__}: {error}") from error
    try:
        torch.testing.assert_close(actual, expected, equal_nan=True)
    except AssertionError as error:
        raise AssertionError(f"{where}: WRONG result: {error}") from None
    return True


def _perturbed(t: Any) -> Any:
    """A floating tensor with other values (x 1.001) and the same layout (shape, strides,
    storage offset); anything else as it is."""
    if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()) or t.layout != torch.strided:
        return t
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    out = torch.empty(t.storage_offset() + extent, dtype=t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
    return out.copy_(t * 1.001).requires_grad_(t.requires_grad)


SHARED_TRANSFORMS = {"backward": transform_backward, "vjp": transform_vjp}


def run_shared_case(op_name: str, transform: str) -> list[tuple[str, str, str]]:
    """Two regions of one op's first sample, the second on other values (its own inputs and
    its own captured tensors), the first kept alive: the second shares the first's plan
    when its graph is the same, and must match no remat either way. Outcome "shared" or
    "pass" (planned on its own), "refused" or "torch-cant"."""
    from remat._api import decorator as _remat

    runner = SHARED_TRANSFORMS[transform]
    op = OPS[op_name]
    first = next(iter(samples(op)), None)
    case_a = make_case(op, first) if first is not None else None
    if case_a is None:
        return []
    case_b = make_case(op, first.transform(_perturbed))
    assert case_b is not None
    try:
        expected = runner(case_b.fn, case_b)
    except Exception:
        return [("0", "-", "torch-cant")]
    joints: list[int] = []
    differentiate = _remat.differentiate

    def counted(*args: Any, **kwargs: Any) -> Any:
        joints.append(1)
        return differentiate(*args, **kwargs)

    where = f"{op_name}, shared plan under {transform}, sample 0, nothing"
    _remat.differentiate = counted  # type: ignore[assignment]
    try:
        region_a = remat(case_a.fn, policy=P.nothing_saveable)
        runner(region_a, case_a)
        before = len(joints)
        region_b = remat(case_b.fn, policy=P.nothing_saveable)
        actual = runner(region_b, case_b)
    except RematError as error:
        if op_name not in KNOWN_REFUSALS:
            raise AssertionError(f"{where}: refused, and not a known refusal: {error}") from error
        return [("0", "nothing", "refused")]
    except Exception as error:
        raise AssertionError(f"{where}: raised {type(error).__name__}: {error}") from error
    finally:
        _remat.differentiate = differentiate  # type: ignore[assignment]
    try:
        torch.testing.assert_close(actual, expected, equal_nan=True)
    except AssertionError as error:
        raise AssertionError(f"{where}: WRONG result: {error}") from None
    return [("0", "nothing", _replayed(op_name, where, region_b, "shared" if len(joints) == before else "pass"))]


# OpInfo's sample functions size their tensors with the module constants S and M (5 and 10):
# the same sample drawn under other values is the same call at other sizes.
RESIZED = ({"S": 5, "M": 10}, {"S": 7, "M": 12}, {"S": 6, "M": 11}, {"S": 4, "M": 13})  # M > S, as samples assume
_IDENTITY = cmi.SampleInput(torch.empty(0)).output_process_fn_grad.__code__


@contextlib.contextmanager
def _sample_sizes(sizes: dict[str, int]) -> Iterator[None]:
    modules = [m for n, m in list(sys.modules.items()) if n.startswith("torch.testing._internal") and hasattr(m, "S")]
    saved = [(m, name, getattr(m, name)) for m in modules for name in sizes if hasattr(m, name)]
    for module, name, _ in saved:
        setattr(module, name, sizes[name])
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _structure(sample: Any) -> tuple[Any, list[Any], Any] | None:
    """(what must match between sizes, leaves, spec); None for a sample not taken."""
    if getattr(sample.output_process_fn_grad, "__code__", None) is not _IDENTITY:
        return None
    leaves, spec = optree.tree_flatten((sample.input, sample.args, sample.kwargs))  # type: ignore[arg-type]
    if any(isinstance(x, torch.Tensor) and x.layout != torch.strided for x in leaves):
        return None
    kinds = tuple(("tensor", x.dim(), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else repr(x) for x in leaves)
    return (spec, kinds), leaves, spec


def _resized_group(op: Any) -> list[tuple[list[Any], Any]]:
    """The op's first sample that OpInfo draws alike (same arguments, ranks, dtypes) under
    every value of RESIZED but with other sizes: its (leaves, spec) at each."""
    drawn = []
    for sizes in RESIZED:
        with _sample_sizes(sizes):
            try:
                samples = zip(range(SAMPLES_PER_OP), op.sample_inputs("cpu", D, requires_grad=True))
                drawn.append([_structure(sample) for _, sample in samples])
            except Exception:  # a sample function that assumes the usual sizes
                return []
    for index, first in enumerate(drawn[0]):
        if first is None:
            continue
        group = [at[index] for at in drawn if index < len(at) and at[index] is not None and at[index][0] == first[0]]
        shapes = {tuple(tuple(x.shape) for x in leaves if isinstance(x, torch.Tensor)) for _, leaves, _ in group}
        if len(group) == len(RESIZED) and len(shapes) >= 3:
            return [(leaves, spec) for _, leaves, spec in group]
    return []


def run_resized_case(op_name: str) -> list[tuple[str, str, str]]:
    """One region of an op called on its samples of other sizes, in turn: the second size
    traces a template with the changed dimensions symbolic, later sizes are specialized
    from it without tracing. Each call must match no remat (.backward(), nothing_saveable).
    Outcome per call: "traced", "specialized", "refused" or "torch-cant"."""
    group = _resized_group(OPS[op_name])
    if not group:
        return []
    first_leaves, spec = group[0]
    diff = [i for i, x in enumerate(first_leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not diff:
        return []
    current = list(first_leaves)  # the sample being run: the region captures its other tensors here
    op = OPS[op_name]

    def fn(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        full = list(current)
        for i, t in zip(diff, tensors):
            full[i] = t
        inp, args, kwargs = optree.tree_unflatten(spec, full)
        tensors_out = [x for x in optree.tree_leaves(op(inp, *args, **kwargs)) if isinstance(x, torch.Tensor)]  # type: ignore[arg-type]
        floating = tuple(x for x in tensors_out if x.is_floating_point() or x.is_complex())
        return floating, tuple(x for x in tensors_out if not (x.is_floating_point() or x.is_complex()))

    region = remat(fn, policy=P.nothing_saveable)
    rows = []
    ratio, _specializing.TEMPLATE_COST_RATIO = _specializing.TEMPLATE_COST_RATIO, 0.0  # a template at the second size
    try:
        for index, (leaves, _) in enumerate(group):
            rows.append(_resized_call(op_name, fn, region, current, leaves, diff, index, len(group)))
    finally:
        _specializing.TEMPLATE_COST_RATIO = ratio
    return rows


def _resized_call(
    op_name: str, fn: Callable[..., Any], region: Any, current: list[Any], leaves: list[Any], diff: list[int], index: int, n: int
) -> tuple[str, str, str]:
    """One call of the region on one sample: its outcome row."""
    current[:] = leaves
    case = Case(fn, [leaves[i].detach() for i in diff])
    where = f"{op_name}, resized sample {index} of {n}, backward, nothing"
    try:
        expected = transform_backward(fn, case)
    except Exception:
        return (str(index), "nothing", "torch-cant")
    specialized = region.cache_info()["specialized"]
    replays = region.cache_info()["replays"]
    if not _matches(op_name, where, lambda: transform_backward(region, case), expected):
        return (str(index), "nothing", "refused")
    if region.cache_info()["replays"] > replays:
        return (str(index), "nothing", _replayed(op_name, where, region))
    return (str(index), "nothing", "specialized" if region.cache_info()["specialized"] > specialized else "traced")


BF16 = torch.bfloat16
BF16_OPS = {op_id(op): op for op in op_db if op.supports_autograd and BF16 in op.supported_dtypes("cpu")}
# Ops whose bf16 results differ from eager's, each with the reason. Any other op that
# differs fails the sweep.
KNOWN_NOT_BITWISE = {
    "nn.functional.rrelu": "training rrelu is the product of its input and the slopes it drew, rounded "
    "in bf16, where the kernel rounds once (its functional form's derivative is wrong in torch 2.13)",
}


# Ops remat refuses in bf16 only, each with the reason.
KNOWN_BF16_REFUSALS = {
    "nn.functional.instance_norm": "the CPU batch-norm kernel keeps float32 statistics for bf16 input where its "
    "meta function says bf16; the first-run check finds the graph parting from eager there",
}


def run_bf16_case(op_name: str) -> list[tuple[str, str, str]]:
    """The op's first bf16 sample under `.backward()` with nothing_saveable: values and
    gradients bitwise equal to no remat ("bitwise"), else "refused" or "torch-cant"; a
    difference raises AssertionError unless the op is in KNOWN_NOT_BITWISE ("not bitwise")."""
    op = BF16_OPS[op_name]
    try:
        sample = next(iter(op.sample_inputs("cpu", BF16, requires_grad=True)), None)
    except NotImplementedError:  # the sample function itself cannot (chalf on CPU)
        return [("0", "-", "torch-cant")]
    case = make_case(op, sample) if sample is not None else None
    if case is None:
        return []
    try:
        expected = transform_backward(case.fn, case)
    except Exception:
        return [("0", "-", "torch-cant")]
    where = f"{op_name}, bf16, backward, sample 0, nothing"
    try:
        actual = transform_backward(remat(case.fn, policy=P.nothing_saveable), case)
    except RematError as error:
        if op_name not in KNOWN_REFUSALS and op_name not in KNOWN_BF16_REFUSALS:
            raise AssertionError(f"{where}: refused, and not a known refusal: {error}") from error
        return [("0", "nothing", "refused")]
    except Exception as error:
        raise AssertionError(f"{where}: raised {type(error).__name__}: {error}") from error
    if _bitwise(actual, expected):
        return [("0", "nothing", "bitwise")]
    if op_name in KNOWN_NOT_BITWISE:
        torch.testing.assert_close(actual, expected, equal_nan=True)  # within bf16's tolerance
        return [("0", "nothing", "not bitwise")]
    raise AssertionError(f"{where}: not bitwise equal to no remat")


def _bitwise(actual: Any, expected: Any) -> bool:
    a_leaves, a_spec = optree.tree_flatten(actual)  # type: ignore[arg-type]
    e_leaves, e_spec = optree.tree_flatten(expected)  # type: ignore[arg-type]
    return a_spec == e_spec and all(
        _same_bits(a, e) if isinstance(e, torch.Tensor) else a == e for a, e in zip(a_leaves, e_leaves)
    )


def _same_bits(a: torch.Tensor, e: torch.Tensor) -> bool:
    """Equal dtype, layout, shape and values, NaN where the other has NaN (complex by its
    parts; a sparse tensor by its dense values)."""
    if a.dtype != e.dtype or a.shape != e.shape or a.layout != e.layout:
        return False
    if e.layout != torch.strided:
        a, e = a.to_dense(), e.to_dense()
    if a.is_complex():
        a, e = torch.view_as_real(a.to(torch.complex64)), torch.view_as_real(e.to(torch.complex64))
    return bool(torch.equal(a.isnan(), e.isnan()) and torch.equal(a.nan_to_num(), e.nan_to_num()))


def main() -> None:
    """Run the whole sweep; print the outcome counts per transform and every failure."""
    import warnings

    warnings.simplefilter("ignore")
    transforms = sys.argv[1:] or [*TRANSFORMS, *(f"shared_{t}" for t in SHARED_TRANSFORMS), "resized"]
    for transform in transforms:
        counts: collections.Counter[str] = collections.Counter()
        failures = []
        start = time.perf_counter()
        for name in OPS:
            try:
                shared = transform.startswith("shared_")
                if transform == "resized":
                    rows = run_resized_case(name)
                else:
                    rows = run_shared_case(name, transform[len("shared_"):]) if shared else run_case(name, transform)
                counts.update(outcome for _, _, outcome in rows)
            except AssertionError as error:
                counts["FAILED"] += 1
                failures.append(str(error).splitlines()[0][:300])
        print(f"{transform}: {dict(counts)} in {time.perf_counter() - start:.0f} s")
        for failure in failures:
            print("   ", failure)


if __name__ == "__main__":
    main()
