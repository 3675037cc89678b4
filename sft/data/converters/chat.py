"""Converters for chat-shaped sources: ``chat`` (already canonical), ``when2call`` and ``hermes``."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

from sft.data.records import DataError, Loc, normalize_record

__all__ = ["ChatConverter", "HermesConverter", "When2CallConverter"]


class ChatConverter:
    """``{"messages": [...], "tools": [...]}`` records (OpenAI format; arguments may be JSON strings)."""

    OPTIONS: dict = {}

    def __init__(self, options: dict, files: list[Path], where: str):
        del options, files, where

    def __call__(self, raw: Any, loc: Loc) -> dict:
        return normalize_record(raw, loc)


class When2CallConverter:
    """NVIDIA When2Call: ``question`` + the answer named by ``correct_answer``.

    ``tool_call`` becomes an assistant tool call (``answers.tool_call`` is a JSON string
    ``{"name", "arguments"}``); ``request_for_info`` / ``cannot_answer`` / ``direct`` become a plain
    assistant reply (the "should not call" behaviour). ``tools`` are JSON strings.
    """

    OPTIONS: dict = {}
    ANSWERS = ("tool_call", "request_for_info", "cannot_answer", "direct")

    def __init__(self, options: dict, files: list[Path], where: str):
        del options, files, where

    def __call__(self, raw: Any, loc: Loc) -> dict:
        if not isinstance(raw, dict):
            raise DataError(loc, "When2Call record must be an object")
        for key in ("question", "correct_answer", "answers"):
            if key not in raw:
                raise DataError(loc, f"When2Call record has no {key!r}")
        kind, answers = raw["correct_answer"], raw["answers"]
        if kind not in self.ANSWERS:
            raise DataError(loc, f"unknown correct_answer {kind!r} (expected one of "
                                 f"{', '.join(self.ANSWERS)})")
        if not isinstance(answers, dict) or not isinstance(answers.get(kind), str):
            raise DataError(loc, f"answers.{kind} missing or not a string")
        if kind == "tool_call":
            try:
                call = json.loads(answers[kind])
            except json.JSONDecodeError as e:
                raise DataError(loc, f"answers.tool_call is not valid JSON ({e.msg})") from None
            reply = {"role": "assistant", "content": "", "tool_calls": [call]}
        else:
            reply = {"role": "assistant", "content": answers[kind]}
        return normalize_record({"messages": [{"role": "user", "content": raw["question"]}, reply],
                                 "tools": raw.get("tools") or []}, loc)


_TOOLS_RE = re.compile(r"<tools>(.*?)</tools>", re.S)
_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_RESP_RE = re.compile(r"<tool_response>(.*?)</tool_response>", re.S)
_SPEAKER_RE = re.compile(r"^(SYSTEM|USER|ASSISTANT|FUNCTION RESPONSE):[ \t]?", re.M)
_FROM = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
         "assistant": "assistant", "tool": "tool", "function": "tool", "observation": "tool"}
_SPEAKER = {"SYSTEM": "system", "USER": "human", "ASSISTANT": "gpt", "FUNCTION RESPONSE": "tool"}


def _loads_lenient(text: str, what: str, loc: Loc) -> Any:
    """JSON, else a Python literal (some Hermes data writes calls with single quotes)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise DataError(loc, f"{what} is neither JSON nor a Python literal ({e.msg}): "
                                 f"{text[:80]!r}") from None


class HermesConverter:
    """Hermes function-calling chats (NousResearch format).

    Accepts the ShareGPT form ``{"conversations": [{"from": system|human|gpt|tool, "value"}]}``
    and the plain-text form of the Hermes prompt assets (``{"example": "SYSTEM: ... USER: ...
    ASSISTANT: ..."}``). Tool schemas come from the system turn's ``<tools>[...]</tools>`` block
    (or a ``tools`` field), assistant ``<tool_call>{json}</tool_call>`` blocks become tool calls,
    and each ``<tool_response>`` block a tool message.
    """

    OPTIONS: dict = {}

    def __init__(self, options: dict, files: list[Path], where: str):
        del options, files, where

    @staticmethod
    def _split_text(text: str) -> list[dict]:
        text = text.strip().strip("`").strip()
        marks = list(_SPEAKER_RE.finditer(text))
        turns = []
        for i, m in enumerate(marks):
            end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
            turns.append({"from": _SPEAKER[m.group(1)], "value": text[m.end():end].strip()})
        return turns

    def __call__(self, raw: Any, loc: Loc) -> dict:
        if not isinstance(raw, dict):
            raise DataError(loc, "Hermes record must be an object")
        if isinstance(raw.get("example"), str):
            turns = self._split_text(raw["example"])
        elif isinstance(raw.get("conversations"), list):
            turns = raw["conversations"]
        else:
            raise DataError(loc, "Hermes record has neither 'conversations' nor 'example'")
        tools: list = []
        if raw.get("tools"):
            tools = raw["tools"] if isinstance(raw["tools"], list) else \
                _loads_lenient(raw["tools"], "tools", loc)
        messages = []
        for i, t in enumerate(turns):
            if not isinstance(t, dict) or not isinstance(t.get("value"), str):
                raise DataError(loc, f"conversations[{i}]: needs a string 'value'")
            role = _FROM.get(t.get("from"))
            if role is None:
                raise DataError(loc, f"conversations[{i}]: unknown speaker {t.get('from')!r}")
            value = t["value"]
            if role == "system":
                for block in _TOOLS_RE.findall(value):
                    parsed = _loads_lenient(block.strip(), "<tools> block", loc)
                    tools.extend(parsed if isinstance(parsed, list) else [parsed])
                messages.append({"role": "system", "content": _TOOLS_RE.sub("", value).strip()})
            elif role == "assistant":
                calls = [_loads_lenient(c.strip(), "<tool_call> block", loc)
                         for c in _CALL_RE.findall(value)]
                msg = {"role": "assistant", "content": _CALL_RE.sub("", value).strip()}
                if calls:
                    msg["tool_calls"] = calls
                messages.append(msg)
            elif role == "tool":
                blocks = _RESP_RE.findall(value) or [value]
                messages.extend({"role": "tool", "content": b.strip()} for b in blocks)
            else:
                messages.append({"role": role, "content": value})
        return normalize_record({"messages": messages, "tools": tools}, loc)
