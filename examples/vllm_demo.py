"""The demo's first section, against vLLM's real engine: renderer -> shmtransportd -> vLLM, our path
beside vLLM's own (``examples/demo.py`` starts the daemon and the servers, then calls ``run``).

Servers: vLLM's stock gRPC server (SMG's servicer over AsyncLLM, as ``vllm serve --grpc`` runs it)
and our ``shmtransport vllm-worker`` (handles all the way to the process where the model runs);
with ``--full`` also three more vllm-workers fed the same arena views through vLLM's in-tree ways
to the model (its default MessagePack/ZMQ path, ``--mm-processor-cache-type shm`` and
``--mm-tensor-ipc torch_shm``). This process is the frontend: it renders sample images and videos of
a tiny random-weight Qwen2-VL with the real Qwen2-VL processors (0.3-28 MiB; ``--full``: a video
alone too, and a 55 MiB image instead of the 28 MiB one) and sends every request down every path,
stock with ShmHandles (a segment per tensor) and stock inline (bytes in the message) included.

Parity: one request per kind goes down every path with the same content; the 8 greedy tokens must
be equal, and the table shows the largest logprob difference from ours. The servers run without
vLLM's prefix cache: the two stock paths share a server, and a prefix-cache hit on the second one
prefills fewer tokens, i.e. other kernel shapes (the likely cause of logprobs 3.9e-3 apart with
equal tokens, seen once on the 55 MiB image when the demo compared them within 1e-4). Timed
requests carry new pixels each (vLLM's encoder cache would answer a repeated image), each sent
once the other engines are idle.
"""
from __future__ import annotations

import os
import pathlib
import statistics
import tempfile
import time

import grpc

from shmtransport.engine import paths, process
from shmtransport.engine.qwen2_vl import Qwen2VLRenderer

MAX_TOKENS = 8
# Same tokens with logprobs further apart than this is reported (not a failure): bf16 CPU kernels
# give bit-equal results for equal shapes, and a few 1e-3 when a prefill is split otherwise.
LOGPROB_TOLERANCE = 1e-2
NO_PREFIX_CACHE = ("--no-enable-prefix-caching",)


def rounds(full: bool) -> int:
    """Timed requests per path and kind: medians of at least three."""
    return 9 if full else 3


def worker_paths(full: bool) -> list[str]:
    """Our worker, and with ``full`` one vllm-worker per in-tree vLLM path."""
    return ["ours", *(paths.VLLM_PATHS if full else ())]


def servers(model: str, daemon_socket: str, log_dir: str, full: bool) -> dict[str, process.EngineServer]:
    """The section's servers, not yet launched: vLLM's stock gRPC server (``stock``) and one
    vllm-worker per ``worker_paths``, none with a prefix cache. Their model processes take turns on
    the cores (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's default puts every one on core 0, where two
    starting side by side each import vLLM at half speed, 25 s more)."""
    runtime = os.path.join(tempfile.gettempdir(), "shmtransport-vllm")  # keeps torch's compile cache
    log = pathlib.Path(log_dir)
    cores = os.cpu_count() or 1
    out: dict[str, process.EngineServer] = {}
    for i, name in enumerate(["stock", *worker_paths(full)]):
        port = process.free_port()
        env = {**paths.WORKER_ENV.get(name, {}),
               **({"VLLM_CPU_OMP_THREADS_BIND": str((cores - 1 - i) % cores)} if cores >= 2 else {})}
        argv = process.stock_argv(model, port, NO_PREFIX_CACHE) if name == "stock" else \
            process.worker_argv(model, port, daemon_socket, (*paths.WORKER_FLAGS[name], *NO_PREFIX_CACHE))
        out[name] = process.EngineServer(argv, port, runtime_dir=runtime, log_path=log / f"{name}.log", env=env)
    return out


def render(model: str, full: bool) -> tuple[Qwen2VLRenderer, dict]:
    """The renderer and the request kinds, rendered once: 0.3-28 MiB by default; ``full`` adds a
    video alone and has the 55 MiB image instead of the 28 MiB one (about 4 s a request on two
    cores against 1.3 s, most of it vLLM's encoder)."""
    from shmtransport.frontend.media import synthetic_image, synthetic_video

    renderer = Qwen2VLRenderer(model)
    large = Qwen2VLRenderer(model, pixel_dtype="float32")
    img = lambda w, h, seed, r=renderer: r.image(synthetic_image(w, h, seed))  # noqa: E731
    kinds = {
        "image 224x224": lambda: [img(224, 224, 1)],
        "3 images (ragged)": lambda: [img(224, 224, 2), img(448, 336, 3), img(112, 84, 4)],
        "video 4x224x224": lambda: [renderer.video(synthetic_video(4, 224, 224, 5))],
        "image+video": lambda: [img(448, 448, 6), renderer.video(synthetic_video(2, 224, 224, 7))],
        "image 1344x896 f32": lambda: [img(1344, 896, 9, large)],
        "image 1792x1344 f32": lambda: [img(1792, 1344, 8, large)],
    }
    left_out = ("image 1344x896 f32",) if full else ("video 4x224x224", "image 1792x1344 f32")
    shown = [kind for kind in kinds if kind not in left_out]
    return renderer, {kind: kinds[kind]() for kind in shown}


def run(servers: dict[str, process.EngineServer], rendered: tuple[Qwen2VLRenderer, dict], daemon_socket: str,
        full: bool) -> bool:
    """Every kind of ``rendered`` (from ``render``) down every path of the serving ``servers``;
    prints the table; whether every path gave ours's tokens and the daemon holds nothing afterwards."""
    from shmtransport import NO_INLINE, GeneratorClient
    from shmtransport.client import Consumer, Producer

    n_rounds = rounds(full)
    renderer, kinds = rendered
    results: dict[tuple[str, str], list[paths.Completion]] = {}
    parity: dict[str, dict[str, paths.Completion]] = {}
    clients: dict[str, GeneratorClient] = {}
    ours = [name for name in servers if name != "stock"]
    with Producer(daemon_socket) as producer, Consumer(daemon_socket) as consumer, \
            grpc.insecure_channel(servers["stock"].address) as stock:
        clients = {path: GeneratorClient(servers[path].address, producer, inline=NO_INLINE, timeout_s=300)
                   for path in ours}
        send = {path: (lambda p, c=client: paths.send_ours(c, p.token_ids, p.features, max_tokens=MAX_TOKENS))
                for path, client in clients.items()}
        send["stock-shm"] = lambda p: paths.send_stock(stock, producer, consumer, p.token_ids, p.features,
                                                       shm=True, max_tokens=MAX_TOKENS)
        send["stock-inline"] = lambda p: paths.send_stock(stock, None, None, p.token_ids, p.features,
                                                          shm=False, max_tokens=MAX_TOKENS)
        engine_of = {path: servers["stock" if path.startswith("stock") else path] for path in send}

        def settle(path: str) -> None:
            """Time a path only once the other engines are idle: after a request a vLLM CPU engine
            stays busy for up to a second, taken from the engine under test on a small machine."""
            for server in set(servers.values()) - {engine_of[path]}:
                unsettled[path] += not server.wait_idle()

        unsettled = dict.fromkeys(send, 0)
        variants = iter(range(1, 1 << 16))
        for kind, items in kinds.items():
            t0 = time.perf_counter()
            prompt = renderer.prompt("describe this", items)
            # round 0: one content down every path (their outputs must agree; it also warms up);
            # timed rounds: new content for every request, since vLLM answers a repeated
            # identity from its encoder cache and would hide the transport
            first = prompt.variant(next(variants))
            parity[kind] = {path: fn(first) for path, fn in send.items()}
            order = list(send)
            for _ in range(n_rounds):  # each round starts with another path: no path is always first
                for path in order:
                    settle(path)
                    results.setdefault((kind, path), []).append(send[path](prompt.variant(next(variants))))
                order = order[1:] + order[:1]
            print(f"  {kind}: {time.perf_counter() - t0:.0f} s", flush=True)
        for client in clients.values():
            client.close()
        stat = producer.stat()
        deadline = time.monotonic() + 10
        while (stat.live_leases or stat.live_objects) and time.monotonic() < deadline:
            time.sleep(0.05)  # the worker releases once vLLM drops its last view
            stat = producer.stat()
    ok = _print_table(kinds, results, parity)
    print(f"machine: {os.cpu_count()} CPUs, load average {' / '.join(f'{x:.1f}' for x in os.getloadavg())} "
          f"(1 / 5 / 15 min) after the section; medians of {n_rounds} timed requests per path, after one "
          "untimed request per path and kind, each timed once the other engines were idle "
          f"(not within 5 s: {sum(unsettled.values())} times)")
    print(f"daemon after the section: {stat.live_objects} live objects, {stat.live_leases} live leases")
    return ok and stat.live_leases == 0 and stat.live_objects == 0


def _p90(values: list[float]) -> float:
    """The 90th percentile (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, -(-9 * len(ordered) // 10) - 1)]


def verdict(tokens_equal: bool, logprob_diff: float) -> str:
    """The parity column: different tokens fail; equal tokens with logprobs further apart than
    ``LOGPROB_TOLERANCE`` are shown, not failed."""
    if not tokens_equal:
        return "DIFFERENT"
    return "same" if logprob_diff <= LOGPROB_TOLERANCE else "same tokens, logprobs apart"


def logprob_diff(a: list[float], b: list[float]) -> float:
    """The largest absolute difference of two paths' logprobs (over the common length)."""
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def _print_table(kinds: dict, results: dict, parity: dict) -> bool:
    ms = 1e3
    ok = True
    print(f"\n{'request':<20} {'MiB':>6} {'path':<15} {'first token p50':>15} {'p90':>9} {'total p50':>10} "
          f"{'host copies':>11} {'max |dlogprob|':>14}  tokens vs ours")
    for kind, items in kinds.items():
        nbytes = sum(it.nbytes for it in items)
        floats = any(v.dtype.kind == "f" for it in items for v in it.kwargs.values())
        ref = parity[kind]["ours"]
        for i, path in enumerate(parity[kind]):
            runs = results[(kind, path)]
            c = parity[kind][path]
            diff = logprob_diff(c.logprobs, ref.logprobs)
            equal = c.token_ids == ref.token_ids and len(c.logprobs) == len(ref.logprobs)
            ok &= equal
            copies = paths.copies_to_model(path, 1, nbytes) + (1 if floats and path.startswith("stock") else 0)
            if not equal:  # say how far apart, so that a failure can be judged
                print(f"  {path} vs ours: tokens {c.token_ids} vs {ref.token_ids}")
            size = f"{nbytes / 2**20:.1f}" if i == 0 else ""
            print(f"{kind if i == 0 else '':<20} {size:>6} {path:<15} "
                  f"{statistics.median(c.first_token_s for c in runs) * ms:>13.1f}ms "
                  f"{_p90([c.first_token_s for c in runs]) * ms:>7.1f}ms "
                  f"{statistics.median(c.total_s for c in runs) * ms:>8.1f}ms {copies:>11} "
                  f"{'(reference)' if path == 'ours' else f'{diff:.1e}':>14}  {verdict(equal, diff)}")
    print("(first token: request built from the renderer's output -> first token back, every timed request\n"
          " with new pixels (vLLM caches encoder outputs by identity). host copies of the tensor bytes from\n"
          " the renderer's output to the model's input (shmtransport.engine.paths.copies_to_model): ours is\n"
          " one put into the arena, then handles to the process where the model runs, which maps them;\n"
          " the others also pay vLLM's hops (API -> EngineCore over ZMQ, EngineCore -> worker through its\n"
          " broadcast ring). Several items of one request also meet vLLM's batching copy on every path.\n"
          " tokens vs ours: 8 greedy tokens of one request with the same content on every path, which must\n"
          f" be equal; max |dlogprob|: their largest logprob difference from ours (bf16; a difference above\n"
          f" {LOGPROB_TOLERANCE:g} with equal tokens is marked, not failed))")
    return ok
