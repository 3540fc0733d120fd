"""What every test shares: comparisons with an oracle, the graph checks run on every plan,
the sweep markers and the default set.

Where a test goes:
  contract/  a promise remat makes to its users (a policy keeps what it says, a transform or
             a channel of the user's Python gives what eager gives, an error names its fix,
             an example or benchmark script runs), each against the same code without remat.
  units/     one part of the mechanism or the house on its own (the partitioner, passes,
             argument splitting, the policy vocabulary, the layering, the fast paths).
  oracles/   sweeps against oracles remat did not write: torch's OpInfo database, real
             models, random programs, make_fx, properties; what they found.
  support/   modules the tests import (model and function zoos, the OpInfo and differential
             drivers, the recording oracle); no tests.
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import optree
import pytest
import torch
import torch.fx

from remat import policies as P

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))  # the tests' shared modules


def assert_close(actual: Any, expected: Any, *, rtol: float = 1e-8, atol: float = 1e-10) -> None:
    """Pytrees of tensors equal leaf by leaf (same structure, dtype, shape, values)."""
    a_leaves, a_spec = optree.tree_flatten(actual)
    e_leaves, e_spec = optree.tree_flatten(expected)
    assert a_spec == e_spec, f"structure differs: {a_spec} vs {e_spec}"
    for a, e in zip(a_leaves, e_leaves):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor)
            assert a.dtype == e.dtype and a.shape == e.shape, f"{a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol)
        else:
            assert a == e


def _keep_tanh(op: Any, *args: Any, **kwargs: Any) -> bool:
    """A custom policy: keep tanh outputs and anything named 'g'."""
    return P.op_key(op) == "aten::tanh" or kwargs.get("name") == "g"


# The built-in policies (and None) by short name: what the model and CUDA tests sweep.
BUILT_IN_POLICIES: dict[str, Any] = {
    "none": None,
    "nothing": P.nothing_saveable,
    "everything": P.everything_saveable,
    "dots": P.dots_saveable,
    "dots_no_batch": P.dots_with_no_batch_dims_saveable,
    "dots_attention": P.dots_and_attention_saveable,
    "budget": P.memory_budget(0.5),
}

POLICIES = {
    "default": None,
    "nothing": P.nothing_saveable,
    "everything": P.everything_saveable,
    "dots": P.dots_saveable,
    "dots_no_batch": P.dots_with_no_batch_dims_saveable,
    "only_names": P.save_only_these_names("h", "scores"),
    "names_but": P.save_any_names_but_these("h"),
    "except_names": P.save_anything_except_these_names("h", "g"),
    "both": P.save_from_both_policies(P.dots_with_no_batch_dims_saveable, P.save_only_these_names("scores")),
    "custom": _keep_tanh,
}


def pairwise_cover(a: list[str], b: list[str], c: list[str]) -> set[tuple[str, str, str]]:
    """Combinations of three axes in which every pair of values of any two axes appears:
    for each pair of axes, the third axis's value is chosen by the two indices' sum."""
    cover: set[tuple[str, str, str]] = set()
    for (i, x), (j, y) in itertools.product(enumerate(a), enumerate(b)):
        cover.add((x, y, c[(i + j) % len(c)]))
    for (i, x), (k, z) in itertools.product(enumerate(a), enumerate(c)):
        cover.add((x, b[(i + k) % len(b)], z))
    for (j, y), (k, z) in itertools.product(enumerate(b), enumerate(c)):
        cover.add((a[(j + k) % len(a)], y, z))
    return cover


def pairwise_in_default(a: list[str], b: list[str], c: list[str]) -> list[Any]:
    """Parameters for the full product of three axes; those outside the pairwise cover are
    marked `product`, a sweep the default run leaves out."""
    cover = pairwise_cover(a, b, c)
    return [
        pytest.param(x, y, z, id=f"{x}-{y}-{z}", marks=() if (x, y, z) in cover else pytest.mark.product)
        for x, y, z in itertools.product(a, b, c)
    ]


@pytest.fixture(params=list(POLICIES), ids=list(POLICIES))
def policy(request: pytest.FixtureRequest) -> Any:
    return POLICIES[request.param]


def check_every_graph(install: Callable[[Any, str, Any], None]) -> None:
    """From now on, every graph remat builds is checked as its plan is built: functional,
    vmap-safe and laid out as traced (remat/_trace/passes.py). `install` is monkeypatch.setattr
    in a test, the builtin setattr in the worker processes of tests/oracles/test_differential.py."""
    from remat._api import decorator as _remat
    from remat._running import executing as _executing
    from remat._trace.passes import check_invariants, check_layouts
    from remat._core.torch_internals import autocast_off, dispatch_modes_off, fake_tensor_cache_bounded

    def check(*graphs: torch.fx.GraphModule) -> None:
        # check_layouts runs ops on fakes, as the graphs run; as remat builds plans, out of sight of the
        # caller's dispatch modes (a replayed region around this one caches the ops it sees)
        with fake_tensor_cache_bounded(), autocast_off(), dispatch_modes_off():
            for gm in graphs:
                check_invariants(gm)
                check_layouts(gm)

    build = _remat.Rematerialized._build

    def checked_build(self: Any, *args: Any, **kwargs: Any) -> Any:
        plan, traced = build(self, *args, **kwargs)
        for part in plan.plans() if plan is not None else ():
            check(part.stage_one.graph, part.part.forward, part.part.forward_pure, part.part.backward)
        return plan, traced

    higher_order = _executing.Plan.higher_order

    def checked_higher_order(self: Any, *args: Any) -> Any:
        full, order, cotangents = higher_order(self, *args)
        check(full.forward, full.backward)
        return full, order, cotangents

    install(_remat.Rematerialized, "_build", checked_build)
    install(_executing.Plan, "higher_order", checked_higher_order)


@pytest.fixture(autouse=True)
def _every_graph_keeps_the_invariants(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every graph remat builds in any test is functional, vmap-safe and laid out as traced."""
    check_every_graph(monkeypatch.setattr)


@pytest.fixture(autouse=True)
def _traces_against_make_fx() -> Iterator[None]:
    """With REMAT_COMPARE_TRACES=1, every stage-1 and joint graph any test builds is built
    again with make_fx and must be the same graph (tests/support/recording_oracle.py): the recorder
    checked across the whole suite, at about twice its tracing time. A test that counts
    how often its function body runs sees each first call's body run twice."""
    if os.environ.get("REMAT_COMPARE_TRACES") != "1":
        yield
        return
    from recording_oracle import traces_compared

    with traces_compared():
        yield


# The oracle sweeps: long runs against oracles remat's authors did not write, each under its
# marker. `python -m pytest` runs the default set (every promise at least once, in a few
# minutes); `-m sweep` runs every sweep, `-m models` (or another marker) one of them, and
# `--sweeps` runs everything.
SWEEPS: dict[str, str] = {
    "opinfo": "torch's OpInfo database under every transform (tests/oracles/test_opinfo.py)",
    "differential": "random programs against no remat (tests/oracles/test_differential.py)",
    "models": "real models from transformers, torchvision and torch, and Opacus, against no remat",
    "compile": "regions under torch.compile (tests/contract/test_compile.py)",
    "product": "full products of policies, functions and transforms (tests/contract/test_transforms.py, tests/contract/test_memory_contract.py, reports in tests/contract/test_fallback.py; the default run takes a cover of each)",
    "properties": "the property test at its full example count (tests/oracles/test_properties.py)",
    "examples": "the examples and the benchmark scripts run (tests/contract/test_examples.py, tests/contract/test_bench.py)",
}

# One case of a sweep that the default run keeps, so that it covers that sweep's promise.
REPRESENTATIVES = frozenset({
    "tests/oracles/test_models.py::test_backward_matches_no_remat[gpt2-eager-dots]",
    "tests/oracles/test_models.py::test_backward_matches_no_remat[vit-nothing]",
    "tests/oracles/test_models.py::test_resnet_block_functional_call_with_buffers_matches_no_remat[dots]",
    "tests/oracles/test_models.py::test_mixtral_style_moe_with_data_dependent_routing_replays_as_without_remat[dots]",
    "tests/oracles/test_models.py::test_layers_remat_cannot_trace_train_as_without_remat[bloom-eager-dots]",
    "tests/oracles/test_models.py::test_a_report_of_a_layer_that_runs_replayed_says_what_its_backward_graph_holds[mixtral-eager-experts-dots]",
    "tests/oracles/test_models.py::test_default_kv_cache_replays_as_without_remat_naming_the_cache_and_the_fix[llama]",
    "tests/oracles/test_models.py::test_checkpoint_model_trains_a_transformers_model_as_without_remat_tracing_each_layer_once[llama]",
    "tests/oracles/test_opacus.py::test_opacus_per_sample_gradients_equal_no_remat[hooks-dots]",
    "tests/oracles/test_opacus.py::test_opacus_per_sample_gradients_equal_no_remat[ew-nothing]",
    "tests/contract/test_compile.py::test_compiled_values_gradients_and_random_stream_equal_no_remat[nothing]",
    "tests/contract/test_compile.py::test_memory_budget_under_fullgraph_is_refused_naming_policy_and_fix",
    "tests/contract/test_compile.py::test_a_report_describes_a_dynamic_region_as_the_same_region_traced_per_shape",
    "tests/contract/test_examples.py::test_quickstart_memory_goes_down_and_losses_agree",
})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--sweeps", action="store_true", help="run the oracle sweeps too (everything)")


def pytest_configure(config: pytest.Config) -> None:
    # Inductor's cache in a directory of this session's own (of each pytest-xdist worker's
    # own: workers inherit the controller's environment): a run beside another (or a stale
    # cache of another torch) cannot race on or poison the shared default one.
    if "PYTEST_XDIST_WORKER" in os.environ or "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="remat-tests-inductor-")
    for name, what in SWEEPS.items():
        config.addinivalue_line("markers", f"{name}: an oracle sweep: {what}")
    config.addinivalue_line("markers", "sweep: any oracle sweep (added to every test under one of the sweeps' markers)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under a sweep's marker is marked `sweep` too (a representative stays
    out of it). A run of the whole suite (no paths named) without `-m` or `--sweeps`
    leaves the sweeps out; a run of named files or tests runs what it names."""
    for item in items:
        if item.nodeid not in REPRESENTATIVES and any(item.get_closest_marker(name) for name in SWEEPS):
            item.add_marker(pytest.mark.sweep)
    named = config.args_source == pytest.Config.ArgsSource.ARGS
    if named or config.getoption("markexpr") or config.getoption("--sweeps"):
        return
    if not config.getoption("keyword"):  # a representative renamed or moved would leave the default set silently
        collected = {item.nodeid for item in items}
        files = {nodeid.split("::")[0] for nodeid in collected}
        missing = sorted(  # a file skipped whole (a missing optional dependency) is not a missing test
            r for r in REPRESENTATIVES - collected
            if r.split("::")[0] in files or not (config.rootpath / r.split("::")[0]).exists()
        )
        if missing:
            raise pytest.UsageError(f"REPRESENTATIVES in tests/conftest.py names tests that do not exist: {missing}")
    kept = [item for item in items if not item.get_closest_marker("sweep")]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("sweep")])
        items[:] = kept


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Counts of the OpInfo sweep's outcomes per transform, from every passed test's record,
    and of the random programs' outcomes, from every test's record."""
    programs: dict[str, int] = {}
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        for name, outcomes in getattr(report, "user_properties", []):
            if name == "differential":
                for outcome in outcomes:
                    programs[outcome] = programs.get(outcome, 0) + 1
    if programs:
        terminalreporter.write_sep("-", "random programs against no remat")
        terminalreporter.write_line(", ".join(f"{k} {v}" for k, v in sorted(programs.items())))
    counts: dict[str, dict[str, int]] = {}
    for report in terminalreporter.stats.get("passed", []):
        for name, rows in getattr(report, "user_properties", []):
            if name == "opinfo":
                for transform, outcome in rows:
                    counts.setdefault(transform, {}).setdefault(outcome, 0)
                    counts[transform][outcome] += 1
    if counts:
        terminalreporter.write_sep("-", "OpInfo sweep: sample x policy runs per transform")
        for transform, outcomes in counts.items():
            terminalreporter.write_line(f"{transform}: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
