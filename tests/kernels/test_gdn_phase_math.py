"""The phase-split per-chunk math (gdn_phase_math) against the one-step chunk math and autodiff.

Oracle: ``gdn_chunk_math.chunk_forward`` (itself tested against transformers through the kernels)
and ``jax.vjp`` of it; the phases composed (intra -> sweep; state backward, parallel backward) must
reproduce the forward and every cotangent of one chunk with documents, decays and a carried state.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import gdn_chunk_math as cm  # noqa: E402
from pallas_kernels import gdn_phase_math as pm  # noqa: E402
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
