"""Remote tier: tensors read across nodes with NIXL (UCX), explicit inline fallback.

- ``remote_extension(...)``: daemon side (``Daemon(extensions=[remote_extension()])``).
- ``RemoteReader``: pulls ``RemoteTensorHandle``s with NIXL READs into a registered receive pool.
- ``RemoteExporter`` / ``resolve``: TensorData with shm, remote or (opt-in) inline payloads.
- ``choose_transport`` / ``COUNTERS``: shm when namespaces match, remote otherwise; every choice counted.
- ``RemoteTLS``: mutual-TLS material for both sides (with, or instead of, a shared ``secret``).

NIXL is optional (``pip install shmtransport[nixl]``); without it remote handles raise
``NixlUnavailable``. Heavy imports happen on use.
"""
from typing import TYPE_CHECKING

from ._nixl import EXTRA_HINT, NixlUnavailable, load_nixl, nixl_available
from .transport import COUNTERS, INLINE, REMOTE, SHM, TransportCounters, choose_transport, namespace_of

if TYPE_CHECKING:  # imported on first use (``__getattr__``)
    from .auth import RemoteTLS
    from .daemon_ext import remote_extension
    from .exporter import RemoteExporter, resolve
    from .reader import RemoteReader

__all__ = [
    "COUNTERS", "EXTRA_HINT", "INLINE", "REMOTE", "SHM", "NixlUnavailable", "RemoteExporter", "RemoteReader",
    "RemoteTLS", "TransportCounters", "choose_transport", "load_nixl", "namespace_of", "nixl_available",
    "remote_extension", "resolve",
]


def __getattr__(name: str) -> object:
    if name == "remote_extension":
        from .daemon_ext import remote_extension

        return remote_extension
    if name == "RemoteTLS":
        from .auth import RemoteTLS

        return RemoteTLS
    if name == "RemoteReader":
        from .reader import RemoteReader

        return RemoteReader
    if name in ("RemoteExporter", "resolve"):
        from . import exporter

        return getattr(exporter, name)
    raise AttributeError(name)
