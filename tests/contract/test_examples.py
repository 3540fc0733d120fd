"""The examples run (in a short mode) and say what they promise."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.examples

ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_quickstart_memory_goes_down_and_losses_agree() -> None:
    out = run_example("quickstart.py", "--steps", "3", "--layers", "2", "--d-model", "32", "--seq", "16")
    kept = {m.group(1).strip(): float(m.group(2)) for m in re.finditer(r"^(.+?)\s+([\d.]+) MiB", out, re.M)}
    assert kept["nothing_saveable"] < kept["dots_saveable"] < kept["no remat"]
    assert kept["everything_saveable"] <= kept["no remat"]
    spread = float(re.search(r"final losses: (\S+)", out).group(1))
    assert spread < 1e-5


def _kept_mib(out: str) -> dict[str, float]:
    """Rows that start with a label and then a size in MiB: {label: MiB}."""
    return {m.group(1).strip(): float(m.group(2)) for m in re.finditer(r"^\s*(\S.*?)\s+([\d.]+) MiB", out, re.M)}


def test_gpt_compare_same_losses_less_memory() -> None:
    out = run_example("gpt.py", "--compare", "--steps", "4", "--log-every", "2", "--layers", "2",
                      "--d-model", "32", "--seq", "16", "--batch", "4", "--every", "2")
    kept = _kept_mib(out.split("kept for backward")[1])
    assert kept["nothing_saveable"] < kept["dots_saveable every 2"] < kept["no remat"]
    assert kept["nothing_saveable"] < kept["dots_saveable"] < kept["no remat"]
    assert kept["everything_saveable"] <= kept["no remat"]
    curves = re.findall(r"^\s+(\d+)((?:\s+\d+\.\d{6})+)$", out, re.M)
    assert [int(step) for step, _ in curves] == [2, 4]
    for _, losses in curves:
        assert len(set(losses.split())) == 1  # identical across the five schedules
    assert float(re.search(r"loss curve: (\S+)", out).group(1)) < 1e-5


def test_gpt_single_schedule_reports_memory_and_samples() -> None:
    out = run_example("gpt.py", "--policy", "nothing_saveable", "--every", "1", "--steps", "3", "--log-every", "1",
                      "--layers", "2", "--d-model", "32", "--seq", "16", "--batch", "4", "--sample", "20")
    assert "schedule: nothing_saveable, nothing_saveable" in out
    assert len(re.findall(r"step\s+\d+/3", out)) == 3
    ours, plain = (float(x) for x in re.search(r"kept for backward:\s+([\d.]+) MiB.*?,\s+([\d.]+) MiB", out).groups())
    assert ours < plain
    assert re.search(r"^sample: The clock.{20}", out, re.M)


def test_per_sample_grads_match_and_checkpoint_fails() -> None:
    out = run_example("per_sample_grads.py", "--steps", "2", "--log-every", "1", "--batch", "8", "--seq", "16",
                      "--d-model", "16", "--layers", "2")
    assert re.search(r"torch\.utils\.checkpoint under vmap\(grad\(\.\.\.\)\) fails: \w+(Error|Exception): \S", out)
    assert float(re.search(r"remat vs no remat: largest difference (\S+)", out).group(1)) < 1e-6
    kept = _kept_mib(out)
    assert kept["kept for backward, remat nothing_saveable"] < kept["kept for backward, no remat"]
    assert len(re.findall(r"step\s+\d+/2\s+loss \d", out)) == 2
    assert "test accuracy after 2 DP-SGD steps" in out


def test_hessian_vector_matches_and_residual_remat_keeps_less() -> None:
    out = run_example("hessian_vector.py", "--steps", "3", "--log-every", "1", "--points", "32", "--width", "8",
                      "--blocks", "2", "--power-iters", "2")
    diffs = re.findall(r"^remat .*?\)\s+(\S+)\s+(\S+)$", out, re.M)
    assert len(diffs) == 2
    assert all(float(d) < 1e-10 for row in diffs for d in row)
    rows = re.findall(r"^\s+(\S.*?)\s+([\d.]+) MiB \(.*?\)\s+([\d.]+) MiB", out, re.M)
    first_order = {name: float(a) for name, a, _ in rows}
    pde_loss = {name: float(b) for name, _, b in rows}
    assert first_order["remat each block (nothing_saveable)"] < first_order["no remat"]
    assert pde_loss["remat the residual (nothing_saveable)"] < pde_loss["no remat"]
    assert len(re.findall(r"step\s+\d+/3\s+loss", out)) == 3
    assert re.search(r"top Hessian eigenvalue .*: -?\d", out)


def test_policy_sweep_table_without_matplotlib(tmp_path: Path) -> None:
    png = tmp_path / "sweep.png"
    script = (
        "import runpy, sys; sys.modules['matplotlib'] = None; "  # as if matplotlib were not installed
        f"sys.argv = ['policy_sweep.py', '--layers', '2', '--d-model', '32', '--seq', '16', '--batch', '2', "
        f"'--steps', '1', '--warmup', '1', '--plot', {str(png)!r}]; "
        f"runpy.run_path({str(ROOT / 'examples' / 'policy_sweep.py')!r}, run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    rows = {m.group(1).strip(): m.groups()[1:] for m in re.finditer(
        r"^(.+?)\s+([\d.]+) MiB \(\s*[\d.]+%\)\s+[\d.]+ms\s+([+-][\d.]+)%\s+([+-]\d+)$", out, re.M)}
    kept = {name: float(r[0]) for name, r in rows.items()}
    flops = {name: float(r[1]) for name, r in rows.items()}
    ops = {name: int(r[2]) for name, r in rows.items()}
    assert len(rows) == 7
    assert kept["all nothing_saveable"] < kept["all dots_saveable"] < kept["no remat"]
    assert kept["all nothing_saveable"] < kept["every other layer nothing"] < kept["no remat"]
    assert kept["names: qkv + attn_out"] < kept["no remat"]
    assert kept["all everything_saveable"] == kept["no remat"]
    assert flops["all everything_saveable"] == flops["all dots_saveable"] == 0 < flops["all nothing_saveable"]
    assert ops["all everything_saveable"] == 0 < ops["all dots_saveable"] < ops["all nothing_saveable"]
    assert "matplotlib is not installed" in out and not png.exists()


def test_policy_sweep_plot_renders(tmp_path: Path) -> None:
    import pytest

    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import policy_sweep
    finally:
        sys.path.remove(str(ROOT / "examples"))
    png = tmp_path / "sweep.png"
    policy_sweep.plot({"no remat": {"kept": 2**21, "ms": 10.0}, "all nothing_saveable": {"kept": 2**19, "ms": 12.0}},
                      str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
