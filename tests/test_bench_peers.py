"""The transport benchmark's peers: every correctness flag is computed from the bytes received, so
it can fail, and the harness leaves no processes, file descriptors or /dev/shm segments behind."""
from __future__ import annotations

import importlib.util
import multiprocessing
import os
import pathlib
import sys
import tempfile
from multiprocessing import resource_tracker

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from peers import ALTERNATIVE_PEERS, BASELINE_PEERS, OURS_PEERS, _ours
from peers.common import PeerError, Session, digest_of, seeded_payload
from peers.ray_put import _alive, _tree

from shmtransport.testing import run_in_child

NBYTES = 64 << 10
# stbench_: segment_pread, dynamo_segment, iceoryx2; psm_: multiprocessing.shared_memory (both
# peers); torch_
OUR_PREFIXES = ("stbench_", "psm_", "torch_")


def _our_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(OUR_PREFIXES)}


def _needs(peer: str) -> None:
    """Found, not imported: importing ray here would load it into the test process for good."""
    package = ALTERNATIVE_PEERS[peer]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{peer}: {package} is not installed (the peers extra)")


def _open_fds() -> dict[int, str]:
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return fds


@pytest.fixture(scope="module", autouse=True)
def no_leftovers():
    resource_tracker.ensure_running()  # the first spawn starts it (one pipe for the process's life)
    segments, fds = _our_segments(), _open_fds()
    yield
    leaked = _our_segments() - segments
    children = multiprocessing.active_children()
    new_fds = {fd: target for fd, target in _open_fds().items() if fds.get(fd) != target}
    assert not leaked, f"/dev/shm leftovers: {sorted(leaked)}"
    assert not children, f"leaked child processes: {children}"
    assert not new_fds, f"file descriptors left open: {new_fds}"


@pytest.fixture
def daemon_process():
    why_not = _ours.import_error()
    if why_not is not None:
        pytest.skip(f"shmtransport client/daemon not importable: {why_not}")
    workdir = tempfile.mkdtemp(prefix="stb-test-")
    with _ours.DaemonProcess(os.path.join(workdir, "d.sock"), 32 * NBYTES) as daemon:
        yield daemon
    os.rmdir(workdir)


@pytest.fixture
def daemon_socket(daemon_process):
    return daemon_process.socket_path


def _check_flags(session: Session) -> list[bool]:
    return [ok for _, ok in _check_rounds(session)]


def _check_rounds(session: Session) -> list[tuple[float, bool]]:
    payload = seeded_payload(NBYTES, seed=7)
    session.prepare(NBYTES, digest_of(payload))
    return [session.iteration(payload, corrupt) for corrupt in (None, "sender", "receiver", None)]


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


@pytest.mark.timeout(30)
def test_iceoryx2_peer_flag_is_true_when_clean_and_false_when_a_byte_is_flipped():
    _needs("iceoryx2_loan")
    with Session("iceoryx2_loan", max_nbytes=NBYTES) as session:
        rounds = _check_rounds(session)
        usage = session.usage.take(NBYTES)
    from peers._iceoryx2 import remove_management_file

    remove_management_file()  # both processes are gone: nothing of iceoryx2's may stay in /dev/shm
    assert [ok for _, ok in rounds] == [True, False, False, True]
    assert all(seconds > 0 for seconds, _ in rounds)
    assert set(usage["cpu_s_per_gb"]) == {"producer", "consumer"}


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("peer", ["shm_floor", "shm_loan", "iceoryx2_loan"])
def test_a_consumer_receiving_in_its_main_thread_checks_the_bytes_and_runs_no_listener_thread(peer, request):
    options: dict = {}
    if peer == "iceoryx2_loan":
        _needs(peer)
        options = {"max_nbytes": NBYTES}
    elif peer in OURS_PEERS:
        options = {"socket_path": request.getfixturevalue("daemon_socket")}
    with Session(peer, main_thread=True, **options) as session, Session(peer, **options) as listening:
        assert session.name == f"{peer}:main"
        assert _check_flags(session) == [True, False, False, True]
        assert _check_flags(listening) == [True, False, False, True]
        # the listener shape runs a listener thread (the harness's; iceoryx2's own too) that the
        # main-thread shape does not
        assert _threads(listening.consumer_pid) > _threads(session.consumer_pid)
    if peer == "iceoryx2_loan":
        from peers._iceoryx2 import remove_management_file

        remove_management_file()


def _ray_rounds() -> dict:
    """In a child: Ray's driver keeps event-loop fds and log files open after ``ray.shutdown``, which
    the fd check would count against this process."""
    with Session("ray_put", max_nbytes=NBYTES) as session:
        rounds = _check_rounds(session)
        usage = session.usage.take(NBYTES)
        cluster = sorted(_tree(session.producer.roots))
        pids = dict(session.producer.pids)
    return {"rounds": rounds, "roles": sorted(usage["cpu_s_per_gb"]), "pids": pids, "cluster": cluster,
            "alive": [p for p in cluster if _alive(p)]}


@pytest.mark.timeout(60)
def test_ray_peer_flag_is_true_when_clean_and_false_when_a_byte_is_flipped_and_its_cluster_stops():
    _needs("ray_put")
    token = pathlib.Path.home() / ".ray" / "auth_token"
    had_token = token.exists()
    got = run_in_child(_ray_rounds, timeout_s=50)
    assert [ok for _, ok in got["rounds"]] == [True, False, False, True]
    assert all(seconds > 0 for seconds, _ in got["rounds"])
    assert got["roles"] == ["consumer", "daemon", "producer"]  # the actor and the raylet are counted
    assert got["pids"]["consumer"] in got["cluster"] and got["pids"]["daemon"] in got["cluster"]
    assert got["alive"] == []
    assert not [p for p in got["cluster"] if _alive(p)]
    assert token.exists() == had_token  # the per-run token lives in the environment


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


def test_vllm_peer_encodes_the_same_bytes_as_our_kwargs_msgpack():
    from peers.vllm_msgpack_inline import encode

    from shmtransport.protocol.msgpack_kwargs import encode_kwargs_item

    payload = seeded_payload(4099, seed=3)
    assert encode(payload) == encode_kwargs_item({"pixel_values": payload})


@pytest.mark.timeout(60)
def test_usage_counts_cpu_and_peak_rss_of_each_process_in_the_timed_span(daemon_process):
    payload = seeded_payload(4 << 20, seed=5)
    with Session("mp_shared_memory") as peer:
        peer.prepare(payload.nbytes, digest_of(payload))
        for _ in range(3):
            peer.iteration(payload)
        usage = peer.usage.take(payload.nbytes)
    assert set(usage["cpu_s_per_gb"]) == {"producer", "consumer"}
    assert all(v > 0 for v in usage["cpu_s_per_gb"].values())
    assert usage["rss_growth_mb"]["consumer"] >= 4.0  # a fresh mapping plus the copy out: >= 4 MiB each span
    assert peer.usage.spans == 0  # take resets
    small = payload[: 16 * NBYTES]
    with Session("shm_put_hash", socket_path=daemon_process.socket_path, daemon_pid=daemon_process.pid) as ours:
        ours.prepare(small.nbytes, digest_of(small))
        ours.iteration(small)
        usage = ours.usage.take(small.nbytes)
    assert set(usage["cpu_ms_per_op"]) == {"producer", "consumer", "daemon"}
    assert usage["peak_rss_mb"]["daemon"] > 0
