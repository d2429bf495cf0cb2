"""Build hooks pyproject.toml cannot express; everything else lives in pyproject.toml.

- cffi's out-of-line API-mode build (``cffi_modules``) of the C kernels, and the object table's
  fast lane (``_shmt_lane``), as optional extensions: without a working C compiler (or without
  Python.h) the install still succeeds, with a warning, and the package runs on its pure-Python
  kernels (``shmtransport.BACKEND == "python"``). pip shows that warning only with ``-v``, so a
  build that must have them sets ``SHMTRANSPORT_REQUIRE_NATIVE=1``: then it fails instead.
- The .proto files ship in the wheel under ``shmtransport/proto/``, import paths intact.
- The extensions use only the stable ABI, so the wheel is tagged abi3 (one wheel for 3.10+).
- Platforms the transport cannot work on are refused here, before anything is compiled.
"""
import os
import pathlib
import re
import sys

SUPPORTED = "Linux on little-endian CPUs (x86_64, aarch64), CPython 3.10 or later"


def _refuse_unsupported_platform() -> None:
    why = None
    if not sys.platform.startswith("linux"):
        why = (f"this is {sys.platform}; the daemon needs Linux: POSIX shared memory in /dev/shm, "
               "SCM_RIGHTS fd passing and SO_PEERCRED")
    elif sys.byteorder != "little":
        why = "this CPU is big-endian; the object table's layout and the digests are little-endian"
    elif sys.implementation.name != "cpython":
        why = f"this is {sys.implementation.name}; the C kernels and the tests target CPython"
    if why:
        sys.exit(f"shmtransport supports {SUPPORTED}: {why}.")


_refuse_unsupported_platform()  # before setuptools or cffi get a chance to fail less clearly

from setuptools import Extension, setup  # noqa: E402
from setuptools.command.build_ext import build_ext  # noqa: E402
from setuptools.command.build_py import build_py  # noqa: E402


class OptionalKernels(build_ext):
    """Build the C kernels if this machine can; otherwise warn and leave the pure-Python ones
    (under ``SHMTRANSPORT_REQUIRE_NATIVE=1``, fail)."""

    def build_extensions(self):
        required = os.environ.get("SHMTRANSPORT_REQUIRE_NATIVE") == "1"
        for ext in self.extensions:
            ext.optional = not required  # optional: setuptools reports a failed build as a warning, not an error
        super().build_extensions()
        if not all(os.path.exists(self.get_ext_fullpath(ext.name)) for ext in self.extensions):
            self.warn(
                "shmtransport: the C kernels could not be built (is a C compiler installed, and Python.h?). "
                "Installing with the pure-Python kernels, about 1.5x slower to hash; "
                "shmtransport.BACKEND says which kernels run (SHMTRANSPORT_REQUIRE_NATIVE=1 makes this an "
                "error).")


class WithProtos(build_py):
    """Copy proto/**/*.proto into the built package, so ``protoc -I <package>/proto`` works."""

    def run(self):
        super().run()
        for source in sorted(pathlib.Path("proto").rglob("*.proto")):
            target = pathlib.Path(self.build_lib, "shmtransport", source)
            self.mkpath(str(target.parent))
            self.copy_file(str(source), str(target))


def _package_version() -> str:
    match = re.search(r'^version = "([^"]+)"', pathlib.Path("pyproject.toml").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError("no version in pyproject.toml")
    return match.group(1)


# The client's fast lane into the object table (csrc/shmt_lane_py.c): a small CPython-API module,
# since each step of a handoff must build its Python results in C (a cffi call's unpacking costs
# more than the step). It compiles the kernels it needs into itself.
LANE = Extension(
    "shmtransport._shmt_lane",
    sources=["csrc/shmt_lane_py.c"],
    include_dirs=["csrc"],
    depends=["csrc/shmt_kernels.c", "csrc/shmt_kernels.h"],
    define_macros=[("SHMT_PACKAGE_VERSION", f'"{_package_version()}"')],
    extra_compile_args=["-O3", "-std=c11", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"],
    py_limited_api=True,
)

setup(
    ext_modules=[LANE],
    cffi_modules=["csrc/build_native.py:ffibuilder"],
    cmdclass={"build_ext": OptionalKernels, "build_py": WithProtos},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
