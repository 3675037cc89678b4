"""The smaller faults a careful user meets, each answered with one line naming what is wrong:

- an empty `--prompts` file: `file: no prompts`, exit 2, before any checkpoint is read;
- a data source whose file holds no record: `file: no records`, exit 2 (`data` and `sft`);
- skipped bad records and render failures: the first 3 logged as `file:line: reason`, then
  "and K more" (checked against the lines broken by hand);
- `model.generate_missing` writes a random init only inside `logging.run_dir`: a mistyped path
  elsewhere is refused and nothing is written there;
- SIGTERM outside the training loop (here: during the first compile, with libtpu loaded as in this
  test environment) ends `launch.py sft` with the recipe's one line and exit 143, no C++ stack dump;
  the guard gives way to the loop's own handler and restores what it replaced.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clover_jax.input_file import InputFileError
from clover_jax.yaml_config import ConfigError
from sft.data.synthetic import generate_records, write_jsonl
from tests.launch.launch_utils import run_main

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------- prompts
def test_empty_prompts_file_is_named_and_exits_2_before_the_checkpoint_is_read(tok, tmp_path, capsys):
    from clover_jax.decoding.cli import read_prompts_file

    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n  \n")):
        f = tmp_path / name
        f.write_text(text)
        with pytest.raises(InputFileError, match=rf"^{re.escape(str(f))}: no prompts in the file"):
            read_prompts_file(f, tok)
        # the checkpoint does not exist: the prompts file is read first, so its error is the one
        rc, _, err = run_main(["generate", "--checkpoint", str(tmp_path / "no_ckpt"), "--prompts", str(f)], capsys)
        want = f"error: {f}: no prompts in the file (it has no non-blank line)"
        assert rc == 2 and err.strip().splitlines() == [want], (rc, err)


# ---------------------------------------------------------------------------------------------- data
def _data_recipe(tmp_path: Path, path: Path) -> Path:
    f = tmp_path / "recipe.yaml"
    f.write_text("model: {preset: tiny-qwen3.6, num_hidden_layers: 2, block_size: 16,\n"
                 "        layer_types: [linear_attention, full_attention]}\n"
                 f"data:\n  seq_len: 256\n  batch_size: 2\n  eval_fraction: 0.0\n"
                 f"  sources:\n    - {{name: mine, format: chat, path: {path}}}\n"
                 f"logging: {{run_dir: {tmp_path / 'run'}}}\n")
    return f


def test_a_source_file_without_records_exits_2_naming_the_file(tok, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    recipe = _data_recipe(tmp_path, empty)
    want = f"error: {empty}: no records (source 'mine': empty, or only blank lines)"
    for argv in (["data", "--config", str(recipe)], ["sft", "--config", str(recipe)]):
        rc, _, err = run_main(argv, capsys)
        assert rc == 2 and err.strip().splitlines() == [want], (argv, rc, err)
    assert not list((tmp_path / "run").glob("checkpoints/[0-9]*"))  # sft stopped before any checkpoint


def test_skipped_records_are_logged_with_file_line_and_reason(tok, tmp_path, caplog):
    from sft.data import DataConfig, SFTData, SourceConfig

    lines = [json.dumps(r) for r in generate_records(100, seed=2)]
    broken = {4: "{torn", 19: "[1, 2]", 30: json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
              61: "{torn again", 88: json.dumps({"messages": []})}  # 0-based: lines 5, 20, 31, 62, 89
    for i, text in broken.items():
        lines[i] = text
    f = tmp_path / "mixed.jsonl"
    f.write_text("\n".join(lines) + "\n")
    cfg = DataConfig(sources=(SourceConfig(name="mine", path=str(f)),), seq_len=1024, block_align=16, batch_size=2,
                     eval_fraction=0.0, max_bad_fraction=0.1)
    with caplog.at_level(logging.WARNING, logger="sft.data"):
        data = SFTData(cfg, tok)
    st = data.load_stats()["mine"]
    assert (st["read"], st["bad"]) == (100, 5)
    msgs = [r.getMessage() for r in caplog.records if r.name == "sft.data.sources"]
    assert len(msgs) == 1, msgs
    head, *shown = msgs[0].splitlines()
    assert head == "source 'mine': skipped 5 bad record(s) of 100:"
    # the first 3 in file order, each `file:line: reason`, then the count of the rest
    assert [s.split(": ", 1)[0].strip() for s in shown[:3]] == [f"{f}:5", f"{f}:20", f"{f}:31"], shown
    assert "malformed JSON line" in shown[0] and "record must be an object" in shown[1] and "'robot'" in shown[2]
    assert shown[3:] == ["  and 2 more"]
    assert st["bad_examples"] == [s.strip() for s in shown[:3]]


def test_render_failures_are_logged_bounded(tok, tmp_path, monkeypatch, caplog):
    from sft.data import DataConfig, SFTData, SourceConfig

    recs = generate_records(60, seed=4)
    poison = [3, 10, 25, 40]  # lines 4, 11, 26, 41: they fail to render (the chat template raises)
    for i in poison:
        recs[i]["messages"][-1]["content"] += " POISON"
    f = tmp_path / "mine.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = DataConfig(sources=(SourceConfig(name="mine", path=str(f)),), seq_len=512, block_align=16, batch_size=8,
                     eval_fraction=0.0, max_bad_fraction=0.1, bad_window=100, shuffle=False)
    data = SFTData(cfg, tok)
    real = tok.apply_chat_template

    def apply(messages, *a, **kw):
        if any("POISON" in (m.get("content") or "") for m in messages):
            raise ImportError("apply_chat_template requires jinja2 to be installed")
        return real(messages, *a, **kw)

    monkeypatch.setattr(tok, "apply_chat_template", apply)
    it = data.train_iterator()
    with caplog.at_level(logging.WARNING, logger="sft.data"):
        for _ in range(20):  # > 60 documents: the poisoned ones come round more than once
            next(it)
    assert it.stats()["sources"]["mine"]["render_bad"] > 4
    msgs = [r.getMessage() for r in caplog.records if r.name == "sft.data.pipeline"]
    assert len(msgs) == 3, msgs
    assert [m.split("failed to render: ")[1].split(": ")[0] for m in msgs] == [f"{f}:4", f"{f}:11", f"{f}:26"]
    assert all("ImportError" in m for m in msgs) and msgs[-1].endswith("counted, not logged")


# ---------------------------------------------------------------------------------------------- init
def test_generate_missing_writes_only_inside_the_run_dir(tmp_path):
    from sft.config import load_sft_config
    from sft.recipe import data_source

    base = [f"logging.run_dir={tmp_path / 'run'}", "model.num_hidden_layers=2",
            "model.layer_types=[linear_attention,full_attention]"]
    cfg_path = ROOT / "configs" / "sft_tiny.yaml"
    for typo in (tmp_path / "Qwen3.6-35B-A3b", tmp_path / "run"):  # a mistyped checkpoint; the run dir itself
        cfg = load_sft_config(cfg_path, [*base, f"model.init_from={typo}"])
        with pytest.raises(ConfigError, match=rf"^model.init_from {re.escape(str(typo))} does not exist "
                                              r"\(model.generate_missing only writes under logging.run_dir"):
            data_source(cfg)
        assert not typo.exists() and not typo.with_name(typo.name + ".tmp").exists()
    inside = tmp_path / "run" / "init_hf"
    kind, path, ck_cfg, _ = data_source(load_sft_config(cfg_path, [*base, f"model.init_from={inside}"]))
    assert (kind, path) == ("hf", inside) and (inside / "config.json").is_file() and ck_cfg.num_hidden_layers == 2


# ---------------------------------------------------------------------------------------------- SIGTERM
def test_phase_table_names_functions_that_exist():
    """The SIGTERM message's phase is read off the stack by function name: each name must exist."""
    from sft.preemption import PHASES

    for module, fn in PHASES:
        src = inspect.getsource(importlib.import_module(module))
        assert re.search(rf"^\s*def {fn}\(", src, re.M), f"{module}.{fn} is gone: update sft.preemption.PHASES"


GUARD_SCRIPT = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from sft.preemption import sigterm_exits
got = []
with sigterm_exits(lambda: {ckpt!r}, 143):
    mine = signal.getsignal(signal.SIGTERM)
    loops = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))  # as train.loop installs its own
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    assert got == [signal.SIGTERM], got  # the loop's handler took it; the guard's thread let it be
    signal.signal(signal.SIGTERM, loops)
    print("ready", flush=True)
    time.sleep(60)
print("not reached", flush=True)
"""


def test_sigterm_guard_gives_way_to_the_loop_then_exits_143(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "7").mkdir(parents=True)  # a finalized Orbax step dir
    p = subprocess.Popen([sys.executable, "-c", GUARD_SCRIPT.format(root=str(ROOT), ckpt=str(ckpt))],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 143, (out, err)
    assert out == "SIGTERM received during setup: no checkpoint written since step 7; exiting\n", (out, err)

    # in-process: the handler and the wakeup fd it replaced come back
    from sft.preemption import sigterm_exits

    def wakeup_fd() -> int:  # read without changing it
        fd = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(fd)
        return fd

    before, fd_before = signal.getsignal(signal.SIGTERM), wakeup_fd()
    with sigterm_exits(lambda: None, 143):
        assert signal.getsignal(signal.SIGTERM) is not before and wakeup_fd() not in (-1, fd_before)
    assert signal.getsignal(signal.SIGTERM) is before and wakeup_fd() == fd_before


def test_sigterm_during_the_first_compile_prints_one_line_and_exits_143(tmp_path):
    run = tmp_path / "run"
    cfg = tmp_path / "t.yaml"
    cfg.write_text(f"base_config: {ROOT / 'configs' / 'sft_tiny.yaml'}\n"
                   f"model: {{init_from: {run / 'init_hf'}, num_hidden_layers: 2, "
                   "layer_types: [linear_attention, full_attention]}\n"
                   "data:\n  seq_len: 64\n  sources:\n"
                   "    - {name: s, format: synthetic, options: {n_records: 60, seed: 0}}\n"
                   f"train: {{steps: 4, eval_every: 0}}\nlogging: {{run_dir: {run}, progress: 'off', "
                   "wandb: {mode: disabled}}\ncount_flops: false\npeak_flops_per_device: 1.0e12\ndevices: 1\n")
    # JAX picks its platforms as a user's run does: libtpu (installed here) is loaded at backend
    # start-up and would install its C++ failure-signal handler; no compilation cache (a cached
    # program would skip the compile)
    drop = ("JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(ALLOW_MULTIPLE_LIBTPU_LOAD="1", WANDB_MODE="disabled")
    p = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "sft", "--config", str(cfg)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if "compiling the train step" in line:  # the first compile has begun (it takes about a minute)
                time.sleep(2)
                p.send_signal(signal.SIGTERM)
                break
        t0 = time.perf_counter()
        out = "".join(lines) + p.stdout.read()
        rc = p.wait(timeout=60)
        waited = time.perf_counter() - t0
    finally:
        p.kill()
    assert rc == 143, out[-3000:]
    assert waited < 20, f"{waited:.1f} s from SIGTERM to exit: it waited for the compile"
    last = out.rstrip().splitlines()[-1]
    assert last == "SIGTERM received during compile: no checkpoint written since step 0; exiting", out[-3000:]
    assert not re.search("FailureSignalHandler|stack trace|SIGTERM received by PID", out), out[-3000:]
    assert "compiled the train step" not in out and not list(run.glob("checkpoints/[0-9]*"))  # no step saved
    assert (run / "init_hf" / "config.json").is_file()  # generated in the run dir, whole
