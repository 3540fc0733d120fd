"""The house's layers, read from the source: each module of `remat/` imports only its own
layer and the ones below, no module takes part in an import circle, `policies/` imports
nothing of the mechanism, and private torch names (`torch._...`) appear only in
`remat/_core/torch_internals.py`. Every import counts, those under TYPE_CHECKING or inside a
function too: a circle broken only at run time is still a circle for the reader."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REMAT = ROOT / "remat"
POLICIES = ROOT / "policies"

# Bottom to top: each layer is a subpackage of remat/, and a module imports from its own
# layer or one below. remat/__init__.py, the face, may import any layer.
LAYERS = ("_core", "_trace", "_partition", "_running", "_plans", "_api")
RANK = {layer: rank for rank, layer in enumerate(LAYERS)}
FACE = "__init__"
INTERNALS = "_core.torch_internals"


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _module_name(path: Path) -> str:
    """`layer.module` for a module inside a layer, `__init__` for remat/__init__.py."""
    relative = path.relative_to(REMAT).with_suffix("")
    return ".".join(relative.parts) if len(relative.parts) > 1 else relative.name


def _modules() -> list[Path]:
    return sorted(REMAT.rglob("*.py"))


def _imported_modules(path: Path) -> set[str]:
    """The remat modules `path` imports, as `layer.module` (or `layer` for the package)."""
    package = _module_name(path).split(".")[:-1]  # remat/_trace/x.py: ["_trace"]; remat/__init__.py: []
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            parts = [*base, *(node.module or "").split(".")] if node.module else base
            names = [".".join([*parts, alias.name]) for alias in node.names] if not node.module else [".".join(parts)]
            found.update(names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("remat."):
            found.add(node.module.removeprefix("remat."))  # type: ignore[union-attr]
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("remat.") for a in node.names if a.name.startswith("remat."))
    # `policies`: the vocabulary, below everything; a module's own `__init__` is no dependency
    return {name for name in found if name.split(".")[0] != "policies" and name != "__init__"}


def _layer(module: str) -> str:
    return module.split(".")[0]


def _graph() -> dict[str, set[str]]:
    return {_module_name(path): _imported_modules(path) for path in _modules()}


def test_every_module_has_a_layer() -> None:
    """remat/ holds only the face and the layers' subpackages, each with its docstring."""
    loose = [name for name in _graph() if name != FACE and _layer(name) not in RANK]
    assert not loose, f"modules outside a layer: {loose}"
    for layer in LAYERS:
        assert ast.get_docstring(_tree(REMAT / layer / "__init__.py")), f"{layer}/__init__.py says nothing of its layer"


def test_modules_import_only_their_layer_and_below() -> None:
    upward = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        if module != FACE
        for target in targets
        if RANK[_layer(target)] > RANK[_layer(module)]
    ]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    circles: list[list[str]] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in path:
                circles.append(path[path.index(target):] + [target])
            elif target not in done:
                visit(target, path + [target])
        done.add(module)

    for module in graph:
        if module not in done:
            visit(module, [module])
    return circles


def test_no_import_circle() -> None:
    circles = _circles(_graph())
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


@pytest.mark.parametrize("path", sorted(POLICIES.glob("*.py")), ids=lambda p: p.name)
def test_policies_import_nothing_of_the_mechanism(path: Path) -> None:
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            assert node.level > 0 or not (node.module or "").startswith("remat"), f"{path.name}: from {node.module} import"
        elif isinstance(node, ast.Import):
            assert not any(alias.name.startswith("remat") for alias in node.names), f"{path.name}: import remat"


def _private_torch_names(path: Path) -> list[str]:
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch._"):
            found.append(f"line {node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.startswith("torch._")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id == "torch" and _first_attribute(node).startswith("_"):
                found.append(f"line {node.lineno}: torch.{_first_attribute(node)}")
    return found


def _first_attribute(node: ast.Attribute) -> str:
    while isinstance(node.value, ast.Attribute):
        node = node.value
    return node.attr


@pytest.mark.parametrize(
    "path",
    [p for p in [*_modules(), *sorted(POLICIES.glob("*.py"))] if p.parent == POLICIES or _module_name(p) != INTERNALS],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_private_torch_names_only_behind_the_internals_module(path: Path) -> None:
    assert not _private_torch_names(path), f"{path.name}: " + "; ".join(_private_torch_names(path))


def test_the_checks_see_what_they_look_for() -> None:
    """The readers find an upward import, a circle and a private name where there is one."""
    internals = _private_torch_names(REMAT / "_core" / "torch_internals.py")
    assert any("torch._C" in line for line in internals) and any("from torch._ops" in line for line in internals)
    assert "_trace.tracing" in _imported_modules(REMAT / "_running" / "executing.py")
    assert "_core.locking" in _imported_modules(REMAT / "_trace" / "arguments.py")
    assert "_trace.records" in _imported_modules(REMAT / "_trace" / "tracing.py")  # same layer: `from .records import`
    assert "_api.decorator" in _imported_modules(REMAT / "__init__.py")
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
