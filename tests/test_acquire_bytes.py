"""``Consumer.acquire_bytes``: the handle's wire form to a held lease in one native call, where the
object is in this tenant's object table; the general path (``acquire(Handle.from_bytes(data))``)
for everything else. Whatever the handle, both must agree: the same bytes for a good handle, the
same typed error for a bad one. Runs under both backends (without the C kernels every call takes
the general path)."""
from __future__ import annotations

import numpy as np
import pytest

from shmtransport.client import Handle, Producer
from shmtransport.errors import ShmTransportError
from shmtransport.handle import Where


def _put(producer: Producer, shape=(3, 5), dtype=np.float32) -> tuple[np.ndarray, Handle]:
    array = (np.arange(int(np.prod(shape))) % 3).astype(dtype).reshape(shape)
    return array, producer.put(array, digest=True)


def _outcome(call) -> tuple:
    """What a call did: the bytes it gave (released at once), or its error's type and reason."""
    try:
        lease = call()
    except ShmTransportError as exc:
        return type(exc), exc.reason
    with lease:
        return "lease", lease.array.dtype.str, lease.array.shape, lease.array.tobytes(), lease.handle.digest


@pytest.mark.parametrize("shape, dtype", [((3, 5), np.float32), ((0, 4), np.int64), ((), np.uint16), ((7,), np.bool_)])
def test_a_good_handle_gives_the_same_lease_as_acquire(pair, shape, dtype) -> None:
    producer, consumer = pair
    array, handle = _put(producer, shape, dtype)
    data = handle.to_bytes()
    with consumer.acquire_bytes(data) as lease:
        assert lease.array.dtype == array.dtype and lease.array.shape == array.shape
        np.testing.assert_array_equal(lease.array, array)
        assert lease.handle == handle and lease.handle.where == handle.where
        lease.verify()
    assert _outcome(lambda: consumer.acquire_bytes(data)) == _outcome(lambda: consumer.acquire(Handle.from_bytes(data)))
    producer.release(handle)


def _forged(handle: Handle, **changes) -> bytes:
    shape = changes.pop("shape", handle.shape)
    dtype = changes.pop("dtype", handle.dtype)
    return Handle._of(handle.where._replace(**changes), None, dtype, tuple(shape), handle.digest).to_bytes()


FORGERIES = {
    "other dtype": lambda h: _forged(h, dtype="float64"),
    "unknown dtype": lambda h: _forged(h, dtype="float128"),
    "other shape": lambda h: _forged(h, shape=(5, 5)),
    "zero dim, other size": lambda h: _forged(h, shape=(0, 2**62, 2**62)),
    "other offset": lambda h: _forged(h, offset=h.where.offset + 64),
    "other size": lambda h: _forged(h, nbytes=h.where.nbytes + 4, shape=(h.where.nbytes // 4 + 1,)),
    "outside the arena": lambda h: _forged(h, offset=2**40),
    "other generation": lambda h: _forged(h, generation=h.where.generation + 1),
    "older generation": lambda h: _forged(h, generation=max(h.where.generation - 1, 0)),
    "other slot": lambda h: _forged(h, slot=h.where.slot + 1),
    "other instance": lambda h: _forged(h, instance_id="0123456789ab"),
    "other segment": lambda h: _forged(h, name=h.where.name + "x"),
    "a path": lambda h: _forged(h, name="../etc/passwd"),
    "truncated": lambda h: h.to_bytes()[:-3],
    "noise": lambda h: b"\x0a\xff\xff",
}


@pytest.mark.parametrize("forge", FORGERIES.values(), ids=FORGERIES.keys())
def test_a_bad_handle_gets_the_error_acquire_gives_and_holds_nothing(pair, forge) -> None:
    producer, consumer = pair
    _, handle = _put(producer)
    data = forge(handle)
    try:
        expected = _outcome(lambda: consumer.acquire(Handle.from_bytes(data)))
    except ShmTransportError as exc:  # Handle.from_bytes refused the bytes themselves
        expected = (type(exc), exc.reason)
    assert _outcome(lambda: consumer.acquire_bytes(data)) == expected
    consumer.flush()
    producer.release(handle, wait=True)
    # the hand-off went with nothing else holding the object: a forged handle took no hold
    assert _outcome(lambda: consumer.acquire_bytes(handle.to_bytes()))[0] != "lease"


def test_leases_of_one_object_in_one_client_share_its_hold_until_the_last_goes(pair) -> None:
    producer, consumer = pair
    array, handle = _put(producer)
    data = handle.to_bytes()
    first, second = consumer.acquire_bytes(data), consumer.acquire(Handle.from_bytes(data))
    producer.release(handle)
    first.release()
    np.testing.assert_array_equal(second.array, array)  # still held: the object lives
    third = consumer.acquire_bytes(data)
    second.release()
    third.release()
    consumer.flush()
    producer.flush()
    assert _outcome(lambda: consumer.acquire_bytes(data))[0] != "lease"  # freed


def test_a_view_kept_past_release_keeps_the_object(pair) -> None:
    producer, consumer = pair
    array, handle = _put(producer)
    lease = consumer.acquire_bytes(handle.to_bytes())
    view = lease.array[1:]
    lease.release()
    producer.release(handle)
    _, other = _put(producer)  # a new object must not land in the bytes the view still shows
    np.testing.assert_array_equal(view, array[1:])
    del view
    consumer.flush()
    producer.release(other)


def test_a_handle_is_immutable_and_its_forms_agree() -> None:
    where = Where("shmt-seg", 4096, 60, "session", 3, "instance", 9)
    handle = Handle._of(where, None, "float32", (3, 5))
    assert handle.shm.offset == 4096 and handle.nbytes == 60 and handle.where == where
    again = Handle.from_bytes(handle.to_bytes())
    assert again == handle and again.where == where and again.shm == handle.shm
    for name in ("shm", "dtype", "shape", "digest", "commit_token", "where"):
        with pytest.raises(AttributeError):
            setattr(handle, name, None)
