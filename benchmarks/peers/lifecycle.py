"""Request-lifecycle throughput: N concurrent producer/consumer client pairs against one daemon.

One lifecycle = put ``tensors`` arrays with hash=True (``put_many`` when the client has it) -> handles over the pair's
pipe -> ``acquire`` them (``acquire_many``) -> check their digests -> release (``release_many``) -> ack
-> the producer releases its handles (``release_many``, else ``release(list)`` — one RPC either way). The consumer's digest check (xxh3_64 of
4 x 64 KiB, ~20 us) is inside the lifecycle: it is the receiver's correctness flag.
"""
from __future__ import annotations

import functools
import multiprocessing as mp
import os
import time
import traceback

from . import _ours
from .common import CTX, IDLE_LIMIT_S, IDLE_POLL_S, REPLY_TIMEOUT_S, START_TIMEOUT_S, rss_kib, seeded_payload, stop_process, verify, \
    wait_reply, digest_of


def _batch(obj, name: str):
    return getattr(obj, name, None)


def _producer_main(socket_path: str, ctl, peer, tensors: int, nbytes: int, seed: int) -> None:
    client = None
    try:
        client = _ours.client().Producer(socket_path, timeout_s=_ours.CLIENT_TIMEOUT_S)
        arrays = [seeded_payload(nbytes, seed + i) for i in range(tensors)]
        put_many, release_many = _batch(client, "put_many"), _batch(client, "release_many")
        if put_many is not None:
            put_many = functools.partial(put_many, hash=True)
        ctl.send(("ready", os.getpid()))
        _, duration_s = wait_reply(ctl, START_TIMEOUT_S, "lifecycle orchestrator")
        samples: list[float] = []
        ok = True
        start = time.perf_counter()
        deadline = start + duration_s
        while True:
            t0 = time.perf_counter()
            handles = list(put_many(arrays)) if put_many else [client.put(a, hash=True) for a in arrays]
            peer.send(("xfer", [h.to_bytes() for h in handles]))
            _, flag = wait_reply(peer, REPLY_TIMEOUT_S, "lifecycle consumer")
            ok = ok and flag
            if release_many:
                release_many(handles)
            else:
                client.release(handles)  # Producer.release takes one handle or an iterable: one RPC
            t1 = time.perf_counter()
            samples.append(t1 - t0)
            if t1 >= deadline:
                break
        elapsed = time.perf_counter() - start
        peer.send(("stop",))
        ctl.send(("result", samples, ok, elapsed, bool(put_many), bool(release_many)))
    except BaseException:  # noqa: BLE001
        try:
            ctl.send(("error", traceback.format_exc()))
            peer.send(("stop",))
        except Exception:  # noqa: BLE001
            pass
    finally:
        if client is not None:
            client.close()
        ctl.close()
        peer.close()


def _consumer_main(socket_path: str, ctl, peer, tensors: int, nbytes: int, seed: int) -> None:
    client = None
    try:
        mod = _ours.client()
        client = mod.Consumer(socket_path, timeout_s=_ours.CLIENT_TIMEOUT_S)
        digests = [digest_of(seeded_payload(nbytes, seed + i)) for i in range(tensors)]
        acquire_many, release_many = _batch(client, "acquire_many"), _batch(client, "release_many")
        ctl.send(("ready", os.getpid()))
        parent = mp.parent_process()
        idle_s = 0.0
        while True:
            if not peer.poll(IDLE_POLL_S):
                idle_s += IDLE_POLL_S
                if (parent is not None and not parent.is_alive()) or idle_s > IDLE_LIMIT_S:
                    return
                continue
            idle_s = 0.0
            msg = peer.recv()
            if msg[0] == "stop":
                break
            handles = [mod.Handle.from_bytes(b) for b in msg[1]]
            leases = list(acquire_many(handles)) if acquire_many else [client.acquire(h) for h in handles]
            ok = all(verify(lease.array, d) for lease, d in zip(leases, digests))
            if release_many:
                release_many(leases)
            else:
                for lease in leases:
                    lease.release()
            del leases
            peer.send(("ack", ok))
        ctl.send(("done", bool(acquire_many), bool(release_many)))
    except BaseException:  # noqa: BLE001
        try:
            ctl.send(("error", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
    finally:
        if client is not None:
            client.close()
        ctl.close()
        peer.close()


def run_lifecycles(socket_path: str, pairs: int, tensors: int, nbytes: int, duration_s: float,
                   rss_pid: int | None = None) -> dict:
    """Start ``pairs`` producer/consumer processes, run them together for ``duration_s``.

    Returns lifecycles/s (all pairs together), per-lifecycle seconds, the AND of the flags, which
    batch calls were used, and the peak VmRSS (KiB) of ``rss_pid`` sampled during the run.
    """
    procs = []  # (process, ctl conn, role)
    try:
        for i in range(pairs):
            prod_peer, cons_peer = CTX.Pipe(duplex=True)
            for role, target, peer_end in (("producer", _producer_main, prod_peer), ("consumer", _consumer_main, cons_peer)):
                ctl_parent, ctl_child = CTX.Pipe(duplex=True)
                proc = CTX.Process(target=target, name=f"lifecycle-{role}-{i}", daemon=True,
                                   args=(socket_path, ctl_child, peer_end, tensors, nbytes, 1000 * i))
                proc.start()
                ctl_child.close()
                procs.append((proc, ctl_parent, role))
            prod_peer.close()
            cons_peer.close()
        for proc, ctl, role in procs:
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
        consumer_batch = []
        for proc, ctl, role in procs:
            if role == "consumer":
                consumer_batch.append(wait_reply(ctl, REPLY_TIMEOUT_S, "lifecycle consumer")[1:])
        samples = [s for r in results for s in r[1]]
        count = len(samples)
        wall = max(r[3] for r in results)
        return {
            "lifecycles_per_s": count / wall,
            "samples": samples,
            "correct": all(r[2] for r in results),
            "producer_put_many": all(r[4] for r in results),
            "producer_release_many": all(r[5] for r in results),  # else release(list): also one RPC
            "consumer_acquire_many": all(b[0] for b in consumer_batch),
            "consumer_release_many": all(b[1] for b in consumer_batch),
            "daemon_peak_rss_kib": peak or None,
        }
    finally:
        for proc, ctl, _ in procs:
            stop_process(proc, None, "lifecycle")
            ctl.close()
