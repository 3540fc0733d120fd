"""The benchmark runs end to end at its smoke-test size and reports what it promises.

No timing is asserted: only that every variant ran on every workload, that each matched
the gradients of no checkpointing, and that the memory figures say what remat is for.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.examples  # runs the benchmark scripts

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {
    "none",
    "tuc",
    "tuc_sac_dots",
    "remat_nothing_saveable",
    "remat_dots_saveable",
    "remat_dots_with_no_batch_dims_saveable",
    "remat_everything_saveable",
}
WORKLOADS = {"mlp", "gpt_sdpa", "gpt_matmul"}


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # One torch thread: on a busy machine two threads stall at OpenMP barriers, and this
    # test asserts no timing, only that everything ran and what was kept.
    out = tmp_path_factory.mktemp("bench") / "results.json"
    markdown = out.with_suffix(".md")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_remat.py"), "--size", "tiny", "--device", "cpu",
         "--threads", "1", "--repeats", "1", "--warmup", "0", "--out", str(out), "--markdown", str(markdown)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "round 1/1" in proc.stderr  # progress is shown while it runs
    results = json.loads(out.read_text())
    results["_markdown"] = markdown.read_text()
    return results


def test_every_variant_ran_on_every_workload(tiny_results: dict[str, Any]) -> None:
    assert set(tiny_results["workloads"]) == WORKLOADS
    for name, workload in tiny_results["workloads"].items():
        assert VARIANTS <= set(workload["variants"]), name
        for variant, row in workload["variants"].items():
            assert row["error"] is None, (name, variant, row["error"])
            assert row["step_ms"] > 0 and row["kept_bytes"] >= 0, (name, variant)
        assert set(workload["trace"]) == {"nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable",
                                          "memory_budget_0.5"}
        assert all(t["traced"] for t in workload["trace"].values()), name


def test_torch_remat_is_reported_either_way(tiny_results: dict[str, Any]) -> None:
    peer = tiny_results["torch_remat"]
    assert isinstance(peer["available"], bool)
    if not peer["available"]:
        assert "not installed" in peer["note"]


def test_all_gradient_checks_pass(tiny_results: dict[str, Any]) -> None:
    for name, workload in tiny_results["workloads"].items():
        for variant, row in workload["variants"].items():
            assert row["grad_check"]["ok"], (name, variant, row["grad_check"])


def test_nothing_saveable_keeps_fewer_bytes_than_none(tiny_results: dict[str, Any]) -> None:
    for name, workload in tiny_results["workloads"].items():
        rows = workload["variants"]
        assert rows["remat_nothing_saveable"]["kept_bytes"] < rows["none"]["kept_bytes"], name
        # the byte count sees inside torch.utils.checkpoint: its full recompute keeps as little
        assert rows["tuc"]["kept_bytes"] < rows["none"]["kept_bytes"], name
        assert rows["remat_everything_saveable"]["kept_bytes"] <= rows["none"]["kept_bytes"], name


def test_targets_and_markdown_are_reported(tiny_results: dict[str, Any]) -> None:
    assert tiny_results["targets"] and all(isinstance(t["met"], bool) for t in tiny_results["targets"])
    markdown = tiny_results["_markdown"]
    assert "| workload | variant |" in markdown and "CUDA sizes: not yet measured" in markdown


def test_rewriting_the_results_keeps_the_other_scripts_sections(tmp_path: Path) -> None:
    """bench_remat.py rewrites RESULTS.md whole; bench_compile.py's and budget_vs_torch.py's
    sections must survive, and replacing one leaves the other."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_compile
        import bench_remat
    finally:
        sys.path.remove(str(ROOT / "bench"))
    markdown = tmp_path / "RESULTS.md"
    markdown.write_text("# old results\n")
    bench_compile.replace_section(markdown, f"{bench_remat.SECTION_START}\ncompile rows\n{bench_remat.SECTION_END}")
    assert bench_remat.kept_section(markdown).strip() == f"{bench_remat.SECTION_START}\ncompile rows\n{bench_remat.SECTION_END}"
    bench_compile.replace_section(markdown, f"{bench_remat.SECTION_START}\nnew rows\n{bench_remat.SECTION_END}")
    assert "compile rows" not in markdown.read_text() and markdown.read_text().count("new rows") == 1
    assert bench_remat.kept_section(tmp_path / "missing.md") == ""
    budget = bench_remat.GENERATED_SECTIONS[1]
    bench_remat.replace_section(markdown, f"{budget[0]}\nbudget rows\n{budget[1]}", budget)
    bench_remat.replace_section(markdown, f"{budget[0]}\nnew budget rows\n{budget[1]}", budget)
    kept = bench_remat.kept_section(markdown)
    assert "\nnew rows" in kept and "new budget rows" in kept and "\nbudget rows" not in kept


def test_the_compile_benchmark_builds_its_variants_and_their_steps_match_no_checkpointing() -> None:
    """bench_compile.py's variants (the ones with a compiled counterpart) are bench_remat's,
    built for the workload's device; each step's gradients equal no checkpointing's."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_compile
        import bench_remat
    finally:
        sys.path.remove(str(ROOT / "bench"))
    size = bench_remat.Size(1, 64, 8, 2, "float64", 0, 0, 0, "test")
    wl = bench_remat.build_workload("gpt_sdpa", size, torch.device("cpu"), seed=0)
    variants = bench_compile._variants(wl.block, wl.x.device)
    assert set(variants) == {"none", "tuc", "tuc_sac_dots", "remat_nothing_saveable", "remat_dots_saveable"}
    reference = bench_remat.step(wl.block, wl)
    for call in variants.values():
        torch.testing.assert_close(bench_remat.step(call, wl), reference, rtol=0, atol=0)


def test_the_budget_benchmark_meets_torch_s_frontier(tmp_path: Path) -> None:
    """bench/budget_vs_torch.py at its smoke size: both sides exact, and at torch's kept
    bytes remat recomputes no more (the row the benchmark judges)."""
    out, markdown = tmp_path / "budget.json", tmp_path / "budget.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "budget_vs_torch.py"), "--smoke", "--threads", "1",
         "--out", str(out), "--markdown", str(markdown)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())["measure"]
    assert [p["fraction"] for p in result["remat"]] == [0.0, 0.5, 1.0]
    for point in result["remat"] + result["torch"] + result["remat_at_torch_bytes"]:
        assert point["max_rel_grad_err"] == 0.0, point
    assert result["remat"][0]["kept_bytes"] < result["remat"][-1]["kept_bytes"] == result["plain_kept_bytes"]
    assert result["remat"][0]["recomputed_flops"] > 0 == result["remat"][-1]["recomputed_flops"]
    assert all(c["met"] for c in result["comparison"]), result["comparison"]
    assert "| torch f |" in markdown.read_text()


def test_the_one_line_benchmark_runs_every_variant() -> None:
    """bench/one_line.py at its quick size: every variant of both models timed, and the ratio
    of the one-liner to checkpoint_layers reported (its value is the benchmark's to judge)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "one_line.py"), "--quick"], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    variants = {"checkpoint_model", "checkpoint_layers", "transformers' own", "plain", "ratio: checkpoint_model / checkpoint_layers"}
    assert {(row.split("|")[1].strip(), row.split("|")[2].strip()) for row in rows} == {
        (model, variant) for model in ("llama", "gpt2", "bert", "mistral", "t5") for variant in variants
    }
