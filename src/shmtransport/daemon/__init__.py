"""The node-local daemon that owns shared memory (see server.Daemon)."""
from .config import DaemonConfig
from .server import Daemon

__all__ = ["Daemon", "DaemonConfig"]
