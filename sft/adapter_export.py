"""A LoRA run's adapters as a PEFT LoRA adapter dir (`clover_jax.bridge.peft_adapter`): at the end
of the run with `export.adapters` (into ``<logging.run_dir>/adapter``), or from a training checkpoint
(`launch.py export --adapters`).

The dir is written whole and atomically, in `export.dtype`, and records the run and step in its
``clover_export.json``, so the replacing rules of the HF export hold (`sft.export.check_export_target`:
a rerun of the same run replaces its own adapter, another folder needs `export.overwrite`). Whether
the adapter can hold the run (`lora.full_trainable` only on the Clover block-mode tensors, which it
leaves out as the ``qwen`` export does) is checked before training starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from clover_jax.config import ModelConfig
from clover_jax.yaml_config import ConfigError
from sft.config import SFTConfig

__all__ = ["ADAPTER_DIR", "adapter_dir", "check_adapter_export", "export_adapter"]

ADAPTER_DIR = "adapter"


def adapter_dir(cfg: SFTConfig) -> str:
    """``<logging.run_dir>/adapter``: where `export.adapters` writes."""
    from train.remote import join

    return join(cfg.logging.run_dir, ADAPTER_DIR)


def check_adapter_export(cfg: SFTConfig, param_paths: Iterable[str], out: str | Path | None = None) -> None:
    """Before training: the run has adapters, a PEFT adapter can hold what it trains (``param_paths``:
    the run's params paths), and ``out`` (default `adapter_dir`) may be written. ConfigError otherwise."""
    from clover_jax.bridge.peft_adapter import PeftExportError, check_full_trainable
    from sft.export import check_export_target

    if not cfg.lora.enabled:
        raise ConfigError("a PEFT adapter export needs a LoRA run (lora.rank > 0); this run trains in full: "
                          "export the HF checkpoint instead")
    try:
        check_full_trainable(param_paths, cfg.lora.full_trainable)
    except PeftExportError as e:
        raise ConfigError(f"export.adapters: {e}") from None
    check_export_target(cfg, adapter_dir(cfg) if out is None else out)


def export_adapter(cfg: SFTConfig, model_cfg: ModelConfig, params: Any, step: int, *,
                   out: str | Path | None = None, overwrite: bool | None = None) -> Path:
    """The PEFT adapter of the run's LoRA ``params`` (stacked, any device or host) after ``step``
    updates into ``out`` (default `adapter_dir`), in `export.dtype`. ``overwrite`` None: the
    recipe's replacing rules; a bool: the writer's plain rule (as `launch.py export` has it)."""
    import jax

    from clover_jax.bridge.peft_adapter import write_peft_adapter
    from sft.export import check_export_target, run_provenance

    out = Path(adapter_dir(cfg) if out is None else out)
    replace = check_export_target(cfg, out) if overwrite is None else overwrite
    provenance = {**run_provenance(cfg, step), "dtype": cfg.export.dtype}
    return write_peft_adapter(model_cfg, jax.device_get(params), out, full_trainable=cfg.lora.full_trainable,
                              dtype=cfg.export.dtype, base_model=cfg.model.init_from, overwrite=replace,
                              provenance=provenance)
