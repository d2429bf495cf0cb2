"""The artifacts a user installs, built from a copy of the sources: a machine without a C compiler
still installs (pure-Python kernels, with a warning); unsupported platforms are refused before
anything compiles; the wheel and the sdist carry what they must. (``tools/test_dist.sh``, run by
CI, goes further: the manylinux wheel and the sdist installed in fresh venvs, their tests run.)"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import zipfile

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 300
SOURCES = ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE", "CHANGELOG.md", "csrc", "src",
           "proto", "tests", "benchmarks", "docs", "tools", "examples", "Makefile")


def _copy_sources(dest: pathlib.Path) -> pathlib.Path:
    """The checkout without build outputs (no compiled extension a build could reuse)."""
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info", "results")
    dest.mkdir(parents=True)
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, dest / name, ignore=ignore)
        else:
            shutil.copy2(path, dest / name)
    return dest


def _build(source: pathlib.Path, out: pathlib.Path, kind: str, env: dict[str, str] | None = None):
    for tool, version in (("build", None), ("setuptools", "77"), ("cffi", None), ("wheel", None)):
        pytest.importorskip(tool, minversion=version, reason=f"could not import {tool}: a build needs it here")
    # --no-isolation: the build tools of this venv (pyproject's build requirements) instead of
    # downloading them again.
    return subprocess.run([sys.executable, "-m", "build", "--no-isolation", f"--{kind}", "-o", str(out), str(source)],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def compilerless_wheel(tmp_path_factory) -> tuple[pathlib.Path, str]:
    """A wheel built where the C compiler does not exist, and the build's output."""
    root = tmp_path_factory.mktemp("nocc")
    result = _build(_copy_sources(root / "src-copy"), root / "dist", "wheel", {"CC": str(root / "no-such-cc")})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = (root / "dist").glob("*.whl")
    return wheel, result.stdout + result.stderr


def test_without_a_compiler_the_build_warns_and_leaves_out_only_the_kernels(compilerless_wheel):
    wheel, output = compilerless_wheel
    assert "the C kernels could not be built (is a C compiler installed" in output
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith(".so")]
    assert "shmtransport/_purepy.py" in names and "shmtransport/client/__init__.py" in names
    # the runtime only: the chaos harness (tools/) and the demo (examples/) stay in the sdist
    assert not {"shmtransport/chaos.py", "shmtransport/demo.py"} & set(names)


def test_without_a_compiler_the_installed_package_runs_on_pure_python_kernels(compilerless_wheel, tmp_path):
    wheel, _ = compilerless_wheel
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
    code = ("import shmtransport, numpy as np; from shmtransport._backend import kernels; "
            "print(shmtransport.BACKEND, shmtransport.__file__); "
            "print(kernels.tree_digest(memoryview(np.arange(1000, dtype=np.uint8))).hex())")
    env = {k: v for k, v in os.environ.items() if k != "SHMTRANSPORT_BACKEND"}  # auto: what a user gets
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**env, "PYTHONPATH": str(site)}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    backend, path = result.stdout.split("\n")[0].split()
    assert backend == "python" and path.startswith(str(site))
    assert "using the pure-Python kernels" in result.stderr and "C compiler" in result.stderr
    from shmtransport import _purepy
    expected = _purepy.tree_digest(memoryview(np.arange(1000, dtype=np.uint8))).hex()
    assert result.stdout.split("\n")[1] == expected


def test_the_wheel_carries_license_types_and_protos(compilerless_wheel):
    wheel, _ = compilerless_wheel
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    assert "shmtransport/py.typed" in names
    protos = {p.relative_to(REPO / "proto").as_posix() for p in (REPO / "proto").rglob("*.proto")}
    assert {f"shmtransport/proto/{p}" for p in protos} <= names
    assert "shmtransport-0.1.0.dist-info/licenses/LICENSE" in names
    metadata = archive.read("shmtransport-0.1.0.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "-abi3-" in wheel.name  # the extension uses the stable ABI: one wheel for every CPython


def test_the_sdist_carries_what_its_tests_need(tmp_path):
    result = _build(_copy_sources(tmp_path / "src-copy"), tmp_path / "dist", "sdist")
    assert result.returncode == 0, result.stderr[-3000:]
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for needed in ("tests/conftest.py", "tests/golden/identity_vectors.json",
                   "tests/fuzz_corpus/README.md", "proto/vllm/inference.proto", "csrc/shmt_kernels.c",
                   "csrc/build_native.py", "LICENSE", "CHANGELOG.md", "Makefile", "tools/venv_fixups.py",
                   "tools/chaos.py", "examples/demo.py"):
        assert needed in names, needed
    assert not [n for n in names if n.endswith((".so", ".pyc"))]


@pytest.mark.parametrize("patch, words", [
    ("sys.platform = 'darwin'", "needs Linux"),
    ("sys.platform = 'win32'", "needs Linux"),
    ("sys.byteorder = 'big'", "big-endian"),
    ("sys.implementation.name = 'pypy'", "target CPython"),
])
def test_unsupported_platforms_are_refused_before_anything_compiles(patch, words):
    code = f"import runpy, sys; {patch}; runpy.run_path('setup.py', run_name='__main__')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 1
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith("shmtransport supports Linux on little-endian CPUs")
    assert words in line
