"""Tests for clover_jax.bridge.safetensors_io: byte-exact round trips against the reference safetensors
library (numpy and torch), sharding, and every validation error naming its file and key."""

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
from safetensors import safe_open

from clover_jax.bridge.safetensors_io import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    MissingKeyError,
    SafetensorsIndex,
    ShardedSafetensorsWriter,
    save_safetensors,
)


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((7, 5)).astype(ml_dtypes.bfloat16),
        "model.layers.0.linear_attn.A_log": rng.standard_normal((4,)).astype(np.float32),
        "model.layers.0.mlp.experts.gate_up_proj":
            rng.standard_normal((3, 4, 5)).astype(ml_dtypes.bfloat16),
        "ids": rng.integers(-2**40, 2**40, size=(2, 3), dtype=np.int64),
        "i32": rng.integers(-9, 9, size=(6,), dtype=np.int32),
        "half": rng.standard_normal((2, 2)).astype(np.float16),
        "scalar": np.asarray(1.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=ml_dtypes.bfloat16),
    }


def _assert_same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def _raw_header(path: Path) -> tuple[dict, int]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), n


def _rewrite_header(path: Path, header: dict) -> None:
    """Replace a file's header keeping its data buffer (to fabricate corrupt headers)."""
    _, n = _raw_header(path)
    data = path.read_bytes()[8 + n:]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


# -- round trips ----------------------------------------------------------------------------
def test_single_file_round_trip_byte_exact(tmp_path):
    ts = _tensors()
    out = save_safetensors(ts, tmp_path)
    assert out == [tmp_path / SINGLE_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_FILE]

    ix = SafetensorsIndex(tmp_path)
    assert ix.keys() == list(ts) and len(ix) == len(ts) and "ids" in ix
    assert ix.metadata == {"format": "pt"}
    assert ix.total_size == sum(v.nbytes for v in ts.values())
    for k, v in ts.items():
        assert ix.shape(k) == v.shape and ix.dtype(k) == v.dtype
        _assert_same(ix.get(k), v)
    assert ix.dtype("model.embed_tokens.weight") == np.dtype(ml_dtypes.bfloat16)
    assert ix.st_dtype("model.embed_tokens.weight") == "BF16"
    assert ix.dtype("model.layers.0.linear_attn.A_log") == np.float32
    # get_rows reads a slab of the leading axis (one expert of a fused tensor).
    fused = ts["model.layers.0.mlp.experts.gate_up_proj"]
    _assert_same(ix.get_rows("model.layers.0.mlp.experts.gate_up_proj", 1, 3), fused[1:3])
    # A direct path to the file works too, and items() streams everything.
    assert dict(SafetensorsIndex(tmp_path / SINGLE_FILE).items()).keys() == ts.keys()

    # The reference readers agree, byte for byte.
    ref = safetensors.numpy.load_file(tmp_path / SINGLE_FILE)
    for k, v in ts.items():
        _assert_same(ref[k], v)
    with safe_open(tmp_path / SINGLE_FILE, framework="np") as f:
        assert f.metadata() == {"format": "pt"}


def test_writer_output_loads_in_torch(tmp_path):
    import torch

    ts = _tensors(1)
    save_safetensors(ts, tmp_path)
    ref = safetensors.torch.load_file(tmp_path / SINGLE_FILE)
    for k, v in ts.items():
        t = ref[k]
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)  # numpy has no bf16: compare the raw bits
        assert tuple(t.shape) == v.shape
        assert t.numpy().tobytes() == v.tobytes(), k


def test_torch_written_bf16_reads_back_identical(tmp_path):
    import torch

    torch.manual_seed(0)
    ts = {"w": torch.randn(6, 4).bfloat16(), "b": torch.randn(3).bfloat16(),
          "f": torch.randn(2, 2, dtype=torch.float32)}
    safetensors.torch.save_file(ts, tmp_path / SINGLE_FILE, metadata={"format": "pt"})
    ix = SafetensorsIndex(tmp_path)
    for k, t in ts.items():
        got = ix.get(k)
        want = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
        assert got.shape == tuple(t.shape) and got.tobytes() == want.tobytes()
    assert ix.dtype("w") == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(ix.get("w").astype(np.float32), ts["w"].float().numpy())


def test_sharding_greedy_with_index(tmp_path):
    ts = _tensors(2)
    # Sizes in plan order: 70, 16, 120 (> limit: own shard), 48, 24, 8, 4, 0 bytes.
    # Greedy with limit 80: [70] [16] [120] [48 24 8] (exactly 80 still fits) [4 0].
    out = save_safetensors(ts, tmp_path, max_shard_bytes=80)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)] + [INDEX_FILE]
    assert out[-1] == tmp_path / INDEX_FILE
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in ts.values())
    wm = index["weight_map"]
    assert list(wm) == sorted(ts)
    shard = {k: int(v[6:11]) for k, v in wm.items()}
    assert shard == {"model.embed_tokens.weight": 1, "model.layers.0.linear_attn.A_log": 2,
                     "model.layers.0.mlp.experts.gate_up_proj": 3, "ids": 4, "i32": 4, "half": 4,
                     "scalar": 5, "empty": 5}
    ix = SafetensorsIndex(tmp_path)
    assert len(ix.files) == 5 and sorted(ix.keys()) == sorted(ts)
    for k, v in ts.items():
        _assert_same(ix.get(k), v)
        assert ix.file_of(k).name == wm[k]
    for shard in ix.files:  # each shard is a valid standalone safetensors file
        for k, v in safetensors.numpy.load_file(shard).items():
            if v.dtype != np.dtype(ml_dtypes.bfloat16):
                _assert_same(v, ts[k])


def test_reads_dir_written_by_reference_library(tmp_path):
    ts = {k: v for k, v in _tensors(3).items() if v.dtype != np.dtype(ml_dtypes.bfloat16)}
    keys = list(ts)
    safetensors.numpy.save_file({k: ts[k] for k in keys[:2]}, tmp_path / "a.safetensors")
    safetensors.numpy.save_file({k: ts[k] for k in keys[2:]}, tmp_path / "b.safetensors")
    wm = {k: ("a.safetensors" if i < 2 else "b.safetensors") for i, k in enumerate(keys)}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    ix = SafetensorsIndex(tmp_path)
    for k, v in ts.items():
        _assert_same(ix.get(k), v)


# -- reader errors -----------------------------------------------------------------------------
def _sharded(tmp_path: Path) -> Path:
    save_safetensors(_tensors(4), tmp_path, max_shard_bytes=80)  # 5 shards, see above
    return tmp_path


def test_missing_dir_and_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist") as e:
        SafetensorsIndex(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(e.value)
    with pytest.raises(CheckpointError, match=f"neither {INDEX_FILE} nor {SINGLE_FILE}") as e:
        SafetensorsIndex(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_index_points_to_missing_shard(tmp_path):
    d = _sharded(tmp_path)
    (d / "model-00004-of-00005.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00004-of-00005.safetensors is missing") as e:
        SafetensorsIndex(d)
    assert INDEX_FILE in str(e.value) and "'half'" in str(e.value)


def test_index_key_absent_from_shard(tmp_path):
    d = _sharded(tmp_path)
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00005.safetensors"
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'ghost.weight' is listed for .*model-00001") as e:
        SafetensorsIndex(d)
    assert "absent from that shard" in str(e.value)


def test_shard_key_missing_from_index(tmp_path):
    d = _sharded(tmp_path)
    index = json.loads((d / INDEX_FILE).read_text())
    del index["weight_map"]["half"]
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00004-of-00005.safetensors: key 'half' is "
                                              "in this shard but missing from the index"):
        SafetensorsIndex(d)
    # ... and a key that the index places in another shard than the one holding it.
    index["weight_map"]["half"] = "model-00001-of-00005.safetensors"
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'half'"):
        SafetensorsIndex(d)


def test_corrupted_index_json(tmp_path):
    d = _sharded(tmp_path)
    (d / INDEX_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE}: corrupted index"):
        SafetensorsIndex(d)
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="weight_map"):
        SafetensorsIndex(d)


def test_truncated_header_length(tmp_path):
    f = tmp_path / SINGLE_FILE
    f.write_bytes(struct.pack("<Q", 1000) + b'{"a":')
    with pytest.raises(CheckpointError, match=f"{SINGLE_FILE}: truncated file .*header length"):
        SafetensorsIndex(tmp_path)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match=f"{SINGLE_FILE}: truncated file"):
        SafetensorsIndex(tmp_path)


def test_truncated_data(tmp_path):
    save_safetensors(_tensors(), tmp_path)
    f = tmp_path / SINGLE_FILE
    f.write_bytes(f.read_bytes()[:-3])
    # The last tensor in the buffer with a non-empty payload is the one cut off.
    with pytest.raises(CheckpointError, match=f"{SINGLE_FILE}: tensor 'scalar': truncated file"):
        SafetensorsIndex(tmp_path)


def test_corrupted_header_not_json(tmp_path):
    f = tmp_path / SINGLE_FILE
    f.write_bytes(struct.pack("<Q", 8) + b"garbage!" + b"\0" * 16)
    with pytest.raises(CheckpointError, match=f"{SINGLE_FILE}: corrupted header .*JSON"):
        SafetensorsIndex(tmp_path)


@pytest.mark.parametrize("field,value,msg", [
    ("dtype", "Q8", "bad dtype 'Q8'"),
    ("shape", [7, -5], "bad shape"),
    ("shape", [7, 6], "needs 84"),                   # shape * itemsize != offsets span
    ("data_offsets", [0, 71], "span 71 bytes"),
    ("data_offsets", [5], "bad data_offsets"),
])
def test_corrupted_header_entries(tmp_path, field, value, msg):
    save_safetensors(_tensors(), tmp_path)
    f = tmp_path / SINGLE_FILE
    header, _ = _raw_header(f)
    header["model.embed_tokens.weight"][field] = value
    _rewrite_header(f, header)
    with pytest.raises(CheckpointError, match=msg) as e:
        SafetensorsIndex(tmp_path)
    assert SINGLE_FILE in str(e.value) and "'model.embed_tokens.weight'" in str(e.value)


def test_overlapping_offsets(tmp_path):
    save_safetensors({"a": np.zeros(4, np.float32), "b": np.ones(4, np.float32)}, tmp_path)
    f = tmp_path / SINGLE_FILE
    header, _ = _raw_header(f)
    header["b"]["data_offsets"] = [8, 24]
    _rewrite_header(f, header)
    with pytest.raises(CheckpointError, match="tensor 'b': corrupted header .*overlapping"):
        SafetensorsIndex(tmp_path)


def test_unknown_key_and_unreadable_tensor(tmp_path):
    save_safetensors(_tensors(), tmp_path)
    ix = SafetensorsIndex(tmp_path)
    with pytest.raises(MissingKeyError, match="no tensor named 'lm_head.weight'") as e:
        ix.get("lm_head.weight")
    assert isinstance(e.value, KeyError) and str(tmp_path) in str(e.value)
    with pytest.raises(KeyError):
        ix.shape("lm_head.weight")
    with pytest.raises(CheckpointError, match="rows \\[0, 9\\) out of range"):
        ix.get_rows("ids", 0, 9)
    # The file shrinks after the (valid) headers were read: get names file and key.
    f = tmp_path / SINGLE_FILE
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{SINGLE_FILE}: tensor 'half' is unreadable"):
        ix.get("half")


# -- writer ------------------------------------------------------------------------------------
def _plan(ts):
    return [(k, v.shape, v.dtype) for k, v in ts.items()]


def test_writer_streams_via_partial_files(tmp_path):
    ts = _tensors(5)
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=100, metadata={"format": "pt", "x": "y"})
    names = w.plan(_plan(ts))
    assert len(names) == 3  # [70 16] [120] [48 24 8 4 0]
    keys = list(ts)
    w.write(keys[0], ts[keys[0]])
    partial = tmp_path / (names[0] + ".partial")
    assert partial.exists() and not list(tmp_path.glob("*.safetensors"))
    # Header first, then data: the header is already complete on disk.
    header, _ = _raw_header(partial)
    assert set(header) == {"__metadata__", keys[0], keys[1]}
    for k in keys[1:]:
        w.write(k, ts[k])
    w.close()
    assert not list(tmp_path.glob("*.partial"))
    assert SafetensorsIndex(tmp_path).metadata == {"format": "pt", "x": "y"}
    with pytest.raises(CheckpointError, match="after close"):
        w.write("ids", ts["ids"])


def test_writer_rejects_bad_writes(tmp_path):
    ts = _tensors(6)
    with ShardedSafetensorsWriter(tmp_path) as w:
        with pytest.raises(CheckpointError, match="before plan"):
            w.write("ids", ts["ids"])
        w.plan(_plan(ts))
        with pytest.raises(CheckpointError, match="'ids' written out of order: the plan "
                                                  "expects 'model.embed_tokens.weight'"):
            w.write("ids", ts["ids"])
        k = "model.embed_tokens.weight"
        with pytest.raises(CheckpointError, match=f"'{k}' has shape \\(5, 7\\), the plan says"):
            w.write(k, ts[k].T)
        with pytest.raises(CheckpointError, match=f"'{k}' has dtype F32, the plan says BF16"):
            w.write(k, ts[k].astype(np.float32))
        with pytest.raises(CheckpointError, match="already called"):
            w.plan(_plan(ts))
        for key, v in ts.items():  # the rejected writes left the writer usable
            w.write(key, v)
    for key, v in ts.items():
        _assert_same(SafetensorsIndex(tmp_path).get(key), v)


def test_writer_plan_errors(tmp_path):
    w = ShardedSafetensorsWriter(tmp_path)
    with pytest.raises(CheckpointError, match="'a' appears twice"):
        w.plan([("a", (1,), "F32"), ("a", (1,), "F32")])
    w = ShardedSafetensorsWriter(tmp_path)
    with pytest.raises(CheckpointError, match="'s': unsupported dtype"):
        w.plan([("s", (1,), np.dtype("U3"))])


def test_writer_close_with_missing_tensors(tmp_path):
    ts = _tensors(7)
    with pytest.raises(CheckpointError, match=r"2 planned tensors not written \(first: 'scalar'\)"):
        with ShardedSafetensorsWriter(tmp_path, max_shard_bytes=100) as w:
            w.plan(_plan(ts))
            for k in list(ts)[:-2]:
                w.write(k, ts[k])
    assert list(tmp_path.iterdir()) == []  # close() failed -> partial files cleaned up


def test_exception_inside_with_leaves_no_files(tmp_path):
    ts = _tensors(8)
    with pytest.raises(RuntimeError, match="boom"):
        with ShardedSafetensorsWriter(tmp_path, max_shard_bytes=100) as w:
            w.plan(_plan(ts))
            for k in list(ts)[:4]:
                w.write(k, ts[k])
            raise RuntimeError("boom")
    assert not list(tmp_path.glob("model*.safetensors*"))
    assert list(tmp_path.iterdir()) == []


def test_overwrite_protection_and_stale_cleanup(tmp_path):
    ts = _tensors(9)
    save_safetensors(ts, tmp_path, max_shard_bytes=100)
    with pytest.raises(CheckpointError, match="already holds checkpoint files"):
        ShardedSafetensorsWriter(tmp_path)
    # Re-export as a single file: the old index and shards must go, or they'd shadow it.
    small = {"a": np.arange(3, dtype=np.int32)}
    save_safetensors(small, tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_FILE]
    _assert_same(SafetensorsIndex(tmp_path).get("a"), small["a"])


def test_empty_checkpoint(tmp_path):
    save_safetensors({}, tmp_path)
    ix = SafetensorsIndex(tmp_path)
    assert ix.keys() == [] and ix.total_size == 0
    assert safetensors.numpy.load_file(tmp_path / SINGLE_FILE) == {}


# -- row-block streaming -----------------------------------------------------------------------
def _file_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_row_blocks_and_tiled_copy():
    from clover_jax.bridge.safetensors_io import row_blocks, tiled_copy

    a = np.arange(6 * 5 * 4, dtype=np.float32).reshape(6, 5, 4)
    (only,) = list(row_blocks(a, max_bytes=8))
    assert only is a  # contiguous: handed back uncopied
    t = a.transpose(0, 2, 1)
    blocks = list(row_blocks(t, max_bytes=2 * 5 * 4 * 4))  # 2 rows of [4, 5] float32 per block
    assert [b.shape[0] for b in blocks] == [2, 2, 2]
    assert all(b.flags.c_contiguous for b in blocks)
    np.testing.assert_array_equal(np.concatenate(blocks), t)
    assert [b.shape[0] for b in row_blocks(a[:, :, ::2], max_bytes=1)] == [1] * 6  # >= one row
    s = np.asarray(3.0, np.float32)
    assert list(row_blocks(s)) == [s]
    for src in (a.T, t, np.arange(7 * 9, dtype=np.int16).reshape(7, 9).T):
        dst = np.empty(src.shape, src.dtype)
        tiled_copy(dst, src, tile_bytes=16)
        np.testing.assert_array_equal(dst, src)


def test_write_rows_is_byte_identical_to_whole_writes(tmp_path):
    ts = _tensors(11)
    save_safetensors(ts, tmp_path / "whole", max_shard_bytes=100)
    with ShardedSafetensorsWriter(tmp_path / "rows", max_shard_bytes=100) as w:
        w.plan(_plan(ts))
        for k, v in ts.items():
            if v.ndim == 0:
                w.write_rows(k, iter([v]))
            elif v.shape[0] == 0:
                w.write_rows(k, iter([]))  # zero rows: no blocks at all
            else:
                cuts = [0, 0, 1, v.shape[0] // 2 + 1, v.shape[0]]  # uneven, incl. an empty block
                w.write_rows(k, (v[a:b] for a, b in zip(cuts, cuts[1:])))
    assert _file_bytes(tmp_path / "rows") == _file_bytes(tmp_path / "whole")


def test_write_streams_non_contiguous_arrays(tmp_path, monkeypatch):
    """A transposed view is written in row blocks: byte-identical, never copied whole."""
    import tracemalloc

    import clover_jax.bridge.safetensors_io as sio

    monkeypatch.setattr(sio, "BLOCK_BYTES", 64 * 1024)
    base = np.random.default_rng(0).standard_normal((256, 2048)).astype(np.float32)  # 2 MiB
    view = base.T
    save_safetensors({"w": np.ascontiguousarray(view)}, tmp_path / "ref")
    with ShardedSafetensorsWriter(tmp_path / "out") as w:
        w.plan([("w", view.shape, view.dtype)])
        tracemalloc.start()
        try:
            w.write("w", view)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < view.nbytes / 4, peak
    assert _file_bytes(tmp_path / "out") == _file_bytes(tmp_path / "ref")


def test_write_rows_rejects_bad_blocks_and_stays_usable(tmp_path):
    ts = {"a": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.arange(5, dtype=np.int32),
          "s": np.asarray(2.0, np.float32)}
    save_safetensors(ts, tmp_path / "ref", max_shard_bytes=30)
    a = ts["a"]
    with ShardedSafetensorsWriter(tmp_path / "out", max_shard_bytes=30) as w:
        w.plan(_plan(ts))
        with pytest.raises(CheckpointError, match="written out of order"):
            w.write_rows("b", iter([ts["b"]]))
        with pytest.raises(CheckpointError, match=r"'a': block 1 has dtype F64, the plan says F32"):
            w.write_rows("a", iter([a[:1], a[1:].astype(np.float64)]))
        with pytest.raises(CheckpointError, match=r"'a': block 0 has shape \(2, 2\), expected \(n, 3\)"):
            w.write_rows("a", iter([a[:2, :2]]))
        with pytest.raises(CheckpointError, match=r"more than the planned 4 rows \(block 2 brings"):
            w.write_rows("a", iter([a[:2], a[2:], a[:1]]))
        with pytest.raises(CheckpointError, match=r"'a': blocks hold 3 rows, the plan says 4"):
            w.write_rows("a", iter([a[:2], a[2:3]]))

        def dies():
            yield a[:2]
            raise RuntimeError("producer died")

        with pytest.raises(RuntimeError, match="producer died"):
            w.write_rows("a", dies())
        w.write_rows("a", iter([a[:3], a[3:]]))  # the failed attempts left nothing behind
        with pytest.raises(CheckpointError, match=r"'b': block 0 has shape \(5, 1\), expected \(n,\)"):
            w.write_rows("b", iter([ts["b"][:, None]]))
        w.write("b", ts["b"])
        with pytest.raises(CheckpointError, match="a 0-d tensor takes exactly one block"):
            w.write_rows("s", iter([ts["s"], ts["s"]]))
        w.write_rows("s", iter([ts["s"]]))
    assert _file_bytes(tmp_path / "out") == _file_bytes(tmp_path / "ref")
