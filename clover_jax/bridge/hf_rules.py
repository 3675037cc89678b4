"""Names of the HF Qwen3.5/3.6-MoE (and Clover) text tensors: the layout of a checkpoint, and one
rule per HF tensor group saying which of our per-layer leaves it becomes (`hf_keys.py` applies them).

A rule's HF shapes are derived from our shapes (`params.layer_param_shapes`), so the config is the
single source of truth; `check_tensor_names` / `check_hf_shapes` validate a whole checkpoint's
names and headers against it before any data is read. Logs under ``clover_jax.bridge.hf_keys``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from clover_jax.bridge import hf_clover as hc
from clover_jax.config import FULL, ModelConfig
from clover_jax.bridge.hf_clover import HFMappingError
from clover_jax.model.params import flatten, global_param_shapes, layer_param_shapes

logger = logging.getLogger("clover_jax.bridge.hf_keys")  # one logger for the whole HF mapping

HUB_PREFIX = "model.language_model."
PLAIN_PREFIX = "model."
TEXT_PREFIXES = (HUB_PREFIX, PLAIN_PREFIX)
FUSED = "fused"
PER_EXPERT = "per_expert"
EXPERT_LAYOUTS = (FUSED, PER_EXPERT)
LM_HEAD_KEY = "lm_head.weight"

Shape = tuple[int, ...]


@dataclass(frozen=True)
class HFLayout:
    """How a checkpoint names its text tensors: the key prefix, the routed-expert layout, whether
    its GDN layers carry the Clover block-diffusion tensors, and in which of the two namings
    (`hf_clover`: ``split``, what llama.cpp's Clover converter reads and our default export writes,
    or ``packed``)."""

    prefix: str = PLAIN_PREFIX
    expert_layout: str = PER_EXPERT
    clover: bool = False
    clover_naming: str = hc.SPLIT

    def __post_init__(self) -> None:
        if self.prefix not in TEXT_PREFIXES:
            raise HFMappingError(f"unknown HF prefix {self.prefix!r} (supported: {TEXT_PREFIXES})")
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise HFMappingError(
                f"unknown expert layout {self.expert_layout!r} (supported: {EXPERT_LAYOUTS})"
            )
        hc.scalar_names(self.clover_naming)  # fails naming an unknown naming


# --------------------------------------------------------------------------------------------
# Detection and skipping
# --------------------------------------------------------------------------------------------

_TEXT_MODULES = ("layers", "embed_tokens", "norm", "rotary_emb")
_FUSED_RE = re.compile(r"layers\.\d+\.mlp\.experts\.gate_up_proj$")
_PER_EXPERT_RE = re.compile(r"layers\.\d+\.mlp\.experts\.\d+\.")
_CLOVER_RES = {naming: re.compile(r"layers\.\d+\.linear_attn\.(%s)$" % "|".join(
    hc.scalar_names(naming) + (hc.right_name(naming),))) for naming in hc.NAMINGS}


def _clover_name(key: str) -> str | None:
    """The Clover naming a tensor name belongs to, None for any other tensor."""
    return next((n for n, r in _CLOVER_RES.items() if r.search(key)), None)


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
    ``layout.clover`` is true if any GDN layer has a Clover tensor (`check_tensor_names` then wants
    all of its naming in every GDN layer); a checkpoint with tensors of both namings fails, naming one
    of each.
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
    found: dict[str, str] = {}
    for k in body:
        naming = _clover_name(k)
        if naming is not None:
            found.setdefault(naming, prefix + k)
    if len(found) > 1:
        raise HFMappingError(f"{source}: Clover block-diffusion tensors in both namings: "
                             f"{found[hc.SPLIT]!r} (split) and {found[hc.PACKED]!r} (packed); keep one")
    naming = next(iter(found), hc.SPLIT)
    return HFLayout(prefix, FUSED if fused else PER_EXPERT, bool(found), naming), text_keys


# --------------------------------------------------------------------------------------------
# Rules: one HF tensor group <-> one group of our leaves
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """``kind`` says how ``hf`` keys (HF shapes derived from ours) map to ``ours`` flat keys.

    The Clover kinds (``bd_scalars``: one packed HF tensor or the three split ones; ``bd_right``)
    may have an empty side: ``hf == ()`` (not in the
    checkpoint: read fills ``init`` / zeros, write drops) or ``ours == ()`` (not in the model: read
    drops, write fills). ``our_shapes`` is always given; a filled side takes the dtype of ``like``
    (the conv1d weight / our conv kernel) or, for the scalars, fp32."""

    kind: str  # copy | T | rows (qkv) | conv | gate_up | down | experts | bd_scalars | bd_right
    hf: tuple[str, ...]
    ours: tuple[str, ...]
    our_shapes: tuple[Shape, ...]
    init: tuple[float, ...] = ()
    like: str = ""

    def hf_shapes(self) -> list[Shape]:
        s = self.our_shapes
        if self.kind in ("bd_scalars", "bd_right"):
            return [self.accepted_hf_shapes()[0]] * len(self.hf)
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

    def accepted_hf_shapes(self) -> list[Shape]:
        """Shapes a reader accepts for each of this rule's HF tensors (a rule of one HF tensor, or the
        split Clover scalars), canonical first."""
        if self.kind == "bd_scalars":
            return hc.hf_scalar_shapes(self.our_shapes[0][0], hc.PACKED if len(self.hf) == 1 else hc.SPLIT)
        if self.kind == "bd_right":
            return hc.hf_right_shapes(self.our_shapes)
        return self.hf_shapes()[:1]


def _linear(kind: str, hf: str, ours: str, shapes: Mapping[str, Shape]) -> Rule:
    return Rule(kind, (hf,), (ours,), (shapes[ours],))


def global_rules(cfg: ModelConfig, layout: HFLayout) -> list[Rule]:
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


def layer_rules(cfg: ModelConfig, layout: HFLayout, i: int) -> list[Rule]:
    """The rules of decoder layer ``i`` in HF module order (which is also our write order)."""
    s = _leaf_shapes(flatten(layer_param_shapes(cfg, i)))
    p = f"{layout.prefix}layers.{i}."
    rules: list[Rule] = []
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
            Rule("conv", (g + "conv1d.weight",), conv, tuple(s[k] for k in conv)),
            _linear("copy", g + "norm.weight", "gdn.norm.scale", s),
            _linear("T", g + "out_proj.weight", "gdn.out_proj.kernel", s),
            Rule("rows", (g + "in_proj_qkv.weight",), qkv, tuple(s[k] for k in qkv)),
            _linear("T", g + "in_proj_z.weight", "gdn.in_proj_z.kernel", s),
            _linear("T", g + "in_proj_b.weight", "gdn.in_proj_b.kernel", s),
            _linear("T", g + "in_proj_a.weight", "gdn.in_proj_a.kernel", s),
        ]
        rules += _clover_rules(cfg, layout, g)
    m = p + "mlp."
    rules.append(_linear("T", m + "gate.weight", "moe.router.kernel", s))
    if layout.expert_layout == FUSED:
        rules += [
            Rule("gate_up", (m + "experts.gate_up_proj",), ("moe.wi_gate", "moe.wi_up"),
                  (s["moe.wi_gate"], s["moe.wi_up"])),
            _linear("down", m + "experts.down_proj", "moe.wo", s),
        ]
    else:
        e = cfg.num_experts
        for hf_name, ours in (("gate_proj", "moe.wi_gate"), ("up_proj", "moe.wi_up"), ("down_proj", "moe.wo")):
            keys = tuple(f"{m}experts.{j}.{hf_name}.weight" for j in range(e))
            rules.append(Rule("experts", keys, (ours,), (s[ours],)))
    for n in ("gate_proj", "up_proj", "down_proj"):
        rules.append(_linear("T", f"{m}shared_expert.{n}.weight", f"moe.shared_{n}.kernel", s))
    rules.append(_linear("T", m + "shared_expert_gate.weight", "moe.shared_gate.kernel", s))
    rules += [
        _linear("copy", p + "input_layernorm.weight", "input_norm.scale", s),
        _linear("copy", p + "post_attention_layernorm.weight", "post_norm.scale", s),
    ]
    return rules


def _clover_rules(cfg: ModelConfig, layout: HFLayout, g: str) -> list[Rule]:
    """The two Clover rules of a GDN layer (``g`` = its ``linear_attn.`` prefix; HF names in
    ``layout.clover_naming``); none if neither the checkpoint side (``layout.clover``) nor ours
    (block mode) has the tensors."""
    ours, hf = cfg.mode == "block", layout.clover
    if not (ours or hf):
        return []
    sc_shape, right_shapes = hc.our_shapes(cfg)
    return [
        Rule("bd_scalars", tuple(g + n for n in hc.scalar_names(layout.clover_naming)) if hf else (), (hc.OUR_SCALARS,) if ours else (), (sc_shape,),
              init=cfg.bd_scalar_init),
        Rule("bd_right", (g + hc.right_name(layout.clover_naming),) if hf else (), hc.OUR_RIGHT if ours else (), right_shapes,
              like="gdn.conv_q.kernel" if hf else g + "conv1d.weight"),
    ]


def expected_hf_shapes(rules: Iterable[Rule]) -> dict[str, Shape]:
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


def check_hf_shapes(
    cfg: ModelConfig, layout: HFLayout, shape_of: Callable[[str], Shape], *,
    source: str = "checkpoint", file_of: Callable[[str], Any] | None = None,
) -> None:
    """Every expected HF tensor has an accepted shape (`shape_of(key)`, e.g. from safetensors
    headers); fails naming the tensor (and its file, with ``file_of``), its shape and what fits."""
    rules = global_rules(cfg, layout)
    for i in range(cfg.num_hidden_layers):
        rules += layer_rules(cfg, layout, i)
    for r in rules:
        for key, shape in zip(r.hf, r.hf_shapes()):
            accepted = r.accepted_hf_shapes() if len(r.hf) == 1 or r.kind == "bd_scalars" else [shape]
            got = tuple(shape_of(key))
            if got not in accepted:
                raise hc.shape_error(key, got, accepted, str(file_of(key)) if file_of else source)


def check_tensor_names(
    cfg: ModelConfig, layout: HFLayout, text_keys: Iterable[str], *, source: str = "checkpoint"
) -> None:
    """Fails on the first missing HF tensor (named) and on any unexpected text tensor (all named)."""
    present = set(text_keys)
    expected = all_expected_keys(cfg, layout)
    missing = [k for k in expected if k not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        why = ""
        if layout.clover and _clover_name(missing[0]):
            has = next(k for k in sorted(present) if _clover_name(k))
            why = f": the checkpoint has Clover block-diffusion tensors in other GDN layers (e.g. {has!r})"
        raise HFMappingError(f"{source}: missing tensor {missing[0]!r}{more}{why}")
    extra = sorted(present - set(expected))
    if cfg.tie_word_embeddings and LM_HEAD_KEY in extra:
        # a tied checkpoint may still carry the (identical) head; the embedding is the one we keep
        logger.info("%s: tie_word_embeddings=true, ignoring %r", source, LM_HEAD_KEY)
        extra.remove(LM_HEAD_KEY)
    if extra:
        shown = ", ".join(repr(k) for k in extra[:8]) + (f" ... ({len(extra)} in all)" if len(extra) > 8 else "")
        raise HFMappingError(f"{source}: unexpected tensors not in the config's model: {shown}")


__all__ = [
    "EXPERT_LAYOUTS", "FUSED", "HFLayout", "HFMappingError", "HUB_PREFIX", "LM_HEAD_KEY", "PER_EXPERT",
    "PLAIN_PREFIX", "Rule", "Shape", "TEXT_PREFIXES", "all_expected_keys", "check_hf_shapes", "check_tensor_names",
    "detect_layout", "expected_hf_shapes", "global_rules", "layer_rules",
]
