"""The package's shape, as rules a change cannot break unseen: layers that point one way,
no import cycles, no reading of another module's private attributes.

There is no cap on a file's length: one idea per file, split along the idea's seams, never
by trimming prose (docs/development.md, "Layout")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dtrain.import_order import LAYERS, layer_of
from tests.support.paths import SRC

PACKAGE = SRC / "dtrain"
FOREIGN_PRIVATE = {"_get_backend", "_timeout", "_version", "_init_weights"}
"""Other libraries' underscored names dtrain relies on: torch's process-group backend and
timeout, a tensor's version counter (autograd's in-place check), and transformers'
per-module initializer (how a Hugging Face model draws its weights)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str:
    """The dtrain module `name` imports: itself if a module, else its nearest package."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (never run)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def imports_of(module: str) -> set[str]:
    """The dtrain modules `module` imports, wherever in the file (function-local too)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {_resolve(a.name) for a in node.names if a.name.split(".")[0] == "dtrain"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}".rstrip(".")
            if base.split(".")[0] != "dtrain":
                continue
            for alias in node.names:
                found.add(_resolve(f"{base}.{alias.name}"))
    found.discard(module)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_a_module_no_layer_names_is_refused() -> None:
    """The top-level package names itself only: a module or subpackage that LAYERS does not
    place raises instead of landing in the front layer through the prefix "dtrain"."""
    for unplaced in ("dtrain.nonexistent_thing", "dtrain.nonexistent_thing.inner"):
        with pytest.raises(KeyError, match="is in no layer"):
            layer_of(unplaced)
    front = len(LAYERS) - 1
    assert layer_of("dtrain") == front and layer_of("dtrain.cli") == front
    collectives = [name for name, _ in LAYERS].index("collectives")
    assert layer_of("dtrain.comm") == layer_of("dtrain.comm.shm") == collectives


def test_every_name_in_the_layers_is_a_module() -> None:
    """No stale entry: each name in LAYERS is a module or package of the tree."""
    assert [name for _, names in LAYERS for name in names if name not in MODULES] == []


def test_no_import_climbs_a_layer() -> None:
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
              for m, deps in GRAPH.items() for d in sorted(deps)
              if m != "dtrain" and layer_of(d) > layer_of(m)]
    assert upward == []


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for d in sorted(GRAPH[m]):
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in on_stack:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == m:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in sorted(GRAPH):
        if m not in index:
            visit(m)
    return found


def test_no_import_cycles() -> None:
    # A package's __init__ that re-exports its modules is exempt as an importer: it runs
    # first whenever one of its modules is imported, so a module importing it is a cycle.
    assert _cycles() == []


def _defined_private(tree: ast.Module) -> set[str]:
    """Private names a file defines: functions, classes, attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_")}


def _foreign_modules(tree: ast.Module) -> set[str]:
    """Names bound to modules from outside dtrain (torch, os, ...): their private parts
    are theirs to answer for."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if not a.name.startswith("dtrain")}
        elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("dtrain"):
            names |= {a.asname or a.name for a in node.names}
    return names


def test_no_module_reads_another_modules_private_attributes() -> None:
    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        own, foreign = _defined_private(tree), _foreign_modules(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.attr not in own
                    and node.attr not in FOREIGN_PRIVATE):
                continue
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in foreign:
                continue
            found.append(f"{module}:{node.lineno} reads {ast.unparse(node)}")
    assert found == []


TESTS = SRC.parent / "tests"
TEST_GROUPS = {"package": "rules over the whole tree (layers, types, docs, the environment)",
               "support": "the tests' own helpers (the CLI, poll, hosts, etcd, soak counts)",
               "gpu": "the CUDA lane, across packages"}
"""Folders of tests/ that are not named after a package or module of dtrain."""


def test_tests_mirror_the_packages_they_test() -> None:
    """tests/X/ holds the tests of dtrain.X (a package or module of the tree), so that a
    contributor finds them where the code is; the few folders that are not are listed."""
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    unplaced = sorted(f for f in folders - set(TEST_GROUPS)
                      if f"dtrain.{f}" not in MODULES)
    assert unplaced == []
    assert not list(TESTS.glob("test_*.py")), "a test file outside the package folders"


def test_benchmarks_import_nothing_from_the_tests() -> None:
    """A benchmark stands on dtrain alone (dtrain.testing has what both need)."""
    found = [f"{path.name}:{node.lineno}"
             for path in sorted((SRC.parent / "benchmarks").glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0]
                 == "tests") or (isinstance(node, ast.Import)
                                  and any(a.name.split(".")[0] == "tests" for a in node.names))]
    assert found == []
