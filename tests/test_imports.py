"""The Python package's import structure, read from its source with ``ast`` (nothing is imported):
the modules of ``fused_dense`` import each other without a cycle, counting the imports inside
functions, each only modules of the tiers below its own (docs/contract.md, "Layers"), and no
module imports another's private (underscore) names.

Allowed private modules: the package's loading infrastructure and ``_common``, the shared private
module whose names are public within the package.
"""
import ast
import re
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

PACKAGE = "fused_dense"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE
ALLOWED_PRIVATE_MODULES = {"_loader", "_version", "_abi", "_build_info", "_C", "_common"}
CONTRACT = Path(__file__).resolve().parents[1] / "docs" / "contract.md"


def tiers() -> List[List[str]]:
    """The package's rows of docs/contract.md's layers table, top to bottom, as module names;
    then what the build writes (the compiled library and _build_info), at the bottom."""
    rows = []
    for line in CONTRACT.read_text().splitlines():
        if line.startswith(f"| `{PACKAGE}/"):
            stems = re.findall(r"`(?:" + PACKAGE + r"/)?(\w+)\.py`", line.split("|")[1])
            rows.append([_module_name(Path(f"{stem}.py")) for stem in stems])
    return rows + [[f"{PACKAGE}._build_info", f"{PACKAGE}._C"]]


def _module_name(path: Path) -> str:
    return PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _Imports:
    """The package modules one file imports, and the private names it takes from them."""

    def __init__(self, name: str, tree: ast.AST, modules: Set[str]):
        self.name, self.modules = name, modules
        self.edges: Set[str] = set()
        self.private: List[str] = []
        aliases: Dict[str, str] = {}  # a local name bound to a package module -> that module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = self._longest_module(alias.name)
                    if target is not None:
                        self._edge(target, node)
                        if alias.asname:
                            aliases[alias.asname] = target
                        elif alias.name == PACKAGE:
                            aliases[PACKAGE] = PACKAGE
            elif isinstance(node, ast.ImportFrom):
                base = self._resolve(node)
                if base is None:
                    continue
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:  # a submodule: `from . import ops`
                        self._edge(f"{base}.{alias.name}", node)
                        aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
                        continue
                    self._edge(base, node)
                    if _is_private(alias.name):
                        self.private.append(f"{name} line {node.lineno}: from {base} import {alias.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in aliases and _is_private(node.attr) \
                    and f"{aliases[node.value.id]}.{node.attr}" not in modules:
                self.private.append(f"{name} line {node.lineno}: {node.value.id}.{node.attr} "
                                    f"({aliases[node.value.id]})")

    def _longest_module(self, dotted: str) -> Optional[str]:
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in self.modules:
                return ".".join(parts[:n])
        return None

    def _resolve(self, node: ast.ImportFrom) -> Optional[str]:
        """The module `from X import ...` reads, as a package module name, or None (outside)."""
        if node.level == 0:
            return self._longest_module(node.module or "")
        package = self.name if self.name == PACKAGE else self.name.rpartition(".")[0]
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - (node.level - 1)])
        full = f"{base}.{node.module}" if node.module else base
        return full if full in self.modules else self._longest_module(full)

    def _edge(self, target: str, node) -> None:
        if target == self.name:
            return
        self.edges.add(target)
        leaf = target.rpartition(".")[2]
        if target != PACKAGE and _is_private(leaf) and leaf not in ALLOWED_PRIVATE_MODULES:
            self.private.append(f"{self.name} line {node.lineno}: imports the private module {target}")


def read_package(package_dir: Path) -> Tuple[Dict[str, Set[str]], List[str]]:
    """(graph: module -> the package modules it imports, the private-name imports found)."""
    files = sorted(package_dir.glob("*.py"))
    # what the build writes counts as a module whether or not this tree has been built
    modules = {_module_name(p) for p in files} | {f"{PACKAGE}._C", f"{PACKAGE}._build_info"}
    graph, private = {}, []
    for path in files:
        found = _Imports(_module_name(path), ast.parse(path.read_text(), str(path)), modules)
        graph[found.name] = found.edges
        private += found.private
    return graph, private


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def _format(graph: Dict[str, Set[str]]) -> str:
    return "\n".join(f"  {m} -> {', '.join(sorted(graph[m])) or '(none)'}" for m in sorted(graph))


def test_no_import_cycle():
    graph, _ = read_package(PACKAGE_DIR)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}\nthe package's imports:\n{_format(graph)}"


def imports_not_down(graph: Dict[str, Set[str]]) -> List[str]:
    """The imports of a module in the same or a higher row of the layers table, and the modules
    in no row."""
    tier = {name: i for i, row in enumerate(tiers()) for name in row}
    found = [f"{m} is in no row of docs/contract.md's layers table" for m in sorted(set(graph) - set(tier))]
    return found + [f"{m} -> {t}" for m in sorted(graph) if m in tier for t in sorted(graph[m])
                    if tier.get(t, -1) <= tier[m]]


def test_imports_go_down_the_layers_table():
    graph, _ = read_package(PACKAGE_DIR)
    found = imports_not_down(graph)
    assert not found, "imports not down the layers table of docs/contract.md:\n" + "\n".join(found)


def test_no_private_names_across_modules():
    _, private = read_package(PACKAGE_DIR)
    assert not private, "private names imported from other package modules:\n" + "\n".join(private)


def test_the_checks_find_planted_faults(tmp_path):
    """The checks above fail on a package that has what they look for: a copy of the package
    with a cycle planted through an import inside a function, a private name imported, a private
    attribute of an imported module read, a sideways import and a module in no row."""
    copy = tmp_path / PACKAGE
    copy.mkdir()
    for path in PACKAGE_DIR.glob("*.py"):
        shutil.copy(path, copy / path.name)
    graph, private = read_package(copy)
    assert find_cycle(graph) is None and not private and not imports_not_down(graph)
    assert f"{PACKAGE}.ops" in graph[f"{PACKAGE}.functional"]
    with open(copy / "ops.py", "a") as f:
        f.write("\n\ndef _planted():\n    from .functional import fused_mlp_func, _as_private\n")
    graph, private = read_package(copy)
    cycle = find_cycle(graph)
    assert cycle is not None and f"{PACKAGE}.ops" in cycle and f"{PACKAGE}.functional" in cycle, cycle
    assert any("_as_private" in p for p in private), private
    assert f"{PACKAGE}.ops -> {PACKAGE}.functional" in imports_not_down(graph)
    (copy / "extra.py").write_text("from . import ops as _o\n\n_o._op\n")
    with open(copy / "modules.py", "a") as f:
        f.write("\nfrom .parallel import ColumnParallelLinear\n")
    graph, private = read_package(copy)
    assert any("_o._op" in p for p in private), private
    found = imports_not_down(graph)
    assert f"{PACKAGE}.extra is in no row of docs/contract.md's layers table" in found, found
    assert f"{PACKAGE}.modules -> {PACKAGE}.parallel" in found, found
