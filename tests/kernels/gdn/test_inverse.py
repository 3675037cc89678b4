"""The triangular inverse of the chunk matrix, T = (I + A)^-1, by both methods of
``chunk_math.INVERSES``: "doubling" (the TPU form's) and "blocked" (16 x 16 diagonal tiles by
substitution, then merged; the GPU form's default), and the GPU kernels with one vs the other.

Oracles: numpy float64 ``solve(I + A, I)`` of chunk matrices built here in float64 from the token
quantities (keys, beta, log decays, documents), not by the kernels' phase math; the doubling inverse
(checked against float64 in test_causal_op.py) for the blocked one; and for the Triton kernels in
interpret mode, the same kernels with the doubling inverse (their oracle tests, test_causal_op.py and
test_block_op.py, run the GPU form with its default, the blocked inverse).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pallas_kernels.gdn import chunk_math as cm  # noqa: E402
from pallas_kernels.gdn import gpu_calls  # noqa: E402
from pallas_kernels.gdn import phase_math as pm  # noqa: E402
from pallas_kernels.gdn.causal_op import prepare  # noqa: E402
from pallas_kernels.gdn.kernel_bodies import KernelConfig  # noqa: E402
from tests.model.parity_utils import FP32_REL, assert_rel_close  # noqa: E402

MM = cm.MatmulPolicy(None)
KINDS = ("random", "gated", "near_repeated_keys")


def tokens(kind: str, n: int, C: int, rng, K: int = 128) -> dict[str, np.ndarray]:
    """float64 keys [n, K] (l2-normalised), beta, log decays g [n], document ids [n] of ``n`` tokens.
    "gated": random keys, beta = sigmoid(N(0, 1)) in (0, 1), g = -softplus(N(0, 1)), a document
    boundary inside every chunk; "near_repeated_keys": one key plus 1% noise, beta in (0.9, 1), g ~
    -1e-3, one document: A ~ all ones below the diagonal, the case where powers of A cancel."""
    if kind == "gated":
        k = rng.standard_normal((n, K))
        beta = 1.0 / (1.0 + np.exp(-rng.standard_normal(n)))
        g = -np.logaddexp(0.0, rng.standard_normal(n))
        doc = np.cumsum((np.arange(n) % C) == C // 2 + 3)
    else:
        k = rng.standard_normal(K) + 0.01 * rng.standard_normal((n, K))
        beta = rng.uniform(0.9, 1.0, n)
        g = -1e-3 * rng.uniform(0.5, 1.5, n)
        doc = np.zeros(n, np.int64)
    return dict(k=k / np.linalg.norm(k, axis=1, keepdims=True), beta=beta, g=g, doc=doc)


def chunk_matrices(x: dict[str, np.ndarray], C: int) -> np.ndarray:
    """float64 A [N, C, C]: A_ij = beta_i (k_i . k_j) exp(cum_i - cum_j) for j < i in one document
    (cum: the in-chunk cumsum of g restarting at each document), else 0."""
    out = []
    for c in range(len(x["g"]) // C):
        s = slice(c * C, (c + 1) * C)
        k, beta, g, doc = x["k"][s], x["beta"][s], x["g"][s], x["doc"][s]
        cum = np.array([g[np.flatnonzero(doc[:i + 1] == doc[i])].sum() for i in range(C)])
        keep = np.tril(doc[:, None] == doc[None, :], -1)
        decay = np.exp(np.where(keep, cum[:, None] - cum[None, :], 0))
        out.append(np.where(keep, beta[:, None] * (k @ k.T) * decay, 0))
    return np.stack(out)


def matrices(kind: str, C: int, rng, n_chunks: int = 6) -> np.ndarray:
    if kind == "random":   # U(-1/2, 1/2) strictly below the diagonal: cond(I + A) ~ 1e2 at C = 64
        return np.tril(rng.uniform(-0.5, 0.5, (n_chunks, C, C)), -1)
    return chunk_matrices(tokens(kind, n_chunks * C, C, rng), C)


def solve64(A: np.ndarray) -> np.ndarray:
    eye = np.eye(A.shape[-1])
    return np.linalg.solve(eye + A, np.broadcast_to(eye, A.shape))


def inverse(method: str):
    return jax.jit(jax.vmap(lambda a: cm.invert(a, MM, method)))


@pytest.mark.parametrize("C", [16, 32, 64])
@pytest.mark.parametrize("kind", KINDS)
def test_blocked_inverse_matches_float64_and_doubling(kind, C):
    A = matrices(kind, C, np.random.default_rng(C))
    A32 = jnp.asarray(A, jnp.float32)
    want = solve64(np.asarray(A32, np.float64))             # the fp32 input, solved exactly
    blocked, doubling = np.asarray(inverse("blocked")(A32)), np.asarray(inverse("doubling")(A32))
    for t in range(len(A)):   # per chunk, relative to its own inverse's largest entry (>= 1: the diagonal)
        assert_rel_close(blocked[t], want[t], FP32_REL, f"blocked vs float64, chunk {t}")
        assert_rel_close(blocked[t], doubling[t], FP32_REL, f"blocked vs doubling, chunk {t}")
        assert np.all(np.triu(blocked[t], 1) == 0) and np.all(np.diag(blocked[t]) == 1), t


def test_leaf_substitution_is_the_exact_inverse_of_small_tiles():
    """The substitution alone (the 16 x 16 tiles), including the all-ones tile whose inverse is known
    by hand: (I + L)^-1 = I - S (S the first subdiagonal) for L = ones below the diagonal."""
    rng = np.random.default_rng(1)
    A = np.tril(rng.uniform(-1, 1, (16, 16)), -1).astype(np.float32)
    assert_rel_close(jax.jit(cm.invert_unit_lower_leaf)(A), solve64(A.astype(np.float64)), FP32_REL, "leaf")
    L = np.tril(np.ones((16, 16), np.float32), -1)
    np.testing.assert_array_equal(np.asarray(jax.jit(cm.invert_unit_lower_leaf)(L)), np.eye(16) - np.eye(16, k=-1))


def test_chunk_inverse_of_prepared_chunks():
    """Through the phase math the kernels run (A built from k and the aux rows that ``prepare``
    packs): the blocked chunk inverse equals the float64 inverse of A built here from the tokens."""
    C, N, K = 64, 4, 128
    x = tokens("gated", N * C, C, np.random.default_rng(3))
    one = lambda a: jnp.asarray(a, jnp.float32)[None, :, None]  # noqa: E731  [1, T, 1(, K)]
    z = jnp.zeros((1, N * C, 1, K), jnp.float32)
    _, k, _, aux, _ = prepare(z, one(x["k"]), z, one(x["g"]), one(x["beta"]), None,
                              jnp.asarray(x["doc"], jnp.int32)[None], C)
    k32 = np.asarray(k[0], np.float64)
    want = solve64(chunk_matrices(dict(x, k=k32), C))   # the fp32-rounded keys, as the kernel sees them
    for method in cm.INVERSES:
        got = jax.jit(jax.vmap(lambda kc, a: pm.chunk_inverse(kc, a, MM, method)))(k[0].reshape(N, C, K), aux[0, 0])
        for t in range(N):
            assert_rel_close(got[t], want[t], FP32_REL, f"{method}, chunk {t}")


def test_gpu_kernels_with_either_inverse_agree():
    """The Triton kernels (interpret mode) of the causal forward and backward, fp32, with the blocked
    inverse (the GPU default) vs the doubling one: T, o, the final state and every cotangent."""
    B, T, H, HK, K, V, C = 1, 256, 2, 1, 32, 16, 64
    rng = np.random.default_rng(5)
    x = tokens("gated", T, C, rng, K)
    q = jnp.asarray(rng.standard_normal((B, T, HK, K)) / np.sqrt(K), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
    gate = lambda a: jnp.asarray(np.stack([a, a[::-1]], -1)[None], jnp.float32)  # noqa: E731  [1, T, H]
    qf, kf, vf, aux, s0 = prepare(q, jnp.asarray(x["k"], jnp.float32)[None, :, None], v, gate(x["g"]), gate(x["beta"]),
                                  jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32),
                                  jnp.asarray(x["doc"], jnp.int32)[None], C)
    dO = jnp.asarray(rng.standard_normal((B, T, H * V)), jnp.float32)
    dfin = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)

    def run(method):
        kw = dict(cfg=KernelConfig(chunk_size=C, scale=K ** -0.5, block_v=8, inverse=method), interpret=True)
        o, final, Tinv = gpu_calls.causal_forward(qf, kf, vf, aux, s0, **kw)
        grads = gpu_calls.causal_backward(qf, kf, vf, aux, s0, Tinv, dO, dfin, **kw)
        return dict(zip(("o", "final", "T", "dq", "dk", "dv", "daux", "ds0"), (o, final, Tinv) + tuple(grads)))

    assert KernelConfig().inverse_for("gpu") == "blocked" and KernelConfig().inverse_for("tpu") == "doubling"
    blocked, doubling = jax.jit(lambda: run("blocked"))(), jax.jit(lambda: run("doubling"))()
    for name in blocked:
        assert_rel_close(blocked[name], doubling[name], FP32_REL, name)


def test_errors_are_clear():
    with pytest.raises(ValueError, match="KernelConfig.inverse must be one of"):
        KernelConfig(inverse="lu")
    with pytest.raises(ValueError, match="inverse must be one of"):
        cm.invert(jnp.zeros((16, 16)), MM, "neumann")
    with pytest.raises(ValueError, match="chunk size 68 does not halve"):
        cm.invert(jnp.zeros((68, 68)), MM, "blocked")
