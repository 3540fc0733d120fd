"""A user's type checker sees a decorated function's own signature: mypy (the `test`
extra installs it) on a typed script that calls `remat(f)` rightly and wrongly."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.examples  # runs a tool on a script: about 30 s, most of it reading torch's types
pytest.importorskip("mypy")

ROOT = Path(__file__).resolve().parents[2]

USER_SCRIPT = '''
import torch

from remat import policies as P
from remat import remat


@remat(policy=P.dots_saveable)
def block(x: torch.Tensor, w: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    return torch.tanh(x @ w) * scale


def plain(x: torch.Tensor, n: int) -> torch.Tensor:
    return x * n


wrapped = remat(plain)
layer = remat(torch.nn.Linear(2, 2))
reveal_type(block)
reveal_type(wrapped)
reveal_type(layer)
ok: torch.Tensor = block(torch.ones(2, 2), torch.ones(2, 2), scale=2.0)
block(torch.ones(2, 2))
wrapped(torch.ones(2), "three")
'''


def test_mypy_sees_a_rematerialized_function_s_signature(tmp_path: Path) -> None:
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(USER_SCRIPT))
    config = tmp_path / "mypy.ini"
    config.write_text(f"[mypy]\nmypy_path = {ROOT}\nfollow_imports = silent\ncache_dir = {tmp_path / 'cache'}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), str(script)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    lines = proc.stdout.splitlines()
    revealed = [  # mypy versions differ in spelling builtins
        line.split("Revealed type is ", 1)[1].replace("builtins.", "") for line in lines if "Revealed type" in line
    ]
    assert revealed == [
        '"remat._api.decorator.Rematerialized[[x: torch._tensor.Tensor, w: torch._tensor.Tensor, *, '
        'scale: float =], torch._tensor.Tensor]"',
        '"remat._api.decorator.Rematerialized[[x: torch._tensor.Tensor, n: int], torch._tensor.Tensor]"',
        '"remat._api.decorator.RematerializedModule"',
    ], proc.stdout
    errors = [line for line in lines if ": error:" in line]
    assert len(errors) == 2, proc.stdout
    assert 'Missing positional argument "w"' in errors[0]
    assert 'incompatible type "str"; expected "int"' in errors[1]
