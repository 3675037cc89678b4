"""HF safetensors <-> our params (per-layer numpy trees) <-> our Orbax params checkpoint.

Everything streams layer by layer and global tensor by global tensor, so converting the 70 GB
Qwen3.6-35B-A3B checkpoint holds about one layer or one global tensor in host memory: HF tensors are
read in row blocks straight into their transposed (C-contiguous) Orbax layout, and written back as
row blocks of the HF layout (`ShardedSafetensorsWriter.write_rows`), so no tensor ever sits next to
its transposed copy.

* `convert_hf_to_orbax(hf_dir, out_dir)`: HF dir (hub layout or `save_pretrained` layout) -> params
  checkpoint (`params_checkpoint.py`), recording the source's prefix / expert layout / dir;
* `export_orbax_to_hf(ckpt_dir, out_dir)`: params checkpoint -> HF dir (shards + index, config.json,
  generation_config.json, tokenizer files), with the source's names by default;
* `read_hf` / `write_hf`: the same in memory (they back `clover_jax.load_hf` / `save_hf`).

Name and layout mapping lives in `hf_keys.py`; file IO in `safetensors_io.py`. Dtypes are never
changed, so HF -> Orbax -> HF is byte identical.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clover_jax import hf_keys as hk
from clover_jax.config import ModelConfig, ModelConfigError
from clover_jax.params import flatten
from clover_jax.params_checkpoint import (
    bounded_host_memory,
    manifest_dtypes,
    open_params_checkpoint,
    release_host_memory,
    write_params_checkpoint,
)
from clover_jax.safetensors_io import CheckpointError, SafetensorsIndex, ShardedSafetensorsWriter

logger = logging.getLogger(__name__)

Tree = dict[str, Any]

#: Copied verbatim from the source HF dir on export, where present.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "chat_template.jinja",
)
EXPORT_FORMATS = ("qwen", "clover")
#: Names for checkpoints that record no source (e.g. trained from scratch): compact fused experts.
DEFAULT_LAYOUT = hk.HFLayout(hk.PLAIN_PREFIX, hk.FUSED)


# --------------------------------------------------------------------------------------------
# reading HF
# --------------------------------------------------------------------------------------------


def read_hf_config(hf_dir: str | Path, **runtime: Any) -> ModelConfig:
    """`ModelConfig` from ``hf_dir/config.json`` (composite `qwen3_5_moe`: its `text_config`).
    Unknown model types fail naming the file."""
    return ModelConfig.from_hf_file(Path(hf_dir) / "config.json", **runtime)


@dataclass
class HFCheckpoint:
    """An opened, fully validated HF dir (headers only; no tensor data read yet)."""

    dir: Path
    cfg: ModelConfig
    index: SafetensorsIndex
    layout: hk.HFLayout
    model_type: str
    composite_config: bool

    def source_info(self) -> dict[str, Any]:
        return {
            "kind": "hf",
            "hf_dir": str(self.dir.absolute()),
            "hf_prefix": self.layout.prefix,
            "expert_layout": self.layout.expert_layout,
            "model_type": self.model_type,
            "composite_config": self.composite_config,
        }


def open_hf(hf_dir: str | Path, cfg: ModelConfig | None = None) -> HFCheckpoint:
    """Reads config and every safetensors header, and checks the whole tensor list (names and
    shapes) against the config before any data is read: a bad 70 GB checkpoint fails in seconds."""
    d = Path(hf_dir)
    raw = _read_json(d / "config.json")
    cfg = cfg or ModelConfig.from_hf_dict(raw, source=str(d / "config.json"))
    index = SafetensorsIndex(d)
    layout, text_keys = hk.detect_layout(index.keys(), source=str(d))
    hk.check_tensor_names(cfg, layout, text_keys, source=str(d))
    for key, shape in hk.all_expected_keys(cfg, layout).items():
        if index.shape(key) != shape:
            raise hk.HFMappingError(
                f"{index.file_of(key)}: tensor {key!r} has shape {index.shape(key)}, expected {shape}"
            )
    return HFCheckpoint(d, cfg, index, layout, raw.get("model_type", ""), "text_config" in raw)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelConfigError(f"{path}: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path}: not valid JSON ({e})") from None


def read_hf_globals(ck: HFCheckpoint) -> Tree:
    """``{"embed", "final_norm", "lm_head"?}`` of an opened checkpoint."""
    return hk.hf_to_globals(ck.cfg, ck.layout, ck.index, source=str(ck.dir))


def _iter_globals(ck: HFCheckpoint) -> Iterator[tuple[str, np.ndarray]]:
    """(flat key, array) per global tensor, each read only when asked for (so one at a time)."""
    return hk.iter_hf_globals(ck.cfg, ck.layout, ck.index, source=str(ck.dir))


def _iter_layers(ck: HFCheckpoint) -> Iterator[Tree]:
    for i in range(ck.cfg.num_hidden_layers):
        # read exactly this layer's tensors (in row blocks, into contiguous outputs), hand over;
        # the next layer is read only when the consumer asks for it (after it has written this one)
        logger.debug("%s: reading layer %d", ck.dir, i)
        # no local name for the layer: a suspended generator would keep it alive while the next
        # layer is read, doubling peak memory
        yield hk.hf_to_layer(ck.cfg, ck.layout, i, ck.index, source=str(ck.dir))


def iter_hf_layers(hf_dir: str | Path, cfg: ModelConfig | None = None) -> Iterator[Tree]:
    """Yields the per-layer dicts of an HF dir one layer at a time (validated up front)."""
    yield from _iter_layers(open_hf(hf_dir, cfg))


def read_hf(hf_dir: str | Path) -> tuple[ModelConfig, Tree]:
    """The whole HF checkpoint in memory: ``(cfg, per-layer tree)`` (numpy, source dtypes)."""
    ck = open_hf(hf_dir)
    return ck.cfg, {**read_hf_globals(ck), "layers": list(_iter_layers(ck))}


# --------------------------------------------------------------------------------------------
# HF -> Orbax
# --------------------------------------------------------------------------------------------


def convert_hf_to_orbax(hf_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """HF safetensors dir -> params checkpoint at ``out_dir``, streaming layer by layer.

    An interruption leaves nothing at ``out_dir`` (see `write_params_checkpoint`). Returns ``out_dir``.
    """
    ck = open_hf(hf_dir)
    logger.info(
        "converting %s (%s, prefix %r, %s experts, %d layers) -> %s",
        ck.dir, ck.model_type, ck.layout.prefix, ck.layout.expert_layout, ck.cfg.num_hidden_layers, out_dir,
    )
    # globals as a lazy iterator: each HF global is read just before it is saved, then dropped
    return write_params_checkpoint(
        out_dir, ck.cfg, _iter_globals(ck), _iter_layers(ck), source_info=ck.source_info(),
        overwrite=overwrite,
    )


# --------------------------------------------------------------------------------------------
# -> HF
# --------------------------------------------------------------------------------------------


def _dtypes(tree: Tree) -> dict[str, np.dtype]:
    return {k: np.dtype(v.dtype) for k, v in flatten(tree).items()}


def _write_hf_dir(
    cfg: ModelConfig,
    layout: hk.HFLayout,
    out: Path,
    *,
    read_global: Callable[[str], Any],
    globals_dtypes: dict[str, np.dtype],
    layer_dtypes: Callable[[int], dict[str, np.dtype]],
    read_layer: Callable[[int], Tree],
    source_dir: Path | None,
    max_shard_bytes: int,
    overwrite: bool,
) -> Path:
    """The streaming core shared by `export_orbax_to_hf` and `write_hf`: plans every shard from
    shapes and dtypes, then writes one global tensor and one layer at a time.

    ``read_global(flat_key)`` is called for each global tensor just before its HF tensor is
    written, and the result is dropped right after, so the embedding and head (GBs at 35B) are
    never in memory together. Every HF tensor goes out as row blocks (`write_rows`): a transposed
    or concatenated tensor is never materialised whole."""
    plan = hk.globals_hf_specs(cfg, layout, globals_dtypes)
    for i in range(cfg.num_hidden_layers):
        plan += hk.layer_hf_specs(cfg, layout, i, layer_dtypes(i))
    with bounded_host_memory(), ShardedSafetensorsWriter(out, max_shard_bytes, overwrite=overwrite) as w:
        w.plan(plan)
        for key, blocks in hk.iter_globals_to_hf_blocks(cfg, layout, read_global):
            w.write_rows(key, blocks)
            release_host_memory()
        for i in range(cfg.num_hidden_layers):
            for key, blocks in hk.iter_layer_to_hf_blocks(cfg, layout, i, read_layer(i)):
                w.write_rows(key, blocks)
            release_host_memory()
    _write_configs(cfg, out, source_dir, globals_dtypes["embed.embedding"].name)
    logger.info("wrote HF checkpoint %s (prefix %r, %s experts)", out, layout.prefix, layout.expert_layout)
    return out


def _write_configs(cfg: ModelConfig, out: Path, source_dir: Path | None, weights_dtype: str) -> None:
    hf = cfg.to_hf_dict("qwen3_5_moe_text")
    # the weights' own dtype: transformers loads with dtype="auto" from here, so an fp32 export
    # must not claim bf16
    hf["dtype"] = weights_dtype if weights_dtype in ("float32", "bfloat16", "float16") else hf["dtype"]
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if source_dir is not None and source_dir.absolute() == out.absolute():
        source_dir = None  # exporting over the source: its side files are already in place
    src_gen = source_dir / "generation_config.json" if source_dir else None
    if src_gen is not None and src_gen.is_file():
        shutil.copyfile(src_gen, out / "generation_config.json")
    else:
        eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
        gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos, "pad_token_id": cfg.pad_token_id}
        gen = {k: v for k, v in gen.items() if v is not None}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    copied = []
    if source_dir is not None and source_dir.is_dir():
        for name in TOKENIZER_FILES:
            if (source_dir / name).is_file():
                shutil.copyfile(source_dir / name, out / name)
                copied.append(name)
    if source_dir is not None and not copied:
        logger.warning("%s: no tokenizer files found to copy into %s", source_dir, out)


def _check_format(format: str) -> None:
    if format == "clover":
        raise NotImplementedError("clover export lands with the block-diffusion issue")
    if format not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {format!r} (supported: {', '.join(EXPORT_FORMATS)})")


def export_orbax_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    format: str = "qwen",
    expert_layout: str | None = None,
    prefix: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
) -> Path:
    """Params checkpoint -> HF dir, streaming one layer at a time.

    ``format="qwen"`` writes a ``qwen3_5_moe_text`` checkpoint loadable by transformers'
    ``Qwen3_5MoeForCausalLM`` (also when the source config was the composite ``qwen3_5_moe``).
    ``expert_layout`` (``"fused"`` / ``"per_expert"``) and ``prefix`` (``"model.language_model."`` /
    ``"model."``) default to the source's as recorded at convert time. Tokenizer files and
    generation_config.json come from the recorded source dir when it still exists.
    """
    _check_format(format)
    ck = open_params_checkpoint(ckpt_dir)
    cfg, info = ck.cfg, ck.info
    src = info.get("source", {})
    layout = hk.HFLayout(
        prefix or src.get("hf_prefix", DEFAULT_LAYOUT.prefix),
        expert_layout or src.get("expert_layout", DEFAULT_LAYOUT.expert_layout),
    )
    source_dir = Path(src["hf_dir"]) if src.get("hf_dir") else None
    return _write_hf_dir(
        cfg, layout, Path(out_dir), read_global=ck.read_global, globals_dtypes=manifest_dtypes(info, "globals"),
        layer_dtypes=lambda i: manifest_dtypes(info, i), read_layer=ck.read_layer,
        source_dir=source_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite,
    )


def write_hf(
    cfg: ModelConfig,
    per_layer_tree: Tree,
    out_dir: str | Path,
    *,
    format: str = "qwen",
    expert_layout: str = hk.FUSED,
    prefix: str = hk.PLAIN_PREFIX,
    max_shard_bytes: int = 5 * 10**9,
    source_dir: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """In-memory per-layer tree (numpy or jax leaves, any dtypes) -> HF dir. Leaves are fetched to
    host one layer at a time. ``source_dir``: where to copy tokenizer / generation config from."""
    _check_format(format)
    layers = per_layer_tree["layers"]
    if len(layers) != cfg.num_hidden_layers:
        raise CheckpointError(f"tree has {len(layers)} layers, config has {cfg.num_hidden_layers}")
    globals_tree = {k: v for k, v in per_layer_tree.items() if k != "layers"}
    flat_globals = flatten(globals_tree)
    return _write_hf_dir(
        cfg, hk.HFLayout(prefix, expert_layout), Path(out_dir),
        read_global=lambda k: np.asarray(flat_globals[k]), globals_dtypes=_dtypes(globals_tree),
        layer_dtypes=lambda i: _dtypes(layers[i]),
        read_layer=lambda i: _to_host(layers[i]),
        source_dir=Path(source_dir) if source_dir else None,
        max_shard_bytes=max_shard_bytes, overwrite=overwrite,
    )


def _to_host(tree: Tree) -> Tree:
    """Nested dict with every leaf as a host numpy array (device arrays are copied to host)."""
    return {k: _to_host(v) if isinstance(v, dict) else np.asarray(v) for k, v in tree.items()}


__all__ = [
    "EXPORT_FORMATS", "HFCheckpoint", "TOKENIZER_FILES", "convert_hf_to_orbax", "export_orbax_to_hf",
    "iter_hf_layers", "open_hf", "read_hf", "read_hf_config", "read_hf_globals", "write_hf",
]
