"""What remat says while it works: its log (each trace with why and how long, replays), a
progress line for long comparisons, warnings at the user's line with advice that fits,
and no torch.compile notice to a user who compiled nothing."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import remat
from remat import policies as P

HERE = os.path.abspath(__file__)


def _tanh(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


def test_the_log_says_each_trace_why_and_how_long(caplog: pytest.LogCaptureFixture) -> None:
    region = remat.remat(_tanh, name="logged")
    w = torch.randn(4, 4, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="remat"):
        region(torch.randn(3, 4), w).sum().backward()
        region(torch.randn(3, 4), w).sum().backward()  # from the cache: nothing to say
        torch.func.grad(lambda w: region(torch.randn(5, 4), w).sum())(w)
    lines = [r.getMessage() for r in caplog.records if r.name == "remat"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("remat(logged): traced in ") and lines[0].endswith("ms (first call)")
    assert "float32[3, 4] on cpu -> float32[5, 4] on cpu" in lines[1]


def test_the_environment_switch_prints_the_log() -> None:
    code = "import torch, remat\nremat.remat(lambda x: x.sin())(torch.ones(2, requires_grad=True)).sum().backward()\n"
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "REMAT_LOG": "info"}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "[remat] remat(<lambda>): traced in " in proc.stderr, proc.stderr


class _Stores(torch.nn.Module):
    """Keeps what it computes where the caller sees it: replays."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = self.linear(x)
        return self.last.tanh()


def test_a_replay_warns_at_the_user_s_line_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    layers = torch.nn.ModuleList([_Stores()])
    remat.checkpoint_layers(layers, P.nothing_saveable)
    with caplog.at_level(logging.INFO, logger="remat"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layers[0](torch.randn(2, 4)).sum().backward()  # the user's line
    fallback = [w for w in caught if issubclass(w.category, remat.RematFallbackWarning)]
    assert len(fallback) == 1 and fallback[0].filename == HERE, [(w.filename, w.lineno) for w in fallback]
    assert any("runs replayed" in r.getMessage() for r in caplog.records if r.name == "remat")


def test_the_retrace_warning_names_dynamic_when_only_sizes_change() -> None:
    region = remat.remat(_tanh)
    w = torch.randn(4, 4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(2, 12):  # under a transform every size is traced
            torch.func.grad(lambda w: region(torch.randn(n, 4), w).sum())(w)
    retraces = [w for w in caught if issubclass(w.category, remat.RematRetraceWarning)]
    assert retraces and all(w.filename == HERE for w in retraces), [(w.filename, w.lineno) for w in retraces]
    assert "dynamic=True" in str(retraces[0].message)


def test_dynamic_regions_say_nothing_about_a_compile_the_user_did_not_ask_for(tmp_path: Path) -> None:
    script = tmp_path / "dynamic.py"
    script.write_text(textwrap.dedent("""
        import torch, remat
        from remat import policies as P
        region = remat.remat(lambda x: torch.tanh(x @ x), dynamic=True, policy=P.dots_saveable)
        for n in (3, 4, 5):
            region(torch.randn(n, n, requires_grad=True)).sum().backward()
        print("ran")
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ran" in proc.stdout, proc.stderr
    assert "context_fn is passed to torch.utils.checkpoint" not in proc.stderr, proc.stderr


def test_a_measured_comparison_shows_its_progress(capfd: pytest.CaptureFixture[str]) -> None:
    region = remat.remat(_tanh)
    rows = remat.compare(region, torch.randn(3, 4), torch.randn(4, 4), policies=[P.nothing_saveable, P.dots_saveable],
                         measure=True, repeats=2)
    assert len(rows) == 3
    assert "remat.compare" in capfd.readouterr().err
