"""Importing NIXL (optional: ``pip install shmtransport[nixl]``), and the typed error without it."""
from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

from ..errors import Reason, Unavailable

EXTRA_HINT = "pip install shmtransport[nixl]"
# The wheel nixl-cu12 installs the module ``nixl_cu12``; the meta package ``nixl`` installs ``nixl``.
_MODULES = ("nixl_cu12", "nixl._api", "nixl")


class NixlUnavailable(Unavailable):
    """The remote (NIXL) transport cannot be used in this process: the package is missing (or its
    UCX backend failed). Never silently replaced by inline bytes (see ``allow_inline``)."""

    def __init__(self, message: str = "", reason: Reason | None = None):
        super().__init__(message or f"remote tensor handles need NIXL, which is not installed: {EXTRA_HINT}", reason)


_cached: ModuleType | None = None
_import_error: str | None = None


def load_nixl() -> ModuleType:
    """The NIXL module (exposing ``nixl_agent`` / ``nixl_agent_config``), or NixlUnavailable."""
    global _cached, _import_error
    if os.environ.get("SHMTRANSPORT_DISABLE_NIXL") == "1":  # tests and operators: force the fallback
        raise NixlUnavailable(f"NIXL disabled by SHMTRANSPORT_DISABLE_NIXL=1 (to use it: unset it; {EXTRA_HINT})")
    if _cached is not None:
        return _cached
    errors = []
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if hasattr(module, "nixl_agent"):
            _cached = module
            return module
    _import_error = "; ".join(errors)
    raise NixlUnavailable(f"remote tensor handles need NIXL, which cannot be imported ({_import_error}): {EXTRA_HINT}")


def nixl_available() -> bool:
    """Whether the NIXL package can be loaded in this process."""
    try:
        load_nixl()
    except NixlUnavailable:
        return False
    return True


def new_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend and its progress thread; NixlUnavailable when UCX is missing."""
    nixl = load_nixl()
    try:
        agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    except Exception as exc:
        raise NixlUnavailable(f"cannot create a NIXL agent with the UCX backend: {exc}") from exc
    if "UCX" not in agent.backends:
        raise NixlUnavailable(f"NIXL has no UCX backend plugin here (plugins: {agent.plugin_list})")
    return agent
