"""Streaming safetensors IO for HF checkpoints (numpy only, no torch).

Checkpoints are ~70 GB, so nothing here holds more than one tensor in memory: `SafetensorsIndex`
parses only headers on open and reads one tensor's byte range per `get`;
`ShardedSafetensorsWriter` writes each shard's header from a declared plan, then streams bytes.

File format (github.com/huggingface/safetensors): 8-byte little-endian u64 header length N, N bytes
of JSON `{key: {"dtype": "BF16", "shape": [...], "data_offsets": [start, end]}, ...,
"__metadata__": {str: str}}`, then the data buffer; offsets are relative to the buffer start
(8 + N); tensors are little-endian, C-contiguous and tile the buffer without gaps or overlaps.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

__all__ = ["BLOCK_BYTES", "CheckpointError", "MissingKeyError", "SafetensorsIndex",
           "ShardedSafetensorsWriter", "TILE_BYTES", "row_blocks", "rows_per_block", "save_safetensors",
           "tiled_copy",
           "SINGLE_FILE", "INDEX_FILE"]

# Bytes are viewed in place, never byte-swapped: every host we target is little-endian.
assert np.little_endian, "clover_jax.bridge.safetensors_io assumes a little-endian host"

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100_000_000  # the reference reader's limit: a larger length is corruption
#: Size of the row blocks that tensors are streamed in when a whole copy is avoidable (transposes,
#: concatenations): small next to any real tensor, large enough that per-block overhead is nil.
BLOCK_BYTES = 16 * 2**20
#: Tile of a transposing copy (`tiled_copy`): what stays in a core's L2 cache.
TILE_BYTES = 128 * 2**10

# safetensors dtype tag <-> numpy dtype; bf16 / fp8 come from ml_dtypes so bytes stay exact.
_ST_TO_NP: dict[str, np.dtype] = {tag: np.dtype(t) for tag, t in [
    ("F64", np.float64), ("F32", np.float32), ("F16", np.float16), ("BF16", ml_dtypes.bfloat16),
    ("F8_E4M3", ml_dtypes.float8_e4m3fn), ("F8_E5M2", ml_dtypes.float8_e5m2),
    ("I64", np.int64), ("I32", np.int32), ("I16", np.int16), ("I8", np.int8), ("U64", np.uint64),
    ("U32", np.uint32), ("U16", np.uint16), ("U8", np.uint8), ("BOOL", np.bool_),
    ("C64", np.complex64)]}
_NP_TO_ST: dict[np.dtype, str] = {v: k for k, v in _ST_TO_NP.items()}


class CheckpointError(ValueError):
    """A checkpoint dir or file is missing, truncated, corrupted or inconsistent. The message
    always names the offending file and, where there is one, the tensor key."""


class MissingKeyError(CheckpointError, KeyError):
    """A tensor name the checkpoint does not hold (also a KeyError)."""

    def __str__(self) -> str:  # KeyError.__str__ would repr() the message
        return str(self.args[0])


def _st_dtype(dtype: Any) -> str:
    """Tag ("BF16") of a numpy / ml_dtypes dtype, or of a tag; ValueError if unsupported."""
    if isinstance(dtype, str) and dtype in _ST_TO_NP:
        return dtype
    try:
        npd = np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"unsupported dtype {dtype!r}") from e
    npd = npd.newbyteorder("=") if npd.byteorder in "<>" else npd
    if npd not in _NP_TO_ST:
        raise ValueError(f"unsupported dtype {dtype!r} (supported: {sorted(_ST_TO_NP)})")
    return _NP_TO_ST[npd]


def _nbytes(shape: Sequence[int], tag: str) -> int:
    return math.prod(shape) * _ST_TO_NP[tag].itemsize


def rows_per_block(shape: Sequence[int], itemsize: int, max_bytes: int | None = None) -> int:
    """How many leading-axis rows of a ``shape`` tensor fit in ``max_bytes`` (default
    `BLOCK_BYTES`; at least 1)."""
    row = math.prod(shape[1:]) * itemsize
    return max(1, (BLOCK_BYTES if max_bytes is None else max_bytes) // max(1, row))


def tiled_copy(dst: np.ndarray, src: np.ndarray, tile_bytes: int = TILE_BYTES) -> None:
    """``dst[...] = src`` in leading-axis tiles of ~``tile_bytes``. For a transposing copy (one side
    strided) this keeps the strided side's cache lines in cache while they are used: 2-4x faster
    than one numpy assignment on a large 2-byte transpose."""
    if src.ndim == 0:
        dst[...] = src
        return
    if src.ndim > 2 and math.prod(src.shape[1:]) * src.itemsize > 2 * tile_bytes:
        for i in range(src.shape[0]):  # rows too big for one tile (an expert's matrix): tile each
            tiled_copy(dst[i], src[i], tile_bytes)
        return
    n = rows_per_block(src.shape, src.itemsize, tile_bytes)
    for start in range(0, src.shape[0], n):
        dst[start:start + n] = src[start:start + n]


def row_blocks(array: Any, max_bytes: int | None = None) -> Iterator[np.ndarray]:
    """``array`` as consecutive C-contiguous leading-axis blocks of about ``max_bytes`` (default
    `BLOCK_BYTES`; a block is at least one row).

    A C-contiguous array (or a 0-d one) comes back whole as its only block, uncopied; anything else
    (a transposed view, say) is copied one block at a time, so a writer never holds a full
    contiguous copy of it."""
    a = np.asarray(array)
    if a.ndim == 0 or a.flags.c_contiguous:
        yield a
        return
    n = rows_per_block(a.shape, a.itemsize, max_bytes)
    for start in range(0, a.shape[0], n):
        src = a[start:start + n]
        out = np.empty(src.shape, a.dtype)
        tiled_copy(out, src)
        del src
        yield out
        del out


class _TensorInfo(NamedTuple):
    """Where one tensor lives: file, dtype tag, shape, absolute byte range [begin, end)."""
    path: Path
    tag: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _read_header(path: Path) -> tuple[dict[str, _TensorInfo], dict[str, str]]:
    """Parse and validate one file's header, reading no tensor data. Returns (infos, metadata).

    Checks: the header fits in the file and is a JSON object; known dtypes; non-negative int
    shapes; `end - start == prod(shape) * itemsize`; offsets tile the buffer from 0 (as the
    reference reader demands); the buffer fits in the file.
    """
    if not path.is_file():
        raise CheckpointError(f"{path}: safetensors file does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated file ({size} bytes, no 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: corrupted header (header length {n} is implausible)")
        if 8 + n > size:
            raise CheckpointError(
                f"{path}: truncated file (header length {n} > {size - 8} bytes after the length)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupted header (not valid UTF-8 JSON: {e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupted header (JSON is not an object)")
    metadata = header.pop("__metadata__", None) or {}
    if not (isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str)
                                               for k, v in metadata.items())):
        raise CheckpointError(f"{path}: corrupted header (__metadata__ must map str to str)")

    data_start, infos = 8 + n, {}
    for key, ent in header.items():
        ent = ent if isinstance(ent, dict) else {}
        tag, shape, offs = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
        bad = None
        if tag not in _ST_TO_NP:
            bad = f"corrupted header (bad dtype {tag!r})"
        elif not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            bad = f"corrupted header (bad shape {shape!r})"
        elif not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                  and 0 <= offs[0] <= offs[1]):
            bad = f"corrupted header (bad data_offsets {offs!r})"
        elif offs[1] - offs[0] != _nbytes(shape, tag):
            bad = (f"corrupted header (data_offsets {offs} span {offs[1] - offs[0]} bytes, "
                   f"shape {shape} x {tag} needs {_nbytes(shape, tag)})")
        elif data_start + offs[1] > size:
            bad = f"truncated file (data ends at byte {data_start + offs[1]}, file has {size})"
        if bad:
            raise CheckpointError(f"{path}: tensor {key!r}: {bad}")
        infos[key] = _TensorInfo(path, tag, tuple(shape), data_start + offs[0],
                                 data_start + offs[1])
    pos = data_start
    for key, info in sorted(infos.items(), key=lambda kv: kv[1].begin):
        if info.begin != pos:
            raise CheckpointError(
                f"{path}: tensor {key!r}: corrupted header (data_offsets start at "
                f"{info.begin - data_start}, expected {pos - data_start}: overlapping or gapped)")
        pos = info.end
    return infos, metadata


class SafetensorsIndex:
    """Read-only view of an HF safetensors checkpoint, one tensor at a time.

    `path`: a dir with `model.safetensors.index.json` + shards (preferred when both exist, as in
    transformers) or with a single `model.safetensors`; or one `.safetensors` file. Every header is
    parsed and cross-checked against the index on construction (cheap: headers only), so a broken
    checkpoint fails before any slow tensor read starts.
    """

    def __init__(self, path: str | os.PathLike):
        root = Path(path)
        self.files: list[Path] = []
        self.metadata: dict[str, str] = {}
        self._infos: dict[str, _TensorInfo] = {}
        self.dir = root.parent if root.is_file() else root
        if root.is_file():
            self._infos, self.metadata = _read_header(root)
            self.files = [root]
        elif not root.is_dir():
            raise CheckpointError(f"{root}: checkpoint directory does not exist")
        elif (root / INDEX_FILE).is_file():
            self._load_index(root / INDEX_FILE)
        elif (root / SINGLE_FILE).is_file():
            self._infos, self.metadata = _read_header(root / SINGLE_FILE)
            self.files = [root / SINGLE_FILE]
        else:
            raise CheckpointError(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE} found")

    def _load_index(self, index_path: Path) -> None:
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index_path}: corrupted index (not valid JSON: {e})") from e
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise CheckpointError(f"{index_path}: corrupted index (no weight_map of key -> file)")
        by_shard: dict[str, list[str]] = {}
        for key, shard in wmap.items():
            by_shard.setdefault(shard, []).append(key)
        for shard, keys in by_shard.items():
            file = self.dir / shard
            if not file.is_file():
                raise CheckpointError(f"{index_path}: shard file {file} is missing (listed for "
                                      f"{len(keys)} keys, e.g. {keys[0]!r})")
            infos, meta = _read_header(file)
            for key in keys:  # index -> shard
                if key not in infos:
                    raise CheckpointError(f"{index_path}: key {key!r} is listed for {file} but "
                                          f"absent from that shard's header")
            for key in infos:  # shard -> index
                if wmap.get(key) != shard:
                    where = f"listed for {wmap[key]}" if key in wmap else "missing from the index"
                    raise CheckpointError(
                        f"{file}: key {key!r} is in this shard but {where} ({index_path})")
            self._infos.update(infos)
            self.metadata = self.metadata or meta
            self.files.append(file)

    # -- headers only --------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """All tensor names, in index / header order."""
        return list(self._infos)

    def __contains__(self, key: object) -> bool:
        return key in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def _info(self, key: str) -> _TensorInfo:
        try:
            return self._infos[key]
        except KeyError:
            raise MissingKeyError(
                f"{self.dir}: no tensor named {key!r} in the checkpoint") from None

    def shape(self, key: str) -> tuple[int, ...]:
        return self._info(key).shape

    def dtype(self, key: str) -> np.dtype:
        """numpy dtype of `key` (BF16 -> ml_dtypes.bfloat16, F32 -> float32)."""
        return _ST_TO_NP[self._info(key).tag]

    def st_dtype(self, key: str) -> str:
        """safetensors dtype tag of `key`, e.g. "BF16"."""
        return self._info(key).tag

    def nbytes(self, key: str) -> int:
        return self._info(key).end - self._info(key).begin

    def file_of(self, key: str) -> Path:
        return self._info(key).path

    @property
    def total_size(self) -> int:
        """Sum of all tensors' byte sizes (the index's `metadata.total_size`)."""
        return sum(i.end - i.begin for i in self._infos.values())

    # -- data ----------------------------------------------------------------------------------
    def get(self, key: str) -> np.ndarray:
        """Read one tensor: a fresh, writable, C-contiguous array of `shape(key)`, `dtype(key)`.
        The bytes are copied verbatim (no casts), so bf16 / f32 values are bit-exact."""
        info = self._info(key)
        return self._read(info, key, info.begin, info.end, info.shape)

    def get_rows(self, key: str, start: int, stop: int) -> np.ndarray:
        """`tensor[start:stop]` along axis 0 without reading the rest (e.g. a few experts of a
        fused [E, 2I, H] tensor). Shape (stop - start, *shape[1:])."""
        info = self._info(key)
        if not info.shape or not 0 <= start <= stop <= info.shape[0]:
            raise CheckpointError(f"{info.path}: tensor {key!r}: rows [{start}, {stop}) out of "
                                  f"range for shape {info.shape}")
        row = _nbytes(info.shape[1:], info.tag)
        return self._read(info, key, info.begin + start * row, info.begin + stop * row,
                          (stop - start, *info.shape[1:]))

    def _read(self, info: _TensorInfo, key: str, begin: int, end: int,
              shape: tuple[int, ...]) -> np.ndarray:
        try:
            with open(info.path, "rb") as f:
                f.seek(begin)
                buf = np.fromfile(f, dtype=np.uint8, count=end - begin)
        except OSError as e:
            raise CheckpointError(f"{info.path}: tensor {key!r} is unreadable: {e}") from e
        if buf.size != end - begin:  # valid on open, so the file shrank under us
            raise CheckpointError(f"{info.path}: tensor {key!r} is unreadable (truncated file: "
                                  f"got {buf.size} of {end - begin} bytes)")
        return buf.view(_ST_TO_NP[info.tag]).reshape(shape)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (key, array) one tensor at a time, in on-disk order (sequential reads)."""
        for key, i in sorted(self._infos.items(), key=lambda kv: (str(kv[1].path), kv[1].begin)):
            yield key, self.get(key)

    def __repr__(self) -> str:
        return f"SafetensorsIndex({str(self.dir)!r}, {len(self)} tensors, {len(self.files)} files)"


class ShardedSafetensorsWriter:
    """Streams tensors into HF-style safetensors shards; peak memory is one tensor.

        with ShardedSafetensorsWriter(out, max_shard_bytes=5 * 10**9) as w:
            w.plan([(key, shape, dtype), ...])   # every tensor, in write order
            for key, arr in produce():           # same order as the plan
                w.write(key, arr)
        # a clean exit calls close(); an exception deletes every *.partial file

    `write` takes any array (a non-contiguous view is streamed in `row_blocks`, never copied
    whole); `write_rows(key, blocks)` takes a tensor as an iterable of consecutive leading-axis
    blocks, so a tensor that has to be assembled (transposed, concatenated) never exists in memory
    at once.

    Shards fill greedily in plan order: a tensor that would push the current shard past
    `max_shard_bytes` starts a new one (so a tensor above the limit gets a shard to itself).
    One shard -> `model.safetensors`; N > 1 -> `model-0000k-of-0000N.safetensors` plus
    `model.safetensors.index.json`. Files are written as `<name>.partial` and renamed only by a
    successful `close()`: an interrupted export never leaves a file that looks complete. If
    `out_dir` already holds checkpoint files, `overwrite=False` raises and `overwrite=True` deletes
    the stale ones on close, after the new files are in place.
    """

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 10**9,
                 metadata: Mapping[str, str] | None = None, *, overwrite: bool = False):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = int(max_shard_bytes)
        self.metadata = dict({"format": "pt"} if metadata is None else metadata)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.metadata.items()):
            raise ValueError("safetensors metadata must map str to str")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stale = self._existing()
        if stale and not overwrite:
            raise CheckpointError(f"{self.out_dir}: already holds checkpoint files "
                                  f"{[p.name for p in stale]}; pass overwrite=True to replace them")
        self._plan: list[tuple[str, tuple[int, ...], str]] | None = None
        self._shard_of: list[int] = []  # plan position -> shard number
        self._names: list[str] = []      # final shard file names
        self._headers: list[bytes] = []  # per shard: length prefix + padded JSON
        self._next = 0                   # plan position of the next expected tensor
        self._fh = None                  # open file of shard number self._fh_shard
        self._fh_shard = -1
        self._closed = self._aborted = False
        self._outputs: list[Path] = []

    def _existing(self) -> list[Path]:
        return sorted(p for p in self.out_dir.glob("model*.safetensors*")
                      if not p.name.endswith(".partial"))

    def _partial(self, shard: int) -> Path:
        return self.out_dir / (self._names[shard] + ".partial")

    def plan(self, entries: Iterable[tuple[str, Sequence[int], Any]]) -> list[str]:
        """Declare every tensor as (key, shape, dtype) in write order; returns the shard names.
        dtype: a numpy / ml_dtypes dtype or a safetensors tag ("BF16", "F32", ...)."""
        if self._plan is not None:
            raise CheckpointError(f"{self.out_dir}: plan() was already called")
        plan, seen = [], set()
        for key, shape, dtype in entries:
            if key in seen:
                raise CheckpointError(f"{self.out_dir}: key {key!r} appears twice in the plan")
            seen.add(key)
            shape = tuple(int(d) for d in shape)
            try:
                if any(d < 0 for d in shape):
                    raise ValueError(f"negative dim in shape {shape}")
                plan.append((key, shape, _st_dtype(dtype)))
            except ValueError as e:
                raise CheckpointError(f"{self.out_dir}: key {key!r}: {e}") from None

        sizes: list[int] = []  # greedy, in order (as transformers shards too)
        for _, shape, tag in plan:
            nb = _nbytes(shape, tag)
            if not sizes or (sizes[-1] > 0 and sizes[-1] + nb > self.max_shard_bytes):
                sizes.append(0)
            sizes[-1] += nb
            self._shard_of.append(len(sizes) - 1)
        n = max(1, len(sizes))
        self._names = ([SINGLE_FILE] if n == 1 else
                       [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        # The plan fixes every header, so each shard's header goes out before its data: that is
        # what makes single-pass streaming possible.
        headers: list[dict[str, Any]] = [{"__metadata__": self.metadata} for _ in range(n)]
        offs = [0] * n
        for (key, shape, tag), s in zip(plan, self._shard_of):
            nb = _nbytes(shape, tag)
            headers[s][key] = {"dtype": tag, "shape": list(shape),
                               "data_offsets": [offs[s], offs[s] + nb]}
            offs[s] += nb
        for h in headers:
            raw = json.dumps(h, separators=(",", ":")).encode("utf-8")
            raw += b" " * (-len(raw) % 8)  # spaces, so the data buffer starts 8-byte aligned
            self._headers.append(struct.pack("<Q", len(raw)) + raw)
        self._plan = plan
        return list(self._names)

    def _switch_shard(self, shard: int | None) -> None:
        """fsync + close the open shard; open `shard` (if not None) and write its header."""
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None
        if shard is not None:
            self._fh = open(self._partial(shard), "wb")
            self._fh_shard = shard
            self._fh.write(self._headers[shard])

    def _expect(self, key: str) -> tuple[tuple[int, ...], str]:
        """(shape, tag) of the next planned tensor, which must be ``key``."""
        where = f"{self.out_dir}: tensor {key!r}"
        if self._plan is None or self._closed:
            raise CheckpointError(f"{where}: write() "
                                  f"{'before plan()' if self._plan is None else 'after close()'}")
        if self._next >= len(self._plan):
            raise CheckpointError(f"{where}: every planned tensor is already written")
        want_key, shape, tag = self._plan[self._next]
        if key != want_key:
            raise CheckpointError(f"{where} written out of order: the plan expects {want_key!r} "
                                  f"next (position {self._next})")
        return shape, tag

    @staticmethod
    def _tag_of(array: np.ndarray) -> str:
        try:
            return _st_dtype(array.dtype)
        except ValueError:
            return str(array.dtype)

    def _put(self, array: np.ndarray) -> None:
        """Append one block's bytes (little-endian, C order) to the open shard."""
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))  # the format is little-endian
        for block in row_blocks(array):  # no copy when already contiguous
            self._fh.write(block.reshape(-1).view(np.uint8).data)  # the block's own memory
        self._fh.flush()  # nothing of this tensor stays in Python's buffer

    def write(self, key: str, array: np.ndarray) -> None:
        """Append the next planned tensor. Key, shape and dtype must match the plan exactly: no
        silent casts, since a dtype mismatch usually means a conversion bug upstream. A rejected
        write writes nothing, so the writer stays usable. A non-contiguous ``array`` is written in
        row blocks (`row_blocks`), never as a whole contiguous copy."""
        shape, tag = self._expect(key)
        where = f"{self.out_dir}: tensor {key!r}"
        array = np.asarray(array)
        if array.shape != shape:
            raise CheckpointError(f"{where} has shape {array.shape}, the plan says {shape}")
        got = self._tag_of(array)
        if got != tag:
            raise CheckpointError(f"{where} has dtype {got}, the plan says {tag}")
        if self._shard_of[self._next] != self._fh_shard:
            self._switch_shard(self._shard_of[self._next])
        start = self._fh.tell()
        try:
            self._put(array)
        except BaseException:
            self._rewind(start)
            raise
        self._next += 1

    def write_rows(self, key: str, blocks: Iterable[np.ndarray]) -> None:
        """Append the next planned tensor from consecutive blocks along its leading axis: block
        ``j`` has shape ``(n_j, *shape[1:])`` and the plan's dtype, and the ``n_j`` sum to
        ``shape[0]`` (a 0-d tensor: one block of shape ``()``). Blocks are consumed and written one
        at a time, so only one is ever needed in memory. If a block is rejected (or the iterable
        raises), the tensor's bytes written so far are truncated away and the writer stays usable."""
        shape, tag = self._expect(key)
        where = f"{self.out_dir}: tensor {key!r}"
        if self._shard_of[self._next] != self._fh_shard:
            self._switch_shard(self._shard_of[self._next])
        start = self._fh.tell()
        rows, j = 0, -1
        try:
            # no enumerate(): its cached result tuple would keep the previous block alive while the
            # next one is produced
            for block in blocks:
                j += 1
                block = np.asarray(block)
                got = self._tag_of(block)
                if got != tag:
                    raise CheckpointError(f"{where}: block {j} has dtype {got}, the plan says {tag}")
                if not shape:
                    if block.shape != () or j > 0:
                        raise CheckpointError(f"{where}: a 0-d tensor takes exactly one block of "
                                              f"shape (), got {block.shape} as block {j}")
                elif block.ndim != len(shape) or block.shape[1:] != shape[1:]:
                    rows_shape = "(" + ", ".join(["n", *map(str, shape[1:])]) + (",)" if len(shape) == 1 else ")")
                    raise CheckpointError(f"{where}: block {j} has shape {block.shape}, expected "
                                          f"{rows_shape} rows of the planned {shape}")
                rows += block.shape[0] if shape else 1
                if shape and rows > shape[0]:
                    raise CheckpointError(f"{where}: blocks hold more than the planned {shape[0]} "
                                          f"rows (block {j} brings the total to {rows})")
                self._put(block)
                del block  # the next block is produced only when this one is gone
            if rows != (shape[0] if shape else 1):
                raise CheckpointError(f"{where}: blocks hold {rows} rows, the plan says "
                                      f"{shape[0] if shape else 1} (shape {shape})")
        except BaseException:
            self._rewind(start)
            raise
        self._next += 1

    def _rewind(self, start: int) -> None:
        """Drop whatever a failed write left after byte ``start`` of the open shard."""
        self._fh.flush()
        self._fh.seek(start)
        self._fh.truncate()

    def close(self) -> list[Path]:
        """Check that every planned tensor arrived, rename the shards to their final names and
        write the index (if sharded). Returns the final paths (shards, then the index)."""
        if self._aborted:
            raise CheckpointError(f"{self.out_dir}: close() after abort()")
        if self._closed:
            return list(self._outputs)
        if self._plan is None:
            raise CheckpointError(f"{self.out_dir}: close() before plan()")
        if self._next != len(self._plan):
            raise CheckpointError(
                f"{self.out_dir}: close() with {len(self._plan) - self._next} planned tensors not "
                f"written (first: {self._plan[self._next][0]!r})")
        if not self._plan:
            self._switch_shard(0)  # empty checkpoint: a header-only file
        self._switch_shard(None)
        stale = set(self._existing())
        out = [self.out_dir / name for name in self._names]
        for i, path in enumerate(out):
            os.replace(self._partial(i), path)
        if len(self._names) > 1:
            wmap = {k: self._names[s] for (k, _, _), s in zip(self._plan, self._shard_of)}
            index = {"metadata": {"total_size": sum(_nbytes(s, t) for _, s, t in self._plan)},
                     "weight_map": dict(sorted(wmap.items()))}
            tmp = self.out_dir / (INDEX_FILE + ".partial")
            tmp.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
            os.replace(tmp, self.out_dir / INDEX_FILE)
            out.append(self.out_dir / INDEX_FILE)
        # Leftovers of an older export (overwrite=True) would shadow or contradict the new files:
        # e.g. an old index wins over a new single model.safetensors.
        for p in stale - set(out):
            p.unlink()
        self._closed, self._outputs = True, out
        return list(out)

    def abort(self) -> None:
        """Close and delete every partial file written so far (final files are untouched)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        for i in range(len(self._names)):
            self._partial(i).unlink(missing_ok=True)
        (self.out_dir / (INDEX_FILE + ".partial")).unlink(missing_ok=True)
        self._closed = self._aborted = True

    def __enter__(self) -> ShardedSafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.close()
        except BaseException:
            self.abort()
            raise


def save_safetensors(tensors: Mapping[str, np.ndarray], out_dir: str | os.PathLike,
                     max_shard_bytes: int = 5 * 10**9, metadata: Mapping[str, str] | None = None,
                     *, overwrite: bool = False) -> list[Path]:
    """Write an in-memory {key: array} dict (in dict order) as a checkpoint; returns the paths."""
    with ShardedSafetensorsWriter(out_dir, max_shard_bytes, metadata, overwrite=overwrite) as w:
        w.plan((k, np.shape(v), np.asarray(v).dtype) for k, v in tensors.items())
        for k, v in tensors.items():
            w.write(k, v)
    return w.close()
