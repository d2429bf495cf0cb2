"""Fuzzing the worker's ``open_request`` with forged and random requests: forged TensorData
(handles with other offsets, generations, sizes, names, instances; swapped handles; wrong shapes,
dtypes, digests, commit tokens; inline bytes), forged placeholders, identities and schemes, and
bit-flipped serialized requests.

Invariant: a typed ``ShmTransportError``, or engine inputs whose every tensor holds exactly the
bytes the frontend put for that item and key (identity verified before anything is returned); and
no lease is left behind either way.
"""
from __future__ import annotations

import gc
import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmtransport import testing
from shmtransport.client import Consumer, Producer
from shmtransport.embedmask import PlaceholderRange
from shmtransport.errors import Reason, ShmTransportError
from shmtransport.frontend import request as frontend
from shmtransport.protocol.items import FeatureItem
from shmtransport.tensors import DTYPES
from shmtransport.v1 import features_pb2 as fpb
from shmtransport.worker import request as worker

TIMEOUT_S = 10.0
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "80"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
U64 = (1 << 64) - 1


def items() -> list[FeatureItem]:
    rng = np.random.default_rng(3)
    return [
        FeatureItem("image", {"pixel_values": rng.standard_normal((4, 8), dtype=np.float32),
                              "image_grid_thw": np.int64([[1, 2, 2]])}, PlaceholderRange(1, 6)),
        FeatureItem("image", {"pixel_values": rng.standard_normal((4, 8), dtype=np.float32),
                              "image_grid_thw": np.int64([[1, 2, 2]])}, PlaceholderRange(10, 6)),
        FeatureItem("audio", {"input_features": rng.standard_normal((16,), dtype=np.float32)}, PlaceholderRange(20, 5)),
    ]


def _tensor_datas(req: fpb.MultimodalRequest) -> list[fpb.TensorData]:
    return [it.kwargs[k].tensor for b in req.batches for it in b.items for k in sorted(it.kwargs)]


@st.composite
def mutations(draw, base: fpb.MultimodalRequest):
    req = fpb.MultimodalRequest()
    req.CopyFrom(base)
    tds = _tensor_datas(req)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["handle", "swap", "shape", "dtype", "digest", "token", "inline", "clear",
                                     "placeholder", "mm_hash", "scheme", "modality", "duplicate", "bitflip"]))
        td = draw(st.sampled_from(tds)) if tds else None
        if kind == "handle" and td is not None and td.HasField("shm"):
            field = draw(st.sampled_from(["offset", "generation", "nbytes", "name", "instance_id", "owner_id"]))
            if field in ("name", "instance_id", "owner_id"):
                setattr(td.shm, field, draw(st.text(max_size=20)))
            else:
                value = draw(st.one_of(st.integers(0, U64), st.integers(-64, 64).map(
                    lambda d, f=field, t=td: max(0, getattr(t.shm, f) + d))))
                setattr(td.shm, field, value)
        elif kind == "swap" and len(tds) >= 2:
            a, b = draw(st.permutations(tds))[:2]
            if a.HasField("shm") and b.HasField("shm"):
                a.shm.CopyFrom(b.shm)
        elif kind == "shape" and td is not None:
            del td.shape[:]
            td.shape.extend(draw(st.lists(st.integers(0, 1 << 32 - 1), max_size=4)))
        elif kind == "dtype" and td is not None:
            td.dtype = draw(st.one_of(st.sampled_from(sorted(DTYPES)), st.text(max_size=8)))
        elif kind == "digest" and td is not None:
            td.digest = draw(st.binary(max_size=20))
        elif kind == "token" and td is not None:
            td.commit_token = draw(st.binary(max_size=20))
        elif kind == "inline" and td is not None:
            td.inline = draw(st.binary(max_size=160))
        elif kind == "clear" and td is not None:
            td.ClearField("shm")
        elif kind == "placeholder":
            it = draw(st.sampled_from([it for b in req.batches for it in b.items]))
            it.placeholder.offset = draw(st.integers(0, 1 << 32 - 1))
            it.placeholder.length = draw(st.integers(0, 64))
            if draw(st.booleans()):
                it.placeholder.is_embed_nbits = draw(st.integers(0, 64))
                it.placeholder.is_embed = draw(st.binary(max_size=9))
        elif kind == "mm_hash":
            it = draw(st.sampled_from([it for b in req.batches for it in b.items]))
            it.mm_hash = draw(st.one_of(st.text(max_size=50), st.just("xxh3-128:" + "0" * 32)))
        elif kind == "scheme":
            draw(st.sampled_from(list(req.batches))).identity_scheme = draw(st.integers(0, 5))
        elif kind == "modality":
            draw(st.sampled_from(list(req.batches))).modality = draw(st.integers(0, 5))
        elif kind == "duplicate":
            b = draw(st.sampled_from(list(req.batches)))
            b.items.add().CopyFrom(b.items[0])
        elif kind == "bitflip":
            raw = bytearray(req.SerializeToString())
            pos = draw(st.integers(0, len(raw) - 1))
            raw[pos] ^= 1 << draw(st.integers(0, 7))
            try:
                req = fpb.MultimodalRequest.FromString(bytes(raw))
            except Exception:  # noqa: BLE001 - not a message: the gRPC layer would refuse it
                pass
            tds = _tensor_datas(req)
    return req


def _check_bytes(inputs, expected) -> None:
    """Every engine tensor holds the frontend's bytes for that item and key (no view kept)."""
    for m, per_item in inputs.mm_kwargs.items():
        for i, kw in enumerate(per_item):
            for k, t in kw.items():
                want = expected.get((m, i, k))
                got = t.contiguous().view(-1).numpy().view(np.uint8).tobytes() if t.numel() else b""
                assert want is not None and got == want, f"{m}[{i}].{k}: bytes not the frontend's"


def test_forged_requests_get_a_typed_error_or_exactly_the_frontends_bytes_and_leave_no_lease(daemon):
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        originals = items()
        # Every tensor in shared memory: the handle mutations must reach the worker's checks (with
        # the default policy these small tensors would all ride inline).
        built = frontend.build_request(producer, originals, inline=frontend.NO_INLINE)
        base = built.request
        with worker.open_request(consumer, base):  # the genuine request works (and commits the loans)
            pass
        expected = {}
        for m in ("image", "audio"):
            for i, it in enumerate([x for x in originals if x.modality == m]):
                for k, v in it.kwargs.items():
                    expected[(m, i, k)] = np.asarray(v).tobytes()
        verdicts: dict = {}

        @FUZZ
        @given(mutations(base))
        def run(req):
            try:
                inputs = worker.open_request(consumer, req)
            except ShmTransportError as exc:
                assert exc.reason is not Reason.INTERNAL, exc
                verdicts[exc.reason.value] = verdicts.get(exc.reason.value, 0) + 1
            else:
                verdicts["ok"] = verdicts.get("ok", 0) + 1
                with inputs:
                    _check_bytes(inputs, expected)
                del inputs
            consumer.flush()
            if daemon.stat().live_leases:  # a view may await collection: give it a bounded chance
                gc.collect()
                consumer.flush()
                s = testing.settle_daemon(daemon, max_leases=0, timeout_s=2)
                assert s.live_leases == 0, "open_request left a lease behind"

        run()
        assert verdicts.get("ok", 0) >= 1 and len(verdicts) >= 3, verdicts
        built.release()
