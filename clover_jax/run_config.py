"""The top-level run config of `launch.py`: YAML (with `base_config:` includes) + dotted overrides
-> frozen dataclasses. `model.preset: NAME` starts the model section from a preset of
`clover_jax.config.PRESETS`; the other `model.*` keys override its fields.

Later issues add their sections (train, data, checkpoint, decode, mesh) here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

from clover_jax.config import ModelConfig, ModelConfigError, get_preset
from clover_jax.yaml_config import ConfigError, apply_overrides, deep_merge, from_tree, load_yaml_tree, to_tree


@dataclass(frozen=True)
class DemoConfig:
    """The embedded default job (until SFT lands): build a tiny Qwen3.6-shaped HF checkpoint with the
    real tokenizer, convert it to Orbax, export it back, verify, and decode a prompt."""

    out_dir: str = "runs/demo"
    seed: int = 0
    weights_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    expert_layout: Literal["fused", "per_expert"] = "fused"
    prefix: str = "model.language_model."
    prompt: str = "What is the weather in Paris today?"
    max_new_tokens: int = 12
    overwrite: bool = True


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)


def load_run_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """YAML file (or only defaults when None) + `a.b=c` overrides -> RunConfig. Errors name the file
    or the key (with the nearest valid key for typos)."""
    tree = load_yaml_tree(path) if path else {}
    tree = apply_overrides(tree, list(overrides))
    model = dict(tree.get("model") or {})
    preset = model.pop("preset", None)
    try:
        base = get_preset(str(preset)) if preset is not None else ModelConfig()
    except ModelConfigError as e:
        raise ConfigError(f"{path or 'overrides'}: model.preset: {e}") from None
    base_tree = to_tree(base)
    if "num_hidden_layers" in model and "layer_types" not in model:
        # fewer (or more) layers of a preset: repeat its layer pattern, as HF derives it
        n, p = int(model["num_hidden_layers"]), base.group_size
        base_tree["layer_types"] = list(base.layer_types[:p]) * (n // p) if n % p == 0 else []
    if preset is not None or model:
        model = deep_merge(base_tree, model)
    if model or "model" in tree:
        tree = {**tree, "model": model}
    try:
        return from_tree(RunConfig, tree, where=str(path) if path else "config")
    except ModelConfigError as e:
        raise ConfigError(f"{path or 'config'}: model: {e}") from None
