"""The SFT input pipeline (sft.data.pipeline): determinism, exact state restore, mixing weights,
eval split, bad-record threshold and config/open-time errors. Packed documents are compared with
records rendered directly by ChatRenderer (the oracle for what each segment must hold)."""

import json

import numpy as np
import pytest

from clover_jax.bridge import tokenizer as T
from clover_jax.yaml_config import ConfigError, from_tree
from sft.data import DataConfig, DataError, SFTData, SourceConfig
from sft.data.render import ChatRenderer
from sft.data.synthetic import generate_records

SEQ, ALIGN, BATCH = 1024, 32, 4




def synth(name, n, seed, weight=1.0):
    return SourceConfig(name=name, format="synthetic", weight=weight,
                        options={"n_records": n, "seed": seed})


def config(*sources, **kw):
    base = dict(seq_len=SEQ, block_align=ALIGN, batch_size=BATCH, eval_fraction=0.1, seed=5)
    return DataConfig(sources=tuple(sources), **{**base, **kw})


@pytest.fixture(scope="module")
def mix_cfg():
    return config(synth("a", 240, 1, weight=3.0), synth("b", 240, 2, weight=1.0))


@pytest.fixture(scope="module")
def data(tok, mix_cfg):
    return SFTData(mix_cfg, tok)


def segments(batch):
    """All documents of a batch as (ids tuple, mask tuple), checking the row layout on the way."""
    out = []
    for ids, seg, pos, mask in zip(batch["input_ids"], batch["segment_ids"], batch["positions"],
                                   batch["loss_mask"]):
        for s in range(1, int(seg.max()) + 1):
            w = np.flatnonzero(seg == s)
            assert w[0] % ALIGN == 0 and (pos[w] == np.arange(len(w))).all()
            out.append((tuple(ids[w].tolist()), tuple(mask[w].tolist())))
        assert not mask[seg == 0].any()
    return out


def take(it, n):
    return [next(it) for _ in range(n)]


def same(a, b):
    return len(a) == len(b) and all(set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def rendered(tok, data, split):
    """{ids: mask} of every record of `split`, rendered directly (the oracle)."""
    r = ChatRenderer(tok)
    docs = [r(rec) for s in data.sources for rec, _ in getattr(s, split)]
    return {tuple(d.input_ids.tolist()): tuple(d.loss_mask.tolist()) for d in docs}


def test_batches_hold_the_rendered_train_records(tok, data):
    batches = take(data.train_iterator(), 6)
    for b in batches:
        assert set(b) == {"input_ids", "segment_ids", "positions", "loss_mask"}
        assert all(v.shape == (BATCH, SEQ) for v in b.values())
        assert b["input_ids"].dtype == np.int32 and b["loss_mask"].dtype == bool
    train = rendered(tok, data, "train")
    docs = [d for b in batches for d in segments(b)]
    assert len(docs) > 6 * BATCH  # rows are packed with several documents
    for ids, mask in docs:
        assert train.get(ids) == mask  # each segment is one train record, with its mask
    # pad tokens are the tokenizer's pad, outside every segment
    pad = tok.convert_tokens_to_ids(T.ENDOFTEXT)
    assert all((b["input_ids"][b["segment_ids"] == 0] == pad).all() for b in batches)


def test_aligned_responses_start_on_the_grid_after_the_assistant_header(tok, mix_cfg):
    """`align_responses: block`: every assistant response (run of loss tokens) starts at a multiple of
    the alignment within its document; the pads sit between `<|im_start|>assistant\n` and the
    response, carry no loss, and removing them gives the rendered record (the oracle) back. The
    iterator state still restores exactly."""
    data = SFTData(DataConfig(**{**mix_cfg.__dict__, "align_responses": "block"}), tok)
    it = data.train_iterator()
    batches = take(it, 4)
    pad = tok.convert_tokens_to_ids(T.ENDOFTEXT)
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    train = rendered(tok, data, "train")
    n_padded = 0
    for ids, mask in (d for b in batches for d in segments(b)):
        ids, mask = np.asarray(ids), np.asarray(mask)
        starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
        assert starts.size and all(s % ALIGN == 0 for s in starts)
        pads = ids == pad
        assert not mask[pads].any()
        for s in starts:  # the header, then only pads, then the response
            j = s
            while pads[j - 1]:
                j -= 1
            n_padded += s - j
            assert ids[j - len(header): j].tolist() == header
        assert train.get(tuple(ids[~pads].tolist())) == tuple(mask[~pads].tolist())
    assert n_padded > 0
    assert sum(s["response_pads"] for s in it.stats()["sources"].values()) >= n_padded
    state = json.loads(json.dumps(it.get_state()))
    want = take(it, 2)
    again = data.train_iterator()
    again.set_state(state)
    assert same(take(again, 2), want)


def test_deterministic_and_seeded(tok, data, mix_cfg):
    a = take(data.train_iterator(), 3)
    assert same(a, take(SFTData(mix_cfg, tok).train_iterator(), 3))  # a fresh build: identical
    other = SFTData(DataConfig(**{**mix_cfg.__dict__, "seed": 6}), tok)
    assert not same(a, take(other.train_iterator(), 3))


def test_state_restore_gives_identical_next_batches(tok, data, mix_cfg):
    it = data.train_iterator()
    take(it, 3)
    state = json.loads(json.dumps(it.get_state()))  # what Grain's Orbax handler stores
    want = take(it, 4)
    stats = it.stats()
    again = SFTData(mix_cfg, tok).train_iterator()  # e.g. after a job restart
    again.set_state(state)
    assert same(take(again, 4), want)
    assert again.stats() == stats  # counters restored too
    with pytest.raises(ValueError, match="shard"):
        data.train_iterator(shard_index=1, shard_count=2).set_state(state)


def test_mixing_weights_and_counters(data):
    it = data.train_iterator()
    take(it, 30)
    st = it.stats()
    docs = {n: st["sources"][n]["docs"] for n in ("a", "b")}
    assert docs["a"] + docs["b"] > 200
    assert 2.7 < docs["a"] / docs["b"] < 3.3  # weights 3 : 1
    a = st["sources"]["a"]
    assert a["train"] + a["eval"] == 240 and a["tokens"] > a["loss_tokens"] > 0
    assert st["totals"]["rows"] == 30 * BATCH and 0 < st["totals"]["pad_fraction"] < 0.5


def test_eval_split_disjoint_and_complete(tok, data):
    train, held = rendered(tok, data, "train"), rendered(tok, data, "eval")
    assert held and not set(train) & set(held)
    n_eval = sum(s.stats.eval for s in data.sources)
    assert 0.04 < n_eval / 480 < 0.16  # eval_fraction 0.1, by content hash
    docs = []
    batches = list(data.eval_iterator())  # finite: one pass
    for b in batches:
        assert b["input_ids"].shape == (BATCH, SEQ)
        docs += segments(b)
    assert len(docs) == n_eval and set(d[0] for d in docs) == set(held)  # each record once
    assert all(held[ids] == mask for ids, mask in docs)
    # split is by content: the same records land in the same split whatever the seed
    other = SFTData(config(synth("a", 240, 1, weight=3.0), synth("b", 240, 2), seed=99), tok)
    assert rendered(tok, other, "eval") == held


def test_overlong_split_and_drop_are_counted(tok):
    src = synth("a", 60, 1)
    split = SFTData(config(src, seq_len=256, eval_fraction=0.0), tok).train_iterator()
    b = take(split, 4)
    c = split.stats()["sources"]["a"]
    assert c["overlong_split"] > 0 and c["pieces"] > c["docs"]
    assert all(len(s[0]) <= 256 for x in b for s in segments(x))
    drop = SFTData(config(src, seq_len=256, eval_fraction=0.0, overlong="drop"), tok).train_iterator()
    take(drop, 4)
    c = drop.stats()["sources"]["a"]
    assert c["overlong_dropped"] > 0 and c["pieces"] == c["docs"] - c["overlong_dropped"]


def test_shards_split_documents(tok, mix_cfg, data):
    its = [data.train_iterator(shard_index=i, shard_count=2) for i in range(2)]
    halves = [take(it, 2) for it in its]
    assert all(b["input_ids"].shape == (BATCH // 2, SEQ) for h in halves for b in h)
    assert its[0].get_state()["next_doc"] > 0
    # One finite pass per shard: the shards' documents are disjoint (host i reads global documents
    # i, i+2, ...) and together they are exactly the documents of the unsharded pass, piece for piece.
    def pieces(it):
        return [(p.ref[0], p.ref[1], tuple(p.ids.tolist())) for _ in it for row in it.last_rows
                for p in row]
    whole = pieces(data.eval_iterator())
    per_shard = [pieces(data.eval_iterator(shard_index=i, shard_count=2)) for i in range(2)]
    docs = [{d for d, _, _ in s} for s in per_shard]
    assert docs[0] and docs[1] and not docs[0] & docs[1]
    assert all(d % 2 == i for i in range(2) for d in docs[i])
    assert sorted(per_shard[0] + per_shard[1]) == sorted(whole)
    assert {d for d, _, _ in whole} == set(range(len(data.eval_docs)))  # no document lost
    with pytest.raises(ConfigError, match="batch_size"):
        data.train_iterator(shard_index=0, shard_count=3)


def test_bad_fraction_threshold_names_first_bad_line(tok, tmp_path):
    good = generate_records(100, seed=0)
    lines = [json.dumps(r) for r in good]
    lines[4] = "{not json"                                                       # line 5
    lines[39] = json.dumps({"messages": [{"role": "robot", "content": "x"}]})    # line 40
    bad_args = good[76]
    bad_args["messages"][-1] = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}
    lines[76] = json.dumps(bad_args)                                             # line 77
    f = tmp_path / "mixed.jsonl"
    f.write_text("\n".join(lines) + "\n")
    src = SourceConfig(name="mine", path=str(f))
    with pytest.raises(DataError, match=rf"3 of 100 records are bad .* {f}:5: malformed JSON"):
        SFTData(config(src, max_bad_fraction=0.01), tok)
    ok = SFTData(config(src, max_bad_fraction=0.05), tok)
    assert ok.load_stats()["mine"]["bad"] == 3
    with pytest.raises(DataError, match=rf"{f}:5: malformed JSON"):
        SFTData(config(src, on_bad="fail"), tok)


def test_hf_datasets_source_offline(tok, tmp_path):
    """A `datasets` json spec (tool arguments and schemas as JSON strings: Arrow would otherwise
    merge their differing keys into one struct, adding nulls)."""
    recs = generate_records(30, seed=4)
    f = tmp_path / "hf.jsonl"
    with f.open("w") as fh:
        for r in recs:
            r = {"tools": [json.dumps(t) for t in r["tools"]], "messages": [
                {**m, "tool_calls": [{"type": "function", "function": {
                    "name": c["function"]["name"],
                    "arguments": json.dumps(c["function"]["arguments"])}} for c in m["tool_calls"]]}
                if "tool_calls" in m else m for m in r["messages"]]}
            fh.write(json.dumps(r) + "\n")
    src = SourceConfig(name="hf", hf={"path": "json", "data_files": str(f)})
    d = SFTData(config(src, eval_fraction=0.0), tok)
    assert [r for r, _ in d.sources[0].train] == recs


def test_config_and_open_errors(tok, tmp_path):
    with pytest.raises(ConfigError, match="weight: must be > 0"):
        SourceConfig(name="x", path="a.jsonl", weight=0)
    with pytest.raises(ConfigError, match="weight: must be > 0"):
        from_tree(DataConfig, {"sources": [{"name": "x", "path": "a.jsonl", "weight": -1.0}]})
    with pytest.raises(ConfigError, match=r"unknown key 'sources\[0\]\.wieght' \(did you mean "
                                          r"'sources\[0\]\.weight'"):
        from_tree(DataConfig, {"sources": [{"name": "x", "path": "a.jsonl", "wieght": 1.0}]})
    with pytest.raises(ConfigError, match="seq_len: must be a positive multiple of block_align"):
        DataConfig(seq_len=100, block_align=32)
    with pytest.raises(ConfigError, match="exactly one of 'path'"):
        SourceConfig(name="x")
    with pytest.raises(ConfigError, match="duplicate source name"):
        DataConfig(sources=(synth("a", 5, 0), synth("a", 5, 1)))
    with pytest.raises(ConfigError, match="no data sources"):
        SFTData(DataConfig(), tok)
    with pytest.raises(ConfigError, match="source 'm': path: file not found: .*nope.jsonl"):
        SFTData(config(SourceConfig(name="m", path=str(tmp_path / "nope.jsonl"))), tok)
    with pytest.raises(ConfigError, match="no file matches"):
        SFTData(config(SourceConfig(name="m", path=str(tmp_path / "*.jsonl"))), tok)
    (tmp_path / "empty.jsonl").write_text("\n")  # a user's file without a record: named, like a bad record
    with pytest.raises(DataError, match=rf"^{tmp_path / 'empty.jsonl'}: no records \(source 'e': empty"):
        SFTData(config(SourceConfig(name="e", path=str(tmp_path / "empty.jsonl"))), tok)
    with pytest.raises(ConfigError, match="eval_fraction: no eval records"):
        SFTData(config(synth("a", 5, 0), eval_fraction=0.0), tok).eval_iterator()
