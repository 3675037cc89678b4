"""The read-from-the-prompt tool-call task (sft.data.tool_task) on the real BFCL schemas of
../shared/data: determinism, disjoint splits, every argument value readable from the user turn
(copied, or a number word transformed), the scenario mix, and the `tool_task` source format."""

import hashlib
import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from clover_jax.yaml_config import ConfigError
from sft.data import tool_task as tt
from sft.data.config import DataConfig, SourceConfig
from sft.data.sources import load_source

BFCL = Path(__file__).resolve().parents[3] / "shared" / "data" / "bfcl" / "BFCL_v4_simple_python.json"
WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()


@pytest.fixture(scope="module")
def schemas():
    return tt.load_schemas(str(BFCL), 32, 256)


def test_schemas_are_real_bfcl_functions_and_answer_values(schemas):
    raw = {}  # first schema of each name (BFCL reuses names with other parameters)
    for line in BFCL.read_text().splitlines():
        for f in json.loads(line)["function"] if line.strip() else []:
            raw.setdefault(f["name"], f)
    assert len(schemas.tools) == 32 and len(schemas.values) == 256
    for t in schemas.tools:
        fn = t["function"]
        src = raw[fn["name"]]["parameters"]
        assert fn["parameters"]["required"] == src["required"] and 1 <= len(src["required"]) <= 3
        assert all(fn["parameters"]["properties"][k]["type"] == src["properties"][k]["type"]
                   in ("string", "integer", "boolean") for k in src["required"])
    answers = "".join(p.read_text() for p in (BFCL.parent / "possible_answer").glob("*.json"))
    assert all(json.dumps(v) in answers for v in schemas.values[::16])  # values are answers' strings


def _said(value):
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return WORDS[value] if value <= 12 else str(value)  # 0-12 are said as words
    return value


def test_records_are_deterministic_and_answers_are_read_from_the_user_turn(schemas):
    recs = tt.generate_records(400, 3, "train", schemas)
    assert recs == tt.generate_records(400, 3, "train", schemas)
    assert recs[:50] == tt.generate_records(50, 3, "train", schemas)
    assert recs != tt.generate_records(400, 4, "train", schemas)
    kinds = Counter()
    for r in recs:
        user, answer = r["messages"][0]["content"], r["messages"][1]
        offered = {t["function"]["name"] for t in r["tools"]}
        calls = [c["function"] for c in answer.get("tool_calls", [])]
        kinds[len(calls)] += 1
        if not calls:
            assert answer["content"]
            continue
        for c in calls:
            assert c["name"] in offered and c["name"].replace("_", " ").replace(".", " ") in user
            for k, v in c["arguments"].items():
                said = _said(v)
                if said is None:  # boolean: "with x" / "without x"
                    assert f"{'with' if v else 'without'} {k.replace('_', ' ')}" in user
                else:
                    assert f"{k.replace('_', ' ')} {said}" in user, (k, v, user)
    # 50 / 30 / 20 single / two-call / no-call
    assert 0.4 < kinds[1] / 400 < 0.6 and 0.2 < kinds[2] / 400 < 0.4 and 0.12 < kinds[0] / 400 < 0.28
    assert any(w in r["messages"][0]["content"].split() for r in recs for w in WORDS[:13])  # a transform


def test_splits_are_disjoint_and_the_assertion_names_a_shared_turn(schemas):
    train = tt.generate_records(2000, 0, "train", schemas)
    held = tt.generate_records(200, 0, "heldout", schemas)
    tt.assert_disjoint(train, held)
    # by construction: the user turn's hash picks the split (recomputed here), 1 in HELDOUT_BUCKETS held out
    bucket = lambda r: int.from_bytes(hashlib.sha256(r["messages"][0]["content"].encode()).digest()[:8], "big")  # noqa: E731
    assert all(bucket(r) % tt.HELDOUT_BUCKETS == 0 for r in held)
    assert all(bucket(r) % tt.HELDOUT_BUCKETS != 0 for r in train)
    assert len({r["messages"][0]["content"] for r in held}) > 190  # varied, small talk included
    with pytest.raises(AssertionError, match="held-out user turn also in train"):
        tt.assert_disjoint(train, held[:3] + train[5:6])
    with pytest.raises(ValueError, match="split must be one of"):
        tt.generate_record(0, 0, "test", schemas)


def test_tool_task_source_format(tmp_path):
    cfg = DataConfig(eval_fraction=0.0)
    src = SourceConfig(name="task", format="tool_task", path=str(BFCL),
                       options={"n_records": 20, "seed": 1, "split": "heldout"})
    loaded = load_source(src, cfg)
    assert [r for r, _ in loaded.train] == tt.generate_records(20, 1, "heldout", tt.load_schemas(str(BFCL)))
    with pytest.raises(ConfigError, match="set path, not hf"):
        SourceConfig(name="task", format="tool_task", options={"n_records": 5})
    with pytest.raises(ConfigError, match="options.split: expected train or heldout"):
        SourceConfig(name="task", format="tool_task", path=str(BFCL), options={"split": "eval"})
    with pytest.raises(ConfigError, match="options.value_words: must be >= 0"):
        SourceConfig(name="task", format="tool_task", path=str(BFCL), options={"value_words": -1})
    for bad, match in (({"echo_numbers": 1.5}, r"options.echo_numbers must be in \[0, 1\], got 1.5"),
                       ({"check_share": 1.0}, r"options.check_share must be in \[0, 1\), got 1.0"),
                       ({"unoffered_share": -0.1}, r"options.unoffered_share must be in \[0, 1\)")):
        with pytest.raises(ConfigError, match=f"source 'task'.*{match}"):
            SourceConfig(name="task", format="tool_task", path=str(BFCL), options=bad)
    with pytest.raises(ValueError, match="value_words must be >= 0"):
        tt.load_schemas(str(BFCL), value_words=-1)
    with pytest.raises(ConfigError, match="file not found"):
        load_source(SourceConfig(name="task", format="tool_task", path=str(tmp_path / "no.json")), cfg)


def test_copy_drills_repeat_the_user_values_and_leave_the_task_stream_alone(schemas):
    """`echo_share`: about that share of records are copy drills whose reply repeats the user's 2-4 pool
    values in order; at 0 the stream is the task's own, record for record (the drill draws nothing)."""
    plain = tt.generate_records(300, 5, "train", schemas)
    assert plain == tt.generate_records(300, 5, "train", schemas, echo_share=0.0)
    mixed = tt.generate_records(300, 5, "train", schemas, echo_share=0.4)
    drills = [r for r in mixed if r["messages"][1]["content"].startswith(("Noted: ", "I will remember "))]
    assert 0.3 < len(drills) / 300 < 0.5
    for r in drills:
        user, reply = r["messages"][0]["content"], r["messages"][1]["content"]
        listed = reply.removeprefix("Noted: ").removeprefix("I will remember ").removesuffix(".")
        assert listed in user and "tool_calls" not in r["messages"][1] and len(r["tools"]) >= 2
        assert sum(v in listed for v in schemas.values) >= 2  # 2-4 pool values ("a, b and c")
    with pytest.raises(ValueError, match="echo_share"):
        tt.generate_record(0, 5, "train", schemas, echo_share=1.0)


def test_numeric_copy_drills_list_integers_in_order():
    """`echo_numbers`: that share of a drill's values are 2-3 digit integers, repeated in the user's order;
    at 0 the drills are the plain ones, record for record; outside [0, 1] is an error naming the option.
    (Word values: letters only, so a listed value is a digit string exactly when it is an integer.)"""
    schemas = tt.load_schemas(str(BFCL), value_words=96, quote_values=True)
    plain = tt.generate_records(200, 7, "train", schemas, echo_share=0.5)
    assert plain == tt.generate_records(200, 7, "train", schemas, echo_share=0.5, echo_numbers=0.0)
    mixed = tt.generate_records(400, 7, "train", schemas, echo_share=0.5, echo_numbers=0.5)
    drills = [r for r in mixed if r["messages"][1]["content"].startswith(("Noted: ", "I will remember "))]
    n_values = n_ints = 0
    for r in drills:
        user, reply = r["messages"][0]["content"], r["messages"][1]["content"]
        listed = reply.removeprefix("Noted: ").removeprefix("I will remember ").removesuffix(".")
        assert listed in user
        vals = re.split(r", | and ", listed)
        ints = [v for v in vals if v.isdigit()]
        assert all(13 <= int(v) <= 999 for v in ints)
        n_values, n_ints = n_values + len(vals), n_ints + len(ints)
    assert 0.4 < n_ints / n_values < 0.6
    with pytest.raises(ValueError, match="echo_numbers"):
        tt.generate_record(0, 7, "train", schemas, echo_share=0.5, echo_numbers=1.5)


def _contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def _string_args(rec):
    return [(k, v) for c in rec["messages"][1].get("tool_calls") or []
            for k, v in c["function"]["arguments"].items() if isinstance(v, str)]


def test_quoted_values_are_the_same_tokens_in_the_user_turn_and_in_the_call(tok):
    """`quote_values`: each string value is written `key "value"`; the value's tokens inside the call's
    JSON (`"key": "value"`) then occur verbatim in the user turn's tokens. Unquoted, most do not (the
    first word is a different token after a space than after the JSON quote): what the option is for."""
    def copyable(schemas):
        hits = []
        for r in tt.generate_records(300, 2, "train", schemas):
            user = tok.encode(r["messages"][0]["content"], add_special_tokens=False)
            for k, v in _string_args(r):
                if schemas.quote:
                    assert f'{k.replace("_", " ").replace(".", " ")} "{v}"' in r["messages"][0]["content"]
                call = tok.encode(json.dumps({k: v}), add_special_tokens=False)
                head = tok.encode(json.dumps({k: v}).removesuffix(json.dumps(v) + "}") + '"', add_special_tokens=False)
                value = call[len(head):-1]  # the value's tokens inside the call (`"}` closes it)
                assert call[:len(head)] == head and tok.decode(value) == v, (v, call, head)
                hits.append(_contains(user, value))
        return hits

    quoted, plain = copyable(tt.load_schemas(str(BFCL), quote_values=True)), copyable(tt.load_schemas(str(BFCL)))
    assert len(quoted) > 50 and all(quoted)
    assert sum(plain) < 0.5 * len(plain)


def test_named_tools_are_the_same_tokens_in_the_user_turn_the_tool_list_and_the_call(tok):
    """`name_tools`: the user names each requested function in quotes, as written; its tokens inside the
    call's JSON occur verbatim in the user turn and in the tool list's line (`name(`, after a newline),
    so "is it offered" is a match of the same tokens; a "no tool fits" reply names an absent function
    the same way. The default (name words) shares none of those tokens with the call."""
    named, plain = tt.load_schemas(str(BFCL), name_tools=True), tt.load_schemas(str(BFCL))
    head = tok.encode('{"name": "', add_special_tokens=False)
    n_calls = n_none = 0
    for r in tt.generate_records(300, 3, "train", named, unoffered_share=0.3):
        user_text, answer = r["messages"][0]["content"], r["messages"][1]
        user = tok.encode(user_text, add_special_tokens=False)
        offered = [t["function"]["name"] for t in r["tools"]]
        for call in answer.get("tool_calls", []):
            name = call["function"]["name"]
            full = tok.encode(f'{{"name": "{name}"', add_special_tokens=False)
            ids = full[len(head):-1]
            assert full[:len(head)] == head and tok.decode(ids) == name
            listed = tok.encode(f")\n{name}(", add_special_tokens=False)
            assert f'use "{name}"' in user_text and _contains(user, ids) and _contains(listed, ids), name
            assert name in offered
            n_calls += 1
        if answer["content"].startswith("None of"):
            name = re.fullmatch(r'None of the available tools is "(.+)"\.', answer["content"]).group(1)
            assert f'use "{name}"' in user_text and name not in offered
            n_none += 1
    assert n_calls > 100 and n_none > 30
    plain_recs = tt.generate_records(100, 3, "train", plain)
    assert not any('use "' in r["messages"][0]["content"] for r in plain_recs)
    assert all(r["messages"][1]["content"].startswith("None of the available tools can ")
               for r in plain_recs if r["messages"][1]["content"].startswith("None of"))


def test_value_words_make_string_values_of_a_fixed_word_sample(schemas):
    """`value_words`: string values are 1-3 distinct words of a fixed sample of the answer values' words
    (so held-out values are mostly combinations never seen whole in training)."""
    ws = tt.load_schemas(str(BFCL), value_words=40)
    assert len(ws.words) == 40 and ws.words == sorted(set(ws.words))
    answers = tt.load_schemas(str(BFCL), 32, 10_000).values
    assert all(any(re.search(rf"\b{w}\b", v) for v in answers) for w in ws.words)  # whole words of answers
    train = tt.generate_records(1500, 0, "train", ws, echo_share=0.2)
    held = tt.generate_records(150, 0, "heldout", ws)
    seen = {v for r in train for _, v in _string_args(r)}
    held_values = [v for r in held for _, v in _string_args(r)]
    for v in seen | set(held_values):
        parts = v.split(" ")
        assert 1 <= len(parts) <= 3 and len(set(parts)) == len(parts) and set(parts) <= set(ws.words), v
    assert len(held_values) > 20 and sum(v not in seen for v in held_values) > 0.3 * len(held_values)
    rng = random.Random(0)  # default (value_words 0): whole pool values
    assert schemas.words == [] and all(schemas.value(rng) in schemas.values for _ in range(50))


def test_unoffered_share_adds_no_tool_turns_and_leaves_the_task_stream_alone(schemas):
    """`unoffered_share`: extra requests for a function that is not offered, answered in text that
    names it; at 0 the stream is the task's own, record for record."""
    def unoffered(recs):
        out = []
        for r in recs:
            reply = r["messages"][1].get("content") or ""
            if reply.startswith("None of the available tools can "):
                asked = reply.removeprefix("None of the available tools can ").removesuffix(".")
                assert asked in r["messages"][0]["content"]
                assert all(tt._name_words(t["function"]["name"]) != asked for t in r["tools"])
                out.append(r)
        return out

    plain = tt.generate_records(400, 6, "train", schemas)
    assert plain == tt.generate_records(400, 6, "train", schemas, unoffered_share=0.0)
    base = len(unoffered(plain)) / 400  # ~ 20% no-call x 1/2
    more = len(unoffered(tt.generate_records(400, 6, "train", schemas, unoffered_share=0.3))) / 400
    assert 0.05 < base < 0.16 and 0.3 < more < 0.45
    with pytest.raises(ValueError, match="unoffered_share"):
        tt.generate_record(0, 6, "train", schemas, unoffered_share=1.0)


def test_unoffered_requests_off_leaves_only_small_talk_as_no_call_turns(schemas):
    """`unoffered_requests: false` (a task option, so the held-out split follows it): every request for a
    function finds it offered and every no-call turn is small talk that greets a name from the user turn;
    the call turns keep their share; adding unoffered turns to such a task is refused, naming the option."""
    off = tt.load_schemas(str(BFCL), 32, 256, unoffered_requests=False)
    for split, n in (("train", 600), ("heldout", 200)):
        recs = tt.generate_records(n, 4, split, off)
        assert recs == tt.generate_records(n, 4, split, tt.load_schemas(str(BFCL), 32, 256, 0, False, False, False))
        calls = none = 0
        for r in recs:
            answer, offered = r["messages"][1], [t["function"]["name"] for t in r["tools"]]
            if answer.get("tool_calls"):
                assert all(c["function"]["name"] in offered for c in answer["tool_calls"])
                calls += 1
                continue
            assert not answer["content"].startswith("None of"), answer["content"]
            name = re.search(r"(?:Hello|welcome,|morning,) (.+?)[!]", answer["content"]).group(1)
            assert name in r["messages"][0]["content"]
            none += 1
        assert 0.72 < calls / n < 0.88 and 0.12 < none / n < 0.28, (calls, none)
    on = tt.generate_records(600, 4, "train", schemas)
    assert sum(r["messages"][1].get("content", "").startswith("None of") for r in on) > 30  # the default has them
    with pytest.raises(ValueError, match="unoffered_share 0.2 needs unoffered_requests on"):
        tt.generate_record(0, 4, "train", off, unoffered_share=0.2)
    with pytest.raises(ConfigError, match="source 'task'.*options.unoffered_share.*unoffered_requests is off"):
        SourceConfig(name="task", format="tool_task", path=str(BFCL),
                     options={"unoffered_share": 0.2, "unoffered_requests": False})
    assert "unoffered_requests" in tt.TASK_OPTIONS


def test_offer_check_drills_answer_from_the_offered_list(schemas):
    """`check_share`: about that share of records ask whether a named function is offered; the reply is
    "Yes." exactly when it is among the record's tools (half and half); 0 leaves the stream alone; the
    curricula are keyword-only and every one of `CURRICULA` is an option of the source."""
    assert tt.generate_records(200, 9, "train", schemas) == tt.generate_records(200, 9, "train", schemas,
                                                                                  check_share=0.0)
    recs = tt.generate_records(600, 9, "train", schemas, check_share=0.3)
    drills = [r for r in recs if r["messages"][1]["content"] in ("Yes.", "No.")]
    assert 0.22 < len(drills) / 600 < 0.38
    words = {t["function"]["name"].replace(".", " ").replace("_", " "): t["function"]["name"] for t in schemas.tools}
    yes = 0
    for r in drills:
        user = r["messages"][0]["content"]
        asked = [name for w, name in words.items() if user.endswith(f" {w}?")]
        assert len(asked) == 1, user
        present = asked[0] in [t["function"]["name"] for t in r["tools"]]
        assert (r["messages"][1]["content"] == "Yes.") == present and len(r["tools"]) >= 1
        yes += present
    assert 0.35 < yes / len(drills) < 0.65
    with pytest.raises(ValueError, match="check_share"):
        tt.generate_record(0, 9, "train", schemas, check_share=1.0)
    with pytest.raises(TypeError):
        tt.generate_record(0, 9, "train", schemas, 0.1)  # curricula by keyword only
    from sft.data.converters import OPTIONS
    assert set(tt.CURRICULA) <= set(OPTIONS["tool_task"])
