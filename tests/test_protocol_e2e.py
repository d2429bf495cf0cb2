"""Issue 4 end to end through a real daemon: frontend -> shared memory -> worker (also across a
spawned process), identity verification before execution, lease release on every path."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmtransport.client import Consumer, Producer
from shmtransport.embedmask import EmbedMask, PlaceholderRange
from shmtransport.errors import IdentityMismatch, InvalidArgument, Reason
from shmtransport.frontend import request as frontend
from shmtransport.frontend.request import DEFAULT_INLINE, NO_INLINE, InlinePolicy
from shmtransport.identity import item_identity
from shmtransport.protocol.items import FeatureItem, FieldConfig
from shmtransport.protocol.limits import DEFAULT_LIMITS
from shmtransport.testing import run_in_child
from shmtransport.v1 import features_pb2 as fpb
from shmtransport.worker import request as worker

TIMEOUT_S = 10.0


def mixed_items() -> list[FeatureItem]:
    rng = np.random.default_rng(7)
    return [
        FeatureItem("image", {"pixel_values": torch.from_numpy(rng.standard_normal((4, 8), dtype=np.float32))
                              .to(torch.bfloat16), "image_grid_thw": np.int64([[1, 2, 2]])},
                    PlaceholderRange(1, 6, EmbedMask.from_bools([False, True, True, True, True, False])),
                    {"image_grid_thw": FieldConfig("batched", keep_on_cpu=True)}),
        FeatureItem("video", {"pixel_values_videos": rng.standard_normal((2, 3, 4), dtype=np.float32),
                              "video_grid_thw": np.int64([[2, 1, 1]])}, PlaceholderRange(10, 4)),
        FeatureItem("audio", {"input_features": rng.standard_normal((16,), dtype=np.float32).astype(np.float16),
                              "feature_attention_mask": np.ones(16, np.bool_)}, PlaceholderRange(20, 5)),
        FeatureItem("image", {"pixel_values": torch.zeros((4, 8), dtype=torch.bfloat16),
                              "image_grid_thw": np.int64([[1, 2, 2]])}, PlaceholderRange(30, 4),
                    {"image_grid_thw": FieldConfig("batched", keep_on_cpu=True)}),
    ]


def summarize(inputs: worker.EngineInputs) -> dict:
    """Everything the engine gets, as plain comparable data (tensors as dtype/shape/bytes)."""
    kw = {m: [{k: (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes()
                   if t.numel() else b"") for k, t in item.items()} for item in items]
          for m, items in inputs.mm_kwargs.items()}
    ph = {m: [(p.offset, p.length, None if p.is_embed is None else p.is_embed.tolist(), p.get_num_embeds())
              for p in items] for m, items in inputs.mm_placeholders.items()}
    return {"kwargs": kw, "placeholders": ph, "hashes": inputs.mm_hashes, "identities": inputs.identities,
            "uuids": inputs.multi_modal_uuids, "identifiers": inputs.mm_identifiers,
            "fields": {m: [dict(f) for f in fs] for m, fs in inputs.mm_fields.items()}}


def consume_in_child(socket_path: str, request_bytes: bytes) -> dict:
    """The worker process: open the request, summarize what the engine would get, consume."""
    request = fpb.MultimodalRequest.FromString(request_bytes)
    with Consumer(socket_path, timeout_s=TIMEOUT_S) as consumer:
        with worker.open_request(consumer, request) as inputs:
            assert all(t.dtype == torch.bfloat16 for t in (it["pixel_values"] for it in inputs.mm_kwargs["image"]))
            out = summarize(inputs)
        consumer.flush()
    return out


def live_leases(client) -> int:
    client.flush()
    return client.stat().live_leases


def test_mixed_image_video_audio_end_to_end_across_processes(daemon):
    items = mixed_items()
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        with frontend.build_request(producer, items, adapter="lora-a", prompt_len=40, with_markers=True,
                                    inline=NO_INLINE) as built:
            req = built.request
            assert [fpb.Modality.Name(b.modality) for b in req.batches] == ["MODALITY_IMAGE", "MODALITY_VIDEO",
                                                                            "MODALITY_AUDIO"]
            assert all(kw.tensor.WhichOneof("payload") == "shm" for b in req.batches for it in b.items
                       for kw in it.kwargs.values())
            got = run_in_child(consume_in_child, daemon.socket_path, req.SerializeToString(), timeout_s=60)
        # frontend identities are the fused per-tensor digests combined; equal to hashing from scratch
        expected = {m: [item_identity(m, it.kwargs) for it in items if it.modality == m]
                    for m in ("image", "video", "audio")}
        assert got["identities"] == got["hashes"] == got["uuids"] == expected
        assert got["identifiers"]["video"] == ["lora-a:" + expected["video"][0]]
        assert got["placeholders"]["image"][0] == (1, 6, [False, True, True, True, True, False], 4)
        assert got["placeholders"]["audio"] == [(20, 5, None, 5)]
        assert got["kwargs"]["audio"][0]["feature_attention_mask"][:2] == ("torch.bool", (16,))
        assert got["fields"]["image"][0]["image_grid_thw"].keep_on_cpu
        assert live_leases(producer) == 0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["image", "video", "audio"]),
                          st.sampled_from(["float32", "bfloat16", "int64", "uint8", "bool", "float16"]),
                          st.lists(st.integers(0, 4), min_size=1, max_size=3),
                          st.none() | st.lists(st.booleans(), min_size=3, max_size=3), st.integers(0, 2 ** 32 - 1)),
                min_size=1, max_size=4))
def test_inline_msgpack_and_shm_paths_give_identical_engine_inputs(daemon, spec):
    items, offset = [], 0
    for modality, dtype, shape, mask, seed in spec:
        rng = np.random.default_rng(seed)
        data = rng.integers(0, 256, size=int(np.prod(shape)) * torch.empty(0, dtype=getattr(torch, dtype))
                            .element_size(), dtype=np.uint8)
        if dtype == "bool":
            data &= 1
        tensors = {"a": (dtype, tuple(shape), data.tobytes()), "b": ("int64", (1, 3), np.int64([1, 2, seed]).tobytes())}
        items.append(FeatureItem(modality, tensors, PlaceholderRange(offset, 3, None if mask is None else
                                                                      EmbedMask.from_bools(mask))))
        offset += 3
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        inline = frontend.build_request(None, items, mode="msgpack").request
        assert all(it.HasField("kwargs_msgpack") for b in inline.batches for it in b.items)
        with worker.open_request(None, inline) as inputs:
            via_inline = summarize(inputs)
        with frontend.build_request(producer, items, inline=NO_INLINE) as built:
            assert [it.mm_hash for b in built.request.batches for it in b.items] == \
                [it.mm_hash for b in inline.batches for it in b.items]
            with worker.open_request(consumer, built.request) as inputs:
                via_shm = summarize(inputs)
        assert via_shm == via_inline
        assert live_leases(consumer) == 0


def test_tensors_already_in_shm_loan_commit(daemon):
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        loans = producer.loan_many([(None, (3, 4), np.float32), (None, (1, 3), np.int64)])
        loans[0].array[...] = np.arange(12, dtype=np.float32).reshape(3, 4)
        loans[1].array[...] = [[1, 2, 2]]
        handles = producer.commit_many(loans, digest=True)
        for loan in loans:
            loan._detach_views()  # the producer keeps its reference through the handle (as put_many)
        del loans, loan  # a loan keeps its slice of the mapping until it is garbage
        reference = {"pixel_values": np.arange(12, dtype=np.float32).reshape(3, 4), "image_grid_thw":
                     np.int64([[1, 2, 2]])}
        item = FeatureItem("image", {"pixel_values": handles[0], "image_grid_thw": handles[1]}, PlaceholderRange(0, 4))
        built = frontend.build_request(producer, [item])
        assert built.handles == []  # referenced, not copied
        assert built.request.batches[0].items[0].mm_hash == item_identity("image", reference)
        with worker.open_request(consumer, built.request) as inputs:
            t = inputs.mm_kwargs["image"][0]["pixel_values"]
            assert t.dtype == torch.float32 and t.sum().item() == 66.0
            del t
        producer.release(handles)
        assert live_leases(consumer) == 0


def _flip_first_byte(producer: Producer, request: fpb.MultimodalRequest) -> None:
    shm = request.batches[0].items[0].kwargs["pixel_values"].tensor.shm
    memory = producer._conn.memory(shm)  # the producer's writable mapping of the arena
    memory[0] ^= 0xFF
    del memory


@pytest.mark.parametrize("digest_sent", [True, False])
def test_identity_mismatch_rejected_before_execution_and_leases_released(daemon, digest_sent):
    items = [FeatureItem("image", {"pixel_values": np.ones((8, 8), np.float32)}, PlaceholderRange(0, 4))]
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        with frontend.build_request(producer, items, inline=NO_INLINE) as built:
            if not digest_sent:  # the item identity check alone must catch it
                built.request.batches[0].items[0].kwargs["pixel_values"].tensor.digest = b""
            _flip_first_byte(producer, built.request)
            with pytest.raises(IdentityMismatch) as excinfo:
                worker.open_request(consumer, built.request)
            assert excinfo.value.reason is Reason.IDENTITY_MISMATCH
            del excinfo
            gc.collect()
            assert live_leases(consumer) == 0
            # verify="never" is the explicit opt-out: it executes what is there
            with worker.open_request(consumer, built.request, verify="never") as inputs:
                assert inputs.mm_kwargs["image"][0]["pixel_values"].reshape(-1)[1].item() == 1.0
            assert live_leases(consumer) == 0


def test_leases_released_after_consumption(daemon):
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        with frontend.build_request(producer, mixed_items(), inline=NO_INLINE) as built:
            inputs = worker.open_request(consumer, built.request)
            assert consumer.stat().live_leases == len(inputs.leases) == 8
            pv = inputs.mm_kwargs["video"][0]["pixel_values_videos"]
            lease = inputs.leases[4]
            assert pv.data_ptr() == lease.tensor().data_ptr()  # the lease's private (copy-on-write) view
            del pv, lease
            inputs.consumed()
            assert inputs.mm_kwargs == {}
            assert live_leases(consumer) == 0


def test_leases_released_after_a_validation_error_during_open(daemon):
    items = mixed_items()
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        with frontend.build_request(producer, items, with_markers=True) as built:
            built.request.batches[2].items[0].ClearField("mm_hash")  # then the marker is checked vs payload
            built.request.batches[2].items[0].ClearField("cache_identifier")
            built.request.batches[2].ClearField("mm_hashes")
            built.request.batches[2].items[0].routing_marker = "0" * 64
            with pytest.raises(IdentityMismatch, match="routing marker"):
                worker.open_request(consumer, built.request)
            assert live_leases(consumer) == 0


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_fallback_uuids_namespaced_and_aggregated_only(daemon, mode):
    items = mixed_items()[:2]
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        with frontend.build_request(producer, items) as built:
            image = built.request.batches[0]
            content = image.items[0].mm_hash
            image.items[0].mm_hash = image.items[0].cache_identifier = ""
            image.ClearField("mm_hashes")
            with worker.open_request(consumer, built.request, mode=mode, unified_vision=True) as inputs:
                if mode == "aggregated":
                    assert inputs.multi_modal_uuids["vision_chunk"] == [worker.FALLBACK_UUID_PREFIX + content]
                    assert not content.startswith(worker.FALLBACK_UUID_PREFIX)
                else:
                    assert "vision_chunk" not in inputs.multi_modal_uuids  # no UUIDs: modality omitted
                assert inputs.multi_modal_uuids["video"] == [built.request.batches[1].items[0].mm_hash]
        assert live_leases(consumer) == 0


def test_raw_media_takes_the_unchanged_path(daemon):
    req = fpb.MultimodalRequest()
    req.raw_media.add(modality=fpb.MODALITY_IMAGE, url="https://example.com/cat.png", uuid="cat")
    with pytest.raises(InvalidArgument, match="raw media"):
        worker.open_request(None, req)


# -- the inline threshold: small tensors ride in the message -------------------------------------------

def _payloads(request: fpb.MultimodalRequest) -> list[str]:
    return [kw.tensor.WhichOneof("payload") for b in request.batches for it in b.items for kw in it.kwargs.values()]


def _engine_view(consumer, request) -> dict:
    with worker.open_request(consumer, request) as inputs:
        return summarize(inputs)


def test_request_below_threshold_goes_inline_whole_without_touching_the_daemon(daemon):
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        built = frontend.build_request(producer, mixed_items())  # ~0.5 KiB in all: below the default
        assert set(_payloads(built.request)) == {"inline"} and built.handles == []
        assert built.inline_nbytes == sum(v.numel() * v.element_size() if isinstance(v, torch.Tensor) else v.nbytes
                                          for it in mixed_items() for v in it.kwargs.values())
        assert producer.stat().live_objects == 0
        with frontend.build_request(producer, mixed_items(), inline=NO_INLINE) as shm:
            assert set(_payloads(shm.request)) == {"shm"}
            assert _engine_view(consumer, built.request) == _engine_view(consumer, shm.request)
        assert live_leases(consumer) == 0


def test_in_a_shared_memory_request_only_tensors_below_the_tensor_threshold_ride_inline(daemon):
    big = np.arange(DEFAULT_INLINE.request_below_nbytes // 4, dtype=np.float32)  # request above the threshold
    grid = np.int64([[1, 2, 2]])
    items = [FeatureItem("image", {"pixel_values": big, "image_grid_thw": grid}, PlaceholderRange(0, 4))]
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        with frontend.build_request(producer, items) as built, \
                frontend.build_request(producer, items, inline=NO_INLINE) as shm:
            kwargs = built.request.batches[0].items[0].kwargs
            assert kwargs["pixel_values"].tensor.WhichOneof("payload") == "shm"
            assert kwargs["image_grid_thw"].tensor.WhichOneof("payload") == "inline"
            assert len(built.handles) == 1 and built.inline_nbytes == grid.nbytes
            assert built.request.batches[0].items[0].mm_hash == shm.request.batches[0].items[0].mm_hash
            with worker.open_request(consumer, built.request) as inputs:
                assert len(inputs.leases) == 1
                assert inputs.mm_kwargs["image"][0]["image_grid_thw"].tolist() == grid.tolist()
        assert live_leases(consumer) == 0


def test_a_request_with_a_referenced_handle_is_never_inlined_whole(daemon):
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        loan = producer.loan(shape=(4, 8), dtype=np.float32)
        loan.array[:] = 1.0
        handle = loan.commit(digest=True)
        between = np.ones(DEFAULT_INLINE.tensor_below_nbytes // 4, np.float32)  # 4 KiB: below the request threshold
        items = [FeatureItem("image", {"pixel_values": handle, "between": between, "tiny": np.ones(4, np.float32)},
                             PlaceholderRange(0, 4))]
        with frontend.build_request(producer, items) as built:  # shared memory is in use: per-tensor rule
            assert {k: kw.tensor.WhichOneof("payload") for k, kw in built.request.batches[0].items[0].kwargs.items()} \
                == {"pixel_values": "shm", "between": "shm", "tiny": "inline"}
        producer.release(handle)


@pytest.mark.parametrize("limit", ["max_inline_items", "max_inline_bytes"])
def test_inline_tensors_stay_within_the_inline_limits_and_the_rest_go_to_shared_memory(daemon, limit):
    import dataclasses

    limits = dataclasses.replace(DEFAULT_LIMITS, **({"max_inline_items": 2} if limit == "max_inline_items"
                                                    else {"max_inline_bytes": 200}))
    items = [FeatureItem("image", {"pixel_values": np.full(16, i, np.float32)}, PlaceholderRange(8 * i, 4))
             for i in range(4)]  # 64 B each, 256 B in all
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        with frontend.build_request(producer, items, limits=limits) as built:
            kinds = _payloads(built.request)
            assert kinds.count("inline") == (2 if limit == "max_inline_items" else 3) and "shm" in kinds
            with worker.open_request(consumer, built.request, limits=limits) as inputs:
                assert [it["pixel_values"][0].item() for it in inputs.mm_kwargs["image"]] == [0, 1, 2, 3]
        assert live_leases(consumer) == 0


def test_negative_inline_thresholds_are_rejected():
    with pytest.raises(InvalidArgument):
        InlinePolicy(request_below_nbytes=-1)
    with pytest.raises(InvalidArgument):
        InlinePolicy(tensor_below_nbytes=-1)
