"""The import graph follows the layers (``tools/layers.py``): a new import across a wall fails here,
and so does a listed crossing that was fixed (the list only shrinks)."""
from __future__ import annotations

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import layers  # noqa: E402


def test_no_import_crosses_a_wall_except_the_listed_ones():
    found = layers.crossings(layers.graph())
    assert found - layers.KNOWN == set(), "new imports across a layer wall (see tools/layers.py)"
    assert layers.KNOWN - found == set(), "fixed: remove these from layers.KNOWN"


def test_the_daemon_and_the_client_never_import_each_other():
    edges = layers.graph()
    for module, targets in edges.items():
        if layers.layer_of(module) == "daemon":
            assert not {t for t in targets if layers.layer_of(t) != "base" and layers.layer_of(t) != "daemon"}, module
        if layers.layer_of(module) == "client":
            assert not {t for t in targets if layers.layer_of(t) == "daemon"}, module


def test_no_modules_import_each_other():
    assert layers.cycles(layers.graph()) == []


def test_a_planted_import_circle_is_found_even_under_type_checking(tmp_path):
    root = _tree(tmp_path / "shmtransport", {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n",
        "c.py": "from .a import x\n",
        "d.py": "from . import a\n",
    })
    assert layers.cycles(layers.graph(root)) == [["a", "b", "c"]]


def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_planted_violation_is_found_whether_absolute_relative_or_inside_a_function(tmp_path):
    root = _tree(tmp_path / "shmtransport", {
        "__init__.py": "",
        "errors.py": "",
        "client.py": "from . import errors\n",
        "daemon/__init__.py": "",
        "daemon/server.py": "from ..errors import x\n\ndef f():\n    from ..client import Producer\n",
        "daemon/registry.py": "import shmtransport.client\n",
        "wire.py": "from .daemon import server\n",
    })
    found = layers.crossings(layers.graph(root))
    assert found == {("daemon.server", "client"), ("daemon.registry", "client"), ("wire", "daemon.server")}
