"""The reference worker with SMG's ingest as one more way in: the ``segment_pread`` path of
``benchmarks/suites/pipeline.py``, which starts it in place of ``shmtransport worker``.

    python benchmarks/peers/segment_pread_worker.py --socket PATH --daemon-socket PATH
        [--device cpu] [--max-inline-bytes N] [--log-level WARNING]

A request with metadata ``x-shmt-ingest: segment-pread`` names in every ``TensorData.shm`` a fresh
file in /dev/shm (prefix ``stbench_seg_``) that the worker reads with ``pread`` (copy 1) into a
``bytearray`` (copy 2) and unlinks, as SMG's worker does, then checks the identity from those bytes.
Every other request takes the worker's shared-memory path. The ingest plugs into the worker through
``GeneratorService(ingests=...)`` (``shmtransport.worker.server``).
"""
from __future__ import annotations

import os
import pathlib
import sys

if not __package__:  # run as a script: the peers package is beside this file's directory
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from peers._segments import open_segment
from peers.segment_pread import PREFIX, pread_twice

INGEST = "segment-pread"
SCRIPT = pathlib.Path(__file__).resolve()


def ingest(service, mm, prompt_len: int) -> list:
    """The request's items from its segment files: pread + bytearray per tensor, unlink, verify."""
    import numpy as np
    import torch

    from shmtransport.errors import IdentityMismatch
    from shmtransport.identity import combine, tensor_digest
    from shmtransport.protocol.validate import validate_request
    from shmtransport.tensors import DTYPES, to_torch
    from shmtransport.worker.model import MMItem

    checked = validate_request(mm, service.limits, prompt_len)
    items = []
    for batch in checked.batches:
        for it in batch.items:
            arrays, entries = {}, []
            for key, t in it.tensors.items():
                if t.kind == "shm":
                    arrays[key] = _pread_segment(t.source.shm.name, t.nbytes, t.dtype, t.shape)
                else:
                    arrays[key] = np.frombuffer(t.source, dtype=DTYPES[t.dtype]).reshape(t.shape)
                if service.verify == "always":
                    digest = tensor_digest(batch.scheme, arrays[key].reshape(-1).view(np.uint8))
                    entries.append((key, t.dtype, t.shape, t.nbytes, digest))
            if service.verify == "always" and it.mm_hash:
                identity = combine(batch.scheme, batch.modality, entries)
                if identity != it.mm_hash:
                    raise IdentityMismatch(f"{batch.modality}[{it.index}]: payload identity {identity} != "
                                           f"mm_hash {it.mm_hash}")
            mask = it.placeholder.is_embed
            is_embed = torch.from_numpy(np.ascontiguousarray(mask.to_bools(), dtype=np.bool_)) if mask else None
            items.append(MMItem(batch.modality, {k: to_torch(a, it.tensors[k].dtype) for k, a in arrays.items()},
                                it.placeholder.offset, it.placeholder.length, is_embed))
    return items


def _pread_segment(name: str, nbytes: int, dtype: str, shape):
    import numpy as np

    from shmtransport.errors import InvalidArgument
    from shmtransport.tensors import DTYPES

    try:
        path, fd = open_segment(name, PREFIX)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    try:
        buf = pread_twice(fd, nbytes, name)
    except EOFError as exc:
        raise InvalidArgument(str(exc)) from None
    finally:
        os.close(fd)
        os.unlink(path)
    return np.frombuffer(buf, dtype=DTYPES[dtype]).reshape(shape)


def main(argv: list[str] | None = None) -> int:
    """The options ``WorkerProcess`` passes; the same ready line as ``shmtransport worker``."""
    from shmtransport.worker.process import serve_entry

    return serve_entry("segment_pread worker", argv, ingests={INGEST: ingest})


if __name__ == "__main__":
    sys.exit(main())
