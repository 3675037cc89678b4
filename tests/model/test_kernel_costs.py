"""Kernel costs for the HLO walk (`clover_jax.model.kernel_costs`): the expert-parallel buffer fill
by hand, the splash tiles against a brute-force count over the mask, the hook's dispatch."""

from types import SimpleNamespace

import numpy as np
import pytest

from clover_jax.config import get_preset
from clover_jax.model.kernel_costs import ep_buffer_fill, step_kernel_cost
from clover_jax.model.splash_cost import active_tiles, kernel_cost
from pallas_kernels.attention.splash import block_sizes_for


def test_ep_buffer_fill():
    assert ep_buffer_fill(256, 8, 4) == 8 / (4 * 8)  # 64 local experts >= k: buffer 4 n k
    assert ep_buffer_fill(16, 4, 8) == 4 / (8 * 2)  # 2 local experts < k: a token sends at most 2
    assert ep_buffer_fill(16, 4, 1) == 1.0
    with pytest.raises(ValueError, match="16 experts over 3"):
        ep_buffer_fill(16, 4, 3)


def _brute_tiles(t: int, s: int, bs: int | None) -> int:
    q, k = np.arange(t)[:, None], np.arange(s)[None, :]
    if bs is None:
        m = k <= q
    else:
        m = np.where(k < t, k < q - q % bs, (k - t) // bs == q // bs)
    b = block_sizes_for(t, s)
    tiles = m.reshape(t // b.block_q, b.block_q, s // b.block_kv, b.block_kv).any(axis=(1, 3))
    return int(tiles.sum())


@pytest.mark.parametrize("t,bs", [(1024, 32), (768, 16), (2048, 64)])
def test_splash_tiles_are_the_mask_tiles(t, bs):
    assert active_tiles("clean", t, 1) == _brute_tiles(t, t, None)
    assert active_tiles("noisy", t, bs) == _brute_tiles(t, 2 * t, bs)


def test_hook_costs_splash_and_scales_grouped_matmuls():
    arr = lambda dt, *dims: SimpleNamespace(dtype=dt, dims=dims, bytes=2 * int(np.prod(dims)))  # noqa: E731
    b, h, t, kv, d = 2, 4, 1024, 2, 64
    ops = (arr("s32", 4, 2, 2), arr("bf16", b, h, t, d), arr("bf16", b, kv, 2 * t, d), arr("bf16", b, kv, 2 * t, d))
    bsz = block_sizes_for(t, 2 * t)
    fwd, _ = kernel_cost("splash_mha_fwd_segmented_residuals", ops, (), None, block_size=32)
    assert fwd == 2 * 2 * _brute_tiles(t, 2 * t, 32) * bsz.block_q * bsz.block_kv * d * b * h
    dkv, _ = kernel_cost("splash_mha_dkv_segmented_no_residuals", ops, (), None, block_size=32)
    assert dkv == 2 * fwd  # 4 matmuls per tile vs 2
    assert kernel_cost("gdn_block_sweep", ops, (), None, block_size=32) is None
    cfg = get_preset("small-cpu")  # 16 experts, top 4
    hook = step_kernel_cost(cfg, expert_shards=2, block_size=32)
    assert hook("ragged-dot-none", (), (), (800.0, 64.0)) == (400.0, 32.0)  # fill 4 / (2 * 4)
    assert hook("tgmm", (), (), (800.0, 64.0)) == (400.0, 32.0)
    assert hook("gdn_sweep", (), (), (800.0, 64.0)) is None  # keeps its estimate
    assert hook("splash_mha_fwd_x", ops, (), None)[0] == fwd
    squeezed = (ops[0], *(arr(a.dtype, *a.dims[1:]) for a in ops[1:]))  # one row: the vmapped dim squeezed
    assert kernel_cost("splash_mha_fwd_y", squeezed, (), None, block_size=32)[0] == fwd / b


@pytest.mark.parametrize("n", [2, 4])
def test_splash_tiles_of_a_context_shard(n):
    """A context shard's kernel (its tp queries after the (n - 1) tp keys of the other shards): the
    tiles splash runs are the tiles of the shard's mask, counted by brute force, and the hook tells
    the streams apart by S = n tp (clean) or (n + 1) tp (noisy)."""
    tp, bs, d = 512, 32, 64
    pre = (n - 1) * tp
    q = np.arange(tp)[:, None]

    def brute(s, mask):
        b = block_sizes_for(tp, s)
        return int(mask.reshape(tp // b.block_q, b.block_q, s // b.block_kv, b.block_kv).any(axis=(1, 3)).sum())

    k = np.arange(pre + tp)[None, :]
    clean = brute(pre + tp, k <= pre + q)
    k = np.arange(pre + 2 * tp)[None, :]
    noisy = brute(pre + 2 * tp, np.where(k < pre + tp, k < pre + q - q % bs, (k - pre - tp) // bs == q // bs))
    assert active_tiles("clean", tp, 1, prefix=pre) == clean
    assert active_tiles("noisy", tp, bs, prefix=pre) == noisy
    arr = lambda *dims: SimpleNamespace(dtype="bf16", dims=dims, bytes=2 * int(np.prod(dims)))  # noqa: E731
    for s, tiles in ((pre + tp, clean), (pre + 2 * tp, noisy)):
        b = block_sizes_for(tp, s)
        got, _ = kernel_cost("splash_mha_fwd_z", (arr(1, 4, tp, d), arr(1, 2, s, d)), (), None, block_size=bs,
                             context=n)
        assert got == 2 * 2 * tiles * b.block_q * b.block_kv * d * 4


@pytest.mark.parametrize("n", [2, 4])
def test_splash_tiles_of_a_zigzag_shard(n):
    """Under the zig-zag layout (shard i: row pieces i and 2n - 1 - i, queries over the row's keys in
    row order with per-shard tables) the hook costs the most tiles any shard runs, counted here by
    brute force over each shard's mask on row slots; fewer than a contiguous shard's (-> half as n grows)."""
    piece, bs, d = 512, 32, 64
    tq, clean_keys = 2 * piece, 2 * n * piece

    def brute(s, stream):
        b, most = block_sizes_for(tq, s), 0
        for i in range(n):
            q = np.concatenate([i * piece + np.arange(piece), (2 * n - 1 - i) * piece + np.arange(piece)])[:, None]
            k = np.arange(s)[None, :]
            if stream == "clean":
                m = k <= q
            else:
                own = q[:, 0][np.clip(k - clean_keys, 0, None)]  # the shard's noisy keys sit at its queries' slots
                m = np.where(k < clean_keys, k < q - q % bs, own // bs == q // bs)
            tiles = m.reshape(tq // b.block_q, b.block_q, s // b.block_kv, b.block_kv).any(axis=(1, 3)).sum()
            most = max(most, int(tiles))
        return most

    arr = lambda *dims: SimpleNamespace(dtype="bf16", dims=dims, bytes=2 * int(np.prod(dims)))  # noqa: E731
    for stream, s in (("clean", clean_keys), ("noisy", clean_keys + tq)):
        b = block_sizes_for(tq, s)
        tiles = brute(s, stream)
        got, _ = kernel_cost("splash_mha_fwd_z", (arr(1, 4, tq, d), arr(1, 2, s, d)), (), None, block_size=bs,
                             context=n, layout="zigzag")
        assert got == 2 * 2 * tiles * b.block_q * b.block_kv * d * 4, stream
        contiguous, _ = kernel_cost("splash_mha_fwd_z", (arr(1, 4, tq, d), arr(1, 2, s, d)), (), None,
                                    block_size=bs, context=n)
        if stream == "clean":  # by hand: 2n + 1 tiles (module test) vs 2 q tiles x 2 (n - 1) + 3
            assert got / contiguous == pytest.approx((2 * n + 1) / (4 * n - 1))
        assert got < contiguous, stream
