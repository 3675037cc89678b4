"""The task-restricted vocabulary (clover_jax.bridge.vocab_subset) against the full Qwen3.6
tokenizer it is cut from: same tokens (mapped back) and same text on the corpus, a much smaller
vocabulary, errors that name the missing token, and a save / load round trip."""

import numpy as np
import pytest

from clover_jax.bridge.tokenizer import load_tokenizer
from clover_jax.bridge.vocab_subset import (VocabSubset, VocabSubsetError, build_vocab_subset, load_vocab_subset,
                                            save_vocab_subset)

CORPUS = [
    "<|im_start|>user\nPlease calculate triangle area with base 586 and height 43.<|im_end|>\n",
    '<|im_start|>assistant\n<tool_call>\n{"name": "calculate_triangle_area", "arguments": {"base": 586}}\n'
    "</tool_call><|im_end|>\n",
    "Good morning, this is Long Beach, CA.  Tabs\tand  spaces\n\nnewlines; ünïcödé",
]


@pytest.fixture(scope="module")
def base():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def built(base):
    return build_vocab_subset(base, CORPUS)


def test_corpus_round_trips_through_the_subset(base, built):
    tok, subset = built
    assert len(subset) == len(tok) < 1000 < len(base)
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        assert max(ids) < len(subset)
        # the subset ids, mapped back, are exactly the base tokenizer's ids of the same text
        assert subset.to_base(ids).tolist() == base.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert subset.to_subset(subset.to_base(ids)).tolist() == ids
    # the special tokens keep their strings, and ids map to the base's ids of those strings
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>"):
        assert subset.to_base([tok.convert_tokens_to_ids(t)])[0] == base.convert_tokens_to_ids(t)
    assert tok.eos_token == base.eos_token and tok.pad_token == base.pad_token


def test_text_outside_the_corpus_still_encodes_and_decodes(built):
    tok, _ = built
    text = "Zebra quokka 12345 !?"  # no word of it in the corpus: byte-level pieces
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_a_missing_token_is_named(base, built):
    _, subset = built
    ids = base.encode(" quokka", add_special_tokens=False)
    with pytest.raises(VocabSubsetError, match="quokka|base id"):
        subset.to_subset(ids, base.convert_ids_to_tokens(ids))
    tokens = base.convert_ids_to_tokens(ids)
    missing = next(t for t, i in zip(tokens, ids) if i not in set(subset.base_ids.tolist()))
    with pytest.raises(VocabSubsetError, match=f"token {missing!r}"):
        subset.to_subset(ids, tokens)
    with pytest.raises(VocabSubsetError, match=f"subset id {len(subset)} is outside"):
        subset.to_base([0, len(subset)])


def test_save_load_round_trip(built, tmp_path):
    tok, subset = built
    save_vocab_subset(tok, subset, tmp_path / "tok")
    again = load_vocab_subset(tmp_path / "tok")
    np.testing.assert_array_equal(again.base_ids, subset.base_ids)
    loaded = load_tokenizer(tmp_path / "tok", fresh=True)
    assert [loaded.encode(t, add_special_tokens=False) for t in CORPUS] == \
        [tok.encode(t, add_special_tokens=False) for t in CORPUS]
    assert load_vocab_subset(tmp_path) is None  # a dir without the map: a full tokenizer
    with pytest.raises(VocabSubsetError, match="repeat"):
        VocabSubset(np.array([3, 3]), ("a", "b"))
