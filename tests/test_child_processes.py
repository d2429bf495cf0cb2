"""Children started through ``worker.process.die_with_parent`` (the daemon, workers and engines that
tests, benchmarks and the demo start): they end when their parent dies, and starting them from a
process that uses gRPC never aborts them."""
from __future__ import annotations

import concurrent.futures
import os
import select
import subprocess
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shmtransport.testing import remove_tree, short_tmpdir
from shmtransport.worker.process import die_with_parent

TIMEOUT_S = 30.0

# The parent starts the guarded child, which says it runs (so its parent-death signal is armed),
# then both wait; the child notes a SIGTERM in the file named by argv[1] before it exits.
CHILD = """import os, signal, sys, time
def note(*_):
    with open(sys.argv[1], "w") as f:
        f.write("TERM")
    os._exit(0)
signal.signal(signal.SIGTERM, note)
print(os.getpid(), flush=True)
time.sleep(60)
"""
PARENT = """import subprocess, sys, time
from shmtransport.worker.process import die_with_parent
subprocess.Popen(die_with_parent([sys.executable, "-c", sys.argv[1], sys.argv[2]]))
time.sleep(60)
"""


def test_a_child_gets_sigterm_when_its_parent_is_killed():
    tmp = short_tmpdir("shmtchild")
    note = os.path.join(tmp, "note")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, note], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        ready, _, _ = select.select([parent.stdout], [], [], TIMEOUT_S)
        assert ready, "the child never started"
        child_fd = os.pidfd_open(int(parent.stdout.readline()))
        parent.kill()
        parent.wait(TIMEOUT_S)
        ended, _, _ = select.select([child_fd], [], [], TIMEOUT_S)
        os.close(child_fd)
        assert ended, "the child outlived its killed parent"
        with open(note) as f:
            assert f.read() == "TERM"
    finally:
        parent.kill()
        parent.wait(TIMEOUT_S)
        parent.stdout.close()
        remove_tree(tmp)


def test_children_started_from_a_process_using_grpc_never_abort():
    """With a ``preexec_fn`` the parent forks and gRPC's fork handlers restart its poller in the
    child, which then aborted about once in fifty starts (epoll_wait: Bad file descriptor)."""
    tmp = short_tmpdir("shmtchild")
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    address = f"unix:{os.path.join(tmp, 'health.sock')}"
    assert server.add_insecure_port(address)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            failures = []
            for _ in range(200):
                stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
                run = subprocess.run(die_with_parent(["/bin/true"]), capture_output=True, text=True,
                                     timeout=TIMEOUT_S)
                if run.returncode != 0:
                    failures.append((run.returncode, run.stderr[-300:]))
            assert not failures, failures
    finally:
        server.stop(None).wait(TIMEOUT_S)
        remove_tree(tmp)
