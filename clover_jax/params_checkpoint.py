"""Our Orbax params checkpoint: per-layer items, streamed, written atomically.

Layout of a checkpoint directory::

    model_config.json      dataclasses.asdict(ModelConfig)
    clover_ckpt.json       format + version, num_layers, source info, per-item manifest; written LAST
    globals/               Orbax item: {"embed": {"embedding" [V, D]}, "final_norm": {"scale" [D]},
                           "lm_head": {"kernel" [D, V]} (absent if tied)}
    layers/000/ ...        one Orbax item per decoder layer: the per-layer dict of `params.py`

One item per layer is what makes it streaming: a 35B checkpoint is 70 GB, and both `convert` and
`export` hold only one layer (plus the largest tensor of the conversion) in host memory. Leaves are
numpy arrays in their source dtypes (bf16 as ml_dtypes.bfloat16), so HF -> here -> HF is byte exact.

Atomicity: everything is written into a hidden temp sibling ``.{name}.partial-*`` and renamed into
place at the very end, so an interrupted write never leaves a directory at ``out_dir``; and a
directory without ``clover_ckpt.json`` is refused by the reader as incomplete.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy, for np.dtype("bfloat16"))
import numpy as np

from clover_jax.config import ModelConfig
from clover_jax.params import flatten, global_param_shapes, layer_param_shapes
from clover_jax.safetensors_io import CheckpointError

logger = logging.getLogger(__name__)

FORMAT = "clover-jax-params"
FORMAT_VERSION = 1
INFO_FILE = "clover_ckpt.json"
CONFIG_FILE = "model_config.json"
GLOBALS_ITEM = "globals"
LAYERS_DIR = "layers"

Tree = dict[str, Any]
LayerReader = Callable[[int], Tree]


def _layer_item(i: int) -> str:
    return f"{LAYERS_DIR}/{i:03d}"


def _checkpointer() -> Any:
    """A synchronous Orbax PyTree checkpointer for numpy leaves that does not deep-copy them.

    Orbax's default numpy handler copies every host array before an (async) save, which would put
    two copies of a layer in memory; here saves are synchronous and nothing mutates the arrays
    meanwhile, so the copy buys nothing. The registry is local: the global Orbax one (used by the
    trainer) is untouched. Items stay readable by `ocp.StandardCheckpointer().restore` too.
    """
    import jax
    import orbax.checkpoint as ocp  # deferred: orbax pulls in jax

    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        (np.ndarray, th.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, th.ArrayHandler()),  # never used (leaves are numpy); silences an Orbax warning
    )
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry))


def is_params_checkpoint(path: str | Path) -> bool:
    """True if ``path`` is a complete params checkpoint (has ``clover_ckpt.json``)."""
    return (Path(path) / INFO_FILE).is_file()


# --------------------------------------------------------------------------------------------
# tree checks
# --------------------------------------------------------------------------------------------


def _as_numpy_tree(tree: Tree) -> Tree:
    """Leaves to host numpy (jax arrays are fetched here, one item at a time)."""
    out: Tree = {}
    for k, v in tree.items():
        out[k] = _as_numpy_tree(v) if isinstance(v, dict) else np.asarray(v)
    return out


def _manifest(tree: Tree) -> dict[str, list]:
    """{flat key: [shape, dtype name]}: lets export plan its shards without reading data."""
    return {k: [list(v.shape), np.dtype(v.dtype).name] for k, v in flatten(tree).items()}


def _check_shapes(tree: Tree, expected: Tree, where: str) -> None:
    got, want = flatten(tree), {k: tuple(v) for k, v in flatten(expected).items()}
    missing = [k for k in want if k not in got]
    if missing:
        raise CheckpointError(f"{where}: missing param {missing[0]!r}")
    extra = sorted(set(got) - set(want))
    if extra:
        raise CheckpointError(f"{where}: unexpected params {extra}")
    for k, shape in want.items():
        if tuple(got[k].shape) != shape:
            raise CheckpointError(f"{where}: param {k!r} has shape {tuple(got[k].shape)}, expected {shape}")


# --------------------------------------------------------------------------------------------
# config (de)serialisation
# --------------------------------------------------------------------------------------------


def config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_json(d: dict[str, Any], *, source: str) -> ModelConfig:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:  # written by a newer version: dropping fields silently could change the model
        raise CheckpointError(f"{source}: unknown ModelConfig fields {unknown}")
    # JSON turns tuples into lists; the frozen config wants tuples back (hashable, comparable)
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    try:
        return ModelConfig(**kw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: invalid model config: {e}") from None


# --------------------------------------------------------------------------------------------
# write
# --------------------------------------------------------------------------------------------


def _prepare_target(out: Path, overwrite: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory")
    if is_params_checkpoint(out):
        if not overwrite:
            raise CheckpointError(f"{out}: already holds a params checkpoint; pass overwrite=True to replace it")
    elif any(out.iterdir()) and not overwrite:
        # not ours: never delete someone's files without being told to
        raise CheckpointError(f"{out}: exists, is not empty and is not a params checkpoint; pass overwrite=True")


def _save_item(ckptr: Any, path: Path, tree: Tree) -> None:
    import orbax.checkpoint as ocp

    ckptr.save(path, args=ocp.args.PyTreeSave(tree))  # synchronous: one layer in flight at a time


def write_params_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    globals_tree: Tree,
    layer_iter: Iterable[Tree],
    *,
    source_info: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes a params checkpoint, consuming ``layer_iter`` (per-layer dicts, layer 0 first) one
    layer at a time. Shapes are validated against `params.layer_param_shapes` / `global_param_shapes`.

    ``source_info`` (JSON-able) is recorded in ``clover_ckpt.json``; the HF bridge stores
    ``hf_dir``, ``hf_prefix``, ``expert_layout``, ``model_type`` there so export reproduces names.
    Returns the final path. Refuses to replace a complete checkpoint unless ``overwrite``.
    """
    out = Path(out_dir).absolute()
    _prepare_target(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    ckptr = _checkpointer()
    try:
        g = _as_numpy_tree(globals_tree)
        _check_shapes(g, global_param_shapes(cfg), "globals")
        _save_item(ckptr, tmp / GLOBALS_ITEM, g)
        manifest = {"globals": _manifest(g), "layers": []}
        del g, globals_tree  # the embedding and head are GBs at 35B: do not keep them while layers stream
        (tmp / LAYERS_DIR).mkdir()
        n = 0
        # no enumerate(): its cached result tuple would keep the previous layer alive while the
        # next one is read, doubling peak memory
        for layer in layer_iter:
            if n >= cfg.num_hidden_layers:
                raise CheckpointError(
                    f"layer_iter yields more than num_hidden_layers={cfg.num_hidden_layers} layers"
                )
            layer = _as_numpy_tree(layer)
            _check_shapes(layer, layer_param_shapes(cfg, n), f"layer {n}")
            _save_item(ckptr, tmp / _layer_item(n), layer)
            manifest["layers"].append(_manifest(layer))
            del layer
            n += 1
        if n != cfg.num_hidden_layers:
            raise CheckpointError(f"layer_iter yielded {n} layers, config has {cfg.num_hidden_layers}")
        (tmp / CONFIG_FILE).write_text(json.dumps(config_to_json(cfg), indent=2) + "\n")
        info = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "num_layers": n,
            "layer_types": list(cfg.layer_types),
            "source": source_info or {},
            "manifest": manifest,
        }
        # the completeness marker: nothing reads a checkpoint without it
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        ckptr.close()
    logger.info("wrote params checkpoint %s (%d layers)", out, n)
    return out


def _swap_into_place(tmp: Path, out: Path) -> None:
    """rename(tmp, out); an existing ``out`` (allowed by `_prepare_target`) is moved aside first and
    deleted only once the new one is in place."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)  # put the previous checkpoint back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# read
# --------------------------------------------------------------------------------------------


def _restore_item(path: Path) -> Tree:
    if not path.is_dir():
        raise CheckpointError(f"{path}: Orbax item missing from the params checkpoint")
    ckptr = _checkpointer()
    try:
        tree = ckptr.restore(path)
    except Exception as e:  # orbax raises assorted types (ValueError, FileNotFoundError, ...)
        raise CheckpointError(f"{path}: cannot restore Orbax item: {type(e).__name__}: {e}") from e
    finally:
        ckptr.close()
    return _as_numpy_tree(tree)


def _check_manifest(tree: Tree, manifest: dict[str, list], where: str) -> None:
    got = _manifest(tree)
    if got != manifest:
        bad = sorted(k for k in set(got) | set(manifest) if got.get(k) != manifest.get(k))
        raise CheckpointError(
            f"{where}: params differ from the manifest in {INFO_FILE}: {bad[:5]} "
            f"(found {[got.get(k) for k in bad[:2]]}, recorded {[manifest.get(k) for k in bad[:2]]})"
        )


def read_params_info(ckpt_dir: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """``(cfg, info)`` of a checkpoint without reading any array; fails clearly if incomplete."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise CheckpointError(f"{d}: params checkpoint directory does not exist")
    info_path = d / INFO_FILE
    if not info_path.is_file():
        raise CheckpointError(
            f"{d}: not a complete params checkpoint: {INFO_FILE} is missing (an interrupted write?)"
        )
    try:
        info = json.loads(info_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{info_path}: not valid JSON ({e})") from None
    if info.get("format") != FORMAT:
        raise CheckpointError(f"{info_path}: format {info.get('format')!r} is not {FORMAT!r}")
    if info.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{info_path}: format_version {info.get('format_version')!r} unsupported "
            f"(this code reads {FORMAT_VERSION})"
        )
    cfg_path = d / CONFIG_FILE
    if not cfg_path.is_file():
        raise CheckpointError(f"{d}: {CONFIG_FILE} is missing")
    try:
        cfg = config_from_json(json.loads(cfg_path.read_text()), source=str(cfg_path))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    if info.get("num_layers") != cfg.num_hidden_layers:
        raise CheckpointError(
            f"{info_path}: num_layers {info.get('num_layers')} != num_hidden_layers {cfg.num_hidden_layers} "
            f"in {CONFIG_FILE}"
        )
    return cfg, info


def read_params_checkpoint(ckpt_dir: str | Path) -> tuple[ModelConfig, dict[str, Any], Tree, LayerReader]:
    """``(cfg, info, globals_tree, layer_reader)``; ``layer_reader(i)`` restores layer ``i`` only
    (numpy leaves, checked against the manifest)."""
    d = Path(ckpt_dir)
    cfg, info = read_params_info(d)
    manifest = info.get("manifest", {})
    g = _restore_item(d / GLOBALS_ITEM)
    if "globals" in manifest:
        _check_manifest(g, manifest["globals"], str(d / GLOBALS_ITEM))

    def layer_reader(i: int) -> Tree:
        if not 0 <= i < cfg.num_hidden_layers:
            raise IndexError(f"{d}: layer {i} out of range [0, {cfg.num_hidden_layers})")
        layer = _restore_item(d / _layer_item(i))
        if manifest.get("layers"):
            _check_manifest(layer, manifest["layers"][i], str(d / _layer_item(i)))
        return layer

    return cfg, info, g, layer_reader


def load_params_checkpoint(ckpt_dir: str | Path) -> tuple[ModelConfig, Tree]:
    """The whole checkpoint in memory: ``(cfg, per-layer tree)`` (`params.py` per-layer form)."""
    cfg, _, g, reader = read_params_checkpoint(ckpt_dir)
    return cfg, {**g, "layers": [reader(i) for i in range(cfg.num_hidden_layers)]}


def manifest_dtypes(info: dict[str, Any], item: str | int) -> dict[str, np.dtype]:
    """Flat key -> dtype of ``"globals"`` or layer ``i`` from a checkpoint's manifest."""
    m = info["manifest"]
    entries = m["globals"] if item == "globals" else m["layers"][int(item)]
    return {k: np.dtype(v[1]) for k, v in entries.items()}


__all__ = [
    "CONFIG_FILE", "FORMAT", "FORMAT_VERSION", "INFO_FILE", "config_from_json", "config_to_json",
    "is_params_checkpoint", "load_params_checkpoint", "manifest_dtypes", "read_params_checkpoint",
    "read_params_info", "write_params_checkpoint",
]
