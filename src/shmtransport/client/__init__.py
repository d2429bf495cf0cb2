"""Client library: ``Producer`` (put, loan → commit) and ``Consumer`` (acquire → release).

The frontend writes tensors straight into shared memory (``loan``) or copies once with the content
digest fused into the copy (``put(..., digest=True)``); the worker gets zero-copy read-only numpy
views and torch tensors on private copy-on-write pages of the same bytes (an in-place op changes
only this lease's pages, never the shared bytes). Batch forms make one RPC per request, not per
tensor.

Views never read freed memory silently: once a loan or lease is released, ``.array`` raises; and
if the caller still holds a view from before, the client keeps the daemon's reference until that
view is gone (checked on every later call and at close), so the bytes cannot be reused under it.
"""
from __future__ import annotations

from ..handle import Handle
from .consumer import Consumer
from .producer import Producer, Published
from .views import Lease, Loan

__all__ = ["Consumer", "Handle", "Lease", "Loan", "Producer", "Published"]
