"""sft.loss: the chunked CE against full-logits CE (values and gradients, custom VJP included), the
weighting / normalisation coefficients against hand-computed values, masked accuracy on a
constructed example, the AR targets, and the whole SFT loss on the tiny block model against a naive
recomputation with materialised logits (`model.block_logits`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.config import get_preset
from clover_jax.model.clover_model import create_model, model_to_params
from sft.loss import (LossConfig, ar_targets, make_sft_loss, token_coefficients, weighted_ce,
                      weighted_ce_reference)
from sft.noise import NoiseConfig, noise_batch
from tests.model.parity_utils import FP32_REL, assert_rel_close


def _inputs(seed, b=3, t=20, d=8, v=50, density=0.3):
    ks = jax.random.split(jax.random.key(seed), 5)
    h = jax.random.normal(ks[0], (b, t, d), jnp.float32)
    w = 0.5 * jax.random.normal(ks[1], (d, v), jnp.float32)
    tgt = jax.random.randint(ks[2], (b, t), 0, v)
    # about half the targets are the argmax, so accuracy is neither 0 nor 1
    tgt = jnp.where(jax.random.uniform(ks[4], (b, t)) < 0.5, jnp.argmax(h @ w, -1), tgt)
    m = jax.random.uniform(ks[3], (b, t)) < density
    m = m.at[1].set(False)  # an empty row
    coef = jnp.where(m, jax.random.uniform(ks[4], (b, t), minval=0.5, maxval=2.0), 0.0)
    return h, w, tgt, coef, m


# chunks that do not divide the tokens (padding), row groups, one chunk for all (default groups)
@pytest.mark.parametrize("chunk_tokens,groups", [(7, 1), (6, 3), (10_000, None)])
def test_chunked_ce_equals_full_logits_ce(chunk_tokens, groups):
    h, w, tgt, coef, m = _inputs(0)
    got = weighted_ce(h, w, tgt, coef, m, chunk_tokens=chunk_tokens, groups=groups)
    want = weighted_ce_reference(h, w, tgt, coef, m)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert float(want[2]) == int(want[2]) and 0 < float(want[2]) <= int(m.sum())

    def f(fn):
        return jax.grad(lambda h, w: fn(h, w)[0], argnums=(0, 1))(h, w)

    g_got = f(lambda h, w: weighted_ce(h, w, tgt, coef, m, chunk_tokens=chunk_tokens, groups=groups))
    g_want = f(lambda h, w: weighted_ce_reference(h, w, tgt, coef, m))
    for a, b in zip(g_got, g_want):
        assert_rel_close(a, b, FP32_REL, "grad")
    # gradients at non-loss positions are exactly zero (their chunks are skipped or weightless)
    assert np.all(np.asarray(g_got[0])[~np.asarray(m)] == 0.0)


# under a mesh every device sweeps its own tokens (rows over the batch axes, the sequence over
# context) and the lm_head gradient is reduce-scattered; tokens replicated over tensor in the second
@pytest.mark.parametrize("mesh_shape", [dict(data=2, fsdp=2, context=2), dict(fsdp=2, context=2, tensor=2)],
                         ids=str)
def test_chunked_ce_under_a_mesh_equals_full_logits_ce(mesh_shape):
    from clover_jax.parallel import sharding as sh

    h, w, tgt, coef, m = _inputs(2, b=4, t=24)
    loss = lambda fn: jax.value_and_grad(lambda h, w: 2.0 * fn(h, w)[0], argnums=(0, 1))  # noqa: E731
    want = weighted_ce_reference(h, w, tgt, coef, m)
    want_l, want_g = loss(lambda h, w: weighted_ce_reference(h, w, tgt, coef, m))(h, w)
    with sh.use_sharding(sh.make_mesh(sh.MeshConfig(**mesh_shape))):
        got = jax.jit(lambda h, w: weighted_ce(h, w, tgt, coef, m, chunk_tokens=12))(h, w)
        got_l, got_g = jax.jit(loss(lambda h, w: weighted_ce(h, w, tgt, coef, m, chunk_tokens=12)))(h, w)
        hlo = jax.jit(loss(lambda h, w: weighted_ce(h, w, tgt, coef, m, chunk_tokens=12))).lower(h, w).as_text()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    for a, b, name in zip(got_g, want_g, ("dh", "dw")):
        assert_rel_close(a, b, FP32_REL, name)
    assert "reduce_scatter" in hlo  # the lm_head gradient leaves onto its shards


def _scan_lengths(jaxpr) -> list[int]:
    """The `length` of every scan in a (closed) jaxpr, nested ones (shard_map, cond, custom_vjp) included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            out.append(eqn.params["length"])
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _scan_lengths(inner)
    return out


@pytest.mark.parametrize("chunk_tokens,want_chunks", [(12, 1), (5, 3), (4, 3)])
def test_chunk_tokens_size_each_devices_chunk_under_a_mesh(chunk_tokens, want_chunks):
    """8 devices (data 2 x fsdp 2 x context 2), B=4, T=24: each device holds 1 row x 12 tokens and
    sweeps ceil(12 / chunk_tokens) chunks of `chunk_tokens` tokens (not the global chunk split 8 ways)."""
    from clover_jax.parallel import sharding as sh

    h, w, tgt, coef, m = _inputs(3, b=4, t=24)
    with sh.use_sharding(sh.make_mesh(sh.MeshConfig(data=2, fsdp=2, context=2))):
        jaxpr = jax.make_jaxpr(lambda h, w: weighted_ce(h, w, tgt, coef, m, chunk_tokens=chunk_tokens))(h, w)
        got = jax.jit(lambda h, w: weighted_ce(h, w, tgt, coef, m, chunk_tokens=chunk_tokens))(h, w)
    assert _scan_lengths(jaxpr.jaxpr) == [want_chunks]
    np.testing.assert_allclose(got, weighted_ce_reference(h, w, tgt, coef, m), rtol=1e-5)


def test_chunked_ce_under_jit_scaled_cotangent_and_empty_mask():
    h, w, tgt, coef, m = _inputs(1)
    f = jax.jit(jax.grad(lambda h, w: 3.0 * weighted_ce(h, w, tgt, coef, m, chunk_tokens=5)[0], argnums=(0, 1)))
    g = f(h, w)
    r = jax.grad(lambda h, w: 3.0 * weighted_ce_reference(h, w, tgt, coef, m)[0], argnums=(0, 1))(h, w)
    for a, b in zip(g, r):
        assert_rel_close(a, b, FP32_REL, "grad")
    empty = jnp.zeros_like(m)
    out = weighted_ce(h, w, tgt, jnp.zeros_like(coef), empty, chunk_tokens=4)
    np.testing.assert_array_equal(out, np.zeros(3))
    gh, gw = jax.grad(lambda h, w: weighted_ce(h, w, tgt, jnp.zeros_like(coef), empty, chunk_tokens=4)[0],
                      argnums=(0, 1))(h, w)
    assert not np.any(np.asarray(gh)) and not np.any(np.asarray(gw))


def test_masked_accuracy_on_a_constructed_example():
    """logits = h @ I: the argmax is the hot coordinate of h; 3 of the 5 loss tokens hit their target,
    the 2 non-loss tokens (also hits) must not count."""
    v = 6
    hot = np.array([[1, 2, 3, 4, 5, 0, 1]])
    tgt = np.array([[1, 2, 0, 4, 0, 0, 1]])  # hits at 0, 1, 3, 5, 6; misses at 2, 4
    mask = np.array([[1, 1, 1, 1, 1, 0, 0]], bool)
    h = jnp.asarray(np.eye(v)[hot] * 5.0, jnp.float32)
    out = weighted_ce(h, jnp.eye(v), jnp.asarray(tgt), jnp.asarray(mask, jnp.float32), jnp.asarray(mask),
                      chunk_tokens=2)
    assert float(out[2]) == 3.0
    # nll of a hit: logsumexp([5, 0 x5]) - 5; of a miss: logsumexp(...) - 0
    lse = np.log(np.exp(5.0) + 5.0)
    np.testing.assert_allclose(float(out[1]), 3 * (lse - 5.0) + 2 * lse, rtol=1e-6)


def test_coefficients_hand_computed():
    """B = 2 drawn rows x T = 4, complementary (R = 4 rows). Row 0: docs 1 (slots 0-1) and 2 (2-3);
    row 1: doc 1 (slots 0-2) and a pad. Maskable: row 0 slots 1, 2, 3; row 1 slots 1, 2."""
    seg = np.array([[1, 1, 2, 2], [1, 1, 1, 0]])
    maskable = np.array([[0, 1, 1, 1], [0, 1, 1, 0]], bool)
    m_a = np.array([[0, 1, 0, 1], [0, 0, 1, 0]], bool)
    masked = np.concatenate([m_a, maskable & ~m_a])
    t_a = np.array([[0.2, 0.2, 0.5, 0.5], [0.8, 0.8, 0.8, 0.8]])
    t = np.concatenate([t_a, 1 - t_a])
    args = (jnp.asarray(masked), jnp.asarray(t, jnp.float32), jnp.asarray(np.concatenate([maskable] * 2)),
            jnp.asarray(np.concatenate([seg] * 2)))

    def coef(weighting, normalization):
        c, n = token_coefficients(*args, weighting=weighting, normalization=normalization, t_min=1e-3, copies=2)
        return np.asarray(c), float(n)

    n_masked = 5  # = maskable tokens: each masked exactly once per pair
    c, n = coef("uniform", "token")
    assert n == 5
    np.testing.assert_allclose(c, masked / n_masked, rtol=1e-6)
    # inverse_t: masked tokens at (row, slot, level): copy A (0,1,.2) (0,3,.5) (1,2,.8); copy B
    # (0,2,.5) (1,1,.2)
    want = np.zeros((4, 4))
    for (r, s), lv in {(0, 1): .2, (0, 3): .5, (1, 2): .8, (2, 2): .5, (3, 1): .2}.items():
        want[r, s] = 1 / lv
    c, _ = coef("inverse_t", "token")
    np.testing.assert_allclose(c, want / 5, rtol=1e-5)
    # batch: copies * maskable tokens of the drawn rows = 2 * 5
    c, n = coef("inverse_t", "batch")
    assert n == 10
    np.testing.assert_allclose(c, want / 10, rtol=1e-5)
    # sequence: docs (row 0, doc 1): 1 masked token (slot 1, copy A); (row 0, doc 2): 2 (slot 3 A,
    # slot 2 B); (row 1, doc 1): 2 (slot 2 A, slot 1 B) -> 3 documents
    c, n = coef("uniform", "sequence")
    assert n == 3
    want_seq = np.zeros((4, 4))
    want_seq[0, 1] = 1 / 1 / 3
    want_seq[0, 3] = want_seq[2, 2] = 1 / 2 / 3
    want_seq[1, 2] = want_seq[3, 1] = 1 / 2 / 3
    np.testing.assert_allclose(c, want_seq, rtol=1e-6)
    assert abs(c.sum() - 1.0) < 1e-6  # every document weighs the same, the mean over docs sums to 1


def test_inverse_t_weight_is_clipped_at_t_min():
    m = jnp.ones((2, 2), bool)
    t = jnp.asarray([[1e-6, 0.5], [1.0, 0.999999]], jnp.float32)
    c, n = token_coefficients(m, t, m, jnp.ones((2, 2), jnp.int32), weighting="inverse_t",
                              normalization="token", t_min=1e-2, copies=1)
    np.testing.assert_allclose(np.asarray(c) * 4, [[100.0, 2.0], [1.0, 1 / 0.999999]], rtol=1e-5)


def test_ar_targets():
    ids = jnp.asarray([[5, 6, 7, 8, 9, 4]])
    lmask = jnp.asarray([[0, 0, 1, 1, 1, 1]], bool)
    seg = jnp.asarray([[1, 1, 1, 1, 2, 2]])
    tgt, m = ar_targets(ids, lmask, seg)
    np.testing.assert_array_equal(tgt, [[6, 7, 8, 9, 4, 0]])
    # p predicts p+1 where p+1 is a loss token of the same document: p = 1, 2 (doc 1), 4 (doc 2)
    np.testing.assert_array_equal(m, [[0, 1, 1, 0, 1, 0]])


# ----------------------------------------------------------------------------------------------
MASK = 255


def test_sft_loss_equals_naive_full_logits_loss():
    """The whole loss_fn (noise, two streams, shift, chunked CE, inverse_t + sequence normalisation,
    lb, AR) against the same quantities from materialised logits and plain numpy."""
    cfg = get_preset("tiny").replace(mode="block", mask_token_id=MASK)
    model = create_model(cfg, 0)
    graphdef, _ = nnx.split(model)
    params = model_to_params(model)
    rng = np.random.default_rng(0)
    b, t, bk = 2, 32, 8
    ids = rng.integers(2, 250, (b, t)).astype(np.int32)
    seg = np.array([[1] * 16 + [2] * 16, [1] * 24 + [0] * 8], np.int32)
    pos = np.concatenate([np.r_[0:16, 0:16][None], np.r_[0:24, 0:8][None]]).astype(np.int32)
    lmask = np.zeros((b, t), bool)
    lmask[0, 5:16] = lmask[0, 20:32] = lmask[1, 10:24] = True
    batch = {k: jnp.asarray(v) for k, v in
             dict(input_ids=ids, segment_ids=seg, positions=pos, loss_mask=lmask).items()}
    noise = NoiseConfig(t_min=0.05)
    lcfg = LossConfig(weighting="inverse_t", normalization="sequence", ar_loss_weight=0.5, chunk_tokens=16)
    loss_fn = make_sft_loss(graphdef, block_size=bk, mask_token_id=MASK, noise=noise, loss=lcfg, lb_coef=0.01,
                            end_pad_id=MASK - 1)  # no slot after a response's end in this batch
    key = jax.random.key(3)
    fast = {"xla_backend_optimization_level": 0}  # same semantics, half the CPU compile time
    loss, met = jax.jit(loss_fn).lower(params, batch, key).compile(compiler_options=fast)(params, batch, key)

    nz = noise_batch(key, batch["input_ids"], batch["loss_mask"], block_size=bk, mask_token_id=MASK, cfg=noise)
    seg2, pos2 = jnp.concatenate([batch["segment_ids"]] * 2), jnp.concatenate([batch["positions"]] * 2)

    def naive(p, clean_ids, noisy_ids):
        m = nnx.merge(graphdef, p)
        h_c, _, aux = m.two_stream_hidden(clean_ids, noisy_ids, block_size=bk, positions=pos2, segment_ids=seg2)
        full = m.block_logits(clean_ids, noisy_ids, block_size=bk, positions=pos2, segment_ids=seg2)
        return full, m.logits(h_c[:b]), aux["lb_loss"]

    args = (params, nz.input_ids_RT, nz.noisy_ids_RT)
    logits, ar_logits, lb = jax.tree.map(lambda x: np.asarray(x, np.float64),
                                         jax.jit(naive).lower(*args).compile(compiler_options=fast)(*args))
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    clean = np.asarray(nz.input_ids_RT)
    nll = -np.take_along_axis(logp, clean[..., None], -1)[..., 0]
    masked, lv = np.asarray(nz.masked_RT), np.asarray(nz.t_RT, np.float64)
    docs = {}
    for r in range(2 * b):
        for s in range(t):
            if masked[r, s]:
                docs.setdefault((r % b, int(seg[r % b, s])), []).append(nll[r, s] / max(lv[r, s], 0.05))
    diff = np.mean([np.sum(v) / len(v) for v in docs.values()])
    # AR: clean-stream logits of the first copy, position p predicting p + 1
    ar_lp = ar_logits - np.log(np.exp(ar_logits).sum(-1, keepdims=True))
    terms = [-ar_lp[r, p, ids[r, p + 1]] for r in range(b) for p in range(t - 1)
             if lmask[r, p + 1] and seg[r, p] == seg[r, p + 1]]
    want = diff + 0.01 * float(lb) + 0.5 * np.mean(terms)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5)
    assert int(met["num_masked"]) == int(lmask.sum())  # complementary: every response token once
    assert float(met["weight"]) == len(docs)
    np.testing.assert_allclose(float(met["ar_loss"]), np.mean(terms), rtol=2e-5)
    acc = np.mean([logits[r, s].argmax() == clean[r, s] for r in range(2 * b) for s in range(t) if masked[r, s]])
    np.testing.assert_allclose(float(met["acc"]), acc, rtol=1e-6)
    assert int(met["tokens"]) == int((seg > 0).sum())
    assert met["expert_counts"].shape == (cfg.num_hidden_layers, cfg.num_experts)
