"""Handle items (engine/handle_items.py) and their resolution where the model runs
(engine/model_worker.py), with vLLM's real item classes and a real daemon. The whole path through
vLLM's engine, at TP=1 and TP=2, is in test_engine_handles.py."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmtransport.client import Consumer, Producer
from shmtransport.engine import model_worker
from shmtransport.engine.handle_items import MARKER_KEY, encode_marker, handle_item, is_handle_item, parse_marker
from shmtransport.errors import InvalidArgument
from shmtransport.handle import Handle
from shmtransport.testing import settle_daemon
from shmtransport.v1 import daemon_pb2 as pb

torch = pytest.importorskip("torch")
inputs = pytest.importorskip("vllm.multimodal.inputs")

MiB = 1 << 20
TIMEOUT_S = 30


def _handle(i: int) -> Handle:
    return Handle(pb.Handle(name=f"seg{i}", offset=4096 * i, nbytes=64 + i, generation=i + 1, slot=i + 1),
                  "uint8", (64 + i,), digest=bytes([i % 256]) * 8)


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=40), st.integers(0, 1000), min_size=1, max_size=6))
def test_a_marker_names_its_handles_exactly(keys):
    handles = {key: _handle(i) for key, i in keys.items()}
    assert parse_marker(encode_marker(handles)) == handles


def test_a_marker_is_refused_whole_unless_encode_marker_wrote_it():
    good = encode_marker({"pixel_values": _handle(1), "grid": _handle(2)})
    for cut in range(len(good)):  # every truncation
        with pytest.raises(InvalidArgument):
            parse_marker(good[:cut])
    bad = [
        bytes([2]) + good[1:],  # another version
        bytes([1, 0, 0]),  # no entry
        good + b"\0",  # bytes past the last entry
        bytes([1, 3, 0]) + good[3:] + encode_marker({"grid": _handle(3)})[3:],  # a key twice
        bytes([1, 1, 0, 2, 0]) + b"\xff\xfe" + bytes([3, 0]) + b"abc",  # a key that is not UTF-8
        bytes([1, 1, 0, 0, 0, 3, 0]) + b"abc",  # an empty key
        bytes([1, 1, 0, 1, 0]) + b"k" + bytes([3, 0]) + b"\xff\xff\xff",  # not a TensorHandle
    ]
    for data in bad:
        with pytest.raises(InvalidArgument):
            parse_marker(data)


def _fields():
    return {"pixel_values": inputs.MultiModalFlatField(slices=[slice(0, 4)], dim=0),
            "image_grid_thw": inputs.MultiModalBatchedField(keep_on_cpu=True)}


def test_device_fields_go_by_handle_and_cpu_fields_stay_real_as_copies():
    kwargs = {"pixel_values": torch.ones(4, 8), "image_grid_thw": torch.tensor([1, 2, 2])}
    handles = {"pixel_values": _handle(1), "image_grid_thw": _handle(2)}
    item = handle_item(kwargs, _fields(), handles)
    assert is_handle_item(item)
    assert item["pixel_values"].data.numel() == 0 and item["pixel_values"].data.dtype == torch.float32
    assert isinstance(item["pixel_values"].field, inputs.MultiModalFlatField)  # vLLM's field, slices kept
    assert torch.equal(item["image_grid_thw"].data, kwargs["image_grid_thw"])
    assert item["image_grid_thw"].data.data_ptr() != kwargs["image_grid_thw"].data_ptr()
    assert parse_marker(bytes(item[MARKER_KEY].data.numpy())) == {"pixel_values": handles["pixel_values"]}
    assert not item[MARKER_KEY].field.keep_on_cpu  # stripped with the bytes it stands for


def test_an_item_with_nothing_on_the_device_by_handle_is_a_plain_item():
    kwargs = {"image_grid_thw": torch.tensor([1, 2, 2])}
    item = handle_item(kwargs, _fields(), {"image_grid_thw": _handle(2)})
    assert not is_handle_item(item) and list(item) == ["image_grid_thw"]
    assert not is_handle_item(None)


def _feature(item, identifier: str):
    return inputs.MultiModalFeatureSpec(data=item, modality="image", identifier=identifier,
                                        mm_position=inputs.PlaceholderRange(offset=0, length=4))


def test_the_resolver_swaps_handles_for_arena_views_and_holds_them_until_the_request_finishes(make_daemon):
    daemon = make_daemon(arena_nbytes=32 * MiB)
    pixels = np.random.default_rng(1).standard_normal((2 * MiB // 4,), dtype=np.float32).reshape(-1, 128)
    grid = np.array([1, 2, 2], dtype=np.int64)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        handles = {"pixel_values": producer.put(pixels), "image_grid_thw": producer.put(grid)}
        item = handle_item({"pixel_values": torch.from_numpy(pixels), "image_grid_thw": torch.from_numpy(grid)},
                           _fields(), handles)
        feature = _feature(item, "xxh3-128:a")
        resolver = model_worker.HandleResolver(consumer)
        resolver.resolve("req-1", [feature, _feature(None, "cached")])
        assert MARKER_KEY not in feature.data and feature.identifier == "xxh3-128:a"
        tensor = feature.data["pixel_values"].data
        assert torch.equal(tensor, torch.from_numpy(pixels))
        assert model_worker._where(tensor)["in_arena"], model_worker._where(tensor)  # no copy
        producer.release(list(handles.values()), wait=True)
        assert daemon.stat().live_objects == 1  # the lease keeps the pixels; the grid went as a copy
        resolver.finished({"req-0"}, {})
        assert resolver.live_requests == 1
        del feature, tensor, item
        resolver.finished({"req-1"}, {})
        assert resolver.live_requests == 0
        stat = settle_daemon(daemon, timeout_s=10)
        assert (stat.live_leases, stat.live_objects) == (0, 0)


def test_a_handle_that_no_longer_acquires_is_encoded_from_zeros_under_a_key_nobody_else_reads(make_daemon):
    # The API process gave the request up (its leases went) while this step was on its way.
    daemon = make_daemon(arena_nbytes=8 * MiB)
    pixels = np.ones((16, 8), dtype=np.float32)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer, \
            Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        handle = producer.put(pixels)
        item = handle_item({"pixel_values": torch.from_numpy(pixels)}, _fields(), {"pixel_values": handle})
        producer.release(handle, wait=True)
        feature = _feature(item, "xxh3-128:shared-with-others")
        resolver = model_worker.HandleResolver(consumer)
        resolver.resolve("gone", [feature])
        assert torch.equal(feature.data["pixel_values"].data, torch.zeros(16, 8))
        assert feature.identifier.startswith(model_worker.UNAVAILABLE_PREFIX)
        encoder_cache = {feature.identifier: "output of zeros", "xxh3-128:shared-with-others": "real"}
        resolver.finished({"gone"}, encoder_cache)
        assert encoder_cache == {"xxh3-128:shared-with-others": "real"}


def test_only_the_vllm_versions_whose_scheduler_output_the_resolver_reads_are_accepted(monkeypatch):
    assert model_worker.check_vllm_version("0.32.0") is None
    for version in ("0.33.0", "0.31.9", "1.0.0"):
        assert version in model_worker.check_vllm_version(version)
    import vllm

    from shmtransport.engine import worker

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    assert "--model-inputs views" in worker._vllm_problem("handles")
    assert worker._vllm_problem("views") is None
    monkeypatch.undo()
    assert "--model-inputs views" in worker._vllm_problem("handles", "shm")  # vLLM's own cache: its path
    assert worker._vllm_problem("handles", "lru") is None
