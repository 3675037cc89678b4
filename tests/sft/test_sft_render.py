"""Chat rendering + assistant loss mask (sft.data.render) against a hand-built example, against
the tokenizer's own apply_chat_template ids, and the two mask methods against each other on real
records of ../shared/data."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from clover_jax.bridge import tokenizer as T
from sft.data.config import DataConfig, SourceConfig
from sft.data.records import DataError
from sft.data.render import ChatRenderer
from sft.data.sources import load_source

# ../shared/data beside the checkout (as in CI)
DATA = Path(__file__).resolve().parents[3] / "shared" / "data"




TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}}}}
RECORD = {"tools": [TOOL], "messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                      "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "It is 21 C in Paris."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome."},
]}


def hand_built(think: bool):
    """(text, is_assistant) segments written out by hand in the Qwen3.6 ChatML layout."""
    system = ("<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call the functions below to "
              "help with the request. Their signatures, one JSON object per line, are inside "
              "<tools></tools>:\n<tools>\n" + json.dumps(TOOL) + "\n</tools>\n\nTo call a function, "
              "reply with a JSON object holding its name and arguments inside <tool_call></tool_call>"
              " tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
              "</tool_call><|im_end|>\n")
    call = ("<think>\nNeed the tool.\n</think>\n\n" if think else "") + \
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    return [
        (system + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n", False),
        (call, True),
        ("\n<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
         "<|im_start|>assistant\n", False),
        ("It is 21 C in Paris.<|im_end|>", True),
        ("\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n", False),
        ("You're welcome.<|im_end|>", True),
        ("\n", False),
    ]


def expected(tok, segments):
    ids, mask = [], []
    for text, is_assistant in segments:
        part = tok.encode(text, add_special_tokens=False)
        ids += part
        mask += [is_assistant] * len(part)
    return ids, np.asarray(mask, bool)


@pytest.mark.parametrize("think", ["keep", "drop"])
@pytest.mark.parametrize("mode", ["generation", "prefix_diff"])
def test_hand_built_example(tok, think, mode):
    want_ids, want_mask = expected(tok, hand_built(think == "keep"))
    doc = ChatRenderer(tok, think=think, mask_mode=mode)(RECORD)
    # the concatenated hand-built pieces are exactly what the tokenizer's own template produces
    rec = RECORD if think == "keep" else {**RECORD, "messages": [
        {k: v for k, v in m.items() if k != "reasoning_content"} for m in RECORD["messages"]]}
    ref = tok.apply_chat_template(rec["messages"], tools=rec["tools"], tokenize=True)["input_ids"]
    assert want_ids == ref
    assert doc.input_ids.tolist() == want_ids and doc.input_ids.dtype == np.int32
    assert doc.loss_mask.tolist() == want_mask.tolist()
    assert (tok.convert_tokens_to_ids(T.THINK_START) in doc.input_ids.tolist()) == (think == "keep")
    # block starts / header for the splitter: every <|im_start|>, header = the system block
    im_start = tok.convert_tokens_to_ids(T.IM_START)
    assert doc.block_starts.tolist() == [i for i, t in enumerate(want_ids) if t == im_start]
    assert doc.header_len == len(tok.encode(hand_built(True)[0][0].split("<|im_start|>user")[0],
                                            add_special_tokens=False))


def test_prefix_diff_works_without_generation_tags(tok):
    """A checkpoint template without {% generation %} (the hub's case): auto -> prefix_diff,
    same mask as the tagged template; a template that rewrites history is refused."""
    plain = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", T.CHAT_TEMPLATE)
    assert plain != T.CHAT_TEMPLATE
    r = ChatRenderer(tok, chat_template=plain)
    assert r.mask_mode == "prefix_diff"
    a, b = r(RECORD), ChatRenderer(tok, mask_mode="generation")(RECORD)
    assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
    with pytest.raises(ValueError, match="generation"):
        ChatRenderer(tok, mask_mode="generation", chat_template=plain)
    unstable = "{{ messages | length }}" + plain  # earlier turns' rendering changes with later ones
    with pytest.raises(DataError, match="x.jsonl:3: messages\\[2\\]: the chat template is not prefix-stable"):
        ChatRenderer(tok, chat_template=unstable)(RECORD, loc="x.jsonl:3")


SOURCES = [("bfcl", DATA / "bfcl/BFCL_v4_parallel_multiple.json"),
           ("when2call", DATA / "when2call/when2call_test_llm_judge.shared.jsonl"),
           ("tau_bench", DATA / "tau_bench_airline/gpt-4o-airline.shared.jsonl"),
           ("toolbench", DATA / "toolbench_data_example/answer/*/*.json"),
           ("swe_agent", DATA / "swe_agent_trajectories/trajectories/demonstrations/ctf/crypto/*.traj"),
           ("hermes", DATA / "hermes_function_calling_format/few_shot.json")]


@pytest.mark.parametrize("fmt,path", SOURCES, ids=[s[0] for s in SOURCES])
def test_real_records_match_template_and_mask_properties(tok, fmt, path):
    loaded = load_source(SourceConfig(name=fmt, format=fmt, path=str(path), max_records=6),
                         DataConfig())
    gen, diff = ChatRenderer(tok, mask_mode="generation"), ChatRenderer(tok, mask_mode="prefix_diff")
    im_start, im_end = (tok.convert_tokens_to_ids(t) for t in (T.IM_START, T.IM_END))
    asst, nl = tok.encode("assistant\n", add_special_tokens=False)
    for rec, loc in loaded.train:
        d = gen(rec, loc=loc)
        ref = tok.apply_chat_template(rec["messages"], tools=rec["tools"] or None, tokenize=True)
        assert d.input_ids.tolist() == ref["input_ids"], loc
        e = diff(rec, loc=loc)
        assert e.input_ids.tolist() == d.input_ids.tolist() and \
            e.loss_mask.tolist() == d.loss_mask.tolist(), loc
        # one masked run per assistant message, each closed by <|im_end|>, right after the header
        m = np.concatenate([[False], d.loss_mask, [False]]).astype(np.int8)
        starts, ends = np.flatnonzero(np.diff(m) == 1), np.flatnonzero(np.diff(m) == -1)
        assert len(starts) == sum(x["role"] == "assistant" for x in rec["messages"]), loc
        ids = d.input_ids.tolist()
        for s, t in zip(starts, ends):
            assert ids[t - 1] == im_end, loc
            assert ids[s - 3:s] == [im_start, asst, nl] or ids[s - 2:s] == [im_start, asst], loc
