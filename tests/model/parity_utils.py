"""Helpers for parity tests against transformers' `Qwen3_5MoeForCausalLM` (tests/model/test_parity_hf.py).

Import as ``from tests.model.parity_utils import ...`` (tests/ is a package; pytest puts the repository root on sys.path).

* `rel_err` / `assert_rel_close`: the suite's one criterion for fp32 equality,
  `max|ours - ref| <= rel * max|ref|`, with a failure message that says where the worst element is.
  The bound is relative to the reference's scale, so it means the same on any host (fp32
  accumulation order differs between CPUs, e.g. with AVX-512): `FP32_REL` = 1e-5 for the same math
  in fp32 (a different op order, fusion or sharding); a test holds a smaller `rel` where it claims
  tighter agreement (a few ops only, or the same ops recomputed);
* `rounding_floor`: how far a computation moves when its fp32 inputs move by half an ulp, the spread
  any fp32 algorithm for the same math may show; where a problem is ill-conditioned (gradients
  through a delta-rule recurrence) a test bounds the error by a multiple of this floor, measured on
  the very inputs it checks, instead of by a constant;
* `our_layer(model, i)`: decoder layer `i` of a `CloverModel` as a standalone `DecoderLayer`
  (its `attn` / `gdn` / `moe` submodules can then be run alone against the HF module of that layer);
* `our_attention_ctx` / `our_gdn_ctx` / `our_moe_ctx`: the per-mixer contexts the model builds for a
  plain (unpacked, uncached) forward;
* `hf_causal_mask` / `hf_position_embeddings`: what an HF attention / decoder layer needs when called
  alone (the HF model builds them in `Qwen3_5MoeTextModel.forward`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.model.attention import causal_segment_mask, rope_tables
from clover_jax.model.clover_model import NO_SEGMENT

#: the fp32 criterion for the same math computed two ways: max|ours - ref| <= FP32_REL * max|ref|
FP32_REL = 1e-5
#: `lowered.compile(compiler_options=FAST_COMPILE)`: XLA's CPU backend at optimisation level 0, the
#: same HLO ops in fp32 (HIGHEST); about half the compile time of the big sharded parity programs,
#: whose cost is nearly all compiling
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def rel_err(ours: Any, ref: Any) -> float:
    """max |ours - ref| / max |ref| (fp32 numpy)."""
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.max(np.abs(ours - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def rounding_floor(f: Any, args: tuple, key: jax.Array) -> float:
    """max over output leaves of `rel_err(f(*args'), f(*args))`, args' = every float leaf of `args`
    times (1 + 2^-24 u), u ~ N(0, 1): the output's own sensitivity to fp32 input rounding."""
    leaves, treedef = jax.tree.flatten(args)
    keys = jax.random.split(key, len(leaves))
    bumped = [l * (1 + 2.0**-24 * jax.random.normal(k, l.shape, l.dtype)) if jnp.issubdtype(l.dtype, jnp.floating) else l
              for l, k in zip(leaves, keys)]
    ref, moved = jax.tree.leaves(f(*args)), jax.tree.leaves(f(*jax.tree.unflatten(treedef, bumped)))
    return max(rel_err(m, r) for m, r in zip(moved, ref))


def assert_rel_close(ours: Any, ref: Any, rel: float, what: str = "") -> float:
    """Asserts `max|ours - ref| <= rel * max|ref|`; returns the relative error."""
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != {ref.shape}"
    assert np.all(np.isfinite(ours)), f"{what}: non-finite values in ours"
    diff = np.abs(ours - ref)
    scale = float(np.max(np.abs(ref)))
    err = float(np.max(diff))
    if err > rel * scale:
        worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
        # the first position (axis 1 = time for [B, T, ...]) whose error exceeds the tolerance helps
        # tell a wrong-from-token-0 bug from one that grows along the sequence (state / chunking)
        bad = np.argwhere(diff > rel * scale)
        raise AssertionError(
            f"{what}: max abs err {err:.3e} > {rel:g} * max|ref| ({scale:.3e}) -> rel {err / scale:.3e}; "
            f"worst at {tuple(int(i) for i in worst)} (ours {ours[worst]:.6g}, ref {ref[worst]:.6g}); "
            f"{len(bad)} of {diff.size} elements off, first at {tuple(int(i) for i in bad[0])}"
        )
    return err / max(scale, 1e-30)


def our_layer(model: Any, i: int) -> Any:
    """Decoder layer `i` (model order) of a `CloverModel`, unstacked: `DecoderLayer` with `.attn` or
    `.gdn`, and `.moe`, holding layer i's parameters."""
    cfg = model.cfg
    gi, j = divmod(i, cfg.group_size)
    graphdef, state = nnx.split(model.groups)
    group = nnx.merge(graphdef, jax.tree.map(lambda a: a[gi], state))
    return getattr(group, f"layer_{j}")


def our_attention_ctx(cfg: Any, positions_BT: Any) -> dict[str, jax.Array]:
    """cos / sin / causal mask of a single-document forward (what `CloverModel._contexts` builds)."""
    positions_BT = jnp.asarray(positions_BT, jnp.int32)
    b, t = positions_BT.shape
    cos, sin = rope_tables(positions_BT, cfg.rotary_dim, cfg.rope_theta)
    slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    seg = jnp.ones((b, t), jnp.int32)
    return {"cos": cos, "sin": sin, "mask": causal_segment_mask(slots, seg, slots, seg)}


def our_gdn_ctx(cfg: Any, b: int, t: int) -> dict[str, jax.Array]:
    """GDN context of a single-document forward without cache."""
    lring = cfg.linear_conv_kernel_dim - 1
    return {
        "segment_ids": jnp.ones((b, t), jnp.int32),
        "ring_segment_ids": jnp.full((b, lring), NO_SEGMENT, jnp.int32),
        "continues": jnp.zeros((b,), bool),
    }


def our_moe_ctx(b: int, t: int) -> dict[str, jax.Array]:
    return {"valid": jnp.ones((b, t), bool)}


def our_layer_ctx(cfg: Any, positions_BT: Any) -> dict[str, Any]:
    """The full per-layer context (`attn`, `gdn`, `valid`) for a single-document forward."""
    b, t = np.shape(positions_BT)
    return {
        "attn": our_attention_ctx(cfg, positions_BT),
        "gdn": our_gdn_ctx(cfg, b, t),
        "valid": our_moe_ctx(b, t)["valid"],
    }


def hf_causal_mask(b: int, t: int, dtype: Any = None) -> Any:
    """Additive causal mask [B, 1, T, T] (0 on and below the diagonal, -inf above) for eager attention
    (a torch tensor; torch is imported where needed, so tests without an HF model do not load it)."""
    import torch

    m = torch.full((t, t), float("-inf"), dtype=dtype or torch.float32).triu(1)
    return m[None, None].expand(b, 1, t, t)


def hf_position_embeddings(hf_model: Any, x: Any, positions_BT: Any) -> tuple[Any, Any]:
    """(cos, sin) torch tensors from the HF model's own rotary embedding (text positions: all three
    mRoPE rows equal)."""
    import torch

    pos = torch.as_tensor(np.array(positions_BT), dtype=torch.long)
    with torch.no_grad():
        return hf_model.model.rotary_emb(x, pos)


def to_torch(x: Any) -> Any:
    import torch

    return torch.as_tensor(np.asarray(x, np.float32))


__all__ = [
    "FAST_COMPILE", "FP32_REL", "assert_rel_close", "rounding_floor", "fast_jit", "fast_nnx_jit", "hf_causal_mask", "hf_position_embeddings",
    "our_attention_ctx", "our_gdn_ctx", "our_layer", "our_layer_ctx", "our_moe_ctx", "rel_err", "to_torch",
]


def fast_jit(fn):
    """`jax.jit(fn)` lowered and compiled with `FAST_COMPILE` at each call (one-shot parity programs)."""
    def call(*args):
        return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)
    return call


def fast_nnx_jit(fn):
    """`nnx.jit(fn)` for `fn(module, *arrays)` that leaves the module unchanged, compiled with
    `FAST_COMPILE`: one program per module structure (graphdef) and input shapes, as nnx.jit."""
    jitted = jax.jit(lambda graphdef, state, *args: fn(nnx.merge(graphdef, state), *args), static_argnums=0,
                     compiler_options=FAST_COMPILE)

    def call(module, *args):
        graphdef, state = nnx.split(module)
        return jitted(graphdef, state, *args)
    return call
