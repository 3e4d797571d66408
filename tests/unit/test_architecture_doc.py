"""docs/architecture.md tells the truth: its layout lists every top-level part of the package and nothing else, its
layers are the import graph's, and the two request trips it lists are the traced ones (scripts/import_layers.py and
scripts/trace_trip.py print each block as the page must show it)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.scripts import load_script

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _block(tag: str) -> list[str]:
    """The lines of the page's fenced block tagged ``tag`` ("" for the first untagged one: the layout)."""
    match = re.search(rf"^```{re.escape(tag)}\n(.*?)^```", DOC.read_text(), re.MULTILINE | re.DOTALL)
    assert match is not None, f"docs/architecture.md has no ```{tag} block"
    return match.group(1).rstrip("\n").split("\n")


def test_the_layout_lists_every_part_of_the_package_and_only_those() -> None:
    layers = load_script("import_layers")
    listed = []
    inside = False
    for line in _block(""):
        if line.startswith("p2pnode/"):
            inside = True
            continue
        if inside and line.startswith("  ") and not line.startswith("   "):
            listed.append(line.split()[0].removesuffix("/").removesuffix(".py"))
        elif inside and not line.startswith(" "):
            break
    assert sorted(listed) == layers.parts()


def test_the_layers_are_the_import_graphs() -> None:
    layers = load_script("import_layers")
    assert _block("layers") == layers.text(layers.layers()).split("\n")


def test_a_circle_has_no_layering(tmp_path: Path) -> None:
    """The check can fail: two parts importing each other are reported, not layered."""
    layers = load_script("import_layers")
    package = tmp_path / "p2pnode"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("import p2pnode.b\n")
    (package / "b.py").write_text("def f():\n    from p2pnode import a\n")  # a lazy import is a dependency too
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p2pnode.a\n")
    try:
        layers.layers(package)
    except ValueError as e:
        assert "a -> b -> a" in str(e)
    else:
        raise AssertionError("a circle was layered")
    (package / "b.py").write_text("")
    assert layers.layers(package) == [["a"], ["b", "c"]]  # c's import of a is type-only


async def test_the_trips_are_the_traced_ones() -> None:
    trip = load_script("trace_trip")
    traced = await trip.trace()
    for name in ("grpc", "http"):
        assert _block(f"trip {name}") == trip.table({name: traced[name]}).split("\n"), name
