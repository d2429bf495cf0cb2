"""shmtransport: move decoded multimodal tensors between processes through daemon-owned shared memory."""
from ._backend import BACKEND

__version__ = "0.1.0"

__all__ = ["BACKEND", "__version__"]
