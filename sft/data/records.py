"""The canonical SFT record (docs/design.md 6) and its validation.

A record is ``{"messages": [...], "tools": [...]}`` in the OpenAI chat format:

- ``messages``: dicts with ``role`` in system | user | assistant | tool and a string ``content``
  (``None`` is accepted and becomes ``""``; a list of ``{"type": "text", "text"}`` parts is joined);
  assistant messages may carry ``tool_calls`` = ``[{"type": "function", "function": {"name": str,
  "arguments": dict}}]`` and ``reasoning_content`` (str).
- ``tools``: JSON schemas, normalised to ``{"type": "function", "function": {"name", ...}}``.

Every converter ends in ``normalize_record``, so the renderer sees one shape only. Problems raise
``DataError`` carrying the location (file + line or record index) and the reason; the source loader
decides whether to skip (and count) or fail.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from clover_jax.input_file import InputFileError

__all__ = ["ROLES", "DataError", "Loc", "normalize_record", "normalize_tool", "normalize_tool_call",
           "parse_arguments", "text_of"]

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Loc:
    """Where a raw record came from: ``file:line`` (1-based, JSON Lines), ``file[index]`` (0-based,
    JSON arrays / datasets rows) or just ``file`` (one JSON object per file)."""

    file: str
    line: int | None = None
    index: int | None = None

    def __str__(self) -> str:
        if self.line is not None:
            return f"{self.file}:{self.line}"
        if self.index is not None:
            return f"{self.file}[{self.index}]"
        return self.file


class DataError(InputFileError):
    """A record (or file) that does not fit: ``str(e)`` is ``"<loc>: <reason>"`` (launch.py exits 2)."""

    def __init__(self, loc: Loc | str | None, reason: str):
        self.loc, self.reason = loc, reason
        super().__init__(f"{loc}: {reason}" if loc is not None else reason)


def text_of(content: Any, what: str, loc: Loc | None) -> str:
    """Message content -> str: None -> "", text parts joined; anything else is a DataError."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) for p in content):
        parts = []
        for p in content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise DataError(loc, f"{what}: only text content parts are supported, got {p!r:.80}")
            parts.append(p["text"])
        return "".join(parts)
    raise DataError(loc, f"{what}: content must be a string, got {type(content).__name__}")


def parse_arguments(args: Any, what: str, loc: Loc | None) -> dict:
    """Tool-call arguments -> dict. A string must be a JSON object (``json.loads``)."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise DataError(loc, f"{what}: arguments are not valid JSON ({e.msg} at char {e.pos}): "
                                 f"{args[:80]!r}") from None
    if not isinstance(args, Mapping):
        raise DataError(loc, f"{what}: arguments must be a JSON object, got {type(args).__name__}")
    return dict(args)


def normalize_tool_call(call: Any, what: str, loc: Loc | None) -> dict:
    """``{"type": "function", "function": {"name", "arguments"}}`` (or the flat ``{"name",
    "arguments"}``) -> the canonical form with dict arguments."""
    if not isinstance(call, Mapping):
        raise DataError(loc, f"{what}: a tool call must be an object, got {type(call).__name__}")
    fn = call.get("function", call)
    if not isinstance(fn, Mapping):
        raise DataError(loc, f"{what}: 'function' must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise DataError(loc, f"{what}: tool call without a function name")
    if "arguments" not in fn:
        raise DataError(loc, f"{what}: tool call {name!r} has no 'arguments'")
    return {"type": "function",
            "function": {"name": name, "arguments": parse_arguments(fn["arguments"], what, loc)}}


def normalize_tool(tool: Any, what: str, loc: Loc | None) -> dict:
    """A tool schema (OpenAI-wrapped or a bare ``{"name", "description", "parameters"}``, or its
    JSON string) -> ``{"type": "function", "function": {...}}``. Parameter schemas are kept
    verbatim (BFCL's ``"type": "dict"`` included): the model sees what the data offers."""
    if isinstance(tool, str):
        try:
            tool = json.loads(tool)
        except json.JSONDecodeError as e:
            raise DataError(loc, f"{what}: tool schema is not valid JSON ({e.msg})") from None
    if not isinstance(tool, Mapping):
        raise DataError(loc, f"{what}: a tool schema must be an object, got {type(tool).__name__}")
    fn = tool["function"] if isinstance(tool.get("function"), Mapping) else tool
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise DataError(loc, f"{what}: tool schema without a name")
    return {"type": "function", "function": dict(fn)}


def normalize_record(raw: Any, loc: Loc | None) -> dict:
    """Validate and canonicalise one chat record (see the module docstring).

    Raises DataError for: a non-object record, missing/empty ``messages``, an unknown role, a
    non-string content, malformed tool calls or arguments, tool calls outside assistant turns,
    non-string reasoning, bad tool schemas, a record with no assistant message (nothing to
    learn) or one that opens with an assistant turn. Unknown extra message keys (ids, names) are dropped.
    """
    if not isinstance(raw, Mapping):
        raise DataError(loc, f"record must be an object, got {type(raw).__name__}")
    msgs = raw.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise DataError(loc, "missing or empty 'messages' list")
    out_msgs = []
    for i, m in enumerate(msgs):
        what = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise DataError(loc, f"{what}: must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(loc, f"{what}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        if "content" not in m and not (role == "assistant" and m.get("tool_calls")):
            raise DataError(loc, f"{what}: missing 'content'")
        msg: dict[str, Any] = {"role": role, "content": text_of(m.get("content"), what, loc)}
        calls = m.get("tool_calls")
        if calls:
            if role != "assistant":
                raise DataError(loc, f"{what}: tool_calls on a {role!r} message")
            if not isinstance(calls, list):
                raise DataError(loc, f"{what}: tool_calls must be a list")
            msg["tool_calls"] = [normalize_tool_call(c, f"{what}.tool_calls[{j}]", loc)
                                 for j, c in enumerate(calls)]
        reasoning = m.get("reasoning_content")
        if reasoning is not None:
            if role != "assistant" or not isinstance(reasoning, str):
                raise DataError(loc, f"{what}: reasoning_content must be a string on an assistant "
                                     "message")
            if reasoning:
                msg["reasoning_content"] = reasoning
        out_msgs.append(msg)
    if not any(m["role"] == "assistant" for m in out_msgs):
        raise DataError(loc, "no assistant message (nothing to train on)")
    if out_msgs[0]["role"] == "assistant":
        raise DataError(loc, "messages[0] is an assistant turn (a conversation must open with a "
                             "system or user message)")
    tools = raw.get("tools") or []
    if not isinstance(tools, list):
        raise DataError(loc, f"'tools' must be a list, got {type(tools).__name__}")
    return {"messages": out_msgs,
            "tools": [normalize_tool(t, f"tools[{j}]", loc) for j, t in enumerate(tools)]}
