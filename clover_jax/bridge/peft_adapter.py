"""A LoRA run's adapters as a PEFT adapter dir (``adapter_config.json`` + ``adapter_model.safetensors``)
that ``peft.PeftModel.from_pretrained`` loads onto transformers' `Qwen3_5MoeForCausalLM` (numpy only).

Our adapter on a weight ``W [in, out]`` is ``a [in, r]``, ``b [r, out]``, update ``s a b`` with
``s = alpha / r`` (`clover_jax.model.lora`). PEFT's on a torch weight ``[out, in]`` is
``lora_A.weight [r, in]``, ``lora_B.weight [out, r]``, update ``(alpha / r) B A``. Per HF tensor of
the layer rules (`hf_rules.layer_rules`, plain prefix, fused experts), with ``M`` = the module's
state-dict prefix ``base_model.model.model.layers.{i}.`` ...:

==============================  ================================  =========================================
HF weight (rule)                PEFT keys                         from ours (rank)
==============================  ================================  =========================================
Linear ``[out, in]`` ("T")      ``M.lora_A.weight [r, in]``       ``a.T``; ``lora_B.weight [out, r]`` = ``b.T`` (r)
``linear_attn.in_proj_qkv``     ``M.lora_A.weight [3r, D]``       ``a_q.T | a_k.T | a_v.T`` stacked; B block-
  ("rows")                      ``M.lora_B.weight [C, 3r]``       diagonal ``b_q.T, b_k.T, b_v.T`` (3r)
``mlp.experts.gate_up_proj``    ``mlp.experts[.base_layer]``      per expert e: ``A_e = a_g[e].T | a_u[e].T``
  [E, 2I, D] ("gate_up")        ``.lora_A.weight [2r*E, D]``      [2r, D], ``B_e`` = block-diag ``b_g[e].T,
                                ``.lora_B.weight [2I, 2r*E]``     b_u[e].T`` [2I, 2r] (2r)
``mlp.experts.down_proj``       ``mlp.experts.lora_A.weight``     ``A_e = a_wo[e].T`` [r, I], ``B_e =
  [E, D, I] ("down")            [r*E, I], ``lora_B [D, r*E]``     b_wo[e].T`` [D, r] (r)
``mlp.gate.weight`` (router)    ``mlp.gate.lora_A.weight``        ``a.T`` / ``b.T`` (r): a 2-D target parameter
==============================  ================================  =========================================

A fused HF weight made of several of ours is one exact adapter of the summed rank: A stacked, B
block-diagonal (a part without an adapter gets zero blocks), and ``rank_pattern`` / ``alpha_pattern``
give it rank ``k r`` and alpha ``k alpha``, so its scale stays ``alpha / r``. The routed experts (and
the router, a plain `nn.Parameter` in transformers) are PEFT ``target_parameters`` (its
``lora.ParamWrapper``): a 3-D parameter ``[E, d1, d2]`` is read as in ``d2`` / out
``d1``; ``lora_A.weight`` rows are expert-major (row ``e * R + k`` = ``A_e[k]``), ``lora_B.weight``
columns rank-major (column ``k * E + e`` = ``B_e[:, k]``). Two targeted parameters of one module
nest: the first registered (``gate_up_proj``) sits under ``.base_layer``. (PEFT 0.21.2 warns that a
``rank_pattern`` / ``alpha_pattern`` key of a target parameter matched no module; it does apply it.)

Names in ``target_modules`` / ``target_parameters`` drop the ``model.`` prefix: ``self_attn.q_proj``
when every layer with that module has an adapter, ``layers.{i}.self_attn.q_proj`` per layer otherwise
(PEFT matches a name as a suffix at a dot), so they also fit a hub checkpoint's
``model.language_model.`` names; the state-dict keys are `Qwen3_5MoeForCausalLM`'s.

What a LoRA adapter cannot hold is refused (`PeftExportError`): a param trained in full beside the
adapters that transformers' model has (use the merged export). The Clover block-mode tensors trained
in full are not in transformers' Qwen3.5-MoE at all: left out, as the ``qwen`` export leaves them out,
and listed in the log and in the dir's `EXPORT_INFO_FILE`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from clover_jax.bridge import hf_clover as hc
from clover_jax.bridge.convert import EXPORT_INFO_FILE, check_writable_dir, finite_blocks
from clover_jax.bridge.hf_rules import FUSED, PLAIN_PREFIX, HFLayout, Rule, global_rules, layer_rules
from clover_jax.bridge.safetensors_io import CheckpointError, ShardedSafetensorsWriter
from clover_jax.bridge.staged_dir import staged_dir
from clover_jax.config import ModelConfig
from clover_jax.model.lora import adapter_pairs, is_adapter
from clover_jax.model.params import flatten, unstack_layers

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: state-dict prefix of a `PeftModel` around a causal LM (``base_model`` = LoraModel, ``.model`` = the LM)
PEFT_PREFIX = "base_model.model."
#: per-layer paths of the Clover block-mode tensors (not in transformers' Qwen3.5-MoE)
CLOVER_ONLY = (hc.OUR_SCALARS, *hc.OUR_RIGHT)
#: target parameters per HF module, in the module's registration order (= PEFT's nesting order)
_PARAM_ORDER = {"mlp.experts": ("gate_up_proj", "down_proj"), "mlp.gate": ("weight",)}
_LAYOUT = HFLayout(PLAIN_PREFIX, FUSED)  # the transformers model's own names and expert layout
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


class PeftExportError(CheckpointError):
    """A LoRA params tree that a PEFT LoRA adapter cannot express (the message says what and why)."""


@dataclass(frozen=True)
class _Target:
    """One PEFT-adapted HF weight: ``module`` (HF name without ``model.``, e.g. ``layers.0.mlp.experts``),
    ``param`` (None: the module is an `nn.Linear`; else a target parameter of it), its rank multiple
    ``parts`` (k of a fused weight) and the builder of ``(lora_A.weight, lora_B.weight)``."""

    module: str
    param: str | None
    parts: int
    shapes: tuple[tuple[int, ...], tuple[int, ...]]
    build: Callable[[], tuple[np.ndarray, np.ndarray]]

    @property
    def name(self) -> str:
        """What ``target_modules`` / ``target_parameters`` lists."""
        return self.module if self.param is None else f"{self.module}.{self.param}"


def _fused(parts: Sequence[tuple[Any, Any] | None], shapes: Sequence[tuple[int, ...]], r: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """``(A [..., k r, in], B [..., sum out_p, k r])`` of the fused weight whose p-th part is our
    ``W_p [..., in, out_p]`` (`shapes`) with adapter ``parts[p] = (a [..., in, r], b [..., r, out_p])``
    or None (zero blocks): ``B A`` stacks the parts' ``(a_p b_p)^T`` along out."""
    lead, d_in = shapes[0][:-2], shapes[0][-2]
    outs = [s[-1] for s in shapes]
    k = len(parts)
    a_all = np.zeros(lead + (k * r, d_in), np.float32)
    b_all = np.zeros(lead + (sum(outs), k * r), np.float32)
    row = 0
    for p, (pair, d_out) in enumerate(zip(parts, outs)):
        if pair is not None:
            a, b = (np.asarray(x, np.float32) for x in pair)
            a_all[..., p * r:(p + 1) * r, :] = np.swapaxes(a, -1, -2)
            b_all[..., row:row + d_out, p * r:(p + 1) * r] = np.swapaxes(b, -1, -2)
        row += d_out
    return a_all, b_all


def _experts_layout(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-expert ``A [E, R, in]``, ``B [E, out, R]`` -> ParamWrapper's ``lora_A.weight [E R, in]``
    (expert-major rows) and ``lora_B.weight [out, R E]`` (rank-major columns)."""
    e, rank, d_in = a.shape
    return a.reshape(e * rank, d_in), np.ascontiguousarray(np.transpose(b, (1, 2, 0))).reshape(b.shape[1], rank * e)


def _hf_module(rule: Rule) -> tuple[str, str | None]:
    """(module name without ``model.``, target parameter or None for an nn.Linear) of a rule's HF tensor."""
    name = rule.hf[0]
    name = name[len(PLAIN_PREFIX):] if name.startswith(PLAIN_PREFIX) else name
    module, _, leaf = name.rpartition(".")
    short = _LAYER_RE.sub(r"\2", module)
    return (module, leaf) if short in _PARAM_ORDER else (module, None)


def _rule_target(rule: Rule, pairs: Mapping[str, tuple[Any, Any]], r: int, where: str) -> _Target | None:
    """The PEFT target of one HF rule, None when none of its weights has an adapter."""
    hit = [pairs.get(o) for o in rule.ours]
    if not any(p is not None for p in hit):
        return None
    shapes = rule.our_shapes
    if rule.kind in ("T", "rows", "gate_up", "down"):  # the linear maps: one weight or several fused
        parts = len(rule.ours)
    else:
        bad = next(o for o, p in zip(rule.ours, hit) if p is not None)
        raise PeftExportError(f"{where}{bad}: an adapter on a weight whose HF tensor {rule.hf[0]!r} is not a "
                              f"linear map (rule {rule.kind!r}); a PEFT LoRA adapter cannot express it")
    module, param = _hf_module(rule)
    lead = shapes[0][:-2]
    d_in, d_out = shapes[0][-2], sum(s[-1] for s in shapes)
    if rule.kind in ("gate_up", "down"):
        e = lead[0]
        a_shape, b_shape = (e * parts * r, d_in), (d_out, parts * r * e)

        def build() -> tuple[np.ndarray, np.ndarray]:
            return _experts_layout(*_fused(hit, shapes, r))
    else:
        a_shape, b_shape = (parts * r, d_in), (d_out, parts * r)

        def build() -> tuple[np.ndarray, np.ndarray]:
            return _fused(hit, shapes, r)
    return _Target(module, param, parts, (a_shape, b_shape), build)


def adapter_targets(cfg: ModelConfig, params: Any) -> list[_Target]:
    """Every PEFT target of a LoRA model's stacked params tree (`CloverModel` layout, any leaves), in
    HF order: the layers, then the LM head. Fails on an adapter no HF rule covers."""
    r = cfg.lora_rank
    if r <= 0:
        raise PeftExportError("the model has no LoRA adapters (lora_rank 0): nothing to write as a PEFT adapter")
    per_layer = unstack_layers(cfg, params)
    targets: list[_Target] = []
    covered: set[str] = set()
    for i, layer in enumerate(per_layer["layers"]):
        pairs = adapter_pairs(layer)
        for rule in layer_rules(cfg, _LAYOUT, i):
            t = _rule_target(rule, pairs, r, f"layer {i}: ")
            if t is not None:
                targets.append(t)
            covered.update(rule.ours)
        left = sorted(set(pairs) - covered)
        if left:
            raise PeftExportError(f"layer {i}: adapter on {left[0]!r}, which maps to no HF weight")
    glob = adapter_pairs({k: v for k, v in per_layer.items() if k != "layers"})
    for rule in global_rules(cfg, _LAYOUT):
        t = _rule_target(rule, glob, r, "")
        if t is not None:
            targets.append(t)
        covered.update(rule.ours)
    left = sorted(set(glob) - covered)
    if left:
        raise PeftExportError(f"adapter on {left[0]!r}, which maps to no HF weight")
    if not targets:
        raise PeftExportError("the params hold no adapters (lora_a / lora_b leaves): not a LoRA run's params")
    return targets


def state_dict_keys(targets: Sequence[_Target]) -> list[tuple[_Target, str]]:
    """(target, key prefix before ``.lora_A.weight``) for each target, PEFT's state-dict names: a
    module's target parameters nest in registration order, the first registered deepest
    (``mlp.experts.base_layer.lora_A.weight`` is gate_up_proj's when down_proj is also targeted)."""
    params_of: dict[str, list[str]] = {}
    for t in targets:
        if t.param is not None:
            params_of.setdefault(t.module, []).append(t.param)
    out = []
    for t in targets:
        key = PEFT_PREFIX + (PLAIN_PREFIX if t.module.startswith("layers.") else "") + t.module
        if t.param is not None:
            order = [p for p in _PARAM_ORDER[_LAYER_RE.sub(r"\2", t.module)] if p in params_of[t.module]]
            key += ".base_layer" * (len(order) - 1 - order.index(t.param))
        out.append((t, key))
    return out


def _names(cfg: ModelConfig, targets: Sequence[_Target], param: bool) -> list[str]:
    """``target_modules`` (param False) or ``target_parameters``: the short layer-free name when
    every layer holding that HF weight has the adapter, else the per-layer names."""
    mine = [t.name for t in targets if (t.param is not None) == param]
    holders: dict[str, set[int]] = {}
    for i in range(cfg.num_hidden_layers):
        for rule in layer_rules(cfg, _LAYOUT, i):
            if rule.kind in ("T", "rows", "gate_up", "down"):
                module, p = _hf_module(rule)
                holders.setdefault(_LAYER_RE.sub(r"\2", module if p is None else f"{module}.{p}"), set()).add(i)
    by_short: dict[str, set[int]] = {}
    for n in mine:
        m = _LAYER_RE.match(n)
        if m:
            by_short.setdefault(m.group(2), set()).add(int(m.group(1)))
    out: list[str] = []
    for n in mine:
        m = _LAYER_RE.match(n)
        name = m.group(2) if m and by_short[m.group(2)] == holders.get(m.group(2)) else n
        if name not in out:
            out.append(name)
    return out


def adapter_config(cfg: ModelConfig, targets: Sequence[_Target], base_model: str | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` dict (PEFT `LoraConfig` fields; PEFT fills the rest with defaults)."""
    r, alpha = cfg.lora_rank, float(cfg.lora_alpha)
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    for t in targets:
        if t.parts > 1:
            key = _LAYER_RE.sub(r"\2", t.name)
            rank_pattern[key], alpha_pattern[key] = t.parts * r, t.parts * alpha
    params = _names(cfg, targets, param=True)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": r, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "target_modules": _names(cfg, targets, param=False), "target_parameters": params or None,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "modules_to_save": None,
    }


def check_full_trainable(paths: Iterable[str], full_trainable: Sequence[str]) -> list[str]:
    """The params trained in full (`full_trainable` regexes over params paths ``paths``; adapters
    aside) that the adapter leaves out: the Clover block-mode tensors. Any other such param is a
    `PeftExportError` (an adapter holds low-rank updates only)."""
    dropped = []
    for path in paths:
        if is_adapter(path):
            continue
        hit = next((p for p in full_trainable if re.search(p, path)), None)
        if hit is None:
            continue
        if path.endswith(CLOVER_ONLY):
            dropped.append(path)
            continue
        raise PeftExportError(
            f"lora.full_trainable {hit!r} trains {path!r} in full, and a PEFT LoRA adapter holds only low-rank "
            "updates: export the merged checkpoint instead (launch.py export without --adapters), or train that "
            "param through an adapter")
    return dropped


def write_peft_adapter(cfg: ModelConfig, params: Any, out: str | Path, *, full_trainable: Sequence[str] = (),
                       dtype: Any = "float32", base_model: str | None = None, overwrite: bool = False,
                       provenance: Mapping[str, Any] | None = None) -> Path:
    """Writes the PEFT adapter dir of a LoRA model's stacked params (host leaves: numpy) to
    ``out``, atomically (`staged_dir`); a non-empty ``out`` only with ``overwrite`` (replaced whole).
    Tensors in ``dtype`` (fp32 or bf16), built and written one at a time. ``full_trainable``: the
    run's `lora.full_trainable` (`check_full_trainable`); ``provenance`` (with the left-out tensors
    added) goes to `convert.EXPORT_INFO_FILE`."""
    out = Path(out)
    dropped = check_full_trainable(flatten(params), full_trainable)
    targets = adapter_targets(cfg, params)
    check_writable_dir(out, overwrite)
    dt = np.dtype(ml_dtypes.bfloat16) if str(dtype) == "bfloat16" else np.dtype(dtype)
    keyed = state_dict_keys(targets)
    plan = [(f"{k}.lora_{x}.weight", shape, dt) for t, k in keyed for x, shape in zip("AB", t.shapes)]
    with staged_dir(out) as tmp:
        with ShardedSafetensorsWriter(tmp, max_shard_bytes=1 << 62) as w:  # PEFT reads one file
            w.plan(plan)
            for t, k in keyed:
                for x, arr in zip("AB", t.build()):
                    key = f"{k}.lora_{x}.weight"
                    w.write_rows(key, finite_blocks(out, key, [arr.astype(dt)]))
        (tmp / "model.safetensors").rename(tmp / ADAPTER_WEIGHTS)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, targets, base_model), indent=2) + "\n")
        info = {**(provenance or {}), "format": "peft_lora", "left_out_trained_in_full": dropped}
        (tmp / EXPORT_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    n = sum(int(np.prod(s)) for t in targets for s in t.shapes)
    logger.info("wrote PEFT LoRA adapter %s: %d weights, %d params (%s)", out, len(targets), n, dt.name)
    if dropped:
        logger.info("%s: left out %d Clover block-mode tensors trained in full (not in transformers' Qwen3.5-MoE; "
                    "the merged clover export keeps them), e.g. %s", out, len(dropped), dropped[0])
    return out


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "CLOVER_ONLY", "PEFT_PREFIX", "PeftExportError", "adapter_config",
           "adapter_targets", "check_full_trainable", "state_dict_keys", "write_peft_adapter"]
