"""Quality metrics for decoding research: tool-call validity, a BFCL-style argument check,
repetition, exact match and agreement with AR greedy decoding. Plain Python on decoded text/ids.

Eval records are chat records (`{"messages": [...], "tools": [...]}`); `split_record` turns one
into (prompt messages, reference assistant turn, tools): the prompt is everything before the first
assistant turn, the reference is that turn (None when there is none).
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def split_record(record: dict[str, Any], *, drop_reasoning: bool = True
                 ) -> tuple[list[dict[str, Any]], dict[str, Any] | None, list[dict[str, Any]]]:
    """(prompt messages, first assistant message or None, tools) of a chat record."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
        raise ValueError("a chat record needs a non-empty 'messages' list")
    msgs = record["messages"]
    if drop_reasoning:
        msgs = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs]
    k = next((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), None)
    tools = record.get("tools") or []
    if k is None:
        return msgs, None, tools
    if k == 0:
        raise ValueError("the first message is an assistant turn: there is no prompt before it")
    return msgs[:k], msgs[k], tools


def _fn(call: dict[str, Any]) -> dict[str, Any]:
    return call.get("function", call)


def reference_calls(message: dict[str, Any] | None) -> list[dict[str, Any]]:
    """[{"name", "arguments"}] of a reference assistant message (arguments parsed if a string)."""
    out = []
    for call in (message or {}).get("tool_calls") or []:
        fn = _fn(call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {}
        out.append({"name": fn.get("name"), "arguments": args})
    return out


def parse_tool_calls(text: str) -> tuple[list[dict[str, Any] | None], bool]:
    """(calls, well_formed): every `<tool_call>...</tool_call>` span parsed as JSON (None where it
    does not parse or is not an object with a string "name" and an object "arguments");
    `well_formed` is False if an opening tag is left unclosed or a closing one is unopened."""
    calls: list[dict[str, Any] | None] = []
    for body in TOOL_CALL_RE.findall(text):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            calls.append(None)
            continue
        ok = isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)
        calls.append(obj if ok else None)
    well_formed = text.count("<tool_call>") == text.count("</tool_call>") == len(calls)
    return calls, well_formed


def _required(tool: dict[str, Any]) -> list[str]:
    return list((_fn(tool).get("parameters") or {}).get("required") or [])


def tool_call_validity(text: str, tools: Sequence[dict[str, Any]], expects_call: bool) -> dict[str, Any]:
    """Task validity of one output. With `expects_call`: at least one tool call, every call parses,
    names an offered function and carries its required arguments. Without: no tool-call markup
    and some text. Returns {"valid", "n_calls", "parsed", "named_offered", "has_required"}."""
    calls, well_formed = parse_tool_calls(text)
    offered = {_fn(t).get("name"): t for t in tools}
    parsed = well_formed and all(c is not None for c in calls)
    named = parsed and all(c["name"] in offered for c in calls)
    required = named and all(set(_required(offered[c["name"]])) <= set(c["arguments"]) for c in calls)
    if expects_call:
        valid = bool(calls) and required
    else:
        valid = "<tool_call>" not in text and "</tool_call>" not in text and bool(text.strip())
    return {"valid": valid, "n_calls": len(calls), "parsed": parsed, "named_offered": named,
            "has_required": required}


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _value_match(got: Any, accepted: Any) -> bool:
    """BFCL-style value check with the JSON types kept apart: a boolean only matches a boolean
    (Python's True == 1 must not pass), a number only a JSON number (int vs float allowed, a
    numeric string is a type error), a string only a string (case-insensitively after
    stripping); lists/dicts element-wise."""
    options = accepted if isinstance(accepted, list) and accepted and isinstance(accepted[0], list) else [accepted]
    for acc in options:
        if isinstance(acc, bool) or isinstance(got, bool):
            if isinstance(acc, bool) and isinstance(got, bool) and got == acc:
                return True
        elif _is_number(acc):
            if _is_number(got) and float(got) == float(acc):
                return True
        elif isinstance(acc, str):
            if isinstance(got, str) and got.strip().lower() == acc.strip().lower():
                return True
        elif isinstance(acc, list):
            if isinstance(got, list) and len(got) == len(acc) and all(map(_value_match, got, acc)):
                return True
        elif isinstance(acc, dict):
            if isinstance(got, dict) and got.keys() == acc.keys() and all(_value_match(got[k], acc[k]) for k in acc):
                return True
        elif got == acc:
            return True
    return False


def bfcl_match(text: str, reference: Sequence[dict[str, Any]]) -> bool:
    """True iff the output's tool calls match the reference calls as a multiset (order free):
    same function names, the same argument keys, every value accepted (`_value_match`). A
    reference without calls matches an output without calls."""
    calls, well_formed = parse_tool_calls(text)
    if not well_formed or any(c is None for c in calls) or len(calls) != len(reference):
        return False
    left = list(calls)
    for ref in reference:
        hit = next((i for i, c in enumerate(left) if c["name"] == ref["name"]
                    and c["arguments"].keys() == ref["arguments"].keys()
                    and all(_value_match(c["arguments"][k], v) for k, v in ref["arguments"].items())), None)
        if hit is None:
            return False
        left.pop(hit)
    return True


def turn_match(text: str, reference_calls: Sequence[dict[str, Any]], reference_reply: str) -> bool:
    """Argument accuracy of one assistant turn. A reference with calls: `bfcl_match`. A reference
    without calls (a text reply, e.g. "None of the available tools can ..." or a greeting that
    copies a name from the prompt): the output must be that reply, with no tool-call markup and the
    same text after stripping (any text would otherwise pass, and the score would not see whether
    the copied values are right)."""
    if reference_calls:
        return bfcl_match(text, reference_calls)
    return "<tool_call>" not in text and "</tool_call>" not in text and text.strip() == reference_reply.strip()


def repeated_ngram_rate(ids: Sequence[int], n: int = 3) -> float:
    """Fraction of the n-grams of `ids` that repeat an earlier n-gram (0 for fewer than n tokens)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


def longest_repeated_run(ids: Sequence[int]) -> int:
    """Length of the longest run of one token repeated back to back (0 for no tokens)."""
    best = run = 0
    prev = object()
    for t in ids:
        run = run + 1 if t == prev else 1
        best, prev = max(best, run), t
    return best


def ar_agreement(ids: Sequence[int], ar_ids: Sequence[int]) -> float:
    """Positions where the output equals AR greedy decoding, over the longer of the two (1 if both
    are empty)."""
    n = max(len(ids), len(ar_ids))
    return sum(a == b for a, b in zip(ids, ar_ids)) / n if n else 1.0


__all__ = [
    "ar_agreement", "bfcl_match", "longest_repeated_run", "parse_tool_calls", "reference_calls",
    "repeated_ngram_rate", "split_record", "tool_call_validity", "turn_match",
]
