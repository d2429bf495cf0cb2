"""Daemon settings and their defaults (socket path, arena size, quotas, TTLs)."""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping

from ..errors import InvalidArgument, InvalidType
from ..shm_names import validate_prefix
from ..wire import default_socket_path
from .segments import memory_advice, memory_available_nbytes

_log = logging.getLogger("shmtransport.daemon")

PAGE = 4096
MIN_RECOMMENDED_ARENA = 1 << 30
MAX_DEFAULT_ARENA = 8 << 30
SLOT_BLOCK = 64  # the object table is handed out in blocks of this many slots
_UINT32_MAX, _UINT64_MAX = (1 << 32) - 1, (1 << 64) - 1
_SUN_PATH_MAX = 107  # bytes of a Unix socket path, its NUL apart
# Each whole-number field's least and most value (None: no most), and why the least where it is not
# plain. The most is the protocol field it travels in (past it every handshake, or Stat, fails).
_RANGES: dict[str, tuple[int, int | None, str]] = {
    "arena_nbytes": (PAGE, _UINT64_MAX, " (one page)"),
    "quota_nbytes": (1, _UINT64_MAX, " (unset: the arena size)"),
    "quota_leases": (1, _UINT64_MAX, " (0 would refuse every Acquire)"),
    "max_sessions_per_tenant": (1, None, ""),
    "max_hold_ms": (0, _UINT32_MAX, " (0: no holds)"),
    "shm_reserve_nbytes": (0, _UINT64_MAX, ""),
    "max_lease_ttl_ms": (1, _UINT32_MAX, ""),
    "default_lease_ttl_ms": (1, _UINT32_MAX, ""),
    "default_hold_ms": (0, _UINT32_MAX, ""),
    "max_alloc_wait_ms": (0, _UINT32_MAX, ""),
    "page_align_min_nbytes": (0, None, ""),
    # a handle names its slot as index + 1 in a uint32
    "object_slots": (1, _UINT32_MAX // SLOT_BLOCK * SLOT_BLOCK,
                     " (rounded up to whole 64-slot blocks)"),
    "handoff_window_ms": (1, _UINT32_MAX, ""),
    "cache_nbytes": (0, _UINT64_MAX, ""),
    "metrics_port": (1, 65535, ""),
    "grpc_workers": (1, None, ""),
}
# DaemonConfig field -> the ``shmtransport daemon`` flag that sets it (the CLI's messages name the flag).
DAEMON_FLAGS = {
    "arena_nbytes": "--arena-size", "name_prefix": "--name-prefix", "allowed_uids": "--allow-uid",
    "allowed_groups": "--allow-group", "socket_group": "--group", "quota_nbytes": "--quota-bytes",
    "quota_leases": "--quota-leases", "max_sessions_per_tenant": "--max-sessions", "max_hold_ms": "--max-hold-ms",
    "object_slots": "--object-slots", "share_object_table": "--no-shared-table",
    "handoff_window_ms": "--handoff-window-ms", "cache_nbytes": "--cache-size", "shm_reserve_nbytes": "--shm-reserve",
    "default_lease_ttl_ms": "--lease-ttl-ms", "metrics_port": "--metrics-port", "metrics_address": "--metrics-address",
}
# A default that must be within a maximum, or every request relying on it is refused.
_DEFAULT_WITHIN = {"default_lease_ttl_ms": "max_lease_ttl_ms", "default_hold_ms": "max_hold_ms"}


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
    # Bytes of each tenant's objects the identity index (encoder cache) may keep alive with nobody
    # else holding them; past it the least recently used unheld ones are evicted. None: half the
    # tenant's byte quota.
    cache_nbytes: int | None = None
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
        """Slots of a tenant's object table for an arena of ``arena_nbytes``: a multiple of 64 (a
        grant asking for more than the table has gets them all)."""
        if self.object_slots is None:
            return min(65536, max(1024, arena_nbytes // PAGE // SLOT_BLOCK * SLOT_BLOCK))
        return -(-self.object_slots // SLOT_BLOCK) * SLOT_BLOCK

    def resolved_arena_nbytes(self, tenants: int = 1) -> int:
        """Each tenant's arena: ``arena_nbytes`` (whole pages), or the default split between the tenants."""
        if self.arena_nbytes is None:
            return max(PAGE, default_arena_nbytes() // tenants // PAGE * PAGE)
        return (self.arena_nbytes + PAGE - 1) // PAGE * PAGE

    def validate(self, names: Mapping[str, str] | None = None) -> None:
        """Refuse, before anything is created, a value the daemon would start with and then fail on
        (every handshake, put or Stat): InvalidArgument (a ValueError), one line naming the field
        and its range. ``names``: what the message calls a field (the CLI: its flag), else its name."""
        called = names or {}

        def name(field: str) -> str:
            return called.get(field, field)

        def refuse(field: str, rule: str, value: object, error: type[InvalidArgument] = InvalidArgument
                   ) -> InvalidArgument:
            return error(f"{name(field)} {rule}, got {value!r}", field=field)

        for field, (least, most, why) in _RANGES.items():
            value = getattr(self, field)
            if value is None and field in _OPTIONAL:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise refuse(field, "must be a whole number", value, InvalidType)
            if value < least:
                raise refuse(field, f"must be >= {least}{why}", value)
            if most is not None and value > most:
                raise refuse(field, f"must be <= {most}", value)
        for field, maximum in _DEFAULT_WITHIN.items():
            if getattr(self, field) > getattr(self, maximum):
                raise refuse(field, f"must be <= {name(maximum)} ({getattr(self, maximum)})", getattr(self, field))
        for field in ("commit_wait_s", "stop_grace_s"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise refuse(field, "must be a number of seconds", value, InvalidType)
            if not (math.isfinite(value) and value >= 0):
                raise refuse(field, "must be finite and >= 0", value)
        if not isinstance(self.share_object_table, bool):
            raise refuse("share_object_table", "must be True or False", self.share_object_table, InvalidType)
        try:
            validate_prefix(self.name_prefix)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"{name('name_prefix')}: {exc}", field="name_prefix") from None
        for uid in self.allowed_uids:
            if isinstance(uid, bool) or not isinstance(uid, int) or not 0 <= uid < _UINT32_MAX:
                raise refuse("allowed_uids", f"must hold uids 0..{_UINT32_MAX - 1}", uid)
        if not self.allowed_uids and not self.allowed_groups:
            raise InvalidArgument(f"no tenant: {name('allowed_uids')} and {name('allowed_groups')} are both empty",
                                  field="allowed_uids")
        if self.metrics_address is not None:
            if self.metrics_port is not None:
                raise InvalidArgument(f"set {name('metrics_port')} or {name('metrics_address')}, not both",
                                      field="metrics_address")
            if not _metrics_address_ok(self.metrics_address):
                raise refuse("metrics_address", "must be HOST:PORT (port 1..65535) or unix:/ABSOLUTE/PATH "
                             f"(at most {_SUN_PATH_MAX} bytes)", self.metrics_address)


# Fields whose None means "a default computed at start".
_OPTIONAL = frozenset(f.name for f in dataclasses.fields(DaemonConfig) if f.default is None)


def _metrics_address_ok(address: str) -> bool:
    """Whether ``address`` is ``HOST:PORT`` or ``unix:/absolute/path`` (what the metrics server binds)."""
    if address.startswith("unix:"):
        path = address[len("unix:"):]
        return path.startswith("/") and len(os.fsencode(path)) <= _SUN_PATH_MAX
    host, sep, port = address.rpartition(":")
    return bool(sep and host.strip("[]") and port.isdigit() and 1 <= int(port) <= 65535)
