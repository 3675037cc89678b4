"""The point-to-point exchange into and out of the zig-zag layout (pallas_kernels/context/exchange.py)
against the plain gather (`context_layout.to_layout` / `from_layout`): values, the round trip and
the gradient on (fsdp, context) meshes of the 8 simulated CPU devices, the move tables by hand, and
the compiled program moving pieces by collective-permutes (no all-gather of the row)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.context import exchange as context_exchange, layout as context_layout


def test_moves_by_hand():
    """n = 2, zig-zag: shard 0 holds row pieces 0, 3 and shard 1 pieces 1, 2. Into the layout, the
    even pieces 0 (shard 0 slot 0) and 2 (shard 1 slot 0) go to shard 0 slot 0 and shard 1 slot 1;
    the odd pieces 1 (shard 0 slot 1) and 3 (shard 1 slot 1) to shard 1 slot 0 and shard 0 slot 1."""
    even, odd = context_exchange.moves("zigzag", 2)
    assert even.pairs == ((0, 0), (1, 1)) and list(even.send) == [0, 0] and list(even.recv) == [0, 1]
    assert odd.pairs == ((0, 1), (1, 0)) and list(odd.send) == [1, 1] and list(odd.recv) == [1, 0]
    back_even, back_odd = context_exchange.moves("zigzag", 2, inverse=True)
    assert back_even.pairs == ((0, 0), (1, 1)) and list(back_even.send) == [0, 1]
    assert back_odd.pairs == ((0, 1), (1, 0)) and list(back_odd.send) == [1, 0]
    assert context_exchange.moves("contiguous", 4)[0].pairs == ((0, 0), (1, 1), (2, 2), (3, 3))


@pytest.mark.parametrize("context", [2, 4, 8])
def test_exchange_equals_the_gather(context):
    """Token ids [B, T] and hidden states [B, T, D]: into the layout and back equal the gather, the
    round trip is the identity, and the gradient (a random cotangent through both ways) equals the
    gather's."""
    b, t, d = 4, 64, 3
    mesh = jax.make_mesh((8 // context, context), ("fsdp", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.random.normal(jax.random.key(0), (b, t, d))
    ids = jnp.arange(b * t, dtype=jnp.int32).reshape(b, t)
    w = jax.random.normal(jax.random.key(1), (b, t, d))
    want_ids = context_layout.to_layout(ids, context, "zigzag")
    want_x = context_layout.to_layout(x, context, "zigzag")

    def loss(fn_to, fn_from, x):
        y = fn_to(x, context, "zigzag")
        return jnp.sum(jnp.sin(y) * w) + jnp.sum(fn_from(y * w, context, "zigzag") ** 2)

    want_g = jax.grad(lambda x: loss(context_layout.to_layout, context_layout.from_layout, x))(x)
    with jax.set_mesh(mesh):
        tok = NamedSharding(mesh, P("fsdp", "context"))
        sx, sids = jax.device_put(x, tok), jax.device_put(ids, tok)
        got_ids = jax.jit(lambda a: context_exchange.to_layout(a, context, "zigzag"))(sids)
        got_x = jax.jit(lambda a: context_exchange.to_layout(a, context, "zigzag"))(sx)
        back = jax.jit(lambda a: context_exchange.from_layout(context_exchange.to_layout(a, context, "zigzag"),
                                                              context, "zigzag"))(sx)
        got_g = jax.jit(jax.grad(lambda x: loss(context_exchange.to_layout, context_exchange.from_layout, x)))(sx)
        hlo = jax.jit(lambda a: context_exchange.to_layout(a, context, "zigzag")).lower(sx).compile().as_text()
    np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(got_x), np.asarray(want_x))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
    np.testing.assert_allclose(np.asarray(got_g), np.asarray(want_g), rtol=1e-6, atol=1e-6)
    assert "collective-permute" in hlo and "all-gather" not in hlo


def test_exchange_checks_the_split():
    mesh = jax.make_mesh((2, 4), ("fsdp", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="does not split into 8 pieces"):
        context_exchange.to_layout(jnp.zeros((2, 36)), 4, "zigzag")
