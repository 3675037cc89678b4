"""train.remote against a bucket stood in by etils' own local backend (`epath.testing.mock_epath`
with the working directory in tmp: ``gs://b/x`` is the folder ``gs:/b/x`` there): staged copies
equal their source byte for byte and are reused, never trusted half-copied; uploads put the named
files last, so a failure mid-upload leaves no ``config.json``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from etils.epath import testing as epath_testing

from clover_jax.yaml_config import ConfigError
from train.remote import MARKER, is_remote, join, publish, stage_in


def _tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


FILES = {"config.json": b"{}", "model.safetensors": os.urandom(3000), "tok/tokenizer.json": b'{"v": 1}',
         "tok/deeper/x.bin": b"\x00\x01"}


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """A working directory where gs://b/... lives at ./gs:/b/..., and a log of the files epath opens."""
    monkeypatch.chdir(tmp_path)
    opened: list[tuple[str, str]] = []

    def logged_open(orig, path, mode):
        opened.append((str(path), mode))
        return orig(path, mode)

    with epath_testing.mock_epath(open=logged_open):
        yield tmp_path, opened


def test_uri_and_join():
    assert is_remote("gs://b/x") and is_remote("s3://b") and not is_remote("/data/x") and not is_remote(None)
    assert not is_remote("runs/gs:x")
    assert join("gs://b/run/", "checkpoints") == "gs://b/run/checkpoints"
    assert join("runs/a", "checkpoints") == str(Path("runs/a/checkpoints"))


def test_stage_in_copies_once_and_never_trusts_a_partial_copy(bucket, monkeypatch):
    tmp, opened = bucket
    _tree(tmp / "gs:/b/init", FILES)
    local = stage_in("gs://b/init", tmp / "staging", "model.init_from")
    assert local.parent == tmp / "staging" and (local / MARKER).read_text() == "gs://b/init"
    assert {str(p.relative_to(local)): p.read_bytes() for p in local.rglob("*") if p.is_file() and p.name != MARKER} == FILES
    reads = [p for p, m in opened if m == "rb"]
    assert len(reads) == len(FILES)
    assert stage_in("gs://b/init", tmp / "staging", "model.init_from") == local  # reused: nothing read
    assert len([p for p, m in opened if m == "rb"]) == len(FILES)

    # a copy that dies on its third file leaves neither the copy nor a marker; the rerun completes
    import train.remote as remote

    real, n = remote.copy_file, {"i": 0}

    def dying(src, dst):
        n["i"] += 1
        if n["i"] == 3:
            raise OSError("connection reset")
        real(src, dst)

    _tree(tmp / "gs:/b/other", FILES)
    monkeypatch.setattr(remote, "copy_file", dying)
    with pytest.raises(OSError, match="connection reset"):
        stage_in("gs://b/other", tmp / "staging", "data_root")
    assert not [p for p in (tmp / "staging").iterdir() if p.name.startswith("data_root")]
    monkeypatch.setattr(remote, "copy_file", real)
    again = stage_in("gs://b/other", tmp / "staging", "data_root")
    assert (again / "model.safetensors").read_bytes() == FILES["model.safetensors"] and (again / MARKER).is_file()


def test_stage_in_names_a_missing_uri_or_a_file(bucket):
    tmp, _ = bucket
    with pytest.raises(ConfigError, match=r"model.init_from: gs://b/nope does not exist"):
        stage_in("gs://b/nope", tmp / "staging", "model.init_from")
    _tree(tmp / "gs:/b", {"one.json": b"{}"})
    with pytest.raises(ConfigError, match=r"data_root: gs://b/one.json is a file; expected a directory"):
        stage_in("gs://b/one.json", tmp / "staging", "data_root")


def test_publish_uploads_the_named_files_last_and_skips(bucket, monkeypatch):
    tmp, opened = bucket
    _tree(tmp / "out", {**FILES, "checkpoints/1/x": b"ck", MARKER: b"gs://b/init"})
    n = publish(tmp / "out", "gs://b/export", skip=("checkpoints",))
    writes = [p for p, m in opened if m == "wb"]
    assert n == len(FILES) == len(writes) and writes[-1] == "gs://b/export/config.json"
    assert (tmp / "gs:/b/export/tok/deeper/x.bin").read_bytes() == FILES["tok/deeper/x.bin"]
    assert not (tmp / "gs:/b/export/checkpoints").exists() and not (tmp / "gs:/b/export" / MARKER).exists()

    import train.remote as remote

    real = remote.copy_file

    def dying(src, dst):
        if str(dst).endswith("tokenizer.json"):
            raise OSError("quota")
        real(src, dst)

    monkeypatch.setattr(remote, "copy_file", dying)
    with pytest.raises(OSError, match="quota"):
        publish(tmp / "out", "gs://b/export2", skip=("checkpoints",))
    assert (tmp / "gs:/b/export2").is_dir() and not (tmp / "gs:/b/export2/config.json").exists()
