"""``iceoryx2_loan``: iceoryx2 publish-subscribe with a dynamic slice, the renderer writing in place.

The producer creates the services (``_iceoryx2.Ports``: a ``Slice[c_uint8]`` publish-subscribe
service whose publisher's ``initial_max_slice_len`` is the suite's largest payload, plus the
``sent`` / ``ack`` event services) before the consumer starts; the consumer opens them.

Timed: ``loan_slice_uninit(nbytes)`` -> the renderer writes the payload into the sample (excluded
from the span with a split timer, as for ``shm_loan``: iceoryx2's zero-copy equivalent of our loan)
-> ``assume_init().send()`` -> notify ``sent`` -> the consumer's listener thread wakes (``:main``:
its main thread, which also wakes on a ``CONTROL`` event after each control message), ``receive``s
the sample (a view of the publisher's segment) and holds it -> notify ``ack`` -> the producer's
listener wakes. Untimed, the harness's check hashes the held sample's bytes in the consumer; the
consumer then drops the sample, which hands its slot back to the publisher.
"""
from __future__ import annotations

import threading
import time
import traceback

import numpy as np

from . import _iceoryx2
from .common import IDLE_POLL_S, JOIN_TIMEOUT_S, ConsumerBase, ProducerBase

import_package = _iceoryx2.iox2


class Producer(ProducerBase):
    name = "iceoryx2_loan"

    def __init__(self, workdir: str, max_nbytes: int, **options):
        super().__init__(workdir, **options)
        self.service = _iceoryx2.service_name(self.name)
        self.ports = _iceoryx2.Ports(self.service, publisher=True, max_nbytes=max_nbytes, create=True)

    def consumer_kwargs(self) -> dict:
        return {"service": self.service, "main_thread": self.main_thread}

    def connect(self) -> None:
        self.ports.publisher.update_connections()  # the consumer's subscriber exists once it said ready
        if self.main_thread:
            self.chan.wake = lambda: self.ports.answer(_iceoryx2.CONTROL)

    def transfer(self, payload: np.ndarray) -> float:
        sample = self.ports.publisher.loan_slice_uninit(payload.nbytes)
        start_write = time.perf_counter()
        np.copyto(_iceoryx2.view(sample), payload)  # the renderer's write — untimed
        excluded = time.perf_counter() - start_write
        self.ports.send(sample)
        if self.ports.wait_answer() == _iceoryx2.ACK_FAILED:
            # The consumer's traceback comes back through the harness: its check re-raises it here.
            self.chan.send(("check", False))
            self.chan.recv("flag")
        return excluded

    def teardown(self) -> None:
        if self.ports is not None:
            ports, self.ports = self.ports, None
            ports.close()


class Consumer(ConsumerBase):
    """A listener thread receives and acks (the harness's main loop only reads the pipe), or with
    ``main_thread`` the harness's main loop does (``serve_in_main_thread``); the harness's check
    (``take``) and ``release`` run on the main thread once the producer has the ack."""

    def __init__(self, service: str, main_thread: bool = False):
        super().__init__()
        self.ports = _iceoryx2.Ports(service, publisher=False, create=False)
        self._lock = threading.Lock()
        self._held = None  # (sample, view)
        self._failure: str | None = None
        self._stop = threading.Event()
        self._thread = None
        if main_thread:
            self.serve_in_main_thread = self._serve_once
        else:
            self._thread = threading.Thread(target=self._serve, name="iceoryx2-listener", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set() and self._serve_once(IDLE_POLL_S):
            pass

    def _serve_once(self, timeout_s: float) -> bool:
        """Wait for the ``sent`` event, receive and ack what arrived; False once failed."""
        if self._failure is not None:
            return False
        try:
            if self.ports.wait(timeout_s):
                while (sample := self.ports.subscriber.receive()) is not None:
                    got = _iceoryx2.view(sample)
                    got.flags.writeable = False  # a reader's view, as a lease's
                    with self._lock:
                        self._held = (sample, got)
                    self.ports.answer(_iceoryx2.ACK_HOLDING)
        except Exception:  # noqa: BLE001 — goes back to the producer through ``take``
            self._failure = traceback.format_exc()
            self.ports.answer(_iceoryx2.ACK_FAILED)
            return False
        return True

    def take(self) -> np.ndarray:
        with self._lock:
            if self._failure is not None:
                raise RuntimeError(f"iceoryx2 listener thread failed:\n{self._failure}")
            if self._held is None:
                raise RuntimeError("no sample arrived")
            return self._held[1]

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, None
        if held is not None:
            held[0].delete()

    def teardown(self) -> None:
        if self.ports is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(IDLE_POLL_S + JOIN_TIMEOUT_S)
        self.release()
        ports, self.ports = self.ports, None
        ports.close()
