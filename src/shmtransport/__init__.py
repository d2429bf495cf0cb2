"""shmtransport: move decoded multimodal tensors between processes through daemon-owned shared memory."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["BACKEND", "__version__"]


def __getattr__(name: str):
    # The kernel backend is chosen on first use, so importing the package (e.g. the pytest plugin)
    # costs nothing and cannot fail on a bad SHMTRANSPORT_BACKEND.
    if name == "BACKEND":
        from ._backend import BACKEND

        return BACKEND
    raise AttributeError(f"module 'shmtransport' has no attribute {name!r}")
