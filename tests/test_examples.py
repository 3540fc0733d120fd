"""The examples run (in a short mode) and say what they promise."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
