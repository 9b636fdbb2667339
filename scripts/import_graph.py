"""Print the package-level import graph of elasticdl and fail on a package cycle.

Every module under ``elasticdl/`` and ``elasticdl_client/`` is parsed with ``ast``; every
``import`` and ``from ... import`` counts, wherever it sits: at module level, inside a function,
under ``if TYPE_CHECKING:``. A module's package is its first component below ``elasticdl``
(``elasticdl.master.job`` -> ``master``); ``elasticdl_client`` is one package. A string passed
to ``importlib.import_module`` is not an import and is not seen (the layers contract forbids
them for that reason: strategies are registered, not named by module path).

    python scripts/import_graph.py            # the package graph, exit 1 on a cycle
    python scripts/import_graph.py --modules  # also each module-level edge between packages
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Set, Tuple

ROOTS = ("elasticdl", "elasticdl_client")
SKIP = ("elasticdl/proto/elasticdl_pb2",)


def module_name(path: str, repo: str) -> str:
    rel = os.path.relpath(path, repo)[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def package_of(module: str) -> Optional[str]:
    parts = module.split(".")
    if parts[0] == "elasticdl_client":
        return "elasticdl_client"
    if parts[0] != "elasticdl" or len(parts) < 2:
        return None
    return parts[1]


def imports_of(tree: ast.AST, module: str, is_package: bool) -> Set[str]:
    """Every module named by an import statement anywhere in ``tree``."""
    found: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                drop = node.level - 1 if is_package else node.level
                base = base[: len(base) - drop] if drop else base
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # `from elasticdl import master` names the package master
            found.update(f"{target}.{alias.name}" for alias in node.names
                         if alias.name != "*")
    return found


def build(repo: str) -> Tuple[Dict[str, Set[str]], Dict[Tuple[str, str], Set[str]]]:
    graph: Dict[str, Set[str]] = defaultdict(set)
    edges: Dict[Tuple[str, str], Set[str]] = defaultdict(set)
    for root in ROOTS:
        for folder, _dirs, files in os.walk(os.path.join(repo, root)):
            for name in sorted(files):
                path = os.path.join(folder, name)
                if not name.endswith(".py") or any(
                        os.path.relpath(path, repo).startswith(s) for s in SKIP):
                    continue
                module = module_name(path, repo)
                source_pkg = package_of(module)
                if source_pkg is None:
                    continue
                graph.setdefault(source_pkg, set())
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                for target in imports_of(tree, module, name == "__init__.py"):
                    target_pkg = package_of(target)
                    if target_pkg is None or target_pkg == source_pkg:
                        continue
                    if not os.path.exists(os.path.join(repo, "elasticdl", target_pkg)) and \
                            target_pkg != "elasticdl_client":
                        continue  # `from elasticdl import x` of a module, not a package
                    graph[source_pkg].add(target_pkg)
                    edges[(source_pkg, target_pkg)].add(f"{module} -> {target}")
    return graph, edges


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", action="store_true",
                        help="list the module imports behind each package edge")
    args = parser.parse_args(argv)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    graph, edges = build(repo)
    for pkg in sorted(graph):
        print(f"{pkg:17s} -> {', '.join(sorted(graph[pkg])) or '(nothing)'}")
        if args.modules:
            for target in sorted(graph[pkg]):
                for line in sorted(edges[(pkg, target)]):
                    print(f"    {line}")
    found = cycles(graph)
    sys.stdout.flush()
    for component in found:
        print(f"package cycle: {' <-> '.join(component)}", file=sys.stderr)
    if found:
        return 1
    print("no package cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
