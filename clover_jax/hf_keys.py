"""Pure mapping between HF Qwen3.5/3.6-MoE text tensors and our per-layer param tree (numpy).

No file I/O here: `bridge.py` streams tensors in and out, this module only names, checks and reshapes.
Every transform is a transpose, a row split/concat or an expert stack/unstack, so values and dtypes
pass through untouched and HF -> ours -> HF is byte-identical (nothing is ever cast).

HF side (DESIGN.md 2.2; PyTorch [out, in]), with ``P`` the text prefix (``model.language_model.`` on
the hub, ``model.`` from ``save_pretrained``) and ``L = P + "layers.{i}."``:

=====================================================  ==========================  =====================
HF tensor                                              HF shape                    ours
=====================================================  ==========================  =====================
``P embed_tokens.weight``                              [V, D]                      embed.embedding [V, D]
``P norm.weight``                                      [D]                         final_norm.scale
``lm_head.weight`` (absent if tied)                    [V, D]                      lm_head.kernel [D, V]
``L input_layernorm`` / ``post_attention_layernorm``   [D]                         input_norm / post_norm
``L self_attn.{q,k,v,o}_proj.weight``                  [out, in]                   attn.*.kernel [in, out]
``L self_attn.{q,k}_norm.weight``                      [hd]                        attn.{q,k}_norm.scale
``L linear_attn.in_proj_qkv.weight``                   [2*nk*dk + nv*dv, D]        in_proj_{q,k,v} (rows q||k||v)
``L linear_attn.conv1d.weight``                        [C, 1, K]                   conv_{q,k,v} [K, part]
``L linear_attn.{in_proj_z,in_proj_b,in_proj_a,out_proj}.weight``                  [in, out]
``L linear_attn.{A_log,dt_bias}`` / ``norm.weight``    [nv] / [dv]                 gdn.A_log, dt_bias, norm.scale
``L mlp.gate.weight``                                  [E, D]                      moe.router.kernel [D, E]
``L mlp.experts.gate_up_proj`` (fused)                 [E, 2I, D] gate rows first  moe.wi_gate, wi_up [E, D, I]
``L mlp.experts.down_proj`` (fused)                    [E, D, I]                   moe.wo [E, I, D]
``L mlp.experts.{e}.{gate,up}_proj.weight`` (per exp)  [I, D]                      moe.wi_gate[e], wi_up[e]
``L mlp.experts.{e}.down_proj.weight`` (per expert)    [D, I]                      moe.wo[e]
``L mlp.shared_expert.{gate,up,down}_proj.weight``     [out, in]                   moe.shared_*_proj.kernel
``L mlp.shared_expert_gate.weight``                    [1, D]                      moe.shared_gate.kernel [D, 1]
=====================================================  ==========================  =====================
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from clover_jax.config import FULL, ModelConfig
from clover_jax.params import flatten, global_param_shapes, layer_param_shapes, unflatten
from clover_jax.safetensors_io import CheckpointError

logger = logging.getLogger(__name__)

HUB_PREFIX = "model.language_model."
PLAIN_PREFIX = "model."
TEXT_PREFIXES = (HUB_PREFIX, PLAIN_PREFIX)
FUSED = "fused"
PER_EXPERT = "per_expert"
EXPERT_LAYOUTS = (FUSED, PER_EXPERT)
LM_HEAD_KEY = "lm_head.weight"

Tree = dict[str, Any]
Shape = tuple[int, ...]


class HFMappingError(CheckpointError):
    """HF tensors that do not fit the config: the message names the HF key (and shapes).

    A `CheckpointError` (so a `ValueError`): callers catch one type for every bad-checkpoint case."""


@dataclass(frozen=True)
class HFLayout:
    """How a checkpoint names its text tensors: the key prefix and the routed-expert layout."""

    prefix: str = PLAIN_PREFIX
    expert_layout: str = PER_EXPERT

    def __post_init__(self) -> None:
        if self.prefix not in TEXT_PREFIXES:
            raise HFMappingError(f"unknown HF prefix {self.prefix!r} (supported: {TEXT_PREFIXES})")
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise HFMappingError(
                f"unknown expert layout {self.expert_layout!r} (supported: {EXPERT_LAYOUTS})"
            )


# --------------------------------------------------------------------------------------------
# Detection and skipping
# --------------------------------------------------------------------------------------------

_TEXT_MODULES = ("layers", "embed_tokens", "norm", "rotary_emb")
_FUSED_RE = re.compile(r"layers\.\d+\.mlp\.experts\.gate_up_proj$")
_PER_EXPERT_RE = re.compile(r"layers\.\d+\.mlp\.experts\.\d+\.")


def _skip_group(key: str, prefix: str) -> str | None:
    """The skipped group a key belongs to (for the log line), or None if it is a text-model key."""
    if key.startswith("mtp."):
        return "mtp."
    if key.startswith(prefix) or key == LM_HEAD_KEY:
        return None
    if prefix == HUB_PREFIX and key.startswith("model.") and key.split(".")[1] not in _TEXT_MODULES:
        # siblings of model.language_model: model.visual.*, and anything else a multimodal wrapper
        # adds; text names under the other prefix are a broken mixture and stay (-> unexpected)
        return "model." + key.split(".")[1] + "."
    if key.startswith("model.visual."):
        return "model.visual."
    return None


def detect_layout(keys: Iterable[str], *, source: str = "checkpoint") -> tuple[HFLayout, list[str]]:
    """Finds the text prefix and expert layout of a checkpoint's tensor names.

    Returns ``(layout, text_keys)``: ``text_keys`` are the names left after skipping ``mtp.*`` and
    the non-text siblings (``model.visual.*``); each skipped group gets one log line with its count.
    """
    keys = list(keys)
    if any(k.startswith(HUB_PREFIX) for k in keys):
        prefix = HUB_PREFIX
    elif any(k.startswith(PLAIN_PREFIX) and not k.startswith("model.visual.") for k in keys):
        prefix = PLAIN_PREFIX
    else:
        raise HFMappingError(
            f"{source}: no text-model tensors (expected names under {HUB_PREFIX!r} or {PLAIN_PREFIX!r})"
        )
    skipped: dict[str, int] = {}
    text_keys: list[str] = []
    for k in keys:
        group = _skip_group(k, prefix)
        if group is None:
            text_keys.append(k)
        else:
            skipped[group] = skipped.get(group, 0) + 1
    for group, n in skipped.items():
        logger.info("%s: skipping %d tensors under %r (not part of the text model)", source, n, group)

    body = [k[len(prefix):] for k in text_keys if k.startswith(prefix)]
    fused = next((k for k in body if _FUSED_RE.match(k)), None)
    per_expert = next((k for k in body if _PER_EXPERT_RE.match(k)), None)
    if fused and per_expert:
        raise HFMappingError(
            f"{source}: mixed expert layouts: {prefix + fused!r} (fused) and {prefix + per_expert!r} "
            "(per expert)"
        )
    if not fused and not per_expert:
        raise HFMappingError(
            f"{source}: no routed-expert tensors found (expected {prefix}layers.N.mlp.experts.gate_up_proj "
            f"or {prefix}layers.N.mlp.experts.E.gate_proj.weight)"
        )
    return HFLayout(prefix, FUSED if fused else PER_EXPERT), text_keys


# --------------------------------------------------------------------------------------------
# Rules: one HF tensor group <-> one group of our leaves
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rule:
    """``kind`` says how ``hf`` keys (HF shapes derived from ours) map to ``ours`` flat keys."""

    kind: str  # copy | T | rows (qkv) | conv | gate_up | down | experts
    hf: tuple[str, ...]
    ours: tuple[str, ...]
    our_shapes: tuple[Shape, ...]

    def hf_shapes(self) -> list[Shape]:
        s = self.our_shapes
        if self.kind == "copy":
            return [s[0]]
        if self.kind == "T":
            return [s[0][::-1]]
        if self.kind == "rows":  # ours [D, part] x3 -> [sum parts, D]
            return [(sum(x[1] for x in s), s[0][0])]
        if self.kind == "conv":  # ours [K, part] x3 -> [C, 1, K]
            return [(sum(x[1] for x in s), 1, s[0][0])]
        if self.kind == "gate_up":  # ours [E, D, I] x2 -> [E, 2I, D]
            e, d, i = s[0]
            return [(e, 2 * i, d)]
        if self.kind == "down":  # ours [E, I, D] -> [E, D, I]
            e, i, d = s[0]
            return [(e, d, i)]
        if self.kind == "experts":  # ours [E, a, b] -> E tensors [b, a]
            e, a, b = s[0]
            return [(b, a)] * e
        raise AssertionError(self.kind)


def _linear(kind: str, hf: str, ours: str, shapes: Mapping[str, Shape]) -> _Rule:
    return _Rule(kind, (hf,), (ours,), (shapes[ours],))


def global_rules(cfg: ModelConfig, layout: HFLayout) -> list[_Rule]:
    s = _leaf_shapes(flatten(global_param_shapes(cfg)))
    p = layout.prefix
    rules = [
        _linear("copy", p + "embed_tokens.weight", "embed.embedding", s),
        _linear("copy", p + "norm.weight", "final_norm.scale", s),
    ]
    if not cfg.tie_word_embeddings:
        rules.append(_linear("T", LM_HEAD_KEY, "lm_head.kernel", s))
    return rules


def _leaf_shapes(flat: Mapping[str, Any]) -> dict[str, Shape]:
    # flatten() descends into shape tuples' parents only (tuples are leaves), so values are shapes
    return {k: tuple(v) for k, v in flat.items()}


def layer_rules(cfg: ModelConfig, layout: HFLayout, i: int) -> list[_Rule]:
    """The rules of decoder layer ``i`` in HF module order (which is also our write order)."""
    s = _leaf_shapes(flatten(layer_param_shapes(cfg, i)))
    p = f"{layout.prefix}layers.{i}."
    rules: list[_Rule] = []
    if cfg.layer_types[i] == FULL:
        a = p + "self_attn."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            rules.append(_linear("T", f"{a}{n}.weight", f"attn.{n}.kernel", s))
        for n in ("q_norm", "k_norm"):
            rules.append(_linear("copy", f"{a}{n}.weight", f"attn.{n}.scale", s))
    else:
        g = p + "linear_attn."
        qkv = ("gdn.in_proj_q.kernel", "gdn.in_proj_k.kernel", "gdn.in_proj_v.kernel")
        conv = ("gdn.conv_q.kernel", "gdn.conv_k.kernel", "gdn.conv_v.kernel")
        rules += [
            _linear("copy", g + "dt_bias", "gdn.dt_bias", s),
            _linear("copy", g + "A_log", "gdn.A_log", s),
            _Rule("conv", (g + "conv1d.weight",), conv, tuple(s[k] for k in conv)),
            _linear("copy", g + "norm.weight", "gdn.norm.scale", s),
            _linear("T", g + "out_proj.weight", "gdn.out_proj.kernel", s),
            _Rule("rows", (g + "in_proj_qkv.weight",), qkv, tuple(s[k] for k in qkv)),
            _linear("T", g + "in_proj_z.weight", "gdn.in_proj_z.kernel", s),
            _linear("T", g + "in_proj_b.weight", "gdn.in_proj_b.kernel", s),
            _linear("T", g + "in_proj_a.weight", "gdn.in_proj_a.kernel", s),
        ]
    m = p + "mlp."
    rules.append(_linear("T", m + "gate.weight", "moe.router.kernel", s))
    if layout.expert_layout == FUSED:
        rules += [
            _Rule("gate_up", (m + "experts.gate_up_proj",), ("moe.wi_gate", "moe.wi_up"),
                  (s["moe.wi_gate"], s["moe.wi_up"])),
            _linear("down", m + "experts.down_proj", "moe.wo", s),
        ]
    else:
        e = cfg.num_experts
        for hf_name, ours in (("gate_proj", "moe.wi_gate"), ("up_proj", "moe.wi_up"), ("down_proj", "moe.wo")):
            keys = tuple(f"{m}experts.{j}.{hf_name}.weight" for j in range(e))
            rules.append(_Rule("experts", keys, (ours,), (s[ours],)))
    for n in ("gate_proj", "up_proj", "down_proj"):
        rules.append(_linear("T", f"{m}shared_expert.{n}.weight", f"moe.shared_{n}.kernel", s))
    rules.append(_linear("T", m + "shared_expert_gate.weight", "moe.shared_gate.kernel", s))
    rules += [
        _linear("copy", p + "input_layernorm.weight", "input_norm.scale", s),
        _linear("copy", p + "post_attention_layernorm.weight", "post_norm.scale", s),
    ]
    return rules


def expected_hf_shapes(rules: Iterable[_Rule]) -> dict[str, Shape]:
    """HF key -> HF shape, in rule order."""
    out: dict[str, Shape] = {}
    for r in rules:
        out.update(zip(r.hf, r.hf_shapes()))
    return out


def all_expected_keys(cfg: ModelConfig, layout: HFLayout) -> dict[str, Shape]:
    """Every HF text tensor the config implies (globals first, then layer by layer)."""
    out = expected_hf_shapes(global_rules(cfg, layout))
    for i in range(cfg.num_hidden_layers):
        out.update(expected_hf_shapes(layer_rules(cfg, layout, i)))
    return out


def check_tensor_names(
    cfg: ModelConfig, layout: HFLayout, text_keys: Iterable[str], *, source: str = "checkpoint"
) -> None:
    """Fails on the first missing HF tensor (named) and on any unexpected text tensor (all named)."""
    present = set(text_keys)
    expected = all_expected_keys(cfg, layout)
    missing = [k for k in expected if k not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise HFMappingError(f"{source}: missing tensor {missing[0]!r}{more}")
    extra = sorted(present - set(expected))
    if cfg.tie_word_embeddings and LM_HEAD_KEY in extra:
        # a tied checkpoint may still carry the (identical) head; the embedding is the one we keep
        logger.info("%s: tie_word_embeddings=true, ignoring %r", source, LM_HEAD_KEY)
        extra.remove(LM_HEAD_KEY)
    if extra:
        shown = ", ".join(repr(k) for k in extra[:8]) + (f" ... ({len(extra)} in all)" if len(extra) > 8 else "")
        raise HFMappingError(f"{source}: unexpected tensors not in the config's model: {shown}")


# --------------------------------------------------------------------------------------------
# HF -> ours
# --------------------------------------------------------------------------------------------


def _check_shape(key: str, arr: Any, expected: Shape, source: str) -> None:
    if tuple(arr.shape) != tuple(expected):
        raise HFMappingError(
            f"{source}: tensor {key!r} has shape {tuple(arr.shape)}, expected {tuple(expected)}"
        )


def _same_dtype(keys: Iterable[str], arrays: Iterable[Any]) -> np.dtype:
    pairs = list(zip(keys, arrays))
    dt = pairs[0][1].dtype
    for k, a in pairs[1:]:
        if a.dtype != dt:
            # concatenating would silently upcast and break the byte-exact round trip
            raise HFMappingError(
                f"{k!r} has dtype {a.dtype} but {pairs[0][0]!r} has {dt}; they share one HF tensor"
            )
    return dt


def _apply_to_ours(rule: _Rule, arrays: list[np.ndarray]) -> list[np.ndarray]:
    k = rule.kind
    if k == "copy":
        return arrays
    if k == "T":
        return [arrays[0].T]
    if k in ("rows", "conv"):
        a = arrays[0] if k == "rows" else arrays[0][:, 0, :]  # [C, D] or [C, K]
        out, start = [], 0
        for shape in rule.our_shapes:
            out.append(a[start:start + shape[1]].T)
            start += shape[1]
        return out
    if k == "gate_up":
        i = rule.our_shapes[0][2]
        a = arrays[0]
        return [a[:, :i, :].transpose(0, 2, 1), a[:, i:, :].transpose(0, 2, 1)]
    if k == "down":
        return [arrays[0].transpose(0, 2, 1)]
    if k == "experts":
        _same_dtype(rule.hf, arrays)
        return [np.stack([a.T for a in arrays])]
    raise AssertionError(k)


def _to_ours(rules: list[_Rule], tensors: Mapping[str, np.ndarray], source: str) -> Tree:
    flat: dict[str, np.ndarray] = {}
    for r in rules:
        arrays = []
        for key, shape in zip(r.hf, r.hf_shapes()):
            if key not in tensors:
                raise HFMappingError(f"{source}: missing tensor {key!r}")
            _check_shape(key, tensors[key], shape, source)
            arrays.append(np.asarray(tensors[key]))
        flat.update(zip(r.ours, _apply_to_ours(r, arrays)))
    return unflatten(flat)


def hf_to_layer(
    cfg: ModelConfig, layout: HFLayout, i: int, tensors: Mapping[str, np.ndarray], *, source: str = "checkpoint"
) -> Tree:
    """HF tensors of layer ``i`` (at least ``layer_rules(...)``'s keys) -> our per-layer dict.

    Leaves may be views of the HF arrays (transposes, row slices); dtypes are the source's.
    """
    return _to_ours(layer_rules(cfg, layout, i), tensors, source)


def hf_to_globals(
    cfg: ModelConfig, layout: HFLayout, tensors: Mapping[str, np.ndarray], *, source: str = "checkpoint"
) -> Tree:
    """HF embedding / final norm / head -> ``{"embed", "final_norm", "lm_head"?}``."""
    return _to_ours(global_rules(cfg, layout), tensors, source)


# --------------------------------------------------------------------------------------------
# ours -> HF
# --------------------------------------------------------------------------------------------


def _our_leaves(rules: list[_Rule], tree: Tree, where: str) -> dict[str, Any]:
    flat = flatten(tree)
    wanted = {k: sh for r in rules for k, sh in zip(r.ours, r.our_shapes)}
    missing = [k for k in wanted if k not in flat]
    if missing:
        raise HFMappingError(f"{where}: missing param {missing[0]!r}")
    extra = sorted(set(flat) - set(wanted))
    if extra:
        raise HFMappingError(f"{where}: params with no HF tensor: {extra}")
    for k, sh in wanted.items():
        if tuple(flat[k].shape) != sh:
            raise HFMappingError(f"{where}: param {k!r} has shape {tuple(flat[k].shape)}, expected {sh}")
    return flat


def _apply_to_hf(rule: _Rule, arrays: list[np.ndarray]) -> list[np.ndarray]:
    k = rule.kind
    if k == "copy":
        return [np.ascontiguousarray(arrays[0])]
    if k == "T":
        return [np.ascontiguousarray(arrays[0].T)]
    _same_dtype(rule.ours, arrays)
    if k == "rows":
        return [np.concatenate([a.T for a in arrays], axis=0)]
    if k == "conv":
        return [np.concatenate([a.T for a in arrays], axis=0)[:, None, :]]
    if k == "gate_up":
        return [np.concatenate([a.transpose(0, 2, 1) for a in arrays], axis=1)]
    if k == "down":
        return [np.ascontiguousarray(arrays[0].transpose(0, 2, 1))]
    if k == "experts":
        return [np.ascontiguousarray(e.T) for e in arrays[0]]
    raise AssertionError(k)


def _iter_to_hf(rules: list[_Rule], tree: Tree, where: str) -> Iterator[tuple[str, np.ndarray]]:
    flat = _our_leaves(rules, tree, where)
    for r in rules:
        arrays = [np.asarray(flat[k]) for k in r.ours]
        yield from zip(r.hf, _apply_to_hf(r, arrays))


def _to_hf(rules: list[_Rule], tree: Tree, where: str) -> list[tuple[str, np.ndarray]]:
    return list(_iter_to_hf(rules, tree, where))


def layer_to_hf(cfg: ModelConfig, layout: HFLayout, i: int, layer: Tree) -> list[tuple[str, np.ndarray]]:
    """Our per-layer dict of layer ``i`` -> ordered ``[(hf_key, array)]`` (C-contiguous arrays)."""
    return _to_hf(layer_rules(cfg, layout, i), layer, f"layer {i}")


def iter_layer_to_hf(cfg: ModelConfig, layout: HFLayout, i: int, layer: Tree) -> Iterator[tuple[str, np.ndarray]]:
    """`layer_to_hf` one HF tensor at a time, so a streaming writer never holds a converted copy of
    the whole layer (the input layer is validated on the first ``next``)."""
    return _iter_to_hf(layer_rules(cfg, layout, i), layer, f"layer {i}")


def globals_to_hf(cfg: ModelConfig, layout: HFLayout, globals_tree: Tree) -> list[tuple[str, np.ndarray]]:
    """Our globals (``embed``, ``final_norm``, ``lm_head``) -> ordered ``[(hf_key, array)]``."""
    return _to_hf(global_rules(cfg, layout), globals_tree, "globals")


def _specs(rules: list[_Rule], dtypes: Mapping[str, Any], where: str) -> list[tuple[str, Shape, np.dtype]]:
    out = []
    for r in rules:
        missing = [k for k in r.ours if k not in dtypes]
        if missing:
            raise HFMappingError(f"{where}: no dtype recorded for param {missing[0]!r}")
        dts = {np.dtype(dtypes[k]) for k in r.ours}
        if len(dts) > 1:
            raise HFMappingError(
                f"{where}: params {r.ours} share one HF tensor but have dtypes {sorted(map(str, dts))}"
            )
        dt = dts.pop()
        out.extend((k, sh, dt) for k, sh in zip(r.hf, r.hf_shapes()))
    return out


def layer_hf_specs(
    cfg: ModelConfig, layout: HFLayout, i: int, dtypes: Mapping[str, Any]
) -> list[tuple[str, Shape, np.dtype]]:
    """``[(hf_key, hf_shape, dtype)]`` that `layer_to_hf` will produce, from our flat-key dtypes
    (so a streaming writer can plan every shard before reading any data)."""
    return _specs(layer_rules(cfg, layout, i), dtypes, f"layer {i}")


def globals_hf_specs(
    cfg: ModelConfig, layout: HFLayout, dtypes: Mapping[str, Any]
) -> list[tuple[str, Shape, np.dtype]]:
    return _specs(global_rules(cfg, layout), dtypes, "globals")


__all__ = [
    "EXPERT_LAYOUTS", "FUSED", "HFLayout", "HFMappingError", "HUB_PREFIX", "LM_HEAD_KEY", "PER_EXPERT",
    "PLAIN_PREFIX", "TEXT_PREFIXES", "all_expected_keys", "check_tensor_names", "detect_layout",
    "expected_hf_shapes", "global_rules", "globals_hf_specs", "globals_to_hf", "hf_to_globals",
    "hf_to_layer", "iter_layer_to_hf", "layer_hf_specs", "layer_rules", "layer_to_hf",
]
