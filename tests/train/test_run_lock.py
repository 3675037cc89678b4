"""train.run_lock: one writer per run dir. A live holder (here: a real other process) is refused at
once with its host and PID, before the checkpoint manager could delete its save in flight; a dead
holder's stale lock is taken over with a log line; another host's lock is refused with how to remove
it; the lock is re-entrant in one process and gone after the run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.train.toy_loop import steps_on_disk, toy_run


def _hold(directory, pid, host=None):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".run.lock").write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid,
                                                     "token": "x", "started": "then"}))


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_busy_run_dir_is_refused_at_once_and_the_holders_save_in_flight_survives(tmp_path, live_pid):
    from train.run_lock import RunLockError

    ck = tmp_path / "ckpt"
    toy_run(tmp_path / "run", ck, steps=4, every=4)
    inflight = ck / "8.orbax-checkpoint-tmp"  # the holder's save being written
    inflight.mkdir()
    _hold(ck, live_pid)
    t0 = time.perf_counter()
    with pytest.raises(RunLockError) as e:
        toy_run(tmp_path / "run", ck, steps=12, every=4)
    assert time.perf_counter() - t0 < 5
    msg = str(e.value)
    assert "\n" not in msg and f"PID {live_pid} on host {socket.gethostname()}" in msg and str(ck) in msg, msg
    assert inflight.is_dir() and steps_on_disk(ck) == [4]  # nothing of the holder's was touched
    assert not (tmp_path / "run" / ".run.lock").exists()  # all or none: the run dir lock was given back


def test_stale_lock_of_a_dead_process_is_taken_over_and_released_after(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # dead (and reaped): its PID names no process
    _hold(tmp_path / "run", proc.pid)
    msgs: list[str] = []
    res = toy_run(tmp_path / "run", None, steps=2, messages=msgs)
    assert res.step == 2
    assert any(m.startswith("took over the stale run lock of PID %d" % proc.pid) for m in msgs), msgs
    assert not (tmp_path / "run" / ".run.lock").exists()


def test_lock_of_another_host_is_refused_with_how_to_remove_it(tmp_path):
    from train.run_lock import RunLockError, run_lock

    _hold(tmp_path / "run", os.getpid(), host="some-other-host")
    with pytest.raises(RunLockError, match=r"PID \d+ on host some-other-host .*delete .*\.run\.lock"):
        with run_lock([tmp_path / "run"]):
            pass


def test_reentrant_in_one_process_and_exclusive_across_processes(tmp_path):
    from train.run_lock import run_lock

    code = ("import sys; sys.path.insert(0, %r)\nfrom train.run_lock import run_lock, RunLockError\n"
            "try:\n    run_lock([%r]).__enter__()\nexcept RunLockError as e:\n    print(e); sys.exit(2)\n"
            % (os.getcwd(), str(tmp_path / "d")))
    with run_lock([tmp_path / "d"]):
        with run_lock([tmp_path / "d", None]):
            pass
        assert (tmp_path / "d" / ".run.lock").exists()  # the inner exit kept it
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert other.returncode == 2 and f"PID {os.getpid()}" in other.stdout, other
    assert not (tmp_path / "d" / ".run.lock").exists()
