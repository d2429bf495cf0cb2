"""``pipeline``: frontend done -> worker has the tensors on its device, per request kind, end to end.

    python benchmarks/run.py pipeline [--quick] [--json PATH]

Three processes: shmtransportd, the worker server (``shmtransport worker``'s, started by
``benchmarks/peers/segment_pread_worker.py`` to add the segment_pread ingest; CPU here: "on device" =
the verified tensors are in the worker's hands as torch tensors; on CUDA it includes the host->device
copy) and this process as the frontend. One timed span = the frontend has the rendered tensors
(numpy) -> the worker stamps ``on_device`` (its perf_counter, trailing metadata; CLOCK_MONOTONIC
is system-wide on Linux, so the two processes' stamps subtract). Each request generates 1 token.

Paths, alternating in rounds after warm-up, identity verification ON for all of them:
- ``shm``: ``put_many(digest=True)`` (one copy, digest fused) -> handles in GenerateRequest -> worker
  Acquire -> digest recomputed from shared memory (C kernel) -> zero-copy views: the renderer's
  output is a fresh array, copied once. Ratios ``*_put``.
- ``shm_loan``: the renderer wrote its output in place into loans (untimed: that is rendering, as
  ``Renderer.image_into`` does for images); timed: commit with the digest computed from shared
  memory -> the same worker path. The headline ratios use this path: it is what the pipeline does
  for images (``Renderer.image_into``) and video (``Renderer.assemble_video``).
- ``inline``: tensors as ``TensorData.inline`` bytes (tobytes, serialize, gRPC, parse) -> digest.
- ``segment_pread``: SMG style (benchmarks/peers/segment_pread.py): one fresh /dev/shm file per
  tensor (O_EXCL, posix_fallocate, write) + the digest computed on the frontend; the worker
  (benchmarks/peers/segment_pread_worker.py) preads each file (copy 1) into a bytearray (copy 2),
  unlinks it and verifies the digest.

Rows: ``handoff`` per kind and path; ``verify_64MiB``: the worker-side identity check alone (the
XXH3-128 tree digest of the 64 MiB request's bytes, in this process) and ratio
``pipeline_verify_share_64MiB`` (that cost / the headline shm handoff); ``shm_noverify``: the shm
(put) handoff with a worker started ``--verify never``. Ratios at the 64 MiB request (63.5 MiB: a
2x2-mergeable Qwen2-VL grid of 116x122 patches, 1176-wide float32 rows, just under 64 MiB).
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import secrets
import shutil
import statistics
import tempfile
import time
import traceback

import numpy as np
from harness import Report
from peers import segment_pread_worker
from peers.segment_pread import PREFIX as SEG_PREFIX

MiB = 1 << 20
BIG = "64MiB"
KINDS = {  # name -> list of (modality, grid)
    "image_448": [("image", (1, 32, 32))],
    "image_896x1344": [("image", (1, 58, 86))],
    "video_8f_448": [("video", (4, 32, 32))],
    "audio_30s": [("audio", None)],
    BIG: [("image", (1, 116, 122))],
}
QUICK_KINDS = ("image_448", "video_8f_448", "audio_30s", BIG)
PATHS = ("shm", "shm_loan", "inline", "segment_pread")


def _items(kind: str):
    from shmtransport.frontend.generate import Item
    from shmtransport.frontend.media import synthetic_features

    out = []
    for i, (modality, grid) in enumerate(KINDS[kind]):
        kw = synthetic_features(modality, grid=grid, seed=i) if grid else synthetic_features(modality, seed=i)
        out.append(Item(modality, kw))
    return out


class SegmentFrontend:
    """The SMG-style producer: a fresh /dev/shm file per tensor, names in TensorData.shm."""

    def __init__(self):
        self._tag = f"{SEG_PREFIX}{os.getpid()}_{secrets.token_hex(4)}_"
        self._seq = itertools.count()
        self.written: list[str] = []

    def build(self, fe, items, t_start: float):
        from shmtransport.frontend.generate import Prepared
        from shmtransport.frontend.prompt import expand_prompt
        from shmtransport.frontend.request import placeholder_to_proto
        from shmtransport.identity import SCHEMES, cache_identifier, combine, tensor_digest
        from shmtransport.protocol.items import modality_to_pb
        from shmtransport.tensors import as_byte_array
        from shmtransport.v1 import daemon_pb2 as dpb
        from shmtransport.v1 import features_pb2 as fpb
        from shmtransport.v1 import generate_pb2 as gpb

        prompt = expand_prompt("describe", [(it.modality, it.kwargs) for it in items])
        mm = fpb.MultimodalRequest(prompt_len=len(prompt.token_ids))
        batches = {}
        for it, ph in zip(items, prompt.placeholders):
            batch = batches.get(it.modality)
            if batch is None:
                batch = batches[it.modality] = mm.batches.add(modality=modality_to_pb(it.modality),
                                                              identity_scheme=SCHEMES["xxh3-128"].pb)
            msg = batch.items.add(placeholder=placeholder_to_proto(ph))
            entries = []
            for key in sorted(it.kwargs):
                flat, dtype, shape = as_byte_array(it.kwargs[key])
                name = f"{self._tag}{next(self._seq)}"
                path = os.path.join("/dev/shm", name)
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                self.written.append(path)
                try:
                    os.posix_fallocate(fd, 0, max(flat.nbytes, 1))
                    view = memoryview(flat)
                    while view:
                        view = view[os.write(fd, view):]
                finally:
                    os.close(fd)
                digest = tensor_digest("xxh3-128", flat)
                kw = msg.kwargs[key]
                kw.tensor.CopyFrom(fpb.TensorData(shape=shape, dtype=dtype, digest=digest,
                                                  shm=dpb.Handle(name=name, offset=0, nbytes=flat.nbytes)))
                kw.field.kind = fpb.FIELD_KIND_BATCHED
                entries.append((key, dtype, shape, flat.nbytes, digest))
            msg.mm_hash = combine("xxh3-128", it.modality, entries)
            msg.cache_identifier = cache_identifier(msg.mm_hash)
            batch.mm_hashes.append(msg.mm_hash)
            batch.mm_placeholders.append(msg.placeholder)
            for key in sorted(it.kwargs):
                if key not in batch.batched_keys:
                    batch.batched_keys.append(key)
        req = gpb.GenerateRequest(request_id=f"seg-{next(self._seq)}", multimodal=mm)
        req.token_ids.ids.extend(prompt.token_ids)

        class _Nothing:
            handles = []

            def release(self):
                pass

        return Prepared(req, _Nothing(), [], "segment_pread", t_start, 0, 0, 3 * sum(len(it.kwargs) for it in items))

    def cleanup(self) -> None:
        for path in self.written:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.written.clear()


def run(quick: bool) -> Report:
    from shmtransport.client import Producer
    from shmtransport.frontend.generate import Frontend
    from shmtransport.identity import tensor_digest
    from shmtransport.protocol.limits import DEFAULT_LIMITS
    from shmtransport.protocol.spec import INGEST_KEY
    from shmtransport.worker.process import WorkerProcess, start_daemon_process, stop_process

    report = Report("pipeline", extra_versions=("grpcio", "torch", "xxhash"))
    rounds, warmup = (5, 1) if quick else (20, 3)
    kinds = QUICK_KINDS if quick else tuple(KINDS)
    started = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="stb-pipe-", dir="/tmp")
    d_sock = os.path.join(tmp, "d.sock")
    prefix = "stbpipe" + secrets.token_hex(2)
    cap = 256 * MiB
    limits = dataclasses.replace(DEFAULT_LIMITS, max_inline_bytes=cap)
    daemon = worker = noverify = None
    seg = SegmentFrontend()
    try:
        daemon = start_daemon_process(d_sock, 512 * MiB, prefix)
        worker = WorkerProcess(os.path.join(tmp, "w.sock"), d_sock, device="cpu", max_inline_bytes=cap,
                               entry=(str(segment_pread_worker.SCRIPT),))
        noverify = WorkerProcess(os.path.join(tmp, "w2.sock"), d_sock, device="cpu", max_inline_bytes=cap,
                                 extra_args=("--verify", "never"))
        with Producer(d_sock) as producer, Frontend(worker.address, producer, limits=limits) as fe, \
                Frontend(noverify.address, producer, limits=limits) as fe_nv:
            for kind in kinds:
                items = _items(kind)
                nbytes = sum(it.nbytes for it in items)
                paths = PATHS + (("shm_noverify",) if kind == BIG else ())
                samples = {p: [] for p in paths}
                tokens = {p: set() for p in paths}
                idents = {p: set() for p in paths}
                gc.collect()
                for r in range(warmup + rounds):
                    order = paths[r % len(paths):] + paths[:r % len(paths)]
                    for path in order:
                        if path == "shm_loan":  # the renderer writes in place (untimed: that is rendering)
                            run_items = _loaned(producer, items)
                        t0 = time.perf_counter()
                        if path == "shm_loan":
                            out = _send(fe, fe.build(run_items, "describe", mode="shm", t_start=t0), None)
                            del run_items
                        elif path == "segment_pread":
                            prepared = seg.build(fe, items, t0)
                            out = _send(fe, prepared, ((INGEST_KEY, segment_pread_worker.INGEST),))
                            seg.written.clear()  # the worker unlinked them
                        elif path == "shm_noverify":
                            out = _send(fe_nv, fe_nv.build(items, "describe", mode="shm", sampling=_S,
                                                          stopping=_STOP, t_start=t0), None)
                        else:
                            out = _send(fe, fe.build(items, "describe", mode=path, sampling=_S, stopping=_STOP,
                                                     t_start=t0), None)
                        if r >= warmup:
                            samples[path].append(out.handoff_s)
                        tokens[path].add(tuple(out.token_ids))
                        idents[path].add(tuple(out.identities))
                ref_tokens, ref_ids = tokens["shm"], idents["shm"]
                for path in paths:
                    correct = len(tokens[path]) == 1 and tokens[path] == ref_tokens and idents[path] == ref_ids
                    med = statistics.median(samples[path])
                    report.add_row("handoff", samples[path], correct, kind=kind, path=path, nbytes=nbytes,
                                   extra={"gbps": round(nbytes / med / 1e9, 3)})
                if kind == BIG:
                    flat = [np.ascontiguousarray(v).reshape(-1).view(np.uint8) for it in items
                            for v in it.kwargs.values()]
                    verify = []
                    for _ in range(warmup + rounds):
                        t0 = time.perf_counter()
                        for f in flat:
                            tensor_digest("xxh3-128", f)
                        verify.append(time.perf_counter() - t0)
                    report.add_row("verify_64MiB", verify[warmup:], True, kind=kind, path="xxh3-128 tree digest",
                                   nbytes=nbytes, extra={"gbps": round(nbytes / statistics.median(verify) / 1e9, 3)})
                del items
        # Headline: the path the pipeline takes for a 64 MiB image (Renderer.image_into writes the pixel
        # patches in place: shm_loan); *_put: the same request when the renderer's output is a fresh
        # array copied once (put with the digest fused). Both carry the targets.
        inline = report.median("handoff", kind=BIG, path="inline")
        segment = report.median("handoff", kind=BIG, path="segment_pread")
        loan = report.median("handoff", kind=BIG, path="shm_loan")
        put = report.median("handoff", kind=BIG, path="shm")
        report.ratios["pipeline_inline_speedup_64MiB"] = inline / loan
        report.ratios["pipeline_segment_pread_speedup_64MiB"] = segment / loan
        report.ratios["pipeline_inline_speedup_64MiB_put"] = inline / put
        report.ratios["pipeline_segment_pread_speedup_64MiB_put"] = segment / put
        shm = loan
        report.ratios["pipeline_verify_share_64MiB"] = report.median("verify_64MiB", kind=BIG) / shm
        report.targets.update({"pipeline_inline_speedup_64MiB": ">= 20", "pipeline_segment_pread_speedup_64MiB": ">= 3",
                               "pipeline_inline_speedup_64MiB_put": ">= 20",
                               "pipeline_segment_pread_speedup_64MiB_put": ">= 3"})
    except Exception:  # noqa: BLE001
        report.notes.append("ERROR:\n" + traceback.format_exc(limit=8))
        report.rows.append({"name": "pipeline", "params": {}, "median_s": 0.0, "p99_s": 0.0, "n": 0,
                            "correct": False})
    finally:
        seg.cleanup()
        for w in (worker, noverify):
            if w is not None:
                w.stop()
        stop_process(daemon)
        shutil.rmtree(tmp, ignore_errors=True)
    leaked = [n for n in os.listdir("/dev/shm") if n.startswith((prefix, SEG_PREFIX))]
    if leaked:
        report.notes.append(f"LEAK: {leaked}")
    report.notes.append(f"suite wall time {time.perf_counter() - started:.1f} s ({'quick' if quick else 'full'}; "
                        f"{rounds} rounds after {warmup} warm-up; worker device cpu; 1 token per request)")
    return report


def _loaned(producer, items):
    """The items with every large tensor written into a loan, as the renderer's last step does."""
    from shmtransport.frontend.generate import Item

    out = []
    for it in items:
        kw = {}
        for key, value in it.kwargs.items():
            if value.nbytes >= MiB:
                loan = producer.loan(shape=value.shape, dtype=value.dtype)
                np.copyto(loan.array, value)
                value = loan
            kw[key] = value
        out.append(Item(it.modality, kw))
    return out


_S = {"seed": 1, "temperature": 0.0}
_STOP = {"max_tokens": 1}


def _send(fe, prepared, metadata):
    prepared.request.sampling.seed = 1
    prepared.request.sampling.temperature = 0.0
    prepared.request.stopping.max_tokens = 1
    return fe.send(prepared, metadata=metadata)
