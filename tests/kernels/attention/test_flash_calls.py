"""The flash kernels' mask rule and tile skipping (`pallas_kernels.attention.flash_calls`), as
plain functions of slots and segment ids, against the reference masks of docs/design.md 3.1: the
in-kernel mask is the design rule, and the tiles a program visits are exactly the tiles that hold a
visible pair (none skipped that holds one, none visited that holds none) on a packed row whose
documents are contiguous; where an id recurs (one pad id between and after documents), no tile with
a visible pair is skipped."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.flash import doc_extents
from pallas_kernels.attention.flash_calls import FlashConfig, key_tile_ranges, query_tile_range, visible, visible_pairs
from pallas_kernels.attention.reference import two_stream_masks

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


def _shard_layout(stream: str, block: int, seg: np.ndarray, n: int, i: int):
    """Shard i of n (Tl = T / n, no padding) in the context layout of pallas_kernels.context.attention_kernels,
    built here from its definition: keys = the pieces i+1..n-1 (their ids replaced by one no query holds),
    0..i-1, i (|| the shard's own noisy keys); returns (q_offset, q ids, key ids, the global reference
    mask's rows of the shard with its columns in that key order)."""
    tl = T // n
    order = np.concatenate([np.arange(p * tl, (p + 1) * tl) for p in [*range(i + 1, n), *range(i + 1)]])
    kv_seg = np.where(np.arange(T) < (n - 1 - i) * tl, -99, seg[order])
    mask = _reference_mask(stream, block, seg)[i * tl:(i + 1) * tl]
    if stream == "noisy":  # the shard's own noisy keys: global noisy slots T + [i Tl, (i + 1) Tl)
        order = np.concatenate([order, T + np.arange(i * tl, (i + 1) * tl)])
        kv_seg = np.concatenate([kv_seg, seg[i * tl:(i + 1) * tl]])
    return (n - 1) * tl, seg[i * tl:(i + 1) * tl], kv_seg, mask[:, order]


@pytest.mark.parametrize("stream,block", [("clean", 1), ("noisy", 4), ("noisy", 32)])
@pytest.mark.parametrize("n,i", [(4, 0), (4, 2), (4, 3), (2, 1)])
def test_context_shard_rule_and_tiles(stream, block, n, i):
    """A context shard (``q_offset``: its queries after the other shards' keys): the in-kernel mask is
    the one-device row's mask on the shard's queries and the same keys (reordered), and the programs
    visit exactly the tiles with a visible pair (contiguous documents; future keys and finished
    documents skipped)."""
    seg = SEG_CONTIGUOUS
    off, q_seg, kv_seg, want = _shard_layout(stream, block, seg, n, i)
    cfg = FlashConfig(stream=stream, block_size=block, q_offset=off)
    tq, s = len(q_seg), len(kv_seg)
    got = visible(cfg, tq, off + jnp.arange(tq), jnp.asarray(q_seg), jnp.arange(s), jnp.asarray(kv_seg))
    np.testing.assert_array_equal(np.asarray(got), want)
    bq = bk = 16
    needed = _tiles_needed(want, bq, bk)
    first, last = (np.asarray(a)[0] for a in doc_extents(jnp.asarray(kv_seg[:off + tq])[None]))
    by_query, by_key = np.zeros_like(needed), np.zeros_like(needed)
    for a in range(tq // bq):
        for lo, hi in key_tile_ranges(cfg, tq, a * bq, bq, bk, first[off + a * bq:off + (a + 1) * bq]):
            by_query[a, int(lo):int(hi)] = True
    last_kv = last if stream == "clean" else np.concatenate([last, last[off:]])
    for j in range(needed.shape[1]):
        lo, hi = query_tile_range(cfg, tq, j * bk, bk, bq, last_kv[j * bk:(j + 1) * bk])
        by_key[int(lo):int(hi), j] = True
    np.testing.assert_array_equal(by_query, needed)
    np.testing.assert_array_equal(by_key, needed)
    assert visible_pairs(stream, tq, block, off) >= int(want.sum())
