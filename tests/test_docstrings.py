"""Every public definition under ``src/shmtransport`` has a docstring (the generated ``v1/`` excepted).

Public: a module-level function or class, or a method or nested class of a public class, whose name
does not start with ``_``. Functions nested inside functions are not public. The only exemption by
rule is a gRPC servicer's RPC override: a method named after an RPC, in a class with a base named
``*Servicer``, is documented by the ``.proto`` it implements.
"""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "src" / "shmtransport"

# RPCs whose overrides in ``*Servicer`` subclasses need no docstring of their own (see the .proto files).
SERVICER_RPCS = frozenset({"GetServerInfo", "Generate", "GenerateStream"})


def _is_servicer(cls: ast.ClassDef) -> bool:
    for base in cls.bases:
        name = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else ""
        if name.endswith("Servicer"):
            return True
    return False


def _undocumented(body: list[ast.stmt], prefix: str, owner: ast.ClassDef | None) -> list[str]:
    missing = []
    for node in body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        exempt = (owner is not None and _is_servicer(owner) and node.name in SERVICER_RPCS
                  and not isinstance(node, ast.ClassDef))
        if ast.get_docstring(node) is None and not exempt:
            missing.append(f"{prefix}{node.name} (line {node.lineno})")
        if isinstance(node, ast.ClassDef):
            missing += _undocumented(node.body, f"{prefix}{node.name}.", node)
    return missing


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "v1")


def test_every_public_definition_has_a_docstring():
    missing = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        missing += [f"{rel}: {name}" for name in _undocumented(ast.parse(path.read_text()).body, "", None)]
    assert not missing, "public definitions without a docstring:\n" + "\n".join(missing)


def test_the_walk_finds_methods_and_skips_nested_functions_and_servicer_rpcs():
    tree = ast.parse(
        "def f():\n    def inner(): pass\n"
        "class C:\n    def m(self): pass\n    def _p(self): pass\n    class N: pass\n"
        "class _Private:\n    def m(self): pass\n"
        "class S(pb.GeneratorServicer):\n    def Generate(self, r, c): pass\n    def helper(self): pass\n"
    )
    names = [entry.split(" ")[0] for entry in _undocumented(tree.body, "", None)]
    assert names == ["f", "C", "C.m", "C.N", "S", "S.helper"]
