"""The SFT recipe with `lora:` (sft.lora, sft.adapter_export): what trains, in which dtype, exact
resume, the merged export and the PEFT adapter (`export.adapters`, `launch.py export --adapters`).

One tiny run (2-layer tiny-qwen3.6, real vocabulary, bf16 compute, rank-4 adapters on the default
targets with dropout 0.1, a fp32 qwen export and its adapter, checkpoints of the trained params
only) of 4 steps, and the same run resumed from its step-2 checkpoint to 4; checked against the init params read back from the checkpoint (frozen:
bit-identical, in bf16), the uninterrupted run (resume: bit-identical losses and params), the
adapted model's forward (the merged HF export) and transformers + peft (the adapter on the init
checkpoint gives the merged export's logits).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.model import lora
from clover_jax.model.params import flatten

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4

YAML = """\
base_config: {base}
model:
  init_from: {init}
  num_hidden_layers: 2
  layer_types: [linear_attention, full_attention]
  block_size: 16
  dtype: bfloat16
data:
  seq_len: 64
  batch_size: 2
  eval_fraction: 0.1
  sources:
    - {{name: synthetic, format: synthetic, options: {{n_records: 120, seed: 0}}}}
eval: {{t_values: [0.5], max_batches: 1, decode: {{every: 0}}}}
lora: {{rank: 4, alpha: 8, dropout: 0.1}}
train: {{steps: {steps}, eval_every: 0, log_every: 1, seed: 7, compiler_options: {{cpu: {{xla_backend_optimization_level: 0}}}}}}
optimizer: {{lr: 1.0e-2, warmup_steps: 1}}
checkpoint: {{every_steps: 2, keep: 10, async_save: false, save_frozen: false}}
logging: {{run_dir: {run}, console_every: 1, progress: "off", wandb: {{mode: disabled}}}}
export: {{dir: {run}/hf, dtype: float32, format: qwen, adapters: true}}
devices: 1
count_flops: false
"""


def _cfg(tmp: Path, run: Path, init: Path, steps: int, *over: str):
    from sft.config import load_sft_config

    f = tmp / f"{run.name}_{steps}.yaml"
    f.write_text(YAML.format(base=ROOT / "configs" / "sft_tiny.yaml", init=init, run=run, steps=steps))
    return load_sft_config(f, list(over))


def _run(cfg) -> tuple[dict, list[float]]:
    """Final params (host, flat) and the logged losses of `run_sft(cfg)`."""
    from sft.recipe import run_sft

    final: dict = {}

    def on_step(step, state, metrics):
        if step == cfg.train.steps:
            final.update(flatten(jax.device_get(state.params)))

    run_sft(cfg, on_step=on_step, print_fn=lambda *_: None)
    rows = [json.loads(x) for x in (Path(cfg.logging.run_dir) / "metrics.jsonl").read_text().splitlines()]
    return final, [r["loss"] for r in rows if "loss" in r and "step" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from sft.recipe import load_params, prepare

    tmp = tmp_path_factory.mktemp("lora")
    run_a, run_b = tmp / "a", tmp / "b"
    init = run_a / "init_hf"  # written by the first run (generate_missing), read by the second
    cfg_a = _cfg(tmp, run_a, init, STEPS)
    final_a, losses_a = _run(cfg_a)
    # run b = run a stopped after step 2 (its run dir up to the step-2 checkpoint), resumed to the end
    shutil.copytree(run_a, run_b, ignore=shutil.ignore_patterns("hf", "init_hf", str(STEPS)))
    final_b, losses_b = _run(_cfg(tmp, run_b, init, STEPS, "export.enabled=false", "export.adapters=false"))
    assert sorted(p.name for p in (run_b / "checkpoints").iterdir() if p.name.isdigit()) == ["2", str(STEPS)]
    setup = prepare(cfg_a)
    start = flatten(jax.device_get(load_params(setup.kind, setup.init_path, setup.model_cfg, cfg_a.model.seed)))
    return {"cfg": cfg_a, "setup": setup, "start": start, "a": final_a, "b": final_b, "run": run_a,
            "losses_a": losses_a, "losses_b": losses_b, "tmp": tmp}


def test_only_adapters_and_full_trainables_train_and_the_base_stays_in_bf16(runs):
    start, final = runs["start"], runs["a"]
    assert set(start) == set(final)
    full = runs["cfg"].lora.full_trainable
    changed = {k for k in final if not np.array_equal(np.asarray(start[k]), np.asarray(final[k]))}
    adapters = {k for k in final if lora.is_adapter(k)}
    assert adapters and {k for k in adapters if k.endswith("lora_b")} <= changed  # B moved off zero
    for k in final:
        if lora.is_adapter(k) or any(re.search(p, k) for p in full):
            assert final[k].dtype == np.float32, k  # fp32 masters
        elif k not in changed:
            assert final[k].dtype == jnp.bfloat16 or k.endswith(("A_log", "dt_bias")), (k, final[k].dtype)
    frozen_changed = {k for k in changed if not lora.is_adapter(k) and not any(re.search(p, k) for p in full)}
    assert not frozen_changed, sorted(frozen_changed)[:5]
    assert any(re.search(r"bd_gdn_softmax_scalars$", k) for k in changed)  # full-trainable params train


def test_a_resumed_run_is_bit_identical(runs):
    """Resumed from a checkpoint of the trained params only (`checkpoint.save_frozen: false`: the
    frozen base re-read from the init checkpoint): the same losses and params as the run itself."""
    la, lb = runs["losses_a"], runs["losses_b"]
    assert len(la) == STEPS and lb == la
    for k in runs["a"]:
        np.testing.assert_array_equal(np.asarray(runs["a"][k]), np.asarray(runs["b"][k]), err_msg=k)
    import orbax.checkpoint as ocp

    meta = ocp.StandardCheckpointer().metadata((runs["run"] / "checkpoints" / "2" / "params").absolute())
    saved = {m.name for m in jax.tree.leaves(getattr(meta, "item_metadata", meta).tree) if hasattr(m, "shape")}
    full = runs["cfg"].lora.full_trainable
    assert saved == {k for k in runs["a"] if lora.is_adapter(k) or any(re.search(p, k) for p in full)}


def test_a_merged_export_of_the_training_checkpoint_is_the_runs_own(runs, tmp_path, capsys):
    """`launch.py export --checkpoint <run>/checkpoints` of a run that saved only its trained
    params (the base re-read from its init) writes the tensors of the run's end-of-run export."""
    from tests.hf_fixtures import read_all_tensors
    from tests.launch.launch_utils import run_main

    out = tmp_path / "merged"
    rc, _, err = run_main(["export", "--checkpoint", str(runs["run"] / "checkpoints"), "--out", str(out)], capsys)
    assert rc == 0, err
    got, want = read_all_tensors(out), read_all_tensors(runs["cfg"].export_dir)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_the_merged_export_is_the_adapted_model(runs):
    """The run's HF export (adapters merged, a plain checkpoint: no adapter tensors, no LoRA in its
    config) gives the adapted model's logits (fp32)."""
    from flax import nnx

    from clover_jax.api import load_hf
    from clover_jax.model.clover_model import model_from_params
    from clover_jax.model.params import unflatten

    out = Path(runs["cfg"].export_dir)
    assert "lora" not in (out / "config.json").read_text()
    mcfg, exported = load_hf(out, dtype=jnp.float32)
    assert mcfg.lora_rank == 0
    adapted_cfg = runs["setup"].model_cfg.replace(dtype="float32", param_dtype="float32")
    adapted = model_from_params(adapted_cfg, unflatten(runs["a"]))
    ids = jax.random.randint(jax.random.key(0), (2, 32), 0, 1000)
    fwd = nnx.jit(lambda m, ids: m(ids))
    want, got = fwd(adapted, ids), fwd(exported, ids)
    assert float(jnp.max(jnp.abs(want - fwd(model_from_params(lora.base_config(adapted_cfg), unflatten(
        {k: v for k, v in runs["start"].items() if not lora.is_adapter(k)})), ids)))) > 0  # the tuning shows
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_lora_with_optimizer_trainable_is_refused(tmp_path):
    from clover_jax.yaml_config import ConfigError
    from sft.lora import optimizer_config

    cfg = _cfg(tmp_path, tmp_path / "r", tmp_path / "r" / "init", 2, "optimizer.trainable=['gdn']")
    with pytest.raises(ConfigError, match="lora.full_trainable"):
        optimizer_config(cfg)
    with pytest.raises(ConfigError, match="lora.dropout"):
        _cfg(tmp_path, tmp_path / "r", tmp_path / "r" / "init", 2, "lora.dropout=1.0")


# ------------------------------------------------------------------------------------ PEFT adapter
REL = 2e-5


def test_the_runs_adapter_on_transformers_gives_its_merged_exports_logits(runs):
    import peft
    from transformers import Qwen3_5MoeForCausalLM

    from tests.hf_fixtures import hf_logits

    run = runs["run"]
    adapter = run / "adapter"
    info = json.loads((adapter / "clover_export.json").read_text())
    assert info["step"] == STEPS and info["run_dir"] == str(run.absolute())
    assert info["left_out_trained_in_full"]  # block mode: the Clover scalars / right taps, trained in full
    base = lambda: Qwen3_5MoeForCausalLM.from_pretrained(run / "init_hf", attn_implementation="eager",  # noqa: E731
                                                         dtype="float32").eval()
    ids = np.random.default_rng(0).integers(0, 248000, (2, 17))
    adapted = hf_logits(peft.PeftModel.from_pretrained(base(), str(adapter)).eval(), ids)
    merged = hf_logits(Qwen3_5MoeForCausalLM.from_pretrained(runs["cfg"].export_dir, attn_implementation="eager",
                                                             dtype="float32").eval(), ids)
    err = np.max(np.abs(adapted - merged)) / np.max(np.abs(merged))
    moved = np.max(np.abs(hf_logits(base(), ids) - merged)) / np.max(np.abs(merged))
    assert err <= REL and moved > 10 * REL, (err, moved)  # the steps moved B off zero


def test_launch_export_adapters_from_the_training_checkpoint(runs, tmp_path, capsys):
    from tests.hf_fixtures import read_all_tensors
    from tests.launch.launch_utils import run_main

    run = runs["run"]
    out = tmp_path / "adapter"
    rc, _, err = run_main(["export", "--checkpoint", str(run / "checkpoints"), "--out", str(out), "--adapters"], capsys)
    assert rc == 0, err
    got, want = read_all_tensors(out), read_all_tensors(run / "adapter")
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    assert (out / "adapter_config.json").read_bytes() == (run / "adapter" / "adapter_config.json").read_bytes()
    # not a training checkpoint / an option that does not apply: one clear line each
    rc, _, err = run_main(["export", "--checkpoint", str(run / "init_hf"), "--out", str(tmp_path / "x"), "--adapters"],
                          capsys)
    assert rc == 1 and "--adapters needs the training checkpoint of a LoRA run" in err
    rc, _, err = run_main(["export", "--checkpoint", str(run / "checkpoints"), "--out", str(tmp_path / "y"),
                           "--adapters", "--format", "clover"], capsys)
    assert rc == 1 and "--format clover does not apply" in err


def test_adapter_dir_rules(runs, tmp_path):
    import dataclasses

    from clover_jax.yaml_config import ConfigError
    from sft.adapter_export import check_adapter_export

    cfg, run = runs["cfg"], runs["run"]
    check_adapter_export(cfg, [])  # a rerun of this run may replace its own adapter
    other = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, run_dir=str(tmp_path / "other")))
    with pytest.raises(ConfigError, match="export of another run"):
        check_adapter_export(other, [], out=run / "adapter")
    with pytest.raises(ConfigError, match=r"full_trainable.*input_norm.*merged checkpoint"):
        lc = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, full_trainable=(r"\.input_norm\.scale$",)))
        check_adapter_export(lc, ["groups.layer_0.input_norm.scale"], out=tmp_path / "z")
    with pytest.raises(ConfigError, match=r"export.adapters: true .*\(lora.rank 0\)"):
        _cfg(tmp_path, tmp_path / "r", tmp_path / "r" / "init", 2, "lora.rank=0")
