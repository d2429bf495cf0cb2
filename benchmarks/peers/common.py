"""The process harness shared by every transport peer.

One timed iteration (``Session.iteration``) = the producer starts the handoff -> the consumer has the
bytes (or a view) -> the consumer acks -> the producer has the ack. Outside that span the consumer
hashes what it actually got (xxh3_64 of the whole payload against the digest sent at setup) and
reports a flag; only then do both sides drop their references (unlink / release).

Wire between the halves: one duplex ``multiprocessing.Pipe`` per peer for control, carrying small
tuples:

    producer -> consumer   ("setup", nbytes, digest)  ("xfer", descriptor)  ("check", corrupt)  ("stop",)
    consumer -> producer   ("ready", pid)  ("ok",)  ("ack",)  ("flag", bool)  ("bye",)  ("error", traceback)

and one ``SOCK_SEQPACKET`` socket pair for the timed hop of descriptor-passing peers
(``Channel.handoff``): the pickled descriptor one way, one byte of ack back. That is the cheapest
channel a user could pick (a ~20 us round trip here against ~130 us for the control pipe's pickling
and polling): a descriptor peer's row measures the transport, not this harness. The consumer takes
the handoff in one of two shapes (``Session(main_thread=)``):

- a listener thread that waits in ``recv`` while the main thread serves the control pipe: the shape
  of the channel iceoryx2 brings with it (its event service, a listener thread);
- its main thread, blocked on the handoff and the control pipe at once (``select``; iceoryx2: its
  event listener, which the producer also notifies after each control message): no second thread,
  no polling, as a single-threaded worker loop receives. Rows of this shape are named ``<peer>:main``.

Peers whose data travels on another channel (gRPC, a torch queue) hand the received object over via
``Consumer.take``. Every blocking wait has a timeout; a consumer exception comes back as
``("error", traceback)`` (or an ``ERROR`` packet on the socket) and is re-raised in the producer as
``PeerError``.

Resource use per timed span (``Session.usage``): CPU seconds of each process involved (producer = this
process, consumer, and shmtransport's daemon when there is one) from the kernel's per-process CPU
clock, and each process's peak RSS within the span (VmHWM, reset before the span through
``/proc/<pid>/clear_refs``). RSS counts shared-memory pages a process has mapped and touched.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import select
import shutil
import socket
import tempfile
import threading
import time
import traceback
from typing import Any

import numpy as np
import xxhash

CTX = mp.get_context("spawn")
START_TIMEOUT_S = 90.0  # child interpreter start + imports (torch is slow on 2 cores)
REPLY_TIMEOUT_S = 120.0  # one 256 MiB gRPC-inline transfer is ~1 s; leave a wide margin
JOIN_TIMEOUT_S = 10.0
IDLE_POLL_S = 1.0  # consumer wakes this often to notice a dead parent
IDLE_LIMIT_S = 900.0  # a consumer that hears nothing for this long exits

CORRUPT_MODES = (None, "sender", "receiver")


ROLES = ("producer", "consumer", "daemon")
MAIN_THREAD_SUFFIX = ":main"  # the row name of a peer whose consumer receives in its main thread


class PeerError(RuntimeError):
    """A consumer child failed; the message carries its traceback."""


def digest_of(data: Any) -> int:
    return xxhash.xxh3_64_intdigest(as_u8(data))


def as_u8(data: Any) -> np.ndarray:
    """A flat uint8 view of any contiguous buffer (bytes, bytearray, memoryview, ndarray)."""
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def corrupted(data: Any) -> np.ndarray:
    """A copy of ``data`` with one byte flipped (an empty buffer becomes one byte) — the test hook."""
    arr = as_u8(data)
    if arr.size == 0:
        return np.ones(1, dtype=np.uint8)
    out = arr.copy()
    out[out.size // 2] ^= 0xFF
    return out


def verify(data: Any, digest: int, corrupt: bool = False) -> bool:
    arr = as_u8(data)
    if corrupt:
        arr = corrupted(arr)
    return xxhash.xxh3_64_intdigest(arr) == digest


def seeded_payload(nbytes: int, seed: int = 0) -> np.ndarray:
    """A writable, seeded uint8 array of ``nbytes``."""
    rng = np.random.default_rng(seed + nbytes)
    return np.frombuffer(bytearray(rng.bytes(nbytes)), dtype=np.uint8)


def wait_reply(conn, timeout_s: float, who: str):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"{who}: no reply within {timeout_s:.0f} s")
    try:
        msg = conn.recv()
    except EOFError:
        raise PeerError(f"{who}: child exited without replying") from None
    if msg[0] == "error":
        raise PeerError(f"{who} child failed:\n{msg[1]}")
    return msg


HANDOFF_ACK = b"a"
HANDOFF_ERROR = b"e"  # followed by the consumer's traceback
MAX_PACKET = 1 << 16


class Channel:
    """Producer end of the control pipe and of the handoff socket."""

    def __init__(self, conn, who: str, handoff_sock: socket.socket):
        self.conn = conn
        self.who = who
        self.sock = handoff_sock
        self.sock.settimeout(REPLY_TIMEOUT_S)
        # Set by a peer whose main-thread consumer sleeps on the peer's own channel, not on the pipe.
        self.wake: Any = None

    def send(self, msg: tuple) -> None:
        self.conn.send(msg)
        if self.wake is not None:
            self.wake()

    def recv(self, expect: str, timeout_s: float = REPLY_TIMEOUT_S):
        msg = wait_reply(self.conn, timeout_s, self.who)
        if msg[0] != expect:
            raise PeerError(f"{self.who}: expected {expect!r}, got {msg!r}")
        return msg

    def handoff(self, descriptor: Any) -> None:
        """The timed hop: send the descriptor, wait for the consumer's ack."""
        self.sock.send(pickle.dumps(descriptor))
        try:
            reply = self.sock.recv(MAX_PACKET)
        except TimeoutError:
            raise TimeoutError(f"{self.who}: no ack within {REPLY_TIMEOUT_S:.0f} s") from None
        if reply != HANDOFF_ACK:
            if reply.startswith(HANDOFF_ERROR):
                raise PeerError(f"{self.who} child failed:\n{reply[1:].decode(errors='replace')}")
            raise PeerError(f"{self.who}: the handoff socket closed" if not reply else f"{self.who}: got {reply!r}")


class ProducerBase:
    """Producer half of a peer. Subclasses override what they need."""

    name = "?"
    consumer_class: str | None = "Consumer"  # attribute of the same module; None = single process

    def __init__(self, workdir: str, main_thread: bool = False, **options: Any):
        """``main_thread``: the consumer receives in its main thread (see the module docstring)."""
        self.workdir = workdir
        self.main_thread = main_thread
        self.options = options
        self.chan: Channel | None = None

    corrupt_send = False  # set by the harness for the iteration that passes a corrupted payload

    def expected_digest(self, digest: int) -> int:
        """The digest the consumer should see, given the payload's (a peer that sends nothing differs)."""
        return digest

    def consumer_kwargs(self) -> dict[str, Any]:
        """Picklable arguments for the consumer's constructor (passed at spawn)."""
        return {}

    def connect(self) -> None:
        """After the consumer said ready (e.g. open a gRPC channel)."""

    def peer_pids(self) -> dict[str, int]:
        """After ``connect``: processes the peer started itself (a Ray actor, its raylet) whose CPU and
        RSS count in the span, by role (``consumer``, ``daemon``)."""
        return {}

    def setup(self, nbytes: int) -> None:
        """Untimed, once per size."""

    def transfer(self, payload: np.ndarray) -> float:
        """The timed handoff, ack included. Returns seconds to exclude from the span (default 0)."""
        raise NotImplementedError

    def check_local(self, digest: int, corrupt: bool) -> bool:
        """Single-process peers only: the correctness check on what the transfer produced."""
        raise NotImplementedError

    def after_ack(self) -> None:
        """Untimed, after the consumer checked: drop references, unlink, release."""

    def teardown(self) -> None:
        """Idempotent."""


class ConsumerBase:
    """Consumer half of a peer (lives in the spawned child)."""

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs

    def setup(self, nbytes: int) -> None:
        pass

    def receive(self, descriptor: Any) -> Any:
        """Timed: turn a descriptor into bytes or a view; return it (a contiguous buffer)."""
        raise NotImplementedError(f"{type(self).__name__} receives on its own channel")

    def take(self) -> Any:
        """Untimed: the data received on the peer's own channel since the last check."""
        raise NotImplementedError

    # A peer with its own channel that can receive in the main thread (``main_thread=True``)
    # sets this to a method: block until its channel or a control wake-up stirs (at most
    # ``timeout_s``), then receive and ack what arrived.
    serve_in_main_thread: Any = None

    def release(self) -> None:
        """Untimed, after the check."""

    def teardown(self) -> None:
        pass


class _HandoffListener:
    """The consumer's end of the handoff socket: a thread that waits in ``recv``, turns each
    descriptor into the data (``Consumer.receive``) and acks. What it received waits in
    ``pending`` for the control loop's check: the producer sends the check only after the ack, so
    the write happens before the read. A failed receive ends the child, as one in the control loop
    does."""

    def __init__(self, consumer: "ConsumerBase", sock: socket.socket, thread: bool = True):
        """``thread=False``: no thread; the main loop calls ``serve_one`` when the socket is readable."""
        self.consumer = consumer
        self.sock = sock
        self.pending: Any = None
        self.failure: str | None = None  # a failed receive's traceback: the control loop exits on it
        self.thread: threading.Thread | None = None
        if thread:
            self.thread = threading.Thread(target=self._serve, name="handoff-listener", daemon=True)
            self.thread.start()

    def _serve(self) -> None:
        while self.serve_one():
            pass

    def serve_one(self) -> bool:
        """Receive one descriptor, turn it into the data and ack; False once the socket is done
        (closed by the producer, or a failed receive, reported to the producer)."""
        try:
            packet = self.sock.recv(MAX_PACKET)
        except OSError:
            return False
        if not packet:  # the producer closed its end
            return False
        try:
            self.pending = self.consumer.receive(pickle.loads(packet))
        except BaseException:  # noqa: BLE001 — goes back to the producer; the child then exits
            self.failure = traceback.format_exc()
            try:
                self.sock.send(HANDOFF_ERROR + self.failure[-MAX_PACKET // 2:].encode())
            except OSError:
                pass
            return False
        try:
            self.sock.send(HANDOFF_ACK)
        except OSError:
            return False
        return True

    def take(self) -> Any:
        pending, self.pending = self.pending, None
        return pending

    def stop(self) -> None:
        if self.thread is not None:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's recv
            self.thread.join(JOIN_TIMEOUT_S)
        self.sock.close()


def _wait(conn, listener: "_HandoffListener", consumer: "ConsumerBase", main_thread: bool) -> bool:
    """Until a control message is readable (True) or ``IDLE_POLL_S`` passed quietly (False); in the
    main-thread shape, the handoffs that arrive meanwhile are received and acked here."""
    if not main_thread:
        return bool(conn.poll(IDLE_POLL_S))
    if consumer.serve_in_main_thread is not None:  # the peer's own channel (the producer wakes it)
        consumer.serve_in_main_thread(IDLE_POLL_S)
        return bool(conn.poll(0))  # the producer writes the pipe before it wakes the channel
    readable, _, _ = select.select([conn, listener.sock], [], [], IDLE_POLL_S)
    if listener.sock in readable and not listener.serve_one():
        listener.failure = listener.failure or "the handoff socket closed"
    return conn in readable


def consumer_main(module_name: str, class_name: str, kwargs: dict[str, Any], conn,
                  handoff_sock: socket.socket, main_thread: bool = False) -> None:
    """Entry point of every consumer child; ``main_thread``: see the module docstring."""
    consumer = None
    listener = None
    try:
        module = importlib.import_module(module_name)
        consumer = getattr(module, class_name)(**kwargs)
        listener = _HandoffListener(consumer, handoff_sock, thread=not main_thread)
        conn.send(("ready", os.getpid()))
        parent = mp.parent_process()
        digest = 0
        pending: Any = None
        idle_since = time.monotonic()
        while True:
            if listener.failure is not None:  # already sent to the producer on the socket
                return
            if not _wait(conn, listener, consumer, main_thread):
                if (parent is not None and not parent.is_alive()) or time.monotonic() - idle_since > IDLE_LIMIT_S:
                    return
                continue
            idle_since = time.monotonic()
            msg = conn.recv()
            kind = msg[0]
            if kind == "xfer":
                pending = consumer.receive(msg[1])
                conn.send(("ack",))
            elif kind == "check":
                handed = listener.take()
                data = pending if pending is not None else handed if handed is not None else consumer.take()
                pending = handed = None
                ok = verify(data, digest, corrupt=bool(msg[1]))
                del data
                consumer.release()
                conn.send(("flag", ok))
            elif kind == "setup":
                _, nbytes, digest = msg
                consumer.setup(nbytes)
                conn.send(("ok",))
            elif kind == "stop":
                pending = None
                listener.stop()
                listener = None
                consumer.teardown()
                consumer = None
                conn.send(("bye",))
                return
            else:
                raise ValueError(f"unknown message {msg!r}")
    except BaseException:  # noqa: BLE001 — everything goes back to the producer
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
    finally:
        if listener is not None:
            listener.stop()
        if consumer is not None:
            try:
                consumer.teardown()
            except Exception:  # noqa: BLE001
                pass
        handoff_sock.close()
        conn.close()


def stop_process(proc, conn, who: str) -> None:
    """Ask a child to stop, join it with a timeout, escalate if needed."""
    try:
        if conn is not None and proc.is_alive():
            conn.send(("stop",))
            try:
                wait_reply(conn, JOIN_TIMEOUT_S, who)
            except (TimeoutError, PeerError, EOFError, OSError):
                pass
    except (BrokenPipeError, OSError):
        pass
    proc.join(JOIN_TIMEOUT_S)
    if proc.is_alive():
        proc.terminate()
        proc.join(JOIN_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join(JOIN_TIMEOUT_S)
    if conn is not None:
        conn.close()


def process_cpu_s(pid: int) -> float:
    """CPU seconds (all threads) of any process we may inspect: Linux's CPU-clock id for a pid."""
    return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def reset_peak_rss(pid: int) -> None:
    """Restart VmHWM from the current RSS (clear_refs ``5``); a kernel without it keeps the old peak."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


class Usage:
    """CPU seconds and peak RSS of the producer, consumer and daemon over the timed spans since the
    last ``take``; ``Session.iteration`` brackets each span with ``begin``/``end``."""

    def __init__(self) -> None:
        self.spans = 0
        self.cpu_s: dict[str, float] = {}
        self.peak_kib: dict[str, int] = {}
        self.growth_kib: dict[str, int] = {}
        self._start: dict[str, tuple[int, float, int]] = {}

    def begin(self, pids: dict[str, int]) -> None:
        self._start = {}
        for role, pid in pids.items():
            reset_peak_rss(pid)
            self._start[role] = (pid, process_cpu_s(pid), rss_kib(pid).get("VmRSS", 0))

    def end(self, producer_excluded_s: float = 0.0) -> None:
        """``producer_excluded_s``: wall time the producer excluded from the span (single-threaded
        CPU-bound work such as a renderer's write), taken off its CPU as well."""
        for role, (pid, cpu0, rss0) in self._start.items():
            try:
                cpu = process_cpu_s(pid) - cpu0 - (producer_excluded_s if role == "producer" else 0.0)
            except OSError:  # the process is gone (a failed consumer); nothing to add
                continue
            peak = rss_kib(pid).get("VmHWM", 0)
            self.cpu_s[role] = self.cpu_s.get(role, 0.0) + cpu
            self.peak_kib[role] = max(self.peak_kib.get(role, 0), peak)
            self.growth_kib[role] = max(self.growth_kib.get(role, 0), peak - rss0)
        self.spans += 1

    def take(self, nbytes: int) -> dict[str, dict[str, float]]:
        """Row fields for spans of ``nbytes`` each (CPU per GB moved, or per op for 0 bytes), then reset."""
        spans = max(self.spans, 1)
        out: dict[str, dict[str, float]] = {
            "cpu_ms_per_op": {r: round(v / spans * 1e3, 4) for r, v in self.cpu_s.items()},
            "peak_rss_mb": {r: round(v / 1024, 1) for r, v in self.peak_kib.items()},
            "rss_growth_mb": {r: round(v / 1024, 1) for r, v in self.growth_kib.items()},
        }
        if nbytes:
            out["cpu_s_per_gb"] = {r: round(v / (spans * nbytes / 1e9), 4) for r, v in self.cpu_s.items()}
        self.spans, self.cpu_s, self.peak_kib, self.growth_kib = 0, {}, {}, {}
        return out


class Session:
    """One peer: its producer object here, its consumer in a spawned child."""

    def __init__(self, peer: str, daemon_pid: int | None = None, main_thread: bool = False, **options: Any):
        """``main_thread``: the consumer receives in its main thread (module docstring); the
        session's ``name`` is then ``<peer>:main``."""
        self.peer_name = peer
        self.daemon_pid = daemon_pid  # shmtransport's daemon, whose CPU and RSS count for our peers
        self.module_name = f"peers.{peer}"
        module = importlib.import_module(self.module_name)
        self.workdir = tempfile.mkdtemp(prefix=f"stb-{peer[:8]}-")
        self.producer: ProducerBase = module.Producer(self.workdir, main_thread=main_thread, **options)
        self.proc = None
        self.conn = None
        self.handoff_sock: socket.socket | None = None
        self.digest = 0
        self.consumer_pid: int | None = None
        self.usage = Usage()

    @property
    def name(self) -> str:
        return self.producer.name + (MAIN_THREAD_SUFFIX if self.producer.main_thread else "")

    def start(self) -> "Session":
        try:
            cls = self.producer.consumer_class
            if cls is not None:
                parent, child = CTX.Pipe(duplex=True)
                self.handoff_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                self.proc = CTX.Process(target=consumer_main, name=f"consumer-{self.peer_name}",
                                        args=(self.module_name, cls, self.producer.consumer_kwargs(), child,
                                              child_sock, self.producer.main_thread),
                                        daemon=True)
                self.conn = parent
                try:
                    self.proc.start()
                except BaseException:
                    self.proc = None
                    raise
                finally:
                    child.close()
                    child_sock.close()
                _, self.consumer_pid = wait_reply(parent, START_TIMEOUT_S, f"{self.peer_name} consumer")
                self.producer.chan = Channel(parent, f"{self.peer_name} consumer", self.handoff_sock)
            self.producer.connect()
            own = self.producer.peer_pids()
            self.consumer_pid = own.get("consumer", self.consumer_pid)
            self.daemon_pid = own.get("daemon", self.daemon_pid)
        except BaseException:
            self.close()
            raise
        return self

    def prepare(self, nbytes: int, digest: int) -> None:
        self.digest = digest = self.producer.expected_digest(digest)
        self.producer.setup(nbytes)
        if self.producer.chan is not None:
            self.producer.chan.send(("setup", nbytes, digest))
            self.producer.chan.recv("ok")

    def iteration(self, payload: np.ndarray, corrupt: str | None = None) -> tuple[float, bool]:
        """One timed handoff, then the untimed check. ``corrupt``: None | "sender" | "receiver"."""
        if corrupt not in CORRUPT_MODES:
            raise ValueError(f"corrupt must be one of {CORRUPT_MODES}")
        src = corrupted(payload) if corrupt == "sender" else payload
        self.producer.corrupt_send = corrupt == "sender"
        pids = {"producer": os.getpid(), "consumer": self.consumer_pid, "daemon": self.daemon_pid}
        self.usage.begin({role: pid for role, pid in pids.items() if pid is not None})
        start = time.perf_counter()
        excluded = self.producer.transfer(src) or 0.0
        elapsed = time.perf_counter() - start - excluded
        self.usage.end(excluded)
        if self.producer.chan is None:
            ok = self.producer.check_local(self.digest, corrupt == "receiver")
        else:
            self.producer.chan.send(("check", corrupt == "receiver"))
            ok = bool(self.producer.chan.recv("flag")[1])
        self.producer.after_ack()
        return elapsed, ok

    def close(self) -> None:
        try:
            self.producer.teardown()
        finally:
            if self.proc is not None:
                stop_process(self.proc, self.conn, f"{self.peer_name} consumer")
                self.proc = None
                self.conn = None
            if self.conn is not None:
                self.conn.close()
                self.conn = None
            if self.handoff_sock is not None:
                self.handoff_sock.close()
                self.handoff_sock = None
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "Session":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS and its split (RssAnon/RssFile/RssShmem), KiB, from /proc/<pid>/status."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0])
    except OSError:
        pass
    return out
