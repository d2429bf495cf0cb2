"""One fresh ``/dev/shm`` file per object: the naming and opening shared by the segment peers
(SMG's ``segment_pread`` and Dynamo's ``dynamo_segment``)."""
from __future__ import annotations

import itertools
import os
import secrets

SHM_DIR = "/dev/shm"


class FreshSegments:
    """Unique names under one prefix; ``create`` opens the next one ``O_EXCL``, mode 0600."""

    def __init__(self, prefix: str):
        self._tag = f"{prefix}{os.getpid()}_{secrets.token_hex(6)}_"
        self._seq = itertools.count()

    def create(self) -> tuple[str, str, int]:
        """(name, path, writable fd) of a new, empty file."""
        name = f"{self._tag}{next(self._seq)}"
        path = os.path.join(SHM_DIR, name)
        return name, path, os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)


def open_segment(name: str, prefix: str) -> tuple[str, int]:
    """The reader's side: (path, read-only fd); a name outside ``prefix`` (or a path) is refused."""
    if "/" in name or not name.startswith(prefix):
        raise ValueError(f"refusing segment name {name!r}")
    path = os.path.join(SHM_DIR, name)
    return path, os.open(path, os.O_RDONLY)
