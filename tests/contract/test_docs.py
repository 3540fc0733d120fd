"""The examples in the public docstrings run and print what they say; every Python block of
the README and docs/ runs; user pages hold no development history."""

from __future__ import annotations

import doctest
import re
import warnings
from pathlib import Path

import pytest
import torch

import remat._api.decorator
import remat._api.layers
import remat._api.naming


@pytest.mark.parametrize("module", [remat._api.decorator, remat._api.naming, remat._api.layers])
def test_docstring_examples(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_code_block_runs(document: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python blocks of a page run in order, in one namespace (a page sets up what
    its later blocks use), in a scratch directory (a block may write a plot)."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace: dict[str, object] = {"__name__": f"doc_{document.stem}"}
    for number, block in enumerate(_python_blocks(document.read_text()), 1):
        code = compile(block, f"{document.name} block {number}", "exec")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a page's example may warn as it says (a fallback, a cache turned off)
            exec(code, namespace)


def test_user_documentation_holds_no_development_history() -> None:
    """No commit hashes, issue numbers or notes about who measured what in the pages users read."""
    for document in [*DOCUMENTS, ROOT / "CHANGELOG.md"]:
        text = document.read_text()
        assert not re.search(r"\b[0-9a-f]{7,40}\b", text.replace("frontier", "")), document
        assert not re.search(r"[Ii]ssue \d|\.\./shared", text), document
