"""Kernel backend selection: ``SHMTRANSPORT_BACKEND=auto|c|python``.

``kernels`` is the module that implements the kernel API (``_native`` over the cffi extension, or
``_purepy``, the reference that specifies it). ``auto`` falls back to Python only when the
extension cannot be imported, and logs that once.
"""
from __future__ import annotations

import logging
import os
from types import ModuleType

_log = logging.getLogger("shmtransport")

_CHOICES = ("auto", "c", "python")


def _select() -> tuple[str, ModuleType]:
    wanted = os.environ.get("SHMTRANSPORT_BACKEND", "auto").strip().lower() or "auto"
    if wanted not in _CHOICES:
        raise ValueError(f"SHMTRANSPORT_BACKEND must be one of {', '.join(_CHOICES)}, got {wanted!r}")
    if wanted == "python":
        from . import _purepy

        return "python", _purepy
    try:
        from . import _native
    except ImportError as exc:
        if wanted == "c":
            raise ImportError(f"SHMTRANSPORT_BACKEND=c but the C extension is not importable: {exc}") from exc
        _log.warning("shmtransport: the C kernels are not importable (%s); using the pure-Python kernels, "
                     "about 1.3x slower to hash. Reinstall with a C compiler present for the C kernels; "
                     "SHMTRANSPORT_BACKEND=python selects the pure-Python ones without this warning.", exc)
        from . import _purepy

        return "python", _purepy
    return "c", _native


BACKEND, kernels = _select()
