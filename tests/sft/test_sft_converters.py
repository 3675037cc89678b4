"""Converters (sft.data.converters) on real records of ../shared/data, read by path, and the
bad-input cases. Expected values are read off the raw lines / the folders' SOURCE.md counts."""

import json
from collections import Counter
from pathlib import Path

import pytest

from clover_jax.yaml_config import ConfigError
from sft.data.config import DataConfig, FilterConfig, SourceConfig
from sft.data.converters import make_converter
from sft.data.records import DataError, Loc, normalize_record
from sft.data.sources import load_source
from sft.data.synthetic import TOOLS, generate_record, generate_records, write_jsonl

# ../shared/data beside the checkout (as in CI)
DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
BFCL = DATA / "bfcl"
CFG = DataConfig()


def load(fmt, path, **kw):
    return load_source(SourceConfig(name="s", format=fmt, path=str(path), **kw), CFG)


def records(loaded):
    return [r for r, _ in loaded.train]


def by_first_user(recs, text):
    return next(r for r in recs if text in next(m["content"] for m in r["messages"]
                                                 if m["role"] == "user"))


def calls(rec):
    return [c["function"] for m in rec["messages"] for c in m.get("tool_calls", ())]


# --------------------------------------------------------------------------------------- BFCL
def test_bfcl_first_accepted_value_and_parallel_calls():
    recs = records(load("bfcl", BFCL / "BFCL_v4_simple_python.json"))
    assert len(recs) == 280  # SOURCE.md: 280 shared records
    r = by_first_user(recs, "area of a triangle with a base of 10")
    assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
    # answer line: {"base": [10], "height": [5], "unit": ["units", ""]}
    assert calls(r) == [{"name": "calculate_triangle_area",
                         "arguments": {"base": 10, "height": 5, "unit": "units"}}]
    assert r["tools"][0]["type"] == "function"
    assert r["tools"][0]["function"]["name"] == "calculate_triangle_area"
    # property over the whole file: every call names an offered tool, args are declared params
    for r in recs:
        offered = {t["function"]["name"]: t["function"] for t in r["tools"]}
        for c in calls(r):
            assert c["name"] in offered
            assert set(c["arguments"]) <= set(offered[c["name"]]["parameters"]["properties"])

    par = records(load("bfcl", BFCL / "BFCL_v4_parallel.json"))
    r = by_first_user(par, "Taylor Swift and Maroon 5")
    assert calls(r) == [{"name": "spotify.play", "arguments": {"artist": "Taylor Swift", "duration": 20}},
                        {"name": "spotify.play", "arguments": {"artist": "Maroon 5", "duration": 15}}]
    assert len(r["messages"][-1]["tool_calls"]) == 2  # parallel calls in one assistant turn


def test_bfcl_optional_first_nested_dicts_and_real_bad_record():
    path = BFCL / "BFCL_v4_live_simple.json"
    live = load_source(SourceConfig(name="s", format="bfcl", path=str(path)),
                       DataConfig(max_bad_fraction=0.02))
    r = by_first_user(records(live), "Chennai, Tamil Nadu in fahrenheit")
    # {"location": ["Chennai, Tamil Nadu"], "unit": ["", "fahrenheit"]}: "" first = omitted
    assert calls(r) == [{"name": "get_current_weather", "arguments": {"location": "Chennai, Tamil Nadu"}}]
    # lines 72 and 74 have empty accepted-value lists: bad, skipped, counted, the first named
    assert live.stats.bad == 2 and live.stats.read == 181 and live.stats.train == 179
    assert live.stats.first_bad.startswith(f"{path}:72: ")
    # 2/181 = 1.1% > the default 1%: the load fails and names the first bad line
    with pytest.raises(DataError, match=rf"2 of 181 records are bad .*first bad record: {path}:72: "):
        load("bfcl", path)
    r = by_first_user(records(load("bfcl", BFCL / "BFCL_v4_live_multiple.json", max_records=5)),
                      "update my latte")
    assert calls(r) == [{"name": "ChaDri.change_drink", "arguments": {
        "drink_id": "latte", "new_preferences": {
            "size": "large", "milk_type": "coconut", "sweetness_level": "extra",
            "temperature": "hot", "special_instructions": "served boiling hot"}}}]


def test_bfcl_unsupported_categories_fail_at_open():
    with pytest.raises(ConfigError, match="ground-truth file .*possible_answer/BFCL_v4_irrelevance"):
        load("bfcl", BFCL / "BFCL_v4_irrelevance.json")
    with pytest.raises(ConfigError, match="multi-turn"):
        load("bfcl", BFCL / "BFCL_v4_multi_turn_base.json")


# ----------------------------------------------------------------------------------- When2Call
def test_when2call_all_answer_kinds():
    path = DATA / "when2call" / "when2call_test_llm_judge.shared.jsonl"
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    recs = records(load("when2call", path))
    assert len(recs) == len(raw) == 78
    kinds = Counter(r["correct_answer"] for r in raw)
    assert kinds == {"request_for_info": 26, "tool_call": 24, "cannot_answer": 28}  # SOURCE.md
    for src, rec in zip(raw, recs):
        user, reply = rec["messages"]
        assert user == {"role": "user", "content": src["question"]}
        assert [t["function"]["name"] for t in rec["tools"]] == \
            [json.loads(t)["name"] for t in src["tools"]]
        if src["correct_answer"] == "tool_call":
            want = json.loads(src["answers"]["tool_call"])
            assert reply["content"] == "" and calls(rec) == [want]
        else:  # "should not call": a plain reply, no tool call
            assert reply == {"role": "assistant", "content": src["answers"][src["correct_answer"]]}


# ----------------------------------------------------------------------------------- tau-bench
def test_tau_bench_successful_trajectories_with_tools():
    path = DATA / "tau_bench_airline" / "gpt-4o-airline.shared.jsonl"
    loaded = load("tau_bench", path)
    assert loaded.stats.read == 140 and loaded.stats.train == 65 and loaded.stats.filtered == 75
    raw = [json.loads(x) for x in path.read_text().splitlines()]
    ok = [x for x in raw if x["reward"] == 1.0]
    for src, rec in zip(ok, records(loaded)):
        assert len(rec["tools"]) == 14  # airline_tool_schemas.json
        assert [m["role"] for m in rec["messages"]] == [m["role"] for m in src["traj"]]
        want = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for m in src["traj"] for c in m.get("tool_calls") or ()]
        assert calls(rec) == want  # JSON-string arguments parsed to dicts
    assert len(records(load("tau_bench", path, options={"min_reward": 0.0}))) == 140


# ------------------------------------------------------------------------------------ ToolBench
def test_toolbench_final_path_and_finish_modes():
    pattern = DATA / "toolbench_data_example" / "answer" / "*" / "*.json"
    loaded = load("toolbench", pattern)
    # SOURCE.md: 15 files, 2 invalid, 4 give_up -> 9 kept
    assert (loaded.stats.read, loaded.stats.filtered, loaded.stats.train) == (15, 6, 9)
    assert len(records(load("toolbench", pattern, options={"keep_give_up": True}))) == 13
    f = DATA / "toolbench_data_example/answer/G1_answer/10_ChatGPT_DFS_woFilter_w2.json"
    ag = json.loads(f.read_text())["answer_generation"]
    (rec,) = records(load("toolbench", f))
    final = ag["train_messages"][-1]
    assert [m["role"] for m in rec["messages"]] == \
        [{"function": "tool"}.get(m["role"], m["role"]) for m in final]
    assert calls(rec)[-1]["name"] == "Finish"
    (ans,) = records(load("toolbench", f, options={"finish": "answer"}))
    assert ans["messages"][-1] == {"role": "assistant",
                                   "content": json.loads(ag["final_answer"])["final_answer"]}
    assert "Finish" not in {t["function"]["name"] for t in ans["tools"]}
    with pytest.raises(ConfigError, match="options.finish"):
        load("toolbench", f, options={"finish": "maybe"})


# ------------------------------------------------------------------------------------ SWE-agent
def test_swe_agent_trajectories():
    root = DATA / "swe_agent_trajectories"
    loaded = load("swe_agent", root / "**" / "*.traj")
    assert loaded.stats.train == 22 and loaded.stats.bad == 0
    simple = root / "trajectories/demonstrations/function_calling_simple.traj"
    (rec,) = records(load("swe_agent", simple))
    hist = json.loads(simple.read_text())["history"]
    assert [m["role"] for m in rec["messages"]] == [m["role"] for m in hist]
    assert sum(bool(m.get("tool_calls")) for m in rec["messages"]) == 5  # SOURCE.md table
    assert calls(rec)[0] == {"name": "find_file", "arguments": {"file_name": "missing_colon.py"}}
    # function_calling_simple.traj has no exit status: the only one require_submitted drops
    assert len(records(load("swe_agent", root / "**" / "*.traj",
                            options={"require_submitted": True}))) == 21


# --------------------------------------------------------------------------------------- Hermes
def test_hermes_prompt_examples():
    recs = records(load("hermes", DATA / "hermes_function_calling_format" / "few_shot.json"))
    assert len(recs) == 2
    r = recs[0]
    assert [m["role"] for m in r["messages"]] == ["system", "user", "assistant"]
    assert "<tools>" not in r["messages"][0]["content"]
    assert [t["function"]["name"] for t in r["tools"]] == ["calculate_distance", "generate_password"]
    assert calls(r) == [{"name": "calculate_distance", "arguments": {
        "origin": "New York", "destination": "Los Angeles", "mode": "car"}}]
    conv = make_converter("hermes", {}, [], "t")
    rec = conv({"conversations": [
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "<tool_call>\n{'name': 'f', 'arguments': {'x': 1}}\n</tool_call>"},
        {"from": "tool", "value": "<tool_response>\n1\n</tool_response>\n<tool_response>2</tool_response>"},
        {"from": "gpt", "value": "done"}]}, Loc("x.jsonl", 1))
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant", "tool", "tool", "assistant"]
    assert calls(rec) == [{"name": "f", "arguments": {"x": 1}}]
    assert [m["content"] for m in rec["messages"][2:4]] == ["1", "2"]


# ------------------------------------------------------------------------------ bad records
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


@pytest.mark.parametrize("rec,reason", [
    ({"messages": [{"role": "robot", "content": "x"}, GOOD["messages"][1]]}, "unknown role 'robot'"),
    ({"messages": [GOOD["messages"][0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "arguments are not valid JSON"),
    ({"messages": [GOOD["messages"][0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "must be a JSON object"),
    ({"messages": [GOOD["messages"][0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"arguments": {}}}]}]}, "without a function name"),
    ({"messages": [{"role": "user"}, GOOD["messages"][1]]}, "missing 'content'"),
    ({"messages": [{"role": "user", "content": 3}, GOOD["messages"][1]]}, "content must be a string"),
    ({"messages": []}, "missing or empty 'messages'"),
    ({"text": "hi"}, "missing or empty 'messages'"),
    ({"messages": [GOOD["messages"][0]]}, "no assistant message"),
    ({"messages": GOOD["messages"][::-1]}, "messages\[0\] is an assistant turn"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"name": "f", "arguments": {}}]},
                   GOOD["messages"][1]]}, "tool_calls on a 'user' message"),
    ({**GOOD, "tools": [{"description": "no name"}]}, "tool schema without a name"),
])
def test_normalize_record_rejects_bad_input_naming_the_line(rec, reason):
    with pytest.raises(DataError, match=reason) as e:
        normalize_record(rec, Loc("data.jsonl", line=17))
    assert str(e.value).startswith("data.jsonl:17: ")


def test_chat_source_skips_and_counts_bad_lines(tmp_path):
    lines = [json.dumps(GOOD)] * 200 + ["{broken", json.dumps({"messages": [{"role": "x"}]})]
    f = tmp_path / "chat.jsonl"
    f.write_text("\n".join(lines) + "\n")
    cfg = DataConfig(max_bad_fraction=0.02)
    loaded = load_source(SourceConfig(name="c", path=str(f)), cfg)
    assert (loaded.stats.read, loaded.stats.bad, loaded.stats.train) == (202, 2, 200)
    assert loaded.stats.first_bad.startswith(f"{f}:201: malformed JSON line")
    with pytest.raises(DataError, match=f"{f}:201: malformed JSON line"):
        load_source(SourceConfig(name="c", path=str(f)), DataConfig(on_bad="fail"))


def test_filters_and_max_records():
    path = DATA / "tau_bench_airline" / "gpt-4o-airline.shared.jsonl"
    all_ = records(load("tau_bench", path))
    long_ = records(load("tau_bench", path, filter=FilterConfig(min_turns=15)))
    assert long_ == [r for r in all_ if sum(m["role"] == "assistant" for m in r["messages"]) >= 15]
    assert 0 < len(long_) < len(all_)
    w2c = DATA / "when2call" / "when2call_test_llm_judge.shared.jsonl"
    assert len(records(load("when2call", w2c, filter=FilterConfig(require_tool_calls=True)))) == 24
    rx = records(load("when2call", w2c, filter=FilterConfig(content_regex=r"(?i)\bweather\b")))
    assert rx and all(any("weather" in m["content"].lower() for m in r["messages"]) or
                      "weather" in json.dumps(calls(r)).lower() for r in rx)
    assert len(records(load("when2call", w2c, max_records=7))) == 7
    with pytest.raises(ConfigError, match="content_regex"):
        FilterConfig(content_regex="(").check("f")


# --------------------------------------------------------------------------------- synthetic
def test_synthetic_records_are_deterministic_and_grounded(tmp_path):
    recs = generate_records(300, seed=3)
    assert recs[:50] == generate_records(50, seed=3) and recs != generate_records(300, seed=4)
    assert generate_record(123, seed=3) == recs[123]
    n_calls = Counter()
    for rec in recs:
        assert normalize_record(rec, None) == rec  # already canonical
        msgs = rec["messages"]
        offered = {t["function"]["name"] for t in rec["tools"]}
        user_text = ""
        for i, m in enumerate(msgs):
            if m["role"] == "user":
                user_text = m["content"]
            for c in m.get("tool_calls", ()):
                fn = c["function"]
                assert fn["name"] in offered and fn["name"] in TOOLS
                # every argument is copied verbatim from the user's request
                for v in fn["arguments"].values():
                    assert str(v) in user_text, (v, user_text)
                n_calls[len(m["tool_calls"])] += 1
            if m["role"] == "tool":  # the answer after the results quotes their values
                answer = next(x for x in msgs[i:] if x["role"] == "assistant")["content"]
                result = json.loads(m["content"])
                key = next(iter(result.values())) if "flights" not in result else \
                    result["flights"][0]["price"]
                assert str(key) in answer
    assert n_calls[1] > 0 and n_calls[2] > 0  # single and parallel calls both occur
    no_tool = [r for r in recs if not calls(r)]
    assert 0.1 < len(no_tool) / len(recs) < 0.3
    assert any("reasoning_content" in m for r in recs for m in r["messages"])
    out = write_jsonl(tmp_path / "s.jsonl", 20, seed=3)
    assert [json.loads(x) for x in out.read_text().splitlines()] == recs[:20]
    loaded = load_source(SourceConfig(name="syn", format="synthetic",
                                      options={"n_records": 40, "seed": 3}), CFG)
    assert records(loaded) == recs[:40]
    with pytest.raises(ConfigError, match="options.n_record: unknown option .*'n_records'"):
        SourceConfig(name="syn", format="synthetic", options={"n_record": 4})


def test_parquet_and_json_array_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = [{"messages": [{"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": f"a{i}"}]} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "c.parquet")
    (tmp_path / "c.json").write_text(json.dumps(recs))
    for name in ("c.parquet", "c.json"):
        loaded = load("chat", tmp_path / name)
        assert [r["messages"] for r in records(loaded)] == [r["messages"] for r in recs]
    (tmp_path / "bad.json").write_text("[{\"messages\": ")
    with pytest.raises(DataError, match="bad.json: malformed JSON array"):
        load_source(SourceConfig(name="b", path=str(tmp_path / "bad.json")), DataConfig(on_bad="fail"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="unsupported file type"):
        load("chat", tmp_path / "x.csv")
