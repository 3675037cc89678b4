"""The Qwen3.6 / Clover text model: embedding, scanned decoder stack, final norm, lm_head.

`model(input_ids, positions, segment_ids)` is the clean-stream (AR) forward of DESIGN.md 6.
`model.extend(input_ids, cache, ...)` runs new tokens against a cache (prefill and token-by-token
decoding share it). Segment ids mark packed documents (0 may be used for padding: pads are just
one more segment, so they never meet a document; it is excluded from the MoE load statistics).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.attention import causal_segment_mask, rope_tables
from clover_jax.config import ModelConfig
from clover_jax.decoder import init_stack_cache, run_stack, stacked_group
from clover_jax.nn import RMSNorm, dtype_of, make_param, normal
from clover_jax.params import Tree, check_flat_shapes, flatten, unflatten

NO_SEGMENT = -1  # segment id of cache slots / ring entries that hold no token
PAD_SEGMENT = 0  # segment id of padding; documents use ids >= 1 (the default is 1)


def document_positions(segment_ids_BT: jax.Array) -> jax.Array:
    """Positions that restart at 0 where the segment id changes: [B, T] int32."""
    t = segment_ids_BT.shape[1]
    idx = jnp.arange(t, dtype=jnp.int32)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids_BT[:, :1], bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1
    )
    start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return idx - start_idx


class CloverModel(nnx.Module):
    """Decoder-only MoE LM. Params: `embed.embedding` [V, D], `groups` (stacked LayerGroup),
    `final_norm.scale` [D], `lm_head.kernel` [D, V] (absent when tied)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = dtype_of(cfg.param_dtype)
        self.cfg = cfg
        self.embed = _Embedding(cfg.vocab_size, cfg.hidden_size, rngs=rngs, param_dtype=pd)
        self.groups = stacked_group(cfg, rngs)
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, rngs=rngs, axis_name="embed", param_dtype=pd)
        if not cfg.tie_word_embeddings:
            self.lm_head = _LMHead(cfg.hidden_size, cfg.vocab_size, rngs=rngs, param_dtype=pd)

    # ------------------------------------------------------------------------------------------
    def _contexts(self, segment_ids_BT, positions_BT, q_slot_BT, k_slot_BS, k_seg_BS, ring_seg_BL, continues_B):
        cfg = self.cfg
        cos, sin = rope_tables(positions_BT, cfg.rotary_dim, cfg.rope_theta)
        mask = causal_segment_mask(q_slot_BT, segment_ids_BT, k_slot_BS, k_seg_BS)
        return {
            "attn": {"cos": cos, "sin": sin, "mask": mask},
            "gdn": {"segment_ids": segment_ids_BT, "ring_segment_ids": ring_seg_BL, "continues": continues_B},
            "valid": segment_ids_BT != PAD_SEGMENT,
        }

    def hidden_states(
        self, input_ids_BT: jax.Array, positions_BT: jax.Array | None = None, segment_ids_BT: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Final-normed hidden states [B, T, D] of the clean stream, and the MoE aux stats
        (`lb_loss` mean over layers, `expert_counts` [L, E])."""
        b, t = input_ids_BT.shape
        if segment_ids_BT is None:
            segment_ids_BT = jnp.ones((b, t), jnp.int32)
        if positions_BT is None:
            positions_BT = document_positions(segment_ids_BT)
        slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        lring = self.cfg.linear_conv_kernel_dim - 1
        ring_seg = jnp.full((b, lring), NO_SEGMENT, jnp.int32)
        ctx = self._contexts(segment_ids_BT, positions_BT, slots, slots, segment_ids_BT, ring_seg,
                             jnp.zeros((b,), bool))
        x, _, aux = run_stack(self.groups, self.embed(input_ids_BT, dtype_of(self.cfg.dtype)), ctx, None,
                              scan=self.cfg.scan_layers)
        return self.final_norm(x), _reduce_aux(self.cfg, aux)

    def logits(self, h_BTD: jax.Array) -> jax.Array:
        """lm_head on hidden states, fp32 logits [B, T, V]."""
        if self.cfg.tie_word_embeddings:
            w = self.embed.embedding[...].T
        else:
            w = self.lm_head.kernel[...]
        return jnp.dot(h_BTD, w.astype(h_BTD.dtype), preferred_element_type=jnp.float32)

    def __call__(
        self, input_ids_BT: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        """Clean-stream logits [B, T, V] (fp32)."""
        h, _ = self.hidden_states(input_ids_BT, positions, segment_ids)
        return self.logits(h)

    # ------------------------------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int, dtype: jnp.dtype | None = None) -> dict[str, Any]:
        """Empty decode cache for `max_len` tokens: `index` (tokens written, same for every row),
        `segment_ids` [B, max_len] of each slot (-1 = empty), and the stacked per-layer caches."""
        dtype = dtype or dtype_of(self.cfg.dtype)
        return {
            "index": jnp.zeros((), jnp.int32),
            "segment_ids": jnp.full((batch, max_len), NO_SEGMENT, jnp.int32),
            "layers": init_stack_cache(self.cfg, batch, max_len, dtype),
        }

    def extend(
        self, input_ids_BT: jax.Array, cache: dict[str, Any], positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, Any]]:
        """Runs T new tokens after the cached ones; returns (logits [B, T, V] fp32, updated cache).

        Default segment: the one of the last cached token (1 for an empty cache); default positions:
        continue from `index`. The caller keeps `index + T <= max_len`.
        """
        positions_BT, segment_ids_BT = positions, segment_ids
        b, t = input_ids_BT.shape
        idx = cache["index"]
        seg_cache = cache["segment_ids"]
        lring = self.cfg.linear_conv_kernel_dim - 1
        # segment ids of the last L slots before idx (the tokens the conv ring holds)
        ring_slots = idx - lring + jnp.arange(lring)
        ring_seg = jnp.where(ring_slots >= 0, jnp.take(seg_cache, jnp.clip(ring_slots, 0), axis=1), NO_SEGMENT)
        last_seg = ring_seg[:, -1]
        if segment_ids_BT is None:
            segment_ids_BT = jnp.broadcast_to(jnp.where(last_seg == NO_SEGMENT, 1, last_seg)[:, None], (b, t))
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(idx + jnp.arange(t, dtype=jnp.int32), (b, t))
        seg_all = jax.lax.dynamic_update_slice_in_dim(seg_cache, segment_ids_BT.astype(jnp.int32), idx, axis=1)
        s = seg_cache.shape[1]
        q_slots = jnp.broadcast_to(idx + jnp.arange(t, dtype=jnp.int32), (b, t))
        k_slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        ctx = self._contexts(segment_ids_BT, positions_BT, q_slots, k_slots, seg_all, ring_seg,
                             segment_ids_BT[:, 0] == last_seg)
        ctx["attn"]["cache_index"] = idx
        x, layers, _ = run_stack(self.groups, self.embed(input_ids_BT, dtype_of(self.cfg.dtype)), ctx,
                                 cache["layers"], scan=self.cfg.scan_layers)
        logits = self.logits(self.final_norm(x))
        return logits, {"index": idx + t, "segment_ids": seg_all, "layers": layers}


class _Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, param_dtype: jnp.dtype):
        self.embedding = make_param(rngs, normal(), (vocab, dim), ("vocab", "embed"), param_dtype)

    def __call__(self, ids_BT: jax.Array, dtype: jnp.dtype) -> jax.Array:
        return jnp.take(self.embedding[...], ids_BT, axis=0).astype(dtype)


class _LMHead(nnx.Module):
    def __init__(self, dim: int, vocab: int, *, rngs: nnx.Rngs, param_dtype: jnp.dtype):
        self.kernel = make_param(rngs, normal(), (dim, vocab), ("embed", "vocab"), param_dtype)


def _reduce_aux(cfg: ModelConfig, aux: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """[G, p, ...] per-layer stats -> mean lb loss and per-layer (model order) expert counts [L, E]."""
    counts = aux["expert_counts"].reshape(cfg.num_hidden_layers, -1)
    return {"lb_loss": jnp.mean(aux["lb_loss"]), "expert_counts": counts}


# ---------------------------------------------------------------------------------------------
def create_model(cfg: ModelConfig, seed: int = 0) -> CloverModel:
    """Randomly initialised model (tests, tiny runs)."""
    return CloverModel(cfg, rngs=nnx.Rngs(seed))


def abstract_model(cfg: ModelConfig) -> CloverModel:
    """Shapes only, no memory: for loading weights and AOT compiles."""
    return nnx.eval_shape(lambda: CloverModel(cfg, rngs=nnx.Rngs(0)))


def model_to_params(model: CloverModel) -> Tree:
    """Stacked-form pure dict (see `clover_jax.params`)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def model_from_params(cfg: ModelConfig, params: Tree) -> CloverModel:
    """Builds the model around stacked-form params (numpy or jax), cast to `param_dtype` except the
    fp32-only GDN `A_log` / `dt_bias`. Fails naming the first missing, extra or mis-shaped entry."""
    model = abstract_model(cfg)
    state = nnx.state(model, nnx.Param)
    flat_t = flatten(nnx.to_pure_dict(state))
    flat_p = flatten(params)
    check_flat_shapes(flat_p, {k: tuple(v.shape) for k, v in flat_t.items()}, "model params", ValueError)
    pd = dtype_of(cfg.param_dtype)
    out = {k: jnp.asarray(flat_p[k], dtype=ref.dtype if k.endswith(("A_log", "dt_bias", "bd_gdn_softmax_scalars")) else pd)
           for k, ref in flat_t.items()}
    nnx.replace_by_pure_dict(state, unflatten(out))
    nnx.update(model, state)
    return model
