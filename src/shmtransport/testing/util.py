"""Small helpers the other ``testing`` modules share: polling with a deadline, short temporary
directories, this run's segment-name prefix, sizes like ``"64M"``, the /dev/shm entries of a prefix."""
from __future__ import annotations

import argparse
import itertools
import os
import re
import secrets
import shutil
import tempfile
import time
from typing import Any, Callable

from ..shm_names import SHM_DIR

# Every daemon this process starts through ``unique_prefix`` has a name prefix starting with
# RUN_PREFIX, so a leak check can tell this run's segments from those of anyone else sharing
# /dev/shm (even another run of the same suite). "shmtpy" + 6 hex here, + 2 (or more) hex per daemon.
RUN_PREFIX = "shmtpy" + secrets.token_hex(3)
_prefix_counter = itertools.count()


def unique_prefix() -> str:
    """A fresh segment-name prefix for one daemon ([A-Za-z0-9_.], short, unique in this process)."""
    return f"{RUN_PREFIX}{next(_prefix_counter):02x}"


_NBYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_nbytes(text: str | int) -> int:
    """``"64M"``, ``"1G"``, ``"512k"``, ``"64MiB"``, ``"4096"`` → bytes (binary units)."""
    if isinstance(text, int):
        nbytes = text
    else:
        m = _NBYTES_RE.match(str(text))
        if not m:
            raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes or a K/M/G/T suffix, e.g. 64M)")
        nbytes = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if nbytes <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return nbytes


# -- polling -------------------------------------------------------------------------------------
def wait_until(predicate: Callable[[], Any], timeout_s: float = 5.0, interval_s: float = 0.01, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something truthy; that value, or TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"condition not met within {timeout_s} s: {what or predicate!r} (last {value!r})")
        time.sleep(interval_s)


def short_tmpdir(prefix: str = "shmtt") -> str:
    """A fresh directory under /tmp (pytest's tmp_path can exceed the 108-byte AF_UNIX limit)."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def remove_tree(path: str) -> None:
    """Remove ``path`` and everything under it; errors (a missing path) are ignored."""
    shutil.rmtree(path, ignore_errors=True)


# -- /dev/shm ------------------------------------------------------------------------------------
def shm_entries() -> set[str]:
    """The names in ``/dev/shm`` now."""
    return set(os.listdir(SHM_DIR))


def segments_of(prefix: str) -> list[str]:
    """/dev/shm entries of the daemon(s) with this exact name prefix (``PREFIX-...``)."""
    return sorted(name for name in shm_entries() if name.startswith(prefix + "-"))


def indent(text: str, by: str = "    ") -> str:
    """``text`` with every line prefixed by ``by``."""
    return "\n".join(by + line for line in text.splitlines())
