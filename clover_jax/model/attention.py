"""Gated GQA full attention with q/k norm and partial RoPE (Qwen3.5 `Qwen3_5MoeAttention`).

The attention core is chosen by `ModelConfig.attn_backend` through `pallas_kernels.attention.ops`:
the training streams (clean: causal in-document; noisy: the block rule of docs/design.md 3.1) run the
TPU splash kernel, the GPU flash kernel or the jnp reference (`attend` over an explicit boolean mask
[B, Tq, Tk], built by a pure function of slots and segment ids). Prefill, decoding and the
decode-side block steps keep the dense reference: their masks index a cache, and their query
blocks are short. With the row's sequence sharded over the `context` mesh axis, both training
streams run `pallas_kernels.context.attention` (all-gathered K/V, the same backend per shard, one
exchange for both streams; the dense masks are not used).
Keys come either from the current tokens (training forward) or from a preallocated KV cache that
the current tokens are first written into (prefill and decode: one code path for both).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.config import ModelConfig
from clover_jax.model.nn import Dense, RMSNorm, dtype_of
from pallas_kernels.attention.reference import (  # noqa: F401  (re-exported: the model's mask builders)
    attend, causal_segment_mask, noisy_query_mask, two_stream_masks,
)
from pallas_kernels.context.attention import context_stream_attention, context_two_stream_attention
from pallas_kernels.attention.ops import resolve_attn_backend, stream_attention
from pallas_kernels.attention.spans import attend_spans, causal_spans
from pallas_kernels.context.axis import context_size
from pallas_kernels.context.stream_layout import join_streams, split_streams


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


def two_stream_mask(segment_ids_BT: jax.Array, block_size: int) -> jax.Array:
    """The full [B, 2T, 2T] training mask over (clean slots 0..T-1 || noisy slots T..2T-1), a pure
    function of the indices, the segments and the block size: clean queries are token-causal within
    their document and never see noisy keys; noisy queries follow `noisy_query_mask`."""
    clean, noisy = two_stream_masks(segment_ids_BT, block_size)
    clean_rows = jnp.concatenate([clean, jnp.zeros_like(clean)], axis=2)
    return jnp.concatenate([clean_rows, noisy], axis=1)


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
        self.backend = cfg.attn_backend

    def project_kv(self, x_BTD: jax.Array, cos: jax.Array, sin: jax.Array, lora_key: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array]:
        """Normed, rotated keys and values [B, T, K, hd] (`lora_key`: the adapters' dropout, `Dense`)."""
        b, t, _ = x_BTD.shape
        k = self.k_norm(self.k_proj(x_BTD, lora_key).reshape(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x_BTD, lora_key).reshape(b, t, self.num_kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def project_q(self, x_BTD: jax.Array, cos: jax.Array, sin: jax.Array, lora_key: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
        """Normed, rotated queries [B, T, H, hd] and the output gate [B, T, H*hd]."""
        b, t, _ = x_BTD.shape
        qg = self.q_proj(x_BTD, lora_key).reshape(b, t, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]
        q = apply_rope(self.q_norm(q), cos, sin)
        return q, gate.reshape(b, t, self.num_heads * self.head_dim)

    def output(self, attn_BTHD: jax.Array, gate_BTF: jax.Array, lora_key: jax.Array | None = None) -> jax.Array:
        b, t = attn_BTHD.shape[:2]
        y = attn_BTHD.reshape(b, t, -1) * jax.nn.sigmoid(gate_BTF.astype(jnp.float32)).astype(attn_BTHD.dtype)
        return self.o_proj(y, lora_key)

    def __call__(
        self, x_BTD: jax.Array, ctx: dict[str, Any], cache: dict[str, jax.Array] | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        """x [B, T, D] -> [B, T, D]. `ctx` holds `cos`, `sin` [B, T, R] and `mask` [B, T, S] (S = T
        without cache, the cache length with one; without a cache on a kernel backend, `segment_ids`
        [B, T] instead); with a cache (`k`, `v` [B, S, K, hd]) the new keys
        are written at `ctx["cache_index"]` first and the updated cache is returned."""
        lk = ctx.get("lora_key")
        q, gate = self.project_q(x_BTD, ctx["cos"], ctx["sin"], lk)
        k, v = self.project_kv(x_BTD, ctx["cos"], ctx["sin"], lk)
        if cache is not None:
            idx = ctx["cache_index"]
            k_all = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), idx, axis=1)
            v_all = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), idx, axis=1)
            cache = {"k": k_all, "v": v_all}
            k, v = k_all.astype(q.dtype), v_all.astype(q.dtype)
        if cache is None and context_size() > 1:  # T sharded over the `context` mesh axis (decided here only)
            out = context_stream_attention(q, k, v, ctx["segment_ids"], stream="clean",
                                           backend=resolve_attn_backend(self.backend),
                                           layout=ctx.get("context_layout", "contiguous"))
        elif "mask" in ctx and cache is None:  # the reference backend's causal forward
            out = attend_spans(q, k, v, ctx["mask"], causal_spans(q.shape[1]))
        elif "mask" in ctx:  # against a cache: the dense mask is given
            out = attend(q, k, v, ctx["mask"])
        else:  # the clean forward without a cache on a kernel backend
            out = stream_attention(q, k, v, ctx["segment_ids"], stream="clean", backend=self.backend)
        return self.output(out, gate, lk), cache


    def two_stream(self, x_BSD: jax.Array, ctx: dict[str, Any]) -> jax.Array:
        """Training forward of both streams: x [B, 2T, D], the clean and noisy tokens in the layout of
        `pallas_kernels.context.stream_layout`. `ctx`: `cos`/`sin` [B, T, R] (both streams share positions),
        `segment_ids` [B, T], `block_size`, and for the reference backend the precomputed `mask`
        [B, T, T] (clean, causal) and `noisy_mask` [B, T, 2T] over clean || noisy keys (the kernel
        builds its masks from the segment ids)."""
        cos2, sin2 = (join_streams(a, a) for a in (ctx["cos"], ctx["sin"]))
        lk = ctx.get("lora_key")
        q, gate = self.project_q(x_BSD, cos2, sin2, lk)
        k, v = self.project_kv(x_BSD, cos2, sin2, lk)
        (q_c, q_n), (k_c, k_n), (v_c, v_n) = (split_streams(a) for a in (q, k, v))
        seg = ctx["segment_ids"]
        if context_size() > 1:  # each stream's T over the `context` axis (decided here only): one K/V exchange
            out_c, out_n = context_two_stream_attention(q_c, q_n, k_c, k_n, v_c, v_n, seg,
                                                        block_size=ctx["block_size"],
                                                        backend=resolve_attn_backend(self.backend),
                                                        layout=ctx.get("context_layout", "contiguous"))
            return self.output(join_streams(out_c, out_n), gate, lk)
        out_c = stream_attention(q_c, k_c, v_c, seg, stream="clean", backend=self.backend, mask_BTS=ctx.get("mask"))
        out_n = stream_attention(q_n, jnp.concatenate([k_c, k_n], axis=1), jnp.concatenate([v_c, v_n], axis=1), seg,
                                 stream="noisy", block_size=ctx["block_size"], backend=self.backend,
                                 mask_BTS=ctx.get("noisy_mask"))
        return self.output(join_streams(out_c, out_n), gate, lk)

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
