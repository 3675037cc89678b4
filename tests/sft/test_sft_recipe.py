"""The SFT recipe end to end (sft.recipe, launch.py sft), on configs/sft_tiny.yaml scaled down: a
2-layer tiny-qwen3.6 (the real vocabulary and tokenizer), 64-token rows, synthetic agent traces.

(a) an uninterrupted run (a subprocess) writes metrics.jsonl (with the held-out eval), checkpoints
    and an HF export that loads back equal to the final checkpoint, with the mask token in config
    and tokenizer;
(b) the same run SIGKILLed mid-way (the worker), then resumed by a real `launch.py sft` process
    that the test SIGTERMs from outside once its loop runs: it exits 143 with a checkpoint of its
    last finished step (no periodic save due), and a second `launch.py sft` resumes from that
    checkpoint to the end; the losses and evals are bit-identical step for step to (a);
(c) bad input through `launch.py sft`: clear errors or counted skips, and an existing run's
    checkpoints and metrics are untouched (the record-level cases are in test_sft_converters.py
    and test_sft_pipeline.py);
(d) the SFT step on 8 simulated devices (an fsdp x expert mesh) gives the
    losses and metrics that (a) logged on 1 device;
(e) multi-size training: the block size of each update follows `draw_block_size`, also after a
    resume, each size compiled once (a stub step: the sizes' shapes are covered by test_sft_loss).

The subprocess runs share a persistent compilation cache, so only the first compiles, and every
compile here uses XLA's backend optimisation level 0 (`FAST`: same semantics, half the compile
time on CPU). Run as a script, this file is the worker (`_worker`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STEPS = 6
FAST = {"xla_backend_optimization_level": 0}


def _worker(argv: list[str]) -> int:
    import argparse

    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    p.add_argument("--kill-at", type=int)  # SIGKILL right after this step
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    from sft.config import load_sft_config
    from sft.recipe import run_sft

    def on_step(step, state, metrics):
        if step == a.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    res = run_sft(load_sft_config(a.config, a.overrides), on_step=on_step)
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(f"worker done: step={res.step} preempted={res.preempted} resumed_from={res.resumed_from}; "
          f"cpu {ru.ru_utime + ru.ru_stime:.1f} s, max rss {ru.ru_maxrss / 1e6:.2f} GB", flush=True)
    return 143 if res.preempted else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(_worker(sys.argv[1:]))

# ---------------------------------------------------------------------------------------------- tests
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import launch  # noqa: E402
from sft.noise import draw_block_size  # noqa: E402

TEST_YAML = """\
base_config: {base}
model:
  init_from: {init}
  num_hidden_layers: 2
  layer_types: [linear_attention, full_attention]
  block_size: 16
data:
  seq_len: 64
  batch_size: 2
  eval_fraction: 0.1
  sources:
    - {{name: synthetic, format: synthetic, options: {{n_records: 120, seed: 0}}}}
eval: {{t_values: [0.5], max_batches: 1}}
train: {{steps: {steps}, eval_every: 2, log_every: 1, seed: 7}}
optimizer: {{lr: 1.0e-3, warmup_steps: 2, frozen: ['^embed\.']}}
checkpoint: {{every_steps: 2, keep: 10, async_save: true}}
logging: {{run_dir: {run}, console_every: 1, progress: "off", wandb: {{mode: disabled}}}}
export: {{dir: {run}/hf, dtype: float32}}
devices: 1
"""


def _config(tmp: Path, run: Path, init: Path) -> Path:
    f = tmp / f"{run.name}.yaml"
    f.write_text(TEST_YAML.format(base=ROOT / "configs" / "sft_tiny.yaml", init=init, run=run, steps=STEPS))
    return f


def _spawn(cfg: Path, cache: Path, *extra: str, launch_py: bool = False) -> subprocess.Popen:
    """The worker on `cfg`, or with `launch_py` the real `launch.py sft --config cfg` (stderr merged
    into stdout); a background process, `_finish` waits for it. Matmuls at full fp32 precision in
    both (the worker sets it as tests/conftest.py, launch.py gets it from the environment)."""
    flags = os.environ.get("XLA_FLAGS", "") + "".join(f" --{k}={v}" for k, v in FAST.items())
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
           "JAX_DEFAULT_MATMUL_PRECISION": "highest", "WANDB_MODE": "disabled"}
    if launch_py:
        return subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "sft", "--config", str(cfg), *extra],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--config", str(cfg), *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _sigterm_after_logged_step(proc: subprocess.Popen, step: int) -> tuple[int, str, bool]:
    """Reads a `launch.py sft` process's output until its console row of `step` (printed inside the
    training loop, after the step), then sends SIGTERM from outside; (exit code, output, whether
    /proc showed the process catching SIGTERM when it was sent)."""
    lines, caught = [], False
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.strip().startswith(f"{step}/{STEPS} |") and not caught:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            sigcgt = int(next(ln for ln in status.splitlines() if ln.startswith("SigCgt:")).split()[1], 16)
            caught = bool(sigcgt >> (signal.SIGTERM - 1) & 1)
            proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=900), "".join(lines), caught


def _finish(proc: subprocess.Popen, want_rc: int, timeout: int = 900) -> str:
    """Waits for a worker; its stdout, after checking its exit code."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == want_rc, f"exit {proc.returncode} (want {want_rc})\n{out[-3000:]}\n{err[-3000:]}"
    print(*(ln for ln in out.splitlines() if ln.startswith("worker done")))  # its CPU time (pytest -s)
    return out


def _metrics(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _ckpt_steps(run: Path) -> list[int]:
    d = run / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The init checkpoint (here), then two workers side by side (2 cores): R0 uninterrupted on 1
    device and R8 on 8 devices (2 steps, no export); then, in a background thread while the other
    tests run, R1 (the worker, SIGKILL after step 3), R2 (`launch.py sft`: resumes from step 2,
    SIGTERMed from outside after it logged step 3) and R3 (`launch.py sft`: resumes from R2's
    checkpoint, runs to the end), which reuse R0's compiles. Only R0 counts FLOPs for the MFU
    (`count_flops`: a lowering of the unrolled stack). `runs["resume"]()` waits for R1, R2 and R3."""
    import threading

    from sft.config import load_sft_config
    from sft.recipe import generate_init_checkpoint

    tmp = tmp_path_factory.mktemp("sft")
    init = tmp / "init_hf"
    a, b, c = tmp / "run_a", tmp / "run_b", tmp / "run_8dev"
    cfg_a, cfg_b, cfg_8 = _config(tmp, a, init), _config(tmp, b, init), _config(tmp, c, init)
    generate_init_checkpoint(load_sft_config(cfg_a))
    p0 = _spawn(cfg_a, tmp / "cache_1dev")
    p8 = _spawn(cfg_8, tmp / "cache_8dev", "devices=8", "mesh.fsdp=2", "mesh.expert=4", "train.steps=2",
                "export.enabled=false", "count_flops=false")
    try:
        r0 = _finish(p0, 0)
    except BaseException:
        p8.kill()
        raise
    resume: dict = {}

    def kill_and_resume() -> None:
        try:
            # sync saves, so the step-2 checkpoint is complete when the kill comes
            extra = ("count_flops=false", "checkpoint.async_save=false")
            _finish(_spawn(cfg_b, tmp / "cache_1dev", "--kill-at", "3", *extra), -signal.SIGKILL)
            resume["steps_after_kill"] = _ckpt_steps(b)
            # R2, the real launch.py: no periodic saves (so the SIGTERM path writes the checkpoint),
            # SIGTERM from outside once it logged step 3; R3 resumes from what R2 saved to the end
            real = (*extra, "export.enabled=false")
            p2 = _spawn(cfg_b, tmp / "cache_1dev", *real, "checkpoint.every_steps=0", launch_py=True)
            resume["r2_rc"], resume["r2"], resume["r2_caught"] = _sigterm_after_logged_step(p2, 3)
            resume["steps_after_term"] = _ckpt_steps(b)
            resume["r3"] = _finish(_spawn(cfg_b, tmp / "cache_1dev", *real, launch_py=True), 0)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test that waits
            resume["error"] = e

    thread = threading.Thread(target=kill_and_resume, daemon=True)
    thread.start()
    r8 = _finish(p8, 0)

    def wait_resume() -> dict:
        thread.join()
        if "error" in resume:
            raise resume["error"]
        return resume

    return dict(tmp=tmp, init=init, a=a, b=b, c=c, cfg_a=cfg_a, cfg_b=cfg_b, r0=r0, r8=r8, resume=wait_resume)


def _init_tensor(init: Path, key: str) -> np.ndarray:
    """A tensor of the (bf16, hub-layout) init HF dir, as fp32."""
    from clover_jax.bridge.safetensors_io import SafetensorsIndex

    return np.asarray(SafetensorsIndex(init).get(key), np.float32)


def test_end_to_end_run_writes_metrics_checkpoint_and_loadable_export(runs):
    from clover_jax.api import load_hf
    from clover_jax.model.clover_model import model_to_params
    from clover_jax.bridge.tokenizer import load_tokenizer
    from train.checkpoint import Checkpointer
    from train.config import CheckpointConfig

    a = runs["a"]
    recs = _metrics(a)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for r in recs:
        assert {"loss", "tokens_per_s", "acc", "ce", "lb_loss", "num_masked", "grad_norm", "mfu"} <= set(r)
        assert np.isfinite(r["loss"]) and r["num_masked"] > 0 and 0 < r["mfu"] < 1
        assert r["tokens"] <= 2 * 64 and len(r["expert_counts"]) == 2
    # the held-out eval every 2 steps, at the fixed level t = 0.5 (the only one: eval/loss is its CE)
    evals = [r for r in recs if "eval/loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 6]
    for r in evals:
        assert r["eval/loss"] == r["eval/ce_t0.5"] and 0 <= r["eval/acc_t0.5"] <= 1
    # README: the main job's held-out masked-token CE falls (same held-out batches, eval after eval)
    ce = [r["eval/loss"] for r in evals]
    assert ce[0] > ce[1] > ce[2], ce
    assert _ckpt_steps(a) == [2, 4, 6]
    summary = json.loads((a / "summary.json").read_text())
    w = STEPS // 2
    assert summary["steps"] == STEPS and summary["window_steps"] == w and summary["flops_per_step"] > 1e9
    np.testing.assert_allclose(summary["train_loss_first"], np.mean([r["loss"] for r in recs[:w]]))
    np.testing.assert_allclose(summary["train_loss_last"], np.mean([r["loss"] for r in recs[-w:]]))
    # and the summary line the job prints says so: the held-out CE of the evals in the last window
    # (steps 4 and 6) below the first window's (step 2)
    np.testing.assert_allclose([summary["eval_loss_first"], summary["eval_loss_last"]], [ce[0], np.mean(ce[1:])])
    assert summary["eval_loss_last"] < summary["eval_loss_first"]
    assert "held-out masked CE (evals in those windows): " in runs["r0"]
    assert (a / "loss.png").is_file()

    hf = json.loads((a / "hf" / "config.json").read_text())
    assert hf["model_type"] == "clover_moe" and hf["mask_token_id"] == 248077
    tok = load_tokenizer(a / "hf", fresh=True)
    assert tok.convert_tokens_to_ids("<|mask|>") == 248077
    cfg, model = load_hf(a / "hf")
    assert cfg.mode == "block" and cfg.num_hidden_layers == 2 and cfg.block_sizes == (16,)
    exported = model_to_params(model)
    ck = Checkpointer(CheckpointConfig(dir=str(a / "checkpoints")))
    trained = ck.restore_params(exported)
    ck.close()
    flat_e = jax.tree_util.tree_leaves_with_path(exported)
    flat_t = jax.tree.leaves(trained)
    assert len(flat_e) == len(flat_t)
    for (path, e), t in zip(flat_e, flat_t):
        np.testing.assert_array_equal(np.asarray(e), np.asarray(t), err_msg=jax.tree_util.keystr(path))
    # training moved the weights away from the init checkpoint, except the frozen embedding
    np.testing.assert_array_equal(np.asarray(exported["embed"]["embedding"]),
                                  _init_tensor(runs["init"], "model.language_model.embed_tokens.weight"))
    lm0 = _init_tensor(runs["init"], "lm_head.weight").T  # HF [V, D] -> kernel [D, V]
    assert np.abs(np.asarray(exported["lm_head"]["kernel"]) - lm0).max() > 1e-4


BAD_CHAT = [
    '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}',
    '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}',  # torn line
    '{"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}',  # unknown role
    '{"messages": [{"role": "user", "content": "w?"}, {"role": "assistant", "content": "", "tool_calls": '
    '[{"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}',  # arguments not JSON
]


def _bad_case(tmp: Path, name: str, sources: str) -> Path:
    """run_a's config with other data sources (`sources` may carry more `data` keys after it)."""
    f = tmp / f"bad_{name}.yaml"
    f.write_text(f"base_config: {tmp / 'run_a.yaml'}\ndata:\n  sources: {sources}\n")
    return f


def test_bad_input_errors_and_counted_skips_keep_the_run(runs, capsys):
    from sft.config import load_sft_config
    from sft.recipe import prepare

    tmp, a = runs["tmp"], runs["a"]
    chat = tmp / "chat.jsonl"
    good = [BAD_CHAT[0].replace("hi", f"hi {i}") for i in range(20)]
    chat.write_text("\n".join(good + BAD_CHAT[1:]) + "\n")
    empty = tmp / "empty.jsonl"
    empty.write_text("")
    before = (_ckpt_steps(a), (a / "metrics.jsonl").read_bytes(), (a / "summary.json").read_bytes())

    # counted skips: the torn line, the unknown role, the non-JSON tool arguments (3 of 23 records)
    f = _bad_case(tmp, "skip", f"[{{name: chat, path: {chat}}}]\n  max_bad_fraction: 0.2")
    st = prepare(load_sft_config(f)).data.load_stats()["chat"]
    assert (st["read"], st["bad"], st["kept"]) == (23, 3, 20)
    assert st["first_bad"].startswith(f"{chat}:21: ")

    cases = {
        "too_many_bad": (f"[{{name: chat, path: {chat}}}]", [f"{chat}:21", "max_bad_fraction"]),
        "fail_fast": (f"[{{name: chat, path: {chat}}}]\n  on_bad: fail", [f"{chat}:21"]),
        "empty": (f"[{{name: e, path: {empty}}}]", [f"{empty}: no records"]),
        "missing": (f"[{{name: m, path: {tmp / 'nope.jsonl'}}}]", ["nope.jsonl"]),
        "weight": (f"[{{name: w, path: {chat}, weight: 0}}]", ["weight", "> 0"]),
    }
    for name, (src, needles) in cases.items():
        rc = launch.main(["sft", "--config", str(_bad_case(tmp, name, src))])
        err = capsys.readouterr().err
        assert rc == (2 if name in ("too_many_bad", "fail_fast", "empty") else 1), (name, err)  # 2: a user's file
        for n in needles:
            assert n in err, (name, n, err)
    # unknown config key: named, with the nearest valid one
    rc = launch.main(["sft", "--config", str(runs["cfg_a"]), "train.step=3"])
    assert rc == 1 and "'train.steps'" in capsys.readouterr().err
    # nothing already trained is lost
    assert (_ckpt_steps(a), (a / "metrics.jsonl").read_bytes(), (a / "summary.json").read_bytes()) == before


def test_sft_run_on_8_devices_equals_1_device(runs):
    """R8, the recipe on an fsdp x expert mesh of 8 simulated devices (fsdp 2 x expert 4: the expert
    parallel path), against R0 on 1 device: the same init, batches and rngs, so the logged losses
    agree to fp32 round-off, step for step (update 1 is in the warmup, whose
    learning rate does not depend on train.steps), counts and routing exactly, the held-out eval
    after step 2 too; and the run writes its checkpoint (and measures the peak off the mesh: a
    one-device matmul inside the mesh context fails)."""
    assert "mesh {'data': 1, 'fsdp': 2, 'expert': 4, 'context': 1, 'tensor': 1}" in runs["r8"]
    r0, r8 = _metrics(runs["a"])[:2], _metrics(runs["c"])
    assert [r["step"] for r in r8] == [1, 2]
    for m8, m1 in zip(r8, r0):
        for k in ("loss", "ce", "grad_norm", "lb_loss") + (("eval/loss",) if "eval/loss" in m1 else ()):
            np.testing.assert_allclose(m8[k], m1[k], rtol=2e-5, err_msg=f"step {m1['step']}: {k}")
        for k in ("num_masked", "tokens", "weight", "acc", "expert_counts"):
            assert m8[k] == m1[k], (m1["step"], k)
    assert "eval/loss" in r8[1] and r0[0]["loss"] != r0[1]["loss"]  # the second step saw the first update
    assert _ckpt_steps(runs["c"]) == [2]
    assert json.loads((runs["c"] / "summary.json").read_text())["peak_flops"] > 0


def test_init_from_orbax_equals_init_from_hf(runs):
    """`model.init_from` = the Orbax params checkpoint that `launch.py convert` makes of the (AR,
    Qwen-format) init dir: same block-mode params as reading the HF dir (the Clover params at their
    init values), same mask token (the recorded source dir's tokenizer)."""
    from clover_jax.bridge.convert import convert_hf_to_orbax
    from sft.config import load_sft_config
    from sft.recipe import load_params, prepare

    orbax = convert_hf_to_orbax(runs["init"], runs["tmp"] / "init_orbax", overwrite=True)
    setup_h = prepare(load_sft_config(runs["cfg_a"]))
    setup_o = prepare(load_sft_config(runs["cfg_a"], [f"model.init_from={orbax}"]))
    assert (setup_h.kind, setup_o.kind) == ("hf", "orbax")
    assert setup_o.model_cfg == setup_h.model_cfg and setup_o.model_cfg.mask_token_id == 248077
    ph = load_params("hf", setup_h.init_path, setup_h.model_cfg, 0)
    po = load_params("orbax", setup_o.init_path, setup_o.model_cfg, 0)
    fh, fo = jax.tree_util.tree_leaves_with_path(ph), jax.tree.leaves(po)
    assert len(fh) == len(fo)
    for (path, a), b in zip(fh, fo):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    scal = np.asarray(po["groups"]["layer_0"]["gdn"]["bd_gdn_softmax_scalars"])
    np.testing.assert_allclose(scal[..., 0], 4.0)  # alpha = sqrt(dk = 16), beta 0, gamma 1
    np.testing.assert_array_equal(scal[..., 1:], np.broadcast_to([0.0, 1.0], scal[..., 1:].shape))


def test_multi_size_steps_follow_the_draw_and_resume():
    """`BlockSizeSteps` with a stub setup: update s runs the step of `draw_block_size(sizes, seed,
    s)` (the step adds its block size to a counter), each size is compiled once, the metrics name
    the size, and a run resumed at update 3 continues the same sequence."""
    from types import SimpleNamespace
    from typing import NamedTuple

    import jax.numpy as jnp

    from sft.recipe import BlockSizeSteps

    class S(NamedTuple):
        step: jax.Array
        total: jax.Array

    made = []

    def make_step(bk):
        made.append(bk)
        return jax.jit(lambda st, b: (S(st.step + 1, st.total + bk * b), {"loss": jnp.float32(bk)}))

    sizes, seed = (8, 16, 32), 3
    abstract = S(jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    setup = SimpleNamespace(block_sizes=sizes, cfg=SimpleNamespace(train=SimpleNamespace(seed=seed, steps=8),
                                                                   model=SimpleNamespace(block_size_schedule=None)),
                            make_step=make_step, abstract_state=abstract)
    want = [draw_block_size(sizes, seed, s) for s in range(8)]
    assert len(set(want)) == 3  # every size drawn (this seed)
    steps, st, got = BlockSizeSteps(setup, jax.ShapeDtypeStruct((), jnp.int32)), S(jnp.int32(0), jnp.int32(0)), []
    for _ in range(8):
        st, m = steps(st, jnp.int32(1))
        got.append(m["block_size"])
        assert float(m["loss"]) == m["block_size"]
    assert got == want and int(st.total) == sum(want) and sorted(made) == sorted(sizes)
    resumed, st = BlockSizeSteps(setup, jax.ShapeDtypeStruct((), jnp.int32)), S(jnp.int32(3), jnp.int32(0))
    got = []
    for _ in range(5):
        st, m = resumed(st, jnp.int32(1))
        got.append(m["block_size"])
    assert got == want[3:]


def test_agent_mix_recipe_parses_and_builds_its_data_mix(tok):
    """configs/agent_mix.yaml, the 35B recipe, without the 35B weights: the model spec (HF init
    path, block mode, block 32), rows of 8192, the v5p-64 mesh (32 chips: fsdp 32), and
    the agent mix over ../shared/data: every source opens with records and few bad ones, and a
    packed row of 8192 tokens comes out block-aligned."""
    from dataclasses import replace

    from clover_jax.config import ModelConfig
    from clover_jax.model.clover_model import check_block_aligned
    from sft.config import load_sft_config, model_config_from
    from sft.data import SFTData

    data_root = ROOT.parent / "shared" / "data"
    cfg = load_sft_config(ROOT / "configs" / "agent_mix.yaml", [f"data_root={data_root}"])
    assert cfg.model.init_from.endswith("Qwen3.6-35B-A3B") and cfg.model.preset is None
    m = model_config_from(cfg.model, ModelConfig())  # ModelConfig() is the Qwen3.6-35B-A3B architecture
    assert (m.mode, m.block_sizes, m.hidden_size, m.num_hidden_layers, m.num_experts) == ("block", (32,), 2048, 40, 256)
    assert cfg.data.seq_len == 8192 and cfg.data.seq_len % 32 == 0 and cfg.export.format == "clover"
    assert cfg.mesh.axis_sizes(32) == {"data": 1, "fsdp": 32, "expert": 1, "context": 1, "tensor": 1}
    assert Path(cfg.data_root) == data_root.resolve()
    assert len(cfg.data.sources) >= 10 and all(s.weight > 0 for s in cfg.data.sources)
    assert {s.format for s in cfg.data.sources} >= {"bfcl", "tau_bench", "when2call", "toolbench", "swe_agent"}
    data = SFTData(replace(cfg.data, batch_size=1), tok)
    stats = data.load_stats()
    assert set(stats) == {s.name for s in cfg.data.sources}
    for name, st in stats.items():
        assert st["train"] > 0 and st["bad"] <= cfg.data.max_bad_fraction * st["read"], (name, st)
    row = next(data.train_iterator())
    assert row["input_ids"].shape == (1, 8192) and row["loss_mask"].any()
    check_block_aligned(row["segment_ids"], 32)


def test_sigkill_then_real_sigterm_and_resume_are_bit_exact(runs):
    """Last in the file: it waits for R1, R2 and R3 (see `runs`)."""
    a, b = runs["a"], runs["b"]
    res = runs["resume"]()
    # killed after step 3: the newest complete checkpoint is step 2 (step 4's was never due)
    assert res["steps_after_kill"] == [2]
    out = res["r2"]
    assert "resumed from checkpoint step 2" in out
    # the external SIGTERM reached the loop's handler (caught, not the default exit) after step 3:
    # exit 143, and a checkpoint of the last finished step n (no periodic save was due in R2) written
    # before the exit; n is 3 or 4 (the signal lands after step 3 was logged: in the wait for batch 4,
    # or inside step 4)
    assert res["r2_caught"], out[-3000:]
    assert res["r2_rc"] == launch.EXIT_PREEMPTED, out[-3000:]
    stopped = re.findall(r"SIGTERM received(?: while waiting for data)?: stopped after step (\d+)", out)
    assert len(stopped) == 1 and 3 <= int(stopped[0]) < STEPS, out[-3000:]
    n = int(stopped[0])
    assert res["steps_after_term"] == [2, n]
    # R3 resumed from it (complete: restored) and ran to the end
    assert f"resumed from checkpoint step {n}" in res["r3"]
    assert _ckpt_steps(b)[-1] == STEPS
    ra, rb = _metrics(a), _metrics(b)
    assert [r["step"] for r in rb] == list(range(1, STEPS + 1))  # re-run steps are logged once
    keys = ("loss", "ce", "acc", "grad_norm", "lb_loss", "num_masked", "weight", "tokens", "expert_counts",
            "eval/loss", "eval/ce_t0.5", "eval/acc_t0.5")
    for x, y in zip(ra, rb):
        for k in keys:
            assert (k in x) == (k in y), (x["step"], k)
            if k in x:
                assert x[k] == y[k], (x["step"], k, x[k], y[k])  # bit-exact (JSON round-trips floats)
    assert "eval/loss" in rb[1]


def test_layer_stack_unrolls_on_cpu_unless_the_recipe_says(runs):
    """The recipe picks the layer loop for the devices it trains on (issue 19): unrolled on CPU, scanned
    elsewhere, and a `model.scan_layers` the recipe sets always wins (both values, both platforms)."""
    from sft.config import ModelSpec, load_sft_config
    from sft.recipe import platform_scan_default, prepare

    assert prepare(load_sft_config(runs["cfg_a"])).model_cfg.scan_layers is False  # these tests run on CPU
    assert prepare(load_sft_config(runs["cfg_a"], ["model.scan_layers=true"])).model_cfg.scan_layers is True
    from clover_jax.config import get_preset

    cfg = get_preset("tiny")
    for platform, want in (("cpu", False), ("tpu", True), ("gpu", True)):
        assert platform_scan_default(cfg, ModelSpec(), platform).scan_layers is want
        for set_to in (True, False):
            spec = ModelSpec(overrides={"scan_layers": set_to})
            assert platform_scan_default(cfg.replace(scan_layers=set_to), spec, platform).scan_layers is set_to


def test_aligned_responses_are_recorded_in_the_model_config_and_its_export(runs, tmp_path):
    """`data.align_responses: block` sets `response_block_align` to the packing alignment (the lcm of
    data.block_align and the block sizes) in the run's model config; the Clover export writes it and
    loading the export reads it back (so the decoder pads prompts); `none` records 0."""
    from clover_jax.api import save_hf
    from clover_jax.config import ModelConfig
    from clover_jax.model.clover_model import create_model
    from sft.config import load_sft_config
    from sft.recipe import prepare

    on = prepare(load_sft_config(runs["cfg_a"], ["data.align_responses=block"]))
    assert on.model_cfg.response_block_align == on.data.cfg.block_align > 1
    assert prepare(load_sft_config(runs["cfg_a"])).model_cfg.response_block_align == 0
    mcfg = on.model_cfg.replace(param_dtype="float32", dtype="float32")
    save_hf(create_model(mcfg, seed=0), mcfg, tmp_path / "hf", format="clover")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["response_block_align"] == on.data.cfg.block_align
    assert ModelConfig.from_hf_dict(written).response_block_align == on.data.cfg.block_align
