"""Span-restricted attention (pallas_kernels/attention/spans.py): the spans cover every visible key of
the training masks (packed rows, pads, several block sizes and chunk counts), `attend_spans` equals
the dense `attend` over the full mask in values and in the gradients of q, k and v, the scored area is
the hand-computed one, the dispatch's reference path (what the model runs on CPU) equals the plain
oracles, and bad spans are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.ops import stream_attention
from pallas_kernels.attention.reference import attend, clean_attention_ref, noisy_attention_ref, two_stream_masks
from pallas_kernels.attention.spans import attend_spans, causal_spans, noisy_spans


def _segments(t: int) -> jnp.ndarray:
    """Two rows: one document; three documents (one crossing every chunk edge) and a pad tail."""
    seg = np.ones((2, t), np.int32)
    seg[1, t // 3:] = 2
    seg[1, 2 * t // 3 + 5:] = 3
    seg[1, -7:] = 0
    return jnp.asarray(seg)


def _covered(mask: np.ndarray, spans) -> np.ndarray:
    """[B, T, S] True where some span lets the row see the key."""
    cov = np.zeros(mask.shape, bool)
    for a, b, keys in spans:
        for k0, k1 in keys:
            cov[:, a:b, k0:k1] = True
    return cov


@pytest.mark.parametrize("t,block", [(64, 4), (96, 32), (256, 32), (128, 16)])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 8])
def test_spans_cover_every_visible_key(t, block, chunks):
    clean, noisy = (np.asarray(m) for m in two_stream_masks(_segments(t), block))
    for mask, spans in ((clean, causal_spans(t, chunks)), (noisy, noisy_spans(t, block, chunks))):
        rows = [r for a, b, _ in spans for r in range(a, b)]
        assert rows == list(range(t))  # every query row exactly once, in order
        assert not (mask & ~_covered(mask, spans)).any()


def test_scored_area_is_the_hand_computed_one():
    # T = 256, block 32, 4 chunks of 64 rows: clean keys [0, 64), [0, 128), [0, 192), [0, 256);
    # noisy rows see clean [0, b - 32) and their own 64 noisy keys: 96, 160, 224, 288 keys
    area = lambda spans: sum((b - a) * sum(k1 - k0 for k0, k1 in keys) for a, b, keys in spans)  # noqa: E731
    assert area(causal_spans(256, 4)) == 64 * (64 + 128 + 192 + 256)  # 62.5% of 256 x 256
    assert area(noisy_spans(256, 32, 4)) == 64 * (96 + 160 + 224 + 288)  # 37.5% of 256 x 512
    assert noisy_spans(64, 32, 4) == ((0, 32, ((64, 96),)), (32, 64, ((0, 32), (96, 128))))  # 2 blocks: 2 chunks


@pytest.mark.parametrize("h,kv", [(4, 2), (3, 3)])
@pytest.mark.parametrize("stream", ["clean", "noisy"])
def test_attend_spans_equals_dense_attend(stream, h, kv):
    t, block, d = 96, 8, 16
    clean, noisy = two_stream_masks(_segments(t), block)
    mask, spans = (clean, causal_spans(t, 4)) if stream == "clean" else (noisy, noisy_spans(t, block, 4))
    s = mask.shape[2]
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (2, t, h, d))
    k, v = (jax.random.normal(x, (2, s, kv, d)) for x in ks[1:3])
    dout = jax.random.normal(ks[3], (2, t, h, d))

    def value_and_grads(f):
        """f's output and the gradients of sum(f * dout), as one compiled program (op by op, the many
        small ops of the spans would each compile on their own)."""
        grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * dout), argnums=(0, 1, 2))
        return jax.jit(lambda q, k, v: (f(q, k, v), grads(q, k, v)))(q, k, v)

    got, g_got = value_and_grads(lambda q, k, v: attend_spans(q, k, v, mask, spans))
    want, g_want = value_and_grads(lambda q, k, v: attend(q, k, v, mask))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_mask", [True, False])
def test_dispatch_reference_path_equals_the_plain_oracles(with_mask):
    t, block, h, kv, d = 64, 8, 4, 2, 8
    seg = _segments(t)
    clean, noisy = two_stream_masks(seg, block)
    ks = jax.random.split(jax.random.PRNGKey(1), 5)
    q = jax.random.normal(ks[0], (2, t, h, d))
    kc, vc, kn, vn = (jax.random.normal(x, (2, t, kv, d)) for x in ks[1:])
    k2, v2 = jnp.concatenate([kc, kn], axis=1), jnp.concatenate([vc, vn], axis=1)

    @jax.jit  # one program each side (op by op, every small op would compile on its own)
    def got_and_want(q, kc, vc, k2, v2):
        got_c = stream_attention(q, kc, vc, seg, stream="clean", backend="reference",
                                 mask_BTS=clean if with_mask else None)
        got_n = stream_attention(q, k2, v2, seg, stream="noisy", block_size=block, backend="reference",
                                 mask_BTS=noisy if with_mask else None)
        return (got_c, got_n), (clean_attention_ref(q, kc, vc, seg), noisy_attention_ref(q, k2, v2, seg, block))

    (got_c, got_n), (want_c, want_n) = got_and_want(q, kc, vc, k2, v2)
    np.testing.assert_allclose(got_c, want_c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_n, want_n, rtol=1e-5, atol=1e-6)


def test_bad_spans_are_refused():
    q = jnp.zeros((1, 8, 1, 4))
    k = jnp.zeros((1, 8, 1, 4))
    mask = jnp.ones((1, 8, 8), bool)
    with pytest.raises(ValueError, match="do not tile the 8 query rows"):
        attend_spans(q, k, k, mask, ((0, 4, ((0, 8),)), (5, 8, ((0, 8),))))
    with pytest.raises(ValueError, match="not a multiple of the block size 3"):
        noisy_spans(8, 3)
