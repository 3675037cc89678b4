"""A dtype-generic per-token oracle of the GDN ops (causal and block mode), run in float64 in its
own process (``python tests/kernels/gdn/f64_oracle.py IN.npz OUT.npz ...``: JAX's x64 switch is global,
so the fp32 kernels under test never share a process with it).

Written independently of ``pallas_kernels.gdn`` (which casts everything to fp32): the literal
recurrence ``S = exp(g_t) S; d = beta_t (v_t - S^T k_t); S = S + k_t d^T; o_t = S^T (q_t dk^-0.5)``
with document resets, one ``lax.scan`` over tokens, and for block mode the noisy readout of each
block (one softmax over the in-block logits alpha qn.kn in the token's document and the history
logit beta + gamma log Bk, whose value is the readout of the clean state entering the block).
Gradients are JAX autodiff of it, so d loss / d g per token is the exact (to ~1e-15) reference.
"""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

#: the differentiated inputs, in order (block mode adds the noisy stream and the scalars)
CAUSAL = ("q", "k", "v", "g", "beta", "s0")
BLOCK = CAUSAL + ("qn", "kn", "vn", "scalars")


def _runs(seg: np.ndarray) -> np.ndarray:
    """Document index per token [B, T]: a new document wherever the id changes (never at t = 0)."""
    reset = np.concatenate([np.zeros((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return np.cumsum(reset, axis=1)


def states(q, k, v, g, beta, s0, run):
    """(o [B, T, H, V], state after every token [B, T, H, K, V]) by the per-token recurrence; q, k
    [B, T, HK, K] (value head h reads key head h // (H / HK))."""
    H = v.shape[2]
    rep = H // q.shape[2]
    q, k = jnp.repeat(q, rep, axis=2) * q.shape[-1] ** -0.5, jnp.repeat(k, rep, axis=2)
    reset = jnp.asarray(np.concatenate([np.zeros((run.shape[0], 1), bool), run[:, 1:] != run[:, :-1]], axis=1))

    def step(S, x):
        qt, kt, vt, gt, bt, rt = x
        S = jnp.where(rt[:, None, None, None], 0.0, S) * jnp.exp(gt)[..., None, None]
        d = bt[..., None] * (vt - jnp.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt[..., :, None] * d[..., None, :]
        return S, (jnp.einsum("bhkv,bhk->bhv", S, qt), S)

    tm = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
    _, (o, St) = jax.lax.scan(step, s0, tuple(map(tm, (q, k, v, g, beta, reset))))
    return tm(o), tm(St)


def noisy(qn, kn, vn, scalars, St, s0, run, block: int, has_s0: bool):
    """o_noisy [B, T, H, V]: each block's softmax over in-document in-block logits and the history unit."""
    B, T, H, V = vn.shape
    rep = H // qn.shape[2]
    qn, kn = jnp.repeat(qn, rep, axis=2), jnp.repeat(kn, rep, axis=2)
    n = T // block
    # the state entering block m: after token m*Bk - 1 (s0 for block 0), in that token's document
    entry = jnp.concatenate([s0[:, None], St[:, block - 1:T - 1:block]], axis=1)        # [B, n, H, K, V]
    runb = run.reshape(B, n, block)
    prev = np.concatenate([run[:, :1], runb[:, :-1, -1]], axis=1)
    hist = runb == prev[..., None]
    if not has_s0:
        hist[:, 0] = False
    same = runb[..., :, None] == runb[..., None, :]
    blk = lambda x: x.reshape((B, n, block) + x.shape[2:])  # noqa: E731
    alpha, lb, gamma = scalars[:, 0], scalars[:, 1], scalars[:, 2]
    L = alpha[:, None, None] * jnp.einsum("bnihk,bnjhk->bnhij", blk(qn), blk(kn))
    L = jnp.where(same[:, :, None], L, -jnp.inf)
    lh = jnp.broadcast_to((lb + gamma * math.log(block))[:, None, None], L.shape[:-1] + (1,))
    lh = jnp.where(hist[:, :, None, :, None], lh, -jnp.inf)
    p = jax.nn.softmax(jnp.concatenate([L, lh], axis=-1), axis=-1)
    r = jnp.einsum("bnchk,bnhkv->bnchv", blk(qn) * qn.shape[-1] ** -0.5, entry)
    o = jnp.einsum("bnhij,bnjhv->bnihv", p[..., :-1], blk(vn)) + jnp.moveaxis(p[..., -1], 2, 3)[..., None] * r
    return o.reshape(B, T, H, V)


def loss_and_grads(x: dict[str, np.ndarray], block: int | None, dtype) -> tuple[float, list[np.ndarray]]:
    """(loss, its gradients w.r.t. CAUSAL or BLOCK inputs) in ``dtype``; loss = sum(o w_o) + sum(S_T w_s)
    (+ sum(o_noisy w_on) in block mode). ``x`` holds the inputs, ``seg`` and the weights."""
    names = CAUSAL if block is None else BLOCK
    run = _runs(np.asarray(x["seg"]))
    w = {n: jnp.asarray(x[n], dtype) for n in ("w_o", "w_s", "w_on") if n in x}

    def loss(*a):
        d = dict(zip(names, a))
        o, St = states(d["q"], d["k"], d["v"], d["g"], d["beta"], d["s0"], run)
        val = jnp.sum(o * w["w_o"]) + jnp.sum(St[:, -1] * w["w_s"])
        if block is not None:
            on = noisy(d["qn"], d["kn"], d["vn"], d["scalars"], St, d["s0"], run, block, bool(x.get("has_s0", True)))
            val = val + jnp.sum(on * w["w_on"])
        return val

    vg = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(names)))))
    val, grads = vg(*(jnp.asarray(x[n], dtype) for n in names))
    return float(val), [np.asarray(a) for a in grads]


def main(argv: list[str]) -> None:
    """argv: pairs IN.npz OUT.npz; each IN holds a case (inputs, ``seg``, weights, ``block`` = 0 for
    the causal op, ``has_s0``), each OUT gets ``loss`` and ``d<name>`` per input, float64."""
    jax.config.update("jax_enable_x64", True)
    for src, dst in zip(argv[::2], argv[1::2], strict=True):
        with np.load(src) as f:
            x = dict(f)
        block = int(x["block"]) or None
        val, grads = loss_and_grads(x, block, jnp.float64)
        names = CAUSAL if block is None else BLOCK
        np.savez(dst, loss=np.float64(val), **{f"d{n}": a for n, a in zip(names, grads)})


if __name__ == "__main__":
    main(sys.argv[1:])
