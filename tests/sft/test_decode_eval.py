"""`eval.decode` (sft.decode_eval): decode quality measured during SFT training.

One `launch.py sft` run (a subprocess) on the cached trained task model (tests/decode_fixtures.py),
4 steps at a negligible lr, CE evals every 2 steps and a decode eval every 4:
(a) the logged ``decode/*`` values equal an independent decode of the run's exported params through
    the public API (`load_hf`, `Decoder`, `metrics`) on the same held-out prompts (the first
    eval-split records, rendered as `launch.py calibrate` does) with the same settings; decode.png
    and the summary's decode fields are written;
(b) ``decode/*`` keys appear in metrics.jsonl at the multiples of eval.decode.every only (step 4,
    not the CE eval at step 2), and in the console rows of those steps.
(c) Bad settings fail at load in one line naming the key (exit 2 through launch.py);
    `train.eval_every: 0` turns decode evals off without an error; the embedded default
    (configs/sft_tiny.yaml) has them on.
(d) A prompts file: missing, without assistant turns, a non-JSON line, a prompt too long for the
    context: one error naming the file (and line); a good one gives its first `prompts` records.
The run goes in the background while the config and prompts-file tests run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

FIXTURE_YAML = """\
model: {{init_from: {ck}, dtype: float32}}
data:
  seq_len: 96
  batch_size: 2
  eval_fraction: 0.2
  sources: [{{name: task, format: chat, path: {data}}}]
eval: {{t_values: [0.5], max_batches: 1, decode: {{every: 4, prompts: 4, max_new_tokens: 32, threshold: 0.9}}}}
train: {{steps: 4, eval_every: 2, log_every: 1}}
optimizer: {{lr: 1.0e-7, warmup_steps: 0}}
checkpoint: {{every_steps: 0, save_final: false}}
logging: {{run_dir: {run}, console_every: 1, progress: "off", wandb: {{mode: disabled}}}}
export: {{dtype: float32}}
count_flops: false
devices: 1
"""


def _launch(cfg: Path, run: Path):
    """A background `launch.py sft --config cfg` process (conftest's XLA flags: fast compiles); returns
    `result() -> (rc, output, run)`, waiting for it on the first call."""
    env = {**os.environ, "WANDB_MODE": "disabled", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "sft", "--config", str(cfg)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done: list[tuple[int, str, Path]] = []

    def result() -> tuple[int, str, Path]:
        if not done:
            out, _ = proc.communicate(timeout=1200)
            done.append((proc.returncode, out, run))
        return done[0]

    return proc, result


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run as a background process: (result, config)."""
    from tests.decode_fixtures import eval_records, task_records, trained_checkpoint

    tmp = tmp_path_factory.mktemp("decode_eval")
    recs = task_records(120, 0) + eval_records(60)
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    fx = tmp / "fixture.yaml"
    fx.write_text(FIXTURE_YAML.format(ck=trained_checkpoint(), data=tmp / "data.jsonl", run=tmp / "fixture"))
    proc, result = _launch(fx, tmp / "fixture")
    yield result, fx
    if proc.poll() is None:
        proc.kill()


def _metrics(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def test_logged_decode_metrics_equal_a_direct_decoder_run(run):
    from clover_jax.api import load_hf
    from clover_jax.bridge.tokenizer import load_tokenizer
    from clover_jax.decoding import metrics as ev
    from clover_jax.decoding.generator import DecodeConfig, Decoder
    from clover_jax.input_file import render_chat
    from sft.config import load_sft_config
    from sft.data.sources import load_source

    result, cfg = run
    rc, printed, run = result()
    assert rc == 0, printed[-3000:]
    logged = [r for r in _metrics(run) if "decode/validity" in r]
    assert [r["step"] for r in logged] == [4]
    got = logged[0]

    # independently: the exported params, the first 4 eval-split records with tools, the public API
    mcfg, model = load_hf(run / "hf_export")
    tok = load_tokenizer(run / "hf_export")
    c = load_sft_config(cfg)  # the eval split as the pipeline reads it (the records as converted)
    held = [r for r, _ in load_source(c.data.sources[0], c.data).eval][:4]
    assert len(held) == 4
    prompts, refs = [], []
    for r in held:
        prompt, answer, tools = ev.split_record(r)
        p_text = render_chat(tok, "test", prompt, tools, add_generation_prompt=True)
        full = render_chat(tok, "test", prompt + [answer], tools)
        target = full[len(p_text):]
        target = target[: target.index("<|im_end|>") + len("<|im_end|>")]
        prompts.append(tok.encode(p_text, add_special_tokens=False))
        refs.append((tok.encode(target, add_special_tokens=False), answer, tools))
    eos = (tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"))
    limit = min(len(tok), mcfg.vocab_size)
    outs = {}
    for mode in ("ar", "threshold"):
        d = DecodeConfig(mode=mode, block_size=None if mode == "ar" else 32, threshold=0.9, max_new_tokens=32)
        outs[mode] = Decoder(model, d, eos_ids=eos, vocab_limit=limit).generate(prompts).generations

    def score(gens):
        valid, match, exact = [], [], []
        for g, (ref_ids, answer, tools) in zip(gens, refs):
            body = [t for t in g.token_ids if t not in eos]
            text = tok.decode(body, skip_special_tokens=False)
            calls = ev.reference_calls(answer)
            valid.append(ev.tool_call_validity(text, tools, bool(calls))["valid"])
            match.append(ev.turn_match(text, calls, answer.get("content") or ""))
            exact.append(body == [t for t in ref_ids if t not in eos])
        return np.mean(valid), np.mean(match), np.mean(exact)

    v, m, x = score(outs["threshold"])
    ar_v, ar_m, _ = score(outs["ar"])
    pairs = list(zip((g.token_ids for g in outs["threshold"]), (g.token_ids for g in outs["ar"])))
    n_tok = sum(len(g.token_ids) for g in outs["threshold"])
    n_fwd = sum(g.stats["nfe"] for g in outs["threshold"])
    want = {"validity": v, "arg_accuracy": m, "exact_match": x, "tokens_per_forward": n_tok / n_fwd,
            "ar_agreement": np.mean([ev.ar_agreement(a, b) for a, b in pairs]),
            "ar_exact": np.mean([a == b for a, b in pairs]), "ar_validity": ar_v, "ar_arg_accuracy": ar_m}
    assert {k: got[f"decode/{k}"] for k in want} == pytest.approx(want, abs=1e-9)
    assert 0 < want["ar_validity"] and n_tok > 0  # the trained model makes valid calls: not a vacuous match
    assert got["decode/time_s"] > 0
    assert (run / "decode.png").stat().st_size > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["decode_evals"] == 1 and summary["decode_time_s"] == pytest.approx(got["decode/time_s"])
    assert 0 < summary["decode_time_share"] < 1
    assert "decode evals: 1, validity" in printed


def test_decode_metrics_are_logged_at_their_steps_only(run):
    result, _ = run
    rc, out, run = result()
    assert rc == 0, out[-3000:]
    recs = _metrics(run)
    assert [r["step"] for r in recs if "eval/loss" in r] == [2, 4]
    dec = [r for r in recs if any(k.startswith("decode/") for k in r)]
    assert [r["step"] for r in dec] == [4]
    names = {"validity", "arg_accuracy", "exact_match", "tokens_per_forward", "ar_agreement", "ar_exact",
             "ar_validity", "ar_arg_accuracy", "time_s"}
    assert {k for k in dec[0] if k.startswith("decode/")} == {f"decode/{k}" for k in names}
    assert all(0.0 <= dec[0][f"decode/{k}"] <= 1.0 for k in names - {"tokens_per_forward", "time_s"})
    rows = {int(m[1]): ln for ln in out.splitlines() if (m := re.match(r"\s*(\d+)/\d+ \|", ln))}
    assert "decode/validity=" in rows[4] and "decode/tokens_per_forward=" in rows[4]
    assert "eval/loss=" in rows[2] and "decode/" not in rows[2]


@pytest.mark.parametrize("override, key", [
    (["eval.decode.every=3"], "eval.decode.every 3 must be a multiple of train.eval_every"),
    (["eval.decode.prompts=0"], "eval.decode.prompts must be >= 1"),
    (["eval.decode.threshold=1.5"], "eval.decode.threshold must be in [0, 1]"),
])
def test_bad_decode_settings_fail_at_load_naming_the_key(override, key):
    from clover_jax.yaml_config import ConfigError
    from sft.config import load_sft_config

    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_sft_config(ROOT / "configs" / "sft_tiny.yaml", ["train.eval_every=2", *override])


def test_train_eval_every_0_turns_decode_evals_off_without_an_error():
    from sft.config import load_sft_config
    from sft.decode_eval import with_decode_eval

    cfg = load_sft_config(ROOT / "configs" / "sft_tiny.yaml", ["train.eval_every=0"])
    assert cfg.eval.decode.every == 100 and cfg.train.eval_every == 0
    ce_eval = object()  # off: the CE eval comes back as it was, no DecodeEval built (it would need data)
    assert with_decode_eval(SimpleNamespace(cfg=cfg), ce_eval) is ce_eval
    # the embedded default decodes 4 held-out prompts at every 100th step, an eval step
    default = load_sft_config(ROOT / "configs" / "sft_tiny.yaml")
    dc, eval_every = default.eval.decode, default.train.eval_every
    assert (dc.every, dc.prompts) == (100, 4) and eval_every > 0 and dc.every % eval_every == 0


def test_prompts_file_errors_name_the_file_and_line(tmp_path):
    from clover_jax.bridge.tokenizer import load_tokenizer
    from clover_jax.input_file import InputFileError
    from clover_jax.yaml_config import ConfigError
    from sft.config import DecodeEvalConfig
    from sft.decode_eval import DecodeEval
    from tests.decode_fixtures import eval_records, trained_checkpoint

    tok = load_tokenizer(trained_checkpoint())

    def setup(path: Path, context: int = 1024) -> SimpleNamespace:
        """What DecodeEval reads of an `SFTSetup` (no model needed before the first eval)."""
        dc = DecodeEvalConfig(every=2, prompts=2, max_new_tokens=32, prompts_file=str(path))
        return SimpleNamespace(cfg=SimpleNamespace(eval=SimpleNamespace(decode=dc)), graphdef=None,
                               compute_dtype=None, data=SimpleNamespace(tokenizer=tok), block_sizes=(32,),
                               model_cfg=SimpleNamespace(max_position_embeddings=context, eos_token_id=2))

    with pytest.raises(ConfigError, match="eval.decode.prompts_file .*nope.jsonl does not exist"):
        DecodeEval(setup(tmp_path / "nope.jsonl"))
    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ConfigError, match="no_answer.jsonl has no chat record with an assistant turn"):
        DecodeEval(setup(no_answer))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(eval_records(1)[0]) + "\n{not json\n")
    with pytest.raises(InputFileError, match="bad.jsonl:2: not valid JSON"):
        DecodeEval(setup(bad))
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in eval_records(3)))
    with pytest.raises(ConfigError, match=r"good.jsonl:1: prompt of \d+ tokens \+ eval.decode.max_new_tokens 32 exceeds"):
        DecodeEval(setup(good, context=40))
    ev = DecodeEval(setup(good))  # the first 2 of 3 records, one fixed-shape batch
    assert len(ev.examples) == 2 and ev.dcfg.batch_bucket == 2 and ev.dcfg.block_size == 32
