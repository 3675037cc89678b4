"""Remote storage (gs://, s3://, anything `etils.epath` opens) for a run's inputs and outputs: the
primitives the SFT recipe stages with (`sft.remote`) and the checkpoint manager's URI check.

- `stage_in(uri, staging_dir, what)`: a local copy of a remote file tree, made once per host: the
  copy goes to a temp dir renamed into place with a `.staged` marker naming the URI, so a host
  killed mid-copy leaves nothing a rerun would trust, and a rerun reuses a complete copy;
- `publish(local, uri, last=...)`: upload a local tree, the files named in ``last`` after every
  other (a loader that needs ``config.json`` never takes a half-uploaded dir for a checkpoint).

gs:// needs ``gcsfs`` and s3:// ``s3fs`` (``pip install -e ".[cloud]"``), which `epath` uses.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from clover_jax.yaml_config import ConfigError

__all__ = ["MARKER", "copy_file", "copy_tree", "epath_of", "files_under", "is_remote", "join", "publish", "stage_in",
           "staging_path"]

_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
MARKER = ".staged"


def is_remote(path: str | os.PathLike | None) -> bool:
    """True for a URI with a scheme (``gs://bucket/x``); False for local paths and None."""
    return path is not None and bool(_SCHEME.match(str(path)))


def join(base: str, *parts: str) -> str:
    """``base/part/...`` for a URI or a local path (pathlib would fold a URI's ``//``)."""
    return "/".join([str(base).rstrip("/"), *parts]) if is_remote(base) else str(Path(base, *parts))


def epath_of(uri: str):
    from etils import epath

    return epath.Path(uri)


def copy_file(src, dst) -> None:
    with src.open("rb") as f, dst.open("wb") as g:
        shutil.copyfileobj(f, g, length=16 << 20)


def files_under(root, skip: tuple[str, ...] = ()) -> list[str]:
    """Relative paths of every file under ``root`` (an `epath.Path` or a `pathlib.Path`), sorted;
    top-level entries named in ``skip`` are not descended into (a bucket's checkpoint tree)."""
    out: list[str] = []

    def walk(d, rel: str) -> None:
        for child in sorted(d.iterdir(), key=lambda p: p.name):
            if not rel and child.name in skip:
                continue
            r = f"{rel}{child.name}"
            if child.is_dir():
                walk(child, r + "/")
            else:
                out.append(r)

    walk(root, "")
    return out


def copy_tree(src, dst, *, skip: tuple[str, ...] = (), last: tuple[str, ...] = ()) -> int:
    """Copy every file under ``src`` to ``dst`` (either side local or remote), same relative paths,
    the top-level files named in ``last`` after all others, top-level ``skip`` entries left out.
    Returns the number of files copied."""
    rels = sorted(files_under(src, skip), key=lambda r: r in last)  # stable: the others keep their order
    for rel in rels:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        copy_file(src / rel, dst / rel)
    return len(rels)


def staging_path(staging_dir: str | os.PathLike, what: str, uri: str) -> Path:
    """``<staging_dir>/<what>-<hash of uri>``: where a host keeps its copy of ``uri``."""
    tag = hashlib.sha1(uri.encode()).hexdigest()[:12]
    return Path(os.path.expanduser(str(staging_dir))) / f"{what.replace('.', '_')}-{tag}"


def stage_in(uri: str, staging_dir: str | os.PathLike, what: str) -> Path:
    """The local copy of the remote directory at ``uri`` (module docstring); ``what`` names the
    setting in errors (e.g. "model.init_from")."""
    src = epath_of(uri)
    try:
        exists = src.exists()
    except ImportError as e:  # epath's fsspec backend without the bucket's filesystem package
        raise ConfigError(f"{what}: {uri}: {e} (pip install -e \".[cloud]\" brings gcsfs and s3fs)") from None
    if not exists:
        raise ConfigError(f"{what}: {uri} does not exist")
    if not src.is_dir():
        raise ConfigError(f"{what}: {uri} is a file; expected a directory (a data root or a checkpoint dir)")
    dst = staging_path(staging_dir, what, uri)
    marker = dst / MARKER
    if marker.is_file() and marker.read_text() == uri:
        return dst
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        copy_tree(src, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / MARKER).write_text(uri)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


def publish(local: str | os.PathLike, uri: str, *, last: tuple[str, ...] = ("config.json",),
            skip: tuple[str, ...] = ()) -> int:
    """Upload every file under ``local`` to ``uri`` (same relative paths, overwriting), the
    top-level files named in ``last`` after all others; top-level entries in ``skip`` stay local.
    Returns the number of files uploaded."""
    return copy_tree(Path(local), epath_of(uri), skip=(*skip, MARKER), last=last)
