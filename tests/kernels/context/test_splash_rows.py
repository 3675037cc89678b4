"""Splash over keys in row order with per-shard tables (pallas_kernels/context/splash_rows.py): the
vectorised tables against splash's own mask processing, the in-kernel mask against the streams'
definition on row slots, the tile count by hand (every zig-zag shard runs the same causal share),
and both streams through the kernel (interpreted) against the one-device reference with pieces of
several tiles, so shards really skip tiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sa_mask
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as sa_info
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.context.attention import context_two_stream_attention
from pallas_kernels.attention.reference import clean_attention_ref, noisy_attention_ref
from clover_jax.model.splash_cost import active_tiles
from pallas_kernels.attention.splash import block_sizes_for
from pallas_kernels.context.splash_rows import mask_function, query_codes, query_slots, row_tables
from pallas_kernels.context.layout import to_layout, from_layout
from tests.model.parity_utils import FP32_REL, assert_rel_close, fast_jit

class RowSlotMask(sa_mask._ComputableMask):
    """One shard's mask as splash's own mask object (queries at ``slots`` over the stream's keys), for
    splash's ``process_mask`` to build its tables from."""

    def __init__(self, stream, slots: np.ndarray, block_size: int, clean_keys: int):
        codes, shift = query_codes(stream, slots, block_size)
        keys = clean_keys + (slots.size if stream == "noisy" else 0)
        super().__init__(shape=(slots.size, keys), mask_function=mask_function(stream, shift, clean_keys, block_size))
        self.q_sequence = codes
        self._key = (stream, codes.tobytes(), block_size, clean_keys)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowSlotMask) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


CASES = [("clean", 1, 2, 128), ("clean", 1, 4, 256), ("noisy", 4, 2, 128), ("noisy", 32, 4, 128),
         ("noisy", 128, 2, 256), ("clean", 1, 2, 384)]


@pytest.mark.parametrize("stream,block,n,tp", CASES)
def test_tables_equal_splash_mask_processing(stream, block, n, tp):
    """Block classes, both grids' next-fetch tables and the query codes equal what splash's own
    ``process_mask`` / ``process_mask_dkv`` (unshrunk) make of the same shard mask, shard by shard
    (384: a q tile straddles the shard's two pieces)."""
    t = row_tables(stream, "zigzag", n, tp, block)
    slots = query_slots("zigzag", n, tp)
    bs = block_sizes_for(slots.shape[1], t.keys)
    for s in range(n):
        mask = sa.MultiHeadMask([RowSlotMask(stream, slots[s], block, 2 * n * tp)])
        fwd, fn = sa_info.process_mask(mask, (bs.block_q, bs.block_kv), shrink_grid=False, downcast_smem_data=False)
        dkv, _ = sa_info.process_mask_dkv(mask, (bs.block_q_dkv, bs.block_kv_dkv), shrink_grid=False,
                                          downcast_smem_data=False)
        where = f"{stream} b{block} n{n} tp{tp} shard {s}"
        np.testing.assert_array_equal(t.block_mask[s], fwd.block_mask, err_msg=f"{where}: block_mask")
        np.testing.assert_array_equal(t.data_next[s], fwd.data_next, err_msg=f"{where}: data_next")
        np.testing.assert_array_equal(t.data_next_dkv[s], dkv.data_next, err_msg=f"{where}: dkv data_next")
        np.testing.assert_array_equal(t.codes[s], fwd.q_sequence, err_msg=f"{where}: q_sequence")
        assert fn is mask_function(stream, t.shift, 2 * n * tp, block)


@pytest.mark.parametrize("stream,block", [("clean", 1), ("noisy", 4), ("noisy", 16)])
def test_mask_is_the_streams_rule_on_row_slots(stream, block):
    """The in-kernel mask of every shard (codes and key slots) = the stream's rule written on row
    slots: clean keys at row slots 0..m Tp - 1, a clean key visible iff at or before the query
    (clean) / before the query's block (noisy); the shard's noisy keys (its queries' slots) iff in
    the query's block."""
    n, tp = 3, 32
    slots = query_slots("zigzag", n, tp)
    clean_keys = 2 * n * tp
    for s in range(n):
        codes, shift = query_codes(stream, slots[s], block)
        fn = mask_function(stream, shift, clean_keys, block)
        q = slots[s][:, None]
        if stream == "clean":
            keys = np.arange(clean_keys)[None, :]
            want = keys <= q
        else:
            keys = np.arange(clean_keys + slots.shape[1])[None, :]
            noisy_slot = slots[s][np.clip(keys - clean_keys, 0, None)]
            want = np.where(keys < clean_keys, keys < q - q % block, noisy_slot // block == q // block)
        np.testing.assert_array_equal(fn(codes[:, None], keys), want, err_msg=f"{stream} shard {s}")


@pytest.mark.parametrize("n", [2, 4])
def test_every_shard_runs_the_causal_share(n):
    """Clean stream, pieces of one 512 tile: shard i's early piece runs i full tiles + its diagonal,
    its late piece 2n - 1 - i + the diagonal: 2n + 1 on every shard, against 2 x 2n when each piece
    runs over the whole rolled row (the previous path, counted by splash's own tables)."""
    t = row_tables("clean", "zigzag", n, 512, 1)
    assert (np.count_nonzero(t.block_mask, axis=(1, 2, 3)) == 2 * n + 1).all()
    assert t.tiles == 2 * n + 1
    assert 2 * active_tiles("clean", 512, 1, prefix=(2 * n - 1) * 512) == 4 * n


def test_noisy_codes_refuse_overflow():
    with pytest.raises(ValueError, match="int32 query code"):
        query_codes("noisy", np.arange(2 ** 20, 2 ** 20 + 4096) * 2 ** 6, 4)


@pytest.mark.parametrize("block", [4, 256])
def test_kernel_with_skipped_tiles_equals_one_device(block):
    """Both streams through splash per shard (interpreted) at context 2 under zig-zag, T = 2048:
    pieces of 512 (a whole tile), so shard 0 runs 5 of its 8 clean tiles; documents crossing pieces,
    a pad run. Outputs and dq, dk, dv equal the one-device reference."""
    b, t, h, kv, d, context = 1, 2048, 2, 1, 8, 2
    seg = jnp.asarray(np.repeat([1, 2, 0, 3], [700, 900, 48, 400])[None].astype(np.int32))
    ks = jax.random.split(jax.random.key(3), 4)
    q, w = jax.random.normal(ks[0], (b, 2 * t, h, d)), jax.random.normal(ks[3], (b, 2 * t, h, d))
    k, v = jax.random.normal(ks[1], (b, 2 * t, kv, d)), jax.random.normal(ks[2], (b, 2 * t, kv, d))

    def vg(fn):
        def f(q, k, v):
            out = fn(q, k, v)
            return jnp.sum(jnp.sin(out) * w), out
        (_, out), grads = fast_jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return out, grads

    want, want_g = vg(lambda q, k, v: jnp.concatenate([clean_attention_ref(q[:, :t], k[:, :t], v[:, :t], seg),
                                                       noisy_attention_ref(q[:, t:], k, v, seg, block)], axis=1))
    lay = lambda x: to_layout(x, context, "zigzag")  # noqa: E731
    unlay = lambda x: from_layout(x, context, "zigzag")  # noqa: E731
    mesh = jax.make_mesh((8 // context, context), ("fsdp", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        sseg = jax.device_put(lay(seg), NamedSharding(mesh, P(None, "context")))

        def two(q, k, v):
            c, n_ = context_two_stream_attention(lay(q[:, :t]), lay(q[:, t:]), lay(k[:, :t]), lay(k[:, t:]),
                                                 lay(v[:, :t]), lay(v[:, t:]), sseg, block_size=block,
                                                 backend="splash", layout="zigzag")
            return jnp.concatenate([unlay(c), unlay(n_)], axis=1)

        got, got_g = vg(two)
    assert_rel_close(got, want, FP32_REL, f"splash zigzag b{block} output")
    for name, a, b_ in zip("qkv", got_g, want_g):
        assert_rel_close(a, b_, FP32_REL, f"splash zigzag b{block} d{name}")
