"""The capacity grouped FFN (batched capacity part + overflow loop, gathers with inverse-map VJPs)
against independent oracles: the per-group jnp SwiGLU of test_moe_blocked and the dense
all-experts reference, values and every gradient, for balanced, skewed and one-expert routings;
the layout's invariants by enumeration; the gather's VJP against autodiff of `jnp.take`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.model import moe as moe_lib
from clover_jax.model.moe_capacity import (capacity_ffn, capacity_rows, experts_capacity, gather_rows,
                                           overflow_block, plan)
from tests.model.parity_utils import FP32_REL, assert_rel_close
from tests.model.test_moe_blocked import _oracle


def _weights(key, e, d, i):
    k1, k2, k3 = jax.random.split(key, 3)
    return (jax.random.normal(k1, (e, d, i)) / d**0.5, jax.random.normal(k2, (e, d, i)) / d**0.5,
            jax.random.normal(k3, (e, i, d)) / i**0.5)


def test_capacity_rows_and_overflow_block():
    assert capacity_rows(8192, 16) == 568  # 1.1 * 512 = 563.2 -> 568
    assert capacity_rows(100, 4, factor=1.0) == 32  # 25 -> 32
    assert capacity_rows(3, 8) == 8
    assert [overflow_block(c) for c in (8, 100, 568, 5000)] == [8, 8, 64, 128]


@pytest.mark.parametrize("sizes", [[0, 0, 50, 0], [13, 13, 13, 13], [1, 0, 30, 21], [52, 0, 0, 0], [0, 0, 0, 0],
                                   [5, 9, 0, 2]])
def test_plan_covers_every_row_once(sizes):
    n, c, blk = 52, 12, 8
    p = plan(jnp.asarray(sizes, jnp.int32), n, c, blk)
    seen = np.zeros(n, int)
    row_c = np.asarray(p.row_C)
    for s, r in enumerate(row_c):
        if r < n:
            seen[r] += 1
            assert int(p.slot_N[r]) == s  # the two capacity maps are inverse
    starts = np.cumsum([0] + sizes)
    expert_of = np.repeat(np.arange(len(sizes)), sizes)
    used = int(p.used)
    assert used == sum(-(-max(z - c, 0) // blk) for z in sizes)
    assert used <= p.block_row0.shape[0]  # the static block count bounds the worst case
    for b in range(used):
        r0, end, e = int(p.block_row0[b]), int(p.block_end[b]), int(p.block_e[b])
        assert end == starts[e + 1] and r0 >= starts[e] + c
        for r in range(r0, min(r0 + blk, end)):
            assert expert_of[r] == e
            seen[r] += 1
    assert list(seen) == [1] * sum(sizes) + [0] * (n - sum(sizes))
    over = np.asarray(p.over_N)
    assert [bool(over[r]) for r in range(sum(sizes))] == [r - starts[expert_of[r]] >= c for r in range(sum(sizes))]


@pytest.mark.parametrize("sizes,hint", [([19, 0, 3, 8, 17], 10), ([19, 0, 3, 8, 17], None), ([47, 0, 0, 0, 0], None)])
def test_capacity_ffn_values_and_gradients_equal_per_group_oracle(sizes, hint):
    """hint 10: capacity 8, so groups of 19 / 17 / 8 run 2 / 2 / 0 overflow blocks; the others fit."""
    m, d, i, e = 52, 12, 10, len(sizes)
    ks = jax.random.split(jax.random.key(3), 3)
    xs = jax.random.normal(ks[0], (m, d))
    wg, wu, wo = _weights(ks[1], e, d, i)
    ct = jax.random.normal(ks[2], (m, d))
    gs = jnp.asarray(sizes, jnp.int32)  # a traced argument below: nothing is folded at compile time
    got = jax.jit(lambda x, s: capacity_ffn(x, s, wg, wu, wo, hint))(xs, gs)
    assert got.dtype == jnp.float32
    assert_rel_close(got, _oracle(xs, sizes, wg, wu, wo), FP32_REL, "output")
    assert np.all(np.asarray(got[sum(sizes):]) == 0.0)

    loss = lambda f: lambda x, a, b, c, *s: jnp.sum(f(x, a, b, c, *s) * ct)  # noqa: E731
    g_got = jax.jit(jax.grad(loss(lambda x, a, b, c, s: capacity_ffn(x, s, a, b, c, hint)), argnums=(0, 1, 2, 3)))(
        xs, wg, wu, wo, gs)
    g_want = jax.grad(loss(lambda x, a, b, c: _oracle(x, sizes, a, b, c)), argnums=(0, 1, 2, 3))(xs, wg, wu, wo)
    for name, a, b in zip(("x", "wi_gate", "wi_up", "wo"), g_got, g_want):
        assert_rel_close(a, b, FP32_REL, f"d{name}")
    assert np.all(np.asarray(g_got[0][sum(sizes):]) == 0.0)
    for g in np.flatnonzero(np.asarray(sizes) == 0):
        assert np.all(np.asarray(g_got[1][g]) == 0.0)  # an empty expert gets no weight gradient


@pytest.mark.parametrize("skew", ["balanced", "skewed", "two experts"])
def test_experts_capacity_equals_dense_reference(skew):
    t, k, e, d, i = 96, 3, 8, 16, 12
    ks = jax.random.split(jax.random.key(11), 4)
    x = jax.random.normal(ks[0], (t, d))
    logits = jax.random.normal(ks[1], (t, e))
    logits = logits + {"balanced": 0.0, "skewed": 4.0, "two experts": 1e3}[skew] * (jnp.arange(e) >= e - 3) * (
        jnp.arange(e) - e + 4)
    _, w, ex = moe_lib.route(logits, k)
    counts = np.bincount(np.asarray(ex).ravel(), minlength=e)
    if skew != "balanced":
        assert counts.max() > capacity_rows(t * k, e)  # the overflow loop runs
    wg, wu, wo = _weights(ks[2], e, d, i)
    ct = jax.random.normal(ks[3], (t, d))
    got = jax.jit(experts_capacity)(x, w, ex, wg, wu, wo)
    assert_rel_close(got, moe_lib.experts_dense(x, w, ex, wg, wu, wo), FP32_REL, "output")

    def loss(f):
        return lambda x_, w_, a, b, c, ex_: jnp.sum(f(x_, w_, ex_, a, b, c) * ct)

    g_got = jax.jit(jax.grad(loss(experts_capacity), argnums=(0, 1, 2, 3, 4)))(x, w, wg, wu, wo, ex)
    g_want = jax.grad(loss(moe_lib.experts_dense), argnums=(0, 1, 2, 3, 4))(x, w, wg, wu, wo, ex)
    for name, a, b in zip(("x", "weights", "wi_gate", "wi_up", "wo"), g_got, g_want):
        assert_rel_close(a, b, FP32_REL, f"d{name}")


def test_gather_rows_vjp_equals_autodiff_of_take():
    """Each of 5 sources read by K = 2 of 12 positions (some by fewer: unused slots), 2 positions
    reading nothing: the inverse-map VJP equals the scatter-add autodiff writes."""
    idx = jnp.asarray([3, 0, 9, 4, 1, 9, 2, 0, 3, 1, 4, 9], jnp.int32)  # 9: out of range -> zero row
    inv = np.full((5, 2), 12, np.int32)
    for b, a in enumerate(np.asarray(idx)):
        if a < 5:
            inv[a][list(inv[a]).index(12)] = b
    x = jax.random.normal(jax.random.key(0), (5, 7))
    ct = jax.random.normal(jax.random.key(1), (12, 7))
    got = jax.grad(lambda v: jnp.sum(gather_rows(v, idx, jnp.asarray(inv)) * ct))(x)
    want = jax.grad(lambda v: jnp.sum(jnp.take(v, idx, axis=0, mode="fill", fill_value=0) * ct))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(gather_rows(x, idx, jnp.asarray(inv))[2]) == 0.0)


def test_capacity_is_the_cpu_default_and_matches_blocked_in_the_grouped_api():
    from clover_jax.model.moe_platform import resolve_impl

    assert resolve_impl("auto", "cpu") == "capacity"
    assert resolve_impl("auto", "cpu", rows=256, experts=256) == "capacity"
    assert resolve_impl("auto", "cpu", rows=8, experts=256) == "blocked"  # one decoded token, 256 experts
    assert resolve_impl("auto", "gpu", rows=8192, experts=16) == "blocked"
    assert resolve_impl("capacity", "cpu", rows=8, experts=256) == "capacity"  # explicit: as asked
    sizes = jnp.asarray([30, 2, 0, 15], jnp.int32)
    xs = jax.random.normal(jax.random.key(5), (50, 8))
    wg, wu, wo = _weights(jax.random.key(6), 4, 8, 6)
    a = moe_lib.grouped_ffn(xs, sizes, wg, wu, wo, "capacity", rows_hint=20)
    b = moe_lib.grouped_ffn(xs, sizes, wg, wu, wo, "blocked")
    assert_rel_close(a, b, FP32_REL, "capacity vs blocked")
