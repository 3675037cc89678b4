"""The dense attention core (pallas_kernels/attention/reference.py): `attend` (GQA heads folded into
the query rows) against a float64 numpy softmax for values, and against a per-head jnp oracle (K/V
repeated to every query head, no folding) for gradients, on the two training streams' masks of
packed rows, several head ratios, and a query row with no visible key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.reference import attend, two_stream_masks


def _inputs(seed: int, b: int, t: int, s: int, h: int, kv: int, d: int, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, kv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, kv, d), jnp.float32).astype(dtype)
    dout = jax.random.normal(ks[3], (b, t, h, d), jnp.float32).astype(dtype)
    return q, k, v, dout


def _packed_masks(t: int, block: int):
    """Clean [2, T, T] and noisy [2, T, 2T] masks of two rows (one packs two documents and a pad
    tail), with one clean query row made blind (no visible key) to pin the zero-row rule."""
    seg = np.zeros((2, t), np.int32)
    seg[1, t // 2:] = 1
    seg[1, -3:] = -1  # pads: their own segment
    clean, noisy = two_stream_masks(jnp.asarray(seg), block)
    clean = clean.at[0, 5, :].set(False)
    return clean, noisy


def _per_head_attend(q, k, v, mask):
    """The unfolded oracle: K/V repeated to the H query heads, one [T, S] softmax per head."""
    g = q.shape[2] // k.shape[2]
    k_BSHD, v_BSHD = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k_BSHD.astype(jnp.float32)) / np.sqrt(q.shape[-1])
    m = mask[:, None]
    probs = jnp.where(m, jax.nn.softmax(jnp.where(m, scores, -jnp.inf), axis=-1), 0.0)
    return jnp.einsum("bhts,bshd->bthd", probs, v_BSHD.astype(jnp.float32)).astype(v.dtype)


def _numpy_attend(q, k, v, mask):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, h, d = q.shape
    g = h // k.shape[2]
    out = np.zeros((b, t, h, d))
    for hi in range(h):
        s = np.einsum("btd,bsd->bts", q[:, :, hi], k[:, :, hi // g]) / np.sqrt(d)
        s = np.where(mask, s, -np.inf)
        m = np.max(s, axis=-1, keepdims=True)
        e = np.where(mask, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
        z = e.sum(-1, keepdims=True)
        out[:, :, hi] = np.einsum("bts,bsd->btd", e / np.where(z == 0, 1.0, z), v[:, :, hi // g])
    return out


@pytest.mark.parametrize("stream", ["clean", "noisy"])
def test_attend_equals_numpy_softmax_and_zeroes_blind_rows(stream):
    t, block = 24, 8
    clean, noisy = _packed_masks(t, block)
    mask = clean if stream == "clean" else noisy
    q, k, v, _ = _inputs(0, 2, t, mask.shape[-1], h=4, kv=2, d=16)
    got = np.asarray(jax.jit(attend)(q, k, v, mask))
    np.testing.assert_allclose(got, _numpy_attend(q, k, v, np.asarray(mask)), rtol=1e-5, atol=1e-5)
    if stream == "clean":
        assert np.all(got[0, 5] == 0.0)


@pytest.mark.parametrize("stream,h,kv", [("clean", 4, 2), ("noisy", 4, 2), ("noisy", 2, 2), ("clean", 6, 2)])
def test_gradients_equal_the_per_head_oracle(stream, h, kv):
    t, block, d = 24, 8, 16
    clean, noisy = _packed_masks(t, block)
    mask = clean if stream == "clean" else noisy
    q, k, v, dout = _inputs(1, 2, t, mask.shape[-1], h=h, kv=kv, d=d)

    def vjp(fn):
        out, pull = jax.vjp(lambda q, k, v: fn(q, k, v, mask), q, k, v)
        return (out, *pull(dout))

    got, want = jax.jit(lambda: vjp(attend))(), jax.jit(lambda: vjp(_per_head_attend))()
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        scale = float(jnp.max(jnp.abs(w)))
        assert scale > 0, name  # every gradient is live: the comparison cannot pass on zeros
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5 * scale, rtol=0, err_msg=name)
    if stream == "clean":  # the blind query row gets no gradient
        assert np.all(np.asarray(got[1])[0, 5] == 0.0)


def test_bf16_inputs_keep_their_dtype_and_match_the_oracle_to_bf16_rounding():
    t, block = 16, 4
    _, noisy = _packed_masks(t, block)
    q, k, v, dout = _inputs(2, 2, t, 2 * t, h=4, kv=2, d=16, dtype=jnp.bfloat16)
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v, noisy).astype(jnp.float32) * dout),
                             (0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.grad(lambda q, k, v: jnp.sum(_per_head_attend(q, k, v, noisy).astype(jnp.float32) * dout),
                           (0, 1, 2)))(q, k, v)
    for g, r in zip(grads, ref):
        assert g.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(r.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), atol=3e-2 * scale, rtol=0)
