"""Daemon settings and their defaults (socket path, arena size, quotas, TTLs)."""
from __future__ import annotations

import dataclasses
import logging
import os

from ..wire import default_socket_path
from .segments import memory_advice, memory_available_nbytes

_log = logging.getLogger("shmtransport.daemon")

PAGE = 4096
MIN_RECOMMENDED_ARENA = 1 << 30
MAX_DEFAULT_ARENA = 8 << 30


def default_arena_nbytes() -> int:
    """Half of the memory available to the daemon (the arena is its own memory, not /dev/shm's),
    at most 8 GiB, whole pages; warns when that is small."""
    free = memory_available_nbytes()
    nbytes = min(free // 2, MAX_DEFAULT_ARENA) // PAGE * PAGE
    if nbytes < MIN_RECOMMENDED_ARENA:
        _log.warning(
            "only %d MiB of memory is available, so the arena gets %d MiB; for a %d MiB arena: %s",
            free >> 20,
            nbytes >> 20,
            MIN_RECOMMENDED_ARENA >> 20,
            memory_advice(MIN_RECOMMENDED_ARENA),
        )
    return max(nbytes, PAGE)


@dataclasses.dataclass
class DaemonConfig:
    """Everything a ``Daemon`` is started with; ``None`` fields take a default computed at start."""

    socket_path: str = dataclasses.field(default_factory=default_socket_path)
    arena_nbytes: int | None = None  # None: default_arena_nbytes()
    name_prefix: str = "shmt"
    # Tenants: each allowed uid is one tenant, each allowed group one more (its members share it).
    # Every tenant gets its own arena, quotas and wait slots; the first uid is the default tenant.
    allowed_uids: tuple[int, ...] = dataclasses.field(default_factory=lambda: (os.getuid(),))
    allowed_groups: tuple[str, ...] = ()
    socket_group: str | None = None  # when set: sockets 0660 owned by this group (see socket_mode)
    quota_nbytes: int | None = None  # per tenant, arena and dedicated bytes; None: the arena size
    quota_leases: int = 100_000  # per tenant
    max_sessions_per_tenant: int = 256
    max_hold_ms: int = 60_000
    # /dev/shm bytes the daemon never takes for dedicated segments (left to the rest of the node);
    # None: 5 % of /dev/shm, at least 64 MiB.
    shm_reserve_nbytes: int | None = None
    default_lease_ttl_ms: int = 300_000
    max_lease_ttl_ms: int = 3_600_000
    default_hold_ms: int = 0
    # The shm namespace id the daemon advertises; None: "<boot_id>:<st_dev of /dev/shm>". Set it
    # when that is not distinctive (or to simulate two nodes on one machine in tests).
    shm_namespace: str | None = None
    commit_wait_s: float = 2.0  # how long Acquire waits for a commit still in flight
    max_alloc_wait_ms: int = 10_000  # cap on a Loan's back-pressure wait for free space
    page_align_min_nbytes: int = 64 * 1024
    # Slots of each tenant's object table, where every object's lifetime lives: at most that many
    # objects live at once. None: one per 4 KiB of arena, 1,024 to 65,536.
    object_slots: int | None = None
    # Hand the table to clients with the C kernels, which then loan, commit, acquire and release
    # in shared memory without the daemon; False: every object goes through the daemon.
    share_object_table: bool = True
    # A committed object nobody has acquired yet survives its producer (close, exit) this long.
    handoff_window_ms: int = 30_000
    metrics_port: int | None = None  # shorthand for metrics_address "127.0.0.1:PORT"
    metrics_address: str | None = None  # "HOST:PORT" or "unix:/path"
    # Threads serving RPCs. Acquire (waiting for a commit in flight) and Loan (waiting for space)
    # park a thread for a bounded time; a large pool keeps such waits from delaying other clients.
    grpc_workers: int = 64
    stop_grace_s: float = 5.0

    @property
    def session_socket_path(self) -> str:
        """Path of the session-handshake socket, next to the gRPC one."""
        return self.socket_path + ".session"

    @property
    def socket_mode(self) -> int:
        """0660 with a socket group (the operator's restriction wins); 0666 when other uids may
        connect (the handshake's SO_PEERCRED allowlist is then the gate); else 0600."""
        if self.socket_group:
            return 0o660
        euid = os.geteuid()
        if self.allowed_groups or any(uid != euid for uid in self.allowed_uids):
            return 0o666
        return 0o600

    def resolved_object_slots(self, arena_nbytes: int) -> int:
        """Slots of a tenant's object table for an arena of ``arena_nbytes``: a multiple of 64."""
        if self.object_slots is None:
            return min(65536, max(1024, arena_nbytes // PAGE // 64 * 64))
        if self.object_slots < 1:
            raise ValueError(f"object_slots must be >= 1 (every object lives in the table), got {self.object_slots}")
        return (self.object_slots + 63) // 64 * 64

    def resolved_arena_nbytes(self, tenants: int = 1) -> int:
        """Each tenant's arena: ``arena_nbytes``, or the default split between the tenants."""
        if self.arena_nbytes is None:
            return max(PAGE, default_arena_nbytes() // tenants // PAGE * PAGE)
        if self.arena_nbytes < PAGE:
            raise ValueError(f"arena_nbytes must be >= {PAGE}, got {self.arena_nbytes}")
        return (self.arena_nbytes + PAGE - 1) // PAGE * PAGE
