"""`launch.py generate` (docs/design.md 6): prompts as ids, text and chat-record JSONL (tools rendered),
`--out` JSON, decode.* overrides, HF and Orbax checkpoints, clear errors. Checked against the
Python decoder API and the chat template rendered by hand."""

from __future__ import annotations

import json
import shutil

import pytest

import launch
from tests.launch.launch_utils import run_main as _main
from clover_jax.api import load_hf, save_hf
from clover_jax.decoding.generator import DecodeConfig, Decoder
from clover_jax.bridge.tokenizer import load_tokenizer
from tests.decode_fixtures import encode_example, eval_records, tool_call_records, trained_checkpoint


# unoptimised XLA backend (same tokens, ~4x faster compiles) and 16-row batches: the shapes of
# test_decoding / test_calibrate, so the three files share compiled programs
FAST = ["decode.fast_compile=true", "decode.batch_bucket=16"]


def _api(ckpt, prompts, **kw):
    cfg, model = load_hf(ckpt)
    tok = load_tokenizer(ckpt)
    eos = tuple(tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    out = Decoder(model, DecodeConfig(fast_compile=True, batch_bucket=16, **kw), eos_ids=eos).generate(prompts)
    return [g.token_ids for g in out.generations]


def test_generate_prompt_ids_streams_and_writes_json(tmp_path, capsys):
    ckpt = trained_checkpoint()
    tok = load_tokenizer(ckpt)
    ids = encode_example(tok, tool_call_records(1)[0])[0]
    out = tmp_path / "gen.json"
    rc, stdout, err = _main(["generate", "--checkpoint", str(ckpt), "--prompt-ids", ",".join(map(str, ids)),
                             "--out", str(out), "decode.max_new_tokens=48", "decode.block_size=32",
                             "decode.threshold=0.9", *FAST], capsys)
    assert rc == 0, err
    res = json.loads(out.read_text())
    assert len(res) == 1 and {"prompt", "text", "token_ids", "stats"} <= set(res[0])
    r = res[0]
    assert r["token_ids"] == _api(ckpt, [ids], max_new_tokens=48, block_size=32, threshold=0.9)[0]
    assert r["stats"]["tokens_per_forward"] == pytest.approx(len(r["token_ids"]) / r["stats"]["nfe"])
    assert r["text"] == tok.decode([t for t in r["token_ids"] if t != tok.convert_tokens_to_ids("<|im_end|>")],
                                   skip_special_tokens=True)
    streamed, report = stdout.split("--- request 0")
    assert streamed.strip() == r["text"].strip()  # the blocks streamed before the report add up to the text
    assert "tokens/forward" in report and r["text"] in report


def test_generate_chat_records_jsonl_and_orbax(tmp_path, capsys):
    """JSONL chat records are rendered with the template, tools included, up to the first assistant
    turn; an Orbax params checkpoint converted from the HF dir decodes the same tokens."""
    ckpt = trained_checkpoint()
    tok = load_tokenizer(ckpt)
    recs = eval_records(2)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "gen.json"
    rc, _, err = _main(["generate", "--checkpoint", str(ckpt), "--prompts", str(path), "--out", str(out),
                        "--no-stream", "decode.mode=self_speculative", "decode.max_new_tokens=48", *FAST], capsys)
    assert rc == 0, err
    res = json.loads(out.read_text())
    want_ids = [encode_example(tok, r)[0] for r in recs]
    assert [tok.encode(r["prompt"], add_special_tokens=False) for r in res] == want_ids
    for r, rec in zip(res, recs):
        for t in rec["tools"]:
            assert t["function"]["name"] + "(" in r["prompt"]
    assert [r["token_ids"] for r in res] == _api(ckpt, want_ids, mode="ar", max_new_tokens=48)

    launch.main(["convert", "--hf", str(ckpt), "--out", str(tmp_path / "orbax")])
    out2 = tmp_path / "gen2.json"
    rc, _, err = _main(["generate", "--checkpoint", str(tmp_path / "orbax"), "--prompts", str(path), "--out", str(out2),
                        "--no-stream", "decode.mode=self_speculative", "decode.max_new_tokens=48", *FAST], capsys)
    assert rc == 0, err
    res2 = json.loads(out2.read_text())
    assert [r["token_ids"] for r in res2] == [r["token_ids"] for r in res]
    assert [r["text"] for r in res2] == [r["text"] for r in res]  # tokenizer found via the recorded HF source


def test_generate_text_prompt(capsys):
    rc, stdout, err = _main(["generate", "--checkpoint", str(trained_checkpoint()), "--prompt",
                             "What's the weather in Oslo?", "--no-stream", "decode.max_new_tokens=48", *FAST], capsys)
    assert rc == 0, err
    assert "--- request 0" in stdout and "=== 1 requests" in stdout


def test_generate_errors(tmp_path, capsys):
    ckpt = trained_checkpoint()
    base = ["generate", "--checkpoint", str(ckpt), "--no-stream"]
    rc, _, err = _main(base + ["--prompt-ids", "1,2,3", "decode.treshold=0.9", *FAST], capsys)
    assert rc == 1 and "'treshold'" in err and "did you mean 'threshold'" in err
    rc, _, err = _main(base + ["--prompt-ids", "", *FAST], capsys)
    assert rc == 1 and "prompt 0 is empty" in err
    rc, _, err = _main(base + ["--prompt-ids", "1,2,3", "decode.max_new_tokens=8", *FAST], capsys)
    assert rc == 1 and "larger than decode.max_new_tokens" in err
    rc, _, err = _main(base + ["--prompt-ids", ",".join(["7"] * 1100), *FAST], capsys)
    assert rc == 1 and "longer than the model context" in err
    rc, _, err = _main(base + [*FAST], capsys)
    assert rc == 1 and "exactly one of --prompt" in err
    # a Clover checkpoint whose config has no mask token
    bare = tmp_path / "no_mask"
    shutil.copytree(ckpt, bare)
    cfg_json = json.loads((bare / "config.json").read_text())
    mask_id = cfg_json.pop("mask_token_id")
    (bare / "config.json").write_text(json.dumps(cfg_json))
    rc, _, err = _main(["generate", "--checkpoint", str(bare), "--no-stream", "--prompt-ids", "1,2,3", *FAST], capsys)
    assert rc == 1 and "no mask token" in err and "decode.mask_token_id" in err
    real = ",".join(map(str, encode_example(load_tokenizer(ckpt), tool_call_records(1)[0])[0]))
    rc, _, err = _main(["generate", "--checkpoint", str(bare), "--no-stream", "--prompt-ids", real,
                        f"decode.mask_token_id={mask_id}", "decode.max_new_tokens=48", *FAST], capsys)
    assert rc == 0, err
    # an AR (Qwen format) export: block modes refuse, the AR baseline runs
    cfg, model = load_hf(ckpt)
    save_hf(model, cfg, tmp_path / "qwen", format="qwen", dtype=None, source_dir=ckpt)
    qbase = ["generate", "--checkpoint", str(tmp_path / "qwen"), "--no-stream", "--prompt-ids", "1,2,3"]
    rc, _, err = _main(qbase + [*FAST], capsys)
    assert rc == 1 and "decode.mode=ar" in err
