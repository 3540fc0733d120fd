"""Whose code a file or a code object is: the user's, or the machinery's and the libraries'.

Two questions share one set of places. Blame (which line of the user's does an error or an
op come from) skips torch, optree and remat. The closure walk (which code may hold the
user's tensors) also skips the standard library and installed packages: a model's tensors
are found through its module, not through a library function's globals."""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import types

import optree
import torch

REMAT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MACHINERY = (os.path.dirname(torch.__file__), REMAT_DIR, os.path.dirname(optree.__file__))
_INSTALLED = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")} | {REMAT_DIR, _MACHINERY[0]}
)


@functools.lru_cache(maxsize=4096)
def is_machinery_file(filename: str) -> bool:
    """A file of torch, optree or remat (or frozen bootstrap code): never the user's line."""
    return filename.startswith(_MACHINERY) or "<frozen" in filename


def is_installed_code(code: types.CodeType) -> bool:
    """Code of an installed package or of the standard library, which holds no user tensors."""
    return code.co_filename.startswith(_INSTALLED)


@functools.lru_cache(maxsize=1024)
def is_user_class(cls: type) -> bool:
    """A class defined in the user's code (a script, `__main__`, the user's package), whose
    instances may hold the user's tensors as attributes; not a builtin, not a library's."""
    if cls.__module__ == "builtins":
        return False
    module = sys.modules.get(cls.__module__)
    filename = getattr(module, "__file__", None)
    return filename is None or not filename.startswith(_INSTALLED)
