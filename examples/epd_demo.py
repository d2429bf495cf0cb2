"""The demo's encoder-disaggregation section: stock vLLM OpenAI servers, the encoder apart from the
language model, with our EC connector (``examples/demo.py`` starts the daemon and the servers, then
calls ``run``); the same images through each topology (``openai`` client, streamed, greedy).

Topologies on a tiny random-weight Qwen2-VL (``engine.epd.Topology``): ``aggregated`` (one server)
and ``epd-ours`` (an encoder server and a language-model server, ``ShmtransportECConnector`` between
them through the daemon's identity index, ``shmtransport epd-proxy`` in front); with ``--full`` also
``epd-example``, the same pair with vLLM's own ``ECExampleConnector`` (files in /dev/shm). Every
request must give the aggregated server's tokens; the table shows the largest logprob difference,
the time to first token (new images every request), the encoder runs per request (vLLM's own
iteration log) and the copies of the encoder output between the encoder and the language model.
The servers run without vLLM's prefix cache, as in the first section.
"""
from __future__ import annotations

import asyncio
import base64
import io
import statistics

from vllm_demo import NO_PREFIX_CACHE, logprob_diff, verdict

SIZES = ((224, 224), (448, 448), (1344, 896))


def rounds(full: bool) -> int:
    """New images per topology and size: the median of these."""
    return 7 if full else 3


def names(full: bool) -> tuple[str, ...]:
    """The topologies shown; ``aggregated`` first (the reference)."""
    return ("aggregated", "epd-example", "epd-ours") if full else ("aggregated", "epd-ours")


def topologies(model: str, work_dir: str, daemon_socket: str, full: bool) -> dict:
    """The section's topologies (``engine.epd.Topology``), not yet launched."""
    from shmtransport.engine.epd import Topology

    return {name: Topology(name, model, work_dir, daemon_socket, count_encoder_inputs=True,
                           extra_flags=NO_PREFIX_CACHE) for name in names(full)}


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


def run(topologies: dict, urls: dict[str, str], model: str, full: bool) -> bool:
    """The images of every size through every serving topology (``urls``: from ``Topology.start``);
    prints the table; whether every topology gave the aggregated server's tokens."""
    from shmtransport.engine.epd import ENCODER_OUTPUT_COPIES

    n_rounds = rounds(full)
    ok = True
    seeds = iter(range(1000, 1 << 20))
    for name in topologies:  # untimed: vLLM compiles its logprobs path on a server's first request
        _ask(urls[name], model, _png_url(224, 224, next(seeds)))
    print(f"\n{'image':<12} {'path':<12} {'first token p50':>15} {'encoder runs':>13} {'copies':>7} "
          f"{'max |dlogprob|':>14}  tokens vs aggregated")
    for width, height in SIZES:
        images = [_png_url(width, height, next(seeds)) for _ in range(n_rounds)]
        answers = {}
        runs = {}
        for name, topology in topologies.items():
            for other in topologies.values():  # a vLLM engine busy-polls for a while after a request
                if other is not topology:
                    for server in other.servers.values():
                        server.wait_idle()
            before = topology.encoder_inputs()
            answers[name] = [_ask(urls[name], model, image) for image in images]
            runs[name] = (topology.encoder_inputs() - before) / n_rounds
        reference = answers["aggregated"]
        for name in topologies:
            equal = all(a[1] == r[1] for a, r in zip(answers[name], reference))
            diff = max(logprob_diff(a[2], r[2]) for a, r in zip(answers[name], reference))
            ok &= equal
            first = statistics.median(a[0] for a in answers[name]) * 1e3
            print(f"{f'{width}x{height}' if name == 'aggregated' else '':<12} {name:<12} {first:>13.1f}ms "
                  f"{runs[name]:>13.1f} {ENCODER_OUTPUT_COPIES[name]:>7} "
                  f"{'(reference)' if name == 'aggregated' else f'{diff:.1e}':>14}  {verdict(equal, diff)}")
    print("(encoder runs: vLLM's scheduled encoder inputs per request, over the path's servers: the language\n"
          " model of an EPD path loads the encoder's output instead. copies: of one encoder output between\n"
          " the encoder and the language model, by construction (engine.epd.ENCODER_OUTPUT_COPIES). On two\n"
          " shared cores EPD cannot win what separate hardware wins: it shows what crosses, not a speed-up.\n"
          f" tokens: 8 greedy tokens for each of {n_rounds} new images per size, equal to the aggregated server's;\n"
          " max |dlogprob|: the largest logprob difference over them)")
    return ok
