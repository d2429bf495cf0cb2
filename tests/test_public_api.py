"""The package's public surface: what ``import shmtransport`` exports, documented and typed.

Every exported class's public methods and properties have a docstring, and every option (a
parameter with a default) is keyword-only, except the few whose position is their meaning.
"""
from __future__ import annotations

import builtins
import inspect
import pathlib
import subprocess
import sys

import pytest

import shmtransport

# Parameters with a default that may stay positional: the one thing the call is about.
POSITIONAL_OPTIONS = {
    ("Producer", "__init__", "socket_path"),
    ("Consumer", "__init__", "socket_path"),
    ("AsyncProducer", "__init__", "socket_path"),
    ("AsyncConsumer", "__init__", "socket_path"),
    ("Producer", "loan", "nbytes"),
    ("GeneratorClient", "__init__", "producer"),
    ("AsyncGeneratorClient", "__init__", "producer"),
    ("GeneratorClient", "generate_stream", "items"),
    ("AsyncGeneratorClient", "generate_stream", "items"),
    ("GeneratorClient", "generate", "items"),
    ("AsyncGeneratorClient", "generate", "items"),
    ("AsyncProducer", "loan", "nbytes"),
}
# Plain records: their fields are their constructor's parameters, in order.
RECORDS = ("TokenChunk", "Completion", "FeatureItem", "FieldConfig", "PlaceholderRange")
CLASSES = ("Producer", "Consumer", "Handle", "Loan", "Lease", "AsyncProducer", "AsyncConsumer", "GeneratorClient",
           "AsyncGeneratorClient", "TokenStream", "AsyncTokenStream", "TokenChunk", "Completion", "FeatureItem",
           "FieldConfig", "PlaceholderRange")


def _public_members(cls):
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(inspect.getattr_static(cls, name), (property, classmethod, staticmethod)) or callable(member):
            if name == "__init__" and member is object.__init__:
                continue
            yield name, inspect.getattr_static(cls, name)


def test_every_exported_name_resolves():
    for name in shmtransport.__all__:
        assert getattr(shmtransport, name) is not None, name
    assert set(shmtransport.__all__) <= set(dir(shmtransport))
    # dir() shows what a user may use: no helper this module imports (Any, importlib, ...)
    assert {name for name in dir(shmtransport) if not name.startswith("__")} == set(shmtransport.__all__) - {
        "__version__"}


def test_importing_the_package_loads_no_grpc_and_no_kernels():
    code = ("import sys, shmtransport; "
            "print(sorted(m for m in ('grpc', 'numpy', 'shmtransport._backend', 'shmtransport.client') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_errors_are_one_tree():
    for name in shmtransport.__all__:
        value = getattr(shmtransport, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, shmtransport.ShmTransportError), name


@pytest.mark.parametrize("class_name", CLASSES)
def test_public_calls_have_docstrings(class_name):
    cls = getattr(shmtransport, class_name)
    assert cls.__doc__, class_name
    missing = []
    for name, member in _public_members(cls):
        func = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
        if not (getattr(func, "__doc__", None) or "").strip() and name not in ("__init__",):
            missing.append(name)
    assert not missing, f"{class_name}: no docstring on {missing}"


@pytest.mark.parametrize("class_name", CLASSES)
def test_options_are_keyword_only_and_shadow_no_builtin(class_name):
    cls = getattr(shmtransport, class_name)
    bad, shadowing = [], []
    for name, member in _public_members(cls):
        func = getattr(member, "__func__", member)
        if isinstance(member, property) or not callable(func):
            continue
        for param in inspect.signature(func).parameters.values():
            if param.name in vars(builtins):
                shadowing.append(f"{name}({param.name})")
            if class_name in ("Loan", "Lease", "TokenStream", "AsyncTokenStream") and name == "__init__":
                continue  # made by the client, never by callers
            if class_name in RECORDS and name == "__init__":
                continue
            if (param.default is not inspect.Parameter.empty and param.kind is param.POSITIONAL_OR_KEYWORD
                    and (class_name, name, param.name) not in POSITIONAL_OPTIONS):
                bad.append(f"{name}({param.name})")
    assert not bad, f"{class_name}: options that should be keyword-only: {bad}"
    assert not shadowing, f"{class_name}: parameters shadowing builtins: {shadowing}"


def test_the_wheel_marks_itself_typed():
    assert (pathlib.Path(shmtransport.__file__).parent / "py.typed").is_file()
