"""An SFT training checkpoint as a model: what `launch.py export` and `launch.py generate` accept
besides HF dirs and params checkpoints.

A training checkpoint is a step dir of `train.checkpoint` (``<run_dir>/checkpoints/<step>``, with
its ``params`` and ``config`` items), or the checkpoints dir itself (= its newest complete step).
Only two items are read: ``config`` (the run's `SFTConfig`, from which `sft.recipe.run_model_config`
rebuilds the ModelConfig exactly as the run built it) and ``params`` (the master weights; the
optimizer state is never restored). A run with `checkpoint.save_frozen: false` saved only its
trained params: the frozen ones are re-read from its `model.init_from` and checked against the
fingerprint in ``progress`` (`train.checkpoint.check_frozen`). The tokenizer is the run's: its init
dir's (or its task vocabulary), as the run's own export takes it, so exporting a final checkpoint
writes the same tensors and files as the run's end-of-run export (`sft.export.export_params` does
both).

Paths inside the run config (``model.init_from``, ``logging.run_dir``) are as the run was given
them: relative ones resolve against the current directory, as for the run itself. Reading is
read-only: no Orbax manager is opened on the directory (one would clean up a live run's temp dirs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover_jax.bridge.safetensors_io import CheckpointError
from clover_jax.config import ModelConfig
from clover_jax.yaml_config import ConfigError
from sft.config import SFTConfig

__all__ = ["TrainedRun", "export_training_adapter", "export_training_checkpoint", "load_model", "open_training_checkpoint", "training_step_dir"]

#: the items of a `train.checkpoint` step dir read here
PARAMS_ITEM, CONFIG_ITEM, PROGRESS_ITEM = "params", "config", "progress"


def _restore_item(path: Path, target: Any, what: str) -> Any:
    """An array item of a step dir, host-resident, into `target` (None: as saved)."""
    import jax
    import orbax.checkpoint as ocp

    path = path.absolute()
    ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    try:
        args = ocp.args.StandardRestore(target) if target is not None else ocp.args.StandardRestore()
        return jax.device_get(ckptr.restore(path, args=args))
    except (ValueError, KeyError, FileNotFoundError) as e:  # Orbax: missing / mismatched leaves
        raise CheckpointError(f"{path}: cannot restore {what} "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
    finally:
        ckptr.close()


def _is_step_dir(p: Path) -> bool:
    # Orbax renames `<step>.orbax-checkpoint-tmp-*` to `<step>` only once every item is written, so
    # a digits-only name with both items is a complete step
    return p.name.isdigit() and (p / PARAMS_ITEM).is_dir() and (p / CONFIG_ITEM).is_dir()


def training_step_dir(path: str | Path) -> Path | None:
    """The complete step dir ``path`` names (itself, or a checkpoints dir's newest step); None when
    ``path`` is no training checkpoint."""
    p = Path(path)
    if not p.is_dir():
        return None
    if _is_step_dir(p):
        return p
    steps = [c for c in p.iterdir() if _is_step_dir(c)]
    return max(steps, key=lambda c: int(c.name)) if steps else None


@dataclass(frozen=True)
class TrainedRun:
    """A training checkpoint opened for reading: its step dir and step, the run's config, the
    ModelConfig the run trained, and its tokenizer dir (None: the built-in one, if any)."""

    step_dir: Path
    step: int
    cfg: SFTConfig
    model_cfg: ModelConfig
    tok_dir: Path | None
    init_kind: str = "random"
    init_path: Path | None = None

    def read_params(self) -> Any:
        """The master params (stacked pure dict of host-resident arrays, `train.param_dtype`; the
        frozen ones of a `save_frozen: false` run re-read from its init, as the run held them)."""
        import jax

        from clover_jax.model.clover_model import abstract_model, model_to_params
        from train.checkpoint import FINGERPRINT, check_frozen, merge_subset, subset
        from train.checkpoint import CheckpointError as TrainCheckpointError

        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                              model_to_params(abstract_model(self.model_cfg)))
        if self.cfg.checkpoint.save_frozen:
            return _restore_item(self.step_dir / PARAMS_ITEM, target, "the params of the run's model")
        from sft.init_params import load_params
        from sft.lora import frozen_dtype, optimizer_config
        from train.optimizer import trainable_mask
        from train.state import FP32_ONLY_PATTERNS, cast_master

        mask = trainable_mask(optimizer_config(self.cfg), target)
        trained = _restore_item(self.step_dir / PARAMS_ITEM, subset(target, mask), "the trained params of the run")
        progress = _restore_item(self.step_dir / PROGRESS_ITEM, None, "the run's progress")
        # the initial params as the run held them (master / frozen dtypes), then its fingerprint check
        frozen = jax.tree.map(lambda m: not m, mask)
        initial = cast_master(load_params(self.init_kind, self.init_path, self.model_cfg, self.cfg.model.seed),
                               self.cfg.train.param_dtype, FP32_ONLY_PATTERNS, frozen, frozen_dtype(self.model_cfg))
        try:
            check_frozen(str(self.step_dir), initial, mask, progress[FINGERPRINT])
        except TrainCheckpointError as e:
            raise CheckpointError(str(e)) from None
        return jax.device_get(merge_subset(initial, trained))


def _read_run_config(step_dir: Path) -> SFTConfig:
    import orbax.checkpoint as ocp

    from clover_jax.yaml_config import from_tree

    ckptr = ocp.Checkpointer(ocp.JsonCheckpointHandler())
    try:
        tree = ckptr.restore((step_dir / CONFIG_ITEM).absolute())
    except Exception as e:  # noqa: BLE001 - Orbax raises assorted types on a torn item
        raise CheckpointError(f"{step_dir / CONFIG_ITEM}: cannot read the run config ({type(e).__name__}: {e})") from None
    finally:
        ckptr.close()
    if not isinstance(tree, dict) or not tree:
        raise CheckpointError(f"{step_dir / CONFIG_ITEM}: no run config recorded (not an SFT run's checkpoint?)")
    try:
        return from_tree(SFTConfig, tree, where=f"{step_dir / CONFIG_ITEM}")
    except ConfigError as e:
        raise CheckpointError(f"the run config of {step_dir} does not load: {e}") from None


def open_training_checkpoint(path: str | Path) -> TrainedRun:
    """Opens the training checkpoint ``path`` (module docstring); reads configs and tokenizer only.
    Errors name the checkpoint and what of the run is missing (e.g. a deleted init dir)."""
    from sft.recipe import data_source, run_model_config

    step_dir = training_step_dir(path)
    if step_dir is None:
        raise CheckpointError(f"{path}: not a training checkpoint (a <run_dir>/checkpoints dir or one of its steps)")
    cfg = _read_run_config(step_dir)
    # never write a random init here: a missing init dir is an error naming it
    probe = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, generate_missing=False))
    try:
        kind, init_path, ck_cfg, tok_dir = data_source(probe)
        cfg, mcfg, tok_dir = run_model_config(cfg, ck_cfg, tok_dir, build_vocab=False)
    except (ConfigError, FileNotFoundError) as e:
        raise CheckpointError(f"training checkpoint {step_dir}: cannot rebuild its run's model: {e}") from None
    return TrainedRun(step_dir=step_dir, step=int(step_dir.name), cfg=cfg, model_cfg=mcfg, tok_dir=tok_dir,
                      init_kind=kind, init_path=init_path)


def export_training_checkpoint(path: str | Path, out: str | Path, *, overwrite: bool = False, **write_kw: Any) -> Path:
    """The training checkpoint ``path`` -> HF dir ``out``, as the run's own export would write it
    (`export_params`; the run's export dtype / format / naming unless ``write_kw`` sets format,
    clover_naming, expert_layout, prefix, max_shard_bytes). A non-empty ``out`` is replaced only
    with ``overwrite`` (as for any `launch.py export`)."""
    from sft.export import export_params

    run = open_training_checkpoint(path)
    return export_params(run.cfg, run.model_cfg, run.tok_dir, run.read_params(), run.step, out=out,
                         overwrite=bool(overwrite), **write_kw)


def export_training_adapter(path: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """`launch.py export --adapters`: the training checkpoint ``path`` of a LoRA run -> PEFT adapter
    dir ``out`` (what `export.adapters` writes at the end of that run)."""
    from sft.adapter_export import export_adapter

    run = open_training_checkpoint(path)
    if not run.model_cfg.lora_rank:
        raise CheckpointError(f"{run.step_dir}: --adapters: this run trained without adapters (lora.rank 0); "
                              "export it without --adapters")
    return export_adapter(run.cfg, run.model_cfg, run.read_params(), run.step, out=out, overwrite=bool(overwrite))


def load_model(path: str | Path, **runtime: Any) -> tuple[ModelConfig, Any, Any]:
    """``(ModelConfig, CloverModel, tokenizer or None)`` for `launch.py generate`: a training
    checkpoint as the model its run's export loads to (the tokenizer with the mask token), anything
    else through `clover_jax.decoding.cli.load_checkpoint`. ``runtime``: ModelConfig overrides."""
    from clover_jax.bridge.convert import clover_tokenizer
    from clover_jax.decoding.cli import load_checkpoint
    from clover_jax.model.clover_model import model_from_params

    if Path(path).is_dir() and not (Path(path) / "config.json").is_file() and training_step_dir(path) is not None:
        run = open_training_checkpoint(path)
        mcfg = run.model_cfg.replace(**runtime) if runtime else run.model_cfg
        tok = clover_tokenizer(mcfg, run.tok_dir)
        return mcfg, model_from_params(mcfg, run.read_params()), tok[0] if tok is not None else None
    return load_checkpoint(path, **runtime)
