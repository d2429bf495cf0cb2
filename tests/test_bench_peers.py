"""The transport benchmark's peers: every correctness flag is computed from the bytes received, so
it can fail, and the harness leaves no processes or /dev/shm segments behind."""
from __future__ import annotations

import multiprocessing
import os
import pathlib
import sys
import tempfile

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from peers import BASELINE_PEERS, OURS_PEERS, _ours  # noqa: E402
from peers.common import PeerError, Session, digest_of, seeded_payload  # noqa: E402

NBYTES = 64 << 10
OUR_PREFIXES = ("stbench_", "psm_", "torch_")  # segment_pread, multiprocessing.shared_memory, torch


def _our_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(OUR_PREFIXES)}


@pytest.fixture(scope="module", autouse=True)
def no_leftovers():
    before = _our_segments()
    yield
    leaked = _our_segments() - before
    children = multiprocessing.active_children()
    assert not leaked, f"/dev/shm leftovers: {sorted(leaked)}"
    assert not children, f"leaked child processes: {children}"


@pytest.fixture
def daemon_socket():
    why_not = _ours.import_error()
    if why_not is not None:
        pytest.skip(f"shmtransport client/daemon not importable: {why_not}")
    workdir = tempfile.mkdtemp(prefix="stb-test-")
    with _ours.DaemonProcess(os.path.join(workdir, "d.sock"), 32 * NBYTES) as daemon:
        yield daemon.socket_path
    os.rmdir(workdir)


def _check_flags(session: Session) -> list[bool]:
    payload = seeded_payload(NBYTES, seed=7)
    session.prepare(NBYTES, digest_of(payload))
    return [session.iteration(payload, corrupt)[1] for corrupt in (None, "sender", "receiver", None)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("peer", BASELINE_PEERS)
def test_baseline_peer_flag_is_true_when_clean_and_false_when_a_byte_is_flipped(peer):
    with Session(peer) as session:
        assert _check_flags(session) == [True, False, False, True]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("peer", OURS_PEERS)
def test_shmtransport_peer_flag_is_true_when_clean_and_false_when_a_byte_is_flipped(peer, daemon_socket):
    with Session(peer, socket_path=daemon_socket) as session:
        assert _check_flags(session) == [True, False, False, True]


@pytest.mark.timeout(60)
def test_consumer_exception_comes_back_to_the_producer_with_its_traceback():
    with Session("segment_pread") as session:
        session.prepare(NBYTES, 0)
        with pytest.raises(PeerError, match="refusing segment name"):
            session.producer.chan.handoff(("../not-ours", NBYTES))
        session.proc.join(10.0)
        assert not session.proc.is_alive()


@pytest.mark.timeout(60)
def test_lifecycle_pairs_report_a_rate_and_a_true_flag(daemon_socket):
    from peers.lifecycle import run_lifecycles

    result = run_lifecycles(daemon_socket, pairs=2, tensors=4, nbytes=NBYTES, duration_s=0.3)
    assert result["correct"] is True
    assert result["lifecycles_per_s"] > 0
    assert len(result["samples"]) >= 2
