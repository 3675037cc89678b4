"""Dropless mixture of experts with a sigmoid-gated shared expert (Qwen3.5 `SparseMoeBlock`).

Router: fp32 softmax over all experts, top-k, renormalise the k weights to sum 1. Two expert paths
that compute the same function:

* `ragged` (default): sort the T*k assignments by expert and run grouped matmuls
  (`jax.lax.ragged_dot`); no capacity, so no token is ever dropped;
* `blocked`: the same sort, then each expert's group is padded to a multiple of a row block and the
  blocks run as one batched matmul against their expert's weights (an XLA grouped matmul, the fast
  path on CPU, where `ragged_dot` expands to a dense masked product);
* `dense`: every token through every expert, weighted by a dense [T, E] combine matrix: the plain
  reference (E/k times the FLOPs).

`auto` picks `blocked` on CPU and `ragged` elsewhere.

Expert parallelism across devices (shard_map + ragged all-to-all) is the scale issue's work; it
plugs in behind `route` / `combine` below.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.config import ModelConfig
from clover_jax.nn import Dense, dtype_of, make_param, normal


def route(logits_TE: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (probs_TE fp32 softmax, weights_TK renormalised top-k, experts_TK int32)."""
    probs = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights, experts.astype(jnp.int32)


def load_balancing_loss(probs_TE: jax.Array, experts_TK: jax.Array, valid_T: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Switch-style loss `E * sum_e f_e P_e` over valid tokens (f_e: share of the T*k assignments that
    go to e, P_e: mean router probability), and the per-expert assignment counts [E]."""
    e = probs_TE.shape[-1]
    w = valid_T.astype(jnp.float32)
    counts = jnp.zeros((e,), jnp.float32).at[experts_TK].add(jnp.broadcast_to(w[:, None], experts_TK.shape))
    n = jnp.maximum(jnp.sum(w), 1.0)
    frac = counts / (n * experts_TK.shape[-1])
    mean_prob = jnp.sum(probs_TE * w[:, None], axis=0) / n
    return e * jnp.sum(frac * mean_prob), counts


def experts_ragged(x_TD, weights_TK, experts_TK, wi_gate_EDI, wi_up_EDI, wo_EID) -> jax.Array:
    """Sorted grouped-matmul experts: exact, dropless. Returns [T, D] fp32."""
    t, k = experts_TK.shape
    e = wi_gate_EDI.shape[0]
    flat_e = experts_TK.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    group_sizes = jnp.bincount(flat_e, length=e).astype(jnp.int32)
    xs = x_TD[order // k]
    h = jax.lax.ragged_dot(xs, wi_gate_EDI, group_sizes, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot(xs, wi_up_EDI, group_sizes, preferred_element_type=jnp.float32)
    act = (jax.nn.silu(h) * u).astype(x_TD.dtype)
    y = jax.lax.ragged_dot(act, wo_EID, group_sizes, preferred_element_type=jnp.float32)
    y_unsorted = jnp.zeros_like(y).at[order].set(y)
    return jnp.einsum("tkd,tk->td", y_unsorted.reshape(t, k, -1), weights_TK)


def _block_rows(n: int, e: int) -> int:
    """Row block for `experts_blocked`: about a quarter of the mean group size, in [8, 128], so the
    padding (at most e * (block - 1) rows) stays a small fraction of the n real rows."""
    target = max(8, min(128, n // (4 * e)))
    return 1 << (target.bit_length() - 1)


def experts_blocked(x_TD, weights_TK, experts_TK, wi_gate_EDI, wi_up_EDI, wo_EID) -> jax.Array:
    """Grouped matmul by padded row blocks: exact and dropless (static bound n + e*(block-1) rows).
    Returns [T, D] fp32."""
    t, k = experts_TK.shape
    e, d, _ = wi_gate_EDI.shape
    n = t * k
    blk = _block_rows(n, e)
    nb = -(-(n + e * (blk - 1)) // blk)
    flat_e = experts_TK.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    sorted_e = flat_e[order]
    sizes = jnp.bincount(flat_e, length=e).astype(jnp.int32)
    padded = -(-sizes // blk) * blk
    start = jnp.cumsum(sizes) - sizes
    pstart = jnp.cumsum(padded) - padded
    dest = pstart[sorted_e] + jnp.arange(n, dtype=jnp.int32) - start[sorted_e]  # row in padded layout
    xs = jnp.zeros((nb * blk, d), x_TD.dtype).at[dest].set(x_TD[order // k])
    # expert owning each block (trailing empty blocks reuse the last expert on zero rows)
    block_e = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded), jnp.arange(nb) * blk, side="right"), e - 1)
    xb = xs.reshape(nb, blk, d)
    h = jnp.einsum("bmd,bdi->bmi", xb, wi_gate_EDI[block_e], preferred_element_type=jnp.float32)
    u = jnp.einsum("bmd,bdi->bmi", xb, wi_up_EDI[block_e], preferred_element_type=jnp.float32)
    act = (jax.nn.silu(h) * u).astype(x_TD.dtype)
    y = jnp.einsum("bmi,bid->bmd", act, wo_EID[block_e], preferred_element_type=jnp.float32)
    y_sorted = y.reshape(nb * blk, d)[dest]
    y_unsorted = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
    return jnp.einsum("tkd,tk->td", y_unsorted.reshape(t, k, d), weights_TK)


def experts_dense(x_TD, weights_TK, experts_TK, wi_gate_EDI, wi_up_EDI, wo_EID) -> jax.Array:
    """Reference: all experts on all tokens, combined with a dense [T, E] weight matrix."""
    e = wi_gate_EDI.shape[0]
    combine_TE = jnp.einsum("tk,tke->te", weights_TK, jax.nn.one_hot(experts_TK, e, dtype=jnp.float32))
    h = jnp.einsum("td,edi->tei", x_TD, wi_gate_EDI, preferred_element_type=jnp.float32)
    u = jnp.einsum("td,edi->tei", x_TD, wi_up_EDI, preferred_element_type=jnp.float32)
    act = (jax.nn.silu(h) * u).astype(x_TD.dtype)
    y = jnp.einsum("tei,eid->ted", act, wo_EID, preferred_element_type=jnp.float32)
    return jnp.einsum("ted,te->td", y, combine_TE)


EXPERT_IMPLS = {"ragged": experts_ragged, "blocked": experts_blocked, "dense": experts_dense}


def resolve_impl(impl: str) -> str:
    if impl == "auto":
        return "blocked" if jax.default_backend() == "cpu" else "ragged"
    if impl not in EXPERT_IMPLS:
        raise ValueError(f"unknown moe_impl {impl!r}; expected auto or one of {sorted(EXPERT_IMPLS)}")
    return impl


class MoE(nnx.Module):
    """Routed experts + shared expert: `moe(x) = sum_k w_k E_k(x) + sigmoid(x W_sg) S(x)`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd, dt = dtype_of(cfg.param_dtype), dtype_of(cfg.dtype)
        d, e, i, si = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        kw = dict(rngs=rngs, param_dtype=pd, dtype=dt)
        self.router = Dense(d, e, ("embed", "router_experts"), **kw)
        self.wi_gate = make_param(rngs, normal(), (e, d, i), ("experts", "embed", "expert_mlp"), pd)
        self.wi_up = make_param(rngs, normal(), (e, d, i), ("experts", "embed", "expert_mlp"), pd)
        self.wo = make_param(rngs, normal(), (e, i, d), ("experts", "expert_mlp", "embed"), pd)
        self.shared_gate_proj = Dense(d, si, ("embed", "mlp"), **kw)
        self.shared_up_proj = Dense(d, si, ("embed", "mlp"), **kw)
        self.shared_down_proj = Dense(si, d, ("mlp", "embed"), **kw)
        self.shared_gate = Dense(d, 1, ("embed", None), **kw)
        self.top_k, self.impl, self.dtype = cfg.num_experts_per_tok, cfg.moe_impl, dt

    def __call__(self, x_BTD: jax.Array, ctx: dict[str, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [B, T, D] -> ([B, T, D], aux {"lb_loss": scalar, "expert_counts": [E]}).
        `ctx["valid"]` [B, T] excludes pad tokens from the load statistics."""
        b, t, d = x_BTD.shape
        x = x_BTD.reshape(b * t, d).astype(self.dtype)
        probs, weights, experts = route(self.router(x), self.top_k)
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        routed = EXPERT_IMPLS[resolve_impl(self.impl)](x, weights, experts, w(self.wi_gate), w(self.wi_up), w(self.wo))
        shared = self.shared_down_proj(jax.nn.silu(self.shared_gate_proj(x)) * self.shared_up_proj(x))
        gate = jax.nn.sigmoid(self.shared_gate(x).astype(jnp.float32))
        y = routed + gate * shared.astype(jnp.float32)
        lb, counts = load_balancing_loss(probs, experts, ctx["valid"].reshape(-1))
        return y.astype(x_BTD.dtype).reshape(b, t, d), {"lb_loss": lb, "expert_counts": counts}
