"""The package's layers and the imports between them: ``python tools/layers.py`` prints the layer
graph, every import that crosses a wall, and the largest modules. ``tests/test_layers.py`` fails
on a crossing that is not listed in ``KNOWN`` (and on a listed one that is gone).

Layers, bottom up; a module may import its own layer and the ones below it (``ALLOWED``):

- ``base``: errors, wire constants, kernels, tensors, masks, the allocator, the object table's
  layout, arena mappings, identity, the generated protos;
- ``daemon``: the daemon (never the client);
- ``protocol``: request schemas, validation, limits, the model spec both sides agree on,
  capabilities (pure: no daemon, no client, no sockets);
- ``client``: Producer/Consumer, the table client, the asyncio clients;
- ``frontend`` (renderer, request building), ``worker`` (request reading, the reference worker),
  ``remote`` (the remote tier; its daemon extension may use the daemon): side by side, none
  imports another;
- ``bridges``: our request -> stock servers' schemas (reads requests as a worker does);
- ``app``: engine, CLI, pytest plugin, testing.
Imports inside functions count: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
import pathlib
import sys

PACKAGE = "shmtransport"
SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / PACKAGE

LAYER_OF_PREFIX = [  # first match wins
    ("daemon", "daemon"),
    ("client", "client"), ("aio", "client"),
    ("protocol", "protocol"),
    ("frontend", "frontend"), ("worker", "worker"), ("remote", "remote"), ("bridges", "bridges"),
    ("engine", "app"), ("cli", "app"),
    ("__main__", "app"), ("pytest_plugin", "app"), ("testing", "app"),
]
ALLOWED = {
    "base": {"base"},
    "daemon": {"base", "daemon"},
    "protocol": {"base", "protocol"},
    "client": {"base", "protocol", "client"},
    "frontend": {"base", "protocol", "client", "frontend"},
    "worker": {"base", "protocol", "client", "worker"},
    "remote": {"base", "protocol", "client", "daemon", "remote"},
    "bridges": {"base", "protocol", "client", "worker", "bridges"},
    "app": {"base", "daemon", "protocol", "client", "frontend", "worker", "remote", "bridges", "app"},
}
# Crossings not fixed yet, each (importer, imported). Listed so that none is added unnoticed; the
# list only shrinks (tests/test_layers.py fails on a listed crossing that is gone).
KNOWN: set[tuple[str, str]] = set()


def layer_of(module: str) -> str:
    for prefix, layer in LAYER_OF_PREFIX:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return "base"


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The absolute module (without the package name) an ``ImportFrom`` names, or None if outside."""
    if node.level == 0:
        name = node.module or ""
        if name != PACKAGE and not name.startswith(PACKAGE + "."):
            return None
        return name[len(PACKAGE) + 1:]
    base = module.split(".") if module else []
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def graph(root: pathlib.Path = SRC) -> dict[str, set[str]]:
    """module -> the package's modules it imports (names relative to the package)."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py") if "v1" not in p.relative_to(root).parts[:1]}
    known = set(modules) | {""}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name[len(PACKAGE) + 1:] for a in node.names if a.name.startswith(PACKAGE + ".")]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(node, module, is_package)
                if target is None:
                    continue
                # ``from . import x``: x may be a module of its own
                targets = [f"{target}.{a.name}".strip(".") if f"{target}.{a.name}".strip(".") in known else target
                           for a in node.names]
            for target in targets:
                if target.startswith("v1"):
                    continue  # generated protos: base
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target and target != module:
                    edges[module].add(target)
    return edges


def crossings(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(m, t) for m, targets in edges.items() for t in targets if layer_of(t) not in ALLOWED[layer_of(m)]}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import each other, directly or through others (strongly connected
    components of more than one module), each sorted; TYPE_CHECKING imports count too."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in edges.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return sorted(found)


def layer_graph(edges: dict[str, set[str]]) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for m, targets in edges.items():
        for t in targets:
            key = (layer_of(m), layer_of(t))
            if key[0] != key[1]:
                counts[key] = counts.get(key, 0) + 1
    return counts


def main() -> int:
    edges = graph()
    print("layer -> layer: module imports")
    for (a, b), n in sorted(layer_graph(edges).items()):
        print(f"  {a:8} -> {b:8} {n}")
    found = crossings(edges)
    print(f"crossings: {len(found)} ({len(found - KNOWN)} not in KNOWN)")
    for m, t in sorted(found):
        print(f"  {m} -> {t}{'' if (m, t) in KNOWN else '   NEW'}")
    circles = cycles(edges)
    print(f"import circles: {len(circles)}")
    for group in circles:
        print("  " + " <-> ".join(group))
    sizes = sorted(((len(p.read_text().splitlines()), p.relative_to(SRC)) for p in SRC.rglob("*.py")
                    if "v1" not in p.relative_to(SRC).parts[:1]), reverse=True)[:10]
    print("largest modules (lines):")
    for n, p in sizes:
        print(f"  {n:5} {p}")
    return 1 if found != KNOWN or circles else 0


if __name__ == "__main__":
    sys.exit(main())
