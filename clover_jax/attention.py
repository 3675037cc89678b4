"""Gated GQA full attention with q/k norm and partial RoPE (Qwen3.5 `Qwen3_5MoeAttention`).

The core (`attend`) takes an explicit boolean mask [B, Tq, Tk], built by a pure function of slots
and segment ids, so the block-diffusion issue can feed its own masks through the same code.
Keys come either from the current tokens (training forward) or from a preallocated KV cache that
the current tokens are first written into (prefill and decode: one code path for both).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.config import ModelConfig
from clover_jax.nn import Dense, RMSNorm, dtype_of


def rope_tables(positions_BT: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, rotary_dim] in fp32 (NeoX layout: the frequency table repeated twice)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs_BTF = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs_BTF, freqs_BTF], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BTHD: jax.Array, cos_BTR: jax.Array, sin_BTR: jax.Array) -> jax.Array:
    """Partial rotary embedding on the first R dims of each head (`rotate_half` convention)."""
    r = cos_BTR.shape[-1]
    x_rot, x_pass = x_BTHD[..., :r], x_BTHD[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos_BTR[:, :, None, :], sin_BTR[:, :, None, :]
    out = x_rot.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return jnp.concatenate([out.astype(x_BTHD.dtype), x_pass], axis=-1)


def causal_segment_mask(
    q_slot_BT: jax.Array, q_seg_BT: jax.Array, k_slot_BS: jax.Array, k_seg_BS: jax.Array
) -> jax.Array:
    """[B, Tq, Tk] bool: key visible iff it is not later than the query and in the same document.

    Slots are indices in the (cached) sequence, not RoPE positions, so causality stays right when
    positions restart per packed document. Pads are their own segment and never meet a document.
    """
    causal = k_slot_BS[:, None, :] <= q_slot_BT[:, :, None]
    same_doc = k_seg_BS[:, None, :] == q_seg_BT[:, :, None]
    return causal & same_doc


def noisy_query_mask(
    q_start_BT: jax.Array, q_seg_BT: jax.Array, k_slot_BS: jax.Array, k_seg_BS: jax.Array,
    k_start_BS: jax.Array, k_noisy_S: jax.Array,
) -> jax.Array:
    """[B, Tq, S] bool, the block-diffusion rule for NOISY queries (DESIGN.md 3.1): a clean key is
    visible iff it is in the query's document and strictly before the query's block start; a noisy
    key iff it is in the query's document and in the same block. `*_start`: slot of the first
    position of the token's block; `k_noisy_S`: which keys are noisy-stream tokens."""
    same_doc = k_seg_BS[:, None, :] == q_seg_BT[:, :, None]
    clean_ok = ~k_noisy_S[None, None, :] & (k_slot_BS[:, None, :] < q_start_BT[:, :, None])
    noisy_ok = k_noisy_S[None, None, :] & (k_start_BS[:, None, :] == q_start_BT[:, :, None])
    return same_doc & (clean_ok | noisy_ok)


def two_stream_masks(segment_ids_BT: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """(clean [B, T, T], noisy [B, T, 2T]) training masks; keys of the noisy rows are clean slots
    0..T-1 then noisy slots T..2T-1. Blocks are on the row grid (slot // block_size)."""
    b, t = segment_ids_BT.shape
    slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    start = slots - slots % block_size
    clean = causal_segment_mask(slots, segment_ids_BT, slots, segment_ids_BT)
    both = lambda a: jnp.concatenate([a, a], axis=1)  # noqa: E731
    noisy = noisy_query_mask(start, segment_ids_BT, both(slots), both(segment_ids_BT), both(start),
                             jnp.arange(2 * t) >= t)
    return clean, noisy


def two_stream_mask(segment_ids_BT: jax.Array, block_size: int) -> jax.Array:
    """The full [B, 2T, 2T] training mask over (clean slots 0..T-1 || noisy slots T..2T-1), a pure
    function of the indices, the segments and the block size: clean queries are token-causal within
    their document and never see noisy keys; noisy queries follow `noisy_query_mask`."""
    clean, noisy = two_stream_masks(segment_ids_BT, block_size)
    clean_rows = jnp.concatenate([clean, jnp.zeros_like(clean)], axis=2)
    return jnp.concatenate([clean_rows, noisy], axis=1)


def attend(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, mask_BTS: jax.Array) -> jax.Array:
    """Softmax attention with GQA (query head h uses KV head h // (H/K)), fp32 softmax.

    A query with no visible key (never the case for real tokens: each sees itself) gets zeros.
    Returns [B, T, H, D] in the dtype of v.
    """
    b, t, h, d = q_BTHD.shape
    kv = k_BSKD.shape[2]
    q_BTKGD = q_BTHD.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD, preferred_element_type=jnp.float32)
    scores = scores * (d ** -0.5)
    mask = mask_BTS[:, None, None, :, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask, probs, 0.0)  # rows with no visible key: 0 instead of NaN
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_BSKD.dtype), v_BSKD,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(v_BSKD.dtype)


class Attention(nnx.Module):
    """Full attention layer: q (with an interleaved per-head output gate), k, v projections, q/k norm,
    partial RoPE, GQA attention, `o_proj(attn * sigmoid(gate))`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd, dt = dtype_of(cfg.param_dtype), dtype_of(cfg.dtype)
        d, hq, hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        kw = dict(rngs=rngs, param_dtype=pd, dtype=dt)
        self.q_proj = Dense(d, hq * 2 * hd, ("embed", "q_heads"), **kw)
        self.k_proj = Dense(d, hkv * hd, ("embed", "kv_heads"), **kw)
        self.v_proj = Dense(d, hkv * hd, ("embed", "kv_heads"), **kw)
        self.o_proj = Dense(hq * hd, d, ("heads", "embed"), **kw)
        self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, rngs=rngs, axis_name="head_dim", param_dtype=pd)
        self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, rngs=rngs, axis_name="head_dim", param_dtype=pd)
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, hd

    def project_kv(self, x_BTD: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Normed, rotated keys and values [B, T, K, hd]."""
        b, t, _ = x_BTD.shape
        k = self.k_norm(self.k_proj(x_BTD).reshape(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x_BTD).reshape(b, t, self.num_kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def project_q(self, x_BTD: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Normed, rotated queries [B, T, H, hd] and the output gate [B, T, H*hd]."""
        b, t, _ = x_BTD.shape
        qg = self.q_proj(x_BTD).reshape(b, t, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]
        q = apply_rope(self.q_norm(q), cos, sin)
        return q, gate.reshape(b, t, self.num_heads * self.head_dim)

    def output(self, attn_BTHD: jax.Array, gate_BTF: jax.Array) -> jax.Array:
        b, t = attn_BTHD.shape[:2]
        y = attn_BTHD.reshape(b, t, -1) * jax.nn.sigmoid(gate_BTF.astype(jnp.float32)).astype(attn_BTHD.dtype)
        return self.o_proj(y)

    def __call__(
        self, x_BTD: jax.Array, ctx: dict[str, Any], cache: dict[str, jax.Array] | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        """x [B, T, D] -> [B, T, D]. `ctx` holds `cos`, `sin` [B, T, R] and `mask` [B, T, S] (S = T
        without cache, the cache length with one); with a cache (`k`, `v` [B, S, K, hd]) the new keys
        are written at `ctx["cache_index"]` first and the updated cache is returned."""
        q, gate = self.project_q(x_BTD, ctx["cos"], ctx["sin"])
        k, v = self.project_kv(x_BTD, ctx["cos"], ctx["sin"])
        if cache is not None:
            idx = ctx["cache_index"]
            k_all = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), idx, axis=1)
            v_all = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), idx, axis=1)
            cache = {"k": k_all, "v": v_all}
            k, v = k_all.astype(q.dtype), v_all.astype(q.dtype)
        out = attend(q, k, v, ctx["mask"])
        return self.output(out, gate), cache


    def two_stream(self, x_BSD: jax.Array, ctx: dict[str, Any]) -> jax.Array:
        """Training forward of both streams: x [B, 2T, D] = clean || noisy. `ctx`: `cos`/`sin`
        [B, T, R] (both streams share positions), `mask` [B, T, T] (clean, causal) and
        `noisy_mask` [B, T, 2T] over clean || noisy keys."""
        cos2, sin2 = (jnp.concatenate([a, a], axis=1) for a in (ctx["cos"], ctx["sin"]))
        q, gate = self.project_q(x_BSD, cos2, sin2)
        k, v = self.project_kv(x_BSD, cos2, sin2)
        t = ctx["cos"].shape[1]
        out_c = attend(q[:, :t], k[:, :t], v[:, :t], ctx["mask"])
        out_n = attend(q[:, t:], k, v, ctx["noisy_mask"])
        return self.output(jnp.concatenate([out_c, out_n], axis=1), gate)

    def block_step(self, x_BKD: jax.Array, ctx: dict[str, Any], cache: dict[str, jax.Array]) -> jax.Array:
        """Decode side: a noisy canvas [B, Bk, D] against the cached clean K/V (read only).
        `ctx["mask"]` [B, Bk, S + Bk] over cached slots || canvas keys."""
        q, gate = self.project_q(x_BKD, ctx["cos"], ctx["sin"])
        k, v = self.project_kv(x_BKD, ctx["cos"], ctx["sin"])
        k_all = jnp.concatenate([cache["k"].astype(q.dtype), k], axis=1)
        v_all = jnp.concatenate([cache["v"].astype(q.dtype), v], axis=1)
        return self.output(attend(q, k_all, v_all, ctx["mask"]), gate)


def init_attention_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype) -> dict[str, jax.Array]:
    shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
