"""Request-lifecycle throughput: N concurrent producer/consumer client pairs against one daemon
(``run_lifecycles``), and the same shape of request sent inline over gRPC (``run_grpc_inline_lifecycles``).

One lifecycle = ``put_many`` of ``tensors`` arrays (with the content digest fused in when
``fused_hash``) -> handles over the pair's socket -> ``acquire_many`` (``acquire_bytes`` for one)
-> check their digests -> ``release`` the leases -> ack -> the producer releases its handles. The
consumer's digest check (xxh3_64 of every array) is inside the lifecycle: it is the receiver's
correctness flag.

The handles travel on a ``SOCK_SEQPACKET`` socket pair (pickled, one packet each way), the cheapest
channel a frontend could pick, as iceoryx2's pairs use their own event service: the row measures
the transport, not a pickling pipe.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback

from . import _ours
from .common import (
    CTX,
    IDLE_LIMIT_S,
    IDLE_POLL_S,
    REPLY_TIMEOUT_S,
    START_TIMEOUT_S,
    digest_of,
    rss_kib,
    seeded_payload,
    stop_process,
    verify,
    wait_reply,
)


def _run_for(duration_s: float, lifecycle) -> tuple[list[float], bool, float]:
    """``lifecycle()`` (returns the receiver's flag) back to back for ``duration_s``: the samples,
    the AND of the flags and the elapsed time."""
    samples: list[float] = []
    ok = True
    start = time.perf_counter()
    deadline = start + duration_s
    while True:
        t0 = time.perf_counter()
        ok = lifecycle() and ok
        t1 = time.perf_counter()
        samples.append(t1 - t0)
        if t1 >= deadline:
            return samples, ok, time.perf_counter() - start


def _send_failure(ctl, peer=None) -> None:
    """From an ``except`` block: the traceback to the orchestrator, and stop the pair's consumer."""
    try:
        ctl.send(("error", traceback.format_exc()))
        if peer is not None:
            peer.send(("stop",))
    except Exception:  # noqa: BLE001, S110 — the parent may be gone already
        pass


STOP = b"stop"
MAX_PACKET = 1 << 16


def _producer_main(socket_path: str, fused_hash: bool, sockets, ctl, peer, tensors: int, nbytes: int,
                   seed: int) -> None:
    client = None
    sock = sockets[0]
    sockets[1].close()
    try:
        client = _ours.client().Producer(socket_path, timeout_s=_ours.CLIENT_TIMEOUT_S)
        arrays = [seeded_payload(nbytes, seed + i) for i in range(tensors)]
        sock.settimeout(REPLY_TIMEOUT_S)
        ctl.send(("ready", os.getpid()))
        _, duration_s = wait_reply(ctl, START_TIMEOUT_S, "lifecycle orchestrator")

        def lifecycle() -> bool:
            handles = client.put_many(arrays, digest=fused_hash)
            sock.send(pickle.dumps([h.to_bytes() for h in handles]))
            reply = sock.recv(MAX_PACKET)
            if reply not in (b"\x00", b"\x01"):
                raise RuntimeError(f"lifecycle consumer: {reply[:2000]!r}")
            flag = reply == b"\x01"
            client.release(handles)
            return flag

        samples, ok, elapsed = _run_for(duration_s, lifecycle)
        sock.send(STOP)
        ctl.send(("result", samples, ok, elapsed))
    except BaseException:  # noqa: BLE001
        _send_failure(ctl)
        try:
            sock.send(STOP)
        except OSError:
            pass
    finally:
        if client is not None:
            client.close()
        sock.close()
        ctl.close()
        peer.close()


def _consumer_main(socket_path: str, fused_hash: bool, sockets, ctl, peer, tensors: int, nbytes: int,
                   seed: int) -> None:
    client = None
    sock = sockets[1]
    sockets[0].close()
    try:
        mod = _ours.client()
        client = mod.Consumer(socket_path, timeout_s=_ours.CLIENT_TIMEOUT_S)
        digests = [digest_of(seeded_payload(nbytes, seed + i)) for i in range(tensors)]
        sock.settimeout(IDLE_POLL_S)
        ctl.send(("ready", os.getpid()))
        parent = mp.parent_process()
        idle_s = 0.0
        while True:
            try:
                packet = sock.recv(MAX_PACKET)
            except TimeoutError:
                idle_s += IDLE_POLL_S
                if (parent is not None and not parent.is_alive()) or idle_s > IDLE_LIMIT_S:
                    return
                continue
            idle_s = 0.0
            if packet in (STOP, b""):
                break
            blobs = pickle.loads(packet)
            # As a user would: one handle's bytes straight to a lease, several in one call.
            leases = [client.acquire_bytes(blobs[0])] if len(blobs) == 1 else \
                client.acquire_many([mod.Handle.from_bytes(b) for b in blobs])
            ok = all(verify(lease.array, d) for lease, d in zip(leases, digests))
            client.release(leases)
            del leases
            sock.send(b"\x01" if ok else b"\x00")
        ctl.send(("done",))
    except BaseException:  # noqa: BLE001
        _send_failure(ctl)
        try:
            sock.send(b"consumer failed")  # the producer raises; the traceback comes through ctl
        except OSError:
            pass
    finally:
        if client is not None:
            client.close()
        sock.close()
        ctl.close()
        peer.close()


def run_lifecycles(socket_path: str, pairs: int, tensors: int, nbytes: int, duration_s: float,
                   rss_pid: int | None = None, fused_hash: bool = True) -> dict:
    """Start ``pairs`` producer/consumer processes, run them together for ``duration_s``.

    Returns lifecycles/s (all pairs together), per-lifecycle seconds, the AND of the flags and the
    peak VmRSS (KiB) of ``rss_pid`` sampled during the run.
    """
    channels = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(pairs)]
    try:
        results, peak = _run_pairs(
            _producer_main, _consumer_main, lambda i: (socket_path, fused_hash, channels[i]),
            pairs, tensors, nbytes, duration_s, rss_pid)
    finally:
        for pair in channels:
            for end in pair:
                end.close()
    samples = [s for r in results for s in r[1]]
    count = len(samples)
    wall = max(r[3] for r in results)
    return {
        "lifecycles_per_s": count / wall,
        "samples": samples,
        "correct": all(r[2] for r in results),
        "daemon_peak_rss_kib": peak or None,
    }


def run_grpc_inline_lifecycles(workdir: str, pairs: int, tensors: int, nbytes: int, duration_s: float) -> dict:
    """The inline-gRPC counterpart of ``run_lifecycles``: ``pairs`` producer processes, each calling
    its own consumer process's gRPC server (Unix socket) with the ``tensors`` arrays' bytes inline in
    one unary request; the server checks every array's digest inside the call and answers the flag.

    One lifecycle = join the arrays' bytes into the request (the copy a frontend holding numpy arrays
    pays) -> the call -> the consumer's digest check -> the response. No daemon; no releases.
    """
    results, _ = _run_pairs(
        _grpc_producer_main, _grpc_consumer_main, lambda i: (os.path.join(workdir, f"inline{i}.sock"),),
        pairs, tensors, nbytes, duration_s, None)
    samples = [s for r in results for s in r[1]]
    return {
        "lifecycles_per_s": len(samples) / max(r[3] for r in results),
        "samples": samples,
        "correct": all(r[2] for r in results),
    }


def _run_pairs(producer_target, consumer_target, endpoint, pairs: int, tensors: int, nbytes: int,
               duration_s: float, rss_pid: int | None):
    """Spawn the pairs (``endpoint(i)``: the leading arguments of pair i's two targets), start every
    producer at once, collect (producer results, consumer ``done`` payloads, peak RSS of rss_pid)."""
    procs = []  # (process, ctl conn, role)
    try:
        for i in range(pairs):
            prod_peer, cons_peer = CTX.Pipe(duplex=True)
            for role, target, peer_end in (("producer", producer_target, prod_peer),
                                           ("consumer", consumer_target, cons_peer)):
                ctl_parent, ctl_child = CTX.Pipe(duplex=True)
                proc = CTX.Process(target=target, name=f"lifecycle-{role}-{i}", daemon=True,
                                   args=(*endpoint(i), ctl_child, peer_end, tensors, nbytes, 1000 * i))
                proc.start()
                ctl_child.close()
                procs.append((proc, ctl_parent, role))
            prod_peer.close()
            cons_peer.close()
        for _proc, ctl, role in procs:
            wait_reply(ctl, START_TIMEOUT_S, f"lifecycle {role}")
        producers = [(p, c) for p, c, role in procs if role == "producer"]
        for _, ctl in producers:
            ctl.send(("go", duration_s))
        peak = 0
        deadline = time.monotonic() + duration_s + REPLY_TIMEOUT_S
        results = []
        pending = list(producers)
        while pending:
            if rss_pid is not None:
                peak = max(peak, rss_kib(rss_pid).get("VmRSS", 0))
            for item in list(pending):
                if item[1].poll(0.05 / len(pending)):
                    results.append(wait_reply(item[1], 1.0, "lifecycle producer"))
                    pending.remove(item)
            if time.monotonic() > deadline:
                raise TimeoutError("lifecycle producers did not finish")
        for _proc, ctl, role in procs:
            if role == "consumer":
                wait_reply(ctl, REPLY_TIMEOUT_S, "lifecycle consumer")
        return results, peak
    finally:
        for proc, ctl, _ in procs:
            stop_process(proc, None, "lifecycle")
            ctl.close()


# -- the inline-gRPC pair ----------------------------------------------------------------------------

def _grpc_producer_main(socket_path: str, ctl, peer, tensors: int, nbytes: int, seed: int) -> None:
    channel = None
    try:
        import grpc

        from ._grpc import OPTIONS, SERVICE

        arrays = [seeded_payload(nbytes, seed + i) for i in range(tensors)]
        ctl.send(("ready", os.getpid()))
        _, duration_s = wait_reply(ctl, START_TIMEOUT_S, "lifecycle orchestrator")
        channel = grpc.insecure_channel(f"unix:{socket_path}", options=OPTIONS)
        grpc.channel_ready_future(channel).result(timeout=START_TIMEOUT_S)
        call = channel.unary_unary(f"/{SERVICE}/Call")  # raw bytes both ways
        samples, ok, elapsed = _run_for(duration_s, lambda: call(b"".join(arrays), timeout=REPLY_TIMEOUT_S) == b"\x01")
        peer.send(("stop",))
        ctl.send(("result", samples, ok, elapsed))
    except BaseException:  # noqa: BLE001
        _send_failure(ctl, peer)
    finally:
        if channel is not None:
            channel.close()
        ctl.close()
        peer.close()


def _grpc_consumer_main(socket_path: str, ctl, peer, tensors: int, nbytes: int, seed: int) -> None:
    server = None
    try:
        from concurrent import futures

        import grpc

        from ._grpc import OPTIONS, SERVICE

        digests = [digest_of(seeded_payload(nbytes, seed + i)) for i in range(tensors)]

        def handle(request: bytes, context) -> bytes:
            view = memoryview(request)
            ok = len(request) == tensors * nbytes and all(
                verify(view[i * nbytes:(i + 1) * nbytes], d) for i, d in enumerate(digests))
            return b"\x01" if ok else b"\x00"

        handler = grpc.method_handlers_generic_handler(SERVICE, {"Call": grpc.unary_unary_rpc_method_handler(handle)})
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=OPTIONS)
        server.add_generic_rpc_handlers((handler,))
        if server.add_insecure_port(f"unix:{socket_path}") == 0:
            raise RuntimeError(f"cannot bind unix:{socket_path}")
        server.start()
        ctl.send(("ready", os.getpid()))
        parent = mp.parent_process()
        idle_s = 0.0
        while not peer.poll(IDLE_POLL_S):
            idle_s += IDLE_POLL_S
            if (parent is not None and not parent.is_alive()) or idle_s > IDLE_LIMIT_S:
                return
        peer.recv()  # ("stop",)
        ctl.send(("done",))
    except BaseException:  # noqa: BLE001
        _send_failure(ctl)
    finally:
        if server is not None:
            server.stop(grace=1.0).wait(5.0)
        ctl.close()
        peer.close()
