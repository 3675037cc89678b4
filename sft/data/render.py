"""Chat rendering with the assistant loss mask.

``ChatRenderer(tok)(record)`` renders a canonical record with the tokenizer's own chat template:
``input_ids`` are exactly ``tok.apply_chat_template(messages, tools=tools)``. The loss mask
covers the assistant turns: thinking block, text, tool calls and the closing ``<|im_end|>`` (the
model must learn to stop); NOT the header ``<|im_start|>assistant\n`` (at inference the prompt
supplies it) nor the newline after ``<|im_end|>`` (template glue). Two ways to find it, which the
tests check against each other and against a hand-built example:

- ``generation`` (default when the template has ``{% generation %}`` tags, as ours does): one
  ``apply_chat_template(..., return_assistant_tokens_mask=True)`` call;
- ``prefix_diff`` (any prefix-stable ChatML template, e.g. a checkpoint's own without the tags):
  for assistant message ``k``, ``P_k = render(messages[:k], add_generation_prompt=True)`` ends
  with the header and ``Q_k = render(messages[:k+1])`` with the turn; the character span from
  ``len(P_k)`` to just after the turn's last ``<|im_end|>`` is the assistant's. ``P_k`` and ``Q_k``
  must be prefixes of the full rendering, else ``DataError`` (a template that rewrites earlier
  turns). The text is tokenised once; a token is in the mask iff its character span overlaps an
  assistant span. Tokens do not normally straddle a span edge, but content that starts with a
  newline merges with the header's newline into one token, which then counts as the
  assistant's, as in transformers' generation-mask rule. Cost: O(turns) renders per record.

``think="drop"`` removes ``reasoning_content`` before rendering. Besides ids and mask, a ``Doc``
records the token positions of every ``<|im_start|>`` (message block starts, where an overlong
document may be split) and the length of the leading system block (``header_len``, 0 if none),
which the packer repeats at the start of each split piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import re

import numpy as np

from clover_jax.bridge.tokenizer import IM_END, IM_START
from sft.data.records import DataError

__all__ = ["ChatRenderer", "Doc"]

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class Doc:
    """One rendered record. ``input_ids`` int32 [L], ``loss_mask`` bool [L] (True = assistant
    token), ``block_starts`` int32 [n_blocks] (positions of ``<|im_start|>``, ascending),
    ``header_len`` (tokens of the leading system block; 0 if none), ``source`` (index in the mix),
    ``loc`` (record location, for errors)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    block_starts: np.ndarray
    header_len: int = 0
    source: int = 0
    loc: str = ""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


class ChatRenderer:
    """Render canonical records with ``tok``'s chat template (see the module docstring)."""

    def __init__(self, tok: Any, think: Literal["keep", "drop"] = "keep",
                 mask_mode: Literal["auto", "generation", "prefix_diff"] = "auto",
                 chat_template: str | None = None):
        """``chat_template`` overrides the tokenizer's own (a Jinja string)."""
        if think not in ("keep", "drop"):
            raise ValueError(f"think must be 'keep' or 'drop', got {think!r}")
        template = chat_template or getattr(tok, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise ValueError("the tokenizer has no (single) chat template")
        has_tags = bool(_GENERATION_TAG.search(template))
        if mask_mode == "auto":
            mask_mode = "generation" if has_tags else "prefix_diff"
        if mask_mode == "generation" and not has_tags:
            raise ValueError("mask_mode='generation' needs {% generation %} tags in the template")
        if mask_mode not in ("generation", "prefix_diff"):
            raise ValueError(f"unknown mask_mode {mask_mode!r}")
        self.tok, self.think, self.mask_mode, self.template = tok, think, mask_mode, template
        self.im_start_id = tok.convert_tokens_to_ids(IM_START)

    def text(self, messages: list[dict], tools: list[dict] | None,
             add_generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                            add_generation_prompt=add_generation_prompt,
                                            chat_template=self.template)

    def prepare(self, record: dict) -> tuple[list[dict], list[dict]]:
        msgs = record["messages"]
        if self.think == "drop":
            msgs = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs]
        return msgs, record.get("tools") or []

    def assistant_spans(self, messages: list[dict], tools: list[dict], full: str,
                        loc: str = "") -> list[tuple[int, int]]:
        """Character spans ``[start, end)`` of the assistant turns within ``full``."""
        spans = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            if k == 0:
                raise DataError(loc, "messages[0] is an assistant turn")
            p = self.text(messages[:k], tools, add_generation_prompt=True)
            q = self.text(messages[:k + 1], tools)
            if not (q.startswith(p) and full.startswith(q)):
                raise DataError(loc, f"messages[{k}]: the chat template is not prefix-stable "
                                     "(the rendering of earlier turns changes with later ones)")
            tail = q.rfind(IM_END, len(p))
            spans.append((len(p), tail + len(IM_END) if tail >= 0 else len(q)))
        return spans

    def _prefix_diff(self, messages: list[dict], tools: list[dict],
                     loc: str) -> tuple[np.ndarray, np.ndarray]:
        full = self.text(messages, tools)
        spans = self.assistant_spans(messages, tools, full, loc)
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int32)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(ids.shape[0], dtype=bool)
        for a, b in spans:
            mask |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
        return ids, mask

    def _generation(self, messages: list[dict], tools: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        enc = self.tok.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                           return_dict=True, return_assistant_tokens_mask=True,
                                           chat_template=self.template)
        return (np.asarray(enc["input_ids"], dtype=np.int32),
                np.asarray(enc["assistant_masks"], dtype=bool))

    def __call__(self, record: dict, source: int = 0, loc: str = "") -> Doc:
        """Render one canonical record (see the module docstring)."""
        messages, tools = self.prepare(record)
        try:
            if self.mask_mode == "generation":
                ids, mask = self._generation(messages, tools)
            else:
                ids, mask = self._prefix_diff(messages, tools, loc)
        except DataError:
            raise
        except Exception as e:  # jinja raise_exception / TemplateError: a record the template refuses
            raise DataError(loc, f"chat template failed: {type(e).__name__}: {e}") from None
        starts = np.flatnonzero(ids == self.im_start_id).astype(np.int32)
        has_header = bool(tools) or messages[0]["role"] == "system"
        header_len = int(starts[1]) if has_header and starts.size > 1 and starts[0] == 0 else 0
        return Doc(ids, mask, starts, header_len, source, loc)
