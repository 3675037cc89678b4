"""train.logging: metrics.jsonl records (fields, window means, array summaries), the console table,
wandb offline (files, no network) and disabled, resume truncation, eval records."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.train.test_train_toy import ToyBatches, toy_loss, toy_params
from train.config import LoggingConfig, TrainConfig, TrainerConfig, WandbConfig
from train.logging import MetricsLogger, array_summary, resolve_wandb_mode
from train.loop import run
from train.state import init_train_state
from train.step import make_train_step

COUNTS = np.array([[0, 2, 4, 2], [1, 1, 1, 1]], np.int32)  # [layers, experts]


def _records(run_dir):
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_array_summary_hand_computed():
    s = array_summary("expert_counts", COUNTS)
    # layer 0: max 4 / min clamped to 1 = 4; layer 1: 1; worst = 4. zeros: 1 of 8
    assert s == {"expert_counts.max_min_ratio": 4.0, "expert_counts.frac_zero": 0.125}


def test_metrics_jsonl_and_console(tmp_path, capsys):
    def loss_fn(params, batch, rng):
        loss, m = toy_loss(params, batch, rng)
        return loss, {**m, "expert_counts": jnp.asarray(COUNTS)}

    cfg = TrainerConfig(train=TrainConfig(steps=4, log_every=2, eval_every=4),
                        logging=LoggingConfig(run_dir=str(tmp_path), progress="off", wandb=WandbConfig(mode="disabled")))
    step_fn = make_train_step(loss_fn, optax.adam(1e-2))
    per_step = []
    res = run(step_fn, init_train_state(toy_params(), optax.adam(1e-2)), ToyBatches(seed=1), config=cfg,
              eval_fn=lambda state: {"loss": 1.25}, flops_per_step=1e6, peak_flops=1e9,
              on_step=lambda s, st, m: per_step.append(float(m["loss"])))
    assert res.step == 4 and not res.preempted
    recs = _records(tmp_path)
    assert [r["step"] for r in recs] == [2, 4]
    for r in recs:
        for k in ("step", "loss", "tokens_per_s", "steps_per_s", "grad_norm", "accuracy", "weight", "eta_s", "mfu"):
            assert k in r, k
        assert r["tokens_per_s"] > 0 and r["mfu"] == pytest.approx(1e6 * r["steps_per_s"] / 1e9)
        assert r["expert_counts"] == COUNTS.tolist()
        assert r["expert_counts.max_min_ratio"] == 4.0 and r["expert_counts.frac_zero"] == 0.125
    # a record holds the mean over the steps since the previous one
    assert recs[0]["loss"] == pytest.approx(np.mean(per_step[:2])) and recs[1]["loss"] == pytest.approx(np.mean(per_step[2:]))
    assert recs[1]["eval/loss"] == 1.25 and "eval/loss" not in recs[0]
    # throughput over the timed steps (step 1, with compilation, is not one): 8 x 6 tokens a step
    assert recs[0]["tokens_per_s"] == pytest.approx(48 * recs[0]["steps_per_s"], rel=1e-9)

    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if "grad_norm" in ln)
    assert "step" in header and "loss" in header and "tok/s" in header and "eta" in header
    row = next(ln for ln in out.splitlines() if ln.strip().startswith("2/4"))
    assert f"{recs[0]['loss']:.4f}" in row and "max/min=4.00" in row and "empty=12.5%" in row
    assert "[[0" not in out  # raw per-expert arrays stay out of the console
    assert "eval/loss=1.25" in out


def test_resume_drops_records_of_rerun_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": float(s), "tokens_per_s": 1.0}) for s in range(1, 6)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "lo')  # the last line torn by a kill
    log = MetricsLogger(LoggingConfig(run_dir=str(tmp_path), progress="off", console_every=0,
                                      wandb=WandbConfig(mode="disabled")), total_steps=10)
    log.start(3)
    log.record(4, {"loss": jnp.asarray(9.0)}, 10)
    log.close()
    assert [(r["step"], r["loss"]) for r in _records(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 9.0)]


def test_wandb_offline_writes_its_dir_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # a closed port: any network use would fail
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLogger(LoggingConfig(run_dir=str(tmp_path), progress="off", console_every=0,
                                      wandb=WandbConfig(mode="offline", project="t")), total_steps=2,
                        run_config={"train": {"steps": 2}})
    log.start(0)
    log.record(1, {"loss": jnp.asarray(2.0)}, 8)
    log.record(2, {"loss": jnp.asarray(1.5)}, 8)
    log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb")), list(tmp_path.rglob("*"))
    run_id = (tmp_path / "wandb_run_id.txt").read_text()
    assert runs[0].name.endswith(run_id)
    assert [r["loss"] for r in _records(tmp_path)] == [2.0, 1.5]


def test_wandb_disabled_writes_nothing_and_mode_resolution(tmp_path, monkeypatch):
    log = MetricsLogger(LoggingConfig(run_dir=str(tmp_path), progress="off", wandb=WandbConfig(mode="disabled")),
                        total_steps=1)
    log.start(0)
    log.record(1, {"loss": jnp.asarray(1.0)}, 1)
    log.close()
    assert not (tmp_path / "wandb").exists() and (tmp_path / "metrics.jsonl").exists()
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert resolve_wandb_mode(None) == "offline"  # the project default: never the network unless asked
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode(None) == "disabled" and resolve_wandb_mode("online") == "online"
    monkeypatch.setenv("WANDB_MODE", "bogus")
    with pytest.raises(ValueError, match="WANDB_MODE or logging.wandb.mode"):
        resolve_wandb_mode(None)


def test_progress_bar_shows_steps(tmp_path, capsys):
    log = MetricsLogger(LoggingConfig(run_dir=str(tmp_path), progress="on", console_every=0,
                                      wandb=WandbConfig(mode="disabled")), total_steps=3)
    log.start(0)
    for s in (1, 2, 3):
        log.record(s, {"loss": jnp.asarray(0.5)}, 4)
    log.close()
    err = capsys.readouterr().err
    assert "3/3" in err and "loss=0.5000" in err, err
