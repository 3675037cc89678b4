"""Our Orbax params checkpoint: one Orbax item per layer and per global tensor, streamed, atomic.

Layout of a checkpoint directory (format version 2)::

    model_config.json             dataclasses.asdict(ModelConfig)
    clover_ckpt.json              format + version, num_layers, source info, per-item manifest; written LAST
    globals/embed.embedding/      Orbax item {"embed": {"embedding" [V, D]}}
    globals/final_norm.scale/     Orbax item {"final_norm": {"scale" [D]}}
    globals/lm_head.kernel/       Orbax item {"lm_head": {"kernel" [D, V]}} (absent if tied)
    layers/000/ ...               one Orbax item per decoder layer: the per-layer dict of `params.py`

One item per layer and per global tensor is what makes it streaming: a 35B checkpoint is 70 GB, and
both `convert` and `export` hold only one layer, or one global tensor, in host memory (version 1
kept the embedding and the head in one ``globals/`` item, so both were read at once; it is still
read, at that cost). Leaves are numpy arrays in their source dtypes (bf16 as ml_dtypes.bfloat16), so
HF -> here -> HF is byte exact.

Host memory while streaming: arrays are stored in chunks of at most `OCDBT_TARGET_BYTES`, with
OCDBT data files of that size, so a save never buffers a whole compressed item and a restore never
decodes a whole array next to its copy; `bounded_host_memory` (glibc only) makes the allocator
return those chunk-sized buffers to the OS instead of caching them, and `release_host_memory`
(``malloc_trim``) runs after each item.

Atomicity: everything is written into a hidden temp sibling ``.{name}.partial-*`` and renamed into
place at the very end (`staged_dir`), so an interrupted write never leaves a directory at
``out_dir``; and a directory without ``clover_ckpt.json`` is refused by the reader as incomplete.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import json
import logging
import platform
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy, for np.dtype("bfloat16"))
import numpy as np

from clover_jax.config import ModelConfig
from clover_jax.model.params import check_flat_shapes, flatten, global_param_shapes, layer_param_shapes, unflatten
from clover_jax.bridge.safetensors_io import CheckpointError
from clover_jax.bridge.staged_dir import staged_dir

logger = logging.getLogger(__name__)

FORMAT = "clover-jax-params"
FORMAT_VERSION = 2
#: Versions this code reads: 1 had all globals in one ``globals/`` item (read whole; more memory).
READABLE_VERSIONS = (1, 2)
INFO_FILE = "clover_ckpt.json"
CONFIG_FILE = "model_config.json"
GLOBALS_DIR = "globals"
GLOBALS_ITEM = GLOBALS_DIR  # version 1: the single globals item
LAYERS_DIR = "layers"
#: OCDBT data file size and (so, via Orbax) the largest chunk of a stored array. Orbax's default
#: (2 GiB, and whole-array chunks below it) makes a save buffer a whole compressed item and a
#: restore decode a whole array next to its copy; 16 MiB keeps both to a few chunks.
OCDBT_TARGET_BYTES = 16 * 2**20

Tree = dict[str, Any]
LayerReader = Callable[[int], Tree]


def _layer_item(i: int) -> str:
    return f"{LAYERS_DIR}/{i:03d}"


def _global_item(key: str) -> str:
    """Item path of one global tensor by its flat key, e.g. ``globals/lm_head.kernel``."""
    return f"{GLOBALS_DIR}/{key}"


# --------------------------------------------------------------------------------------------
# host memory (glibc)
# --------------------------------------------------------------------------------------------

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
#: Allocations at least this big get their own mmap, returned to the OS on free.
MMAP_THRESHOLD_BYTES = 1 << 20
_GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # what glibc's dynamic threshold grows to on 64-bit hosts
_libc_cache: list[Any] = []
_bounded_lock = threading.Lock()
_bounded_depth = 0


def _glibc() -> Any | None:
    """The process's glibc (ctypes) or None elsewhere (musl, macOS, ...): the tuning is glibc's."""
    if not _libc_cache:
        lib = None
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                lib.malloc_trim, lib.mallopt  # noqa: B018  (both must exist)
            except (OSError, AttributeError):
                lib = None
        _libc_cache.append(lib)
    return _libc_cache[0]


def release_host_memory() -> None:
    """Hands memory freed by the last item (compression / decode buffers in glibc's arenas) back to
    the OS: ``malloc_trim(0)``. A no-op off glibc."""
    lib = _glibc()
    if lib is not None:
        lib.malloc_trim(0)


@contextlib.contextmanager
def bounded_host_memory() -> Iterator[None]:
    """For a streaming convert / export: glibc mmaps every allocation of `MMAP_THRESHOLD_BYTES` or
    more for the duration (``mallopt(M_MMAP_THRESHOLD)``), so the chunk-sized buffers that
    tensorstore allocates and frees on its threads go back to the OS at once instead of piling up in
    per-thread arenas (glibc's default threshold grows to 32 MiB after the first such free, and then
    caches them: +50% RSS on a restore). On exit the threshold becomes 32 MiB, glibc's own ceiling,
    and freed memory is trimmed. Re-entrant; a no-op off glibc."""
    global _bounded_depth
    lib = _glibc()
    if lib is None:
        yield
        return
    with _bounded_lock:
        _bounded_depth += 1
        if _bounded_depth == 1:
            lib.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    try:
        yield
    finally:
        with _bounded_lock:
            _bounded_depth -= 1
            if _bounded_depth == 0:
                lib.mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_THRESHOLD_MAX)
        release_host_memory()


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
    want = {k: tuple(v) for k, v in flatten(expected).items()}
    check_flat_shapes(flatten(tree), want, where, CheckpointError)


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

    # synchronous: one item in flight at a time; bounded data files => chunked arrays (see
    # OCDBT_TARGET_BYTES), so neither the compressed item nor a whole-array chunk is ever buffered
    ckptr.save(path.absolute(), args=ocp.args.PyTreeSave(tree, ocdbt_target_data_file_size=OCDBT_TARGET_BYTES))
    release_host_memory()


def _iter_global_pairs(globals_: Tree | Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    if isinstance(globals_, Mapping):
        return iter(flatten(globals_).items())
    return iter(globals_)


def _save_globals(ckptr: Any, tmp: Path, cfg: ModelConfig, globals_: Tree | Iterable[tuple[str, Any]]) -> dict:
    """Saves each global tensor as its own item, in the order given; returns the manifest entries."""
    want = {k: tuple(v) for k, v in flatten(global_param_shapes(cfg)).items()}
    manifest: dict[str, list] = {}
    (tmp / GLOBALS_DIR).mkdir()
    for key, arr in _iter_global_pairs(globals_):
        if key not in want:
            raise CheckpointError(f"globals: unexpected param {key!r} (expected {sorted(want)})")
        if key in manifest:
            raise CheckpointError(f"globals: param {key!r} given twice")
        arr = np.asarray(arr)
        if tuple(arr.shape) != want[key]:
            raise CheckpointError(f"globals: param {key!r} has shape {tuple(arr.shape)}, expected {want[key]}")
        _save_item(ckptr, tmp / _global_item(key), unflatten({key: arr}))
        manifest[key] = [list(arr.shape), np.dtype(arr.dtype).name]
        del arr  # the embedding and head are GBs at 35B: never two of them at once
    missing = [k for k in want if k not in manifest]
    if missing:
        raise CheckpointError(f"globals: missing param {missing[0]!r}")
    return manifest


def write_params_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    globals_tree: Tree | Iterable[tuple[str, Any]],
    layer_iter: Iterable[Tree],
    *,
    source_info: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes a params checkpoint, consuming ``layer_iter`` (per-layer dicts, layer 0 first) one
    layer at a time. Shapes are validated against `params.layer_param_shapes` / `global_param_shapes`.

    ``globals_tree``: the globals tree (``{"embed", "final_norm", "lm_head"?}``), or an iterable of
    ``(flat key, array)`` pairs (``"embed.embedding"``, ...) consumed one at a time, each saved as
    its own item and dropped before the next is asked for: a generator that reads each tensor only
    when asked (`hf_keys.iter_hf_globals` does) keeps one global tensor in memory.

    ``source_info`` (JSON-able) is recorded in ``clover_ckpt.json``; the HF bridge stores
    ``hf_dir``, ``hf_prefix``, ``expert_layout``, ``model_type`` there so export reproduces names.
    Returns the final path. Refuses to replace a complete checkpoint unless ``overwrite``.
    """
    out = Path(out_dir).absolute()
    _prepare_target(out, overwrite)
    ckptr = _checkpointer()
    try:
        with staged_dir(out) as tmp, bounded_host_memory():
            manifest = {"globals": _save_globals(ckptr, tmp, cfg, globals_tree), "layers": []}
            del globals_tree
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
    finally:
        ckptr.close()
    logger.info("wrote params checkpoint %s (%d layers)", out, n)
    return out


# --------------------------------------------------------------------------------------------
# read
# --------------------------------------------------------------------------------------------


def _restore_item(path: Path) -> Tree:
    if not path.is_dir():
        raise CheckpointError(f"{path}: Orbax item missing from the params checkpoint")
    ckptr = _checkpointer()
    try:
        tree = ckptr.restore(path.absolute())  # orbax wants absolute paths
    except Exception as e:  # orbax raises assorted types (ValueError, FileNotFoundError, ...)
        raise CheckpointError(f"{path}: cannot restore Orbax item: {type(e).__name__}: {e}") from e
    finally:
        ckptr.close()
        release_host_memory()  # the decode buffers
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
    if info.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{info_path}: format_version {info.get('format_version')!r} unsupported "
            f"(this code reads versions {', '.join(map(str, READABLE_VERSIONS))}; a newer clover_jax wrote it?)"
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


class ParamsCheckpoint:
    """An opened, complete params checkpoint; reads one item at a time, nothing up front.

    ``read_global("lm_head.kernel")`` restores one global tensor, ``read_layer(i)`` one layer (numpy
    leaves, checked against the manifest). Version-1 checkpoints (one globals item) are read too: the
    first `read_global` restores all globals and later calls hand them out."""

    def __init__(self, ckpt_dir: str | Path):
        self.dir = Path(ckpt_dir)
        self.cfg, self.info = read_params_info(self.dir)
        self.version: int = self.info["format_version"]
        self._manifest = self.info.get("manifest", {})
        self._v1_globals: dict[str, np.ndarray] = {}

    @property
    def global_keys(self) -> list[str]:
        """Flat keys of the global tensors, in stored order."""
        if "globals" in self._manifest:
            return list(self._manifest["globals"])
        return list(flatten(global_param_shapes(self.cfg)))

    def read_global(self, key: str) -> np.ndarray:
        if key not in self.global_keys:
            raise CheckpointError(f"{self.dir}: no global param {key!r} (has {self.global_keys})")
        if self.version == 1:
            return self._read_v1_global(key)
        path = self.dir / _global_item(key)
        flat = flatten(_restore_item(path))
        if set(flat) != {key}:
            raise CheckpointError(f"{path}: holds params {sorted(flat)}, expected only {key!r}")
        if "globals" in self._manifest:
            _check_manifest(flat, {key: self._manifest["globals"][key]}, str(path))
        return flat[key]

    def _read_v1_global(self, key: str) -> np.ndarray:
        if key not in self._v1_globals:
            path = self.dir / GLOBALS_ITEM
            g = _restore_item(path)
            if "globals" in self._manifest:
                _check_manifest(g, self._manifest["globals"], str(path))
            self._v1_globals = flatten(g)
            del g
        return self._v1_globals.pop(key)  # handed over: the reader keeps no reference

    def read_globals(self) -> Tree:
        """All globals as a tree (``{"embed", "final_norm", "lm_head"?}``)."""
        return unflatten({k: self.read_global(k) for k in self.global_keys})

    def read_layer(self, i: int) -> Tree:
        if not 0 <= i < self.cfg.num_hidden_layers:
            raise IndexError(f"{self.dir}: layer {i} out of range [0, {self.cfg.num_hidden_layers})")
        layer = _restore_item(self.dir / _layer_item(i))
        if self._manifest.get("layers"):
            _check_manifest(layer, self._manifest["layers"][i], str(self.dir / _layer_item(i)))
        return layer

    @property
    def sharded_reads(self) -> bool:
        """Whether `read_layer_sharded` / `read_global_sharded` work: they take shapes and dtypes
        from the manifest, and need one item per global tensor (format version 2)."""
        return self.version >= 2 and bool(self._manifest.get("layers")) and "globals" in self._manifest

    def stored(self, item: str | int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Flat key -> (shape, dtype) as stored, of layer ``item`` or global ``item`` (manifest)."""
        m = self._manifest["layers"][item] if isinstance(item, int) else {item: self._manifest["globals"][item]}
        return {k: (tuple(v[0]), np.dtype(v[1])) for k, v in m.items()}

    def read_layer_sharded(self, i: int, shardings: Mapping[str, Any]) -> dict[str, Any]:
        """Layer ``i`` as global jax arrays (flat key -> array), restored straight into
        ``shardings`` (flat key -> `jax.sharding.Sharding`, exactly the stored keys), in the stored
        shapes and dtypes: each process reads only the chunks of its addressable shards, so no host
        holds the whole layer. Every process must call it (Orbax restores collectively)."""
        return self._restore_sharded(self.dir / _layer_item(i), self.stored(i), shardings)

    def read_global_sharded(self, key: str, sharding: Any) -> Any:
        """One global tensor restored straight into ``sharding`` (as `read_layer_sharded`)."""
        if key not in self.global_keys:
            raise CheckpointError(f"{self.dir}: no global param {key!r} (has {self.global_keys})")
        return self._restore_sharded(self.dir / _global_item(key), self.stored(key), {key: sharding})[key]

    def _restore_sharded(self, path: Path, stored: dict[str, tuple[tuple[int, ...], np.dtype]],
                         shardings: Mapping[str, Any]) -> dict[str, Any]:
        import jax
        import orbax.checkpoint as ocp

        if not self.sharded_reads:
            raise CheckpointError(f"{self.dir}: format version {self.version} has no per-tensor manifest for "
                                  "sharded reads (use read_layer / read_global)")
        if set(shardings) != set(stored):
            raise CheckpointError(f"{path}: holds params {sorted(stored)}, asked for {sorted(shardings)}")
        if not path.is_dir():
            raise CheckpointError(f"{path}: Orbax item missing from the params checkpoint")
        target = unflatten({k: jax.ShapeDtypeStruct(shp, dt, sharding=shardings[k]) for k, (shp, dt) in stored.items()})
        args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape, dtype=t.dtype),
                            target)
        ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
        try:
            tree = ckptr.restore(path.absolute(), args=ocp.args.PyTreeRestore(item=target, restore_args=args))
        except Exception as e:  # orbax raises assorted types (ValueError, FileNotFoundError, ...)
            raise CheckpointError(f"{path}: cannot restore Orbax item: {type(e).__name__}: {e}") from e
        finally:
            ckptr.close()
            release_host_memory()
        return flatten(tree)


def open_params_checkpoint(ckpt_dir: str | Path) -> ParamsCheckpoint:
    """Opens a checkpoint for item-by-item reading (fails clearly if incomplete or unsupported)."""
    return ParamsCheckpoint(ckpt_dir)


def read_params_checkpoint(ckpt_dir: str | Path) -> tuple[ModelConfig, dict[str, Any], Tree, LayerReader]:
    """``(cfg, info, globals_tree, layer_reader)``; ``layer_reader(i)`` restores layer ``i`` only
    (numpy leaves, checked against the manifest). Reads every global tensor: for one at a time, use
    `open_params_checkpoint(...).read_global`."""
    ck = ParamsCheckpoint(ckpt_dir)
    return ck.cfg, ck.info, ck.read_globals(), ck.read_layer


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
    "CONFIG_FILE", "FORMAT", "FORMAT_VERSION", "INFO_FILE", "OCDBT_TARGET_BYTES", "ParamsCheckpoint",
    "READABLE_VERSIONS", "bounded_host_memory", "config_from_json", "config_to_json", "is_params_checkpoint",
    "load_params_checkpoint", "manifest_dtypes", "open_params_checkpoint", "read_params_checkpoint",
    "read_params_info", "release_host_memory", "write_params_checkpoint",
]
