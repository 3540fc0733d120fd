"""Code that runs a traced graph with each aten op called through its C++ entry point.

fx generates `torch.ops.aten.mm.default(a, b)` for every op: four attribute lookups and
`OpOverload.__call__`, a Python frame whose body is `return self._op(*args, **kwargs)`.
On a cache hit a region runs its forward and backward graphs and little else, so that
frame is a large part of what remat adds per op. The code here calls each op's `_op`
instead: the same kernels, the same dispatch (modes, transforms, autocast see the same
calls), one frame fewer per op.

remat writes that code itself (`_source`) for the graphs its traces make (placeholders,
calls of functions, one output), as fx would, freeing each value after its last use; fx's
general code generator costs milliseconds per graph, paid again for each new size a
layer meets. A graph's first run, which compares its values with the trace (`layouts`),
goes node by node instead (`run_checked_nodes`): compiling code for one run costs more.
Any other graph runs through fx's code (`_fx_direct_code`) and fx's interpreter.
"""

from __future__ import annotations

import functools
import itertools
import keyword
import operator
import re
from typing import Any, Callable

import torch
import torch.fx

from .._core.torch_internals import (
    SYMBOLIC_SCALARS,
    entry_point_of,
    generated_code,
    op_entry_point,
    plain_code_generation,
)

# An op fx names by its qualified name: torch.ops.<namespace>.<op>.<overload>(
_QUALIFIED_CALL = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\(")
_COUNTER = itertools.count()
_LITERALS = (int, bool, str, type(None))  # written as Python literals; other constants are bound by name

Check = Callable[[torch.fx.Node, Any], Any]


def direct_code(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """`gm.forward`, with each aten op called without its Python frame; called as `fn(*inputs)`."""
    written = _compiled(gm)
    return written if written is not None else _fx_direct_code(gm)


def run_checked_nodes(gm: torch.fx.GraphModule, check: Check, inputs: tuple[Any, ...]) -> tuple[bool, Any]:
    """Run `gm` on `inputs` node by node, handing each placeholder's and each call's value
    to `check(node, value)` as it is made and going on with what that returns, each value
    freed after its last use, as its code would: (True, the outputs); (False, None) for a
    graph with other nodes than placeholders, calls of functions and one output, which
    runs no node here (fx's interpreter runs it). A graph's first run, once per graph:
    compiling code for it would cost more than this loop."""
    nodes = list(gm.graph.nodes)
    if not plain_code_generation(gm.graph) or any(n.op not in _WRITTEN for n in nodes):
        return False, None
    last_use = _last_uses(nodes)
    env: dict[torch.fx.Node, Any] = {}
    given = iter(inputs)
    load = functools.partial(torch.fx.node.map_arg, fn=env.__getitem__)
    for i, node in enumerate(nodes):
        if node.op == "placeholder":
            env[node] = check(node, next(given))
            continue
        if node.op == "output":
            return True, load(node.args[0])
        target = node.target
        entry = entry_point_of(target)
        env[node] = check(node, (entry or target)(*load(node.args), **load(node.kwargs)))
        for used in node.all_input_nodes:
            if last_use[used] == i:
                env.pop(used, None)
        if not node.users:
            del env[node]
    raise RuntimeError(f"remat: a graph without an output node: {gm}")


_WRITTEN = frozenset({"placeholder", "call_function", "output"})


def _last_uses(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, int]:
    """For each node another one uses, the position of its last user: where its value is freed."""
    last_use: dict[torch.fx.Node, int] = {}
    for i, node in enumerate(nodes):
        for used in node.all_input_nodes:
            last_use[used] = i
    return last_use


def _compiled(gm: torch.fx.GraphModule) -> Callable[..., Any] | None:
    written = _source(gm.graph)
    if written is None:
        return None
    source, bindings = written
    exec(compile(source, f"<remat graph {next(_COUNTER)}>", "exec"), bindings)
    return bindings["forward"]  # type: ignore[no-any-return]


class _Unwritable(Exception):
    """A graph `_source` leaves to fx."""


def _source(graph: torch.fx.Graph) -> tuple[str, dict[str, Any]] | None:
    """Python source of a function running `graph`, and the globals it runs with; None for a
    graph with other nodes than placeholders, calls of functions and one output, or with
    a constant that cannot be bound (a symbolic size), or whose inputs or output fx's code
    would flatten."""
    if not plain_code_generation(graph):
        return None
    nodes = list(graph.nodes)
    names = {node: f"v{i}" for i, node in enumerate(nodes)}
    bindings: dict[str, Any] = {}
    bound: dict[int, str] = {}

    def bind(value: Any, prefix: str) -> str:
        name = bound.get(id(value))
        if name is None:
            name = bound[id(value)] = f"_{prefix}{len(bound)}"
            bindings[name] = value
        return name

    def written(value: Any) -> str:
        kind = type(value)
        if kind is torch.fx.Node:
            return names[value]
        if kind in _LITERALS:
            return repr(value)
        if isinstance(value, list):  # fx holds lists as its immutable_list
            return "[" + ", ".join(map(written, value)) + "]"
        if kind is tuple:
            return "(" + "".join(written(v) + ", " for v in value) + ")"
        if isinstance(value, dict) and all(type(k) is str for k in value):  # fx's immutable_dict
            return "{" + ", ".join(f"{k!r}: {written(v)}" for k, v in value.items()) + "}"
        if isinstance(value, SYMBOLIC_SCALARS) or isinstance(value, (tuple, dict)):
            raise _Unwritable  # a symbolic size, a named tuple: fx's own code
        return bind(value, "k")  # a dtype, a device, a float, a memory format: the graph's own object

    last_use = _last_uses(nodes)
    placeholders = [node for node in nodes if node.op == "placeholder"]
    lines = [f"def forward({', '.join(names[p] for p in placeholders)}):"]
    try:
        for i, node in enumerate(nodes):
            if node.op == "placeholder":
                if node.args or str(node.target).startswith("*"):
                    return None  # a default value or *args: fx's own code
                continue
            if node.op == "output":
                lines.append(f"    return {written(node.args[0])}")
                break
            if node.op != "call_function" or not all(map(_is_name, node.kwargs)):
                return None
            lines.append(f"    {names[node]} = {_call(node, written, bind)}")
            freed = [names[used] for used in dict.fromkeys(node.all_input_nodes) if last_use[used] == i]
            if not node.users:
                freed.append(names[node])
            if freed:
                lines.append(f"    {' = '.join(freed)} = None")
        else:
            return None  # no output node
    except _Unwritable:
        return None
    return "\n".join(lines) + "\n", bindings


def _is_name(keyword_argument: str) -> bool:
    return keyword_argument.isidentifier() and not keyword.iskeyword(keyword_argument)


def _call(node: torch.fx.Node, written: Callable[[Any], str], bind: Callable[[Any, str], str]) -> str:
    """The expression of one call node."""
    target = node.target
    if target is operator.getitem and len(node.args) == 2 and not node.kwargs:
        return f"{written(node.args[0])}[{written(node.args[1])}]"
    entry = entry_point_of(target)
    function = bind(entry if entry is not None else target, "f")
    arguments = [written(a) for a in node.args] + [f"{k}={written(v)}" for k, v in node.kwargs.items()]
    return f"{function}({', '.join(arguments)})"


def _fx_direct_code(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """`direct_code` from the code fx generates for `gm` and the globals fx runs that code
    with, each `torch.ops.<namespace>.<op>.<overload>(` call replaced by its entry point."""
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
