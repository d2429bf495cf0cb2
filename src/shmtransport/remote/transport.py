"""Choosing a transport per tensor, and counting every choice (never a silent fallback).

``shm`` when the producer's daemon and the consumer's daemon share ``/dev/shm`` (equal namespace
ids ``<boot_id>:<st_dev of /dev/shm>``, see ``SessionHello.shm_namespace``), ``remote``
(NIXL) otherwise, ``inline`` bytes only when the caller allowed them and NIXL is not available.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable

from ._nixl import EXTRA_HINT, NixlUnavailable, nixl_available

if TYPE_CHECKING:
    from ..client import Consumer, Producer

_log = logging.getLogger("shmtransport.remote")

SHM, REMOTE, INLINE = "shm", "remote", "inline"


class TransportCounters:
    """Thread-safe counts of transport choices; ``hooks`` get ``(transport, nbytes)`` per choice
    (e.g. a Prometheus counter's ``labels(t).inc``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = {SHM: 0, REMOTE: 0, INLINE: 0}
        self.nbytes = {SHM: 0, REMOTE: 0, INLINE: 0}
        self.hooks: list[Callable[[str, int], None]] = []

    def count(self, transport: str, nbytes: int = 0) -> None:
        """Count one choice of ``transport`` moving ``nbytes``, then call the hooks (their errors are logged)."""
        with self._lock:
            self.counts[transport] += 1
            self.nbytes[transport] += nbytes
        for hook in list(self.hooks):
            try:
                hook(transport, nbytes)
            except Exception:
                _log.exception("transport metrics hook failed")

    def snapshot(self) -> dict[str, int]:
        """A copy of the counts by transport."""
        with self._lock:
            return dict(self.counts)

    def reset(self) -> None:
        """Set every count and byte total to zero."""
        with self._lock:
            for key in self.counts:
                self.counts[key] = 0
                self.nbytes[key] = 0

    def __repr__(self) -> str:
        return f"TransportCounters({self.snapshot()})"


COUNTERS = TransportCounters()


def namespace_of(client: Producer | Consumer) -> str:
    """The shm namespace id a Producer/Consumer's daemon advertised in its handshake."""
    return client.shm_namespace


def choose_transport(producer_namespace: str, consumer_namespace: str, *, allow_inline: bool = False,
                     nbytes: int = 0, counters: TransportCounters | None = None) -> str:
    """``shm`` when both namespaces are equal (and known), else ``remote``; ``inline`` only when
    NIXL is unavailable and ``allow_inline``; otherwise NixlUnavailable naming the extra."""
    counters = counters or COUNTERS
    if producer_namespace and producer_namespace == consumer_namespace:
        choice = SHM
    elif nixl_available():
        choice = REMOTE
    elif allow_inline:
        _log.warning("NIXL unavailable (%s): sending %d bytes inline, as the caller allowed", EXTRA_HINT, nbytes)
        choice = INLINE
    else:
        raise NixlUnavailable(
            f"producer and consumer do not share /dev/shm ({producer_namespace!r} vs {consumer_namespace!r}) "
            f"and NIXL is not installed: {EXTRA_HINT} (or pass allow_inline=True to send bytes inline)"
        )
    counters.count(choice, nbytes)
    return choice
