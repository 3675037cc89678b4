"""One writer per run directory: a lock file created with an atomic exclusive create.

Two trainings on one `checkpoint.dir` destroy each other's work (a new Orbax manager deletes the
other run's in-progress save as a leftover tmp directory; both rewrite `metrics.jsonl`). A run
therefore holds ``<dir>/.run.lock`` for each of its output dirs while it trains:

- the lock file is created with ``O_CREAT | O_EXCL`` (atomic on a local or NFSv3+ filesystem) and
  holds JSON ``{"host", "pid", "token", "started"}``; it is removed when the run ends;
- a second run finds it and refuses at once (`RunLockError`, one line naming host and PID);
- a lock left by a dead process on this host (SIGKILL, OOM) is stale: it is renamed away (an atomic
  rename, so of two runs taking it over only one succeeds) and created afresh, with a log line;
- a lock of another host cannot be checked from here: refused, and the message says how to remove it.

Invariants: a lock file is never half-written as seen by another run (the JSON goes to the exclusive
create's file descriptor before anyone can read a valid holder; a torn/empty file reads as "unknown
holder" and is refused, never taken over); a process re-entering a lock it holds (the recipe locks
early, the loop again) only counts up, and the file goes when the outermost holder releases it.

Remote dirs (``gs://...``) are not locked (a log line says so): `etils.epath` offers no exclusive
create, and a check-then-write lock left by a hard-killed host would block the resume of a preempted
pod on another host, which cannot tell whether that host still runs. Documented in docs/guides/sft.md.
Only process 0 of a multi-process run takes the lock (the others write under its supervision).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from clover_jax.bridge.staged_dir import pid_alive

log = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"

#: locks this process holds: lock path -> (path, token, depth)
_HELD: dict[str, tuple[Any, str, int]] = {}


class RunLockError(RuntimeError):
    """Another run holds the directory (or its lock cannot be judged); the message is one line."""


def _read(path: Any) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_remote(directory: str | os.PathLike) -> bool:
    from train.remote import is_remote

    return is_remote(str(directory))


def _lock_path(directory: str | os.PathLike) -> Path:
    return Path(directory).absolute() / LOCK_NAME


def _record(token: str) -> bytes:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": token,
                       "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()


def _create_local(path: Path, token: str) -> bool:
    """Exclusive create; False when the file exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(_record(token))
        f.flush()
        os.fsync(f.fileno())
    return True


def _holder(info: dict[str, Any] | None) -> str:
    if not info:
        return "an unknown holder (empty or unreadable lock file)"
    return f"PID {info.get('pid')} on host {info.get('host')} (since {info.get('started', '?')})"


def _acquire_one(directory: str | os.PathLike, message: Callable[[str], None]) -> str | None:
    if _is_remote(directory):
        message(f"note: {directory} is remote and not locked: never start two runs on it (docs/guides/sft.md)")
        return None
    path = _lock_path(directory)
    key = str(path)
    if key in _HELD:
        _, token, depth = _HELD[key]
        _HELD[key] = (path, token, depth + 1)
        return key
    token = secrets.token_hex(8)
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        if _create_local(path, token):
            break
        info = _read(path)
        host = socket.gethostname()
        hint = f"if no run uses {directory} any more, delete {path}"
        if info is None or info.get("host") != host or not isinstance(info.get("pid"), int):
            raise RunLockError(f"{directory} is in use by {_holder(info)}: one run per directory; {hint}")
        if pid_alive(info["pid"]):
            raise RunLockError(f"{directory} is in use by {_holder(info)}: one run per directory "
                               f"(wait for it, stop it, or point logging.run_dir / checkpoint.dir elsewhere)")
        # stale: its process is gone. Rename it away first (atomic: one taker wins), then create.
        stale = path.with_name(f"{LOCK_NAME}.stale-{info['pid']}-{token}")
        try:
            os.rename(path, stale)
        except FileNotFoundError:
            continue  # another run took it over first: retry the create (and meet its lock)
        message(f"took over the stale run lock of {_holder(info)} (process gone) in {directory}")
        with contextlib.suppress(OSError):
            stale.unlink()
    else:
        raise RunLockError(f"{directory}: could not create the run lock {path}")
    _HELD[key] = (path, token, 1)
    return key


def _release_one(key: str) -> None:
    path, token, depth = _HELD[key]
    if depth > 1:
        _HELD[key] = (path, token, depth - 1)
        return
    del _HELD[key]
    info = _read(path)
    if info is not None and info.get("token") == token:  # never remove a lock someone else took over
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def run_lock(directories: Sequence[str | os.PathLike | None], *,
             message: Callable[[str], None] | None = None) -> Iterator[None]:
    """Holds the run lock of each directory (None entries and duplicates ignored) while inside; all
    or none: a refusal releases those already taken. Only process 0 locks (module docstring)."""
    import jax

    if jax.process_index() != 0:
        yield
        return
    say = message or log.warning
    taken: list[str] = []
    seen: set[str] = set()
    try:
        for d in directories:
            if d is None or str(d) in seen:
                continue
            seen.add(str(d))
            key = _acquire_one(d, say)
            if key is not None:
                taken.append(key)
        yield
    finally:
        for key in reversed(taken):
            _release_one(key)


__all__ = ["LOCK_NAME", "RunLockError", "run_lock"]
