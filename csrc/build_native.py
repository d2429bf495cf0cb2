"""cffi builder (API mode, out-of-line) for ``shmtransport._shmt_c``.

Used by setup.py (``cffi_modules=["csrc/build_native.py:ffibuilder"]``) or run directly
(``python csrc/build_native.py`` compiles next to the sources in ``src/shmtransport``).

XXH3 is linked from an installed library; no xxHash source lives in this repository. The
choice, overridable with ``SHMT_XXH=auto|system|pypkg|none``:

``pypkg``   the XXH symbols exported by the ``xxhash`` PyPI package's extension module (a runtime
            dependency anyway, and the very code the reference uses). They are left undefined at
            link time (``-z now`` makes a missing one fail at import, never mid-call) and
            ``_native`` loads that extension with ``RTLD_GLOBAL`` before importing ``_shmt_c``.
            Needs nothing at build time, so it also works in isolated builds.
``system``  the system ``libxxhash.so.0`` (Debian/Ubuntu package libxxhash0), linked by full path
            (no dev package needed), recorded as ``DT_NEEDED libxxhash.so.0``.
``none``    ``SHMT_HAVE_XXH3=0``: the mask kernels and the copy build; ``_native`` hashes with
            the ``xxhash`` package instead.

``auto``: ``pypkg`` when the ``xxhash`` package is importable in the build environment and its
extension exports the symbols we need (measured here: its runtime-dispatched XXH3 is ~15% faster
than Debian's libxxhash 0.8.1, and it is what ``xxhash.xxh3_128`` runs); else ``system`` when
``libxxhash.so.0`` is found; else ``pypkg`` unchecked (resolved at import time).
In every mode the runtime-dispatching entry points (``XXH3_128bits_dispatch``, AVX2/AVX-512) are
declared weak in C and used when the library exports them.
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import pathlib
import re

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent

_NEEDED = ("XXH3_128bits", "XXH3_128bits_reset", "XXH3_128bits_update", "XXH3_128bits_digest",
           "XXH128_canonicalFromHash", "XXH3_createState", "XXH3_freeState")


def _exports(path: str, names: tuple[str, ...]) -> bool:
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return False
    return all(hasattr(lib, name) for name in names)


def _system_libxxhash() -> str | None:
    patterns = ("/usr/lib/*/libxxhash.so.0", "/lib/*/libxxhash.so.0", "/usr/lib64/libxxhash.so.0",
                "/usr/lib/libxxhash.so.0", "/usr/local/lib/libxxhash.so.0")
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            if _exports(path, _NEEDED):
                return os.path.realpath(path)
    return None


def _pypkg_xxhash() -> str | None:
    try:
        spec = importlib.util.find_spec("xxhash._xxhash")
    except (ImportError, ValueError):
        return None
    return spec.origin if spec and spec.origin else None


def _link_choice() -> tuple[str, str | None]:
    """(mode, library path or None)."""
    wanted = os.environ.get("SHMT_XXH", "auto").strip().lower() or "auto"
    if wanted not in ("auto", "system", "pypkg", "none"):
        raise ValueError(f"SHMT_XXH must be auto, system, pypkg or none, got {wanted!r}")
    if wanted == "none":
        return "none", None
    pypkg = _pypkg_xxhash()
    if wanted == "pypkg" or (wanted == "auto" and pypkg and _exports(pypkg, _NEEDED)):
        return "pypkg", pypkg
    system = _system_libxxhash()
    if system:
        return "system", system
    if wanted == "system":
        raise RuntimeError("SHMT_XXH=system but no usable libxxhash.so.0 was found")
    return "pypkg", pypkg


MODE, LIBPATH = _link_choice()
HAVE_XXH3 = MODE != "none"

def _cdef_from_header(path: pathlib.Path) -> str:
    """The header's declarations in cffi's cdef dialect: its SHMT_ constants become ``...``
    (cffi reads their values from the compiled module), other preprocessor lines are dropped."""
    lines = []
    for line in path.read_text().splitlines():
        words = line.split()
        if words[:1] == ["#define"] and words[1].startswith("SHMT_") and len(words) > 2:
            if words[1] != "SHMT_HAVE_XXH3":
                lines.append(f"#define {words[1]} ...")
        elif not line.lstrip().startswith("#"):
            lines.append(line)
    return "\n".join(lines) + "\nint32_t shmt_xxh_link_mode(void);\nconst char *shmt_package_version(void);\n"


_CDEF = _cdef_from_header(HERE / "shmt_kernels.h")
# The streaming state is allocated by the Python wrapper, never inside a kernel.
_CDEF_STATE = """
struct XXH3_state_s *XXH3_createState(void);
int XXH3_freeState(struct XXH3_state_s *state);
"""

def _package_version() -> str:
    """The project version (pyproject.toml), baked into the extension: ``_native`` refuses an
    extension built for another version (a stale build left next to newer sources)."""
    match = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError("no version in pyproject.toml")
    return match.group(1)


_LINK_MODES = {"none": 0, "system": 1, "pypkg": 2}
_PREAMBLE = f"""
#include "shmt_kernels.h"
/* how XXH3 was linked: 0 none, 1 system libxxhash, 2 the xxhash package's extension */
static int32_t shmt_xxh_link_mode(void) {{ return {_LINK_MODES[MODE]}; }}
static const char *shmt_package_version(void) {{ return "{_package_version()}"; }}
"""
if HAVE_XXH3:
    _PREAMBLE += """
extern struct XXH3_state_s *XXH3_createState(void);
extern int XXH3_freeState(struct XXH3_state_s *state);
"""

ffibuilder = FFI()
ffibuilder.cdef(_CDEF + (_CDEF_STATE if HAVE_XXH3 else ""))

_link_args: list[str] = []
if MODE == "system":
    _link_args = [LIBPATH]  # by full path: no dev symlink (libxxhash.so) is needed
elif MODE == "pypkg":
    _link_args = ["-Wl,-z,now"]  # unresolved XXH symbols fail at import time, never mid-call

ffibuilder.set_source(
    "shmtransport._shmt_c",
    _PREAMBLE,
    # relative for setuptools (run from the project root); absolute when run as a script, because
    # ffibuilder.compile() builds inside its tmpdir
    sources=[str(HERE / "shmt_kernels.c") if __name__ == "__main__" else "csrc/shmt_kernels.c"],
    include_dirs=[str(HERE) if __name__ == "__main__" else "csrc"],
    depends=[str(HERE / "shmt_kernels.h") if __name__ == "__main__" else "csrc/shmt_kernels.h"],
    define_macros=[("SHMT_HAVE_XXH3", "1" if HAVE_XXH3 else "0")],
    # No -fno-strict-aliasing: the kernels read bytes through memcpy, the intrinsics' own vector
    # types and the slot struct's atomics, never through a pointer of another type.
    extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra"],
    extra_link_args=_link_args,
)

if __name__ == "__main__":
    os.chdir(ROOT)
    print(f"shmt: XXH3 link mode {MODE} ({LIBPATH})")
    ffibuilder.compile(tmpdir=str(ROOT / "build" / "cffi"), target=None, verbose=True)
    # compile() writes shmtransport/_shmt_c*.so under tmpdir; move it into the source package
    built = sorted((ROOT / "build" / "cffi" / "shmtransport").glob("_shmt_c*.so"))
    for so in built:
        so.replace(ROOT / "src" / "shmtransport" / so.name)
        print(f"shmt: installed {ROOT / 'src' / 'shmtransport' / so.name}")
