"""Run the daemon and the worker server as child processes (demo, tests, benchmarks)."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from types import TracebackType
from typing import Any

# Torch's OpenMP threads spin for a while after each parallel region by default; on a machine the
# worker shares with the frontend (tests, benchmarks, the demo) that spinning steals the cores the
# frontend copies with. A variable already set in the environment wins.
_WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


# The child arms its own parent-death signal, then execs the command: a ``preexec_fn`` would make
# the parent fork() instead of vfork(), and in a process using gRPC, fork() runs gRPC's fork
# handlers, which restart its poller threads in the child; the child then closes every fd before
# exec, and about one start in fifty aborted on "epoll_wait error: Bad file descriptor".
# PR_SET_PDEATHSIG (1) survives exec; a parent already gone before it was armed ends the child.
_ARM_PARENT_DEATH = ("import ctypes,os,signal,sys;ctypes.CDLL(None).prctl(1,signal.SIGTERM);"
                     "os.getppid()==int(sys.argv[1]) or os._exit(1);os.execv(sys.argv[2],sys.argv[2:])")


def die_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that the child gets SIGTERM when this process dies, however it dies (a killed
    demo or test run must not leave a daemon or an engine running). ``argv[0]`` is a path."""
    return [sys.executable, "-S", "-c", _ARM_PARENT_DEATH, str(os.getpid()), *argv]


def _wait_ready(proc: subprocess.Popen[str], what: str, timeout_s: float) -> str:
    stdout = proc.stdout
    if stdout is None:
        raise ValueError(f"{what}: the process was not started with stdout=PIPE")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = stdout.readline()
        if not line:
            break
        if "ready" in line:
            return line.strip()
    proc.kill()
    proc.wait(5)
    err = proc.stderr.read() if proc.stderr else ""
    raise RuntimeError(f"{what} did not start within {timeout_s} s (exit {proc.returncode}): {err[-2000:]}")


def start_daemon_process(socket_path: str, arena_nbytes: int, name_prefix: str,
                         timeout_s: float = 30.0) -> subprocess.Popen[str]:
    """A daemon started as a child (killed if this process dies), once it listens; raises after ``timeout_s``."""
    cmd = [sys.executable, "-m", "shmtransport", "daemon", "--socket", socket_path,
           "--arena-size", str(arena_nbytes), "--name-prefix", name_prefix, "--log-level", "WARNING"]
    proc = subprocess.Popen(die_with_parent(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_ready(proc, "shmtransportd", timeout_s)
    return proc


def stop_process(proc: subprocess.Popen[str] | None, timeout_s: float = 10.0) -> int | None:
    """SIGTERM ``proc``, SIGKILL after ``timeout_s``, close its pipes; its exit status (None for no process)."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    return proc.returncode


def serve_entry(name: str, argv: list[str] | None = None, **service_options: Any) -> int:
    """The main of a ``WorkerProcess(entry=...)`` script: parse the options ``WorkerProcess`` passes
    (``--socket``, ``--daemon-socket``, ``--device``, ``--max-inline-bytes``, ``--torch-threads``,
    ``--log-level``), then serve the reference worker with ``service_options`` (``GeneratorService``'s
    extension points: ``ingests``, ``after_open``) until SIGTERM, its ready line naming ``name``. A
    socket another live worker serves is refused: one line on stderr, exit status 2."""
    import argparse
    import dataclasses
    import logging

    from ..protocol.limits import DEFAULT_LIMITS
    from ..socket_lock import SocketInUse
    from .server import WorkerServer

    parser = argparse.ArgumentParser(prog=name)
    parser.add_argument("--socket", required=True, help="Unix socket to serve gRPC on")
    parser.add_argument("--daemon-socket", required=True, help="shmtransportd socket")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-inline-bytes", type=int, default=None, help="inline tensor bytes per request")
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    limits = DEFAULT_LIMITS
    if args.max_inline_bytes is not None:
        limits = dataclasses.replace(limits, max_inline_bytes=args.max_inline_bytes)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    try:
        server = WorkerServer(f"unix:{args.socket}", args.daemon_socket, device=args.device, limits=limits,
                              **service_options)
    except SocketInUse as exc:  # another live worker serves that socket: leave it alone, say so once
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    server.serve_until_signalled(name)
    return 0


class WorkerProcess:
    """``shmtransport worker`` as a child process; ``address`` is the gRPC target (``unix:PATH``).
    ``entry``: what ``python`` runs instead, a script taking the same options and printing the same
    ready line (e.g. a worker with more ingests)."""

    def __init__(self, socket_path: str, daemon_socket: str, *, device: str = "cpu",
                 max_inline_bytes: int | None = None, entry: tuple[str, ...] = ("-m", "shmtransport", "worker"),
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None, timeout_s: float = 60.0) -> None:
        self.address = f"unix:{socket_path}"
        cmd = [sys.executable, *entry, "--socket", socket_path,
               "--daemon-socket", daemon_socket, "--device", device, "--log-level", "WARNING", *extra_args]
        if max_inline_bytes is not None:
            cmd += ["--max-inline-bytes", str(max_inline_bytes)]
        self.proc = subprocess.Popen(die_with_parent(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**_WORKER_ENV, **os.environ, **(env or {})})
        self.ready_line = _wait_ready(self.proc, "shmtransport worker", timeout_s)

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.proc.pid

    def kill(self) -> int:
        """SIGKILL the worker; its exit status."""
        self.proc.kill()
        return self.proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the worker, SIGKILL after ``timeout_s``; its exit status."""
        return stop_process(self.proc, timeout_s)

    def __enter__(self) -> "WorkerProcess":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
