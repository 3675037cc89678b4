"""The block-mode GDN Pallas kernels (interpret mode on CPU) against the jnp reference: the phase
split (TPU form: chunk 64 for every block size, readouts inside the sweep) and the fused one-sweep
kernel (GPU form).

Oracle: ``block_gated_delta_rule_ref`` (clean stream = the causal reference; noisy stream = the
per-block softmax over in-block logits and the history unit, with the block-entry states of a
second sweep with chunks of the block size: written independently of the kernels) and JAX autodiff
of it for the custom VJP, scalars included. Each configuration is one compile of a jitted
``value_and_grad`` that returns both streams, the final state and all ten gradients.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pallas_kernels import block_gated_delta_rule, block_gated_delta_rule_pallas, block_gated_delta_rule_ref  # noqa: E402
from pallas_kernels.gdn import block_math as bm  # noqa: E402
from pallas_kernels.gdn import block_phase_math as bpm  # noqa: E402
from pallas_kernels.gdn import chunk_math as cm  # noqa: E402
from tests.model.parity_utils import FP32_REL, assert_rel_close, fast_jit  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta", "s0", "qn", "kn", "vn", "scalars")
B, T, HK, H, DK, DV = 2, 128, 1, 2, 16, 8


def l2(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


@pytest.fixture(scope="module")
def x() -> dict[str, np.ndarray]:
    """Both streams on 1 key head for 2 value heads (grouped: value head h reads key head h // 2);
    scalars off their init (alpha = sqrt(dk), beta = 0, gamma = 1) so every term matters. Two
    chunks of 64. Segments: documents end mid-block and mid-chunk, pad runs, documents start
    exactly on a block boundary (16 + 16 = 32) and on the chunk boundary (row 0: 11 + 5 + 16 + 32 =
    64), one crosses the chunk boundary (row 1), an id reused after another is a new document."""
    rng = np.random.default_rng(7)
    f32 = np.float32
    n = lambda *s: rng.standard_normal(s).astype(f32)  # noqa: E731
    d = dict(q=l2(n(B, T, HK, DK)), k=l2(n(B, T, HK, DK)), v=n(B, T, H, DV),
             g=(-np.logaddexp(0.0, n(B, T, H))).astype(f32), beta=(1 / (1 + np.exp(-n(B, T, H)))).astype(f32),
             s0=0.5 * n(B, H, DK, DV), qn=l2(n(B, T, HK, DK)), kn=l2(n(B, T, HK, DK)), vn=n(B, T, H, DV),
             scalars=np.stack([np.sqrt(DK) * (1 + 0.2 * n(H)), n(H), 1 + 0.3 * n(H)], -1).astype(f32),
             w_o=n(B, T, H, DV), w_on=n(B, T, H, DV), w_s=n(B, H, DK, DV))
    d["seg"] = np.stack([np.repeat([4, 0, 5, 6, 8, 2], [11, 5, 16, 32, 40, 24]),
                         np.repeat([0, 3, 8, 9, 0, 9], [3, 29, 20, 45, 7, 24])]).astype(np.int32)
    return d


@functools.cache
def _value_and_grad(fn, block_size: int, chunk_size: int, with_init: bool):
    def loss(q, k, v, g, beta, s0, qn, kn, vn, scalars, seg, w_o, w_on, w_s):
        o, on, s = fn(q, k, v, g, beta, qn, kn, vn, scalars, block_size=block_size,
                      initial_state=s0 if with_init else None, segment_ids=seg, chunk_size=chunk_size)
        return jnp.sum(o * w_o) + jnp.sum(on * w_on) + jnp.sum(s * w_s), (o, on, s)
    # one-shot programs: compiled at XLA backend opt level 0 (compile-bound; round-off unchanged in effect)
    return fast_jit(jax.value_and_grad(loss, argnums=tuple(range(10)), has_aux=True))


def run(fn, x, block_size, chunk_size, with_init, length=T):
    """Outputs and gradients on the first ``length`` positions of the case."""
    x = {n: a if n in ("s0", "scalars", "w_s") else a[:, :length] for n, a in x.items()}
    (_, outs), grads = _value_and_grad(fn, block_size, chunk_size, with_init)(
        *(x[n] for n in NAMES), x["seg"], x["w_o"], x["w_on"], x["w_s"])
    return [np.asarray(a) for a in outs], [np.asarray(a) for a in grads]


def maxdiff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def pallas_tpu_form(*a, **kw):
    return block_gated_delta_rule_pallas(*a, interpret=True, interpret_form="tpu", **kw)


def pallas_gpu_form(*a, **kw):  # also splits dv = 8 into 2 value tiles of 4
    return block_gated_delta_rule_pallas(*a, interpret=True, interpret_form="gpu", block_v=4, **kw)


# (form, block_size, chunk_size, initial state). Both forms are the phase split (chunk 64 whatever the
# block). TPU form: 16, 4 or 2 blocks start inside each chunk (the sweep reads their states from the
# chunk's start state and deltas), one block per chunk; a block of 2 chunks (the block-start state
# read at every other chunk) is the shard_map test's case (32, 16). GPU form (the readouts in the
# output kernel, from the swept states): blocks inside a chunk, and a block of 2 chunks (the dS sweep
# and the parallel backward step a readout tile of 2 chunks). With and without an initial state
# (without one, block 0 has no history unit). Length 96 (the 16-blocks): the kernels pad to 2 chunks.
CASES = [("tpu", 4, 64, True, T), ("tpu", 16, 64, False, 96), ("tpu", 32, 64, True, T), ("tpu", 64, 64, True, T),
         ("gpu", 16, 64, False, 96), ("gpu", 32, 16, True, T)]
BF16_CASES = [("tpu", 32, 64, True, T), ("gpu", 16, 64, False, 96)]


@pytest.mark.parametrize("form,block_size,chunk_size,with_init,length", CASES)
def test_block_pallas_matches_reference(x, form, block_size, chunk_size, with_init, length):
    fn = pallas_tpu_form if form == "tpu" else pallas_gpu_form
    (o, on, s), grads = run(fn, x, block_size, chunk_size, with_init, length)
    (o_r, on_r, s_r), grads_r = run(block_gated_delta_rule_ref, x, block_size, chunk_size, with_init, length)
    assert o.shape == on.shape == x["v"][:, :length].shape and s.shape == x["s0"].shape
    for name, a, b in (("o", o, o_r), ("o_noisy", on, on_r), ("state", s, s_r)):
        assert_rel_close(a, b, FP32_REL, name)
    for name, a, b in zip(NAMES, grads, grads_r):
        if name == "s0" and not with_init:
            continue  # unused input: both are zero
        assert a.shape == b.shape and np.all(np.isfinite(a)), name
        assert_rel_close(a, b, FP32_REL, name)


@pytest.mark.parametrize("block_size,chunk_size", [(16, 64), (32, 16)])
def test_block_gpu_form_with_grouped_intra_and_value_tiled_backward(x, monkeypatch, block_size, chunk_size):
    """Block mode under the GPU launch knobs that split work, not math: 2 chunks per intra / WY program
    and the parallel backward in value tiles of 4 of dv = 8 (the noisy stream's dqn, dkn, dauxn summed
    over tiles too), blocks inside a chunk and blocks of 2 chunks: equal to the reference's."""
    from pallas_kernels.gdn import gpu_calls
    monkeypatch.setitem(gpu_calls.LAUNCH, (DK, DV, chunk_size),
                        gpu_calls.GpuLaunch(block_v=4, intra_chunks=2, backward_block_v=4))
    fn = functools.partial(block_gated_delta_rule_pallas, interpret=True, interpret_form="gpu")
    (o, on, s), grads = run(fn, x, block_size, chunk_size, True)
    (o_r, on_r, s_r), grads_r = run(block_gated_delta_rule_ref, x, block_size, chunk_size, True)
    for name, a, b in (("o", o, o_r), ("o_noisy", on, on_r), ("state", s, s_r)):
        assert_rel_close(a, b, FP32_REL, name)
    for name, a, b in zip(NAMES, grads, grads_r):
        assert a.shape == b.shape and np.all(np.isfinite(a)), name
        assert_rel_close(a, b, FP32_REL, name)


# bf16 bound relative to each array's max, 4 u (u = 2^-8), as in gdn/test_causal_op.py. Measured
# against the fp32 reference on the fp32 inputs (phase kernels, w / u stored bf16): worst, block 32
# (the tpu case) 6.0e-3 (o), 5.7e-3 (o_noisy), 5.6e-3 (dkn), 5.2e-3 (state); block 16 (the gpu case;
# the tpu form gives the same numbers there) 9.1e-3 (dqn), 8.6e-3 (dg), 7.8e-3 (dscalars), 6.0e-3 (o).
BF16_RTOL = 4 * 2.0 ** -8
BF16_NAMES = ("q", "k", "v", "qn", "kn", "vn")


@pytest.mark.parametrize("form,block_size,chunk_size,with_init,length", BF16_CASES)
def test_block_pallas_bf16_inputs(x, form, block_size, chunk_size, with_init, length):
    """bf16 q/k/v of both streams (the training path with `dtype: bfloat16`): bf16 matmul operands,
    fp32 accumulation, state, softmax and triangular inverse. Oracle: the fp32 reference on the
    fp32 inputs (its compile is shared with the fp32 test)."""
    fn = pallas_tpu_form if form == "tpu" else pallas_gpu_form
    xb = dict(x, **{n: jnp.asarray(x[n], jnp.bfloat16) for n in BF16_NAMES})
    (o, on, s), grads = run(fn, xb, block_size, chunk_size, with_init, length)
    (o_r, on_r, s_r), grads_r = run(block_gated_delta_rule_ref, x, block_size, chunk_size, with_init, length)
    assert o.dtype == on.dtype == jnp.bfloat16 and s.dtype == np.float32
    for name, a, b in zip(("o", "o_noisy", "state") + NAMES, (o, on, s, *grads), (o_r, on_r, s_r, *grads_r)):
        if name == "s0" and not with_init:
            continue
        assert a.dtype == (jnp.bfloat16 if name in BF16_NAMES + ("o", "o_noisy") else np.float32), name
        assert maxdiff(a.astype(np.float32), b) <= BF16_RTOL * float(np.max(np.abs(b))), name


def test_block_pallas_under_shard_map(x):
    """Through the dispatch under jax.set_mesh: batch over "data" (the one key head replicated);
    block 32 over chunks of 16, so each block-start state is read at every other chunk."""
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices()[:4])
    fn = functools.partial(block_gated_delta_rule, backend="pallas")
    with jax.set_mesh(mesh):
        (o, on, s), grads = run(fn, x, 32, 16, True)
    (o_r, on_r, s_r), grads_r = run(block_gated_delta_rule_ref, x, 32, 16, True)
    for name, a, b in (("o", o, o_r), ("o_noisy", on, on_r), ("state", s, s_r)):
        assert_rel_close(a, b, FP32_REL, name)
    for name, a, b in zip(NAMES, grads, grads_r):
        assert_rel_close(a, b, FP32_REL, name)


def test_block_phase_kernels_keep_chunk_64_and_key_heads(x):
    """Block 32 on the TPU form: every kernel of the forward and backward sweeps chunks of 64 (the
    aux operand's last dim; the fused kernel forced 32) and reads q, k, qn, kn at the key heads'
    width HK * dk (nothing repeated before the kernels). Traced only (no compile)."""
    def loss(*a):
        o, on, s = pallas_tpu_form(*a, block_size=32, chunk_size=64, segment_ids=x["seg"])
        return jnp.sum(o) + jnp.sum(on) + jnp.sum(s)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "qn", "kn", "vn", "scalars")]
    calls = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                calls.setdefault(str(eqn.params["name"]), []).append([v.aval.shape for v in eqn.invars])
            for p in eqn.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                    if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                        walk(getattr(sub, "jaxpr", sub))
    walk(jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(9))))(*args).jaxpr)
    assert set(calls) == {"gdn_intra", "gdn_block_sweep", "gdn_block_noisy", "gdn_wy", "gdn_sweep",
                          "gdn_block_state_bwd", "gdn_block_parallel_bwd"}, calls
    aux_at = dict(gdn_intra=2, gdn_block_sweep=4, gdn_wy=2, gdn_sweep=4, gdn_block_state_bwd=3,
                  gdn_block_parallel_bwd=3)
    for name, i in aux_at.items():
        assert calls[name][0][i][-1] == 64, (name, calls[name][0][i])
    q_at = dict(gdn_block_sweep=(0, 1, 6), gdn_block_noisy=(0, 1), gdn_block_parallel_bwd=(0, 1, 10, 11))
    for name, idx in q_at.items():
        assert all(calls[name][0][i] == (B, T, HK * DK) for i in idx), (name, calls[name][0])


def test_block_readout_backward_equals_autodiff():
    """The hand-derived backward of a block's readout (a block starting at a chunk start: r = (qn s) S)
    and its softmax combination, the parallel part (``noisy_tile_backward``) and the dS sweep's share
    (``tile_state_backward``), against jax.vjp of the forward pieces (no Pallas): a document boundary
    inside the block, history on for the first document only."""
    rng = np.random.default_rng(1)
    Bk, K, W = 16, 8, 4
    mm = cm.MatmulPolicy(None)
    f32 = np.float32
    qn, kn = l2(rng.standard_normal((Bk, K))).astype(f32), l2(rng.standard_normal((Bk, K))).astype(f32)
    vn, S = rng.standard_normal((Bk, W)).astype(f32), rng.standard_normal((K, W)).astype(f32)
    run_ = np.repeat([2.0, 3.0], [6, 10]).astype(f32)
    auxn = np.zeros((cm.AUX_WIDTH, Bk), f32)
    auxn[bm.RUN_N], auxn[bm.ALPHA], auxn[bpm.HDEC] = run_, 2.5, 1.0
    auxn[bm.LHIST] = np.where(run_ == 2.0, 0.7, bm.HIST_OFF)
    dO = rng.standard_normal((Bk, W)).astype(f32)
    kw = dict(scale=K ** -0.5, mm=mm)

    @jax.jit
    def both(qn, kn, vn, auxn, S, dO):
        fwd = lambda qn, kn, vn, auxn, S: bm.readout_combine(  # noqa: E731
            qn, kn, vn, auxn, bpm.tile_readout(qn, auxn, S, **kw), mm)[0]
        _, vjp = jax.vjp(fwd, qn, kn, vn, auxn, S)
        ph = bm.readout_combine(qn, kn, vn, auxn, bpm.tile_readout(qn, auxn, S, **kw), mm)[1]
        return vjp(dO), bpm.noisy_tile_backward(qn, kn, vn, auxn, S, dO, **kw)[:4] + (
            bpm.tile_state_backward(qn, auxn, ph, dO, **kw),)

    want, got = both(qn, kn, vn, auxn, S, dO)
    want, got = [np.array(a) for a in want], [np.array(a) for a in got]
    want[3][bm.RUN_N] = 0.0                       # masks get no gradient
    want[3][bm.LHIST] = np.where(run_ == 2.0, want[3][bm.LHIST], 0.0)  # the off sentinel is not a value
    # alpha is one value per head (broadcast over the tokens): only the row total is defined
    # (the kernel reports per-query shares, autodiff of the in-kernel max splits it evenly)
    for d in (want[3], got[3]):
        d[bm.ALPHA] = np.where(np.arange(Bk) == 0, d[bm.ALPHA].sum(), 0.0)
    for name, a, b in zip(("dqn", "dkn", "dvn", "dauxn", "dS"), got, want):
        assert_rel_close(a, b, FP32_REL, name)


def test_block_errors_are_clear(x):
    a = tuple(x[n] for n in ("q", "k", "v", "g", "beta", "qn", "kn", "vn", "scalars"))
    with pytest.raises(ValueError, match="multiple of block_size"):
        block_gated_delta_rule_pallas(*a, block_size=24)
    with pytest.raises(ValueError, match="one must divide the other"):
        block_gated_delta_rule_pallas(*a, block_size=32, chunk_size=24)
    with pytest.raises(ValueError, match=r"scalars must be \[H, 3\]"):
        block_gated_delta_rule_pallas(*a[:8], a[8][:, :2], block_size=32)
    with pytest.raises(ValueError, match="v_noisy must have"):
        block_gated_delta_rule_pallas(*a[:7], a[7][..., :4], a[8], block_size=32)
