"""The top-level run config of `launch.py`: YAML (with `base_config:` includes) + dotted overrides
-> frozen dataclasses. `model.preset: NAME` starts the model section from a preset of
`clover_jax.config.PRESETS`; the other `model.*` keys override its fields.

Sections: `model`, `demo`, `mesh` (clover_jax.parallel.sharding.MeshConfig) and `compile` (`CompileConfig`, what
`launch.py compile` plans for a plain run config; an SFT recipe has its own sections, see sft.config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

from clover_jax.parallel import remat
from clover_jax.config import ModelConfig, ModelConfigError, get_preset
from clover_jax.parallel.sharding import MeshConfig
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
class CompileConfig:
    """The `compile:` section: what to plan. `micro_batch` is global rows per step (one micro-batch
    of gradient accumulation); -1 = one row per batch shard of the mesh. For an SFT recipe only
    `topology` and `remat` apply (batch, length and CE chunk are the recipe's data / loss fields)."""

    topology: str = "v5p-64"
    seq_len: int = 8192
    micro_batch: int = -1
    remat: str = "full"
    loss_chunk: int = 2048  # tokens per lm_head + CE chunk
    lb_coef: float | None = None  # MoE lb-loss weight; None = model.router_aux_loss_coef

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.loss_chunk < 1:
            raise ConfigError(f"compile.seq_len and compile.loss_chunk must be positive, got {self.seq_len}, {self.loss_chunk}")
        if self.micro_batch == 0 or self.micro_batch < -1:
            raise ConfigError(f"compile.micro_batch must be positive or -1, got {self.micro_batch}")
        try:
            remat.resolve(self.remat)
        except ValueError as e:
            raise ConfigError(f"compile.remat: {e}") from None


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)


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
