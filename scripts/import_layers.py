#!/usr/bin/env python3
"""The package's import graph, read from the code: which top-level parts of ``p2pnode`` import which, in layers.

A part is a top-level module (``p2pnode/node.py`` is ``node``) or package (``p2pnode/routing/`` is ``routing``).
Every ``import`` of another part counts, at module level or inside a function (a lazy import is still a dependency),
except those under ``if TYPE_CHECKING:``: a type-only import makes no dependency at run time, and is listed apart.
The layers put each part one above the highest part it imports, so every import points down; a circle has no
layering and is reported instead. Generated code (``p2pnode/v1``) is not a part.

    python scripts/import_layers.py          # the layers, as docs/architecture.md lists them
    python scripts/import_layers.py --json   # {"layers": [[part, ...], ...], "imports": {...}, "type_only": {...}}

tests/unit/test_architecture_doc.py holds docs/architecture.md's layers to this.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "p2pnode"
GENERATED = frozenset({"v1"})


def parts(package: Path = PACKAGE) -> list[str]:
    """Every top-level module and package of ``package`` but generated code."""
    found = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    found |= {p.name for p in package.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    return sorted(found - GENERATED)


def _part_of(module: str, known: set[str]) -> str | None:
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 and pieces[0] == "p2pnode" and pieces[1] in known else None


def _type_only_nodes(tree: ast.AST) -> set[int]:
    """The import statements under ``if TYPE_CHECKING:``."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return inside


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and not node.level and node.module:
        return [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return []


def graph(package: Path = PACKAGE) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(run-time imports, type-only imports): part -> the other parts it imports."""
    known = set(parts(package))
    run: dict[str, set[str]] = defaultdict(set)
    typed: dict[str, set[str]] = defaultdict(set)
    for path in package.rglob("*.py"):
        source = path.relative_to(package).parts[0].removesuffix(".py")
        if source not in known:
            continue
        tree = ast.parse(path.read_text())
        type_only = _type_only_nodes(tree)
        for node in ast.walk(tree):
            for name in _imported(node):
                target = _part_of(name, known)
                if target is not None and target != source:
                    (typed if id(node) in type_only else run)[source].add(target)
    for source, targets in typed.items():
        targets -= run.get(source, set())
    return dict(run), {k: v for k, v in typed.items() if v}


def layers(package: Path = PACKAGE) -> list[list[str]]:
    """The parts by layer, the top first: each part one above the highest part it imports at run time. ValueError
    names a circle."""
    run, _ = graph(package)
    height: dict[str, int] = {}

    def place(part: str, path: tuple[str, ...]) -> int:
        if part in path:
            raise ValueError(f"import circle: {' -> '.join((*path[path.index(part):], part))}")
        if part not in height:
            below = [place(t, (*path, part)) for t in run.get(part, ())]
            height[part] = 1 + max(below, default=-1)
        return height[part]

    for part in parts(package):
        place(part, ())
    top = max(height.values())
    return [sorted(p for p, h in height.items() if h == level) for level in range(top, -1, -1)]


def text(found: list[list[str]]) -> str:
    return "\n".join(f"{len(found) - 1 - i:2}  {' '.join(layer)}" for i, layer in enumerate(found))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    found = layers()
    if args.json:
        run, typed = graph()
        as_lists = {k: sorted(v) for k, v in sorted(run.items())}
        print(json.dumps({"layers": found, "imports": as_lists, "type_only": {k: sorted(v) for k, v in typed.items()}}))
    else:
        print(text(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
