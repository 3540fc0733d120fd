"""The house's layers, read from the source: each module of `remat/` imports only its own
layer and the ones below, no module takes part in an import circle, `policies/` imports
nothing of the mechanism, and private torch names (`torch._...`) appear only in
`remat/_torch_internals.py`. Every import counts, those under TYPE_CHECKING or inside a
function too: a circle broken only at run time is still a circle for the reader."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REMAT = ROOT / "remat"
POLICIES = ROOT / "policies"

# Bottom to top; a module imports from its own layer or one below.
LAYERS: dict[str, tuple[str, ...]] = {
    "core": ("_torch_internals", "_errors", "_locking", "_nodes", "_ops"),
    "trace": (
        "_arguments", "_hooks", "_randomness", "_failures", "_recording", "_reachable",
        "_passes", "_mutations", "_records", "_tracing",
    ),
    "partition": ("_asking", "_budget", "_costs", "_debugging", "_offloading", "_compiling", "_partitioning"),
    "running": ("_graph_code", "_layouts", "_chaining", "_executing"),
    "plans": ("_sharing", "_caching", "_specializing"),
    "face": ("_remat", "_naming", "_layers", "_inspecting", "_comparing", "_measuring", "__init__"),
}
RANK = {module: rank for rank, modules in enumerate(LAYERS.values()) for module in modules}
INTERNALS = "_torch_internals"


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imported_modules(path: Path) -> set[str]:
    """The remat modules `path` imports, by their file names."""
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("remat."):
            found.add(node.module.split(".")[1])  # type: ignore[union-attr]
    return found - {"policies"}  # `from remat.policies import ...`: the vocabulary, below everything


def _graph() -> dict[str, set[str]]:
    return {path.stem: _imported_modules(path) for path in sorted(REMAT.glob("*.py"))}


def test_every_module_has_a_layer() -> None:
    modules = {path.stem for path in REMAT.glob("*.py")}
    assert modules == set(RANK), f"without a layer: {sorted(modules - set(RANK))}; gone: {sorted(set(RANK) - modules)}"


def test_modules_import_only_their_layer_and_below() -> None:
    upward = [
        f"{module} ({name(RANK[module])}) imports {target} ({name(RANK[target])})"
        for module, targets in _graph().items()
        for target in targets
        if target in RANK and RANK[target] > RANK[module]
    ]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def name(rank: int) -> str:
    return list(LAYERS)[rank]


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
    "path", [p for p in sorted([*REMAT.glob("*.py"), *POLICIES.glob("*.py")]) if p.stem != INTERNALS], ids=lambda p: p.name
)
def test_private_torch_names_only_behind_the_internals_module(path: Path) -> None:
    assert not _private_torch_names(path), f"{path.name}: " + "; ".join(_private_torch_names(path))


def test_the_checks_see_what_they_look_for() -> None:
    """The readers find an upward import, a circle and a private name where there is one."""
    internals = _private_torch_names(REMAT / f"{INTERNALS}.py")
    assert any("torch._C" in line for line in internals) and any("from torch._ops" in line for line in internals)
    assert "_tracing" in _imported_modules(REMAT / "_executing.py")
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert "_locking" in _imported_modules(REMAT / "_arguments.py")
