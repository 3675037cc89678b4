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

Mode and format: reading, ``mode=None`` takes the checkpoint's (``clover_moe`` -> ``"block"``, the Qwen
types -> ``"ar"``); ``"block"`` on a Qwen checkpoint fills the Clover tensors with their init values,
``"ar"`` on a Clover checkpoint drops them (one log line each). Writing, ``format="clover"`` writes
``model_type: clover_moe`` with the Clover tensors (init values for an AR model) and a tokenizer that
knows the mask token; ``"qwen"`` writes ``qwen3_5_moe_text`` without them; None = by ``cfg.mode``.

Name and layout mapping lives in `hf_keys.py`; file IO in `safetensors_io.py`. Dtypes are never
changed, so HF -> Orbax -> HF is byte identical.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clover_jax.bridge import hf_clover as hc
from clover_jax.bridge import hf_keys as hk
from clover_jax.config import ModelConfig, ModelConfigError
from clover_jax.model.params import flatten
from clover_jax.bridge.params_checkpoint import (
    bounded_host_memory,
    manifest_dtypes,
    open_params_checkpoint,
    release_host_memory,
    write_params_checkpoint,
)
from clover_jax.bridge.safetensors_io import CheckpointError, SafetensorsIndex, ShardedSafetensorsWriter
from clover_jax.bridge.staged_dir import staged_dir
from clover_jax.bridge.vocab_subset import SUBSET_FILE

logger = logging.getLogger(__name__)

Tree = dict[str, Any]

#: Copied verbatim from the source HF dir on export, where present.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "chat_template.jinja", SUBSET_FILE,  # vocab_subset.json: a task vocabulary's map to the base ids
)
EXPORT_FORMATS = ("qwen", "clover")
#: What wrote an export (JSON; the SFT recipe's run dir and step): lets a rerun of the same run replace
#: its own export while an unrelated folder is refused.
EXPORT_INFO_FILE = "clover_export.json"
#: Names for checkpoints that record no source (e.g. trained from scratch): compact fused experts.
DEFAULT_LAYOUT = hk.HFLayout(hk.PLAIN_PREFIX, hk.FUSED)


# --------------------------------------------------------------------------------------------
# reading HF
# --------------------------------------------------------------------------------------------


def read_hf_config(hf_dir: str | Path, *, mode: str | None = None, **runtime: Any) -> ModelConfig:
    """`ModelConfig` from ``hf_dir/config.json`` (composite `qwen3_5_moe`: its `text_config`).
    Unknown model types fail naming the file. ``mode`` None: the checkpoint's."""
    return ModelConfig.from_hf_file(Path(hf_dir) / "config.json", **_with_mode(runtime, mode))


def _with_mode(runtime: dict[str, Any], mode: str | None) -> dict[str, Any]:
    return runtime if mode is None else {**runtime, "mode": mode}


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
            "clover_tensors": self.layout.clover,
            "clover_naming": self.layout.clover_naming if self.layout.clover else None,
        }


def open_hf(
    hf_dir: str | Path, cfg: ModelConfig | None = None, *, mode: str | None = None, **runtime: Any
) -> HFCheckpoint:
    """Reads config and every safetensors header, and checks the whole tensor list (names and
    shapes) against the config before any data is read: a bad 70 GB checkpoint fails in seconds.

    ``cfg`` None: from config.json, with ``runtime`` overrides; ``mode`` None keeps the config's
    (or the checkpoint's). Only a ``clover_moe`` config may come with Clover tensors (in a Qwen
    config they are unexpected tensors); with them, every GDN layer must have both."""
    d = Path(hf_dir)
    raw = _read_json(d / "config.json")
    if cfg is None:
        cfg = ModelConfig.from_hf_dict(raw, source=str(d / "config.json"), **_with_mode(runtime, mode))
    elif mode is not None and mode != cfg.mode:
        cfg = cfg.replace(mode=mode)
    index = SafetensorsIndex(d)
    layout, text_keys = hk.detect_layout(index.keys(), source=str(d))
    if layout.clover and raw.get("model_type") != "clover_moe":
        layout = dataclasses.replace(layout, clover=False)  # -> named as unexpected just below
    hk.check_tensor_names(cfg, layout, text_keys, source=str(d))
    hk.check_hf_shapes(cfg, layout, index.shape, source=str(d), file_of=index.file_of)
    hc.log_read(cfg, layout.clover, str(d), layout.clover_naming)
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


def iter_hf_layers(
    hf_dir: str | Path, cfg: ModelConfig | None = None, *, mode: str | None = None, **runtime: Any
) -> Iterator[Tree]:
    """Yields the per-layer dicts of an HF dir one layer at a time (validated up front; ``mode`` and
    ``runtime`` as in `open_hf`)."""
    yield from _iter_layers(open_hf(hf_dir, cfg, mode=mode, **runtime))


def read_hf(hf_dir: str | Path, *, mode: str | None = None, **runtime: Any) -> tuple[ModelConfig, Tree]:
    """The whole HF checkpoint in memory: ``(cfg, per-layer tree)`` (numpy, source dtypes; filled-in
    Clover scalars fp32, right taps in the conv weight's dtype). ``mode`` None: the checkpoint's;
    ``runtime``: ModelConfig overrides (e.g. ``bd_alpha_init``, which sets the filled-in values)."""
    ck = open_hf(hf_dir, mode=mode, **runtime)
    return ck.cfg, {**read_hf_globals(ck), "layers": list(_iter_layers(ck))}


# --------------------------------------------------------------------------------------------
# HF -> Orbax
# --------------------------------------------------------------------------------------------


def convert_hf_to_orbax(
    hf_dir: str | Path, out_dir: str | Path, *, mode: str | None = None, overwrite: bool = False, **runtime: Any
) -> Path:
    """HF safetensors dir -> params checkpoint at ``out_dir``, streaming layer by layer. ``mode``
    None: the checkpoint's (a Clover dir keeps its Clover tensors); the checkpoint's ModelConfig
    records it.

    An interruption leaves nothing at ``out_dir`` (see `write_params_checkpoint`). Returns ``out_dir``.
    """
    ck = open_hf(hf_dir, mode=mode, **runtime)
    logger.info(
        "converting %s (%s, prefix %r, %s experts, %d layers) -> %s (mode %r)",
        ck.dir, ck.model_type, ck.layout.prefix, ck.layout.expert_layout, ck.cfg.num_hidden_layers, out_dir,
        ck.cfg.mode,
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
    format: str,
    provenance: Mapping[str, Any] | None = None,
) -> Path:
    """The streaming core shared by `export_orbax_to_hf` and `write_hf`: plans every shard from
    shapes and dtypes, then writes one global tensor and one layer at a time.

    ``read_global(flat_key)`` is called for each global tensor just before its HF tensor is
    written, and the result is dropped right after, so the embedding and head (GBs at 35B) are
    never in memory together. Every HF tensor goes out as row blocks (`write_rows`): a transposed
    or concatenated tensor is never materialised whole.

    Invariants: the whole directory (shards, index, configs, tokenizer files, `EXPORT_INFO_FILE`)
    is built in a temp sibling and renamed into place only when complete (`staged_dir`), so any
    failure leaves ``out`` as it was; a non-empty ``out`` is refused unless ``overwrite`` (then it
    is replaced whole: no file of the previous model survives); every float tensor is checked for
    NaN / Inf block by block as it streams, and one that has any fails the export naming it.
    ``provenance`` (JSON-able) is written to `EXPORT_INFO_FILE` (the SFT recipe records its run)."""
    check_writable_dir(out, overwrite)
    tok = None
    if format == "clover":
        # before any tensor is written: a tokenizer / mask id mismatch must not leave a half export
        tok = clover_tokenizer(cfg, source_dir)
        if tok is not None and cfg.mask_token_id is None:
            cfg = cfg.replace(mask_token_id=tok[1])
            logger.info("%s: mask_token_id was unset; it is %d, the id %r gets in the exported tokenizer",
                        out, tok[1], MASK_TOKEN)
    hc.log_write(cfg, layout.clover, str(out), layout.clover_naming)
    plan = hk.globals_hf_specs(cfg, layout, globals_dtypes)
    for i in range(cfg.num_hidden_layers):
        plan += hk.layer_hf_specs(cfg, layout, i, layer_dtypes(i))
    with staged_dir(out) as tmp:
        with bounded_host_memory(), ShardedSafetensorsWriter(tmp, max_shard_bytes) as w:
            w.plan(plan)
            for key, blocks in hk.iter_globals_to_hf_blocks(cfg, layout, read_global):
                w.write_rows(key, finite_blocks(out, key, blocks))
                release_host_memory()
            for i in range(cfg.num_hidden_layers):
                for key, blocks in hk.iter_layer_to_hf_blocks(cfg, layout, i, read_layer(i)):
                    w.write_rows(key, finite_blocks(out, key, blocks))
                release_host_memory()
        _write_configs(cfg, tmp, source_dir, globals_dtypes["embed.embedding"].name, format,
                       tok[0] if tok is not None else None)
        if provenance is not None:
            (tmp / EXPORT_INFO_FILE).write_text(json.dumps(dict(provenance), indent=2) + "\n")
    logger.info("wrote HF checkpoint %s (%s, prefix %r, %s experts)", out, format, layout.prefix,
                layout.expert_layout)
    return out


def check_writable_dir(out: Path, overwrite: bool) -> None:
    """``out`` may be written: absent, an empty dir, or (``overwrite``) any dir. Refusing here, before
    any tensor is read, is what keeps an export from replacing a folder that holds another model."""
    if not out.exists():
        return
    if not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory")
    held = sorted(p.name for p in out.iterdir())
    if held and not overwrite:
        more = f", ... ({len(held)} entries)" if len(held) > 3 else ""
        raise CheckpointError(f"{out}: exists and is not empty (holds {', '.join(held[:3])}{more}); pass "
                              "overwrite=True to replace the whole directory")


def finite_blocks(out: Path, key: str, blocks: Iterable[Any]) -> Iterator[np.ndarray]:
    """``blocks`` passed through, each float block checked for NaN / Inf before it is written (so a
    35B export is checked as it streams, without a second pass over the weights)."""
    for block in blocks:
        block = np.asarray(block)
        if (block.dtype.kind in "fc" or "float" in block.dtype.name) and not np.isfinite(block).all():
            bad = int(block.size - np.count_nonzero(np.isfinite(block)))
            raise CheckpointError(f"tensor {key!r} holds {bad} non-finite values (NaN / Inf): refusing to export "
                                  f"it; {out} is left as it was")
        yield block
        del block  # the next block is produced only when this one is gone


def read_export_info(hf_dir: str | Path) -> dict[str, Any] | None:
    """The `EXPORT_INFO_FILE` of an export (what wrote it), None when it has none or it is unreadable."""
    try:
        info = json.loads((Path(hf_dir) / EXPORT_INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


MASK_TOKEN = "<|mask|>"
#: ids of the Qwen3.6 tokenizer (248044 BPE ranks + 33 specials, `tokenizer.py`); a model whose
#: vocabulary has room beyond them gets the built-in tokenizer when its source dir has none
QWEN_TOKENIZER_SIZE = 248077


def clover_tokenizer(cfg: ModelConfig, source_dir: Path | None) -> tuple[Any, int] | None:
    """``(tokenizer, mask id)`` for a clover export: the source dir's tokenizer (else, for a model
    with the Qwen3.6 vocabulary, the built-in one) with `MASK_TOKEN` added; its id must be
    ``cfg.mask_token_id`` when that is set, and inside the vocabulary. None (with a warning) when
    there is no tokenizer to write."""
    from clover_jax.bridge import tokenizer as T  # deferred: transformers is a heavy import

    if source_dir is not None and (source_dir / "tokenizer.json").is_file():
        where = str(source_dir)
        try:
            tok = T.load_tokenizer(source_dir, fresh=True)
        except Exception as e:  # transformers / tokenizers raise assorted types on a bad file
            raise CheckpointError(f"{source_dir / 'tokenizer.json'}: cannot load the tokenizer: "
                                  f"{type(e).__name__}: {e}") from e
    elif cfg.vocab_size >= QWEN_TOKENIZER_SIZE + 1:
        where = "the built-in Qwen3.6 tokenizer"
        tok = T.load_tokenizer(None, fresh=True)
    else:
        logger.warning("no tokenizer written: %s, and the vocabulary (%d rows) has no room for the built-in "
                       "Qwen3.6 tokenizer's mask token", f"no tokenizer.json in {source_dir}" if source_dir
                       else "no source dir (source_dir=...) to take a tokenizer from", cfg.vocab_size)
        return None
    try:
        mask_id = T.add_mask_token(tok, MASK_TOKEN, cfg.mask_token_id)
    except ValueError as e:
        raise CheckpointError(f"mask_token_id {cfg.mask_token_id} does not fit {where}: {e}") from None
    if not 0 <= mask_id < cfg.vocab_size:
        raise CheckpointError(f"{where} gives {MASK_TOKEN!r} id {mask_id}, outside the model's vocabulary "
                              f"[0, {cfg.vocab_size})")
    return tok, mask_id


def _write_configs(
    cfg: ModelConfig, out: Path, source_dir: Path | None, weights_dtype: str, format: str, tokenizer: Any = None
) -> None:
    hf = cfg.to_hf_dict("clover_moe" if format == "clover" else "qwen3_5_moe_text")
    # the weights' own dtype: transformers loads with dtype="auto" from here, so an fp32 export
    # must not claim bf16
    hf["dtype"] = weights_dtype if weights_dtype in ("float32", "bfloat16", "float16") else hf["dtype"]
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    # ``out`` is the export's temp dir: exporting over the source dir still reads the old files here
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
    if tokenizer is not None:
        _write_mask_tokenizer(tokenizer, out)
    elif source_dir is not None and not copied:
        logger.warning("%s: no tokenizer files found to copy into %s", source_dir, out)


def _write_mask_tokenizer(tok: Any, out: Path) -> None:
    """The clover export's tokenizer (over the copied source files: tokenizer.json and
    tokenizer_config.json now know the mask token; a copied special_tokens_map.json learns it too)."""
    from clover_jax.bridge.tokenizer import save_tokenizer

    save_tokenizer(tok, out)
    stm = out / "special_tokens_map.json"
    if stm.is_file():
        m = json.loads(stm.read_text())
        m["mask_token"] = {"content": MASK_TOKEN, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False}
        stm.write_text(json.dumps(m, indent=2, ensure_ascii=False) + "\n")


def _resolve_format(format: str | None, cfg: ModelConfig) -> str:
    """None -> by the model's mode (block: clover, ar: qwen)."""
    if format is None:
        return "clover" if cfg.mode == "block" else "qwen"
    if format not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {format!r} (supported: {', '.join(EXPORT_FORMATS)})")
    return format


def export_orbax_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    format: str | None = None,
    expert_layout: str | None = None,
    prefix: str | None = None,
    max_shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
    clover_naming: str = hc.SPLIT,
) -> Path:
    """Params checkpoint -> HF dir, streaming one layer at a time.

    ``format="qwen"`` writes a ``qwen3_5_moe_text`` checkpoint loadable by transformers'
    ``Qwen3_5MoeForCausalLM`` (also when the source config was the composite ``qwen3_5_moe``), without
    the Clover tensors; ``"clover"`` a ``clover_moe`` one (architecture ``CloverMoeModelLM``) with
    them, named by ``clover_naming`` (``"split"``: the four tensor kinds per GDN layer llama.cpp's
    Clover converter reads; ``"packed"``: the two of the other public naming, `hf_clover`); None: by
    the checkpoint's mode. ``expert_layout`` (``"fused"`` / ``"per_expert"``) and ``prefix`` (``"model.language_model."`` /
    ``"model."``) default to the source's as recorded at convert time. Tokenizer files and
    generation_config.json come from the recorded source dir when it still exists. The directory is
    written atomically; a non-empty ``out_dir`` is refused unless ``overwrite`` (replaced whole).
    """
    ck = open_params_checkpoint(ckpt_dir)
    cfg, info = ck.cfg, ck.info
    format = _resolve_format(format, cfg)
    src = info.get("source", {})
    layout = hk.HFLayout(
        prefix or src.get("hf_prefix", DEFAULT_LAYOUT.prefix),
        expert_layout or src.get("expert_layout", DEFAULT_LAYOUT.expert_layout),
        clover=format == "clover", clover_naming=clover_naming,
    )
    source_dir = Path(src["hf_dir"]) if src.get("hf_dir") else None
    return _write_hf_dir(
        cfg, layout, Path(out_dir), read_global=ck.read_global, globals_dtypes=manifest_dtypes(info, "globals"),
        layer_dtypes=lambda i: manifest_dtypes(info, i), read_layer=ck.read_layer,
        source_dir=source_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite, format=format,
    )


def write_hf(
    cfg: ModelConfig,
    per_layer_tree: Tree,
    out_dir: str | Path,
    *,
    format: str | None = None,
    expert_layout: str = hk.FUSED,
    prefix: str = hk.PLAIN_PREFIX,
    max_shard_bytes: int = 5 * 10**9,
    source_dir: str | Path | None = None,
    overwrite: bool = False,
    clover_naming: str = hc.SPLIT,
    provenance: Mapping[str, Any] | None = None,
) -> Path:
    """In-memory per-layer tree (numpy or jax leaves, any dtypes) -> HF dir. Leaves are fetched to
    host one layer at a time. ``source_dir``: where to copy tokenizer / generation config from.
    ``format`` and ``clover_naming`` as in `export_orbax_to_hf`; atomicity, ``overwrite``, the NaN
    check and ``provenance`` as in `_write_hf_dir`."""
    format = _resolve_format(format, cfg)
    layers = per_layer_tree["layers"]
    if len(layers) != cfg.num_hidden_layers:
        raise CheckpointError(f"tree has {len(layers)} layers, config has {cfg.num_hidden_layers}")
    globals_tree = {k: v for k, v in per_layer_tree.items() if k != "layers"}
    flat_globals = flatten(globals_tree)
    return _write_hf_dir(
        cfg, hk.HFLayout(prefix, expert_layout, clover=format == "clover", clover_naming=clover_naming), Path(out_dir),
        read_global=lambda k: np.asarray(flat_globals[k]), globals_dtypes=_dtypes(globals_tree),
        layer_dtypes=lambda i: _dtypes(layers[i]),
        read_layer=lambda i: _to_host(layers[i]),
        source_dir=Path(source_dir) if source_dir else None,
        max_shard_bytes=max_shard_bytes, overwrite=overwrite, format=format, provenance=provenance,
    )


def _to_host(tree: Tree) -> Tree:
    """Nested dict with every leaf as a host numpy array (device arrays are copied to host)."""
    return {k: _to_host(v) if isinstance(v, dict) else np.asarray(v) for k, v in tree.items()}


__all__ = [
    "EXPORT_FORMATS", "EXPORT_INFO_FILE", "HFCheckpoint", "read_export_info", "MASK_TOKEN", "clover_tokenizer", "TOKENIZER_FILES", "convert_hf_to_orbax", "export_orbax_to_hf",
    "iter_hf_layers", "open_hf", "read_hf", "read_hf_config", "read_hf_globals", "write_hf",
]
