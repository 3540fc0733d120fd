"""Code that runs a traced graph with each aten op called through its C++ entry point.

fx generates `torch.ops.aten.mm.default(a, b)` for every op: four attribute lookups and
`OpOverload.__call__`, a Python frame whose body is `return self._op(*args, **kwargs)`.
On a cache hit a region runs its forward and backward graphs and little else, so that
frame is a large part of what remat adds per op. The code here is fx's own code for the
graph with each such call replaced by the `_op` it forwards to: the same kernels, the same
dispatch (modes, transforms, autocast see the same calls), one frame fewer per op.
"""

from __future__ import annotations

import functools
import itertools
import re
from typing import Any, Callable

import torch

from .._core.torch_internals import generated_code, op_entry_point

# An op fx names by its qualified name: torch.ops.<namespace>.<op>.<overload>(
_QUALIFIED_CALL = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\(")
_COUNTER = itertools.count()


def direct_code(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """`gm.forward`, with each aten op called without its Python frame; called as
    `fn(*inputs)`. Built from the code fx generates for `gm` and the globals fx runs that
    code with."""
    code, bindings = generated_code(gm)
    names: dict[str, str] = {}

    def replace(match: re.Match[str]) -> str:
        qualified = match.group(0)[:-1]
        if qualified not in names:
            entry = op_entry_point(*match.groups())
            if entry is None:
                return match.group(0)
            names[qualified] = f"_remat_op{len(names)}"
            bindings[names[qualified]] = entry
        return names[qualified] + "("

    source = _QUALIFIED_CALL.sub(replace, code)
    exec(compile(source, f"<remat graph {next(_COUNTER)}>", "exec"), bindings)
    return functools.partial(bindings["forward"], gm)  # a C-level bind: no frame of its own
