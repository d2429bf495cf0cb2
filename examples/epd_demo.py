"""The demo's encoder-disaggregation section: stock vLLM OpenAI servers, the encoder apart from the
language model, with our EC connector beside vLLM's own ``ECExampleConnector`` and one aggregated
server, the same images through each (``openai`` client, streamed, greedy).

Five servers start side by side on a tiny random-weight Qwen2-VL (``engine.epd.Topology``):
aggregated; encoder + language model with ``ECExampleConnector`` (files in /dev/shm); the same with
``ShmtransportECConnector`` (the daemon's identity index); ``shmtransport epd-proxy`` in front of each
pair. Every request must give the aggregated server's tokens and logprobs. The table shows the
time to first token (new images every request), the encoder runs per request (vLLM's own iteration
log) and the copies of the encoder output between the encoder and the language model.
"""
from __future__ import annotations

import asyncio
import base64
import io
import os
import shutil
import statistics
import tempfile
import time

PREFIX = "shmtdemo"
TOLERANCE = 1e-4
SIZES = ((224, 224), (448, 448), (1344, 896))


def _png_url(width: int, height: int, seed: int) -> str:
    from shmtransport.frontend.media import synthetic_image

    png = io.BytesIO()
    synthetic_image(width, height, seed).convert("RGB").save(png, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def _ask(url: str, model: str, image: str) -> tuple[float, list[str], list[float]]:
    import openai

    from shmtransport.engine.epd import chat_first_token, image_part

    async def go() -> tuple[float, list[str], list[float]]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0) as c:
            return await chat_first_token(c, model, [image_part(image)], 8)

    return asyncio.run(go())


def run(quick: bool) -> int:
    from shmtransport.engine import tiny_model
    from shmtransport.engine.epd import ENCODER_OUTPUT_COPIES, Topology
    from shmtransport.engine.process import remove_vllm_orphans
    from shmtransport.worker.process import start_daemon_process, stop_process

    started = time.perf_counter()
    rounds = 3 if quick else 7  # new images per path and size: the median of these
    tmp = tempfile.mkdtemp(prefix="shmt-epd-demo-", dir="/tmp")
    shm_before = set(os.listdir("/dev/shm"))
    socket = os.path.join(tmp, "d.sock")
    daemon = None
    topologies: dict[str, Topology] = {}
    ok = True
    try:
        model = str(tiny_model.build(os.path.join(tmp, "model")))
        daemon = start_daemon_process(socket, 1 << 30, PREFIX)
        topologies = {name: Topology(name, model, tmp, socket, count_encoder_inputs=True)
                      for name in ("aggregated", "epd-example", "epd-ours")}
        for topology in topologies.values():
            topology.launch()
        urls = {name: topology.start() for name, topology in topologies.items()}
        print(f"\nencoder disaggregation (stock vLLM OpenAI servers; 5 servers up in "
              f"{time.perf_counter() - started:.0f} s)")
        seeds = iter(range(1000, 1 << 20))
        for name in topologies:  # untimed: vLLM compiles its logprobs path on a server's first request
            _ask(urls[name], model, _png_url(224, 224, next(seeds)))
        print(f"{'image':<12} {'path':<12} {'first token p50':>15} {'encoder runs':>13} {'copies':>7}  tokens+logprobs")
        for width, height in SIZES:
            images = [_png_url(width, height, next(seeds)) for _ in range(rounds)]
            answers = {}
            for name, topology in topologies.items():
                for other in topologies.values():  # a vLLM engine busy-polls for a while after a request
                    if other is not topology:
                        for server in other.servers.values():
                            server.wait_idle()
                runs = topology.encoder_inputs()
                answers[name] = [_ask(urls[name], model, image) for image in images]
                answers[name + " runs"] = (topology.encoder_inputs() - runs) / rounds
            reference = answers["aggregated"]
            for name in topologies:
                same = all(a[1] == r[1] and all(abs(x - y) <= TOLERANCE for x, y in zip(a[2], r[2]))
                           for a, r in zip(answers[name], reference))
                ok &= same
                first = statistics.median(a[0] for a in answers[name]) * 1e3
                print(f"{f'{width}x{height}' if name == 'aggregated' else '':<12} {name:<12} {first:>13.1f}ms "
                      f"{answers[name + ' runs']:>13.1f} {ENCODER_OUTPUT_COPIES[name]:>7}  "
                      f"{'same' if same else 'DIFFERENT'}")
        print("(encoder runs: vLLM's scheduled encoder inputs per request, over the path's servers: the language\n"
              " model of an EPD path loads the encoder's output instead. copies: of one encoder output between\n"
              " the encoder and the language model, by construction (engine.epd.ENCODER_OUTPUT_COPIES). On two\n"
              " shared cores EPD cannot win what separate hardware wins: it shows what crosses, not a speed-up.)")
    except Exception as exc:  # noqa: BLE001 - the demo reports and still cleans up
        print(f"\nEPD demo failed: {type(exc).__name__}: {exc}")
        ok = False
    finally:
        for topology in topologies.values():
            topology.stop()
        daemon_rc = stop_process(daemon)
        remove_vllm_orphans(shm_before)
        shutil.rmtree(tmp, ignore_errors=True)
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith((PREFIX, "shmt-ec-example"))]
    print(f"EPD section: daemon exit {daemon_rc}; /dev/shm leftovers: {leftovers or 'none'}; "
          f"{time.perf_counter() - started:.1f} s")
    return 0 if ok and daemon_rc == 0 and not leftovers else 1
