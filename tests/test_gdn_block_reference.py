"""The block-mode GDN reference (pallas_kernels/gdn_block_reference.py) against a float64 numpy
oracle written from DESIGN.md 3.2 B one token at a time, and the block-mode conv (DESIGN.md 3.2 C)
against its defining properties."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.gdn import block_conv, causal_conv, right_conv
from pallas_kernels import block_gated_delta_rule_ref, chunk_gated_delta_rule_ref


def numpy_block_gdn(q, k, v, g, beta, qn, kn, vn, scalars, seg, block, init):
    """Literal recurrence for the clean states, then per noisy token the softmax over its block's
    same-document keys plus the history unit. float64."""
    b_, t_, h_, dk = q.shape
    dv = v.shape[-1]
    out = np.zeros((b_, t_, h_, dv))
    for b in range(b_):
        run = np.cumsum(np.concatenate([[0], seg[b, 1:] != seg[b, :-1]]))
        for h in range(h_):
            alpha, bb, gamma = scalars[h]
            S = init[b, h].copy() if init is not None else np.zeros((dk, dv))
            entry = {}
            for t in range(t_):
                if t % block == 0:
                    entry[t] = S.copy()
                if t > 0 and run[t] != run[t - 1]:
                    S = np.zeros((dk, dv))
                S = S * math.exp(g[b, t, h])
                S = S + np.outer(k[b, t, h], beta[b, t, h] * (v[b, t, h] - S.T @ k[b, t, h]))
            for t in range(t_):
                s = t - t % block
                keys = [j for j in range(s, s + block) if run[j] == run[t]]
                logits = [alpha * qn[b, t, h] @ kn[b, j, h] for j in keys]
                hist_prev = run[s - 1] if s > 0 else (run[0] if init is not None else None)
                has_hist = hist_prev is not None and run[t] == hist_prev
                if has_hist:
                    logits.append(bb + gamma * math.log(block))
                p = np.exp(np.array(logits) - max(logits))
                p /= p.sum()
                o = sum(p[i] * vn[b, j, h] for i, j in enumerate(keys))
                if has_hist:
                    o = o + p[-1] * (entry[s].T @ (qn[b, t, h] * dk ** -0.5))
                out[b, t, h] = o
    return out


def _inputs(rng, b, t, h, dk, dv):
    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    q, k, qn, kn = (unit(rng.normal(size=(b, t, h, dk))) for _ in range(4))
    v, vn = rng.normal(size=(b, t, h, dv)), rng.normal(size=(b, t, h, dv))
    g = -np.exp(rng.normal(size=(b, t, h))) * 0.3
    beta = 1 / (1 + np.exp(-rng.normal(size=(b, t, h))))
    scalars = np.stack([rng.uniform(1, 5, h), rng.normal(size=h), rng.uniform(0.5, 1.5, h)], axis=1)
    return q, k, v, g, beta, qn, kn, vn, scalars


@pytest.mark.parametrize("block,with_init", [(4, False), (5, True), (1, True), (8, False)])
def test_block_gdn_reference_matches_numpy_oracle(block, with_init):
    rng = np.random.default_rng(block)
    b, h, dk, dv = 2, 3, 8, 6
    t = 4 * block if block > 1 else 7
    args = _inputs(rng, b, t, h, dk, dv)
    seg = np.ones((b, t), np.int32)
    seg[1, : t // 2], seg[1, t // 2:] = 1, 2  # row 1: two documents (the second may start mid-block)
    seg[1, t // 2: t // 2 + 1] = 0  # with a pad between them
    init = rng.normal(size=(b, h, dk, dv)) * 0.5 if with_init else None
    want = numpy_block_gdn(*args, seg, block, init)
    f32 = [jnp.asarray(a, jnp.float32) for a in args]
    o_c, o_n, final = block_gated_delta_rule_ref(
        *f32, block_size=block, segment_ids=jnp.asarray(seg),
        initial_state=None if init is None else jnp.asarray(init, jnp.float32), chunk_size=3)
    np.testing.assert_allclose(np.asarray(o_n), want, rtol=0, atol=2e-5)
    # the clean stream is the causal rule, untouched
    ref_c, ref_final = chunk_gated_delta_rule_ref(
        *f32[:5], segment_ids=jnp.asarray(seg), chunk_size=3,
        initial_state=None if init is None else jnp.asarray(init, jnp.float32))
    np.testing.assert_array_equal(np.asarray(o_c), np.asarray(ref_c))
    np.testing.assert_array_equal(np.asarray(final), np.asarray(ref_final))


def test_block_gdn_reference_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    f32 = [jnp.asarray(a, jnp.float32) for a in _inputs(rng, 1, 8, 2, 4, 4)]
    with pytest.raises(ValueError, match="multiple of block_size"):
        block_gated_delta_rule_ref(*f32, block_size=3)
    with pytest.raises(ValueError, match=r"scalars must be \[H, 3\]"):
        block_gated_delta_rule_ref(*f32[:8], f32[8][:, :2], block_size=4)


def test_chunk_states_are_the_states_entering_each_chunk():
    rng = np.random.default_rng(1)
    q, k, v, g, beta = (jnp.asarray(a, jnp.float32) for a in _inputs(rng, 1, 12, 2, 4, 3)[:5])
    seg = jnp.asarray([[1] * 5 + [2] * 7])
    _, _, states = chunk_gated_delta_rule_ref(q, k, v, g, beta, segment_ids=seg, chunk_size=4,
                                              return_chunk_states=True)
    for n in range(3):  # entering chunk n = final state of the prefix of n*4 tokens
        if n == 0:
            np.testing.assert_array_equal(np.asarray(states[:, 0]), 0.0)
            continue
        _, want = chunk_gated_delta_rule_ref(q[:, :4 * n], k[:, :4 * n], v[:, :4 * n], g[:, :4 * n],
                                             beta[:, :4 * n], segment_ids=seg[:, :4 * n], chunk_size=4)
        np.testing.assert_allclose(np.asarray(states[:, n]), np.asarray(want), rtol=0, atol=1e-6)


# -- block-mode conv (DESIGN.md 3.2 C) ---------------------------------------------------------------
def test_zero_right_taps_give_exactly_the_causal_conv():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(3, 6, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
    ring = jnp.asarray(rng.normal(size=(3, 3, 5)), jnp.float32)
    seg = jnp.asarray([[1] * 6, [1, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1]])
    ring_seg = jnp.asarray([[1, 1, 1], [-1, 1, 1], [0, 0, 0]])
    got = block_conv(x, w, jnp.zeros((3, 5)), ring, seg, ring_seg)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(causal_conv(x, w, ring, seg, ring_seg)))


def test_right_taps_match_loops_and_never_leave_the_block():
    rng = np.random.default_rng(3)
    bk, c = 5, 4
    x = rng.normal(size=(2, bk, c)).astype(np.float32)
    w = rng.normal(size=(3, c)).astype(np.float32)
    seg = np.array([[1] * bk, [1, 1, 1, 0, 0]])
    got = np.asarray(right_conv(jnp.asarray(x), jnp.asarray(w), jnp.asarray(seg)))
    want = np.zeros_like(x)
    for b in range(2):
        for t in range(bk):
            for d in range(1, 4):
                if t + d < bk and seg[b, t + d] == seg[b, t]:
                    want[b, t] += w[d - 1] * x[b, t + d]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # the block is the whole input: a larger input's extra tokens (the next block) are never read
    # when the caller cuts blocks, which the model does by reshaping to [B * N, Bk, C]
    x2 = np.concatenate([x, rng.normal(size=(2, 3, c)).astype(np.float32)], axis=1).reshape(2, -1, c)
    blocks = x2[:, :bk]
    np.testing.assert_array_equal(np.asarray(right_conv(jnp.asarray(blocks), jnp.asarray(w), jnp.asarray(seg))), got)


def test_block_conv_reads_clean_ring_before_block():
    """In the two-stream forward the left taps of block n read the CLEAN inputs before the block:
    perturbing the noisy stream of block n-1 changes nothing, perturbing its clean inputs does."""
    from clover_jax.gdn import block_rings

    rng = np.random.default_rng(4)
    b, t, c, bk, lring = 1, 8, 3, 4, 3
    clean = rng.normal(size=(b, t, c)).astype(np.float32)
    seg = np.ones((b, t), np.int32)
    rings, ring_seg = block_rings(jnp.asarray(clean), jnp.asarray(seg), bk, lring, -1)
    np.testing.assert_array_equal(np.asarray(rings[1]), clean[0, 1:4])  # block 1 reads slots 1..3
    np.testing.assert_array_equal(np.asarray(ring_seg[0]), [-1, -1, -1])  # nothing before the row
    np.testing.assert_array_equal(np.asarray(rings[0]), 0.0)
