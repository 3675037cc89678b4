"""Faults through `launch.py sft` (in-process, the scaled-down recipe of test_sft_recipe): divergence
(optimizer.lr=1e4) exits non-zero with one line naming the step, exports nothing and leaves only
finite checkpoints; a second run on a busy run dir is refused within seconds (exit 2, the holder's
PID); a resume under another train.seed (a key that must match) is refused with the diff (exit 2),
and with train.resume=force it resumes and logs it. One train step compile: the later runs compile
the same program, served by the suite's persistent compilation cache (tests/conftest.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.launch.launch_utils import run_main
from tests.sft.test_sft_recipe import ROOT, TEST_YAML


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from sft.config import load_sft_config
    from sft.recipe import generate_init_checkpoint

    tmp = tmp_path_factory.mktemp("faults")
    run = tmp / "run"
    cfg = tmp / "c.yaml"
    cfg.write_text(TEST_YAML.format(base=ROOT / "configs" / "sft_tiny.yaml", init=tmp / "init", run=run, steps=4))
    generate_init_checkpoint(load_sft_config(cfg))
    return dict(tmp=tmp, run=run, cfg=cfg)


FAST = ["count_flops=false", "train.eval_every=0", "checkpoint.every_steps=1"]


def test_divergence_busy_dir_and_resume_config_check(setup, capsys):
    from train.checkpoint import Checkpointer
    from train.config import CheckpointConfig

    run, cfg = setup["run"], str(setup["cfg"])
    # 1) lr=1e4: finite step 1 (saved), NaN from step 2: stop, no save after it, no export, exit 1
    rc, out, err = run_main(["sft", "--config", cfg, *FAST, "optimizer.lr=1e4"], capsys)
    assert rc == 1, (out[-2000:], err[-2000:])
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "non-finite loss / gradient at step 2" in errors[0], err[-2000:]
    assert not (run / "hf").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    ck = Checkpointer(CheckpointConfig(dir=str(run / "checkpoints")))
    meta = ck.manager.item_metadata(1)["params"]
    params = ck.restore_params(jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), meta.tree))
    ck.close()
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
    assert json.loads((run / "summary.json").read_text())["nonfinite_step"] == 2

    # 2) a live process holds the run dir: refused before any work, within seconds
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (run / ".run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid, "token": "t"}))
        t0 = time.perf_counter()
        rc, out, err = run_main(["sft", "--config", cfg, *FAST, "optimizer.lr=1e4"], capsys)
        assert rc == 2 and time.perf_counter() - t0 < 10, (rc, err)
        assert f"PID {holder.pid} on host {socket.gethostname()}" in err and len(err.strip().splitlines()) == 1, err
    finally:
        holder.kill()
        holder.wait()
    # 3) the holder is gone: its lock is stale. A resume under another train.seed is refused with the diff
    rc, out, err = run_main(["sft", "--config", cfg, *FAST, "optimizer.lr=1e4", "train.seed=8"], capsys)
    assert rc == 2 and "took over the stale run lock" in out + err, (out[-2000:], err[-2000:])
    assert "\n  train.seed: 7 -> 8\n" in err and "train.resume=force" in err, err[-2000:]
    assert "optimizer" not in err.split("differences")[-1].split("resume anyway")[0].replace("optimizer, ", ""), err
    # 4) forced: resumes from step 1 (train.steps=1: nothing left to train) and says what differed
    rc, out, err = run_main(["sft", "--config", cfg, *FAST, "optimizer.lr=1e4", "train.seed=8", "train.resume=force",
                             "train.steps=1", "export.dir=null"], capsys)
    assert rc == 0, (out[-2000:], err[-2000:])
    assert "train.resume=force: resuming" in out and "train.seed: 7 -> 8" in out and "resumed from checkpoint step 1" in out
    assert not (run / ".run.lock").exists() and not (run / "checkpoints" / ".run.lock").exists()
