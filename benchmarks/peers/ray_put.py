"""``ray_put``: Ray's object store (plasma, inside the raylet) from the driver to an actor.

Start (untimed, once per session, i.e. once per suite run): ``ray.init`` of a local one-node cluster
(one CPU, no dashboard, an object store of 4x the suite's largest payload, its session and logs in a
temp dir under /tmp, every address on loopback: see ``import_package``), then one actor: a worker
process the raylet starts, which is the consumer. The benchmark process is the driver (the producer).

Timed: ``ray.put(payload)`` (one copy into the store) -> ``actor.hold.remote(ref)``: Ray resolves the
ref in the actor's process to a zero-copy read-only numpy array over the plasma object, the actor
keeps it and returns -> ``ray.get`` of that return is the ack. The ref travels as a task argument,
so no pickle is written by us. Untimed: ``actor.check.remote(digest, corrupt)`` hashes the held bytes
in the actor (the receiver's flag) and drops them; the producer drops its ref, so the store frees
the object. Resource use counts the actor as the consumer and the raylet (the store) as the daemon.

Stop: ``ray.shutdown(wait_for_processes=True)``, then every process of the cluster (the ones
``ray.init`` started and their children, the workers) is waited for, killed if it outlives the wait.
The driver's core worker keeps a few event-loop fds and its log files open after shutdown.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import tempfile
import time

import numpy as np

from .common import JOIN_TIMEOUT_S, REPLY_TIMEOUT_S, START_TIMEOUT_S, ProducerBase

STORE_MIN_NBYTES = 100 << 20  # Ray refuses an object store under 75 MiB


def import_package():
    """``import ray`` with the settings that Ray reads once, at its first import, in the environment
    (inherited by the cluster's processes):

    - cluster mode off (the variable's name says Windows/OSX; it is the switch on Linux too): Ray
      takes 127.0.0.1 as the node's address, not the interface that routes outwards;
    - token auth (Ray's default for a local cluster) with a per-process token in
      ``RAY_AUTH_TOKEN``, so Ray does not write one to ~/.ray/auth_token;
    - no usage-stats reporting.
    """
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    import ray
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError("ray was imported before peers.ray_put: its cluster would not stay on loopback")
    return ray


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def _tree(roots) -> set[int]:
    out, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(_children(pid))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


class Producer(ProducerBase):
    name = "ray_put"
    consumer_class = None  # the consumer is a Ray actor, started by the raylet, not by the harness

    def __init__(self, workdir: str, max_nbytes: int, **options):
        super().__init__(workdir, **options)
        self.store_nbytes = max(4 * max_nbytes, STORE_MIN_NBYTES)
        self.ray = None
        self.actor = None
        self.ref = None
        self.temp_dir: str | None = None
        self.roots: set[int] = set()  # the processes ray.init started
        self.pids: dict[str, int] = {}

    def connect(self) -> None:
        ray = self.ray = import_package()
        if ray.is_initialized():
            raise RuntimeError("ray is already initialised in this process: ray_put owns its cluster")
        from ._ray_actor import RayConsumer

        before = set(_children(os.getpid()))
        self.temp_dir = tempfile.mkdtemp(prefix="stb-ray-", dir="/tmp")  # short: Ray's socket paths live here
        bench_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        ray.init(num_cpus=1, num_gpus=0, include_dashboard=False, object_store_memory=self.store_nbytes,
                 _temp_dir=self.temp_dir, log_to_driver=False, logging_level="WARNING",
                 job_config=ray.job_config.JobConfig(code_search_path=[bench_dir]))  # the actor imports peers.*
        self.roots = set(_children(os.getpid())) - before
        self.actor = RayConsumer.remote()
        actor_pid = ray.get(self.actor.pid.remote(), timeout=START_TIMEOUT_S)
        raylet = [p for p in self.roots if _comm(p) == "raylet"]
        self.pids = {"consumer": actor_pid, **({"daemon": raylet[0]} if raylet else {})}

    def peer_pids(self) -> dict[str, int]:
        return self.pids

    def transfer(self, payload: np.ndarray) -> float:
        self.ref = self.ray.put(payload)
        self.ray.get(self.actor.hold.remote(self.ref), timeout=REPLY_TIMEOUT_S)
        return 0.0

    def check_local(self, digest: int, corrupt: bool) -> bool:
        return self.ray.get(self.actor.check.remote(digest, corrupt), timeout=REPLY_TIMEOUT_S)

    def after_ack(self) -> None:
        self.ref = None

    def teardown(self) -> None:
        self.ref = None
        self.actor = None
        if self.ray is not None:
            cluster = _tree(self.roots)
            self.ray.shutdown(wait_for_processes=True)
            self.ray = None
            _wait_gone(cluster)
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


def _wait_gone(pids: set[int]) -> None:
    """Wait for ``pids`` to exit; SIGKILL what is still there after JOIN_TIMEOUT_S."""
    for sig in (None, signal.SIGKILL):
        if sig is not None:
            for pid in pids:
                if _alive(pid):
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
    left = sorted(p for p in pids if _alive(p))
    if left:
        raise RuntimeError(f"Ray processes still alive after shutdown: {left}")
