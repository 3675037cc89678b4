"""`launch.py data` (inspect an SFT mix without training) and the user-file errors of every command:
one line naming file:line and the reason, exit 2. Checked against the records written, the mix
weights, and the assistant text of the rendered records."""

from __future__ import annotations

import json
import re

import pytest

from clover_jax.input_file import InputFileError
from tests.launch.launch_utils import run_main
from sft.data.synthetic import generate_records, write_jsonl
from sft.mix_report import TRAIN_CLOSE, TRAIN_OPEN


def _recipe(tmp_path, extra=""):
    root = tmp_path / "data"
    write_jsonl(root / "a.jsonl", 120, seed=1)
    lines = (root / "a.jsonl").read_text().splitlines()
    lines[9] = "{torn"  # line 10: a bad record, counted and named
    (root / "a.jsonl").write_text("\n".join(lines) + "\n")
    f = tmp_path / "mix.yaml"
    f.write_text(f"model: {{preset: tiny-qwen3.6, block_size: 16}}\ndata_root: {root}\n"
                 "data:\n  seq_len: 1024\n  batch_size: 4\n  eval_fraction: 0.0\n  max_bad_fraction: 0.05\n"
                 "  sources:\n    - {name: alpha, format: chat, path: a.jsonl, weight: 3.0}\n"
                 "    - {name: beta, format: synthetic, options: {n_records: 50, seed: 2}, weight: 1.0}\n" + extra)
    return f, root


def test_data_prints_the_mix_table_and_marked_samples(tok, tmp_path, capsys):
    f, root = _recipe(tmp_path)
    rc, out, err = run_main(["data", "--config", str(f), "--batches", "6", "--show", "2"], capsys)
    assert rc == 0, err
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines() if ln.startswith("| ")]
    head, table = rows[0], {r[0]: dict(zip(rows[0], r)) for r in rows[1:]}
    assert head[:4] == ["source", "weight %", "drawn %", "tokens %"] and set(table) == {"alpha", "beta", "total"}, out

    def cell(src, name):
        return table[src][{"weight": "weight %", "drawn": "drawn %", "loss": "loss tok"}.get(name, name)]

    assert (cell("alpha", "read"), cell("alpha", "kept"), cell("alpha", "bad")) == ("120", "119", "1")
    assert (cell("beta", "read"), cell("beta", "kept")) == ("50", "50")
    assert (cell("alpha", "weight"), cell("beta", "weight")) == ("75.0", "25.0")
    # Grain's weighted interleave holds 3:1 over every window of 4 documents
    assert abs(float(cell("alpha", "drawn")) - 75.0) < 5 and abs(float(cell("beta", "drawn")) - 25.0) < 5, out
    assert int(cell("alpha", "loss")) < int(cell("alpha", "tokens"))
    assert f"alpha: first bad record: {root / 'a.jsonl'}:10: malformed JSON" in out
    assert re.search(r"6 batch\(es\), 24 rows x 1024 tokens: padding [\d.]+%, [\d.]+ pieces per row", out), out
    # --show 2 in a file: plain markers; every trained span is assistant text, the user turns are outside
    heads = re.findall(r"^--- row (\d) segment \d+: source (alpha|beta), (\S+) \(piece 0\)", out, re.M)
    assert {h[0] for h in heads} == {"0", "1"}, out
    body = out.split(f"between {TRAIN_OPEN} and {TRAIN_CLOSE}", 1)[1]
    trained = re.findall(f"{TRAIN_OPEN}(.*?){TRAIN_CLOSE}", body, re.S)
    assert trained and all(t.endswith("<|im_end|>") for t in trained)
    alpha_recs = {f"{root / 'a.jsonl'}:{i + 1}": r for i, r in enumerate(generate_records(120, seed=1))}
    src, loc = next((s, loc) for _, s, loc in heads if s == "alpha")
    rec = alpha_recs[loc]
    answer = [m["content"] for m in rec["messages"] if m["role"] == "assistant" and m["content"]][-1]
    user = [m["content"] for m in rec["messages"] if m["role"] == "user"][0]
    assert any(answer in t for t in trained) and not any(user in t for t in trained)
    assert user in body


def test_data_estimates_the_share_of_ce_chunks_holding_loss_tokens(tok, tmp_path, capsys):
    """By hand: on 4 chips (v5p-8) a chip holds 4 rows x 2 complementary copies x 1024 / 4 = 2048 CE
    positions per micro-batch, 8 chunks of 256; a loss token is masked in one of the two copies (mean
    level 1/2), so ceil(loss share / 2 x 2048 / 256) of the 8 chunks hold one. The loss share lies
    below the non-pad share of the rows."""
    import math

    f, _ = _recipe(tmp_path)
    rc, out, err = run_main(["data", "--config", str(f), "--batches", "2", "--topology", "v5p-8",
                             "loss.chunk_tokens=256"], capsys)
    assert rc == 0, err
    pad = float(re.search(r"padding ([\d.]+)%", out).group(1)) / 100
    m = re.search(r"loss tokens: ([\d.]+)% of the rows' tokens, masked: ([\d.]+)% .* on 4 chips each sweeps 2048 "
                  r"positions per micro-batch in 8 chunks of 256: about ([\d.]+) of them .*--ce-share ([\d.]+)\)", out)
    assert m, out
    loss, masked, share = float(m.group(1)) / 100, float(m.group(2)) / 100, float(m.group(3))
    assert 0 < loss < 1 - pad and masked == pytest.approx(loss / 2, abs=6e-4)
    assert share == pytest.approx(min(8, math.ceil(math.ceil(masked * 2048) / 256)) / 8, abs=0.005)
    assert m.group(3) == m.group(4) and 0 < share < 1  # a partial share, not the trivial ends


def test_data_errors_name_the_file_and_line(tok, tmp_path, capsys):
    f, root = _recipe(tmp_path)
    # a missing data_root: the sources and where the README says how to fetch them (a config error: 1)
    rc, _, err = run_main(["data", "--config", str(f), f"data_root={tmp_path / 'nope'}"], capsys)
    assert rc == 1 and "alpha (a.jsonl)" in err and 'section "Getting the data"' in err, err
    # a bad record beyond max_bad_fraction: one line, file:line and the reason, exit 2
    rc, _, err = run_main(["data", "--config", str(f), "data.max_bad_fraction=0.0"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"first bad record: {root / 'a.jsonl'}:10: malformed JSON" in err, err


def test_prompt_and_eval_files_name_the_record_the_template_refuses(tok, tmp_path):
    """generate --prompts and the calibrate eval set: a role the chat template refuses (jinja's
    raise_exception) is an InputFileError `file:line: ...` (launch exits 2 on it), not a traceback."""
    from clover_jax.decoding.calibrate import EvalSetConfig, build_examples, eval_records
    from clover_jax.decoding.cli import read_prompts_file

    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "hi"}\n{"messages": [{"role": "robot", "content": "beep"}]}\n')
    with pytest.raises(InputFileError, match=rf"^{re.escape(str(f))}:2: the chat template refuses this record "
                                             r"\(TemplateError: unknown chat role: robot\)$"):
        read_prompts_file(f, tok)
    f.write_text('{"prompt": "hi"}\n{"prompt": \n')
    with pytest.raises(InputFileError, match=rf"^{re.escape(str(f))}:2: not valid JSON"):
        read_prompts_file(f, tok)
    recs = [r for r in generate_records(40, seed=3) if any(m.get("tool_calls") for m in r["messages"])][:3]
    recs[1]["messages"][0]["role"] = "robot"
    e = tmp_path / "eval.jsonl"
    e.write_text("".join(json.dumps(r) + "\n" for r in recs))
    locations: list[str] = []
    records = eval_records(EvalSetConfig(source="jsonl", path=str(e), n=3), locations)
    assert locations == [f"{e}:1", f"{e}:2", f"{e}:3"]
    with pytest.raises(InputFileError, match=rf"^{re.escape(str(e))}:2: the chat template refuses this record"):
        build_examples(tok, records, locations)
