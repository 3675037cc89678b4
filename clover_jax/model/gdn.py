"""The Gated DeltaNet layer (Qwen3.5 `Qwen3_5MoeGatedDeltaNet`), AR (clean-stream) mode.

Shapes: D hidden, nk/nv key/value heads, dk/dv head dims, K conv kernel, L = K-1 ring length.
q, k, v are projected and convolved as three separate channel groups (HF fuses them into one
`in_proj_qkv` and one conv; the bridge splits rows) so that tensor parallelism can shard each by head.

Packed rows: the conv never reads a tap from another document, and the recurrent state resets where
the segment id changes. With a cache, the conv reads the ring of the last L pre-conv inputs and the
recurrence starts from the cached state, unless the first new token starts a new document.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from clover_jax.config import ModelConfig
from clover_jax.model.gdn_conv import CONV_PARTS, block_conv, block_rings, causal_conv
from clover_jax.model.nn import Dense, GatedRMSNorm, constant, dtype_of, make_param, normal
from pallas_kernels.context.axis import context_size
from pallas_kernels.context.stream_layout import join_streams, split_streams


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """`x * rsqrt(sum(x^2) + eps)` over the last axis (fla / transformers convention), fp32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class GatedDeltaNet(nnx.Module):
    """GDN mixer: projections, causal conv + SiLU, gates, l2norm, gated delta rule, gated norm, out_proj."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd, dt = dtype_of(cfg.param_dtype), dtype_of(cfg.dtype)
        d, kd, vd, nv = cfg.hidden_size, cfg.gdn_key_dim, cfg.gdn_value_dim, cfg.linear_num_value_heads
        kw = dict(rngs=rngs, param_dtype=pd, dtype=dt)
        self.in_proj_q = Dense(d, kd, ("embed", "gdn_qk"), **kw)
        self.in_proj_k = Dense(d, kd, ("embed", "gdn_qk"), **kw)
        self.in_proj_v = Dense(d, vd, ("embed", "gdn_v"), **kw)
        self.in_proj_z = Dense(d, vd, ("embed", "gdn_v"), **kw)
        self.in_proj_b = Dense(d, nv, ("embed", "gdn_heads"), **kw)
        self.in_proj_a = Dense(d, nv, ("embed", "gdn_heads"), **kw)
        k = cfg.linear_conv_kernel_dim
        block = cfg.mode == "block"
        self.conv_q = _ConvKernel(k, kd, "gdn_qk", rngs=rngs, param_dtype=pd, right=block)
        self.conv_k = _ConvKernel(k, kd, "gdn_qk", rngs=rngs, param_dtype=pd, right=block)
        self.conv_v = _ConvKernel(k, vd, "gdn_v", rngs=rngs, param_dtype=pd, right=block)
        if block:
            # Clover block mode (docs/design.md 3.2 B): per value head (alpha, beta, gamma), always fp32.
            self.bd_gdn_softmax_scalars = make_param(
                rngs, _rows(cfg.bd_scalar_init), (nv, 3), ("gdn_heads", "bd_scalar"), jnp.float32)
        # A_log and dt_bias stay fp32 whatever param_dtype is (HF keeps A_log fp32; both feed exp).
        self.A_log = make_param(rngs, _log_uniform(1.0, 16.0), (nv,), ("gdn_heads",), jnp.float32)
        self.dt_bias = make_param(rngs, constant(1.0), (nv,), ("gdn_heads",), jnp.float32)
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, eps=cfg.rms_norm_eps, rngs=rngs, param_dtype=pd)
        self.out_proj = Dense(vd, d, ("gdn_v", "embed"), **kw)
        self.cfg = cfg

    def mix_inputs(self, x_BTD: jax.Array, lora_key: jax.Array | None = None) -> dict[str, jax.Array]:
        """Pre-conv q, k, v [B, T, C_part] and the gates' inputs z [B,T,nv,dv], b, a [B,T,nv]
        (`lora_key`: the adapters' dropout, `Dense`)."""
        b, t, _ = x_BTD.shape
        c = self.cfg
        return {
            "q": self.in_proj_q(x_BTD, lora_key),
            "k": self.in_proj_k(x_BTD, lora_key),
            "v": self.in_proj_v(x_BTD, lora_key),
            "z": self.in_proj_z(x_BTD, lora_key).reshape(b, t, c.linear_num_value_heads, c.linear_value_head_dim),
            "b": self.in_proj_b(x_BTD, lora_key),
            "a": self.in_proj_a(x_BTD, lora_key),
        }

    def gates(self, b_BTH: jax.Array, a_BTH: jax.Array) -> tuple[jax.Array, jax.Array]:
        """beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias), both fp32 [B, T, nv]."""
        beta = jax.nn.sigmoid(b_BTH.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a_BTH.astype(jnp.float32) + self.dt_bias[...])
        return g, beta

    def heads(self, conv: dict[str, jax.Array], repeat: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Post-conv channels -> q, k l2-normalised [B,T,nk,dk], repeated to nv heads [B,T,nv,dk] with
        `repeat` (the context-parallel ops and the decode-side block readout need it; the causal and
        block-mode ops read key head h // (nv/nk) themselves); v [B,T,nv,dv]; all three in the compute dtype (the conv's): with `dtype:
        bfloat16` the GDN kernels then run their chunk matmuls on bf16 operands with fp32
        accumulation (state and triangular inverse stay fp32 inside); the norm itself is taken in
        fp32 and rounded once."""
        c = self.cfg
        dt = conv["v"].dtype
        b, t, _ = conv["q"].shape
        rep = c.linear_num_value_heads // c.linear_num_key_heads
        # -1 heads: under a head-sharded shard_map the channels are a device's whole heads
        q = conv["q"].reshape(b, t, -1, c.linear_key_head_dim)
        k = conv["k"].reshape(b, t, -1, c.linear_key_head_dim)
        v = conv["v"].reshape(b, t, -1, c.linear_value_head_dim)
        q, k = l2_normalize(q).astype(dt), l2_normalize(k).astype(dt)
        if repeat:  # value head j reads key head j // rep (HF repeat_interleave)
            q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
        return q, k, v

    def conv_weights(self) -> dict[str, jax.Array]:
        """The conv taps by name: `{p}` [K, C_p] and, in block mode, `{p}_right` [K-1, C_p]."""
        out = {}
        for p in CONV_PARTS:
            conv = getattr(self, f"conv_{p}")
            out[p] = conv.kernel[...]
            if hasattr(conv, "right"):
                out[f"{p}_right"] = conv.right[...]
        return out

    def conv_parts(self, mixed: dict[str, jax.Array], seg: jax.Array, rings: dict[str, jax.Array],
                   ring_seg: jax.Array, weights: dict[str, jax.Array] | None = None) -> dict[str, jax.Array]:
        """Causal conv + SiLU of the q, k, v channel groups (AR / clean stream). `weights`: the taps
        (`conv_weights()`, a device's channels of them inside a shard_map); default the layer's."""
        w = self.conv_weights() if weights is None else weights
        return {p: jax.nn.silu(causal_conv(mixed[p], w[p], rings[p], seg, ring_seg)) for p in CONV_PARTS}

    def block_conv_parts(self, mixed: dict[str, jax.Array], seg: jax.Array, rings: dict[str, jax.Array],
                         ring_seg: jax.Array, weights: dict[str, jax.Array] | None = None) -> dict[str, jax.Array]:
        """Noisy-stream conv (left taps over clean ring || block, right taps in the block) + SiLU.
        Inputs are whole blocks [B', Bk, C] with their rings [B', L, C]; `weights` as `conv_parts`."""
        w = self.conv_weights() if weights is None else weights
        return {p: jax.nn.silu(block_conv(mixed[p], w[p], w[f"{p}_right"], rings[p], seg, ring_seg))
                for p in CONV_PARTS}

    def output(self, o_BTHV: jax.Array, z_BTHV: jax.Array, dtype: jnp.dtype, lora_key: jax.Array | None = None
               ) -> jax.Array:
        b, t = o_BTHV.shape[:2]
        y = self.norm(o_BTHV.astype(dtype), z_BTHV)
        return self.out_proj(y.reshape(b, t, -1), lora_key)

    def __call__(
        self, x_BTD: jax.Array, ctx: dict[str, Any], cache: dict[str, jax.Array] | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        """x [B, T, D] -> [B, T, D]. `ctx`: `segment_ids` [B, T], `ring_segment_ids` [B, L] and, with a
        cache, `continues` [B] bool (the first token continues the cached document). Cache:
        `state` [B, nv, dk, dv] fp32, `conv_{q,k,v}` [B, L, C_part] pre-conv ring."""
        if cache is None and context_size() > 1:  # T sharded over the `context` mesh axis
            from clover_jax.model import gdn_context

            return gdn_context.clean_forward(self, x_BTD, ctx), None
        c = self.cfg
        mixed = self.mix_inputs(x_BTD, ctx.get("lora_key"))
        seg, ring_seg = ctx["segment_ids"], ctx["ring_segment_ids"]
        b, t, _ = x_BTD.shape
        lring = c.linear_conv_kernel_dim - 1
        rings = {p: cache[f"conv_{p}"].astype(mixed[p].dtype) if cache is not None
                 else jnp.zeros((b, lring, mixed[p].shape[-1]), mixed[p].dtype) for p in CONV_PARTS}
        conv = self.conv_parts(mixed, seg, rings, ring_seg)
        new_cache = {f"conv_{p}": jnp.concatenate([rings[p], mixed[p]], axis=1)[:, -lring:] for p in CONV_PARTS}
        q, k, v = self.heads(conv, repeat=False)  # grouped key heads: the causal op indexes them
        g, beta = self.gates(mixed["b"], mixed["a"])
        init_state = None
        if cache is not None:
            init_state = cache["state"] * ctx["continues"][:, None, None, None].astype(jnp.float32)
        if cache is not None and t == 1:
            # one token (an AR decode step): the recurrence's single step; the chunked form, kernel or
            # reference, pads it to a whole chunk (bench/gdn_decode_step.py)
            o, state = pallas_kernels.recurrent_gated_delta_rule_ref(
                q, k, v, g, beta, initial_state_BHKV=init_state, segment_ids_BT=seg)
        else:
            o, state = pallas_kernels.chunk_gated_delta_rule(
                q, k, v, g, beta, initial_state=init_state, segment_ids=seg,
                chunk_size=c.gdn_chunk_size, backend=c.gdn_backend,
            )
        y = self.output(o, mixed["z"], x_BTD.dtype, ctx.get("lora_key"))
        if cache is None:
            return y, None
        new_cache = {k_: v_.astype(cache[k_].dtype) for k_, v_ in new_cache.items()}
        new_cache["state"] = state.astype(jnp.float32)
        return y, new_cache


    # -- block mode (docs/design.md 3.2 B, C) ----------------------------------------------------------
    def two_stream(self, x_BSD: jax.Array, ctx: dict[str, Any]) -> jax.Array:
        """Training forward of both streams: x [B, 2T, D], the clean and noisy tokens (same positions) in
        the layout of `pallas_kernels.context.stream_layout`, -> [B, 2T, D] in that layout. The clean stream is the
        AR layer exactly; the noisy one is the block-mode GDN on the row grid of `ctx["block_size"]` (T a
        multiple of it)."""
        if context_size() > 1:  # each stream's T sharded over the `context` mesh axis
            from clover_jax.model import gdn_context

            return gdn_context.two_stream(self, x_BSD, ctx)
        c = self.cfg
        bk, seg = ctx["block_size"], ctx["segment_ids"]
        b, t = seg.shape
        lring = c.linear_conv_kernel_dim - 1
        mixed = self.mix_inputs(x_BSD, ctx.get("lora_key"))
        streams = {name: split_streams(val) for name, val in mixed.items()}
        clean, noisy = ({name: pair[i] for name, pair in streams.items()} for i in (0, 1))
        empty = jnp.full((b, lring), ctx["empty_segment"], jnp.int32)
        zeros = {p: jnp.zeros((b, lring, clean[p].shape[-1]), clean[p].dtype) for p in CONV_PARTS}
        conv_c = self.conv_parts(clean, seg, zeros, empty)
        n = t // bk
        blocks = lambda a: a.reshape((b * n, bk) + a.shape[2:])  # noqa: E731
        ring_parts = {p: block_rings(clean[p], seg, bk, lring, ctx["empty_segment"]) for p in CONV_PARTS}
        ring_seg = ring_parts["q"][1]
        conv_n = self.block_conv_parts({p: blocks(noisy[p]) for p in CONV_PARTS}, blocks(seg),
                                        {p: r for p, (r, _) in ring_parts.items()}, ring_seg)
        conv_n = {p: v.reshape(b, t, -1) for p, v in conv_n.items()}
        q_c, k_c, v_c = self.heads(conv_c, repeat=False)  # grouped key heads: the block op indexes them
        q_n, k_n, v_n = self.heads(conv_n, repeat=False)
        g, beta = self.gates(clean["b"], clean["a"])
        o_c, o_n, _ = pallas_kernels.block_gated_delta_rule(
            q_c, k_c, v_c, g, beta, q_n, k_n, v_n, self.bd_gdn_softmax_scalars[...],
            block_size=bk, segment_ids=seg, chunk_size=c.gdn_chunk_size, backend=c.gdn_backend)
        return self.output(join_streams(o_c, o_n), mixed["z"], x_BSD.dtype, ctx.get("lora_key"))

    def block_step(self, x_BKD: jax.Array, ctx: dict[str, Any], cache: dict[str, jax.Array]
                   ) -> tuple[jax.Array, jax.Array]:
        """Decode side: one noisy canvas [B, Bk, D] against the clean caches (read only) -> ([B, Bk, D],
        share_K [Bk]: per canvas position, the history unit's softmax share (mean over heads) summed
        over the rows where that position is a real token; `CloverModel.block_step` divides).
        `ctx`: `segment_ids` [B, Bk], `ring_segment_ids` [B, L], `continues` [B, Bk] (token continues
        the cached document, so the history unit is present)."""
        c = self.cfg
        seg = ctx["segment_ids"]
        mixed = self.mix_inputs(x_BKD)
        rings = {p: cache[f"conv_{p}"].astype(mixed[p].dtype) for p in CONV_PARTS}
        conv = self.block_conv_parts(mixed, seg, rings, ctx["ring_segment_ids"])
        q, k, v = self.heads(conv)
        b, bk = seg.shape
        add_n = lambda a: a[:, None]  # noqa: E731  one block
        same_doc = seg[:, :, None] == seg[:, None, :]
        o, p_hist = pallas_kernels.block_readout_ref(
            add_n(q), add_n(k), add_n(v), cache["state"][:, None], same_doc[:, None], add_n(ctx["continues"]),
            self.bd_gdn_softmax_scalars[...], bk, return_history_prob=True)
        real = (seg != 0).astype(jnp.float32)  # 0 = the pad segment
        share_K = jnp.sum(jnp.mean(p_hist[:, 0], axis=-1) * real, axis=0)
        return self.output(o[:, 0], mixed["z"], x_BKD.dtype), share_K


class _ConvKernel(nnx.Module):
    """Depthwise conv taps `kernel` [K, C]; tap K-1 multiplies the current token (HF weight[c, 0, j] =
    kernel[j, c]). Block mode adds `right` [K-1, C] (zero init): tap d-1 multiplies the token d
    positions AHEAD inside the block (HF `bd_gdn_conv_right_weight`[c, d-1] = right[d-1, c])."""

    def __init__(self, k: int, channels: int, axis: str, *, rngs: nnx.Rngs, param_dtype: jnp.dtype,
                 right: bool = False):
        self.kernel = make_param(rngs, normal(0.2), (k, channels), ("conv_tap", axis), param_dtype)
        if right:
            self.right = make_param(rngs, constant(0.0), (k - 1, channels), ("conv_tap", axis), param_dtype)


def _rows(values: tuple[float, ...]):
    """Initializer: every row of an [H, len(values)] parameter equals `values`."""
    return lambda key, shape, dtype: jnp.broadcast_to(jnp.asarray(values, dtype), shape)


def _log_uniform(lo: float, hi: float):
    def init(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, lo, hi)).astype(dtype)

    return init


def init_gdn_cache(cfg: ModelConfig, batch: int, dtype: jnp.dtype) -> dict[str, jax.Array]:
    lring = cfg.linear_conv_kernel_dim - 1
    h, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return {
        "state": jnp.zeros((batch, h, dk, dv), jnp.float32),
        "conv_q": jnp.zeros((batch, lring, cfg.gdn_key_dim), dtype),
        "conv_k": jnp.zeros((batch, lring, cfg.gdn_key_dim), dtype),
        "conv_v": jnp.zeros((batch, lring, cfg.gdn_value_dim), dtype),
    }
