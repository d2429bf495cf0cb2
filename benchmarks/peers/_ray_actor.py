"""The consumer of ``ray_put``: a Ray actor, i.e. its own worker process started by the raylet. It
imports this module by name (``JobConfig.code_search_path`` puts ``benchmarks/`` on its path)."""
from __future__ import annotations

import os

import numpy as np

from .common import verify
from .ray_put import import_package

ray = import_package()


@ray.remote
class RayConsumer:
    def __init__(self) -> None:
        self.held: np.ndarray | None = None

    def pid(self) -> int:
        return os.getpid()

    def hold(self, array: np.ndarray) -> None:
        """Ray resolved the ref argument: a read-only numpy array over the object in the store."""
        self.held = array

    def check(self, digest: int, corrupt: bool) -> bool:
        held, self.held = self.held, None
        if held is None:
            raise RuntimeError("no object held")
        return verify(held, digest, corrupt)
