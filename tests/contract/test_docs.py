"""The examples in the public docstrings run and print what they say."""

from __future__ import annotations

import doctest

import pytest

import remat._api.layers
import remat._api.naming
import remat._api.decorator


@pytest.mark.parametrize("module", [remat._api.decorator, remat._api.naming, remat._api.layers])
def test_docstring_examples(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
