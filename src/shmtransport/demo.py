"""``make demo``: a daemon, a renderer-like producer and a worker-like consumer, three processes.

The producer hands realistic multimodal tensors (Qwen2-VL-sized pixel patches, a video frame stack,
Whisper-sized audio features) to the worker through shmtransport — ``put`` with the content digest
fused into the copy, and ``loan → commit`` where the renderer writes in place — and, for
comparison, as inline bytes over a pipe. The worker verifies every tensor's digest from shared
memory. The demo ends by stopping the daemon and checking that nothing is left in /dev/shm.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

PREFIX = "shmtdemo"

# kind -> list of (key, shape, dtype): what a renderer hands to the worker for one request.
WORKLOAD = {
    "image 448x448": [("pixel_values", (1024, 1176), np.float32), ("image_grid_thw", (1, 3), np.int64)],
    "image 896x1344": [("pixel_values", (4988, 1176), np.float32), ("image_grid_thw", (1, 3), np.int64)],
    "3 images": [("pixel_values", (3 * 1024, 1176), np.float32), ("image_grid_thw", (3, 3), np.int64)],
    "video 8 frames": [("pixel_values_videos", (8 * 1024, 1176), np.float32), ("video_grid_thw", (1, 3), np.int64)],
    "audio 30 s": [("input_features", (128, 3000), np.float32)],
}


def _render(kind: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=np.float32).astype(dtype) for _, shape, dtype in WORKLOAD[kind]]


def _worker(socket_path: str, conn) -> None:
    """Consumer process: acquire, verify the digest from shared memory, reduce, release."""
    from shmtransport.client import Consumer, Handle

    with Consumer(socket_path) as consumer:
        while True:
            message = conn.recv()
            if message is None:
                return
            mode, payload = message
            if mode == "shm":
                leases = consumer.acquire_many([Handle.from_bytes(b) for b in payload])
                for lease in leases:
                    lease.verify()
                checksum = sum(float(lease.array.reshape(-1)[:16].astype(np.float64).sum()) for lease in leases)
                conn.send(("ok", checksum))
                consumer.release_many(leases, wait=True)  # after the ack: off the timed path
            else:
                arrays = [np.frombuffer(raw, dtype=np.dtype(dt)).reshape(shape) for raw, dt, shape in payload]
                checksum = sum(float(a.reshape(-1)[:16].astype(np.float64).sum()) for a in arrays)
                conn.send(("ok", checksum))


def _start_daemon(socket_path: str, arena_nbytes: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "shmtransport", "daemon", "--socket", socket_path,
           "--arena-size", str(arena_nbytes), "--name-prefix", PREFIX, "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"daemon did not start: {line!r}")
    return proc


def _progress(done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    print(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end="", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer requests per kind (CI)")
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else 15

    from shmtransport import BACKEND
    from shmtransport.client import Producer

    tmp = tempfile.mkdtemp(prefix="shmt-demo-", dir="/tmp")
    socket_path = os.path.join(tmp, "d.sock")
    daemon = _start_daemon(socket_path, 512 << 20)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    worker = ctx.Process(target=_worker, args=(socket_path, child), daemon=True)
    worker.start()
    results: dict[tuple[str, str], list[float]] = {}
    nbytes: dict[str, int] = {}
    print(f"shmtransport demo (kernels: {BACKEND}): daemon pid {daemon.pid}, worker pid {worker.pid}")
    try:
        with Producer(socket_path) as producer:
            total = len(WORKLOAD) * (rounds + 1) * 3
            done = 0
            for kind in WORKLOAD:
                tensors = _render(kind, seed=len(kind))
                nbytes[kind] = sum(t.nbytes for t in tensors)
                for round_index in range(rounds + 1):  # round 0 warms up and is not recorded
                    for mode in ("put", "loan", "inline"):
                        start = time.perf_counter()
                        if mode == "inline":
                            parent.send(("inline", [(t.tobytes(), t.dtype.str, t.shape) for t in tensors]))
                        else:
                            if mode == "put":
                                handles = producer.put_many(tensors, hash=True)
                            else:  # the renderer writes its output straight into the loan
                                loans = producer.loan_many([(None, t.shape, t.dtype) for t in tensors])
                                for loan, t in zip(loans, tensors):
                                    np.copyto(loan.array, t)
                                handles = producer.commit_many(loans, hash=True)
                            parent.send(("shm", [h.to_bytes() for h in handles]))
                        if not parent.poll(30):
                            raise TimeoutError("worker did not answer within 30 s")
                        status, _ = parent.recv()
                        if round_index:
                            results.setdefault((kind, mode), []).append(time.perf_counter() - start)
                        if mode != "inline":
                            producer.release(handles)
                        done += 1
                        _progress(done, total)
            stat = producer.stat()
        print()
        _print_table(results, nbytes)
        print(f"daemon after the run: {stat.live_objects} live objects, {stat.live_leases} live leases, "
              f"{stat.allocations_total} allocations")
    finally:
        parent.send(None)
        worker.join(10)
        daemon.terminate()
        daemon.wait(10)
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)]
    print(f"daemon exit code {daemon.returncode}; /dev/shm leftovers: {leftovers or 'none'}")
    return 0 if daemon.returncode == 0 and not leftovers else 1


def _print_table(results: dict[tuple[str, str], list[float]], nbytes: dict[str, int]) -> None:
    print(f"\n{'request kind':<16} {'MiB':>7} {'put p50':>9} {'put p99':>9} {'loan p50':>9} "
          f"{'inline p50':>11} {'speedup':>8}  verified")
    for kind in WORKLOAD:
        put = results[(kind, "put")]
        loan = results[(kind, "loan")]
        inline = results[(kind, "inline")]
        p99 = sorted(put)[min(len(put) - 1, round(0.99 * (len(put) - 1)))]
        speedup = statistics.median(inline) / statistics.median(put)
        print(f"{kind:<16} {nbytes[kind] / 2**20:7.1f} {statistics.median(put) * 1e3:7.2f}ms {p99 * 1e3:7.2f}ms "
              f"{statistics.median(loan) * 1e3:7.2f}ms {statistics.median(inline) * 1e3:9.2f}ms {speedup:7.1f}x  yes")
    print("(put: one copy with the XXH3 digest fused in; loan: renderer writes in place, digest at commit;"
          " inline: bytes over a pipe; every shm tensor's digest re-verified by the worker)")


if __name__ == "__main__":
    sys.exit(main())
