"""The blocked grouped FFN's loop and custom VJP against a per-group jnp oracle (autodiff of plain
per-expert SwiGLUs): values and every gradient, with an empty group, groups spanning several row
blocks and rows past the groups."""

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.model.moe_blocked import block_rows, blocked_ffn
from tests.model.parity_utils import FP32_REL, assert_rel_close


def _oracle(xs, sizes, wg, wu, wo):
    out, start = [], 0
    for g, n in enumerate(sizes):
        rows = xs[start:start + n]
        out.append((jax.nn.silu(rows @ wg[g]) * (rows @ wu[g])) @ wo[g])
        start += n
    out.append(jnp.zeros((xs.shape[0] - start, xs.shape[1]), xs.dtype))
    return jnp.concatenate(out, axis=0)


def test_blocked_ffn_values_and_gradients_equal_per_group_oracle():
    sizes = [19, 0, 3, 8, 17]  # 47 of 52 rows; block 8: groups of 1, 3 and 3 blocks, one empty
    m, d, i, e = 52, 12, 10, len(sizes)
    assert block_rows(m, e) == 8
    ks = jax.random.split(jax.random.key(7), 5)
    xs = jax.random.normal(ks[0], (m, d))
    wg, wu = jax.random.normal(ks[1], (e, d, i)) / d**0.5, jax.random.normal(ks[2], (e, d, i)) / d**0.5
    wo = jax.random.normal(ks[3], (e, i, d)) / i**0.5
    ct = jax.random.normal(ks[4], (m, d))
    got = jax.jit(blocked_ffn)(xs, jnp.asarray(sizes, jnp.int32), wg, wu, wo)
    want = _oracle(xs, sizes, wg, wu, wo)
    assert_rel_close(got, want, FP32_REL, "output")
    assert np.all(np.asarray(got[sum(sizes):]) == 0.0)

    loss = lambda f: lambda x, a, b, c: jnp.sum(f(x, a, b, c) * ct)  # noqa: E731
    g_got = jax.jit(jax.grad(loss(lambda x, a, b, c: blocked_ffn(x, jnp.asarray(sizes, jnp.int32), a, b, c)),
                             argnums=(0, 1, 2, 3)))(xs, wg, wu, wo)
    g_want = jax.grad(loss(lambda x, a, b, c: _oracle(x, sizes, a, b, c)), argnums=(0, 1, 2, 3))(xs, wg, wu, wo)
    for name, a, b in zip(("x", "wi_gate", "wi_up", "wo"), g_got, g_want):
        assert_rel_close(a, b, FP32_REL, f"d{name}")
    assert np.all(np.asarray(g_got[0][sum(sizes):]) == 0.0)  # rows past the groups get no gradient
    assert np.all(np.asarray(g_got[1][1]) == 0.0)  # the empty expert gets no weight gradient
