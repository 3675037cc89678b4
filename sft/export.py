"""The SFT run's HF export: where it goes, when it may replace a folder, what it records.

`export.dir` (null: ``<logging.run_dir>/hf_export``, `SFTConfig.export_dir`) is written whole and
atomically by `clover_jax.bridge.convert.write_hf` (temp dir beside it, renamed at the end; every
tensor checked for NaN / Inf as it streams). Replacing a non-empty folder:

* its `EXPORT_INFO_FILE` names this run's dir: it is this run's own earlier export (a rerun of a
  finished run resumes from its final checkpoint and exports again), replaced whole;
* `export.overwrite: true`: replaced whole, whatever it holds;
* anything else is refused (`check_export_target`, run before training starts, so a long run never
  ends in a refused export).

Both the recipe's end-of-run export and an export from a training checkpoint
(`sft.train_checkpoint`) go through `export_params`, so they write the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clover_jax.bridge.convert import EXPORT_INFO_FILE, read_export_info
from clover_jax.config import ModelConfig
from clover_jax.yaml_config import ConfigError
from sft.config import SFTConfig

__all__ = ["check_export_target", "export_params", "run_identity", "run_provenance"]


def _absolute(path: str) -> str:
    from train.remote import is_remote

    return path if is_remote(path) else str(Path(path).absolute())


def run_identity(cfg: SFTConfig) -> str:
    """What an export records as its run: the absolute run dir (a resumed run keeps it)."""
    return _absolute(cfg.logging.run_dir)


def run_provenance(cfg: SFTConfig, step: int) -> dict[str, Any]:
    """What an export of this run records about where it came from: run dir, checkpoint dir, step."""
    return {"run_dir": run_identity(cfg), "checkpoint_dir": _absolute(cfg.checkpoint_dir), "step": int(step)}


def check_export_target(cfg: SFTConfig, out: str | Path | None = None, *, overwrite: bool | None = None) -> bool:
    """Whether the export into ``out`` (default `cfg.export_dir`) replaces an existing folder; a
    ConfigError naming the folder and the override when it may not. ``overwrite`` None:
    `export.overwrite`."""
    if out is None:
        out = cfg.export_dir
    if out is None:
        return False
    d = Path(out)
    if not d.exists():
        return False
    if not d.is_dir():
        raise ConfigError(f"export.dir: {d} exists and is not a directory")
    if not any(d.iterdir()):
        return False
    if cfg.export.overwrite if overwrite is None else overwrite:
        return True
    info = read_export_info(d)
    if info is not None and info.get("run_dir") == run_identity(cfg):
        return True  # this run's own export: a rerun writes it again
    what = (f"the export of another run ({info.get('run_dir')})" if info is not None and info.get("run_dir")
            else f"not an export of this run (no {EXPORT_INFO_FILE} naming {run_identity(cfg)})")
    raise ConfigError(f"export.dir: {d} is not empty and is {what}; set export.overwrite=true to replace it whole, "
                      "or choose another export.dir")


def export_params(cfg: SFTConfig, model_cfg: ModelConfig, tok_dir: Path | None, params: Any, step: int, *,
                  out: str | Path | None = None, overwrite: bool | None = None, **write_kw: Any) -> Path:
    """HF export of the run's ``params`` (stacked, any device or host) after ``step`` updates:
    `export.format` / `export.dtype` / `export.clover_naming` (``write_kw`` may override format,
    clover_naming, expert_layout, prefix, max_shard_bytes), the tokenizer files of ``tok_dir``
    (clover: plus the mask token), and `EXPORT_INFO_FILE` recording the run and step. ``out``
    default: `cfg.export_dir`. ``overwrite`` None: the recipe's replacing rules
    (`check_export_target`); a bool: the writer's plain rule (a non-empty ``out`` only with True),
    as `launch.py export` has it."""
    import jax
    import jax.numpy as jnp

    from clover_jax.api import save_hf
    from clover_jax.model.clover_model import model_from_params

    ec = cfg.export
    out = Path(out if out is not None else cfg.export_dir)
    replace = check_export_target(cfg, out) if overwrite is None else overwrite
    host = jax.device_get(params)
    if model_cfg.lora_rank:  # the adapters merged into the weights: a plain checkpoint of the tuned model
        from clover_jax.model.lora import base_config, merge_adapters

        host = jax.device_get(merge_adapters(host, model_cfg.lora_rank, model_cfg.lora_alpha))
        model_cfg = base_config(model_cfg)
    model = model_from_params(model_cfg.replace(param_dtype="float32", dtype="float32"), host)
    kw = {"format": ec.format, "clover_naming": ec.clover_naming, **{k: v for k, v in write_kw.items() if v is not None}}
    provenance = {**run_provenance(cfg, step), "format": kw["format"], "dtype": ec.dtype}
    return save_hf(model, model_cfg, out, dtype=jnp.dtype(ec.dtype), source_dir=tok_dir, overwrite=replace,
                   provenance=provenance, **kw)
