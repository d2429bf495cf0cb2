"""Chaos and soak harness: random producer/consumer workloads while parties are SIGKILLed.

    python tools/chaos.py --iterations N [--seed S] [--soak-s SECONDS] [--json PATH]

A controller (this process) runs a real daemon process (``python -m shmtransport daemon``) and a
small pool of long-lived ``spawn`` worker processes (producers and consumers). Each iteration moves
one tensor of random size: a producer loans, writes half, writes the rest, commits with a digest
and hands the handle over; a consumer acquires, verifies the digest
(``Lease.verify``) and compares the bytes with what the seed says they must be, and releases; the
producer then releases its reference. Workers report the phase they reached over their pipe and
wait there when the controller chose that phase as the kill point; the controller then SIGKILLs the
chosen party (producer, consumer or daemon) and lets the rest go on. Kill points lie between the
client calls and, with the object table, between the steps inside its grant, publish, commit,
acquire and release sequences (``client.table.fault_point``). Killed workers are respawned
(only those), a killed daemon is restarted on the same socket with the same name prefix (its start
sweeps the dead instance's segment).

Checked after every iteration and at the end:

- every consumer that was not killed either got bytes whose digest verifies and that equal the
  expected bytes, or a typed ``ShmTransportError`` (``IdentityMismatch`` counts as a failure:
  it would mean stale or foreign bytes), within its deadline (a missed deadline is a hang);
- no consumer refuses a handle of the daemon instance it is connected to (``stale_instance_refusals``:
  bug 1 of docs/reliability.md, fixed; each one is a failure);
- no worker dies on its own and none raises anything but a ``ShmTransportError``;
- the daemon settles to 0 live objects and 0 live leases (dead sessions are reclaimed, objects a
  killed producer handed off are reclaimed when the short hand-off window passes), /dev/shm
  holds nothing of the prefix (the arena and object table are memfds: no killed instance leaves
  them behind), and the live daemon holds exactly one arena and one object table;
- at the end: the last daemon instance's VmRSS and fd count are back to its baseline (with a small
  slack), and after a clean stop no /dev/shm entry of the prefix remains.

``--soak-s`` runs the same workload without kills for that long and compares the throughput of
the first and last window (a tenth of the run, at most 60 s), RSS and leaks.
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

SPAWN = multiprocessing.get_context("spawn")

# Between the client calls, and ("t_*", see shmtransport.client.table) between the steps inside
# the object table's sequences: grant, publish, commit, acquire and release.
TABLE_PRODUCER_POINTS = ("t_after_grant", "t_after_publish", "t_before_commit", "t_after_commit", "t_after_release")
TABLE_CONSUMER_POINTS = ("t_after_acquire", "t_after_release")
PRODUCER_POINTS = ("before_loan", "after_loan", "mid_copy", "after_commit", "before_release", "after_release",
                   *TABLE_PRODUCER_POINTS)
CONSUMER_POINTS = ("before_acquire", "after_acquire", "after_verify", "after_release", *TABLE_CONSUMER_POINTS)
CONSUMER_PHASES = tuple("c_" + p for p in CONSUMER_POINTS)
POINTS = PRODUCER_POINTS + CONSUMER_PHASES
# "stall": the consumer stops (alive, lease held) at c_after_acquire until its lease outlives its
# TTL and is quarantined (a lease in the object table has no TTL: it is simply held); the producer
# puts more bytes meanwhile, which must land elsewhere: when the consumer goes on, its bytes are
# still the right ones.
PARTIES = ("producer", "consumer", "daemon", "stall", "none")
PARTY_WEIGHTS = (0.3, 0.3, 0.1, 0.02, 0.28)

CLIENT_TIMEOUT_S = 3.0
COMMAND_DEADLINE_S = 15.0  # a worker that does not answer a command within this is hung
SPAWN_DEADLINE_S = 60.0  # the machine may be busy: spawning is slow, but not a hang of ours
SETTLE_S = 5.0
FD_SLACK = 8
RSS_SLACK_KIB = 48 * 1024


# -- expected bytes --------------------------------------------------------------------------------
def expected_bytes(seed: int, nbytes: int):
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


# -- worker processes ------------------------------------------------------------------------------
def _typed(exc: BaseException) -> tuple:
    return (type(exc).__name__, getattr(getattr(exc, "reason", None), "value", ""), str(exc)[:200])


def _worker_main(conn, role: str, socket_path: str) -> None:
    """A long-lived worker: one client, commands from the controller until ``exit``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import numpy as np

    from shmtransport.client import Consumer, Handle, Producer
    from shmtransport.client import table as table_client
    from shmtransport.errors import IdentityMismatch, Reason, ShmTransportError, Unavailable

    client = None
    last_handle = None
    pausing_at: list[str | None] = [None]  # the current command's kill point, for the table's steps
    table_client.fault_point = lambda step: phase(step if role == "producer" else "c_" + step, pausing_at[0])

    def phase(name: str, pause_at: str | None) -> None:
        if name == pause_at:
            conn.send(("phase", name))
            msg = conn.recv()
            if msg != ("go",):
                raise RuntimeError(f"unexpected message at phase {name}: {msg!r}")

    def connect():
        cls = Producer if role == "producer" else Consumer
        return cls(socket_path, timeout_s=CLIENT_TIMEOUT_S, **({"alloc_wait_s": 0.5} if role == "producer" else {}))

    try:
        client = connect()
    except ShmTransportError:
        client = None  # the daemon may be restarting: connect on the first command
    conn.send(("ready", os.getpid()))
    while True:
        msg = conn.recv()
        cmd = msg[0]
        if cmd == "exit":
            break
        try:
            if client is None:
                client = connect()
            pausing_at[0] = msg[-1] if cmd in ("put", "release", "get") else None
            if cmd == "put":
                _, seed, nbytes, pause_at = msg
                data = expected_bytes(seed, nbytes)
                phase("before_loan", pause_at)
                loan = client.loan(nbytes)
                try:
                    phase("after_loan", pause_at)
                    half = nbytes // 2
                    loan.array[:half] = data[:half]
                    phase("mid_copy", pause_at)
                    loan.array[half:] = data[half:]
                    handle = loan.commit(digest=True)
                except BaseException:
                    loan.release()
                    raise
                last_handle = handle
                phase("after_commit", pause_at)
                conn.send(("handle", handle.to_bytes()))
            elif cmd == "release":
                _, pause_at = msg
                phase("before_release", pause_at)
                handle, last_handle = last_handle, None
                if handle is not None:
                    client.release(handle, wait=True)
                phase("after_release", pause_at)
                conn.send(("released",))
            elif cmd == "get":
                _, blob, seed, nbytes, pause_at = msg
                handle = Handle.from_bytes(blob)
                phase("c_before_acquire", pause_at)
                try:
                    # Both consumer paths: the handle's bytes in one native call, or the Handle.
                    lease = client.acquire_bytes(blob) if seed % 2 else client.acquire(handle)
                except Unavailable as exc:
                    # A handle of a killed instance is rightly refused; one of the instance the
                    # client reaches is the stale-instance bug, reported as such (no retry).
                    if exc.reason is Reason.INSTANCE_MISMATCH and _reaches(client, handle.shm.instance_id):
                        conn.send(("stale_instance", _typed(exc)))
                        continue
                    raise
                verified = False
                try:
                    phase("c_after_acquire", pause_at)
                    lease.verify()
                    if not np.array_equal(lease.array, expected_bytes(seed, nbytes)):
                        client.release([lease])
                        conn.send(("silent_foreign", ("-", "-", "digest verified but the bytes differ")))
                        continue
                    verified = True
                    phase("c_after_verify", pause_at)
                    client.release([lease], wait=True)
                    phase("c_after_release", pause_at)
                except ShmTransportError as exc:
                    try:
                        client.release([lease])
                    except ShmTransportError:
                        pass
                    if verified:  # the bytes were right; only the release failed (daemon gone)
                        conn.send(("ok_release_failed", _typed(exc)))
                        continue
                    raise
                conn.send(("ok",))
            elif cmd == "stat":
                s = client.stat()
                conn.send(("stat", s.live_objects, s.live_leases, s.quarantined_leases, s.table_objects))
            else:
                raise RuntimeError(f"unknown command {cmd!r}")
        except ShmTransportError as exc:
            if isinstance(exc, IdentityMismatch):
                conn.send(("foreign", _typed(exc)))
            else:
                conn.send(("error", _typed(exc)))
        except Exception as exc:  # noqa: BLE001 - an untyped error is a failure the controller reports
            conn.send(("crash", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-2000:]))
    if client is not None:
        try:
            client.close()
        except ShmTransportError:
            pass


def _reaches(client, instance_id: str) -> bool:
    """Whether ``client``, reconnected if need be, is on daemon instance ``instance_id``."""
    from shmtransport.errors import ShmTransportError

    try:
        client.stat()  # any call reconnects
    except ShmTransportError:
        return False
    return client.instance_id == instance_id


class Worker:
    """Controller side of one worker process."""

    def __init__(self, role: str, socket_path: str):
        self.role = role
        self.conn, child = SPAWN.Pipe(duplex=True)
        self.process = SPAWN.Process(target=_worker_main, args=(child, role, socket_path), daemon=True)
        self.process.start()
        child.close()
        self.ready = False

    def wait_ready(self) -> None:
        if not self.ready:
            msg = self.recv(SPAWN_DEADLINE_S)
            if msg[0] != "ready":
                raise RuntimeError(f"{self.role} worker sent {msg!r} instead of ready")
            self.ready = True

    def send(self, msg: tuple) -> None:
        self.conn.send(msg)

    def recv(self, timeout_s: float) -> tuple:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.role} worker {self.process.pid} did not answer within {timeout_s} s")
        try:
            return self.conn.recv()
        except EOFError:
            self.process.join(2)
            raise ChildDied(f"{self.role} worker {self.process.pid} died (exit code {self.process.exitcode})") from None

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)
        self.conn.close()

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("exit",))
            except OSError:
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.kill()
        self.conn.close()


class ChildDied(RuntimeError):
    pass


# -- the daemon process ----------------------------------------------------------------------------
class DaemonProcess:
    def __init__(self, socket_path: str, prefix: str, arena: str, lease_ttl_ms: int, log_path: str,
                 extra_args: tuple[str, ...] = (), argv_prefix: tuple[str, ...] = (), handoff_window_ms: int = 1000):
        """``extra_args``: more CLI options (e.g. ``--quota-leases``); ``argv_prefix``: a wrapper
        command (e.g. ``prlimit --nofile=64:64 --``)."""
        self.extra_args = tuple(extra_args)
        self.argv_prefix = tuple(argv_prefix)
        self.socket_path = socket_path
        self.prefix = prefix
        self.arena = arena
        self.lease_ttl_ms = lease_ttl_ms
        # Short, so an object handed off by a killed producer (nobody acquires it: the iteration
        # moved on) is reclaimed well within the settle check.
        self.handoff_window_ms = handoff_window_ms
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        """Start without waiting for readiness (``wait_ready``): overlaps with the iteration."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.argv_prefix, sys.executable, "-m", "shmtransport", "daemon", "--socket", self.socket_path,
                 "--arena-size", self.arena, "--name-prefix", self.prefix,
                 "--lease-ttl-ms", str(self.lease_ttl_ms), "--handoff-window-ms", str(self.handoff_window_ms),
                 "--log-level", "WARNING", *self.extra_args],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
            )
        self.starts += 1
        self._ready = False

    def wait_ready(self, timeout_s: float = SPAWN_DEADLINE_S) -> None:
        if self._ready:
            return
        deadline = time.monotonic() + timeout_s
        line = b""
        while b"ready" not in line:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"daemon did not become ready within {timeout_s} s")
            r, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if r:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"daemon exited at start (code {self.proc.wait(5)}); see {self.log_path}")
        self._ready = True

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self.proc.stdout.close()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc.stdout.close()
        return self.proc.returncode

    def rss_kib(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def sealed_segment_kinds(self) -> list[str]:
        """The kinds (arena, objects) of the memfds this daemon process holds (a mapping keeps an fd
        of its own, so a kind may be held twice)."""
        kinds = set()
        for fd in os.listdir(f"/proc/{self.pid}/fd"):
            try:
                target = os.readlink(f"/proc/{self.pid}/fd/{fd}")
            except FileNotFoundError:
                continue
            if target.startswith(f"/memfd:{self.prefix}-"):
                kinds.add(target.removesuffix(" (deleted)").rsplit("-", 1)[-1])
        return sorted(kinds)


def shm_segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix + "-"))


# -- the controller --------------------------------------------------------------------------------
class Chaos:
    def __init__(self, seed: int, producers: int = 2, consumers: int = 2, arena: str = "8M",
                 lease_ttl_ms: int = 1000, max_nbytes: int = 256 << 10, kills: bool = True):
        self.rng = random.Random(seed)
        self.lease_ttl_ms = lease_ttl_ms
        self.seed = seed
        self.kills_enabled = kills
        self.max_nbytes = max_nbytes
        self.tmp = tempfile.mkdtemp(prefix="shmtc", dir="/tmp")
        self.socket_path = os.path.join(self.tmp, "d.sock")
        self.prefix = "shmtchaos" + os.urandom(3).hex()
        self.daemon = DaemonProcess(self.socket_path, self.prefix, arena, lease_ttl_ms,
                                    os.path.join(self.tmp, "daemon.log"))
        self.n_producers, self.n_consumers = producers, consumers
        self.workers: dict[str, list[Worker]] = {"producer": [], "consumer": []}
        self.kills = collections.Counter()  # (party, point) -> n
        self.outcomes = collections.Counter()
        self.failures: list[str] = []
        self.respawns = 0
        self.stale_instance_refusals = 0
        self.iterations = 0
        self.transferred_nbytes = 0
        self.baseline: dict[str, Any] | None = None
        self.instance_iterations = 0
        self.max_growth = {"fds": 0, "rss_kib": 0}

    # lifecycle
    def start(self) -> None:
        self.daemon.start()
        self.daemon.wait_ready()
        for role, n in (("producer", self.n_producers), ("consumer", self.n_consumers)):
            self.workers[role] = [Worker(role, self.socket_path) for _ in range(n)]
        for ws in self.workers.values():
            for w in ws:
                w.wait_ready()

    def close(self) -> dict:
        for ws in self.workers.values():
            for w in ws:
                w.stop()
        code = self.daemon.stop()
        left = shm_segments(self.prefix)
        if left:
            self.failures.append(f"/dev/shm entries left after a clean daemon stop: {left}")
            for name in left:
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except FileNotFoundError:
                    pass
        if code not in (0, -signal.SIGTERM):
            self.failures.append(f"daemon exited with {code} on SIGTERM")
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)
        return self.report()

    def __enter__(self) -> "Chaos":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # helpers
    def _fail(self, text: str) -> None:
        self.failures.append(f"iteration {self.iterations} (seed {self.seed}): {text}")

    def _respawn(self, role: str, index: int) -> None:
        self.workers[role][index] = Worker(role, self.socket_path)
        self.respawns += 1

    def _kill(self, party: str, p_idx: int, c_idx: int) -> None:
        if party == "producer":
            self.workers["producer"][p_idx].kill()
            self._respawn("producer", p_idx)
        elif party == "consumer":
            self.workers["consumer"][c_idx].kill()
            self._respawn("consumer", c_idx)
        elif party == "daemon":
            self.daemon.kill()
            self.daemon.start()  # restart at once; clients meanwhile get typed errors
            self.baseline = None
            self.instance_iterations = 0

    def _run(self, worker: Worker, msg: tuple, pause_at: str | None, party: str, p_idx: int, c_idx: int,
             killed: list) -> tuple | None:
        """Send a command; kill ``party`` when the worker reports ``pause_at``; its final answer,
        or None when the worker itself was the one killed."""
        worker.wait_ready()
        worker.send(msg)
        while True:
            try:
                answer = worker.recv(COMMAND_DEADLINE_S)
            except TimeoutError as exc:
                self._fail(f"hang: {exc} (command {msg[0]})")
                worker.kill()
                self._respawn(worker.role, p_idx if worker.role == "producer" else c_idx)
                return None
            except ChildDied as exc:
                self._fail(f"worker died without being killed: {exc}")
                self._respawn(worker.role, p_idx if worker.role == "producer" else c_idx)
                return None
            if answer[0] != "phase":
                return answer
            self.kills[(party, answer[1])] += 1
            killed.append(party)
            if party == "stall":
                self._stall(p_idx, c_idx)
                worker.send(("go",))
                continue
            self._kill(party, p_idx, c_idx)
            if party == worker.role:
                return None
            worker.send(("go",))

    def iteration(self, party: str | None = None, point: str | None = None) -> None:
        self.iterations += 1
        self.instance_iterations += 1
        rng = self.rng
        if party is None:
            party = rng.choices(PARTIES, PARTY_WEIGHTS)[0] if self.kills_enabled else "none"
        if point is None:
            point = rng.choice(POINTS)
        if party == "stall":
            point = "c_after_acquire"
        pause_at = None if party == "none" else point
        p_idx = rng.randrange(self.n_producers)
        c_idx = rng.randrange(self.n_consumers)
        nbytes = rng.choice((1, 4096, rng.randrange(1, self.max_nbytes)))
        if party == "stall":
            nbytes = max(nbytes, 4096)  # large enough that reused bytes differ
        seed = rng.randrange(1 << 31)
        self._nbytes = nbytes
        killed: list = []
        producer = self.workers["producer"][p_idx]
        answer = self._run(producer, ("put", seed, nbytes, pause_at), pause_at, party, p_idx, c_idx, killed)
        self._note("put", answer)
        if answer is not None and answer[0] == "handle":
            consumer = self.workers["consumer"][c_idx]
            got = self._run(consumer, ("get", answer[1], seed, nbytes, pause_at), pause_at, party, p_idx, c_idx,
                            killed)
            self._note("get", got)
            if got is not None and got[0] in ("ok", "ok_release_failed"):
                self.transferred_nbytes += nbytes
            elif not killed:
                self._undelivered(got)
            producer = self.workers["producer"][p_idx]
            if producer.process.is_alive() and "producer" not in killed:
                rel = self._run(producer, ("release", pause_at), pause_at, party, p_idx, c_idx, killed)
                self._note("release", rel)
                if not killed and (rel is None or rel[0] != "released"):
                    self._fail(f"nothing was killed, yet the producer's release failed: {rel!r}")
        elif not killed:
            self._undelivered(answer)
        if not killed:
            self.outcomes["unkilled_iterations"] += 1
        self._check_settled()

    def _undelivered(self, answer: tuple | None) -> None:
        """Nothing was killed in this iteration, yet the tensor did not arrive."""
        self._fail(f"nothing was killed, yet the tensor was not delivered: {answer!r}")

    def _note(self, step: str, answer: tuple | None) -> None:
        if answer is None:
            self.outcomes[f"{step}:killed_or_hung"] += 1
            return
        kind = answer[0]
        if kind in ("error", "ok_release_failed"):
            self.outcomes[f"{step}:{kind}:{answer[1][0]}/{answer[1][1]}"] += 1
        else:
            self.outcomes[f"{step}:{kind}"] += 1
        if kind == "crash":
            self._fail(f"{step}: untyped exception in the worker:\n{answer[1]}")
        elif kind == "foreign":
            self._fail(f"{step}: stale or foreign bytes: {answer[1]}")
        elif kind == "silent_foreign":
            self._fail(f"{step}: foreign bytes passed verification: {answer[1]}")
        elif kind == "stale_instance":
            self.stale_instance_refusals += 1
            self._fail(f"{step}: a handle of the daemon instance the consumer is connected to was refused: "
                       f"{answer[1]}")

    def _stall(self, p_idx: int, c_idx: int) -> None:
        """The consumer waits (alive, its lease held) at c_after_acquire: the producer releases, the
        lease must outlive its TTL and be quarantined (the object stays), then the same producer
        puts other bytes of the same size (which must not reuse the quarantined range) and
        releases them."""
        producer = self.workers["producer"][p_idx]
        answer = self._run(producer, ("release", None), None, "none", p_idx, c_idx, [])
        if answer is None or answer[0] != "released":
            self._fail(f"stall: the producer's release failed: {answer!r}")
            return
        other = (c_idx + 1) % self.n_consumers
        deadline = time.monotonic() + self.lease_ttl_ms / 1000 + SETTLE_S
        state = None
        while time.monotonic() < deadline:
            state = self._daemon_state(other, quarantined=True)
            # (objects, leases, quarantined, in the table): a table lease has no TTL, it is held
            if state in ((1, 1, 1, 0), (1, 1, 0, 1)):
                break
            time.sleep(0.05)
        if state not in ((1, 1, 1, 0), (1, 1, 0, 1)):
            self._fail(f"stall: the stalled consumer's lease was neither quarantined after its TTL "
                       f"({self.lease_ttl_ms} ms) nor held in the object table: "
                       f"(objects, leases, quarantined, in the table) = {state}")
            return
        self.outcomes["stall:lease_quarantined" if state[2] else "stall:lease_held_in_table"] += 1
        for _ in range(2):  # the first put may land elsewhere if the arena is fragmented
            answer = self._run(producer, ("put", self.rng.randrange(1 << 31), self._nbytes, None), None, "none",
                               p_idx, c_idx, [])
            self._run(producer, ("release", None), None, "none", p_idx, c_idx, [])

    def _daemon_state(self, index: int = 0, quarantined: bool = False) -> tuple[int, ...] | None:
        """(live objects, live leases[, quarantined leases]) through a consumer worker's Stat (None
        if unreachable)."""
        worker = self.workers["consumer"][index]
        worker.wait_ready()
        worker.send(("stat",))
        try:
            answer = worker.recv(COMMAND_DEADLINE_S)
        except (TimeoutError, ChildDied) as exc:
            self._fail(f"stat: {exc}")
            worker.kill()
            self._respawn("consumer", index)
            return None
        if answer[0] != "stat":
            return None
        return tuple(answer[1:5] if quarantined else answer[1:3])

    def _check_settled(self) -> None:
        self.daemon.wait_ready()
        deadline = time.monotonic() + SETTLE_S
        state = None
        while time.monotonic() < deadline:
            state = self._daemon_state()
            if state == (0, 0):
                break
            time.sleep(0.05)
        if state != (0, 0):
            self._fail(f"daemon did not settle to 0 objects / 0 leases within {SETTLE_S} s: {state}")
        segs = shm_segments(self.prefix)
        if segs:
            self._fail(f"/dev/shm holds {segs} for prefix {self.prefix} (expected nothing: arenas are memfds)")
        kinds = self.daemon.sealed_segment_kinds()
        if kinds not in (["arena"], ["arena", "holds", "objects"]):
            self._fail(f"the live daemon holds the memfds {kinds} (expected its arena and object table)")
        # resource baseline of this daemon instance, taken once it is warm
        if self.instance_iterations == 5 and self.baseline is None:
            self.baseline = {"fds": self.daemon.fds(), "rss_kib": self.daemon.rss_kib(), "pid": self.daemon.pid}
        elif self.baseline is not None:
            self.max_growth["fds"] = max(self.max_growth["fds"], self.daemon.fds() - self.baseline["fds"])
            self.max_growth["rss_kib"] = max(self.max_growth["rss_kib"],
                                             self.daemon.rss_kib() - self.baseline["rss_kib"])

    def final_check(self) -> dict:
        """All workers connected, the daemon settled: fds and RSS back to this instance's baseline."""
        for ws in self.workers.values():
            for w in ws:
                w.wait_ready()
        self._check_settled()
        out = {"daemon_pid": self.daemon.pid, "fds": self.daemon.fds(), "rss_kib": self.daemon.rss_kib(),
               "baseline": self.baseline}
        if self.baseline is not None:
            # fds: the workers' sessions and channels settle asynchronously after a respawn
            deadline = time.monotonic() + SETTLE_S
            while self.daemon.fds() - self.baseline["fds"] > FD_SLACK and time.monotonic() < deadline:
                time.sleep(0.1)
            out["fds"] = self.daemon.fds()
            if out["fds"] - self.baseline["fds"] > FD_SLACK:
                self._fail(f"daemon fds grew from {self.baseline['fds']} to {out['fds']}")
            if out["rss_kib"] - self.baseline["rss_kib"] > RSS_SLACK_KIB:
                self._fail(f"daemon VmRSS grew from {self.baseline['rss_kib']} KiB to {out['rss_kib']} KiB")
        self.final = out
        return out

    def report(self) -> dict:
        kills = collections.defaultdict(dict)
        for (party, point), n in sorted(self.kills.items()):
            kills[party][point] = n
        return {
            "seed": self.seed,
            "iterations": self.iterations,
            "kills_total": sum(self.kills.values()),
            "kills": dict(kills),
            "worker_respawns": self.respawns,
            "stale_instance_refusals": self.stale_instance_refusals,
            "daemon_starts": self.daemon.starts,
            "outcomes": dict(sorted(self.outcomes.items())),
            "transferred_nbytes": self.transferred_nbytes,
            "final": getattr(self, "final", None),
            "max_growth_during_run": self.max_growth,
            "failures": self.failures,
        }


def run_chaos(iterations: int, seed: int = 0, **kwargs) -> dict:
    """``iterations`` random iterations with kills; the report (``failures`` empty when all held)."""
    t0 = time.monotonic()
    chaos = Chaos(seed, **kwargs)
    with chaos:
        for _ in range(iterations):
            chaos.iteration()
        chaos.final_check()
    report = chaos.report()
    report["duration_s"] = round(time.monotonic() - t0, 2)
    return report


def run_soak(soak_s: float, seed: int = 0, **kwargs) -> dict:
    """Mixed load without kills for ``soak_s``: throughput per window, daemon RSS, leaks."""
    window_s = min(60.0, soak_s / 10)
    chaos = Chaos(seed, kills=False, **kwargs)
    windows: list[dict] = []
    rss: list[int] = []
    t0 = time.monotonic()
    with chaos:
        start, n0, b0 = time.monotonic(), 0, 0
        while time.monotonic() - t0 < soak_s:
            chaos.iteration()
            now = time.monotonic()
            if now - start >= window_s:
                n, b = chaos.iterations, chaos.transferred_nbytes
                windows.append({"t_s": round(now - t0, 1), "transfers_per_s": round((n - n0) / (now - start), 1),
                                "mb_per_s": round((b - b0) / (now - start) / 1e6, 2)})
                rss.append(chaos.daemon.rss_kib())
                start, n0, b0 = now, n, b
        chaos.final_check()
    report = chaos.report()
    report["duration_s"] = round(time.monotonic() - t0, 2)
    report["windows"] = windows
    report["daemon_rss_kib"] = rss
    if len(windows) >= 2:
        first, last = windows[0]["transfers_per_s"], windows[-1]["transfers_per_s"]
        report["last_over_first_throughput"] = round(last / first, 3) if first else None
        if first and abs(last / first - 1) > 0.10:
            report["failures"].append(f"throughput of the last window {last}/s is not within 10 % of the first "
                                      f"{first}/s")
        if rss and rss[-1] - rss[0] > RSS_SLACK_KIB:
            report["failures"].append(f"daemon RSS grew from {rss[0]} KiB to {rss[-1]} KiB during the soak")
    return report


def _print_report(report: dict) -> None:
    print(f"iterations {report['iterations']}  kills {report['kills_total']}  respawns {report['worker_respawns']}  "
          f"daemon starts {report['daemon_starts']}  {report.get('duration_s')} s")
    for party, points in report["kills"].items():
        print(f"  kills of {party:9s} " + "  ".join(f"{p}={n}" for p, n in points.items()))
    for name, n in report["outcomes"].items():
        print(f"  {name:60s} {n}")
    if "windows" in report:
        for w in report["windows"]:
            print(f"  window @{w['t_s']:>7}s  {w['transfers_per_s']:8.1f} transfers/s  {w['mb_per_s']:8.2f} MB/s")
        print(f"  last/first throughput {report.get('last_over_first_throughput')}  rss {report['daemon_rss_kib']}")
    print(f"  final {report['final']}  max growth {report['max_growth_during_run']}")
    print("FAILURES:\n  " + "\n  ".join(report["failures"]) if report["failures"] else "no failures")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/chaos.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--soak-s", type=float, default=None, help="run a soak (no kills) for this many seconds")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    if args.soak_s:
        report = run_soak(args.soak_s, seed)
    else:
        report = run_chaos(args.iterations, seed)
    _print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
