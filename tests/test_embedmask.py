"""EmbedMask and PlaceholderRange helpers follow vLLM's PlaceholderRange semantics exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import vllm.multimodal.inputs as vllm_inputs
from hypothesis import given, settings
from hypothesis import strategies as st

from shmtransport.embedmask import (
    EmbedMask,
    PlaceholderRange,
    WindowOutOfRange,
    embeds_cumsum,
    extract_embeds_range,
    get_embeds_indices_in_range,
    get_num_embeds,
)
from shmtransport.errors import InvalidArgument

VLLM_EXAMPLE = [False, True, False, True, True]


def VllmPlaceholderRange(offset, length, is_embed=None):
    """The real vLLM PlaceholderRange (its mask a torch.bool tensor, as vLLM builds it)."""
    mask = None if is_embed is None else torch.from_numpy(np.array(is_embed, dtype=bool))
    return vllm_inputs.PlaceholderRange(offset, length, mask)


def test_vllm_docstring_examples():
    p = PlaceholderRange(offset=2, length=5, is_embed=EmbedMask.from_bools(VLLM_EXAMPLE))
    assert p.get_embeds_indices_in_range(3, 5) == (1, 3)
    assert p.extract_embeds_range() == [(3, 3), (5, 6)]
    assert p.get_num_embeds() == p.num_embeds == 3
    assert p.embeds_cumsum == [0, 1, 1, 2, 3] and p.embeds_cumsum is p.embeds_cumsum  # a cached list
    assert embeds_cumsum(5, p.is_embed) == VllmPlaceholderRange(2, 5, VLLM_EXAMPLE).embeds_cumsum


def test_dense_placeholder_means_every_position_is_an_embed():
    p = PlaceholderRange(offset=10, length=4)
    assert p.get_num_embeds() == 4
    assert p.embeds_cumsum is None
    assert p.extract_embeds_range() == [(10, 13)]
    assert p.get_embeds_indices_in_range(1, 3) == (1, 3)
    assert get_num_embeds(4, None) == 4 and embeds_cumsum(4, None) is None
    assert extract_embeds_range(10, 4, None) == [(10, 13)]
    assert get_embeds_indices_in_range(4, None, 0, 4) == (0, 4)


@settings(max_examples=80, deadline=None)
@given(bits=st.lists(st.booleans(), min_size=1, max_size=200), offset=st.integers(0, 10_000), data=st.data())
def test_helpers_equal_vllms_code_for_random_masks(bits, offset, data):
    mask = EmbedMask.from_bools(bits)
    ours = PlaceholderRange(offset, len(bits), mask)
    ref = VllmPlaceholderRange(offset, len(bits), bits)
    assert ours.get_num_embeds() == ref.get_num_embeds()
    assert ours.embeds_cumsum == ref.embeds_cumsum
    assert ours.extract_embeds_range() == ref.extract_embeds_range()
    start = data.draw(st.integers(0, len(bits)))
    end = data.draw(st.integers(max(start, 1), len(bits)))
    assert ours.get_embeds_indices_in_range(start, end) == ref.get_embeds_indices_in_range(start, end)


def test_end_zero_window_is_empty_as_in_vllm():
    p = PlaceholderRange(0, 5, EmbedMask.from_bools(VLLM_EXAMPLE))
    assert p.get_embeds_indices_in_range(0, 0) == (0, 0) == VllmPlaceholderRange(0, 5, VLLM_EXAMPLE) \
        .get_embeds_indices_in_range(0, 0)


@settings(max_examples=80, deadline=None)
@given(bits=st.lists(st.booleans(), max_size=300))
def test_embed_mask_round_trips_and_matches_numpy(bits):
    arr = np.array(bits, dtype=bool)
    m = EmbedMask.from_bools(bits)
    assert m.nbits == len(m) == len(bits)
    assert m.packed == np.packbits(arr).tobytes()
    assert np.array_equal(m.to_bools(), arr)
    assert m.num_embeds() == int(arr.sum())
    assert np.array_equal(m.indices(), np.flatnonzero(arr))
    assert np.array_equal(m.cumsum(), np.cumsum(arr, dtype=np.int64))
    runs = m.runs()
    assert runs.shape == (len(VllmPlaceholderRange(0, len(bits), bits).extract_embeds_range()) if bits else 0, 2)
    rebuilt = np.zeros(len(bits), bool)
    for s, n in runs.tolist():
        rebuilt[s:s + n] = True
    assert np.array_equal(rebuilt, arr)
    assert EmbedMask(m.packed, m.nbits) == m and hash(EmbedMask(m.packed, m.nbits)) == hash(m)


def test_padding_bits_are_ignored_on_input_and_zero_in_packed():
    m = EmbedMask(bytes([0b1011_1111]), 3)
    assert m.packed == bytes([0b1010_0000])
    assert m.to_bools().tolist() == [True, False, True]
    assert m.num_embeds() == 2
    assert m == EmbedMask(bytes([0b1010_0000]), 3)


def test_window_counts_embeds_before_start_and_end():
    m = EmbedMask.from_bools(VLLM_EXAMPLE)
    assert m.window(0, 5) == (0, 3)
    assert m.window(3, 5) == (1, 3)
    assert m.window(5, 5) == (3, 3)


@pytest.mark.parametrize("packed,nbits,word", [
    (b"\x00", 9, "nbits"), (b"\x00\x00", 8, "packed"), (b"", 1, "nbits"), (b"\x00", -1, "nbits"),
    (b"\x00", 2.0, "nbits"), ("ab", 8, "packed"), (b"\x00", True, "nbits"),
])
def test_embed_mask_rejects_bit_counts_that_do_not_fit_the_buffer(packed, nbits, word):
    with pytest.raises(InvalidArgument, match=word):
        EmbedMask(packed, nbits)


@pytest.mark.parametrize("start,end,word", [(-1, 2, "start"), (3, 2, "end"), (0, 6, "end"), (6, 6, "start"),
                                            (1.0, 2, "start")])
def test_embed_mask_window_is_strict(start, end, word):
    with pytest.raises(InvalidArgument, match=word):
        EmbedMask.from_bools(VLLM_EXAMPLE).window(start, end)


@pytest.mark.parametrize("start,end", [(-1, 2), (3, 2), (5, 0), (-4, -1), (0, 5), (5, 5)])
def test_placeholder_windows_vllm_accepts_get_vllms_answer(start, end):
    m = EmbedMask.from_bools(VLLM_EXAMPLE)
    ref = VllmPlaceholderRange(2, 5, VLLM_EXAMPLE).get_embeds_indices_in_range(start, end)
    assert PlaceholderRange(2, 5, m).get_embeds_indices_in_range(start, end) == ref
    assert PlaceholderRange(2, 5).get_embeds_indices_in_range(start, end) == (start, end)  # dense: as given


@pytest.mark.parametrize("start,end,word", [(0, 6, "end"), (6, 6, "start"), (6, 0, "start")])
def test_placeholder_window_past_the_mask_raises_index_error_as_vllm(start, end, word):
    with pytest.raises(IndexError):
        VllmPlaceholderRange(2, 5, VLLM_EXAMPLE).get_embeds_indices_in_range(start, end)
    with pytest.raises(WindowOutOfRange, match=word) as excinfo:
        PlaceholderRange(2, 5, EmbedMask.from_bools(VLLM_EXAMPLE)).get_embeds_indices_in_range(start, end)
    assert isinstance(excinfo.value, IndexError) and isinstance(excinfo.value, InvalidArgument)
    assert PlaceholderRange(0, 1).get_embeds_indices_in_range(0, 2) == (0, 2)  # dense: vLLM does not check


@pytest.mark.parametrize("start,end,word", [(1.0, 2, "start"), (0, "2", "end"), (True, 2, "start")])
def test_placeholder_window_bounds_must_be_ints(start, end, word):
    for p in (PlaceholderRange(2, 5, EmbedMask.from_bools(VLLM_EXAMPLE)), PlaceholderRange(2, 5)):
        with pytest.raises(InvalidArgument, match=word):
            p.get_embeds_indices_in_range(start, end)


def test_placeholder_validation():
    m = EmbedMask.from_bools(VLLM_EXAMPLE)
    with pytest.raises(InvalidArgument, match="is_embed"):
        PlaceholderRange(0, 4, m)
    with pytest.raises(InvalidArgument, match="length"):
        PlaceholderRange(0, 0)
    with pytest.raises(InvalidArgument, match="offset"):
        PlaceholderRange(-1, 5, m)
    with pytest.raises(InvalidArgument, match="is_embed"):
        PlaceholderRange(0, 5, VLLM_EXAMPLE)
    with pytest.raises(InvalidArgument, match="bools"):
        EmbedMask.from_bools(np.zeros((2, 2), bool))


def test_all_false_mask_has_no_embed_ranges():
    p = PlaceholderRange(7, 6, EmbedMask.from_bools([False] * 6))
    assert p.get_num_embeds() == 0
    assert p.extract_embeds_range() == []
    assert p.get_embeds_indices_in_range(0, 6) == (0, 0)


def test_large_mask_helpers_match_vllm():
    rng = np.random.default_rng(5)
    bits = np.repeat(rng.random(50_000) < 0.3, rng.integers(1, 40, 50_000))[:100_003]
    ours = PlaceholderRange(17, bits.size, EmbedMask.from_bools(bits))
    ref = VllmPlaceholderRange(17, bits.size, bits)
    assert ours.extract_embeds_range() == ref.extract_embeds_range()
    assert ours.get_num_embeds() == ref.get_num_embeds()
    assert ours.get_embeds_indices_in_range(1234, 99_999) == ref.get_embeds_indices_in_range(1234, 99_999)
