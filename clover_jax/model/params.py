"""The canonical parameter layout, as pure nested dicts of arrays (numpy or jax).

Two forms of the same parameters:

* per-layer form (what the HF bridge and the Orbax params checkpoint speak): ``{"embed": ...,
  "final_norm": ..., "lm_head": ..., "layers": [layer_0, layer_1, ...]}``, one dict per decoder layer;
* stacked form (what the model holds, so the stack can `lax.scan` over layer groups):
  ``{"embed", "final_norm", "lm_head", "groups": {"layer_0": ..., "layer_{p-1}": ...}}`` where
  ``p = cfg.group_size`` and every leaf of ``groups.layer_j`` has a leading axis of size
  ``cfg.num_groups``: decoder layer ``i`` is ``groups[f"layer_{i % p}"][i // p]``.

Per-layer dict of layer i (JAX [in, out] kernels; shapes for the 35B in brackets)::

    input_norm.scale [D]            post_norm.scale [D]
    attn.{q_proj [D, Hq*2*hd], k_proj [D, Hkv*hd], v_proj [D, Hkv*hd], o_proj [Hq*hd, D]}.kernel
    attn.{q_norm, k_norm}.scale [hd]
    gdn.{in_proj_q [D, nk*dk], in_proj_k [D, nk*dk], in_proj_v [D, nv*dv], in_proj_z [D, nv*dv],
         in_proj_b [D, nv], in_proj_a [D, nv], out_proj [nv*dv, D]}.kernel
    gdn.{conv_q [K, nk*dk], conv_k [K, nk*dk], conv_v [K, nv*dv]}.kernel
    gdn.A_log [nv]  gdn.dt_bias [nv]  gdn.norm.scale [dv]
    block mode only: gdn.bd_gdn_softmax_scalars [nv, 3] (fp32), gdn.conv_{q,k,v}.right [K-1, C_part]
    moe.router.kernel [D, E]  moe.wi_gate [E, D, I]  moe.wi_up [E, D, I]  moe.wo [E, I, D]
    moe.{shared_gate_proj [D, Is], shared_up_proj [D, Is], shared_down_proj [Is, D], shared_gate [D, 1]}.kernel

Only one of ``attn`` / ``gdn`` is present, by ``cfg.layer_types[i]``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from clover_jax.config import FULL, ModelConfig

Tree = dict[str, Any]


def _stack(leaves: list[Any]) -> Any:
    if isinstance(leaves[0], np.ndarray):
        return np.stack(leaves)
    import jax.numpy as jnp

    return jnp.stack(leaves)


def stack_layers(cfg: ModelConfig, per_layer: Tree) -> Tree:
    """Per-layer form -> stacked form. Fails with a message naming the layer on structure mismatch."""
    layers = per_layer["layers"]
    if len(layers) != cfg.num_hidden_layers:
        raise ValueError(f"expected {cfg.num_hidden_layers} layers, got {len(layers)}")
    p, g = cfg.group_size, cfg.num_groups
    groups: Tree = {}
    for j in range(p):
        members = [layers[gi * p + j] for gi in range(g)]
        ref = jax.tree.structure(members[0])
        for gi, m in enumerate(members):
            if jax.tree.structure(m) != ref:
                raise ValueError(f"layer {gi * p + j} has a different structure than layer {j}")
        groups[f"layer_{j}"] = jax.tree.map(lambda *xs: _stack(list(xs)), *members)
    out = {k: v for k, v in per_layer.items() if k != "layers"}
    out["groups"] = groups
    return out


def unstack_layers(cfg: ModelConfig, stacked: Tree) -> Tree:
    """Stacked form -> per-layer form (views into the stacked arrays, no copy for numpy)."""
    p = cfg.group_size
    layers = []
    for i in range(cfg.num_hidden_layers):
        layers.append(jax.tree.map(lambda x, gi=i // p: x[gi], stacked["groups"][f"layer_{i % p}"]))
    out = {k: v for k, v in stacked.items() if k != "groups"}
    out["layers"] = layers
    return out


def layer_param_shapes(cfg: ModelConfig, layer: int) -> Tree:
    """Shapes of one layer's per-layer dict (the contract the bridge validates against)."""
    d = cfg.hidden_size
    out: Tree = {"input_norm": {"scale": (d,)}, "post_norm": {"scale": (d,)}}
    if cfg.layer_types[layer] == FULL:
        hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        out["attn"] = {
            "q_proj": {"kernel": (d, hq * 2 * hd)},
            "k_proj": {"kernel": (d, hkv * hd)},
            "v_proj": {"kernel": (d, hkv * hd)},
            "o_proj": {"kernel": (hq * hd, d)},
            "q_norm": {"scale": (hd,)},
            "k_norm": {"scale": (hd,)},
        }
    else:
        kd, vd, nv, k = cfg.gdn_key_dim, cfg.gdn_value_dim, cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim
        out["gdn"] = {
            "in_proj_q": {"kernel": (d, kd)},
            "in_proj_k": {"kernel": (d, kd)},
            "in_proj_v": {"kernel": (d, vd)},
            "in_proj_z": {"kernel": (d, vd)},
            "in_proj_b": {"kernel": (d, nv)},
            "in_proj_a": {"kernel": (d, nv)},
            "conv_q": {"kernel": (k, kd)},
            "conv_k": {"kernel": (k, kd)},
            "conv_v": {"kernel": (k, vd)},
            "A_log": (nv,),
            "dt_bias": (nv,),
            "norm": {"scale": (cfg.linear_value_head_dim,)},
            "out_proj": {"kernel": (vd, d)},
        }
        if cfg.mode == "block":
            out["gdn"]["bd_gdn_softmax_scalars"] = (nv, 3)
            for part, c in (("conv_q", kd), ("conv_k", kd), ("conv_v", vd)):
                out["gdn"][part]["right"] = (k - 1, c)
    e, i, si = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    out["moe"] = {
        "router": {"kernel": (d, e)},
        "wi_gate": (e, d, i),
        "wi_up": (e, d, i),
        "wo": (e, i, d),
        "shared_gate_proj": {"kernel": (d, si)},
        "shared_up_proj": {"kernel": (d, si)},
        "shared_down_proj": {"kernel": (si, d)},
        "shared_gate": {"kernel": (d, 1)},
    }
    return out


def global_param_shapes(cfg: ModelConfig) -> Tree:
    """Shapes of the non-layer entries of the per-layer form."""
    out: Tree = {
        "embed": {"embedding": (cfg.vocab_size, cfg.hidden_size)},
        "final_norm": {"scale": (cfg.hidden_size,)},
    }
    if not cfg.tie_word_embeddings:
        out["lm_head"] = {"kernel": (cfg.hidden_size, cfg.vocab_size)}
    return out


def check_flat_shapes(
    flat: dict[str, Any], want: dict[str, tuple[int, ...]], where: str, error: type[Exception],
    extra_what: str = "unexpected params",
) -> None:
    """Every key of `want` present in `flat` with that shape, and nothing else; else `error` naming
    the first missing key, the extra keys, or the mis-shaped key."""
    missing = [k for k in want if k not in flat]
    if missing:
        raise error(f"{where}: missing param {missing[0]!r}")
    extra = sorted(set(flat) - set(want))
    if extra:
        raise error(f"{where}: {extra_what} {extra}")
    for k, sh in want.items():
        if tuple(flat[k].shape) != tuple(sh):
            raise error(f"{where}: param {k!r} has shape {tuple(flat[k].shape)}, expected {tuple(sh)}")


def flatten(tree: Tree, prefix: str = "") -> dict[str, Any]:
    """Nested dict -> {"a.b.c": leaf}; lists index as numbers."""
    out: dict[str, Any] = {}
    items = enumerate(tree) if isinstance(tree, list) else tree.items()
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list)):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def unflatten(flat: dict[str, Any]) -> Tree:
    """Inverse of `flatten` for dicts (numeric keys stay strings)."""
    out: Tree = {}
    for key, v in flat.items():
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return out
