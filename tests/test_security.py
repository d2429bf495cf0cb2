"""Security (``docs/design.md``, lifetime rule 9): another uid cannot reach the daemon or its bytes, segment files
and sockets are 0600, forged handles name nothing, and src/ holds no pickle/eval/exec/marshal/
shell=True.

The current model, stated by a test: handles are capabilities among clients of the allowed uids.
A same-uid client holding (or correctly guessing) every field of a valid handle may acquire it;
generations are sequential and offsets predictable, so a handle is not a secret - the allowlist
and file modes are the boundary, not the handle. That holds for object-table handles too (slot and
per-slot generation are as guessable): within a tenant processes cooperate (docs/security.md).
Commit tokens of the RPC path *are* secrets.

The handle tests run on both object paths: the daemon's default object table and none
(``share_object_table=False``, every object through the RPC registry).
"""
from __future__ import annotations

import os
import pathlib
import re
import stat

import grpc
import numpy as np
import pytest

from shmtransport.client import Consumer, Handle, Producer
from shmtransport.errors import (
    HandleError,
    OwnershipError,
    Reason,
    ShmTransportError,
    StateError,
)
from shmtransport.testing import run_in_child
from shmtransport.v1 import daemon_pb2 as pb
from shmtransport.v1 import daemon_pb2_grpc as pb_grpc
from shmtransport.wire import GRPC_OPTIONS

TIMEOUT_S = 10.0
NOBODY = 65534
SRC = pathlib.Path(__file__).resolve().parent.parent / "src"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")


def _as_nobody(socket_path: str, segment_path: str) -> dict:
    """In a spawned child: drop to uid/gid 65534 (no supplementary groups), then try everything."""
    import socket as socketlib  # imported before dropping privileges: the interpreter's files may be 0700

    out = {}
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    out["uid"] = os.getuid()
    for name, cls in (("consumer", Consumer), ("producer", Producer)):
        try:
            cls(socket_path, timeout_s=3).close()
            out[name] = "CONNECTED"
        except ShmTransportError as exc:
            out[name] = f"{type(exc).__name__}/{exc.reason.value}"
        except Exception as exc:  # noqa: BLE001 - reported, the parent fails on it
            out[name] = f"UNTYPED {type(exc).__name__}: {exc}"
    try:
        fd = os.open(segment_path, os.O_RDONLY)
        os.close(fd)
        out["segment"] = "OPENED"
    except PermissionError:
        out["segment"] = "EACCES"
    channel = grpc.insecure_channel(f"unix:{socket_path}", options=GRPC_OPTIONS)
    try:
        pb_grpc.DaemonStub(channel).Stat(pb.StatRequest(), timeout=3)
        out["grpc"] = "OK"
    except grpc.RpcError as err:
        out["grpc"] = err.code().name
    finally:
        channel.close()
    s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        s.settimeout(3)
        s.connect(socket_path + ".session")
        out["session_socket"] = "CONNECTED"
    except OSError as exc:
        out["session_socket"] = type(exc).__name__
    finally:
        s.close()
    return out


@needs_root
def test_another_uid_cannot_reach_the_0600_sockets_and_gets_a_typed_unavailable(daemon):
    out = run_in_child(_as_nobody, daemon.socket_path, daemon.tenants[0].segment.open_path, timeout_s=60)
    assert out["uid"] == NOBODY
    assert out["consumer"] == out["producer"] == "Unavailable/daemon_unavailable", out
    assert out["session_socket"] == "PermissionError", out
    assert out["grpc"] == "UNAVAILABLE", out
    assert out["segment"] == "EACCES", out
    s = daemon.stat()
    assert not s.clients and s.sessions_total == 0


def _open_up(daemon) -> None:
    """A deployment that lets other uids reach the sockets (directory traversable, sockets 0666)."""
    os.chmod(os.path.dirname(daemon.socket_path), 0o755)
    for path in (daemon.socket_path, daemon.socket_path + ".session"):
        os.chmod(path, 0o666)


@needs_root
def test_another_uid_that_reaches_the_handshake_is_refused_by_the_so_peercred_allowlist(daemon):
    _open_up(daemon)
    out = run_in_child(_as_nobody, daemon.socket_path, daemon.tenants[0].segment.open_path, timeout_s=60)
    assert out["consumer"] == out["producer"] == "PermissionDenied/permission_denied", out
    assert out["grpc"] == "PERMISSION_DENIED", out  # no session token, no service
    assert out["segment"] == "EACCES", out  # and the arena file is not readable anyway
    s = daemon.stat()
    assert not s.clients and s.sessions_total == 0


@needs_root
def test_a_socket_group_daemon_lets_the_group_reach_the_handshake_but_the_uid_allowlist_still_refuses(make_daemon):
    daemon = make_daemon(socket_group="nogroup")
    for path in (daemon.socket_path, daemon.socket_path + ".session"):
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == NOBODY
    os.chmod(os.path.dirname(daemon.socket_path), 0o755)
    # the child keeps gid 65534 (nogroup) as its primary group: it passes the file check
    out = run_in_child(_as_nobody, daemon.socket_path, daemon.tenants[0].segment.open_path, timeout_s=60)
    assert out["session_socket"] == "CONNECTED", out
    assert out["consumer"] == "PermissionDenied/permission_denied", out
    assert daemon.stat().sessions_total == 0


def test_segment_files_and_sockets_are_0600_and_owned_by_the_daemon_user(daemon):
    paths = [tenant.segment.open_path for tenant in daemon.tenants]
    paths += [s.open_path for t in daemon.tenants for s in (t.objects.slots_segment, t.objects.holds_segment)]
    for path in paths:  # sealed memfds, reached through the daemon's fds
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
        assert st.st_uid == os.getuid()
    for path in (daemon.socket_path, daemon.socket_path + ".session"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path


ARRAY = np.arange(1024, dtype=np.float32)
BOTH_PATHS = pytest.mark.parametrize("shared_table", [True, False], ids=["default_table", "no_table"])


def _forge(h: Handle, **fields) -> Handle:
    shm = pb.Handle()
    shm.CopyFrom(h.shm)
    for k, v in fields.items():
        setattr(shm, k, v)
    return Handle(shm, "uint8", (shm.nbytes,), digest=h.digest)


def _forger(socket_path: str, seen: bytes) -> dict:
    """Another process of the same uid that only saw a handle of *other* bytes: it forges."""
    out = {}
    seen = Handle.from_bytes(seen)
    with Consumer(socket_path, timeout_s=TIMEOUT_S) as c, Producer(socket_path, timeout_s=TIMEOUT_S) as p:
        guesses = {
            "next_generation_same_offset": _forge(seen, generation=seen.shm.generation + 1),
            "next_slot_same_offset": _forge(seen, slot=seen.shm.slot + 1),
            "previous_generation": _forge(seen, generation=seen.shm.generation - 1),
            "shifted_offset": _forge(seen, offset=seen.shm.offset + 4096),
            "bigger_nbytes": _forge(seen, nbytes=seen.shm.nbytes * 2),
            "offset_beyond_arena": _forge(seen, offset=1 << 40),
            "other_segment": _forge(seen, name="../" + seen.shm.name),
        }
        for name, h in guesses.items():
            try:
                lease = c.acquire(h)
                out[name] = f"ACQUIRED {bytes(lease.array[:8])!r}"
                c.release([lease], wait=True)
            except ShmTransportError as exc:
                out[name] = exc.reason.value
        try:  # releasing or committing someone else's object is refused even with its exact handle
            p.release(seen, wait=True)
            out["release_foreign"] = "RELEASED"
        except ShmTransportError as exc:
            out["release_foreign"] = exc.reason.value
    return out


@BOTH_PATHS
def test_a_handle_forged_by_another_process_for_bytes_it_was_not_given_is_refused(make_daemon, shared_table):
    daemon = make_daemon(share_object_table=shared_table)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as p:
        shared = p.put(np.zeros(1024, np.float32), digest=True)  # the forger was given this one
        secret = p.put(ARRAY, digest=True)  # ... not this one: next offset, next generation or slot
        # a generation counts the objects of one slot
        assert (secret.shm.slot, secret.shm.generation) == (shared.shm.slot + 1, shared.shm.generation)
        out = run_in_child(_forger, daemon.socket_path, shared.to_bytes(), timeout_s=60)
        # next_generation_same_offset, next_slot_same_offset and shifted_offset name the secret only
        # partly (wrong offset, slot or generation): refused. None of the guesses returned bytes.
        assert not [k for k, v in out.items() if v.startswith("ACQUIRED")], out
        assert out["next_generation_same_offset"] in ("stale_handle", "bad_handle"), out
        assert out["next_slot_same_offset"] in ("bad_handle", "stale_handle", "out_of_bounds"), out
        assert out["shifted_offset"] in ("bad_handle", "stale_handle", "out_of_bounds"), out
        assert out["bigger_nbytes"] == "out_of_bounds" and out["offset_beyond_arena"] == "out_of_bounds", out
        assert out["other_segment"] == "bad_handle", out
        assert out["release_foreign"] == "not_owner", out
        p.release([shared, secret], wait=True)


@BOTH_PATHS
def test_current_model_a_same_uid_client_holding_all_fields_of_a_valid_handle_may_acquire_it(make_daemon,
                                                                                              shared_table):
    """Handles are capabilities: the daemon (or the object table) checks instance, name, slot,
    offset, size and generation, not who received the handle. (Generations are sequential and
    slots handed out in order: a same-uid client can guess them.)"""
    daemon = make_daemon(share_object_table=shared_table)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as p, Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as c:
        h = p.put(ARRAY, digest=True)
        guessed = Handle(pb.Handle(name=h.shm.name, offset=h.shm.offset, nbytes=h.shm.nbytes, slot=h.shm.slot,
                                   generation=h.shm.generation, instance_id=h.shm.instance_id),
                         h.dtype, h.shape, digest=h.digest, commit_token=h.commit_token)
        lease = c.acquire(guessed)
        assert np.array_equal(lease.array, ARRAY)
        c.release([lease], wait=True)
        p.release(h, wait=True)


@BOTH_PATHS
def test_a_loan_cannot_be_committed_by_another_client_without_its_secret_commit_token(make_daemon, shared_table):
    daemon = make_daemon(commit_wait_s=0.1, share_object_table=shared_table)  # an Acquire of a loan waits this long
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as p, Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as c:
        loan = p.loan(64)
        h = Handle(loan.handle.shm, "uint8", (64,), commit_token=os.urandom(16))
        # The daemon refuses a wrong token; a loan its producer placed itself commits only in that
        # producer's shared memory, so a token means nothing to it and the loan stays a loan.
        with pytest.raises(StateError if loan._placed is not None else HandleError):
            c.acquire(h)
        with pytest.raises(Exception) as info:  # without a token: not committed
            c.acquire(Handle(loan.handle.shm, "uint8", (64,)))
        assert getattr(info.value, "reason", None) is Reason.WRONG_STATE
        with pytest.raises(OwnershipError):
            with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as other:
                other.release(Handle(loan.handle.shm, "uint8", (64,)), wait=True)
        loan.release()


def test_a_consumers_view_is_read_only(daemon):
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as p, Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as c:
        h = p.put(ARRAY)
        lease = c.acquire(h)
        arr = lease.array
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[0] = 1
        del arr
        c.release([lease], wait=True)
        p.release(h, wait=True)


FORBIDDEN = [
    (re.compile(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle|marshal|shelve)\b"), "imports a pickle-like module"),
    (re.compile(r"\b(c?pickle|dill|cloudpickle)\.(loads?|Unpickler)\b"), "unpickles"),
    (re.compile(r"\bmarshal\.loads?\b"), "marshal.load(s)"),
    (re.compile(r"(?<![.\w])eval\s*\("), "eval("),
    (re.compile(r"(?<![.\w])exec\s*\("), "exec("),
    (re.compile(r"shell\s*=\s*True"), "shell=True"),
    (re.compile(r"allow_pickle\s*=\s*True"), "numpy allow_pickle=True"),
    (re.compile(r"\btorch\.load\s*\((?![^)]*weights_only\s*=\s*True)"), "torch.load without weights_only=True"),
    (re.compile(r"\byaml\.load\s*\("), "yaml.load"),
]


def scan(root: pathlib.Path) -> list[str]:
    hits = []
    for path in sorted(root.rglob("*.py")):
        if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
            continue  # generated by protoc
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern, what in FORBIDDEN:
                if pattern.search(code):
                    hits.append(f"{path.relative_to(root)}:{lineno}: {what}: {line.strip()}")
    return hits


def test_src_holds_no_pickle_eval_exec_marshal_or_shell_true():
    hits = scan(SRC)
    assert not hits, "\n".join(hits)


def test_the_source_scan_finds_what_it_forbids(tmp_path):
    (tmp_path / "bad.py").write_text("import pickle\nx = eval('1')\nexec('y=1')\nsubprocess.run('ls', shell=True)\n"
                                     "marshal.loads(b'')\nnp.load(f, allow_pickle=True)\nself.eval()\n")
    hits = scan(tmp_path)
    assert len(hits) == 6, hits  # model.eval() is a method, not the builtin
