"""Tests for the plain-jnp gated-delta-rule references (CPU, fp32, tiny shapes).

Compile time dominates on CPU, so the cases reuse a few (T, chunk_size) shapes through module-level
jitted wrappers; the per-document oracle for packed rows is a float64 numpy loop (no compiles).
"""

from __future__ import annotations

import inspect
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

from pallas_kernels import (  # noqa: E402
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_ref,
    recurrent_gated_delta_rule_ref,
)

B, H, DK, DV = 2, 4, 16, 8
TOL = 1e-5

rec = jax.jit(recurrent_gated_delta_rule_ref)
chunk = jax.jit(chunk_gated_delta_rule_ref, static_argnames=("chunk_size",))


def make_inputs(T: int, seed: int = 0, b: int = B) -> dict[str, np.ndarray]:
    """Realistic GDN inputs: l2-normalised q, k; g = -softplus(randn) < 0; beta = sigmoid(randn)."""
    rng = np.random.default_rng(seed)
    f32 = np.float32

    def l2(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    return dict(
        q=l2(rng.standard_normal((b, T, H, DK))).astype(f32),
        k=l2(rng.standard_normal((b, T, H, DK))).astype(f32),
        v=rng.standard_normal((b, T, H, DV)).astype(f32),
        g=(-np.logaddexp(0.0, rng.standard_normal((b, T, H)))).astype(f32),
        beta=(1.0 / (1.0 + np.exp(-rng.standard_normal((b, T, H))))).astype(f32),
        s0=(0.5 * rng.standard_normal((b, H, DK, DV))).astype(f32),
    )


def qkvgb(x: dict[str, np.ndarray], sl: slice = slice(None)) -> tuple[np.ndarray, ...]:
    return tuple(x[n][:, sl] for n in ("q", "k", "v", "g", "beta"))


def maxdiff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.parametrize("T,C,with_init", [(37, 16, False), (70, 64, True), (130, 64, True), (130, 16, False)])
def test_chunk_matches_recurrent(T, C, with_init):
    x = make_inputs(T, seed=T)
    s0 = x["s0"] if with_init else None
    o_r, s_r = rec(*qkvgb(x), initial_state_BHKV=s0)
    o_c, s_c = chunk(*qkvgb(x), initial_state=s0, chunk_size=C)
    assert o_c.shape == (B, T, H, DV) and s_c.shape == (B, H, DK, DV)
    assert o_c.dtype == jnp.float32 and s_c.dtype == jnp.float32
    assert maxdiff(o_c, o_r) <= TOL
    # T % C != 0 in all cases: the padded tail must leave the final state untouched.
    assert maxdiff(s_c, s_r) <= TOL


@pytest.mark.parametrize("C", [16, 64])
def test_matches_transformers(C):
    import torch  # a declared test dependency: a missing one fails loudly, never skips
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as hf
    # The names may be rebound to fla kernels (triton only) when fla imports; unwrap to the torch code.
    hf_chunk = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
    hf_rec = inspect.unwrap(hf.torch_recurrent_gated_delta_rule)
    T = 70
    x = make_inputs(T, seed=70)
    t = {n: torch.from_numpy(a) for n, a in x.items()}
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    with torch.no_grad():
        o_hc, s_hc = hf_chunk(*args, chunk_size=C, initial_state=t["s0"], output_final_state=True,
                              use_qk_l2norm_in_kernel=False)
        o_hr, s_hr = hf_rec(*args, initial_state=t["s0"], output_final_state=True, use_qk_l2norm_in_kernel=False)
    o_c, s_c = chunk(*qkvgb(x), initial_state=x["s0"], chunk_size=C)
    o_r, s_r = rec(*qkvgb(x), initial_state_BHKV=x["s0"])
    for o_ours, s_ours in ((o_c, s_c), (o_r, s_r)):
        for o_hf, s_hf in ((o_hc, s_hc), (o_hr, s_hr)):
            assert maxdiff(o_ours, o_hf.numpy()) <= TOL
            assert maxdiff(s_ours, s_hf.numpy()) <= TOL


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_state_handoff(op):
    # Shapes chosen to reuse compiles of test_chunk_matches_recurrent; t1 = 60 is mid-chunk.
    T, t1, C = 130, 60, 64
    x = make_inputs(T, seed=5)

    def run(sl, s0):
        if op == "chunk":
            return chunk(*qkvgb(x, sl), initial_state=s0, chunk_size=C)
        return rec(*qkvgb(x, sl), initial_state_BHKV=s0)

    o_full, s_full = run(slice(None), x["s0"])
    o_a, s_a = run(slice(0, t1), x["s0"])
    o_b, s_b = run(slice(t1, T), s_a)
    assert maxdiff(np.concatenate([o_a, o_b], axis=1), o_full) <= TOL
    assert maxdiff(s_b, s_full) <= TOL


# ---------------------------------------------------------------- packed documents

def packed_layout(seed: int, T: int) -> list[list[tuple[int, int]]]:
    """Per row a list of (segment id, length) runs summing to T: 3 documents and pad (id 0) runs.

    Row 0: doc, pad, doc, pad, doc. Row 1 starts with a pad run (so the initial state belongs to
    the pad) and has two adjacent documents. The middle document is shorter than 16, and document
    ids are reused non-adjacently (7 ... 7) to check that a reappearing id still starts a new document.
    """
    rng = np.random.default_rng(seed)
    l1, p1, l2, p2 = int(rng.integers(20, 50)), int(rng.integers(1, 6)), int(rng.integers(5, 12)), int(rng.integers(1, 6))
    row0 = [(7, l1), (0, p1), (3, l2), (0, p2), (7, T - l1 - p1 - l2 - p2)]
    l1, p1, l2 = int(rng.integers(20, 50)), int(rng.integers(1, 6)), int(rng.integers(5, 12))
    row1 = [(0, p1), (7, l1), (0, p2), (3, l2), (7, T - p1 - l1 - p2 - l2)]
    return [row0, row1]


def numpy_recurrence(q, k, v, g, beta, s0):
    """float64 literal recurrence for ONE row [T, H, ...] (the independent per-document oracle)."""
    S = np.array(s0, np.float64)
    q = q.astype(np.float64) * DK ** -0.5
    o = np.zeros(v.shape, np.float64)
    for t in range(q.shape[0]):
        S = S * np.exp(g[t])[:, None, None]
        d = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", S, k[t]))
        S = S + k[t][:, :, None] * d[:, None, :]
        o[t] = np.einsum("hkv,hk->hv", S, q[t])
    return o, S


@pytest.mark.parametrize("op,C", [("recurrent", None), ("chunk", 16), ("chunk", 64)])
def test_packed_documents_equal_separate_runs(op, C):
    T = 130
    x = make_inputs(T, seed=11)
    layout = packed_layout(seed=3, T=T)
    seg = np.concatenate([np.concatenate([np.full(n, i, np.int32) for i, n in row])[None] for row in layout])
    starts = [np.cumsum([0] + [n for _, n in row])[:-1] for row in layout]
    if C is not None:  # the layout must exercise documents starting mid-chunk and shorter than a chunk
        assert any(s % C for row in starts for s in row[1:])
        assert any(n < C for row in layout for i, n in row if i != 0)

    if op == "chunk":
        o, s = chunk(*qkvgb(x), initial_state=x["s0"], segment_ids=seg, chunk_size=C)
    else:
        o, s = rec(*qkvgb(x), initial_state_BHKV=x["s0"], segment_ids_BT=seg)
    o = np.asarray(o)

    for b, row in enumerate(layout):
        for r, ((_, n), start) in enumerate(zip(row, starts[b])):
            sl = slice(start, start + n)
            s_in = x["s0"][b] if r == 0 else np.zeros((H, DK, DV))  # only token 0's run inherits
            o_ref, s_ref = numpy_recurrence(*(a[b] for a in qkvgb(x, sl)), s_in)
            assert maxdiff(o[b, sl], o_ref) <= TOL, (b, r)
        assert maxdiff(s[b], s_ref) <= TOL  # final state = that of the last document


def test_segments_all_equal_ids_is_no_segments():
    T, C = 130, 64
    x = make_inputs(T, seed=2)
    seg = np.full((B, T), 5, np.int32)
    o_a, s_a = chunk(*qkvgb(x), initial_state=x["s0"], segment_ids=seg, chunk_size=C)
    o_b, s_b = chunk(*qkvgb(x), initial_state=x["s0"], chunk_size=C)
    assert maxdiff(o_a, o_b) <= TOL and maxdiff(s_a, s_b) <= TOL


# ---------------------------------------------------------------- gradients

def _grads(fn, x, seg, rng):
    w_o = rng.standard_normal(x["v"].shape).astype(np.float32)
    w_s = rng.standard_normal(x["s0"].shape).astype(np.float32)

    def loss(q, k, v, g, beta, s0):
        o, s = fn(q, k, v, g, beta, s0, seg)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)

    return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*qkvgb(x), x["s0"])


@pytest.mark.parametrize("with_segments", [False, True])
def test_gradients_chunk_equal_recurrent(with_segments):
    T, C = 37, 16
    x = make_inputs(T, seed=21)
    seg = None
    if with_segments:  # docs of 9, 3 (pad), 20 (starts mid-chunk, crosses a boundary), 5 tokens
        seg = np.repeat(np.array([[1, 0, 2, 3]] * B, np.int32), [9, 3, 20, 5], axis=1)
    g_c = _grads(lambda *a: chunk_gated_delta_rule_ref(*a[:5], initial_state=a[5], segment_ids=a[6],
                                                       chunk_size=C), x, seg, np.random.default_rng(0))
    g_r = _grads(lambda *a: recurrent_gated_delta_rule_ref(*a[:5], initial_state_BHKV=a[5], segment_ids_BT=a[6]),
                 x, seg, np.random.default_rng(0))
    for name, a, b in zip(("q", "k", "v", "g", "beta", "s0"), g_c, g_r):
        assert np.all(np.isfinite(a)), name
        assert maxdiff(a, b) <= 1e-4 * float(np.max(np.abs(b))), name


# ---------------------------------------------------------------- dispatch

def test_dispatch_backends():
    T, C = 37, 16
    x = make_inputs(T, seed=37)
    o_ref, s_ref = chunk(*qkvgb(x), chunk_size=C)
    dispatch = jax.jit(chunk_gated_delta_rule, static_argnames=("chunk_size", "backend"))  # eager is slow
    for backend in ("auto", "reference"):
        o, s = dispatch(*qkvgb(x), chunk_size=C, backend=backend)
        assert maxdiff(o, o_ref) <= TOL and maxdiff(s, s_ref) <= TOL
    # the Pallas kernel (interpret mode on CPU) is tested against the references in gdn/test_causal_op.py
    assert "pallas_call" in str(jax.make_jaxpr(lambda *a: chunk_gated_delta_rule(*a, backend="pallas"))(*qkvgb(x)))
    with pytest.raises(ValueError, match="'triton'"):
        chunk_gated_delta_rule(*qkvgb(x), backend="triton")


def test_shape_errors_are_clear():
    x = make_inputs(8, seed=0)
    q, k, v, g, beta = qkvgb(x)
    with pytest.raises(ValueError, match="g must be"):
        chunk_gated_delta_rule_ref(q, k, v, g[..., :1], beta)
    with pytest.raises(ValueError, match="segment_ids must be"):
        recurrent_gated_delta_rule_ref(q, k, v, g, beta, segment_ids_BT=np.zeros((B, 3), np.int32))

