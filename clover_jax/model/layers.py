"""Decoder layer, the repeating layer group, and the scanned stack.

The stack holds ONE `LayerGroup` module whose parameters carry a leading `layers` axis of size
`cfg.num_groups` (the group = the repeating pattern of `cfg.group_size` layers, 4 for Qwen3.6:
3 GDN + 1 attention). The forward `lax.scan`s over that axis, so the 40-layer model compiles one
group, not 40 layers.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.parallel import remat as remat_policies
from clover_jax.model.attention import Attention, init_attention_cache
from clover_jax.config import FULL, ModelConfig
from clover_jax.model import lora
from clover_jax.model.gdn import GatedDeltaNet, init_gdn_cache
from clover_jax.model.moe import MoE
from clover_jax.model.nn import RMSNorm, dtype_of

Cache = dict[str, Any]


class DecoderLayer(nnx.Module):
    """Pre-norm block: `h = x + mixer(norm1(x))`, `y = h + moe(norm2(h))`."""

    def __init__(self, cfg: ModelConfig, layer_type: str, *, rngs: nnx.Rngs):
        pd = dtype_of(cfg.param_dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, rngs=rngs, axis_name="embed", param_dtype=pd)
        self.post_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, rngs=rngs, axis_name="embed", param_dtype=pd)
        if layer_type == FULL:
            self.attn = Attention(cfg, rngs=rngs)
        else:
            self.gdn = GatedDeltaNet(cfg, rngs=rngs)
        self.moe = MoE(cfg, rngs=rngs)
        self.is_attention = layer_type == FULL

    def __call__(self, x_BTD: jax.Array, ctx: dict[str, Any], cache: Cache | None):
        """`ctx["stream"]` (static) picks the mixer path: "ar" (clean tokens, optional cache),
        "two_stream" (x = clean || noisy, [B, 2T, D]) or "block_step" (a noisy canvas against the
        cache, which is read, not returned)."""
        mixer = self.attn if self.is_attention else self.gdn
        mixer_ctx = ctx["attn"] if self.is_attention else ctx["gdn"]
        if ctx.get("lora_key") is not None:  # the layer group's adapter-dropout key (run_stack)
            mixer_ctx = {**mixer_ctx, "lora_key": ctx["lora_key"]}
        stream = ctx.get("stream", "ar")
        if stream == "ar":
            h, cache = mixer(self.input_norm(x_BTD), mixer_ctx, cache)
        elif stream == "two_stream":
            h, cache = mixer.two_stream(self.input_norm(x_BTD), mixer_ctx), None
        else:
            h, cache = mixer.block_step(self.input_norm(x_BTD), mixer_ctx, cache), None
            # the GDN block step also reports its history-unit share per canvas position (NaN marks
            # attention layers)
            h, share = h if isinstance(h, tuple) else (h, jnp.full((x_BTD.shape[1],), jnp.nan, jnp.float32))
        h = x_BTD + remat_policies.tag(h, remat_policies.ATTN_OUT)
        m, aux = self.moe(self.post_norm(h), ctx)
        if stream == "block_step":
            aux = {**aux, "history_share": share}
        return h + m, cache, aux


class LayerGroup(nnx.Module):
    """`cfg.group_size` consecutive layers, attributes `layer_0` ... `layer_{p-1}`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        for j in range(cfg.group_size):
            setattr(self, f"layer_{j}", DecoderLayer(cfg, cfg.layer_types[j], rngs=rngs))
        self.size = cfg.group_size
        self.remat = cfg.remat  # the config's checkpoint policy for this group (see run_stack)

    def __call__(self, x_BTD: jax.Array, ctx: dict[str, Any], cache: Cache | None,
                 moe_inputs: dict[str, jax.Array] | None = None):
        """`moe_inputs`: per-layer MoE inputs with a leading [group_size] dim (layer j gets entry j
        merged into `ctx["moe"]`), e.g. the fixed coresets of a decoding block."""
        new_cache, auxes = {}, []
        for j in range(self.size):
            name = f"layer_{j}"
            layer_ctx = ctx if moe_inputs is None else {
                **ctx, "moe": {**ctx.get("moe", {}), **{k: v[j] for k, v in moe_inputs.items()}}}
            x_BTD, c, aux = getattr(self, name)(x_BTD, layer_ctx, None if cache is None else cache[name])
            new_cache[name] = c
            auxes.append(aux)
        aux = jax.tree.map(lambda *xs: jnp.stack(xs), *auxes)
        keep = cache is not None and ctx.get("stream", "ar") == "ar"
        return x_BTD, (new_cache if keep else None), aux


def stacked_group(cfg: ModelConfig, rngs: nnx.Rngs) -> LayerGroup:
    """A LayerGroup whose every parameter is stacked over `cfg.num_groups` independently initialised
    groups, with `layers` prepended to its logical axes."""
    groups = [LayerGroup(cfg, rngs=rngs) for _ in range(cfg.num_groups)]
    template = groups[0]
    states = [nnx.state(g, nnx.Param) for g in groups]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    nnx.update(template, stacked)
    for _, var in nnx.iter_graph(template):
        if isinstance(var, nnx.Param):
            var.set_metadata(logical_axes=("layers",) + tuple(var.get_metadata()["logical_axes"]))
    return template


def run_stack(group: LayerGroup, x_BTD: jax.Array, ctx: dict[str, Any], cache: Cache | None, *, scan: bool,
              remat: str | bool | None = None, moe_inputs: dict[str, jax.Array] | None = None):
    """Applies all groups in order. Returns (x, new stacked cache or None, aux stacked [G, p, ...]).

    `remat`: a `clover_jax.parallel.remat` policy name for each layer group (None: the `remat.use_policy`
    context's, else the model config's `remat`). `moe_inputs`: per-layer MoE inputs stacked
    [G, p, ...] (`LayerGroup`). `ctx["lora_key"]` (training with adapter dropout): split into one
    key per group."""
    graphdef, state = nnx.split(group)
    num = jax.tree.leaves(state)[0].shape[0]
    keys = lora.group_keys(ctx.get("lora_key"), num)
    ctx = {k: v for k, v in ctx.items() if k != "lora_key"}

    def body(x, xs):
        group_state, group_cache, group_moe, key = xs
        module = nnx.merge(graphdef, group_state)
        x, new_cache, aux = module(x, ctx if key is None else {**ctx, "lora_key": key}, group_cache, group_moe)
        return x, (new_cache, aux)

    # inside lax.scan the loop already keeps XLA from merging the recompute with the forward
    policy = remat if remat is not None else (remat_policies.override() or getattr(group, "remat", "none"))
    body = remat_policies.apply(body, policy, prevent_cse=not scan)
    if scan:
        x, (new_cache, aux) = jax.lax.scan(body, x_BTD, (state, cache, moe_inputs, keys))
        return x, new_cache, aux
    outs = []
    for gi in range(num):
        sl = jax.tree.map(lambda a: a[gi], (state, cache, moe_inputs, keys))
        x_BTD, out = body(x_BTD, sl)
        outs.append(out)
    new_cache, aux = jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
    return x_BTD, new_cache, aux


def init_stack_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype) -> Cache:
    """Per-layer caches stacked over groups, keyed like the group's layers."""
    out = {}
    for j in range(cfg.group_size):
        one = (init_attention_cache(cfg, batch, max_len, dtype) if cfg.layer_types[j] == FULL
               else init_gdn_cache(cfg, batch, dtype))
        out[f"layer_{j}"] = jax.tree.map(lambda a: jnp.broadcast_to(a, (cfg.num_groups,) + a.shape), one)
    return out
