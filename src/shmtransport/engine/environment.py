"""The environment every vLLM process of ours runs in: loopback only, no telemetry, no stray files.

vLLM otherwise posts usage statistics to an outside server from a background thread, SMG's servicer
publishes KV events on ``tcp://*``, and each engine start leaves IPC socket files in /tmp. Nothing in
this project may talk to an outside address, so every launcher (stock server, our worker, the
offline engine in tests) takes its environment from ``engine_environment``.
"""
from __future__ import annotations

import os
import pathlib
import tempfile

LOOPBACK = "127.0.0.1"


def engine_environment(runtime_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Variables to set before vLLM is imported (or in a child's environment).

    ``runtime_dir`` holds vLLM's IPC sockets and torch's compile cache (kept between runs when the
    same directory is passed again)."""
    base = pathlib.Path(runtime_dir) if runtime_dir else pathlib.Path(tempfile.gettempdir()) / "shmtransport-vllm"
    rpc = base / "rpc"
    rpc.mkdir(parents=True, exist_ok=True, mode=0o700)
    return {
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_HOST_IP": LOOPBACK,
        "VLLM_LOOPBACK_IP": LOOPBACK,
        "GLOO_SOCKET_IFNAME": "lo",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_RPC_BASE_PATH": str(rpc),
        "TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"),
        "SMG_VLLM_SERVICER_KV_EVENTS": "0",
        "SMG_VLLM_SERVICER_WARMUP": "off",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def apply(runtime_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Set ``engine_environment`` in this process (before importing vllm); returns it."""
    env = engine_environment(runtime_dir)
    os.environ.update(env)
    return env
