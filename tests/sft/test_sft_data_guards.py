"""The SFT data path never spins silently (issue: a missing jinja2 made every record fail to render
and the training iterator pulled records forever): render failures count against
max_bad_fraction over a per-source window, a source that gives no trainable piece stops the
iterator, `check_renders` fails before any compile; plus the recipe's data_root (a user setting)
and `hf:` sources named by a recipe. Every hang case runs under a deadline, so on code without the
guards the test fails by timeout instead of hanging."""

from __future__ import annotations

import contextlib
import json
import signal
import time

import pytest

from sft.data import DataConfig, DataError, SFTData, SourceConfig
from sft.data.synthetic import generate_records, write_jsonl


class Deadline(BaseException):
    """A BaseException: the renderer's `except Exception` must not turn it into a bad record."""


@contextlib.contextmanager
def deadline(seconds: float):
    def boom(*_):
        raise Deadline(f"no error within {seconds} s: the data iterator spins")

    old = signal.signal(signal.SIGALRM, boom)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _cfg(path, **kw):
    base = dict(seq_len=512, block_align=16, batch_size=2, eval_fraction=0.0, max_bad_fraction=0.02)
    return DataConfig(sources=(SourceConfig(name="mine", path=str(path)),), **{**base, **kw})


def _template_raising(tok, monkeypatch, when=lambda messages: True):
    """Make the tokenizer's chat template raise as it does without jinja2, for the records `when` picks."""
    real = tok.apply_chat_template

    def apply(messages, *a, **kw):
        if when(messages):
            raise ImportError("apply_chat_template requires jinja2 to be installed")
        return real(messages, *a, **kw)

    monkeypatch.setattr(tok, "apply_chat_template", apply)


def test_a_template_that_fails_every_record_stops_within_seconds(tok, tmp_path, monkeypatch):
    f = write_jsonl(tmp_path / "mine.jsonl", 200, seed=3)
    data = SFTData(_cfg(f), tok)  # loading converts; rendering is lazy
    _template_raising(tok, monkeypatch)
    t0 = time.perf_counter()
    with deadline(20), pytest.raises(DataError) as e:
        next(data.train_iterator())
    msg = str(e.value)
    assert time.perf_counter() - t0 < 10, msg
    # the source, the first failing record as file:line, the cause; 0.02 x 1000-doc window = 20 allowed
    assert msg.startswith("source 'mine': 21 of its last 21 documents failed to render"), msg
    assert f"first failing record: {f}:" in msg and "ImportError: apply_chat_template requires jinja2" in msg, msg
    line = int(msg.split(f"{f}:")[1].split(":")[0])
    assert 1 <= line <= 200
    # the recipe's fail-fast probe (run before the compile) says the same, in file order: line 1
    with deadline(20), pytest.raises(DataError, match=rf"source 'mine': .*first failing record: {f}:1: chat "
                                                      r"template failed: ImportError"):
        data.check_renders()
    # max_bad_fraction 1 tolerates render failures, but a source that gives nothing still stops
    tolerant = SFTData(_cfg(f, max_bad_fraction=1.0, bad_window=50), tok)
    with deadline(20), pytest.raises(DataError, match=r"source 'mine': its last 50 documents .* gave no trainable "
                                                      rf"piece.*first failing record: {f}:"):
        next(tolerant.train_iterator())


def test_a_few_render_failures_are_counted_and_training_goes_on(tok, tmp_path, monkeypatch):
    recs = generate_records(100, seed=4)
    poison = {7, 50}  # 2 of 100 records (lines 8 and 51): under 2% of any 1000-document window
    for i in poison:
        recs[i]["messages"][-1]["content"] += " POISON"
    f = tmp_path / "mine.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = SFTData(_cfg(f, batch_size=16), tok)
    _template_raising(tok, monkeypatch, lambda msgs: any("POISON" in (m.get("content") or "") for m in msgs))
    data.check_renders()  # the first record renders
    it = data.train_iterator()
    with deadline(60):
        batches = [next(it) for _ in range(8)]  # > 100 documents: one epoch at least
    st = it.stats()["sources"]["mine"]
    assert st["docs"] >= 98 and st["render_bad"] >= 2 and all(b["loss_mask"].any() for b in batches)
    assert st["first_render_bad"].split(": ")[0] in (f"{f}:8", f"{f}:51")
    # with no tolerance the first failure stops it
    strict = SFTData(_cfg(f, max_bad_fraction=0.0, batch_size=16), tok).train_iterator()
    with deadline(60), pytest.raises(DataError, match=rf"1 of its last \d+ documents failed .* {f}:(8|51): "):
        for _ in range(12):
            next(strict)


def test_a_source_whose_documents_are_all_dropped_stops(tok, tmp_path):
    """overlong=drop with rows too short for any record: every document is dropped, no batch can
    ever form."""
    f = write_jsonl(tmp_path / "mine.jsonl", 40, seed=5)
    data = SFTData(_cfg(f, seq_len=32, overlong="drop", bad_window=100), tok)
    with deadline(30), pytest.raises(DataError, match=rf"source 'mine': its last 100 documents \(from {f}:\d+\) "
                                                      r"gave no trainable piece: .*seq_len 32 with overlong='drop'"):
        next(data.train_iterator())


def test_recipe_data_root_is_a_user_setting_and_names_hf_sources(tok, tmp_path, monkeypatch):
    """Relative `path` and local-builder `hf.data_files` live under data_root (relative to the
    working directory); a missing data_root names the sources and the README section; an `hf:`
    parquet source opens offline with the records written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from clover_jax.yaml_config import ConfigError
    from sft.config import check_data_root, load_sft_config

    root = tmp_path / "agent-data"
    write_jsonl(root / "synth" / "a.jsonl", 20, seed=6)
    recs = generate_records(20, seed=7)
    # Arrow needs one schema per column: tools and tool-call arguments as JSON strings
    rows = [{"tools": [json.dumps(t) for t in r["tools"]],
             "messages": [{"role": m["role"], "content": m["content"], "tool_calls": [
                 {"type": "function", "function": {"name": c["function"]["name"],
                                                   "arguments": json.dumps(c["function"]["arguments"])}}
                 for c in m.get("tool_calls", [])]} for m in r["messages"]]} for r in recs]
    (root / "hub").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), root / "hub" / "train.parquet")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: {preset: tiny-qwen3.6}\ndata_root: agent-data\ndata:\n  eval_fraction: 0.0\n  sources:\n"
                      "    - {name: local, format: chat, path: synth/a.jsonl}\n"
                      "    - {name: hub, format: chat, hf: {path: parquet, data_files: hub/train.parquet}}\n"
                      "    - {name: gen, format: synthetic, options: {n_records: 5, seed: 0}}\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_sft_config(recipe)
    assert cfg.data_root == str(root) and cfg.data.sources[1].hf["data_files"] == str(root / "hub" / "train.parquet")
    check_data_root(cfg)
    data = SFTData(cfg.data, tok)
    assert [r for r, _ in data.sources[0].train] == generate_records(20, seed=6)
    got = [r for r, _ in data.sources[1].train]
    assert [[(m["role"], m["content"]) for m in r["messages"]] for r in got] == \
        [[(m["role"], m["content"]) for m in r["messages"]] for r in recs]
    assert [r["tools"] for r in got] == [r["tools"] for r in recs]
    # elsewhere (or no such folder): the error names data_root, the sources and the README section
    for where, what in ((tmp_path / "nowhere", "does not exist"), (tmp_path, "lacks the files of 2 source")):
        bad = load_sft_config(recipe, [f"data_root={where}"])
        with pytest.raises(ConfigError, match=rf"data_root {where} {what}.*local \(synth/a.jsonl\), hub "
                                              r"\(hub/train.parquet\).*README.md, section \"Getting the data\""):
            check_data_root(bad)
