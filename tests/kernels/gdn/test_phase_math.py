"""The phase-split per-chunk math (gdn.phase_math) against the one-step chunk math and autodiff.

Oracle: ``gdn.chunk_math.chunk_forward`` (the one-step UT form: T applied to beta (v - ein k S))
and ``jax.vjp`` of it; the phases composed (intra -> sweep; state backward, parallel backward) must
reproduce the forward and every cotangent of one chunk with documents, decays and a carried state.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.gdn import block_math as bm  # noqa: E402
from pallas_kernels.gdn import block_phase_math as bpm  # noqa: E402
from pallas_kernels.gdn import chunk_math as cm  # noqa: E402
from pallas_kernels.gdn import phase_math as pm  # noqa: E402
from tests.model.parity_utils import FP32_REL, assert_rel_close  # noqa: E402

C, K, W = 16, 8, 4
SCALE = K ** -0.5


def l2(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def chunk_case(seed: int = 0):
    rng = np.random.default_rng(seed)
    f = np.float32
    q, k = l2(rng.standard_normal((C, K))).astype(f), l2(rng.standard_normal((C, K))).astype(f)
    v, S = rng.standard_normal((C, W)).astype(f), rng.standard_normal((K, W)).astype(f)
    run = np.array([0] * 5 + [1] * 7 + [2] * 4, f)
    cum = np.cumsum(-0.3 * np.abs(rng.standard_normal(C))).astype(f)
    aux = np.zeros((cm.AUX_WIDTH, C), f)
    aux[cm.CUM], aux[cm.BETA], aux[cm.RUN], aux[cm.SDEC] = cum, rng.uniform(0.1, 0.9, C), run, 0.7
    aux[cm.EIN] = np.exp(cum) * (run == 0)
    aux[cm.EOUT] = np.exp(cum[-1] - cum) * (run == 2)
    dO, dSn = rng.standard_normal((C, W)).astype(f), rng.standard_normal((K, W)).astype(f)
    return q, k, v, aux, S, dO, dSn


def close(a, b, what):
    assert_rel_close(a, b, FP32_REL, what)


def test_phases_compose_to_the_chunk_forward_and_its_vjp():
    q, k, v, aux, S, dO, dSn = chunk_case()
    mm = cm.MatmulPolicy(None)

    @jax.jit
    def run(q, k, v, aux, S, dO, dSn):
        fwd = lambda *a: cm.chunk_forward(*a, scale=SCALE, mm=mm)  # noqa: E731
        want_fwd, vjp = jax.vjp(fwd, q, k, v, aux, S)
        T, w, u = pm.chunk_intra(k, v, aux, mm)
        got_fwd = pm.chunk_sweep(q, k, w, u, aux, S, scale=SCALE, mm=mm)
        dS = pm.chunk_state_backward(q, k, w, aux, dO, dSn, scale=SCALE, mm=mm)
        dq, dk, dv, daux = pm.chunk_parallel_backward(q, k, v, aux, T, w, u, S, dO, dSn, scale=SCALE, mm=mm)
        return want_fwd, vjp((dO, dSn)), got_fwd, (dq, dk, dv, daux, dS)

    want_fwd, want_bwd, got_fwd, got_bwd = run(q, k, v, aux, S, dO, dSn)
    close(got_fwd[0], want_fwd[0], "o")
    close(got_fwd[1], want_fwd[1], "S'")
    want_bwd = [np.array(a) for a in want_bwd]
    # d(sdec) is reported once per chunk (token 0): sdec is one value broadcast over the chunk
    want_bwd[3][cm.SDEC] = np.where(np.arange(C) == 0, want_bwd[3][cm.SDEC].sum(), 0.0)
    want_bwd[3][cm.RUN] = 0.0
    for name, a, b in zip(("dq", "dk", "dv", "daux", "dS"), got_bwd, want_bwd):
        close(a, b, name)


def _recurrent_chunk_with_readouts(q, k, v, aux, S, qn, kn, vn, auxn, Bk):
    """Token-by-token oracle of one chunk in block mode: the delta rule with document resets (the
    carried state decays by EIN at token 0, the chunk's first document continues it), the state
    after every token kept, each noisy row reading the state before its block's first token."""
    mm = cm.MatmulPolicy(None)
    cum, beta, run = aux[cm.CUM], aux[cm.BETA], aux[cm.RUN]
    ein0 = aux[cm.EIN][0]                                     # exp(g_0) on the continuing document
    states, S_t = [S], S
    for t in range(C):
        decay = ein0 if t == 0 else jnp.where(run[t] == run[t - 1], jnp.exp(cum[t] - cum[t - 1]), 0.0)
        S_t = decay * S_t
        S_t = S_t + jnp.outer(k[t], beta[t] * (v[t] - S_t.T @ k[t]))
        states.append(S_t)
    o = jnp.stack([SCALE * states[t + 1].T @ q[t] for t in range(C)])
    r = jnp.stack([SCALE * states[(t // Bk) * Bk].T @ qn[t] for t in range(C)])
    on = bm.readout_combine(qn, kn, vn, auxn, r, mm)[0]
    return o, states[-1], on


def test_block_readouts_in_the_phases_match_a_token_recurrence_and_its_vjp():
    """Blocks of 4 inside a chunk of 16 with 3 documents: the sweep's readouts (chunk-start state and
    the chunk's deltas) and every hand-derived cotangent of the block phase math (the reverse sweep's
    dS; the parallel step's clean and noisy gradients) against a token-by-token recurrence and
    jax.vjp of it."""
    q, k, v, aux, S, dO, dSn = chunk_case(3)
    aux[cm.SDEC] = 0.0     # the chunk's last document starts inside it: the carried state is dropped
    rng = np.random.default_rng(5)
    f = np.float32
    Bk = 4
    qn, kn = l2(rng.standard_normal((C, K))).astype(f), l2(rng.standard_normal((C, K))).astype(f)
    vn, dOn = rng.standard_normal((C, W)).astype(f), rng.standard_normal((C, W)).astype(f)
    run, pos = aux[cm.RUN], np.arange(C)
    first = pos % Bk == 0
    auxn = np.zeros((cm.AUX_WIDTH, C), f)
    piece = np.cumsum(first | (np.r_[0, run[1:] != run[:-1]] > 0))
    start = pos - pos % Bk
    auxn[bm.RUN_N], auxn[bm.ALPHA] = piece, 2.5
    auxn[bm.LHIST] = np.where(run == run[np.maximum(start - 1, 0)], 0.4, bm.HIST_OFF)
    auxn[bpm.BLK] = pos // Bk
    in_first = pos < Bk
    auxn[bpm.HDEC] = np.where(in_first, 1.0, aux[cm.EIN][np.maximum(start - 1, 0)])
    auxn[bpm.CUMB] = np.where(in_first, 0.0, aux[cm.CUM][np.maximum(start - 1, 0)])
    auxn[bpm.RUNB] = np.where(in_first, -1.0, run[np.maximum(start - 1, 0)])
    mm = cm.MatmulPolicy(None)

    @jax.jit
    def both(q, k, v, aux, S, qn, kn, vn, auxn):
        oracle = lambda *a: _recurrent_chunk_with_readouts(*a[:4], a[4], *a[5:], Bk)  # noqa: E731
        want_fwd, vjp = jax.vjp(oracle, q, k, v, aux, S, qn, kn, vn, auxn)
        T, w, u = pm.chunk_intra(k, v, aux, mm)
        o, S_new, r = bpm.chunk_block_sweep(q, k, w, u, aux, S, qn, auxn, scale=SCALE, mm=mm)
        on, ph = bm.readout_combine(qn, kn, vn, auxn, r, mm)
        dS = bpm.chunk_block_state_backward(q, k, w, aux, dO, dSn, qn, auxn, ph, dOn, scale=SCALE, mm=mm)
        grads = bpm.chunk_block_parallel_backward(q, k, v, aux, T, w, u, S, dO, dSn, qn, kn, vn, auxn, dOn,
                                                  scale=SCALE, mm=mm)
        return want_fwd, vjp((dO, dSn, dOn)), (o, S_new, on), grads, dS

    want_fwd, want, got_fwd, grads, dS = both(q, k, v, aux, S, qn, kn, vn, auxn)
    for name, a, b in zip(("o", "S'", "o_noisy"), got_fwd, want_fwd):
        close(a, b, name)
    want = [np.array(a) for a in want]
    dq, dk, dv, daux, dqn, dkn, dvn, dauxn = grads
    # d aux is not compared here: the oracle reads the decays from CUM differences, the phase math
    # from EIN / EOUT / SDEC / CUMB / HDEC too (the kernel tests compare d g through the prep)
    for name, a, b in (("dq", dq, want[0]), ("dk", dk, want[1]), ("dv", dv, want[2]), ("dS", dS, want[4]),
                       ("dqn", dqn, want[5]), ("dkn", dkn, want[6]), ("dvn", dvn, want[7])):
        close(a, b, name)
    want_n = want[8]
    want_n[bm.LHIST] = np.where(auxn[bm.LHIST] > 0.5 * bm.HIST_OFF, want_n[bm.LHIST], 0.0)
    close(np.array(dauxn)[bm.ALPHA].sum(), want_n[bm.ALPHA].sum(), "dalpha")   # one alpha per head
    close(np.array(dauxn)[bm.LHIST], want_n[bm.LHIST], "dLHIST")
