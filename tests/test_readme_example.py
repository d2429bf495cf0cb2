"""The README's Python example, verbatim, in two processes: the frontend puts, sends the handle and
closes its producer before the worker even connects; the worker still gets the bytes (hand-off)."""
from __future__ import annotations

import pathlib
import re

import numpy as np

from shmtransport.testing import run_in_child

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
TIMEOUT_S = 60


def _example() -> tuple[str, str]:
    """(frontend part, worker part) of the README's first Python block, each with its imports."""
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    imports, frontend, worker = block.split("\n\n", 2)
    assert frontend.startswith("with Producer(") and worker.startswith("with Consumer("), block
    return imports + "\n" + frontend, imports + "\n" + worker


def _frontend(code: str, sock: str, seed: int) -> bytes:
    sent: list[bytes] = []
    pixel_values = np.random.default_rng(seed).random((3, 224, 224), dtype=np.float32)
    exec(code, {"sock": sock, "pixel_values": pixel_values, "send_to_worker": sent.append})
    (data,) = sent
    return data


def _worker(code: str, sock: str, data: bytes) -> np.ndarray:
    names = {"sock": sock, "data": data}
    exec(code, names)
    return names["x"].numpy().copy()  # the lease is released by now; the copy was made under it


def test_the_readme_example_runs_verbatim_in_two_processes(daemon):
    frontend, worker = _example()
    data = run_in_child(_frontend, frontend, daemon.socket_path, 7, timeout_s=TIMEOUT_S)
    # The producer's process has exited: its session is gone, the object is handed off.
    pixels = run_in_child(_worker, worker, daemon.socket_path, data, timeout_s=TIMEOUT_S)
    assert np.array_equal(pixels, np.random.default_rng(7).random((3, 224, 224), dtype=np.float32))
    stat = daemon.stat()
    assert (stat.live_objects, stat.live_leases, stat.handoff_objects) == (0, 0, 0)
