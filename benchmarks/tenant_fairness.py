"""Another tenant's RPC latency while one tenant misbehaves (issue 41 item 4: p99 within 2x of idle).

    .venv/bin/python benchmarks/tenant_fairness.py [--attack forged-bits|acquire-herd] [--seconds 10]

Processes (root needed for the second uid): the daemon (started as the CLI starts it), a victim
tenant (this process, uid 0) that times ``Stat`` calls back to back, and an attacker tenant (uid
65534). Attacks:

- ``forged-bits``: a read-only consumer ORs the hand-off bit into every slot of its own table
  every 100 ms, so the daemon's janitor finds them all due at each pass.
- ``acquire-herd``: 32 threads, each with its own session, acquire and release batches of 4,096
  of the attacker's own objects back to back through the daemon (the pure-Python backend, so
  every acquire is an RPC).

Reported: the victim's p50 and p99 with the attacker idle, then attacking the victim's daemon, then
attacking a second daemon of its own (``floor``: what sharing the machine's cores costs, with
nothing shared in the daemon), and the ratios to idle.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time

NOBODY = 65534
MiB = 1 << 20
HERD_THREADS = 32
HERD_BATCH = 4096


def _daemon_main(slots: int, conn) -> None:
    from shmtransport.daemon.server import tune_interpreter_for_daemon
    from shmtransport.testing import start_daemon, stop_daemon

    daemon = start_daemon(arena_nbytes=256 * MiB, object_slots=slots, allowed_uids=(0, NOBODY))
    tune_interpreter_for_daemon()
    os.chmod(os.path.dirname(daemon.config.socket_path), 0o711)
    conn.send(daemon.config.socket_path)
    conn.recv()
    stop_daemon(daemon)


def _become_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _forged_bits(socket_path: str, conn) -> None:
    import numpy as np

    from shmtransport.client import Consumer
    from shmtransport.objtable import HANDOFF

    _become_nobody()
    with Consumer(socket_path, timeout_s=30, daemon_uid=0) as consumer:
        holders = consumer._conn.table.holders
        conn.send("ready")
        while not conn.poll(0.1):
            holders |= np.uint64(HANDOFF)  # every slot, re-armed each 100 ms
        conn.recv()
        conn.send("")


def _acquire_herd(socket_path: str, conn) -> None:
    os.environ["SHMTRANSPORT_BACKEND"] = "python"  # no table: every acquire is an RPC
    import numpy as np

    from shmtransport.client import Consumer, Producer
    from shmtransport.errors import ShmTransportError

    _become_nobody()
    stop = threading.Event()
    calls = [0] * HERD_THREADS

    def herd(i: int, handles) -> None:
        with Consumer(socket_path, timeout_s=60, daemon_uid=0) as consumer:
            while not stop.is_set():
                try:
                    consumer.release(consumer.acquire_many(handles))
                    calls[i] += 1
                except ShmTransportError:  # the tenant's lease quota or CPU share: again
                    pass

    with Producer(socket_path, timeout_s=60, daemon_uid=0) as producer:
        handles = producer.put_many([np.zeros(16, np.uint8)] * HERD_BATCH)
        threads = [threading.Thread(target=herd, args=(i, handles)) for i in range(HERD_THREADS)]
        for t in threads:
            t.start()
        while sum(calls) < HERD_THREADS:  # every thread has done about one round trip
            time.sleep(0.01)
        conn.send("ready")
        started = sum(calls)
        conn.recv()
        stop.set()
        for t in threads:
            t.join(60)
        conn.send(f"{sum(calls) - started} acquire+release round trips of {HERD_BATCH} handles")


def _stat_latencies(consumer, seconds: float) -> list[float]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        consumer.stat()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def _summary(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


ATTACKS = {"forged-bits": _forged_bits, "acquire-herd": _acquire_herd}


class _Daemon:
    def __init__(self, ctx, slots: int) -> None:
        self.conn, end = ctx.Pipe()
        self.process = ctx.Process(target=_daemon_main, args=(slots, end))
        self.process.start()
        self.socket_path = self.conn.recv()

    def stop(self) -> None:
        self.conn.send("stop")
        self.process.join(30)


def _attacked(ctx, attack, socket_path: str, victim, seconds: float) -> tuple[tuple[float, float], str]:
    conn, end = ctx.Pipe()
    attacker = ctx.Process(target=attack, args=(socket_path, end))
    attacker.start()
    try:
        assert conn.recv() == "ready"
        latencies = _summary(_stat_latencies(victim, seconds))
        conn.send("stop")
        return latencies, conn.recv()
    finally:
        attacker.join(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attack", choices=sorted(ATTACKS), default="acquire-herd")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--slots", type=int, default=65536)
    args = parser.parse_args()
    from shmtransport.client import Consumer

    ctx = mp.get_context("spawn")
    daemon, other = _Daemon(ctx, args.slots), _Daemon(ctx, args.slots)
    attack = ATTACKS[args.attack]
    try:
        with Consumer(daemon.socket_path, timeout_s=30) as victim:
            idle = _summary(_stat_latencies(victim, args.seconds))
            shared, shared_work = _attacked(ctx, attack, daemon.socket_path, victim, args.seconds)
            floor, floor_work = _attacked(ctx, attack, other.socket_path, victim, args.seconds)
    finally:
        daemon.stop()
        other.stop()
    print(f"victim Stat, attacker idle:                 p50 {idle[0]:.2f} ms  p99 {idle[1]:.2f} ms")
    print(f"victim Stat, attacker on the same daemon:   p50 {shared[0]:.2f} ms  p99 {shared[1]:.2f} ms"
          f"  p99 ratio {shared[1] / idle[1]:.2f} (target <= 2)  {shared_work}")
    print(f"victim Stat, attacker on a daemon of its own: p50 {floor[0]:.2f} ms  p99 {floor[1]:.2f} ms"
          f"  p99 ratio {floor[1] / idle[1]:.2f} (the floor)  {floor_work}")


if __name__ == "__main__":
    main()
