"""One ``loan`` handoff per size, phase by phase: where the per-object cost that grows with size goes.

    .venv/bin/python benchmarks/handoff_sizes.py [--sizes 1,16,64,256] [--reps 40] [--arena-mib 1024]

Three processes: the daemon (``shmtransport.testing.start_daemon``), the producer (this one) and the
consumer (this script again, ``--consumer``). One timed handoff = ``loan`` -> (the write, untimed) ->
``commit`` -> handle bytes over a ``SOCK_SEQPACKET`` socket pair -> the consumer, blocked on the socket
in its main thread, ``acquire``s, takes ``lease.array``, ``release``s and acks one byte. The producer
releases its reference after the ack, untimed. Reported: the median span, and the median of each
phase on both sides (µs), so a cost that grows with size shows where it is paid. After the timed
handoffs one more is checked byte for byte by the consumer (the ``ok`` column).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

MiB = 1 << 20
CONSUMER_PHASES = ("acquire", "array", "release")
PRODUCER_PHASES = ("loan", "commit", "handoff", "write")


def _daemon_main(arena_nbytes: int, conn: "mp.connection.Connection") -> None:
    from shmtransport.testing import start_daemon, stop_daemon

    daemon = start_daemon(arena_nbytes=arena_nbytes)
    conn.send(daemon.config.socket_path)
    conn.recv()  # stop
    stop_daemon(daemon)


def consumer(fd: int, socket_path: str, evict_mib: int) -> None:
    """Serve handoffs until an empty packet: per handoff, its phase times; then the check.
    ``evict_mib``: after each ack (untimed), copy that much private memory, as a consumer that
    reads what it received does."""
    from shmtransport.client import Consumer

    sock = socket.socket(fileno=fd)
    scratch = np.ones((2, evict_mib * MiB), np.uint8)
    times: dict[str, list[float]] = {phase: [] for phase in CONSUMER_PHASES}
    with Consumer(socket_path) as client:
        while True:
            packet = sock.recv(4096)
            if not packet:
                break
            check = packet[0] == 1
            t0 = time.perf_counter()
            lease = client.acquire_bytes(packet[1:])
            t1 = time.perf_counter()
            array = lease.array
            t2 = time.perf_counter()
            ok = bool(np.all(array.reshape(-1) == np.arange(array.nbytes, dtype=np.uint64).astype(np.uint8))) \
                if check else True
            del array
            t3 = time.perf_counter()
            lease.release()
            t4 = time.perf_counter()
            sock.send(b"\x01" if ok else b"\x00")
            np.copyto(scratch[0], scratch[1])
            if not check:
                for phase, dt in zip(CONSUMER_PHASES, (t1 - t0, t2 - t1, t4 - t3)):
                    times[phase].append(dt)
            if packet[0] == 2:  # end of a size: report its phases
                sock.send(repr({k: v[:] for k, v in times.items()}).encode())
                for v in times.values():
                    v.clear()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1,16,64,256", help="MiB, comma-separated")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--arena-mib", type=int, default=1024)
    parser.add_argument("--evict-mib", type=int, default=0,
                        help="after the write and after the ack (untimed), the producer and the consumer "
                             "each also copy this many MiB of private memory: tells cache and TLB misses "
                             "from work on the shared bytes")
    parser.add_argument("--keep-view", action="store_true",
                        help="keep loan.array past commit (its pages are then made read-only)")
    args = parser.parse_args()
    sizes = [int(float(s) * MiB) for s in args.sizes.split(",")]

    from shmtransport.client import Producer

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    daemon = ctx.Process(target=_daemon_main, args=(args.arena_mib * MiB, child), daemon=True)
    daemon.start()
    socket_path = parent.recv()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen([sys.executable, __file__, "--consumer", str(theirs.fileno()), socket_path,
                             str(args.evict_mib)], pass_fds=(theirs.fileno(),))
    theirs.close()
    print(f"backend={os.environ.get('SHMTRANSPORT_BACKEND', 'default')} arena={args.arena_mib} MiB "
          f"reps={args.reps} keep_view={args.keep_view} evict_mib={args.evict_mib} (µs; write: untimed)")
    print(f"{'size':>8} {'span':>7} | " + " ".join(f"{p:>8}" for p in PRODUCER_PHASES) + " | "
          + " ".join(f"{p:>8}" for p in CONSUMER_PHASES) + " | ok")
    try:
        with Producer(socket_path) as producer:
            for nbytes in sizes:
                payload = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
                scratch = np.ones((2, args.evict_mib * MiB), np.uint8)
                spans: list[float] = []
                phases: dict[str, list[float]] = {phase: [] for phase in PRODUCER_PHASES}
                total = args.warmup + args.reps
                for i in range(total + 1):
                    flag = 1 if i == total else (2 if i == total - 1 else 0)
                    t0 = time.perf_counter()
                    loan = producer.loan(nbytes)
                    t1 = time.perf_counter()
                    np.copyto(loan.array, payload)  # the producer's own write: untimed
                    np.copyto(scratch[0], scratch[1])
                    kept = [loan.array[:1]] if args.keep_view else []  # a view made before the commit
                    t2 = time.perf_counter()
                    handle = loan.commit()
                    kept.clear()
                    t3 = time.perf_counter()
                    ours.send(bytes([flag]) + handle.to_bytes())
                    ack = ours.recv(1)
                    t4 = time.perf_counter()
                    producer.release(handle)
                    if flag == 2:
                        consumer_times = eval(ours.recv(1 << 20))  # noqa: S307 - our own child's repr
                    if i >= args.warmup and i < total:
                        spans.append(t4 - t0 - (t2 - t1))
                        for phase, dt in zip(PRODUCER_PHASES, (t1 - t0, t3 - t2, t4 - t3, t2 - t1)):
                            phases[phase].append(dt)
                ok = ack == b"\x01"
                consumer_times = {k: v[args.warmup:] for k, v in consumer_times.items()}
                us = [statistics.median(phases[p]) * 1e6 for p in PRODUCER_PHASES]
                cs = [statistics.median(consumer_times[p]) * 1e6 for p in CONSUMER_PHASES]
                label = f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes >> 10} KiB"
                print(f"{label:>8} {statistics.median(spans) * 1e6:7.0f} | "
                      + " ".join(f"{v:8.0f}" for v in us) + " | " + " ".join(f"{v:8.0f}" for v in cs)
                      + f" | {ok}", flush=True)
    finally:
        ours.send(b"")
        proc.wait(timeout=30)
        parent.send("stop")
        daemon.join(timeout=30)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--consumer":
        consumer(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    else:
        main()
