"""A task-restricted vocabulary: the base (Qwen3.6) tokenizer cut down to the tokens a corpus uses.

A tiny research model on CPU spends most of its step in the 248,320-row embedding and lm_head
(`launch.py sft` with `vocab_subset.enabled`, issue 20). The subset tokenizer is a real HF
tokenizer (same normaliser, pre-tokeniser, decoder, added tokens and chat template as the base)
whose BPE vocabulary keeps only the tokens the corpus needs, renumbered densely; so the model is an
ordinary one with a small `vocab_size`, and the data pipeline, decoder and scorer run unchanged.

Which tokens: for each distinct pre-tokenised word of the corpus, the tokens the base BPE produces
on the way (intermediate merge results included), plus the 256 byte-level symbols (any text still
encodes) and every added token. The subset's merges are the base merges whose two parts and result
are all kept, in the base order. Since that is a subset of the base merges holding every merge the
base applied to a corpus word, BPE applies the same merges in the same order, so the subset
tokenizer encodes every corpus text to the same tokens (checked on the whole corpus when built,
`VocabSubsetError` otherwise). Text outside the corpus may split into smaller pieces than the base
would give: `VocabSubset.to_subset` of its base ids says which token is missing.

`base_ids[i]` is the base id of subset id i (`vocab_subset.json` next to `tokenizer.json`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["SUBSET_FILE", "VocabSubset", "VocabSubsetError", "build_vocab_subset", "load_vocab_subset",
           "save_vocab_subset"]

SUBSET_FILE = "vocab_subset.json"


class VocabSubsetError(ValueError):
    """A token outside the task vocabulary, or a subset that does not reproduce the base."""


@dataclass(frozen=True)
class VocabSubset:
    """`base_ids` [n] int64: the base id of each subset id (ascending for BPE tokens, then the added
    tokens); `tokens`: their strings (for errors)."""

    base_ids: np.ndarray
    tokens: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(set(self.base_ids.tolist())) != len(self.base_ids):
            raise VocabSubsetError("vocab subset: base ids repeat")

    def __len__(self) -> int:
        return int(self.base_ids.shape[0])

    def to_base(self, ids: Sequence[int]) -> np.ndarray:
        """Subset ids -> base ids; an id outside [0, len) raises naming it."""
        a = np.asarray(ids, np.int64)
        bad = (a < 0) | (a >= len(self))
        if bad.any():
            raise VocabSubsetError(f"subset id {int(a[bad][0])} is outside the task vocabulary [0, {len(self)})")
        return self.base_ids[a]

    def to_subset(self, base_ids: Sequence[int], base_tokens: Sequence[str] | None = None) -> np.ndarray:
        """Base ids -> subset ids; a base id the subset lacks raises naming its token (from
        `base_tokens`, the base tokenizer's strings of `base_ids`, when given)."""
        index = {int(b): i for i, b in enumerate(self.base_ids.tolist())}
        out = np.empty(len(base_ids), np.int64)
        for j, b in enumerate(base_ids):
            i = index.get(int(b))
            if i is None:
                name = repr(base_tokens[j]) if base_tokens is not None else "?"
                raise VocabSubsetError(f"token {name} (base id {int(b)}) is not in the task vocabulary of "
                                       f"{len(self)} tokens; rebuild the subset from a corpus that has it")
            out[j] = i
        return out


def _bpe_pieces(word: str, ranks: dict[tuple[str, str], int], vocab: dict[str, int], ignore_merges: bool) -> set[str]:
    """Every token the base BPE forms while encoding one pre-tokenised `word` (final ones included)."""
    if ignore_merges and word in vocab:
        return {word}
    parts, seen = list(word), set(word)
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get((parts[i], parts[i + 1]))
            if r is not None and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        # HF BPE merges every occurrence of the best pair, left to right
        pair, merged, i = (parts[at], parts[at + 1]), [], 0
        while i < len(parts):
            if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
        seen.add(pair[0] + pair[1])
    return seen


def build_vocab_subset(base: PreTrainedTokenizerFast, texts: Iterable[str], *, chat_template: str | None = None
                       ) -> tuple[PreTrainedTokenizerFast, VocabSubset]:
    """(subset tokenizer, its map to `base`) for the corpus `texts` (module docstring), with
    `chat_template` (None: the base's). Raises VocabSubsetError if the subset does not encode some
    text exactly as `base` does."""
    texts = list(texts)
    state = json.loads(base.backend_tokenizer.to_str())
    model = state["model"]
    if model.get("type") != "BPE":
        raise VocabSubsetError(f"vocab subset: needs a BPE tokenizer, got {model.get('type')!r}")
    vocab: dict[str, int] = model["vocab"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    ranks = {m: r for r, m in enumerate(merges)}
    added = sorted(state["added_tokens"], key=lambda t: t["id"])
    split_added = re.compile("|".join(re.escape(t["content"]) for t in added)) if added else None
    norm, pre = base.backend_tokenizer.normalizer, base.backend_tokenizer.pre_tokenizer
    words: set[str] = set()
    for text in texts:
        for seg in (split_added.split(text) if split_added else [text]):
            if seg:
                seg = norm.normalize_str(seg) if norm is not None else seg
                words.update(w for w, _ in pre.pre_tokenize_str(seg))
    keep = set(pre_tokenizers.ByteLevel.alphabet()) & set(vocab)
    for w in words:
        keep |= _bpe_pieces(w, ranks, vocab, bool(model.get("ignore_merges")))
    missing = sorted(t for t in keep if t not in vocab)
    if missing:
        raise VocabSubsetError(f"vocab subset: pieces {missing[:5]} are not base tokens")
    order = sorted(keep, key=vocab.__getitem__)
    model["vocab"] = {t: i for i, t in enumerate(order)}
    model["merges"] = [list(m) for m in merges if m[0] in keep and m[1] in keep and m[0] + m[1] in keep]
    base_ids = [vocab[t] for t in order] + [t["id"] for t in added]
    for i, t in enumerate(added):
        t["id"] = len(order) + i
    state["added_tokens"] = added
    backend = Tokenizer.from_str(json.dumps(state))
    specials = {k: v for k, v in base.special_tokens_map.items() if isinstance(v, str)}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=chat_template or base.chat_template,
                                  **specials)
    subset = VocabSubset(np.asarray(base_ids, np.int64), tuple(order) + tuple(t["content"] for t in added))
    got_all = backend.encode_batch(texts, add_special_tokens=False)
    want_all = base.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    for text, got, want in zip(texts, got_all, want_all):
        if subset.to_base(got.ids).tolist() != want.ids:
            raise VocabSubsetError(f"vocab subset: encodes {text[:80]!r}... differently from the base tokenizer")
    return tok, subset


def save_vocab_subset(tok: PreTrainedTokenizerFast, subset: VocabSubset, out_dir: str | Path) -> Path:
    """The subset tokenizer's HF files plus `vocab_subset.json` in `out_dir`."""
    from clover_jax.bridge.tokenizer import save_tokenizer

    out = Path(out_dir)
    save_tokenizer(tok, out)
    (out / SUBSET_FILE).write_text(json.dumps({"base_ids": subset.base_ids.tolist(), "tokens": list(subset.tokens)}))
    return out


def load_vocab_subset(path: str | Path) -> VocabSubset | None:
    """The map saved in tokenizer dir `path`, or None when it holds a full tokenizer."""
    f = Path(path) / SUBSET_FILE
    if not f.is_file():
        return None
    d = json.loads(f.read_text())
    return VocabSubset(np.asarray(d["base_ids"], np.int64), tuple(d["tokens"]))
