"""`SFTConfig`: the YAML recipe of `python launch.py sft --config F [k=v ...]` (docs/design.md 3.3, 6).

Sections (each a frozen dataclass, built by `clover_jax.yaml_config.from_tree`, so unknown keys and
bad types fail naming the key):

    model:      init_from (HF dir or Orbax params checkpoint) | preset (random init), plus any
                ModelConfig field as an override (mode, block_size, dtype, mask_token_id, ...);
                block_size_schedule: a block-size curriculum over training (`ModelSpec`)
    data:       sft.data.DataConfig (sources, seq_len, batch_size, eval_fraction, ...)
    data_root:  where relative source paths (and `hf.data_files`) live: a user setting, relative to the
                working directory (`~` and `$VARS` expanded), e.g. `data_root=/mnt/agent-data`;
                `check_data_root` says which source is missing and points to README "Getting the data"
    noise:      sft.noise.NoiseConfig          loss:  sft.loss.LossConfig
    eval:       EvalConfig (held-out masked-token loss at fixed noise levels)
    train, optimizer, checkpoint, logging:     the train.config sections
    export:     ExportConfig (HF export at the end)
    lora:       sft.lora.LoraConfig (low-rank adapters instead of full fine-tuning; rank 0: off)
    vocab_subset: sft.task_vocab.VocabSubsetConfig (a task-restricted vocabulary for tiny research
                models: the data tokenizer cut to the corpus's tokens, random init only)
    mesh:       clover_jax.parallel.sharding.MeshConfig; devices: use only the first N devices (tests)
    peak_flops_per_device, count_flops: the MFU denominator (None: a known chip's peak, else
                measured) and whether to count the step's FLOPs (a lowering of the unrolled stack)
    compile:    the AOT section of `launch.py compile` (train.aot), kept verbatim, unused by `sft`

Paths other than source paths (init_from, logging.run_dir, checkpoint.dir, export.dir) are relative
to the working directory. `checkpoint.dir` null means ``<logging.run_dir>/checkpoints``, `export.dir`
null ``<logging.run_dir>/hf_export``. Each of
them and `data_root` may be a URI (``gs://bucket/...``): `sft.remote` stages it through
`staging_dir` (a local folder).

The model section keeps its ModelConfig overrides apart (`ModelSpec.overrides`), because with
`init_from` the architecture comes from the checkpoint and only the overrides are ours. SFT trains
the block-diffusion model, so `mode` defaults to (and must be) ``block``.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

from clover_jax.config import ModelConfig, ModelConfigError, get_preset
from clover_jax.parallel.sharding import MeshConfig
from clover_jax.yaml_config import ConfigError, apply_overrides, deep_merge, from_tree, load_yaml_tree, to_tree
from sft.data.config import DataConfig
from sft.lora import LoraConfig
from sft.loss import LossConfig
from sft.noise import NoiseConfig, check_block_size_schedule
from sft.task_vocab import VocabSubsetConfig
from train.config import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainConfig, TrainerConfig

__all__ = ["DATA_README", "RESUME_MUST_MATCH", "DecodeEvalConfig", "EvalConfig", "ExportConfig", "ModelSpec", "SFTConfig", "check_data_root",
           "load_sft_config", "model_config_from"]

#: `datasets` builders that read local files: their `hf.data_files` resolve against data_root
LOCAL_BUILDERS = ("json", "parquet", "csv", "text", "arrow")

#: where a user learns how to fetch the agent mix (named in data_root errors)
DATA_README = 'README.md, section "Getting the data"'

_SPEC_KEYS = ("init_from", "preset", "generate_missing", "seed", "block_size_schedule")

#: what a resumed checkpoint's stored config must equal (the same experiment: `train.config_diff`);
#: train.steps, logging, checkpoint cadence, export, eval, mesh may change (`train.resume: force`: all)
RESUME_MUST_MATCH = ("model", "data", "optimizer", "noise", "loss", "vocab_subset", "lora", "train.micro_batches",
                     "train.seed")


@dataclass(frozen=True)
class ModelSpec:
    """Where the weights come from.

    init_from: an HF dir (Qwen3.6 or Clover; `load_hf(..., mode="block")`) or an Orbax params
      checkpoint (`launch.py convert` output); None = random init of `preset`.
    preset: the architecture of a random init (`clover_jax.config.PRESETS`).
    generate_missing: when `init_from` does not exist, write a random `preset` checkpoint there first
      (hub-style HF dir with the Qwen3.6 tokenizer, as the demo does): the embedded default. Only
      inside `logging.run_dir`: a missing `init_from` elsewhere is an error (a mistyped checkpoint
      path never becomes a random model).
    seed: seed of random inits. overrides: ModelConfig fields set on top (see module docstring).
    block_size_schedule: a block-size curriculum, stages ``[[fraction, block size], ...]``: update s
      of `train.steps` trains at the size of the last stage whose fraction f has started
      (s >= ceil(f * train.steps); `sft.noise.scheduled_block_size`), e.g. ``[[0, 4], [0.25, 8],
      [0.5, 16], [0.75, 32]]``. Fractions start at 0 and increase; each size divides `data.seq_len`
      and is listed in `model.block_size` (the sizes compiled, once each, and aligned to). None: a
      list `block_size` draws one size per update (`sft.noise.draw_block_size`). The stages are
      fractions of `train.steps`, as the learning-rate schedule is: a resume under other
      `train.steps` moves the stages not yet reached.
    """

    init_from: str | None = None
    preset: str | None = None
    generate_missing: bool = False
    seed: int = 0
    block_size_schedule: tuple[tuple[float, int], ...] | None = None
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DecodeEvalConfig:
    """Block decoding of held-out prompts during training (`sft.decode_eval`), every `every` steps
    (0: off; a multiple of `train.eval_every`, since it runs at eval steps: none with
    `train.eval_every` 0). The prompts: the first
    `prompts` chat records of the eval split that offer tools and have an assistant turn, or of
    `prompts_file` (JSONL chat records; records without an assistant turn are skipped). Decoded in
    threshold mode at `block_size` (None: the model's first block size) and `threshold`, and AR
    greedy as the baseline, each up to `max_new_tokens` tokens, in one fixed-shape batch (compiled
    once per run). Logged as ``decode/<metric>``."""

    every: int = 0
    prompts: int = 4
    block_size: int | None = None
    threshold: float = 0.95  # clover_jax.decoding.generator.DecodeConfig's default
    max_new_tokens: int = 64
    prompts_file: str | None = None

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"eval.decode.every must be >= 0 (0: off), got {self.every}")
        if self.prompts < 1:
            raise ConfigError(f"eval.decode.prompts must be >= 1, got {self.prompts}")
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError(f"eval.decode.block_size must be >= 1 or null, got {self.block_size}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"eval.decode.threshold must be in [0, 1], got {self.threshold}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"eval.decode.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class EvalConfig:
    """Held-out eval every `train.eval_every` steps: masked-token CE/accuracy with every block at
    each fixed noise level of `t_values` (one copy: no complement, which would be at 1 - t), over at
    most `max_batches` batches of the eval split (kept in memory); at `block_size` (None: the
    model's first block size). Logged as ``eval/ce_t<t>``, ``eval/acc_t<t>``; ``eval/loss`` is the
    mean CE over the levels. `decode`: decode quality of held-out prompts (`DecodeEvalConfig`)."""

    t_values: tuple[float, ...] = (0.25, 0.5, 0.75)
    max_batches: int = 4
    block_size: int | None = None
    decode: DecodeEvalConfig = field(default_factory=DecodeEvalConfig)

    def __post_init__(self) -> None:
        if not self.t_values or any(not 0.0 < t <= 1.0 for t in self.t_values):
            raise ConfigError(f"eval.t_values must be non-empty levels in (0, 1], got {self.t_values}")
        if self.max_batches < 1:
            raise ConfigError(f"eval.max_batches must be >= 1, got {self.max_batches}")


@dataclass(frozen=True)
class ExportConfig:
    """HF export after the last step when `enabled` (`format: clover` keeps the block-diffusion
    tensors and writes the tokenizer with the mask token; `qwen` drops them), into `dir` (null:
    ``<logging.run_dir>/hf_export``). The folder is written whole and atomically. A non-empty `dir`
    is replaced only when it is this run's own earlier export (its ``clover_export.json`` names the
    same run dir: a rerun that resumes from its final checkpoint exports again) or with
    `overwrite: true`; anything else is refused before training starts. `adapters` (LoRA runs only):
    also the adapters as a PEFT LoRA adapter dir, ``<logging.run_dir>/adapter`` (`sft.adapter_export`)."""

    enabled: bool = True
    dir: str | None = None
    format: Literal["clover", "qwen"] = "clover"
    # the Clover tensors' names (clover_jax.bridge.hf_clover): split = the four per GDN layer that
    # llama.cpp's Clover converter reads; packed = the two of the other public naming
    clover_naming: Literal["split", "packed"] = "split"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    overwrite: bool = False
    adapters: bool = False


@dataclass(frozen=True)
class SFTConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataConfig = field(default_factory=DataConfig)
    data_root: str | None = None
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    vocab_subset: VocabSubsetConfig = field(default_factory=VocabSubsetConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    devices: int | None = None
    peak_flops_per_device: float | None = None  # None: a known chip's bf16 peak, else measured (CPU)
    count_flops: bool = True  # XLA's FLOP count of the step for MFU (lowers the unrolled stack once)
    compile: dict[str, Any] = field(default_factory=dict)  # `launch.py compile`'s section; unused here
    staging_dir: str = "~/.cache/clover_jax/staging"  # local copies of remote inputs / outputs (sft.remote)

    def __post_init__(self) -> None:
        if self.export.adapters and not self.lora.enabled:
            raise ConfigError("export.adapters: true writes a LoRA run's adapters, and this run has none "
                              "(lora.rank 0); set lora.rank > 0 or export.adapters: false")
        if self.loss.weighting == "inverse_t" and self.loss.normalization == "token" and not self.noise.complementary:
            # token normalisation divides by the masked count; only with the complementary pair is it
            # the (fixed) maskable count, which makes the 1/t-weighted mean the ELBO
            raise ConfigError("loss.normalization: token with loss.weighting: inverse_t is the ELBO only with "
                              "noise.complementary: true (it divides by the random masked count); use "
                              "loss.normalization: batch, or turn noise.complementary on")
        every, eval_every = self.eval.decode.every, self.train.eval_every
        if every and eval_every and every % eval_every:  # train.eval_every 0: no evals, so no decode evals
            raise ConfigError(f"eval.decode.every {every} must be a multiple of train.eval_every {eval_every} "
                              "(decode evals run at eval steps)")

    @property
    def checkpoint_dir(self) -> str:
        from train.remote import join

        return self.checkpoint.dir or join(self.logging.run_dir, "checkpoints")

    @property
    def export_dir(self) -> str | None:
        """Where the end-of-run export goes: `export.dir`, null = ``<logging.run_dir>/hf_export``;
        None when `export.enabled` is false."""
        from train.remote import join

        if not self.export.enabled:
            return None
        return self.export.dir or join(self.logging.run_dir, "hf_export")

    def trainer_config(self) -> TrainerConfig:
        return TrainerConfig(train=self.train, optimizer=self.optimizer,
                             checkpoint=dataclasses.replace(self.checkpoint, dir=self.checkpoint_dir),
                             logging=self.logging)


def _split_model_section(model: Any, where: str) -> dict[str, Any]:
    """YAML `model:` (spec keys + ModelConfig fields side by side) -> ModelSpec tree."""
    if model is None:
        return {}
    if not isinstance(model, dict):
        raise ConfigError(f"{where}: model: expected a mapping, got {model!r}")
    if "overrides" in model:
        raise ConfigError(f"{where}: model.overrides: write ModelConfig fields directly under model "
                          "(e.g. model.block_size: 32)")
    spec = {k: model[k] for k in _SPEC_KEYS if k in model}
    over = {k: v for k, v in model.items() if k not in _SPEC_KEYS}
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for k in over:
        if k not in fields:
            import difflib

            near = difflib.get_close_matches(k, sorted(fields | set(_SPEC_KEYS)), n=1, cutoff=0.6)
            hint = f"did you mean 'model.{near[0]}'?" if near else "see clover_jax.config.ModelConfig"
            raise ConfigError(f"{where}: unknown key 'model.{k}' ({hint})")
    mode = over.get("mode", "block")
    if mode != "block":
        raise ConfigError(f"{where}: model.mode: SFT trains the block-diffusion model, so mode must be "
                          f"'block', got {mode!r}")
    spec["overrides"] = over
    return spec


def _resolve_sources(data: dict[str, Any], root: Path | str | None) -> dict[str, Any]:
    """Relative source paths (and `hf.data_files`) joined to `root` (a local dir or a URI)."""
    if root is None or not isinstance(data.get("sources"), list):
        return data
    from train.remote import is_remote, join as join_path

    join = lambda p: p if Path(p).is_absolute() or is_remote(p) else join_path(str(root), p)  # noqa: E731
    sources = []
    for s in data["sources"]:
        if isinstance(s, dict):
            s = dict(s)
            if isinstance(s.get("path"), str):
                s["path"] = join(s["path"])
            hf = s.get("hf")
            # a hub dataset's data_files are paths inside its repository: only local builders' join
            if isinstance(hf, dict) and hf.get("path") in LOCAL_BUILDERS and isinstance(hf.get("data_files"), (str, list)):
                files = hf["data_files"]
                hf = {**hf, "data_files": join(files) if isinstance(files, str) else [join(f) for f in files]}
                s["hf"] = hf
        sources.append(s)
    return {**data, "sources": sources}


def load_sft_config(path: str | Path | None, overrides: Sequence[str] = ()) -> SFTConfig:
    """YAML (with `base_config` includes) + dotted overrides -> SFTConfig; errors name the file/key."""
    tree = load_yaml_tree(path) if path is not None else {}
    tree = apply_overrides(tree, list(overrides))
    where = (str(path) if path is not None else "config") + (" + overrides" if overrides else "")
    tree = dict(tree)
    tree["model"] = _split_model_section(tree.get("model"), where)
    root = tree.get("data_root")
    if root is not None:
        if not isinstance(root, str):
            raise ConfigError(f"{where}: data_root: expected a path string, got {root!r}")
        from train.remote import is_remote

        # a URI stays one: `sft.remote.localize` stages it and maps the sources to the copy
        root_path = root if is_remote(root) else Path(os.path.expandvars(os.path.expanduser(root))).resolve()
        tree["data_root"] = str(root_path)
        if isinstance(tree.get("data"), dict):
            tree["data"] = _resolve_sources(tree["data"], root_path)
    try:
        cfg = from_tree(SFTConfig, tree, where=where)
    except ModelConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if cfg.devices is not None and cfg.devices < 1:
        raise ConfigError(f"{where}: devices must be >= 1 or null, got {cfg.devices}")
    if cfg.model.init_from is None and cfg.model.preset is None:
        raise ConfigError(f"{where}: model: set model.init_from (HF dir or Orbax checkpoint) or model.preset "
                          "(random init)")
    if cfg.model.generate_missing and (cfg.model.preset is None or cfg.model.init_from is None):
        raise ConfigError(f"{where}: model.generate_missing needs both model.init_from and model.preset")
    if cfg.vocab_subset.enabled and cfg.model.init_from is not None:
        raise ConfigError(f"{where}: vocab_subset.enabled needs a random init (model.preset, no model.init_from): "
                          "a checkpoint's embedding rows are numbered by the full vocabulary")
    mcfg = model_config_from(cfg.model, None)  # type-check the overrides now, not after loading 70 GB
    if cfg.model.block_size_schedule is not None:
        # the sizes are known now unless they come from the init checkpoint (checked again when it is read)
        known = cfg.model.init_from is None or "block_size" in cfg.model.overrides
        check_block_size_schedule(cfg.model.block_size_schedule, seq_len=cfg.data.seq_len,
                                  block_sizes=mcfg.block_sizes if known else None,
                                  where=f"{where}: model.block_size_schedule")
    return cfg


def check_data_root(cfg: SFTConfig) -> None:
    """ConfigError naming every source whose files under `data_root` are missing (a path that does
    not exist, a glob that matches nothing), the data_root itself when it is missing, and the README
    section that says how to fetch them. Sources outside data_root are left to the source loader."""
    if cfg.data_root is None:
        return
    root = Path(cfg.data_root)
    missing = []
    for s in cfg.data.sources:
        files = [s.path] if s.path is not None else []
        hf = (s.hf or {}).get("data_files")
        files += [hf] if isinstance(hf, str) else list(hf) if isinstance(hf, (list, tuple)) else []
        for f in files:
            if not Path(f).is_relative_to(root):
                continue
            if not (glob.glob(f, recursive=True) if glob.has_magic(f) else Path(f).exists()):
                missing.append(f"{s.name} ({Path(f).relative_to(root)})")
    if not missing:
        return
    what = (f"data_root {root} does not exist" if not root.is_dir()
            else f"data_root {root} lacks the files of {len(missing)} source(s)")
    raise ConfigError(f"{what}: {', '.join(missing)}. Point data_root at your copy of the data "
                      f"(data_root=/path/to/agent-data) or fetch it as {DATA_README} says")


def model_config_from(spec: ModelSpec, base: ModelConfig | None) -> ModelConfig:
    """The run's ModelConfig: `base` (a checkpoint's config) or the preset (or defaults), with the
    overrides on top; fewer layers of a preset repeat its layer pattern. Errors are ConfigErrors."""
    try:
        if base is None:
            base = get_preset(spec.preset) if spec.preset is not None else ModelConfig()
        over = {"mode": "block", **spec.overrides}
        tree = to_tree(base)
        if "num_hidden_layers" in over and "layer_types" not in over:
            n, p = int(over["num_hidden_layers"]), base.group_size
            tree["layer_types"] = list(base.layer_types[:p]) * (n // p) if n % p == 0 else []
        return from_tree(ModelConfig, deep_merge(tree, over), where="model")
    except ModelConfigError as e:
        raise ConfigError(f"model: {e}") from None
