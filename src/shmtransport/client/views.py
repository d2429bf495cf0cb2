"""What a caller holds: ``Loan`` (writable bytes until commit) and ``Lease`` (read-only bytes
until release), and the view tracking both share: a release waits while a numpy or torch view
of the bytes is still alive, and one garbage-collected unreleased warns, then is released."""
from __future__ import annotations

import sys
import warnings
import weakref
from typing import TYPE_CHECKING, Protocol, Sequence, TypeVar

import numpy as np
import numpy.typing as npt

from .. import _call_sites, arena
from .._backend import kernels
from ..errors import (
    ClosedError,
    IdentityMismatch,
    InvalidArgument,
    Reason,
)
from ..handle import Handle
from ..tensors import DTYPES, dtype_from_name, to_torch
from .table import Placed, TableClient

if TYPE_CHECKING:
    import torch

_V = TypeVar("_V", bound="View")


class ViewOwner(Protocol):
    """What a view needs of the client it came from (``session._Client``): views sit below the
    clients, which they never import."""

    @property
    def closed(self) -> bool:
        """Whether the client was closed (its views were released with it)."""

    def _collected_unreleased(self, view: View) -> None: ...

    def _release_views(self, views: Sequence[View]) -> None: ...


class LoanOwner(ViewOwner, Protocol):
    """A ``Producer``, as its loans see it."""

    def commit_many(self, loans: Sequence[Loan], *, digest: bool = False, hold_ms: int = 0,
                    wait: bool = False, keep: bool = True) -> list[Handle]:
        """See ``Producer.commit_many``."""

    def _commit_placed(self, loan: Loan, hold_ms: int, keep: bool) -> Handle: ...


class LeaseOwner(ViewOwner, Protocol):
    """A ``Consumer``, as its leases see it."""

    def _release_held(self, lease: Lease) -> None: ...


class View:
    """Shared machinery of a Loan, a Lease and a remote tier's buffer: a typed view over the bytes
    a handle names, whose release waits until no numpy or torch view of them is alive."""

    # Defaults a view changes when it must (class attributes: a handoff's hot path sets none).
    _array: np.ndarray | None = None
    _roots: tuple[weakref.ref[npt.NDArray[np.uint8]], ...] = ()  # every buffer this view cut typed arrays from
    _released = False
    _sealed = False  # a committed loan hands out no more (writable) views

    def __init__(self, client: ViewOwner, handle: Handle, memory: memoryview) -> None:
        # (Loan and Lease set these three themselves: one frame less on a handoff's hot path.)
        self._client = client
        self.handle = handle
        self._memory: memoryview | None = memory  # None once let go (released, or committed and unviewed)

    @property
    def closed(self) -> bool:
        """Whether ``release`` was called (the views are gone)."""
        return self._released

    @property
    def array(self) -> np.ndarray:
        """Zero-copy numpy view with the tensor's dtype and shape."""
        array = self._array
        if array is None:
            memory = self._memory
            if memory is None or self._released or self._sealed:
                memory = self._check_viewable()  # (which raises)
            array = self._array = self._typed(memory)
        return array

    def tensor(self) -> torch.Tensor:
        """Zero-copy torch tensor over the same bytes (bfloat16 included)."""
        return to_torch(self.array, self.handle.dtype)

    def _check_viewable(self) -> memoryview:
        """The bytes, while new views of them may be made."""
        if self._released:
            raise ClosedError(f"{type(self).__name__} already released: its view is gone", Reason.VIEW_RELEASED)
        if self._sealed:
            raise ClosedError(f"{self!r} is committed: its bytes are immutable now", Reason.VIEW_RELEASED)
        return self._live_memory()

    def _live_memory(self) -> memoryview:
        """Our slice of the bytes; ClosedError once it was let go (released or committed, and no
        view of it left)."""
        if self._memory is None:
            raise ClosedError(f"{self!r}: its bytes are no longer mapped here", Reason.VIEW_RELEASED)
        return self._memory

    def _typed(self, memory: memoryview) -> np.ndarray:
        """The handle's dtype and shape over ``memory``, tracked by ``_views_alive``."""
        handle = self.handle
        try:  # (the handle's fields, not its properties: a handoff's hot path)
            dtype = DTYPES[handle._dtype]
        except KeyError:
            dtype = dtype_from_name(handle._dtype)  # (which raises)
        root: np.ndarray = np.ndarray(handle._shape, dtype, memory)
        # numpy points every view derived from ``root`` (slices, reshapes, torch.from_numpy)
        # at ``root`` itself, so its weakref says whether any view of these bytes is alive.
        self._roots += (weakref.ref(root),)
        return root

    def _views_alive(self) -> bool:
        for ref in self._roots:  # (a loop, not any(): this runs on every release and commit)
            if ref() is not None:
                return True
        return False

    def _detach_views(self) -> None:
        self._released = True
        self._array = None

    def _forget_memory(self) -> None:
        """Once released and unviewed: drop our slice so the process mapping can be unmapped."""
        self._memory = None


    def release(self) -> None:
        """Give the bytes back (each kind of view says how)."""
        raise NotImplementedError

    def __enter__(self: _V) -> _V:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        # The one finalizer policy (views, loans, leases, remote buffers): warn, then release.
        # Never here: a finalizer runs on whichever thread the collector happens to, inside any
        # lock, so the client's background thread does it. A closed client released it already.
        client = getattr(self, "_client", None)  # (None: its __init__ failed before setting it)
        if client is not None and not self._released and not client.closed:
            client._collected_unreleased(self)  # first: the warning may be an error
            warnings.warn(f"{type(self).__name__} {self.handle!r} was never released: released by the garbage "
                          "collector (call release, or use it as a context manager)", ResourceWarning, 2)


class Loan(View):
    """Writable bytes loaned to a producer; ``commit`` seals them and returns the handle."""

    _client: LoanOwner

    def __init__(self, client: LoanOwner, handle: Handle, memory: memoryview,
                 placed: tuple[TableClient, Placed] | None = None) -> None:
        """``placed``: the object-table entry of a loan placed in this producer's own grant."""
        arena.unprotect(memory)  # the bytes of an object committed here earlier may be read-only
        self._client, self.handle, self._memory = client, handle, memory  # (View.__init__'s, one frame less)
        self._placed = placed
        self.committed = False
        if _call_sites.enabled:  # a leak check is on: remember the caller for its report
            _call_sites.record(self)

    def commit(self, *, digest: bool = False, hold_ms: int = 0, wait: bool = False, keep: bool = True) -> Handle:
        """Seal the bytes and hand the object off; the handle names it to consumers. See
        ``Producer.commit_many`` for ``digest``, ``hold_ms``, ``wait`` and ``keep`` (False: the
        object is no longer this producer's, the way a producer that runs for days hands off).

        Raises ClosedError (released), StateError (already committed), Unavailable (the daemon
        restarted under the loan)."""
        if self._placed is not None and not digest:  # a handoff's hot path: the same checks, fewer steps
            return self._client._commit_placed(self, hold_ms, keep)
        return self._client.commit_many([self], digest=digest, hold_ms=hold_ms, wait=wait, keep=keep)[0]

    def _seal(self) -> None:
        """Committed bytes are immutable: ``array`` becomes read-only (a write raises ValueError)
        and, while any view of the bytes is alive, their whole pages are made read-only in this
        process (a write through any other view, a torch tensor included, faults: SIGSEGV)."""
        array, self._array = self._array, None
        # Our own cached array is no caller's view: dropped before the check, as protecting costs
        # ~0.1 ms of page-table work here and again when the range is loaned next. Made read-only
        # only when the caller holds it too (our reference and getrefcount's own are the two).
        if array is not None and sys.getrefcount(array) > 2:
            array.flags.writeable = False
        del array
        self._sealed = True
        if self._roots and self._views_alive():
            if self._memory is not None:
                arena.protect(self._memory)
        else:
            self._memory = None  # no caller view needs our slice: the mapping may go

    def release(self) -> None:
        """Give the loan back without committing (or drop the producer reference after commit)."""
        if not self._released:
            self._client._release_views([self])

    def __repr__(self) -> str:
        state = "released" if self._released else "committed" if self.committed else "live"
        return f"Loan({self.handle!r}, {state})"

    def __del__(self) -> None:
        # A committed loan's reference is its handle from then on (``Producer.release(handle)``,
        # or the producer's close); only a loan dropped uncommitted and unreleased is a leak.
        if not getattr(self, "committed", True):
            super().__del__()


class Lease(View):
    """A consumer's read-only view of committed bytes, valid until ``release``."""

    _client: LeaseOwner
    _private: np.ndarray | None = None  # tensor()'s private pages

    def __init__(self, client: LeaseOwner, handle: Handle, memory: memoryview, lease_id: int,
                 table: TableClient | None = None, slot_key: tuple[int, int] = (0, 0)) -> None:
        """``table``: set for a lease held with this client's bit in the object table
        (``lease_id`` 0) on the object ``slot_key`` (table index, generation); otherwise the
        daemon's lease ``lease_id``."""
        self._client, self.handle, self._memory = client, handle, memory  # (View.__init__'s, one frame less)
        self.lease_id = lease_id
        self._table = table
        self._slot_key = slot_key
        if _call_sites.enabled:  # a leak check is on: remember the caller for its report
            _call_sites.record(self)

    def tensor(self) -> torch.Tensor:
        """Torch tensor of the leased bytes on private pages of this lease (``arena.private_view``).

        From 1 MiB on, reads copy nothing (the pages are the shared ones until written) and an
        in-place op (``div_``, ``add_``, ...) copies just the pages it writes; smaller tensors are
        copied once, which costs less than mapping. Either way this lease's tensors see the change;
        ``array``, other leases and other processes do not. Torch has no read-only tensors: over
        the read-only shared mapping an in-place op would die of SIGSEGV. Like ``array``, a live
        tensor keeps the lease after ``release`` (its pages must not meet a new object)."""
        if self._private is None:
            self._private = self._typed(arena.private_view(self._check_viewable(), self.handle.shm.offset))
        return to_torch(self._private, self.handle.dtype)

    def _detach_views(self) -> None:
        self._released = True
        self._array = self._private = None

    def verify(self) -> None:
        """Recompute the content digest from shared memory; IdentityMismatch when it differs."""
        if self._released:
            raise ClosedError(f"{self!r} is released", Reason.VIEW_RELEASED)
        if not self.handle.digest:
            raise InvalidArgument("handle carries no digest: the producer did not hash")
        if kernels.tree_digest(self._live_memory()) != self.handle.digest:
            raise IdentityMismatch(f"content digest mismatch for {self.handle!r}")

    def release(self) -> None:
        """Give the lease back (see ``Consumer.release``); ``array`` raises from then on."""
        if not self._released:
            if self._table is not None:
                self._client._release_held(self)
            else:
                self._client._release_views([self])

    def __repr__(self) -> str:
        return f"Lease(id={self.lease_id}, {self.handle!r}, {'released' if self._released else 'live'})"
