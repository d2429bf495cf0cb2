"""The identity-scheme registry (``identity.SCHEMES``): adding a scheme is one entry.

A scheme registered here only (nothing else edited) is built by the frontend, passes validation,
rides shared memory through a real daemon and is verified by the worker; every registered scheme
round-trips through the wire enum; an unknown name or enum value is a typed InvalidArgument.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from shmtransport import identity
from shmtransport.client import Consumer, Producer
from shmtransport.embedmask import PlaceholderRange
from shmtransport.errors import IdentityMismatch, InvalidArgument
from shmtransport.frontend.request import NO_INLINE, build_request
from shmtransport.protocol.capabilities import server_info
from shmtransport.protocol.envelope import decode_envelope
from shmtransport.protocol.items import FeatureItem
from shmtransport.protocol.validate import validate_request
from shmtransport.v1 import features_pb2 as fpb

TIMEOUT_S = 10.0
NEW_PB = 1000  # a value features.proto does not declare: proto3 enums carry it unchanged


def _sha256(buf) -> bytes:
    return hashlib.sha256(memoryview(buf).cast("B")).digest()


def _sha256_msgpack(modality: str, raw) -> str:
    return "sha256-mp:" + hashlib.sha256(modality.encode() + b"\0" + bytes(raw)).hexdigest()


@pytest.fixture
def sha256_scheme(monkeypatch) -> identity.IdentityScheme:
    """A two-level scheme (SHA-256 per tensor and over the framed entries): one registry entry."""
    scheme = identity.IdentityScheme("sha256", NEW_PB, lambda buf, threads: _sha256(buf), _sha256, 32)
    monkeypatch.setitem(identity.SCHEMES, scheme.name, scheme)
    return scheme


@pytest.fixture
def msgpack_scheme(monkeypatch) -> identity.IdentityScheme:
    """A scheme over the kwargs MessagePack bytes, like grpc-mm: one registry entry."""
    scheme = identity.IdentityScheme("sha256-mp", NEW_PB + 1, msgpack_identity=_sha256_msgpack)
    monkeypatch.setitem(identity.SCHEMES, scheme.name, scheme)
    return scheme


def _items() -> list[FeatureItem]:
    rng = np.random.default_rng(3)
    return [FeatureItem("image", {"pixel_values": rng.standard_normal((64, 32), dtype=np.float32),
                                  "image_grid_thw": np.int64([[1, 8, 8]])}, PlaceholderRange(0, 16)),
            FeatureItem("audio", {"input_features": rng.standard_normal((128,), dtype=np.float32)},
                        PlaceholderRange(20, 4))]


def _forge(request: fpb.MultimodalRequest, scheme: str) -> fpb.MultimodalRequest:
    """The request with its first item claiming another (well-formed) identity of ``scheme``."""
    forged = fpb.MultimodalRequest.FromString(request.SerializeToString())
    batch = forged.batches[0]
    fake = f"{scheme}:" + "ab" * 32
    batch.items[0].mm_hash = batch.mm_hashes[0] = fake
    batch.items[0].cache_identifier = ""
    batch.items[0].ClearField("routing_marker")
    return forged


# ---------------------------------------------------------------------------------------------
# Every entry on the wire, and the typed error
# ---------------------------------------------------------------------------------------------
def test_every_registered_scheme_round_trips_through_the_proto_enum():
    assert len({s.pb for s in identity.SCHEMES.values()}) == len(identity.SCHEMES)
    for name, scheme in identity.SCHEMES.items():
        assert scheme.name == name and identity.identity_scheme(name) is scheme
        assert fpb.IdentityScheme.Name(scheme.pb) != "IDENTITY_SCHEME_UNSPECIFIED"  # declared in features.proto
        wire = fpb.MultimodalInputs(identity_scheme=scheme.pb).SerializeToString()
        assert identity.scheme_from_pb(fpb.MultimodalInputs.FromString(wire).identity_scheme) is scheme
    assert identity.scheme_from_pb(fpb.IDENTITY_SCHEME_UNSPECIFIED).name == identity.DEFAULT_SCHEME
    assert list(server_info().identity_schemes) == list(identity.SCHEMES)


@pytest.mark.parametrize("bad", ["md5", "", "XXH3-128", None, 3, ["xxh3-128"]])
def test_an_unknown_scheme_name_is_invalid_argument_naming_the_known_ones(bad):
    with pytest.raises(InvalidArgument, match="unknown identity scheme") as exc:
        identity.identity_scheme(bad)
    assert all(name in str(exc.value) for name in identity.SCHEMES)
    with pytest.raises(InvalidArgument, match="unknown identity scheme"):
        build_request(None, _items(), scheme=bad, mode="inline")


def test_an_unknown_enum_value_is_invalid_argument():
    built = build_request(None, _items(), mode="inline")
    built.request.batches[0].identity_scheme = NEW_PB
    with pytest.raises(InvalidArgument, match=f"unknown identity scheme {NEW_PB}"):
        validate_request(built.request)


# ---------------------------------------------------------------------------------------------
# A new scheme: one entry, accepted and verified end to end
# ---------------------------------------------------------------------------------------------
def test_a_new_tensor_scheme_travels_shared_memory_and_the_worker_verifies_it(daemon, sha256_scheme):
    pytest.importorskip("torch")
    from shmtransport.worker.request import open_request

    items = _items()
    expected = [identity.item_identity(it.modality, it.kwargs, scheme="sha256") for it in items]
    assert all(e.startswith("sha256:") and len(e) == len("sha256:") + 64 for e in expected)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        with build_request(producer, items, scheme="sha256", prompt_len=32, inline=NO_INLINE,
                           with_markers=True) as built:
            req = built.request
            assert [b.identity_scheme for b in req.batches] == [NEW_PB, NEW_PB]
            assert [it.mm_hash for b in req.batches for it in b.items] == expected
            tds = [kw.tensor for b in req.batches for it in b.items for kw in it.kwargs.values()]
            assert all(td.WhichOneof("payload") == "shm" and len(td.digest) == 32 for td in tds)
            assert [b.scheme for b in validate_request(req, prompt_len=32).batches] == ["sha256", "sha256"]
            with open_request(consumer, fpb.MultimodalRequest.FromString(req.SerializeToString()),
                              prompt_len=32) as inputs:
                assert [inputs.identities[m][0] for m in ("image", "audio")] == expected
            with pytest.raises(IdentityMismatch, match="payload identity"):
                open_request(consumer, _forge(req, "sha256"), prompt_len=32)
        consumer.flush()
        assert consumer.stat().live_leases == 0


@pytest.mark.parametrize("mode", ["inline", "msgpack"])
def test_a_new_tensor_scheme_inline_and_from_an_envelope(sha256_scheme, mode):
    pytest.importorskip("torch")
    from shmtransport.worker.request import open_request

    items = _items()
    built = build_request(None, items, scheme="sha256", mode=mode)
    expected = [identity.item_identity(it.modality, it.kwargs, scheme="sha256") for it in items]
    assert [it.mm_hash for b in built.request.batches for it in b.items] == expected
    assert open_request(None, built.request).identities == {"image": expected[:1], "audio": expected[1:]}
    with pytest.raises(InvalidArgument, match="not a sha256 identity"):
        validate_request(_forge(built.request, "blake3"))
    if mode == "msgpack":  # an envelope hash of the new scheme is carried, then verified by the frontend
        import base64

        raws = [it.kwargs_msgpack for b in built.request.batches for it in b.items]
        envelope = {"mm_hashes": {"image": [expected[0]], "audio": [expected[1]]},
                    "mm_placeholders": {"image": [[0, 16]], "audio": [[20, 4]]},
                    "kwargs_data": {m: [base64.b64encode(r).decode()] for m, r in zip(("image", "audio"), raws)}}
        decoded = decode_envelope(envelope)
        assert [it.mm_hash for it in decoded] == expected
        decoded[0].mm_hash = "sha256:" + "cd" * 32
        with pytest.raises(IdentityMismatch):
            build_request(None, decoded, scheme="sha256", mode="msgpack")


def test_a_new_msgpack_scheme_needs_the_msgpack_bytes_and_the_worker_verifies_it(msgpack_scheme):
    pytest.importorskip("torch")
    from shmtransport.worker.request import open_request

    items = _items()
    with pytest.raises(InvalidArgument, match="defined over kwargs MessagePack"):
        build_request(None, items, scheme="sha256-mp", mode="inline")
    with pytest.raises(InvalidArgument, match="computed over the msgpack payload"):
        identity.item_identity("image", items[0].kwargs, scheme="sha256-mp")
    built = build_request(None, items, scheme="sha256-mp", mode="msgpack")
    raws = [it.kwargs_msgpack for b in built.request.batches for it in b.items]
    expected = [_sha256_msgpack(it.modality, raw) for it, raw in zip(items, raws)]
    assert [it.mm_hash for b in built.request.batches for it in b.items] == expected
    assert open_request(None, built.request).identities == {"image": expected[:1], "audio": expected[1:]}
    with pytest.raises(IdentityMismatch, match="payload identity"):
        open_request(None, _forge(built.request, "sha256-mp"))
    tensors = build_request(None, items, scheme="xxh3-128", mode="inline").request
    for batch in tensors.batches:
        batch.identity_scheme = msgpack_scheme.pb
        for it in batch.items:
            it.mm_hash = it.cache_identifier = ""
        del batch.mm_hashes[:]
    with pytest.raises(InvalidArgument, match="the sha256-mp identity needs kwargs_msgpack"):
        validate_request(tensors)
