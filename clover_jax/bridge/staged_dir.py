"""Write a whole directory atomically: build it in a hidden temp sibling, rename it into place.

Used by the params checkpoint (`params_checkpoint.write_params_checkpoint`) and the HF export
(`convert._write_hf_dir`): everything (weights, index, configs, tokenizer files) goes into
``.{name}.partial-{host}-{pid}-{hex}`` beside the target, and only a complete directory is renamed
to the target. Invariants:

* a failure anywhere (an exception, including KeyboardInterrupt) deletes the temp dir and leaves the
  previous target exactly as it was (absent, or the old directory);
* a replaced target is moved aside (``.{name}.old-{hex}``) before the rename and deleted only once
  the new one is in place, so there is no moment without a complete target on a crash-free path;
* a temp dir left by a killed process (SIGKILL, power loss) is clearly named and is removed by the
  next write of the same target on the same host once its writer's pid is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = ["clean_stale_partials", "pid_alive", "staged_dir", "swap_into_place"]


def _host() -> str:
    # the pid test below is only meaningful on the host that wrote the temp dir (shared filesystems)
    return socket.gethostname().replace("-", "_") or "host"


def pid_alive(pid: int) -> bool:
    """A live, non-zombie process with this PID on this host (also `train.run_lock`'s stale-lock test)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return "Z" not in line.split()[1]
    except OSError:
        pass
    return True


def clean_stale_partials(out: Path) -> list[Path]:
    """Deletes ``out``'s temp siblings left by dead writers of this host; returns what it deleted.
    Live writers' (and other hosts') temp dirs are never touched."""
    removed = []
    prefix = f".{out.name}.partial-{_host()}-"
    if not out.parent.is_dir():
        return removed
    for p in out.parent.glob(f".{out.name}.partial-*"):
        if not p.name.startswith(prefix):
            continue
        pid = p.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def swap_into_place(tmp: Path, out: Path) -> None:
    """rename(tmp, out); an existing ``out`` is moved aside first and deleted only once the new one
    is in place (and put back if the rename fails)."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)  # put the previous target back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(out: str | Path) -> Iterator[Path]:
    """Yields a fresh empty temp dir beside ``out``; a clean exit of the block renames it to ``out``
    (`swap_into_place`: an existing ``out`` is replaced whole, so the caller decides beforehand
    whether replacing is allowed), an exception deletes it and re-raises. Stale temp dirs of ``out``
    (`clean_stale_partials`) are removed first."""
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_partials(out)
    tmp = out.parent / f".{out.name}.partial-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
