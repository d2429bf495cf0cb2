"""``remote``: a tensor read across a (simulated) node boundary: NIXL READ vs inline gRPC bytes.

    python benchmarks/run.py remote [--quick] [--json PATH]

Setup: an in-process daemon with ``remote_extension`` (namespace overridden, as if on another node)
holds one seeded tensor per size, committed and hashed by a Producer. A spawned reader process
(UCX on loopback only: ``UCX_TLS=tcp,self,sm`` unless set in the environment,
``UCX_NET_DEVICES=lo`` always) times, alternating per
round after warm-up:

- ``nixl_remote_read``: ``RemoteReader.read`` (RemoteAcquire RPC + one NIXL READ into the receive
  pool, or above the slot size into a buffer registered for it and cached for reuse; the
  RemoteRelease RPC is sent without waiting for its reply), then the buffer's release;
- ``grpc_inline``: one unary gRPC call over TCP 127.0.0.1 whose response carries the bytes (the
  server copies them out of shared memory into the message, as an inline sender must).

Digest checks (tree XXH3-128 vs the producer's) run outside the timed span; ``correct`` is their AND.
Honest caveat: both peers run on one 2-core machine; UCX may pick shared memory (``sm``) for two
processes on one host, which a real cross-node read over TCP/RDMA would not.
"""
from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np
from harness import Report, time_alternating

MiB = 1 << 20
FULL_PLAN = {1 * MiB: (30, 3), 16 * MiB: (15, 2), 64 * MiB: (10, 2), 256 * MiB: (5, 1)}
QUICK_PLAN = {1 * MiB: (10, 2), 64 * MiB: (5, 1)}
UCX_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}
SLOT_NBYTES = 8 * MiB
MAX_MSG = 512 * MiB
INLINE_METHOD = "/shmtbench.Inline/Get"


def _label(nbytes: int) -> str:
    return f"{nbytes // MiB}MiB"


def _ucx_env() -> dict:
    """UCX settings for both sides: UCX_TLS may be overridden from the environment (e.g.
    ``UCX_TLS=tcp,self`` keeps UCX off shared memory); the device is always loopback."""
    os.environ.setdefault("UCX_TLS", UCX_ENV["UCX_TLS"])
    os.environ["UCX_NET_DEVICES"] = "lo"
    return {k: os.environ[k] for k in UCX_ENV}


def _reader_main(conn, inline_addr: str, items: list, plan: dict) -> None:
    _ucx_env()
    try:
        import grpc

        from shmtransport._backend import kernels
        from shmtransport.remote import RemoteReader

        channel = grpc.insecure_channel(inline_addr, options=[("grpc.max_receive_message_length", MAX_MSG),
                                                              ("grpc.max_send_message_length", MAX_MSG)])
        get = channel.unary_unary(INLINE_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        results = {}
        with RemoteReader(pool_slots=4, slot_nbytes=SLOT_NBYTES, verify=False) as reader:
            for nbytes, remote_blob, digest in items:
                key = str(nbytes).encode()
                got = {}

                def nixl(remote_blob=remote_blob, got=got, digest=digest):
                    buf = reader.read(remote_blob)
                    got["nixl"] = (kernels.tree_digest(memoryview(buf._memory)) == digest if "nixl" not in got
                                   else got["nixl"])
                    buf.release()

                def inline(key=key, got=got, digest=digest):
                    data = get(key, timeout=60)
                    arr = np.frombuffer(data, dtype=np.uint8)
                    if "inline" not in got:
                        got["inline"] = kernels.tree_digest(memoryview(arr)) == digest

                repeat, warmup = plan[nbytes]
                samples = time_alternating({"nixl_remote_read": nixl, "grpc_inline": inline}, repeat, warmup)
                results[nbytes] = (samples, dict(got), dict(reader.stats))
        channel.close()
        conn.send(("ok", results))
    except BaseException as exc:  # report, never hang the parent
        import traceback

        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run(quick: bool) -> Report:
    ucx_env = _ucx_env()
    import concurrent.futures

    import grpc

    from shmtransport import testing
    from shmtransport.client import Producer
    from shmtransport.remote import RemoteExporter, nixl_available
    from shmtransport.remote.daemon_ext import remote_extension

    report = Report("remote", extra_versions=("grpcio", "nixl-cu12"))
    if not nixl_available():
        report.notes.append("NIXL not installed (pip install shmtransport[nixl]): nothing measured")
        return report
    plan = QUICK_PLAN if quick else FULL_PLAN
    arena = sum(plan) + 64 * MiB
    daemon = testing.start_daemon(arena_nbytes=arena, shm_namespace="bench-node-a", extensions=[remote_extension()])
    server = None
    started = time.perf_counter()
    try:
        with Producer(daemon.socket_path) as producer:
            exporter = RemoteExporter(producer)
            rng = np.random.default_rng(20260901)
            handles = {n: producer.put(rng.integers(0, 256, n, dtype=np.uint8), digest=True) for n in plan}
            views = {str(n).encode(): producer._conn.memory(h.shm)[:n] for n, h in handles.items()}

            def serve(request, context):
                return bytes(views[request])  # what an inline sender does: bytes into the message

            server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2),
                                 options=[("grpc.max_receive_message_length", MAX_MSG),
                                          ("grpc.max_send_message_length", MAX_MSG)])
            handler = grpc.method_handlers_generic_handler(
                "shmtbench.Inline", {"Get": grpc.unary_unary_rpc_method_handler(
                    serve, request_deserializer=lambda b: b, response_serializer=lambda b: b)})
            server.add_generic_rpc_handlers((handler,))
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            items = [(n, exporter.export(h).SerializeToString(), h.digest) for n, h in handles.items()]
            ctx = multiprocessing.get_context("spawn")
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_reader_main, args=(child, f"127.0.0.1:{port}", items, plan), daemon=True)
            proc.start()
            child.close()
            if not parent.poll(600):
                proc.kill()
                raise TimeoutError("reader process did not finish")
            status, payload = parent.recv()
            proc.join(10)
            if status != "ok":
                raise RuntimeError("reader process failed: " + payload)
            for nbytes, (samples, got, stats) in payload.items():
                for name, s in samples.items():
                    key = "nixl" if name.startswith("nixl") else "inline"
                    row = report.add_row(name, s, got.get(key, False), nbytes=nbytes, size=_label(nbytes))
                    row["gbps"] = nbytes / row["median_s"] / 1e9
                report.rows[-2]["reader_stats"] = stats
            producer.release(list(handles.values()), wait=True)
            views.clear()
    finally:
        if server is not None:
            server.stop(0)
        testing.stop_daemon(daemon)
    for nbytes in plan:
        ratio = report.median("grpc_inline", nbytes=nbytes) / report.median("nixl_remote_read", nbytes=nbytes)
        report.ratios[f"remote_inline_speedup_{_label(nbytes)}"] = round(ratio, 3)
    report.targets["remote_inline_speedup_64MiB"] = ">= 5"
    report.notes.append(f"UCX env {ucx_env}; receive pool 4 x {SLOT_NBYTES >> 20} MiB (larger reads use a buffer "
                        f"registered for them, kept for reuse); {'quick' if quick else 'full'} run in "
                        f"{time.perf_counter() - started:.1f} s")
    report.notes.append("one machine: UCX may move the bytes through shared memory (sm/cma) rather than TCP")
    return report
