"""The flash kernels' mask rule and tile skipping (`pallas_kernels.attention_flash_kernels`), as
plain functions of slots and segment ids, against the reference masks of docs/design.md 3.1: the
in-kernel mask is the design rule, and the tiles a program visits are exactly the tiles that hold a
visible pair (none skipped that holds one, none visited that holds none) on a packed row whose
documents are contiguous; where an id recurs (one pad id between and after documents), no tile with
a visible pair is skipped."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention_flash import doc_extents
from pallas_kernels.attention_flash_kernels import (FlashConfig, key_tile_ranges, query_tile_range, visible,
                                                    visible_pairs)
from pallas_kernels.attention_reference import two_stream_masks

T = 256
# documents at 0, 40 (not tile aligned), 160, pads between and at the end (one id for all pads)
SEG = np.repeat([1, 2, 0, 3, 0], [40, 104, 16, 64, 32]).astype(np.int32)
SEG_CONTIGUOUS = np.repeat([1, 2, 3, 0], [40, 120, 64, 32]).astype(np.int32)


def _reference_mask(stream: str, block: int, seg: np.ndarray = SEG) -> np.ndarray:
    clean, noisy = two_stream_masks(jnp.asarray(seg)[None], block)
    return np.asarray(clean[0] if stream == "clean" else noisy[0])


CASES = [("clean", 1), ("noisy", 4), ("noisy", 16), ("noisy", 32)]


@pytest.mark.parametrize("stream,block", CASES)
def test_kernel_mask_is_the_design_rule(stream, block):
    cfg = FlashConfig(stream=stream, block_size=block)
    s = T if stream == "clean" else 2 * T
    seg = jnp.asarray(SEG)
    kv_seg = seg if stream == "clean" else jnp.concatenate([seg, seg])
    got = visible(cfg, T, jnp.arange(T), seg, jnp.arange(s), kv_seg)
    np.testing.assert_array_equal(np.asarray(got), _reference_mask(stream, block))


def _tiles_needed(mask: np.ndarray, bq: int, bk: int) -> np.ndarray:
    nq, nk = mask.shape[0] // bq, mask.shape[1] // bk
    return mask.reshape(nq, bq, nk, bk).any(axis=(1, 3))


@pytest.mark.parametrize("stream,block", CASES)
@pytest.mark.parametrize("bq,bk", [(16, 32), (32, 16), (64, 64)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_visited_tiles_are_the_tiles_with_visible_pairs(stream, block, bq, bk, contiguous):
    cfg = FlashConfig(stream=stream, block_size=block)
    seg = SEG_CONTIGUOUS if contiguous else SEG
    needed = _tiles_needed(_reference_mask(stream, block, seg), bq, bk)
    first, last = (np.asarray(a)[0] for a in doc_extents(jnp.asarray(seg)[None]))
    by_query = np.zeros_like(needed)  # the forward / dq programs: key tiles per query tile
    for i in range(T // bq):
        for lo, hi in key_tile_ranges(cfg, T, i * bq, bq, bk, first[i * bq:(i + 1) * bq]):
            by_query[i, int(lo):int(hi)] = True
    by_key = np.zeros_like(needed)  # the dk/dv program: query tiles per key tile
    last_kv = last if stream == "clean" else np.concatenate([last, last])
    for j in range(needed.shape[1]):
        lo, hi = query_tile_range(cfg, T, j * bk, bk, bq, last_kv[j * bk:(j + 1) * bk])
        by_key[int(lo):int(hi), j] = True
    assert not (needed & ~by_query).any() and not (needed & ~by_key).any(), "a tile with visible pairs is skipped"
    if contiguous:
        np.testing.assert_array_equal(by_query, needed)
        np.testing.assert_array_equal(by_key, needed)
    if stream == "noisy" and contiguous:  # about one causal pass plus the blocks' noisy keys, not [T, 2T]
        causal = _tiles_needed(_reference_mask("clean", 1, seg), bq, bk)
        assert not (by_query[:, :T // bk] & ~causal).any()
        assert by_query[:, T // bk:].sum(axis=1).max() <= -(-max(bq, block) // bk) + 1


@pytest.mark.parametrize("stream,block", CASES)
def test_visible_pairs_counts_a_one_document_row(stream, block):
    clean, noisy = two_stream_masks(jnp.ones((1, T), jnp.int32), block)
    mask = clean if stream == "clean" else noisy
    assert visible_pairs(stream, T, block) == int(mask.sum())
