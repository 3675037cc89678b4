"""Low-rank adapters (LoRA) on the model's projections and routed experts.

A targeted weight ``W [..., in, out]`` (a `Dense` kernel, or an expert stack ``moe.wi_gate [E, D, I]``,
``moe.wi_up``, ``moe.wo [E, I, D]``; leading ``layers`` axis in the stacked form) gains two
`nnx.LoRAParam` leaves beside it::

    lora_a [..., in, r]   uniform(+-1/sqrt(in)) (PEFT's default)   logical axes (..., in_axis, "lora_rank")
    lora_b [..., r, out]  zeros                                    logical axes (..., "lora_rank", out_axis)

and computes with ``W + (alpha / r) * lora_a @ lora_b``. A `Dense` keeps the product factored,
``y = x W + s (x A) B``, so the low-rank update adds to the output at the output's precision, never
to a bf16 weight it would round away. The routed experts merge per layer into the expert stack in
fp32 before the cast to the compute dtype (`expert_weight`): every expert implementation (ragged,
blocked, capacity, expert parallel) then runs unchanged. That is what PEFT does for fused expert
parameters too; its price is that an update below the compute dtype's resolution of ``W`` is not
seen by the bf16 forward (the gradient still flows: the cast's gradient is the identity).

Dropout (`dropout` > 0, PEFT's ``lora_dropout``): a `Dense` adapter reads ``dropout(x)``, a mask of its
own per projection, layer group and step, only when the forward is given a key (`dropout_input`:
training; evaluation and decoding pass none). The routed experts' adapters have none: merged into
the weight, they never see the input apart from the base product (PEFT refuses dropout on such
fused parameters for the same reason).

With B = 0 (initialisation) the model is the base model bit for bit. Paths: a Dense adapter sits at
``<module>.lora_a`` (e.g. ``groups.layer_0.attn.q_proj.lora_a``), an expert adapter at
``moe.wi_gate_lora_a``. `targets` are regexes over the BASE weight's params-tree path
(``groups.layer_0.attn.q_proj.kernel``, ``groups.layer_0.moe.wi_gate``).
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.model.params import Tree, flatten, unflatten

LORA_RANK_AXIS = "lora_rank"
A, B = "lora_a", "lora_b"
EXPERT_WEIGHTS = ("wi_gate", "wi_up", "wo")
#: Every projection of attention, GDN and the shared expert, and the routed experts (not the router,
#: the shared-expert gate, the embedding or the LM head).
DEFAULT_TARGETS: tuple[str, ...] = (
    r"\.attn\.(q|k|v|o)_proj\.kernel$",
    r"\.gdn\.(in_proj_(q|k|v|z|b|a)|out_proj)\.kernel$",
    r"\.moe\.shared_(gate|up|down)_proj\.kernel$",
    r"\.moe\.(wi_gate|wi_up|wo)$",
)
#: Params paths of adapter leaves (fp32 masters, trainable).
ADAPTER_PATTERN = r"(\.|_)lora_[ab]$"


def is_adapter(path: str) -> bool:
    return re.search(ADAPTER_PATTERN, path) is not None


def scale_of(rank: int, alpha: float) -> float:
    return float(alpha) / float(rank)


def adapter_init(key: jax.Array, base_path: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...]
                 ) -> tuple[jax.Array, jax.Array]:
    """Initial (a, b) of the adapter on the weight at `base_path`: a uniform(+-1/sqrt(in)) from
    `key` folded with the path (so every weight draws its own, whatever the order), b zeros."""
    bound = 1.0 / math.sqrt(a_shape[-2])
    k = jax.random.fold_in(key, zlib.crc32(base_path.encode()) & 0x7FFFFFFF)
    return jax.random.uniform(k, a_shape, jnp.float32, -bound, bound), jnp.zeros(b_shape, jnp.float32)


def _adapter_params(kernel: nnx.Param, rank: int, key: jax.Array, base_path: str
                    ) -> tuple[nnx.LoRAParam, nnx.LoRAParam]:
    """(a, b) for `kernel` [..., in, out] with its logical axes; fp32 whatever the kernel's dtype."""
    shape, axes = kernel[...].shape, tuple(kernel.get_metadata()["logical_axes"])
    lead, (d_in, d_out) = shape[:-2], shape[-2:]
    a, b = adapter_init(key, base_path, lead + (d_in, rank), lead + (rank, d_out))
    return (nnx.LoRAParam(a, logical_axes=axes[:-1] + (LORA_RANK_AXIS,)),
            nnx.LoRAParam(b, logical_axes=axes[:-2] + (LORA_RANK_AXIS, axes[-1])))


def add_adapters(model: nnx.Module, rank: int, alpha: float, targets: tuple[str, ...], rngs: nnx.Rngs,
                 prefix: tuple[str, ...] = (), strict: bool = True, dropout: float = 0.0) -> list[str]:
    """Attaches adapters to every targeted weight of `model` (in place). Returns the targeted base
    paths; raises ValueError if nothing is targeted, or (`strict`: the user's own targets) if a
    pattern matches no weight (a typo would silently train nothing there; the defaults name weights
    a model may lack, e.g. attention in an all-GDN stack). `dropout`: the Dense adapters' input
    dropout rate (module docstring)."""
    found: list[str] = []
    hit = {p: False for p in targets}

    def wanted(path: str) -> bool:
        ok = False
        for p in targets:
            if re.search(p, path):
                hit[p] = ok = True
        return ok

    key = rngs.lora()
    modules = [(tuple(str(k) for k in path), m) for path, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)]
    for path, module in modules:
        base = ".".join(prefix + path)
        if getattr(type(module), "takes_lora", False):  # a Dense (clover_jax.model.nn imports this module)
            if wanted(f"{base}.kernel"):
                module.lora_a, module.lora_b = _adapter_params(module.kernel, rank, key, f"{base}.kernel")
                module.lora_scale = scale_of(rank, alpha)
                module.lora_dropout = float(dropout)
                # a mask of its own: the module's path folded into the layer group's key
                module.lora_id = zlib.crc32(base.encode()) & 0x7FFFFFFF
                found.append(f"{base}.kernel")
        elif all(isinstance(getattr(module, n, None), nnx.Param) for n in EXPERT_WEIGHTS):
            for n in EXPERT_WEIGHTS:
                if wanted(f"{base}.{n}"):
                    a, b = _adapter_params(getattr(module, n), rank, key, f"{base}.{n}")
                    setattr(module, f"{n}_{A}", a)
                    setattr(module, f"{n}_{B}", b)
                    module.lora_scale = scale_of(rank, alpha)
                    found.append(f"{base}.{n}")
    missing = [p for p, ok in hit.items() if not ok]
    if missing and strict:
        raise ValueError(f"lora.targets: pattern {missing[0]!r} matches no projection or expert weight "
                         f"(weights look like: {', '.join(found[:3]) or 'groups.layer_0.attn.q_proj.kernel'})")
    if not found:
        raise ValueError("lora.targets: no weight targeted")
    return found


def dropout_input(x: jax.Array, rate: float, key: jax.Array | None, module_id: int) -> jax.Array:
    """`x` with each element zeroed with probability `rate` and the rest scaled by 1 / (1 - rate)
    (so E[out] = x), the mask drawn from `key` folded with `module_id`; `x` itself when `key` is
    None or `rate` is 0 (evaluation, decoding)."""
    if key is None or not rate:
        return x
    keep = jax.random.bernoulli(jax.random.fold_in(key, module_id), 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def group_keys(key: jax.Array | None, groups: int) -> jax.Array | None:
    """One dropout key per stacked layer group (`clover_jax.model.layers.run_stack`): within a
    group every Dense folds in its own path (`dropout_input`), so every adapter of the model draws
    its own mask."""
    return None if key is None else jax.random.split(key, groups)


def low_rank(x: jax.Array, a: jax.Array, b: jax.Array, scale: float, dtype: jnp.dtype) -> jax.Array:
    """``scale * (x @ a) @ b`` in `dtype` with fp32 accumulation: x [..., in], a [in, r], b [r, out]."""
    h = jnp.dot(x, a.astype(dtype), preferred_element_type=jnp.float32).astype(dtype)
    return (scale * jnp.dot(h, b.astype(dtype), preferred_element_type=jnp.float32)).astype(dtype)


def delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """The dense update ``scale * a @ b`` [..., in, out] in fp32 (a [..., in, r], b [..., r, out])."""
    return scale * jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32),
                              preferred_element_type=jnp.float32)


def expert_weight(module: nnx.Module, name: str, dtype: jnp.dtype) -> jax.Array:
    """``module.<name>`` in `dtype`, with its adapter merged in fp32 first when it has one."""
    w = getattr(module, name)[...]
    a = getattr(module, f"{name}_{A}", None)
    if a is None:
        return w.astype(dtype)
    b = getattr(module, f"{name}_{B}")
    return (w.astype(jnp.float32) + delta(a[...], b[...], module.lora_scale)).astype(dtype)


def merge_adapters(params: Tree, rank: int, alpha: float) -> Tree:
    """A params tree without adapters: each adapted weight replaced by ``W + s a @ b`` in fp32 (not
    cast back: a bf16 base would round the update away; an export casts to its own dtype). Numpy or
    jax leaves; the input is not modified."""
    flat = flatten(params)
    s = scale_of(rank, alpha)
    out: dict[str, Any] = {}
    for k, v in flat.items():
        if is_adapter(k):
            continue
        base = k[: -len(".kernel")] if k.endswith(".kernel") else k
        a = flat.get(f"{base}.{A}" if k.endswith(".kernel") else f"{base}_{A}")
        if a is None:
            out[k] = v
            continue
        b = flat[f"{base}.{B}" if k.endswith(".kernel") else f"{base}_{B}"]
        out[k] = jnp.asarray(v, jnp.float32) + delta(jnp.asarray(a), jnp.asarray(b), s)
    return unflatten(out)


def base_path(adapter_path: str) -> str:
    """``x.q_proj.lora_a`` -> ``x.q_proj.kernel``; ``x.moe.wi_gate_lora_b`` -> ``x.moe.wi_gate``."""
    for leaf in (A, B):
        if adapter_path.endswith(f".{leaf}"):
            return adapter_path[: -len(leaf) - 1] + ".kernel"
        if adapter_path.endswith(f"_{leaf}"):
            return adapter_path[: -len(leaf) - 1]
    raise ValueError(f"{adapter_path!r} is not an adapter path")


def base_config(cfg: Any) -> Any:
    """The ModelConfig without adapters (what an HF checkpoint holds, what a merged export writes)."""
    return cfg.replace(lora_rank=0, lora_targets=(), lora_dropout=0.0)


def init_adapters(shapes: dict[str, tuple[int, ...]], key: jax.Array) -> dict[str, jax.Array]:
    """Initial values of the adapter leaves among `shapes` (flat path -> shape, e.g. a LoRA model's
    params): what a checkpoint without adapters starts from (`adapter_init` per weight)."""
    out: dict[str, jax.Array] = {}
    for k, shape in shapes.items():
        if k.endswith(A) and is_adapter(k):
            bk = k[: -len(A)] + B
            out[k], out[bk] = adapter_init(key, base_path(k), tuple(shape), tuple(shapes[bk]))
    return out


def adapter_pairs(params: Tree) -> dict[str, tuple[Any, Any]]:
    """Base weight path -> (a, b) for every adapter in a flat-able params tree."""
    flat = flatten(params)
    return {base_path(k): (v, flat[k[: -len(A)] + B]) for k, v in flat.items() if k.endswith(A) and is_adapter(k)}


__all__ = ["A", "ADAPTER_PATTERN", "B", "DEFAULT_TARGETS", "EXPERT_WEIGHTS", "LORA_RANK_AXIS", "add_adapters",
           "adapter_init", "adapter_pairs", "base_config", "base_path", "delta", "dropout_input", "expert_weight",
           "group_keys", "init_adapters", "is_adapter", "low_rank", "merge_adapters", "scale_of"]
