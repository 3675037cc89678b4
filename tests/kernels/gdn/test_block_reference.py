"""The block-mode GDN reference (pallas_kernels/gdn/block_reference.py) against a float64 numpy
oracle written from docs/design.md 3.2 B one token at a time, and the block-mode conv (docs/design.md 3.2 C)
against its defining properties."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.model.gdn_conv import block_conv, causal_conv, right_conv
from pallas_kernels import block_gated_delta_rule_ref, chunk_gated_delta_rule_ref
from tests.model.parity_utils import FP32_REL, assert_rel_close


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
    s0 = None if init is None else jnp.asarray(init, jnp.float32)
    # jitted: one program each (op by op, every op would compile on its own)
    o_c, o_n, final = jax.jit(lambda *a: block_gated_delta_rule_ref(
        *a, block_size=block, segment_ids=jnp.asarray(seg), initial_state=s0, chunk_size=3))(*f32)
    # relative (host-independent); 5e-6 of max|ref| (2.0-2.6 here) stays under the old absolute
    # 2e-5 (measured: at most 1.7e-7 relative)
    assert_rel_close(np.asarray(o_n), want, 5e-6, f"noisy stream, block {block}")
    # the clean stream is the causal rule, untouched
    ref_c, ref_final = jax.jit(lambda *a: chunk_gated_delta_rule_ref(
        *a, segment_ids=jnp.asarray(seg), chunk_size=3, initial_state=s0))(*f32[:5])
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
    # jitted: one program per length (op by op, every op would compile on its own)
    ref = jax.jit(chunk_gated_delta_rule_ref, static_argnames=("chunk_size", "return_chunk_states"))
    _, _, states = ref(q, k, v, g, beta, segment_ids=seg, chunk_size=4, return_chunk_states=True)
    for n in range(3):  # entering chunk n = final state of the prefix of n*4 tokens
        if n == 0:
            np.testing.assert_array_equal(np.asarray(states[:, 0]), 0.0)
            continue
        _, want = ref(q[:, :4 * n], k[:, :4 * n], v[:, :4 * n], g[:, :4 * n], beta[:, :4 * n],
                      segment_ids=seg[:, :4 * n], chunk_size=4)
        # relative, under the old absolute 1e-6 at this scale (max|ref| 0.8-1.06; measured: equal)
        assert_rel_close(np.asarray(states[:, n]), np.asarray(want), 9e-7, f"state entering chunk {n}")


# -- block-mode conv (docs/design.md 3.2 C) ---------------------------------------------------------------
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
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)  # a 3-term fp32 sum: absolute round-off, as before


def test_block_conv_reads_clean_ring_before_block():
    """block_rings: block n's ring holds the CLEAN inputs of the L slots before it, an empty ring
    (segment `empty_seg`) before the row start. What the two-stream layer reads through it is in
    `test_two_stream_noisy_block_reads_its_block_and_the_clean_ring_only`."""
    from clover_jax.model.gdn_conv import block_rings

    rng = np.random.default_rng(4)
    b, t, c, bk, lring = 1, 8, 3, 4, 3
    clean = rng.normal(size=(b, t, c)).astype(np.float32)
    seg = np.ones((b, t), np.int32)
    rings, ring_seg = block_rings(jnp.asarray(clean), jnp.asarray(seg), bk, lring, -1)
    np.testing.assert_array_equal(np.asarray(rings[1]), clean[0, 1:4])  # block 1 reads slots 1..3
    np.testing.assert_array_equal(np.asarray(ring_seg[0]), [-1, -1, -1])  # nothing before the row
    np.testing.assert_array_equal(np.asarray(rings[0]), 0.0)


# -- the block-mode GDN layer (clover_jax.model.gdn.GatedDeltaNet): what the noisy stream reads -------------
def _block_layer(seed: int = 0):
    """The tiny preset's GDN layer in block mode with every parameter perturbed (right taps and
    calibration scalars included, so zero init values cannot hide a wrong read)."""
    from flax import nnx

    from clover_jax.config import get_preset
    from clover_jax.model.gdn import GatedDeltaNet

    cfg = get_preset("tiny").replace(mode="block", mask_token_id=1)
    layer = GatedDeltaNet(cfg, rngs=nnx.Rngs(seed))
    key = jax.random.PRNGKey(seed + 1)
    for path, var in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        key, sub = jax.random.split(key)
        scale = 0.3 if path[-1] in ("scale", "bd_gdn_softmax_scalars", "right", "kernel") else 0.05
        var.set_value(var[...] + scale * jax.random.normal(sub, var[...].shape, var[...].dtype))
    return cfg, layer


def test_two_stream_noisy_block_reads_its_block_and_the_clean_ring_only():
    """`GatedDeltaNet.two_stream` (x = clean || noisy, 3 blocks of 4), noisy output of block n:
    - bit-identical when the noisy tokens of the NEXT block change: the right taps never read past
      the block end (block 0 vs block 1);
    - bit-identical when the noisy tokens of the PREVIOUS block change: the left taps of block n read
      the clean inputs before it (block 2 vs block 1);
    - changed by the clean input just before the block, with the history unit switched off
      (beta = -1e30: its softmax weight is exactly 0), so that input reaches the block only through
      the conv ring (block 2 vs clean slot 7); block 1 (which holds slot 7) stays bit-identical."""
    from clover_jax.model.clover_model import NO_SEGMENT

    cfg, layer = _block_layer()
    s = layer.bd_gdn_softmax_scalars
    s.set_value(s[...].at[:, 1].set(-1e30))
    bk, t = 4, 12
    rng = np.random.default_rng(5)
    x = rng.normal(size=(1, 2 * t, cfg.hidden_size)).astype(np.float32)
    ctx = {"block_size": bk, "segment_ids": jnp.ones((1, t), jnp.int32), "empty_segment": NO_SEGMENT}
    fwd = jax.jit(lambda x_: layer.two_stream(x_, ctx))
    noisy_blocks = lambda y: np.asarray(y)[0, t:].reshape(t // bk, bk, -1)  # noqa: E731
    base = noisy_blocks(fwd(x))

    x_n = x.copy()
    x_n[0, t + bk: t + 2 * bk] += rng.normal(size=(bk, cfg.hidden_size)).astype(np.float32)
    got = noisy_blocks(fwd(x_n))
    np.testing.assert_array_equal(got[0], base[0], err_msg="block 0 read the noisy tokens after it")
    np.testing.assert_array_equal(got[2], base[2], err_msg="block 2's left taps read the noisy stream")
    assert not np.array_equal(got[1], base[1]), "block 1 ignores its own noisy tokens"

    x_c = x.copy()
    x_c[0, 2 * bk - 1] += rng.normal(size=cfg.hidden_size).astype(np.float32)
    got = noisy_blocks(fwd(x_c))
    np.testing.assert_array_equal(got[:2], base[:2])
    assert not np.array_equal(got[2], base[2]), "block 2's left taps ignore the clean input before it"


def _numpy_block_conv(x_clean, x_noisy, w_KC, w_right_LC, block):
    """Noisy-stream pre-activation conv from docs/design.md 3.2 C, one token at a time (one document,
    float64): left taps over the clean inputs before the block, then the noisy block; right taps
    inside the block."""
    t, c = x_noisy.shape
    k = w_KC.shape[0]
    out = np.zeros((t, c))
    for i in range(t):
        s = i - i % block
        for j in range(k):  # tap j reads slot i - (k - 1) + j
            src = i - (k - 1) + j
            if src >= s:
                out[i] += w_KC[j] * x_noisy[src]
            elif src >= 0:
                out[i] += w_KC[j] * x_clean[src]
        for d in range(1, k):
            if i + d < s + block:
                out[i] += w_right_LC[d - 1] * x_noisy[i + d]
    return out


def test_block_step_decoding_equals_float64_oracle():
    """The decode side of a block-mode GDN layer, independent of the shared readout function
    (`block_readout_ref`, which both the training forward and `block_step` call): block by block,
    `block_step` of the noisy canvas against the cache, then the AR commit pass of the clean block,
    against the float64 token-by-token oracle `numpy_block_gdn` (clean recurrence, per-block softmax
    with the history unit) fed with a float64 loop conv of the noisy stream. Projections, heads,
    gates and the output norm are the layer's own (checked against HF elsewhere). Every block is
    compared, the first (no history) included. Criterion: the suite's fp32 one (1e-5 * max|ref|)."""
    from clover_jax.model.gdn import init_gdn_cache
    from clover_jax.model.gdn_conv import CONV_PARTS
    from clover_jax.model.clover_model import NO_SEGMENT

    cfg, layer = _block_layer(1)
    bk, n, lring = 4, 3, cfg.linear_conv_kernel_dim - 1
    t = bk * n
    rng = np.random.default_rng(6)
    x_c = jnp.asarray(rng.normal(size=(1, t, cfg.hidden_size)), jnp.float32)
    x_n = jnp.asarray(rng.normal(size=(1, t, cfg.hidden_size)), jnp.float32)

    step = jax.jit(lambda xb, ctx, cache: layer.block_step(xb, ctx, cache)[0])
    commit = jax.jit(lambda xb, ctx, cache: layer(xb, ctx, cache)[1])
    cache, got = init_gdn_cache(cfg, 1, jnp.float32), []
    for i in range(n):
        sl = slice(i * bk, (i + 1) * bk)
        ring_seg = jnp.full((1, lring), 1 if i else NO_SEGMENT, jnp.int32)
        seg = jnp.ones((1, bk), jnp.int32)
        got.append(np.asarray(step(x_n[:, sl], {"segment_ids": seg, "ring_segment_ids": ring_seg,
                                                "continues": jnp.full((1, bk), i > 0)}, cache)))
        cache = commit(x_c[:, sl], {"segment_ids": seg, "ring_segment_ids": ring_seg,
                                    "continues": jnp.full((1,), i > 0)}, cache)
    got = np.concatenate(got, axis=1)

    # oracle inputs: the clean stream's q, k, v, g, beta and the noisy stream's pre-conv inputs
    seg = jnp.ones((1, t), jnp.int32)
    mix_c, mix_n = layer.mix_inputs(x_c), layer.mix_inputs(x_n)
    empty = jnp.full((1, lring), NO_SEGMENT, jnp.int32)
    zeros = {p: jnp.zeros((1, lring, mix_c[p].shape[-1])) for p in CONV_PARTS}
    q, k, v = layer.heads(layer.conv_parts(mix_c, seg, zeros, empty))
    g, beta = layer.gates(mix_c["b"], mix_c["a"])
    conv_n = {}
    for p in CONV_PARTS:
        conv = getattr(layer, f"conv_{p}")
        pre = _numpy_block_conv(np.asarray(mix_c[p][0], np.float64), np.asarray(mix_n[p][0], np.float64),
                                np.asarray(conv.kernel[...], np.float64), np.asarray(conv.right[...], np.float64), bk)
        conv_n[p] = jax.nn.silu(jnp.asarray(pre[None], jnp.float32))
    qn, kn, vn = layer.heads(conv_n)
    as64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    o = numpy_block_gdn(*map(as64, (q, k, v, g, beta, qn, kn, vn, layer.bd_gdn_softmax_scalars[...])),
                        np.ones((1, t), np.int32), bk, None)
    want = np.asarray(layer.output(jnp.asarray(o, jnp.float32), mix_n["z"], jnp.float32))
    assert_rel_close(got, want, FP32_REL, "block_step + commit vs float64 oracle")
