"""shmtransport: move decoded multimodal tensors between processes through daemon-owned shared memory.

The public API is what this package exports (``__all__``), the ``shmtransport`` command, the
pytest plugin's fixtures and ``shmtransport.testing``; the submodules behind them are internal and
may change between releases.

A frontend's ``Producer.put(array, digest=True)`` returns a ``Handle``; its ``to_bytes()`` travel
in the request; the worker's ``Consumer.acquire(Handle.from_bytes(data))`` returns a ``Lease``
whose ``array`` and ``tensor()`` are zero-copy views. The README has the complete two-process
example (it runs as a test).

A frontend sends prompts with images or video to a worker (``shmtransport vllm-worker``) with
``GeneratorClient`` or ``AsyncGeneratorClient``: items as ``FeatureItem``s, their tensors put into
shared memory by the client's ``Producer``, tokens streamed back (docs/vllm.md).
"""
import importlib as _importlib
from typing import Any as _Any

__version__ = "0.1.0"

# name -> the module it lives in; imported on first use, so importing the package (e.g. the pytest
# plugin) costs nothing and cannot fail on a bad SHMTRANSPORT_BACKEND or a missing extra.
_EXPORTS = {
    "BACKEND": "._backend",
    "Producer": ".client",
    "Consumer": ".client",
    "Handle": ".handle",
    "Loan": ".client",
    "Lease": ".client",
    "Published": ".client",
    "AsyncProducer": ".aio",
    "AsyncConsumer": ".aio",
    "InlinePolicy": ".frontend.request",
    "NO_INLINE": ".frontend.request",
    "GeneratorClient": ".frontend.client",
    "AsyncGeneratorClient": ".frontend.client",
    "TokenStream": ".frontend.client",
    "AsyncTokenStream": ".frontend.client",
    "TokenChunk": ".frontend.client",
    "Completion": ".frontend.client",
    "WorkerUnavailable": ".frontend.client",
    "FeatureItem": ".protocol.items",
    "FieldConfig": ".protocol.items",
    "PlaceholderRange": ".embedmask",
    "Reason": ".errors",
    "ShmTransportError": ".errors",
    "InvalidArgument": ".errors",
    "InvalidType": ".errors",
    "HandleError": ".errors",
    "OwnershipError": ".errors",
    "StateError": ".errors",
    "ResourceExhausted": ".errors",
    "PermissionDenied": ".errors",
    "Unavailable": ".errors",
    "IdentityMismatch": ".errors",
    "ClosedError": ".errors",
    "DeadlineExceeded": ".errors",
    "MissingDependency": ".errors",
    "InternalError": ".errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> _Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shmtransport' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    """The public names (and the module's dunders), not the helpers this module imports."""
    return sorted({name for name in globals() if name.startswith("__")} | set(__all__))
