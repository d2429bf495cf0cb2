"""The environment of the vLLM processes we start, and the defaults ``shmtransport vllm-worker``
gives its users.

Whatever the process's user set wins: we only fill in variables that are unset.

- ``PRIVACY_DEFAULTS`` (every vLLM process of ours, ``vllm-worker`` included): vLLM otherwise posts
  usage statistics to an outside server from a background thread, and SMG's servicer publishes KV
  events on ``tcp://*`` and sends itself warm-up requests.
- ``isolated_environment`` (the launchers of this repository's tests, demo and benchmarks, which run
  on one machine with no outside network): loopback only, no model hub, a 1 GiB CPU KV cache, and
  vLLM's IPC sockets and torch's compile cache in a directory of ours instead of stray files in
  /tmp. A user's ``vllm-worker`` gets none of these: a hub model id downloads and a multi-host
  setup keeps its own interface.
"""
from __future__ import annotations

import os
import pathlib
import tempfile
from typing import Mapping

LOOPBACK = "127.0.0.1"

PRIVACY_DEFAULTS = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "SMG_VLLM_SERVICER_KV_EVENTS": "0",
    "SMG_VLLM_SERVICER_WARMUP": "off",
}


def isolated_environment(runtime_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """``PRIVACY_DEFAULTS`` plus what a vLLM process on a machine without outside network needs.

    ``runtime_dir`` holds vLLM's IPC sockets and torch's compile cache (kept between runs when the
    same directory is passed again)."""
    base = pathlib.Path(runtime_dir) if runtime_dir else pathlib.Path(tempfile.gettempdir()) / "shmtransport-vllm"
    rpc = base / "rpc"
    rpc.mkdir(parents=True, exist_ok=True, mode=0o700)
    return {
        **PRIVACY_DEFAULTS,
        "VLLM_HOST_IP": LOOPBACK,
        "VLLM_LOOPBACK_IP": LOOPBACK,
        "GLOO_SOCKET_IFNAME": "lo",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_RPC_BASE_PATH": str(rpc),
        "TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def with_defaults(defaults: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with each of ``defaults`` added where ``environ`` has no value for it."""
    return {**defaults, **environ}


def apply_defaults(defaults: Mapping[str, str]) -> dict[str, str]:
    """Set each of ``defaults`` in this process (before importing vllm) where it is unset; returns
    the ones it set."""
    applied = {name: value for name, value in defaults.items() if name not in os.environ}
    for name, value in applied.items():
        os.environ.setdefault(name, value)
    return applied
