"""pallas_kernels/context/stream_layout.py: the per-shard layout of the two training streams.

Checked against hand-built slot orders, and by the compiled program: with T sharded over `context`,
joining and splitting the streams moves no data between devices (no collective in the HLO), where
the plain clean || noisy layout does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.context.stream_layout import join_streams, split_streams

COLLECTIVES = ("collective-permute", "all-gather", "all-to-all", "all-reduce", "reduce-scatter")


def test_join_puts_each_shards_clean_and_noisy_pieces_together():
    """n = 4, T = 8: slots are [c0 c1 | n0 n1 | c2 c3 | n2 n3 | ...] (pieces of T / n = 2 tokens); n = 1
    is clean || noisy; split inverts join for any trailing shape."""
    clean, noisy = jnp.arange(8)[None], 100 + jnp.arange(8)[None]
    want = [0, 1, 100, 101, 2, 3, 102, 103, 4, 5, 104, 105, 6, 7, 106, 107]
    np.testing.assert_array_equal(join_streams(clean, noisy, n=4)[0], want)
    np.testing.assert_array_equal(join_streams(clean, noisy, n=1)[0], list(range(8)) + list(range(100, 108)))
    x = jax.random.normal(jax.random.key(0), (2, 24, 3, 5))
    y = jax.random.normal(jax.random.key(1), (2, 24, 3, 5))
    for n in (1, 2, 4, 8):
        c, m = split_streams(join_streams(x, y, n=n), n=n)
        np.testing.assert_array_equal(c, x)
        np.testing.assert_array_equal(m, y)


def test_layout_errors_name_the_shapes():
    with pytest.raises(ValueError, match="T=6 does not split into context=4"):
        join_streams(jnp.zeros((1, 6)), jnp.zeros((1, 6)), n=4)
    with pytest.raises(ValueError, match="differ"):
        join_streams(jnp.zeros((1, 8)), jnp.zeros((1, 4)), n=1)
    with pytest.raises(ValueError, match="not 2T"):
        split_streams(jnp.zeros((1, 7)), n=1)


def _collectives(fn, *args) -> dict[str, int]:
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return {k: hlo.count(f" {k}(") + hlo.count(f" {k}-start(") for k in COLLECTIVES}


@pytest.mark.parametrize("context", [2, 4, 8])
def test_split_and_join_move_nothing_on_a_context_mesh(context):
    """A [B, 2T, D] activation sharded over `context` (as THE rule table lays out `length`): splitting it
    into the two streams, a per-stream op, and joining back compile to no collective at all, while
    the plain clean || noisy slices do need them (the counter-check that the probe sees collectives)."""
    mesh = jax.make_mesh((8 // context, context), ("fsdp", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    b, t, d = 8 // context, 16 * context, 4
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((b, 2 * t, d)), NamedSharding(mesh, P("fsdp", "context")))

        def per_shard(x):
            c, n = split_streams(x)
            return join_streams(jnp.cumsum(c, axis=-1), n * 2.0), c + n

        def plain(x):
            c, n = x[:, :t], x[:, t:]
            out = jnp.concatenate([jnp.cumsum(c, axis=-1), n * 2.0], axis=1)
            # both streams' tokens of one position side by side (what the layers do with them)
            return out, c + n

        assert sum(_collectives(per_shard, x).values()) == 0
        assert sum(_collectives(plain, x).values()) > 0
