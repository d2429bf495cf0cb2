"""What a lease holder sees, and what it can do to it.

- ``lease.tensor()`` lies on private copy-on-write pages: in-place torch ops (``div_``, ``add_``,
  ``mul_``) work and stay in the holder's process; the shared bytes, other leases and other
  processes never see them; a new object in the same bytes is seen as itself (no stale private
  pages). Over the read-only shared mapping itself the same op is SIGSEGV (the control test).
- ``lease.array`` stays the read-only shared view: numpy refuses in-place writes.
- Forged handles (shapes whose size wraps around in int64, negative dims, path-like names) are
  refused with a typed error before the Acquire, so the daemon keeps no lease.
- Segments are mapped only after checks: the arena fd and dedicated segment files must be regular
  files of the expected owner that others cannot reach, dedicated ones opened without following
  links; a dedicated segment that fails them costs the daemon no lease either.
"""
from __future__ import annotations

import fcntl
import os
import signal
import stat
import sys

import numpy as np
import pytest

from shmtransport import arena, testing
from shmtransport.client import Consumer, Handle, Producer
from shmtransport.errors import HandleError, InvalidArgument, PermissionDenied, Reason, Unavailable
from shmtransport.testing import BlockingChild, ChildError

TIMEOUT_S = 10.0
SMALL = 1024  # float32 elements: 4 KiB, below arena.PRIVATE_COPY_MAX_NBYTES (a private copy)
LARGE = 1 << 20  # 4 MiB: a copy-on-write window
SIZES = [pytest.param(SMALL, id="4KiB-copy"), pytest.param(LARGE, id="4MiB-window")]
assert SMALL * 4 < arena.PRIVATE_COPY_MAX_NBYTES <= LARGE * 4


@pytest.fixture(params=["unaligned", "default"])
def placement(request, make_daemon):
    """(daemon, whether its objects start inside a page). ``unaligned``: the daemon's own allocator
    places every object on a 64-byte boundary only, so an object after a pad starts inside a page
    (the window must cover the page range); that is the RPC path (``share_object_table=False``), as in the
    object table producers place objects in their own grants. ``default``: the object table where
    there is one."""
    if request.param == "unaligned":
        return make_daemon(page_align_min_nbytes=1 << 30, share_object_table=False), True
    return make_daemon(), False


def _wait_leases(daemon, n: int) -> None:
    testing.wait_until(lambda: daemon.stat().live_leases == n, TIMEOUT_S, what=f"{n} live leases")


# -- children -----------------------------------------------------------------------------------
def _in_place_child(conn, socket_path: str, handle_bytes: bytes) -> dict:
    handle = Handle.from_bytes(handle_bytes)
    with Consumer(socket_path, timeout_s=TIMEOUT_S) as consumer:
        lease = consumer.acquire(handle)
        before = lease.array.copy()
        t = lease.tensor()
        t.div_(2)
        t.add_(1)
        t.mul_(3)
        out = {
            "tensor": t.numpy().copy(),
            "same_lease_tensor": lease.tensor().numpy().copy(),  # a lease's tensors share its pages
            "array_unchanged": bool(np.array_equal(lease.array, before)),
            "offset_in_page": handle.shm.offset % 4096,
        }
        del t
        lease.release()
        consumer.flush()
    return out


def _modify_release_then_read_reused(conn, socket_path: str, first_bytes: bytes) -> dict:
    """Write A's tensor in place, release A, then read B, put by the parent into A's bytes."""
    with Consumer(socket_path, timeout_s=TIMEOUT_S) as consumer:
        lease = consumer.acquire(Handle.from_bytes(first_bytes))
        t = lease.tensor()
        t.fill_(-1.0)
        del t
        lease.release()
        consumer.flush()
        conn.send("released")
        if not conn.poll(TIMEOUT_S):
            raise TimeoutError("no second handle from the parent")
        second = Handle.from_bytes(conn.recv())
        with consumer.acquire(second) as lease:
            t = lease.tensor()
            out = {"tensor": t.numpy().copy(), "array": lease.array.copy()}
            del t
    return out


def _in_place_on_the_shared_mapping_child(conn, socket_path: str, handle_bytes: bytes) -> None:
    """The old ``lease.tensor()``: a torch tensor straight over the read-only shared mapping."""
    import resource

    from shmtransport.tensors import to_torch

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the expected crash leaves no core file
    handle = Handle.from_bytes(handle_bytes)
    consumer = Consumer(socket_path, timeout_s=TIMEOUT_S)
    lease = consumer.acquire(handle)
    conn.send("leased")
    to_torch(lease.array, handle.dtype).div_(2)
    conn.send("survived")


# -- in-place ops on lease tensors ----------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
def test_in_place_ops_on_a_lease_tensor_stay_private_to_the_holder(placement, n):
    daemon, unaligned = placement
    src = np.arange(n, dtype=np.float32)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        pad = producer.put(np.zeros(100, np.uint8))
        handle = producer.put(src)
        with BlockingChild(_in_place_child, daemon.socket_path, handle.to_bytes()) as child:
            out = child.finish(timeout_s=60)
            assert child.process.exitcode == 0
        if unaligned:
            assert out["offset_in_page"] != 0
        np.testing.assert_array_equal(out["tensor"], (src / 2 + 1) * 3)
        np.testing.assert_array_equal(out["same_lease_tensor"], out["tensor"])
        assert out["array_unchanged"]
        with Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as other:
            with other.acquire(handle) as lease:
                np.testing.assert_array_equal(lease.array, src)  # the shared bytes are untouched
                t = lease.tensor()
                np.testing.assert_array_equal(t.numpy(), src)  # and so is a new lease's private view
                del t
        producer.release([pad, handle], wait=True)


@pytest.mark.parametrize("n", SIZES)
def test_bytes_reused_by_a_new_object_are_seen_as_the_new_object(daemon, n):
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        first = producer.put(np.arange(n, dtype=np.float32))
        with BlockingChild(_modify_release_then_read_reused, daemon.socket_path, first.to_bytes()) as child:
            assert child.recv() == "released"
            producer.release(first, wait=True)
            testing.wait_until(lambda: daemon.stat().live_objects == 0, TIMEOUT_S, what="the first object freed")
            second = producer.put(np.full(n, 7.0, np.float32))
            assert second.shm.offset == first.shm.offset, "the test needs the first object's bytes reused"
            child.send(second.to_bytes())
            out = child.finish(timeout_s=60)
            assert child.process.exitcode == 0
        np.testing.assert_array_equal(out["array"], np.full(n, 7.0, np.float32))
        np.testing.assert_array_equal(out["tensor"], np.full(n, 7.0, np.float32))
        producer.release(second, wait=True)


def test_control_an_in_place_op_on_the_shared_mapping_itself_is_sigsegv(daemon):
    """Why ``lease.tensor()`` needs private pages: the tests above fail this way without them."""
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(np.arange(SMALL, dtype=np.float32))
        with BlockingChild(_in_place_on_the_shared_mapping_child, daemon.socket_path, handle.to_bytes()) as child:
            assert child.recv() == "leased"
            with pytest.raises(ChildError, match="died"):
                child.recv()
            assert child.process.exitcode == -signal.SIGSEGV
        _wait_leases(daemon, 0)  # the dead child's session took its lease with it
        producer.release(handle, wait=True)


@pytest.mark.parametrize("n", SIZES)
def test_the_array_stays_the_read_only_shared_view(daemon, n):
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handle = producer.put(np.arange(n, dtype=np.float32))
        with consumer.acquire(handle) as lease:
            arr = lease.array
            assert not arr.flags.writeable
            with pytest.raises(ValueError, match="read-only"):
                arr *= 2
            with pytest.raises(ValueError, match="read-only"):
                np.divide(arr, 2, out=arr)
            with pytest.raises(ValueError, match="read-only"):
                arr[0] = 1
            del arr
        producer.release(handle, wait=True)


@pytest.mark.parametrize("n", SIZES)
def test_a_live_private_tensor_keeps_the_lease_after_release(daemon, n):
    """While a tensor of a released lease lives, the bytes must not be reused under its pages."""
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handle = producer.put(np.arange(n, dtype=np.float32))
        lease = consumer.acquire(handle)
        t = lease.tensor()
        lease.release()
        consumer.flush()
        assert daemon.stat().live_leases == 1
        del t
        consumer.flush()
        assert daemon.stat().live_leases == 0
        producer.release(handle, wait=True)


# -- forged handles -------------------------------------------------------------------------------
FORGED_SHAPES = [
    # (object bytes, dtype, shape): np.prod(shape, dtype=int64) * itemsize wraps to the object's size
    pytest.param(4096, "uint8", (4096, 2**52 + 1), id="elements-wrap-to-4096"),
    pytest.param(1, "uint8", (2**32, 2**32, 4), id="elements-wrap-to-0-as-a-zero-size-object"),
    pytest.param(1, "float32", (2**62, 4), id="float32-elements-wrap-to-0"),
    pytest.param(4096, "uint8", (-1, -4096), id="negative-dims"),
]


@pytest.mark.parametrize("nbytes, dtype, shape", FORGED_SHAPES)
def test_a_forged_shape_is_refused_before_the_acquire(daemon, nbytes, dtype, shape):
    itemsize = np.dtype(np.float32 if dtype == "float32" else np.uint8).itemsize
    wrapped = int(np.prod(shape, dtype=np.int64)) * itemsize
    assert wrapped == nbytes or (wrapped == 0 and nbytes == 1), "the forged shape must pass an int64 check"
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        real = producer.put(np.zeros(0 if nbytes == 1 else nbytes, np.uint8))
        assert real.nbytes == nbytes
        with pytest.raises(InvalidArgument) as info:
            consumer.acquire(Handle(real.shm, dtype, shape))
        assert info.value.reason is Reason.INVALID_ARGUMENT
        consumer.flush()
        assert daemon.stat().live_leases == 0
        with consumer.acquire(real) as lease:  # the genuine handle still works
            assert lease.array.nbytes == (0 if nbytes == 1 else nbytes)
        producer.release(real, wait=True)


def test_a_loan_with_an_overflowing_shape_is_refused(daemon):
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        with pytest.raises(InvalidArgument):
            producer.loan(shape=(2**32, 2**32, 4), dtype=np.uint8)
        with pytest.raises(InvalidArgument):
            producer.loan(shape=(2**40, 2**40), dtype=np.float32)
        assert daemon.stat().live_objects == 0


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".", "", "x" * 129, "seg\n", "/dev/shm/x"])
def test_a_handle_naming_a_path_is_refused_before_the_acquire(daemon, name):
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        real = producer.put(np.zeros(64, np.uint8))
        shm = type(real.shm)()
        shm.CopyFrom(real.shm)
        shm.name = name
        with pytest.raises(HandleError):
            consumer.acquire(Handle(shm, "uint8", (64,)))
        consumer.flush()
        assert daemon.stat().live_leases == 0
        producer.release(real, wait=True)


# -- checked mappings -----------------------------------------------------------------------------
def _tamper(path: str, how: str, other: str) -> None:
    if how == "mode":
        os.chmod(path, 0o604)
    else:  # the daemon's file replaced under the same name (it holds its own fd of the original)
        os.unlink(path)
        if how == "symlink":
            os.symlink(other, path)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, 1 << 20)
            os.fchown(fd, 65534, 65534)
            os.close(fd)


@pytest.mark.parametrize("how", ["mode", "symlink", pytest.param("owner", marks=pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to give a file to another uid"))])
def test_a_tampered_dedicated_segment_is_refused_and_costs_no_lease(daemon, how, tmp_path):
    other = str(tmp_path / "planted")
    with open(other, "wb") as f:
        f.truncate(1 << 20)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        daemon.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        good = producer.put(np.arange(16, dtype=np.float32), dedicated=True)
        bad = producer.put(np.arange(16, dtype=np.float32), dedicated=True)
        path = os.path.join(arena.SHM_DIR, bad.shm.name)
        try:
            _tamper(path, how, other)
            with pytest.raises(PermissionDenied):
                consumer.acquire_many([good, bad])  # granted by the daemon, refused by the mapping
            consumer.flush()
            assert daemon.stat().live_leases == 0
        finally:
            if how != "mode" and os.path.lexists(path):
                os.unlink(path)
        producer.release([good, bad], wait=True)


def _shm_file(nbytes: int, mode: int = 0o600) -> str:
    """A named /dev/shm file, as a dedicated segment is."""
    name = testing.unique_prefix() + "-viewtest"
    fd = os.open(os.path.join(arena.SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.fchmod(fd, mode)
    os.ftruncate(fd, nbytes)
    os.close(fd)
    return name


def _sealed_segment(nbytes: int, mode: int = 0o600) -> int:
    """An fd of a segment as a daemon makes one: a memfd of ``nbytes``, its size sealed."""
    fd = os.memfd_create("viewtest", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.fchmod(fd, mode)
    os.ftruncate(fd, nbytes)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def _reopen(fd: int, flags: int = os.O_RDONLY) -> int:
    return os.open(f"/proc/self/fd/{fd}", flags)


def _is_closed(fd: int, target: str) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") != target
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("case", ["other-uid", "group-readable", "too-small", "not-a-regular-file",
                                  "read-only-fd-mapped-writable", "unsealed"])
def test_attach_fd_refuses_a_file_a_daemon_would_not_hand_out_and_closes_the_fd(case, tmp_path):
    name = testing.unique_prefix() + "-viewtest"
    segment = _sealed_segment(1 << 16, 0o640 if case == "group-readable" else 0o600)
    unsealed = tmp_path / "unsealed"
    unsealed.write_bytes(bytes(1 << 16))
    unsealed.chmod(0o600)
    try:
        if case == "not-a-regular-file":
            fd = os.open(os.devnull, os.O_RDONLY)
        else:
            fd = os.open(unsealed, os.O_RDONLY) if case == "unsealed" else _reopen(segment)
        target = os.readlink(f"/proc/self/fd/{fd}")
        owner = os.geteuid() + 1 if case == "other-uid" else os.geteuid()
        writable = case == "read-only-fd-mapped-writable"
        expected = HandleError if case in ("too-small", "not-a-regular-file") else PermissionDenied
        with pytest.raises(expected):
            arena.attach_fd(fd, name, 2 << 16 if case == "too-small" else 1 << 16, writable, owner)
        assert _is_closed(fd, target)
        assert arena.mappings_of(name) == []
    finally:
        os.close(segment)


def test_attach_fd_shares_one_mapping_per_segment_and_mode():
    name = testing.unique_prefix() + "-viewtest"
    segment = _sealed_segment(1 << 16)
    other = _sealed_segment(1 << 16)  # another segment under the same name is not the mapped one
    try:
        first = arena.attach_fd(_reopen(segment), name, 1 << 16, False, os.geteuid())
        fd = _reopen(segment)
        target = os.readlink(f"/proc/self/fd/{fd}")
        assert arena.attach_fd(fd, name, 1 << 16, False, os.geteuid()) is first
        assert _is_closed(fd, target)  # the existing mapping is shared, the new fd closed
        with pytest.raises(Unavailable):
            arena.attach_fd(_reopen(other), name, 1 << 16, False, os.geteuid())
        arena.detach(first)
        arena.detach(first)
        assert first.closed and arena.mappings_of(name) == []
    finally:
        os.close(segment)
        os.close(other)


def test_map_dedicated_checks_name_link_owner_and_mode(tmp_path):
    owners = frozenset((os.geteuid(),))
    name = _shm_file(1 << 16, 0o660)  # group members of a group tenant may map it
    path = os.path.join(arena.SHM_DIR, name)
    try:
        view = arena.map_dedicated(name, 1 << 16, False, owners)
        assert view.readonly and view.nbytes == 1 << 16
        del view
        with pytest.raises(PermissionDenied):
            arena.map_dedicated(name, 1 << 16, False, frozenset((os.geteuid() + 1,)))
        with pytest.raises(HandleError):
            arena.map_dedicated(name, 1 << 17, False, owners)
        with pytest.raises(HandleError):
            arena.map_dedicated("../" + name, 1 << 16, False, owners)
        os.chmod(path, 0o664)
        with pytest.raises(PermissionDenied):
            arena.map_dedicated(name, 1 << 16, False, owners)
        link = name + "-link"
        os.symlink(path, os.path.join(arena.SHM_DIR, link))
        try:
            with pytest.raises(PermissionDenied, match="symbolic link"):
                arena.map_dedicated(link, 1 << 16, False, owners)
        finally:
            os.unlink(os.path.join(arena.SHM_DIR, link))
        assert stat.S_ISREG(os.lstat(path).st_mode)
    finally:
        os.unlink(path)


@pytest.mark.parametrize("shared_table", [True, False], ids=["table", "rpc"])
def test_a_loan_warns_when_dropped_uncommitted_not_after_its_handle_took_over(make_daemon, shared_table):
    import gc
    import warnings

    daemon = make_daemon(share_object_table=shared_table)
    with Producer(daemon.socket_path, timeout_s=30) as producer:
        loan = producer.loan(64)
        handle = loan.commit()
        producer.release(handle)  # the handle is the reference after commit: no warning for the loan
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del loan
            gc.collect()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
        leaked = producer.loan(64)
        with pytest.warns(ResourceWarning, match="never released: released by the garbage collector"):
            del leaked
            gc.collect()
        # ... and then released, long before the producer closes: the bytes are free again.
        testing.wait_until(lambda: daemon.stat().used_nbytes == 0, timeout_s=TIMEOUT_S,
                           what="the dropped loan given back")


@pytest.mark.parametrize("shared_table", [True, False], ids=["table", "rpc"])
def test_a_lease_dropped_unreleased_warns_then_is_released_once_no_view_of_it_is_left(make_daemon, shared_table):
    import gc

    daemon = make_daemon(share_object_table=shared_table)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        first, second = producer.put_many([np.full(4096, 1, np.uint8), np.full(4096, 2, np.uint8)])
        dropped, viewed = consumer.acquire_many([first, second])
        producer.release([first, second], wait=True)  # the leases are the last references
        row = viewed.array[:8]  # a view that outlives its lease object
        with pytest.warns(ResourceWarning, match="never released: released by the garbage collector"):
            del dropped, viewed
            gc.collect()
        testing.wait_until(lambda: daemon.stat().live_objects == 1, timeout_s=TIMEOUT_S,
                           what="the unviewed lease released, its object freed")
        consumer.flush()
        assert (row == 2).all() and daemon.stat().live_objects == 1  # the viewed one waits for its view
        del row
        testing.wait_until(lambda: daemon.stat().live_objects == 0, timeout_s=TIMEOUT_S,
                           what="the viewed lease released once its view was gone")


def test_tensor_without_torch_says_what_to_install_and_acquire_of_a_non_handle_is_refused(daemon, monkeypatch):
    from shmtransport.errors import MissingDependency

    with Producer(daemon.socket_path, timeout_s=30) as producer, Consumer(daemon.socket_path, timeout_s=30) as consumer:
        handle = producer.put(np.arange(16, dtype=np.float32))
        for wrong in ("not a handle", handle.to_bytes(), None):
            with pytest.raises(InvalidArgument, match="Handle objects"):
                consumer.acquire(wrong)
        lease = consumer.acquire(handle)
        monkeypatch.setitem(sys.modules, "torch", None)  # what `import torch` meets without torch installed
        with pytest.raises(MissingDependency, match=r"pip install 'shmtransport\[torch\]'") as info:
            lease.tensor()
        assert isinstance(info.value, ImportError) and info.value.reason is Reason.MISSING_DEPENDENCY
        assert lease.array.tolist() == list(range(16))  # numpy views still work
        lease.release()
        producer.release(handle)
        del info
