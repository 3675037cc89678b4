"""The Qwen3.6 / Clover text model: embedding, scanned decoder stack, final norm, lm_head.

`model(input_ids, positions, segment_ids)` is the clean-stream (AR) forward of docs/design.md 6.
`model.extend(input_ids, cache, ...)` runs new tokens against a cache (prefill and token-by-token
decoding share it). Segment ids mark packed documents (0 may be used for padding: pads are just
one more segment, so they never meet a document; it is excluded from the MoE load statistics).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.model.attention import causal_segment_mask, noisy_query_mask, rope_tables, two_stream_masks
from clover_jax.config import ModelConfig
from clover_jax.model.lora import DEFAULT_TARGETS, add_adapters
from clover_jax.model.layers import init_stack_cache, run_stack, stacked_group
from clover_jax.model.nn import RMSNorm, dtype_of, make_param, normal
from pallas_kernels.attention.ops import resolve_attn_backend
from pallas_kernels.context.exchange import from_layout, to_layout
from pallas_kernels.context.axis import context_size
from pallas_kernels.context.stream_layout import join_streams, split_streams
from clover_jax.model.params import Tree, check_flat_shapes, flatten, unflatten

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


def continued_positions(segment_ids_BT: jax.Array, continues_B: jax.Array, next_position_B: jax.Array) -> jax.Array:
    """Document positions of new tokens after a cache: the run that continues the cached document
    counts on from `next_position`, later documents restart at 0. [B, T] int32."""
    pos = document_positions(segment_ids_BT)
    first_run = jnp.cumsum(jnp.concatenate(
        [jnp.zeros_like(segment_ids_BT[:, :1]), (segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]).astype(jnp.int32)],
        axis=1), axis=1) == 0
    return pos + jnp.where(first_run & continues_B[:, None], next_position_B[:, None], 0).astype(jnp.int32)


def shift_predictions(h_clean_BTD: jax.Array, h_noisy_BTD: jax.Array, segment_ids_BT: jax.Array,
                      block_size: int, logits_shift: bool) -> jax.Array:
    """Hidden state that predicts each position (docs/design.md 3.2 D), [B, T, D].

    With the shift, position p of a row-grid block starting at s is predicted from the clean stream
    at s - 1 when p = s, else from the noisy stream at p - 1; a document's first position has no
    predecessor in its document and gets zeros (it is prompt, never in the loss). Without the shift,
    p predicts itself from the noisy stream."""
    if not logits_shift:
        return h_noisy_BTD
    prev = lambda h: jnp.pad(h[:, :-1], ((0, 0), (1, 0), (0, 0)))  # noqa: E731
    t = segment_ids_BT.shape[1]
    at_start = (jnp.arange(t) % block_size == 0)[None, :, None]
    pred = jnp.where(at_start, prev(h_clean_BTD), prev(h_noisy_BTD))
    doc_start = jnp.concatenate(
        [jnp.ones_like(segment_ids_BT[:, :1], bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    return jnp.where(doc_start[..., None], 0.0, pred).astype(h_noisy_BTD.dtype)


def check_block_aligned(segment_ids_BT: Any, block_size: int) -> None:
    """Host-side check of block-aligned packing (docs/design.md 3.1) on a numpy batch: T is a multiple of
    the block size and every document (segment id != 0) starts on the block grid. Raises ValueError
    naming the row and slot of the first violation."""
    import numpy as np

    seg = np.asarray(segment_ids_BT)
    if seg.ndim != 2 or seg.shape[1] % block_size:
        raise ValueError(f"segment_ids {seg.shape}: length must be a multiple of block_size {block_size}")
    starts = np.concatenate([np.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    bad = starts & (seg != PAD_SEGMENT) & (np.arange(seg.shape[1]) % block_size != 0)[None]
    if bad.any():
        row, slot = map(int, np.argwhere(bad)[0])
        raise ValueError(f"row {row}: document {int(seg[row, slot])} starts at slot {slot}, not a multiple of "
                         f"block_size {block_size} (pack with block alignment)")


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
        if cfg.lora_rank:
            add_adapters(self, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets or DEFAULT_TARGETS, rngs,
                         strict=bool(cfg.lora_targets), dropout=cfg.lora_dropout)

    # ------------------------------------------------------------------------------------------
    def _contexts(self, segment_ids_BT, positions_BT, q_slot_BT, k_slot_BS, k_seg_BS, ring_seg_BL, continues_B,
                  cached: bool = True):
        """Per-layer contexts. Without a cache (`cached=False`) a kernel backend gets the segment ids
        instead of a dense mask."""
        cfg = self.cfg
        cos, sin = rope_tables(positions_BT, cfg.rotary_dim, cfg.rope_theta)
        attn = {"cos": cos, "sin": sin, "segment_ids": segment_ids_BT}
        if cached or resolve_attn_backend(cfg.attn_backend) == "reference":
            attn["mask"] = causal_segment_mask(q_slot_BT, segment_ids_BT, k_slot_BS, k_seg_BS)
        return {
            "attn": attn,
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
        n, layout = self._context_layout()
        ids, segment_ids_BT, positions_BT = (to_layout(a, n, layout) for a in (input_ids_BT, segment_ids_BT,
                                                                                positions_BT))
        slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        lring = self.cfg.linear_conv_kernel_dim - 1
        ring_seg = jnp.full((b, lring), NO_SEGMENT, jnp.int32)
        ctx = self._contexts(segment_ids_BT, positions_BT, slots, slots, segment_ids_BT, ring_seg,
                             jnp.zeros((b,), bool), cached=False)
        for part in ("attn", "gdn"):
            ctx[part]["context_layout"] = layout
        x, _, aux = run_stack(self.groups, self.embed(ids, dtype_of(self.cfg.dtype)), ctx, None,
                              scan=self.cfg.scan_layers)
        return from_layout(self.final_norm(x), n, layout), _reduce_aux(self.cfg, aux)

    def _context_layout(self) -> tuple[int, str]:
        """(context size of the active mesh, the row layout over it): `cfg.context_layout` when the
        row is sharded over a `context` axis > 1, else contiguous (nothing is permuted). Under a
        zigzag layout the stack runs on the permuted row (token ids, positions and segment ids are
        moved in, the final hidden states moved back, by `pallas_kernels.context.exchange`'s
        point-to-point exchanges), so everything outside sees row order."""
        n = context_size()
        return n, (self.cfg.context_layout if n > 1 else "contiguous")

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
        `segment_ids` [B, max_len] of each slot (-1 = empty), `next_position` [B] (RoPE position of
        the next token of the cached document), `last_hidden` [B, D] (final-normed hidden state of
        the last cached token: block mode predicts a block's first position from it), and the
        stacked per-layer caches."""
        dtype = dtype or dtype_of(self.cfg.dtype)
        return {
            "index": jnp.zeros((), jnp.int32),
            "segment_ids": jnp.full((batch, max_len), NO_SEGMENT, jnp.int32),
            "next_position": jnp.zeros((batch,), jnp.int32),
            "last_hidden": jnp.zeros((batch, self.cfg.hidden_size), dtype),
            "layers": init_stack_cache(self.cfg, batch, max_len, dtype),
        }

    def _cached_segments(self, cache: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
        """Segment ids of the L slots before `index` (what the conv ring holds) [B, L], and of the
        last cached token [B] (-1 for an empty cache)."""
        lring = self.cfg.linear_conv_kernel_dim - 1
        ring_slots = cache["index"] - lring + jnp.arange(lring)
        ring_seg = jnp.where(ring_slots >= 0, jnp.take(cache["segment_ids"], jnp.clip(ring_slots, 0), axis=1),
                             NO_SEGMENT)
        return ring_seg, ring_seg[:, -1]

    def _new_tokens(self, cache, b, t, positions_BT, segment_ids_BT):
        """Defaults for tokens appended after the cache: segment = the last cached one (1 if empty),
        positions continue the cached document."""
        ring_seg, last_seg = self._cached_segments(cache)
        if segment_ids_BT is None:
            segment_ids_BT = jnp.broadcast_to(jnp.where(last_seg == NO_SEGMENT, 1, last_seg)[:, None], (b, t))
        segment_ids_BT = segment_ids_BT.astype(jnp.int32)
        if positions_BT is None:
            positions_BT = continued_positions(segment_ids_BT, segment_ids_BT[:, 0] == last_seg,
                                               cache["next_position"])
        return ring_seg, last_seg, positions_BT, segment_ids_BT

    def extend(
        self, input_ids_BT: jax.Array, cache: dict[str, Any], positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None, return_stats: bool = False,
    ) -> tuple[jax.Array, dict[str, Any]] | tuple[jax.Array, dict[str, Any], dict[str, jax.Array]]:
        """Runs T new tokens through the clean stream after the cached ones; returns (logits
        [B, T, V] fp32, updated cache). Prefill, AR decoding and the block-mode commit pass. With
        `return_stats`, also {"expert_counts": [L, E]}: the routed assignments of the new non-pad
        tokens per layer and expert (bench/decode_cost.py reads the experts a forward touches).

        Default segment: the one of the last cached token (1 for an empty cache); default positions:
        continue the cached document (restart at 0 where a new segment starts). The caller keeps
        `index + T <= max_len`.
        """
        b, t = input_ids_BT.shape
        idx = cache["index"]
        seg_cache = cache["segment_ids"]
        ring_seg, last_seg, positions_BT, segment_ids_BT = self._new_tokens(cache, b, t, positions, segment_ids)
        seg_all = jax.lax.dynamic_update_slice_in_dim(seg_cache, segment_ids_BT, idx, axis=1)
        s = seg_cache.shape[1]
        q_slots = jnp.broadcast_to(idx + jnp.arange(t, dtype=jnp.int32), (b, t))
        k_slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        ctx = self._contexts(segment_ids_BT, positions_BT, q_slots, k_slots, seg_all, ring_seg,
                             segment_ids_BT[:, 0] == last_seg)
        ctx["attn"]["cache_index"] = idx
        x, layers, aux = run_stack(self.groups, self.embed(input_ids_BT, dtype_of(self.cfg.dtype)), ctx,
                                   cache["layers"], scan=self.cfg.scan_layers)
        h = self.final_norm(x)
        new_cache = {
            "index": idx + t, "segment_ids": seg_all, "next_position": positions_BT[:, -1] + 1,
            "last_hidden": h[:, -1].astype(cache["last_hidden"].dtype), "layers": layers,
        }
        if return_stats:
            return self.logits(h), new_cache, {"expert_counts": _reduce_aux(self.cfg, aux)["expert_counts"]}
        return self.logits(h), new_cache

    # -- block diffusion (docs/design.md 3) ----------------------------------------------------------
    def _require_block_mode(self, what: str) -> None:
        if self.cfg.mode != "block":
            raise ValueError(f"{what} needs the block-diffusion parameters, but this model was built with "
                             "mode='ar'; build or load it with mode='block'")

    def two_stream_hidden(
        self, input_ids_BT: jax.Array, noisy_ids_BT: jax.Array, *, block_size: int | None = None,
        positions: jax.Array | None = None, segment_ids: jax.Array | None = None, lora_key: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """The training forward of both streams (docs/design.md 3.1) -> (clean hidden [B, T, D], noisy
        hidden [B, T, D], MoE aux over both streams). `noisy_ids` = `input_ids` with some positions
        replaced by the mask token. Blocks lie on the row grid of `block_size` (default: the first
        configured size); T must be a multiple of it and every document must start on the grid
        (block-aligned packing; `check_block_aligned` checks a host batch). `lora_key` (a typed key):
        the adapters' input dropout (`cfg.lora_dropout`, training only); None: none."""
        self._require_block_mode("two_stream_hidden")
        cfg = self.cfg
        bk = int(block_size or cfg.block_sizes[0])
        b, t = input_ids_BT.shape
        if noisy_ids_BT.shape != (b, t):
            raise ValueError(f"noisy_ids {noisy_ids_BT.shape} must have the shape of input_ids {(b, t)}")
        if t % bk:
            raise ValueError(f"sequence length {t} is not a multiple of block_size {bk}: pad the rows (packing does)")
        seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
        positions_BT = document_positions(seg) if positions is None else positions
        n, layout = self._context_layout()
        input_ids_BT, noisy_ids_BT, seg, positions_BT = (to_layout(a, n, layout) for a in (
            input_ids_BT, noisy_ids_BT, seg, positions_BT))
        cos, sin = rope_tables(positions_BT, cfg.rotary_dim, cfg.rope_theta)
        attn_ctx = {"cos": cos, "sin": sin, "segment_ids": seg, "block_size": bk, "context_layout": layout}
        if resolve_attn_backend(cfg.attn_backend) == "reference":  # the kernel needs no dense masks
            attn_ctx["mask"], attn_ctx["noisy_mask"] = two_stream_masks(seg, bk)
        valid = seg != PAD_SEGMENT
        ctx = {
            "stream": "two_stream",
            "attn": attn_ctx,
            "gdn": {"segment_ids": seg, "block_size": bk, "empty_segment": NO_SEGMENT, "context_layout": layout},
            # the block coreset's blocks: a zigzag shard holds two runs of the row, a contiguous one one
            "moe": {"block_size": bk, "pieces": n * (2 if layout == "zigzag" else 1)},
            "valid": join_streams(valid, valid),
        }
        if lora_key is not None and cfg.lora_rank and cfg.lora_dropout:
            ctx["lora_key"] = lora_key
        ids = join_streams(input_ids_BT, noisy_ids_BT)  # [B, 2T]: a context shard holds both streams' pieces
        x, _, aux = run_stack(self.groups, self.embed(ids, dtype_of(cfg.dtype)), ctx, None, scan=cfg.scan_layers)
        h_clean, h_noisy = (from_layout(h, n, layout) for h in split_streams(self.final_norm(x)))
        return h_clean, h_noisy, _reduce_aux(cfg, aux)

    def block_logits(
        self, input_ids_BT: jax.Array, noisy_ids_BT: jax.Array, *, block_size: int | None = None,
        positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """fp32 logits [B, T, V] predicting every position in block mode (after the logit shift).
        Materialises [B, T, V]: for tests and small runs; training uses a chunked loss instead."""
        bk = int(block_size or self.cfg.block_sizes[0])
        h_c, h_n, _ = self.two_stream_hidden(input_ids_BT, noisy_ids_BT, block_size=bk, positions=positions,
                                             segment_ids=segment_ids)
        seg = jnp.ones(input_ids_BT.shape, jnp.int32) if segment_ids is None else segment_ids
        return self.logits(shift_predictions(h_c, h_n, seg, bk, self.cfg.logits_shift))

    def block_step(
        self, canvas_ids_BK: jax.Array, cache: dict[str, Any], *, positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None, return_stats: bool = False, coreset: jax.Array | None = None,
        use_coreset: jax.Array | bool = True,
    ) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        """One denoising forward of a canvas (known tokens + mask tokens) of Bk positions placed at
        slots [index, index + Bk) against the clean caches, which are read and not changed (the
        commit pass, `extend`, writes the finished block). The block size is the canvas length.
        Returns fp32 logits [B, Bk, V] predicting every canvas position (after the logit shift);
        they equal the training forward's noisy logits of that block (the central invariant).
        With `return_stats`, also the history unit's softmax probability per GDN layer (model order),
        mean over heads: {"history_share": [n_gdn] its mean over the canvas' non-pad tokens,
        "history_share_sum": [n_gdn, Bk] its sum per canvas position over the rows where that position
        is a non-pad token, "history_tokens": [Bk] the count of those rows} (position means =
        sum / tokens: the share vs the position inside the block), and "expert_counts" [L, E]: the
        routed assignments of the canvas' non-pad tokens per layer and expert; with the block coreset
        on (`moe_block_coreset`), "coreset" [G, p, B, C]: the experts each MoE layer allowed (G
        groups of p layers, the stack's own order). `coreset` (that form), where `use_coreset`
        (a traced bool) is true, is used instead of the canvas' own coresets: the coreset fixed at a
        block's first step (`DecodeConfig.coreset`)."""
        self._require_block_mode("block_step")
        cfg = self.cfg
        b, bk = canvas_ids_BK.shape
        idx, seg_cache = cache["index"], cache["segment_ids"]
        s = seg_cache.shape[1]
        ring_seg, last_seg, positions_BK, seg = self._new_tokens(cache, b, bk, positions, segment_ids)
        cos, sin = rope_tables(positions_BK, cfg.rotary_dim, cfg.rope_theta)
        cache_slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        canvas_slots = jnp.broadcast_to(idx + jnp.arange(bk, dtype=jnp.int32), (b, bk))
        start = jnp.full((b, bk), idx, jnp.int32)
        mask = noisy_query_mask(
            start, seg, jnp.concatenate([cache_slots, canvas_slots], axis=1),
            jnp.concatenate([seg_cache, seg], axis=1), jnp.concatenate([cache_slots, start], axis=1),
            jnp.arange(s + bk) >= s)
        continues = seg == last_seg[:, None]
        ctx = {
            "stream": "block_step",
            "attn": {"cos": cos, "sin": sin, "mask": mask},
            "gdn": {"segment_ids": seg, "ring_segment_ids": ring_seg, "continues": continues},
            "valid": seg != PAD_SEGMENT,
        }
        moe_inputs = None
        if coreset is not None:
            use = jnp.broadcast_to(jnp.asarray(use_coreset, bool), coreset.shape[:2])
            moe_inputs = {"core": coreset.astype(jnp.int32), "use_core": use}
        x, _, aux = run_stack(self.groups, self.embed(canvas_ids_BK, dtype_of(cfg.dtype)), ctx, cache["layers"],
                              scan=cfg.scan_layers, moe_inputs=moe_inputs)
        h = self.final_norm(x)
        if cfg.logits_shift:
            first = jnp.where(continues[:, :1, None], cache["last_hidden"][:, None].astype(h.dtype), 0.0)
            rest = jnp.where((seg[:, 1:] == seg[:, :-1])[..., None], h[:, :-1], 0.0)
            h = jnp.concatenate([first, rest], axis=1).astype(h.dtype)
        logits = self.logits(h)
        if not return_stats:
            return logits
        share_LK = aux["history_share"].reshape(cfg.num_hidden_layers, bk)  # [G, p, Bk] -> model order
        gdn_layers = [i for i, t in enumerate(cfg.layer_types) if t != "full_attention"]
        share_LK = share_LK[jnp.asarray(gdn_layers)]
        tokens_K = jnp.sum((seg != PAD_SEGMENT).astype(jnp.float32), axis=0)
        return logits, {"history_share": jnp.sum(share_LK, axis=1) / jnp.maximum(jnp.sum(tokens_K), 1.0),
                        "history_share_sum": share_LK, "history_tokens": tokens_K,
                        "expert_counts": _reduce_aux(cfg, aux)["expert_counts"]} | (
                            {"coreset": aux["coreset"]} if "coreset" in aux else {})


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
    """Stacked-form pure dict (see `clover_jax.model.params`)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


#: Params that keep the model's own dtype (fp32) whatever `param_dtype` (their numerics need it).
OWN_DTYPE_SUFFIXES = ("A_log", "dt_bias", "bd_gdn_softmax_scalars", "lora_a", "lora_b")


def param_dtype_of(cfg: ModelConfig, key: str, own: Any) -> Any:
    """The dtype `model_from_params` gives the param at flat `key`: `cfg.param_dtype`, except the
    `OWN_DTYPE_SUFFIXES` ones, which keep `own` (the abstract model's dtype for that param)."""
    return own if key.endswith(OWN_DTYPE_SUFFIXES) else dtype_of(cfg.param_dtype)


def model_from_params(cfg: ModelConfig, params: Tree) -> CloverModel:
    """Builds the model around stacked-form params (numpy or jax), cast to `param_dtype` except the
    fp32-only GDN `A_log` / `dt_bias`. Fails naming the first missing, extra or mis-shaped entry."""
    model = abstract_model(cfg)
    state = nnx.state(model, nnx.Param)
    flat_t = flatten(nnx.to_pure_dict(state))
    flat_p = flatten(params)
    check_flat_shapes(flat_p, {k: tuple(v.shape) for k, v in flat_t.items()}, "model params", ValueError)
    out = {k: jnp.asarray(flat_p[k], dtype=param_dtype_of(cfg, k, ref.dtype)) for k, ref in flat_t.items()}
    nnx.replace_by_pure_dict(state, unflatten(out))
    nnx.update(model, state)
    return model
