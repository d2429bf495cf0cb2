"""Every daemon option is checked before "ready": a bad ``shmtransport daemon`` flag is one line on
stderr and exit status 2 (never a daemon whose every handshake or put then fails), a bad
``DaemonConfig`` value is a one-line InvalidArgument naming the field and its range before
anything is created, and an unknown keyword to ``start_daemon`` / ``shm_make_daemon`` is a
one-line TypeError naming the field meant."""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from shmtransport import testing
from shmtransport.cli import build_parser
from shmtransport.client import Consumer, Producer
from shmtransport.daemon import Daemon
from shmtransport.daemon.config import DAEMON_FLAGS, DaemonConfig
from shmtransport.errors import InvalidArgument, InvalidType
from shmtransport.testing import segments_of

TIMEOUT_S = 30
MiB = 1 << 20
U32, U64 = (1 << 32) - 1, (1 << 64) - 1

# flag -> bad values of it (each with the other flags at their defaults).
BAD_FLAGS: dict[str, list[list[str]]] = {
    "--arena-size": [["0"], ["-4M"], ["8GB2"]],
    "--quota-bytes": [["0"], ["-1"], ["lots"]],
    "--quota-leases": [["0"], ["-1"], ["1.5"], [str(U64 + 1)]],
    "--max-sessions": [["0"], ["-3"]],
    "--max-hold-ms": [["-1"], [str(U32 + 1)]],
    "--object-slots": [["0"], ["-5"], [str(U32 + 1)]],
    "--handoff-window-ms": [["-5"], ["0"], [str(U32 + 1)]],
    "--cache-size": [["-1"], ["big"]],
    "--shm-reserve": [["-1"]],
    "--lease-ttl-ms": [["0"], ["-1"], ["3600001"]],
    "--metrics-port": [["99999"], ["0"], ["-1"], ["http"]],
    "--metrics-address": [["nohost"], ["127.0.0.1:99999"], ["127.0.0.1:http"], ["unix:relative.sock"],
                          ["127.0.0.1:9100", "--metrics-port", "9100"]],
    "--allow-uid": [["-1"], [str(U32)], ["root"]],
    "--name-prefix": [["a/b"], ["x" * 33]],
    "--log-level": [["bogus"], ["10"]],
    "--remote": [["127.0.0.1:99999"], ["7400"]],
}
CLI_CASES = [pytest.param(flag, values, id=f"{flag}={' '.join(values)}")
             for flag, cases in BAD_FLAGS.items() for values in cases]


def _daemon_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["daemon"]


def test_the_bad_values_walk_every_numeric_and_enumerated_daemon_option():
    typed = {a.option_strings[0] for a in _daemon_parser()._actions
             if a.option_strings and (a.type is not None or a.choices is not None)}
    assert typed and typed <= set(BAD_FLAGS), typed - set(BAD_FLAGS)
    assert set(DAEMON_FLAGS.values()) <= {s for a in _daemon_parser()._actions for s in a.option_strings}


@pytest.mark.parametrize(("flag", "values"), CLI_CASES)
def test_a_bad_daemon_option_is_one_line_and_exit_2_before_ready(flag, values, tmpdir_short, new_prefix):
    prefix = new_prefix()
    sock_dir = os.path.join(tmpdir_short, "run")
    args = ["daemon", "--socket", os.path.join(sock_dir, "d.sock"), "--arena-size", "16M", "--name-prefix", prefix,
            flag, *values]
    result = subprocess.run([sys.executable, "-m", "shmtransport", *args], capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert flag in lines[0], lines[0]
    assert "ready" not in result.stdout
    assert segments_of(prefix) == [] and not os.path.exists(sock_dir)  # refused before anything was made


@pytest.mark.parametrize("command", ["stat", "ls", "health", "worker"])
def test_every_log_level_option_takes_the_standard_names_in_any_case_only(command):
    parser = build_parser()
    assert parser.parse_args([command, "--log-level", "debug"]).log_level == "DEBUG"
    result = subprocess.run([sys.executable, "-m", "shmtransport", command, "--log-level", "bogus"],
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--log-level" in lines[0] and "WARNING" in lines[0], result.stderr


# field -> (bad value, what the message says), one case each.
BAD_VALUES: dict[str, list[tuple[object, str]]] = {
    "arena_nbytes": [(4095, ">= 4096 (one page)"), ("16M", "whole number"), (U64 + 1, f"<= {U64}")],
    "name_prefix": [("a/b", "must match"), ("", "must match")],
    "allowed_uids": [((-1,), "0..4294967294, got -1"), ((U32,), "got 4294967295"), (("root",), "got 'root'"),
                     ((), "no tenant")],
    "quota_nbytes": [(0, ">= 1"), (U64 + 1, f"<= {U64}")],
    "quota_leases": [(0, ">= 1"), (-1, ">= 1"), (True, "whole number"), (U64 + 1, f"<= {U64}")],
    "max_sessions_per_tenant": [(0, ">= 1"), (None, "whole number")],
    "max_hold_ms": [(-1, ">= 0"), (U32 + 1, f"<= {U32}")],
    "shm_reserve_nbytes": [(-1, ">= 0")],
    "default_lease_ttl_ms": [(0, ">= 1"), (3_600_001, "<= max_lease_ttl_ms (3600000)")],
    "max_lease_ttl_ms": [(0, ">= 1"), (U32 + 1, f"<= {U32}")],
    "default_hold_ms": [(-1, ">= 0"), (60_001, "<= max_hold_ms (60000)")],
    "commit_wait_s": [(-0.1, ">= 0"), (math.nan, "finite"), (math.inf, "finite"), ("2", "seconds")],
    "max_alloc_wait_ms": [(-1, ">= 0"), (U32 + 1, f"<= {U32}")],
    "page_align_min_nbytes": [(-1, ">= 0")],
    "object_slots": [(0, ">= 1 (rounded up"), (-5, ">= 1"), (U32 + 1, "<= 4294967232")],
    "share_object_table": [("yes", "True or False")],
    "handoff_window_ms": [(-5, ">= 1, got -5"), (0, ">= 1"), (U32 + 1, f"<= {U32}")],
    "cache_nbytes": [(-1, ">= 0")],
    "metrics_port": [(0, ">= 1"), (65536, "<= 65535"), (-1, ">= 1")],
    "metrics_address": [("nohost", "HOST:PORT"), ("127.0.0.1:0", "HOST:PORT"), ("127.0.0.1:65536", "HOST:PORT"),
                        (":9100", "HOST:PORT"), ("unix:relative.sock", "unix:/"), ("unix:/" + "s" * 120, "107 bytes")],
    "grpc_workers": [(0, ">= 1")],
    "stop_grace_s": [(-1, ">= 0"), (math.inf, "finite")],
}
VALUE_CASES = [pytest.param(field, value, words, id=f"{field}={value!r}"[:60])
               for field, cases in BAD_VALUES.items() for value, words in cases]


def test_the_bad_values_cover_every_numeric_and_enumerated_config_field():
    checked = {f.name for f in dataclasses.fields(DaemonConfig) if any(t in f.type for t in ("int", "float", "bool"))}
    assert checked <= set(BAD_VALUES), checked - set(BAD_VALUES)


@pytest.mark.parametrize(("field", "value", "words"), VALUE_CASES)
def test_validate_names_the_field_and_its_range_in_one_line(field, value, words):
    config = dataclasses.replace(DaemonConfig(), **{field: value})
    with pytest.raises(InvalidArgument) as refused:
        config.validate()
    message = str(refused.value)
    assert words in message and "\n" not in message, message
    assert refused.value.field == field and field in message
    assert isinstance(refused.value, ValueError)
    if words in ("whole number", "seconds", "True or False"):
        assert isinstance(refused.value, InvalidType)


def test_validate_names_a_field_as_the_caller_calls_it():
    with pytest.raises(InvalidArgument, match=r"^--handoff-window-ms must be >= 1, got -5$"):
        DaemonConfig(handoff_window_ms=-5).validate(DAEMON_FLAGS)
    with pytest.raises(InvalidArgument, match=r"^--lease-ttl-ms must be <= max_lease_ttl_ms \(3600000\)"):
        DaemonConfig(default_lease_ttl_ms=3_600_001).validate(DAEMON_FLAGS)
    with pytest.raises(InvalidArgument, match=r"^set --metrics-port or --metrics-address, not both$"):
        DaemonConfig(metrics_port=9100, metrics_address="127.0.0.1:9100").validate(DAEMON_FLAGS)


@pytest.mark.parametrize("good", [
    {}, {"arena_nbytes": 4096, "quota_nbytes": 1, "quota_leases": 1, "max_sessions_per_tenant": 1},
    {"max_hold_ms": 0, "default_hold_ms": 0, "handoff_window_ms": 1, "object_slots": 1, "cache_nbytes": 0},
    {"max_hold_ms": U32, "default_hold_ms": U32, "handoff_window_ms": U32, "max_lease_ttl_ms": U32,
     "default_lease_ttl_ms": U32, "object_slots": U32 // 64 * 64, "quota_leases": U64, "metrics_port": 65535},
    {"commit_wait_s": 0, "stop_grace_s": 0.0, "max_alloc_wait_ms": 0, "page_align_min_nbytes": 0, "grpc_workers": 1},
    {"metrics_address": "[::1]:9100"}, {"metrics_address": "unix:/run/shmt/metrics.sock"},
    {"allowed_uids": (), "allowed_groups": ("users",)}, {"allowed_uids": (0, U32 - 1)},
], ids=lambda good: ",".join(good) or "defaults")
def test_validate_accepts_the_ends_of_every_range(good):
    dataclasses.replace(DaemonConfig(), **good).validate()


def test_object_slots_round_up_to_whole_blocks():
    assert DaemonConfig(object_slots=5).resolved_object_slots(1 << 30) == 64
    assert DaemonConfig(object_slots=100).resolved_object_slots(16 * MiB) == 128
    assert DaemonConfig().resolved_object_slots(16 * MiB) == 4096  # the default is untouched


def test_an_unknown_keyword_is_one_line_naming_the_field_meant(shm_make_daemon):
    with pytest.raises(TypeError) as refused:
        testing.start_daemon(arena_size=16 * MiB)
    assert str(refused.value) == ("start_daemon() got an unexpected keyword argument 'arena_size': "
                                  "did you mean 'arena_nbytes'?")
    with pytest.raises(TypeError, match=r"'lease_ttl_ms': did you mean 'default_lease_ttl_ms'\?$"):
        testing.start_daemon(lease_ttl_ms=1000)  # what its flag sets, not merely the closest name
    with pytest.raises(TypeError, match=r"^shm_make_daemon\(\) got an unexpected keyword argument 'arena_size'"):
        shm_make_daemon(arena_size=16 * MiB)
    with pytest.raises(TypeError) as unlike:
        testing.start_daemon(zzz=1)
    message = str(unlike.value)
    assert "\n" not in message and all(f.name in message for f in dataclasses.fields(DaemonConfig))


def test_a_bad_value_is_refused_before_the_socket_or_a_segment_exists(tmpdir_short, new_prefix):
    prefix = new_prefix()
    sock_dir = os.path.join(tmpdir_short, "run")
    daemon = Daemon(socket_path=os.path.join(sock_dir, "d.sock"), arena_nbytes=16 * MiB, name_prefix=prefix,
                    max_hold_ms=-1)
    with pytest.raises(InvalidArgument, match=r"^max_hold_ms must be >= 0 \(0: no holds\), got -1$"):
        daemon.start()
    assert not os.path.exists(sock_dir) and segments_of(prefix) == []


def _read_until(stream, words: str, deadline: float) -> str:
    """What ``stream`` (a child's pipe) said up to and including the line with ``words``, or all it
    said by ``deadline`` without one."""
    fd, seen = stream.fileno(), b""
    while words.encode() not in seen:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        seen += chunk
    return seen.decode()


def test_a_good_config_at_the_ends_of_the_ranges_starts_and_serves(tmpdir_short, new_prefix):
    """The least values that work (one hold-free ms of hand-off, one lease, 5 object slots: one block
    of 64, fewer than a 64 MiB arena's first grant asks for, which gets them all) still make a daemon
    that serves a put and an acquire."""
    prefix = new_prefix()
    sock = os.path.join(tmpdir_short, "d.sock")
    proc = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-m", "shmtransport", "daemon", "--socket", sock,
         "--arena-size", "64M", "--name-prefix", prefix, "--object-slots", "5", "--handoff-window-ms", "1",
         "--max-hold-ms", "0", "--quota-leases", "1", "--max-sessions", "2", "--lease-ttl-ms", "3600000",
         "--cache-size", "0", "--shm-reserve", "0", "--quota-bytes", "64M", "--metrics-address",
         f"unix:{os.path.join(tmpdir_short, 'm.sock')}", "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = _read_until(proc.stdout, "shmtransportd ready", time.monotonic() + TIMEOUT_S)
        assert "shmtransportd ready" in ready
        with Producer(sock, timeout_s=TIMEOUT_S) as producer, Consumer(sock, timeout_s=TIMEOUT_S) as consumer:
            data = np.arange(1 << 16, dtype=np.uint8)
            handle = producer.put(data)
            with consumer.acquire(handle) as lease:
                assert np.array_equal(lease.array, data)
            producer.release(handle, wait=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=TIMEOUT_S)
            raise
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert segments_of(prefix) == []
