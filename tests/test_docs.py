"""The examples in the public docstrings run and print what they say."""

from __future__ import annotations

import doctest

import pytest

import remat._layers
import remat._naming
import remat._remat


@pytest.mark.parametrize("module", [remat._remat, remat._naming, remat._layers])
def test_docstring_examples(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
