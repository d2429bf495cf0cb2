"""iceoryx2 (Eclipse iceoryx2's Python bindings: daemonless zero-copy IPC) for its peers: the
services and ports, and the request-lifecycle pair for the ``scale`` suite's pairs curve.

A handoff uses three services under one name: a publish-subscribe service of ``Slice[c_uint8]``
(the payload), and two event services, ``<name>/sent`` (producer -> consumer) and ``<name>/ack``
(consumer -> producer). iceoryx2's subscriber has no blocking receive; an event listener is its
documented way to sleep until a sample arrives. The ack's event id carries the receiver's word.

The service is sized for exactly one publisher and one subscriber that holds one sample: no history,
a subscriber buffer of one, one loan at a time, so the publisher's data segment (allocated once,
``AllocationStrategy.Static``, sized by ``initial_max_slice_len``) holds three slots of the largest
payload and is never regrown inside a timed span.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import secrets
import time

import numpy as np

from .common import (
    IDLE_LIMIT_S,
    IDLE_POLL_S,
    REPLY_TIMEOUT_S,
    START_TIMEOUT_S,
    digest_of,
    seeded_payload,
    verify,
    wait_reply,
)

ACK_HOLDING = 1  # the consumer holds the sample (transport peer) / every digest matched (lifecycle)
ACK_FAILED = 2  # the consumer failed (transport peer) / a digest did not match (lifecycle)
CONTROL = 3  # on ``sent``: no sample, read the control pipe (a consumer waiting in its main thread)


def iox2():
    import iceoryx2

    iceoryx2.set_log_level(iceoryx2.LogLevel.Error)  # else every process warns that it found no config file
    return iceoryx2


def service_name(peer: str) -> str:
    return f"stbench/{peer}/{os.getpid()}/{secrets.token_hex(4)}"


# Every /dev/shm file iceoryx2 makes for the harness carries the harness's prefix, so a leak check
# sees them; iceoryx2 keeps one management file per prefix after its last node is gone, which
# ``remove_management_file`` takes away once every process of a run has exited.
PREFIX = "stbench_iox2_"


def node():
    iceoryx2 = iox2()
    config = iceoryx2.config.default()
    config.global_cfg.prefix = iceoryx2.FileName.new(PREFIX)
    # Disabled: the default installs SIGINT/SIGTERM handlers, which would take Ctrl-C from the harness.
    return (iceoryx2.NodeBuilder.new().config(config).signal_handling_mode(iceoryx2.SignalHandlingMode.Disabled)
            .create(iceoryx2.ServiceType.Ipc))


def remove_management_file() -> None:
    """Unlink the harness's iceoryx2 management file(s); call only when no node of ours lives."""
    for name in os.listdir("/dev/shm"):
        if name.startswith(PREFIX) and name.endswith(".global_mgmt"):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass


def duration(seconds: float):
    return iox2().Duration.from_secs_f64(seconds)


class Ports:
    """One side's ports. ``publisher=True``: the producer (publisher, notifier on ``sent``, listener on
    ``ack``); else the consumer (subscriber, listener on ``sent``, notifier on ``ack``). ``create``:
    this side creates the services (the other opens them); None: whichever side comes first."""

    def __init__(self, name: str, publisher: bool, max_nbytes: int = 0, create: bool | None = None):
        iceoryx2 = iox2()
        self.node = node()

        def builder(suffix: str):
            return self.node.service_builder(iceoryx2.ServiceName.new(name + suffix))

        def made(b):
            return b.create() if create else b.open() if create is False else b.open_or_create()

        self.pubsub = made(builder("").publish_subscribe(iceoryx2.Slice[ctypes.c_uint8])
                           .max_publishers(1).max_subscribers(1).history_size(0)
                           .subscriber_max_buffer_size(1).subscriber_max_borrowed_samples(1))
        self.sent = made(builder("/sent").event())
        self.ack = made(builder("/ack").event())
        if publisher:
            self.publisher = (self.pubsub.publisher_builder().initial_max_slice_len(max_nbytes)
                              .allocation_strategy(iceoryx2.AllocationStrategy.Static).max_loaned_samples(1).create())
            self.notifier = self.sent.notifier_builder().create()
            self.listener = self.ack.listener_builder().create()
        else:
            self.subscriber = self.pubsub.subscriber_builder().create()
            self.listener = self.sent.listener_builder().create()
            self.notifier = self.ack.notifier_builder().create()
        self._ack_ids = {i: iceoryx2.EventId.new(i) for i in (ACK_HOLDING, ACK_FAILED, CONTROL)}

    def send(self, sample) -> None:
        sample.assume_init().send()
        self.notifier.notify()

    def answer(self, word: int) -> None:
        self.notifier.notify_with_custom_event_id(self._ack_ids[word])

    def wait(self, timeout_s: float) -> list[int]:
        """Event ids that arrived (empty after ``timeout_s``)."""
        return [activation.id.as_value for activation in self.listener.timed_wait(duration(timeout_s))]

    def wait_answer(self, timeout_s: float = REPLY_TIMEOUT_S) -> int:
        ids = self.wait(timeout_s)
        if not ids:
            raise TimeoutError(f"iceoryx2: no ack within {timeout_s:.0f} s")
        return ACK_FAILED if ACK_FAILED in ids else ACK_HOLDING

    def close(self) -> None:
        for port in ("publisher", "subscriber", "notifier", "listener"):
            obj = self.__dict__.pop(port, None)
            if obj is not None:
                obj.delete()
        self.pubsub = self.sent = self.ack = None
        self.node = None  # the last reference: iceoryx2 removes the node and services it owned


def view(sample) -> np.ndarray:
    """A uint8 array over a sample's payload, no copy."""
    return np.frombuffer(sample.payload().as_memory_view(), dtype=np.uint8)


# -- the request-lifecycle pair (``scale``'s throughput_vs_pairs) ----------------------------------

def _producer_main(name: str, ctl, peer, tensors: int, nbytes: int, seed: int) -> None:
    from .lifecycle import _run_for, _send_failure

    ports = None
    try:
        ports = Ports(name, publisher=True, max_nbytes=tensors * nbytes, create=None)
        arrays = [seeded_payload(nbytes, seed + i) for i in range(tensors)]
        ctl.send(("ready", os.getpid()))
        _, duration_s = wait_reply(ctl, START_TIMEOUT_S, "lifecycle orchestrator")
        ports.publisher.update_connections()  # every consumer said ready before "go"

        def lifecycle() -> bool:
            sample = ports.publisher.loan_slice_uninit(tensors * nbytes)
            dst = view(sample)
            for i, array in enumerate(arrays):  # the put's copy: one request = one sample
                dst[i * nbytes:(i + 1) * nbytes] = array
            del dst
            ports.send(sample)
            return ports.wait_answer() == ACK_HOLDING

        samples, ok, elapsed = _run_for(duration_s, lifecycle)
        peer.send(("stop",))
        ctl.send(("result", samples, ok, elapsed))
    except BaseException:  # noqa: BLE001
        _send_failure(ctl, peer)
    finally:
        if ports is not None:
            ports.close()
        ctl.close()
        peer.close()


def _consumer_main(name: str, ctl, peer, tensors: int, nbytes: int, seed: int) -> None:
    from .lifecycle import _send_failure

    ports = None
    try:
        ports = Ports(name, publisher=False, create=None)
        digests = [digest_of(seeded_payload(nbytes, seed + i)) for i in range(tensors)]
        ctl.send(("ready", os.getpid()))
        parent = mp.parent_process()
        idle_since = time.monotonic()
        while not peer.poll(0):
            if not ports.wait(IDLE_POLL_S):
                if (parent is not None and not parent.is_alive()) or time.monotonic() - idle_since > IDLE_LIMIT_S:
                    return
                continue
            idle_since = time.monotonic()
            while (sample := ports.subscriber.receive()) is not None:
                got = view(sample)
                ok = got.size == tensors * nbytes and all(
                    verify(got[i * nbytes:(i + 1) * nbytes], d) for i, d in enumerate(digests))
                del got
                sample.delete()  # back to the publisher before the ack, as the shm consumer releases
                ports.answer(ACK_HOLDING if ok else ACK_FAILED)
        ctl.send(("done",))
    except BaseException:  # noqa: BLE001
        _send_failure(ctl)
    finally:
        if ports is not None:
            ports.close()
        ctl.close()
        peer.close()


def run_iceoryx2_lifecycles(pairs: int, tensors: int, nbytes: int, duration_s: float) -> dict:
    """``lifecycle.run_lifecycles``' shape over iceoryx2: per pair, the producer loans one sample of
    ``tensors * nbytes``, copies the arrays in, sends; the consumer checks every array's digest,
    drops the sample and acks with the flag. No daemon."""
    from .lifecycle import _run_pairs

    token = service_name("lifecycle")
    try:
        results, _ = _run_pairs(_producer_main, _consumer_main, lambda i: (f"{token}/{i}",),
                                   pairs, tensors, nbytes, duration_s, None)
    finally:
        remove_management_file()
    samples = [s for r in results for s in r[1]]
    return {
        "lifecycles_per_s": len(samples) / max(r[3] for r in results),
        "samples": samples,
        "correct": all(r[2] for r in results),
    }
