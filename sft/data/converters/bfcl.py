"""BFCL v4 (Berkeley Function Calling Leaderboard) -> single-turn tool-call records.

A question file line ``{"id", "question": [[messages]], "function": [schemas]}`` joins its answer
line ``{"id", "ground_truth": [{fn_name: {arg: [accepted values]}}, ...]}`` by ``id``. The record is
the question's messages plus one assistant turn calling every ground-truth function (several =
parallel calls) with, per argument, the **first** accepted value (deterministic); ``""`` there means
"may be omitted", so the argument is left out. Dict-valued arguments hold accepted-value lists per
key and are resolved recursively.

Not supported (a ``ConfigError`` at open time): multi-turn files (their ground truth needs executed
tool results this data does not have) and categories without an answer file (irrelevance,
live_relevance: there is no reference reply to train on; use When2Call for "do not call" data).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clover_jax.yaml_config import ConfigError
from sft.data.records import DataError, Loc, normalize_record

__all__ = ["BfclConverter", "pick_first"]


def pick_first(accepted: Any, what: str, loc: Loc) -> tuple[bool, Any]:
    """(present, value) for one ground-truth entry: a list of accepted values -> its first;
    ``""`` first -> absent. A dict whose values are all lists is resolved key by key."""
    if not isinstance(accepted, list):
        raise DataError(loc, f"{what}: ground truth must list the accepted values, got "
                             f"{type(accepted).__name__}")
    if not accepted:
        raise DataError(loc, f"{what}: empty list of accepted values")
    value = accepted[0]
    if isinstance(value, str) and value == "":
        return False, None
    if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
        out = {}
        for k, v in value.items():
            present, picked = pick_first(v, f"{what}.{k}", loc)
            if present:
                out[k] = picked
        return True, out
    return True, value


class BfclConverter:
    OPTIONS = {
        "answers_dir": ((str,), None, "folder of the ground-truth files (same file names); "
                                      "default: <question file dir>/possible_answer"),
    }

    def __init__(self, options: dict, files: list[Path], where: str):
        self._answers: dict[str, dict[str, list]] = {}
        for f in files:
            if "multi_turn" in f.name:
                raise ConfigError(f"{where}: path: {f}: BFCL multi-turn files are not supported "
                                  "(their ground truth needs executed tool results)")
            adir = Path(options["answers_dir"]) if options["answers_dir"] else \
                f.parent / "possible_answer"
            afile = adir / f.name
            if not afile.is_file():
                raise ConfigError(f"{where}: no BFCL ground-truth file {afile} for {f} "
                                  "(irrelevance / live_relevance have none and are not "
                                  "supported; set options.answers_dir if it lives elsewhere)")
            table: dict[str, list] = {}
            for n, line in enumerate(afile.read_text(encoding="utf-8").splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    a = json.loads(line)
                    table[a["id"]] = a["ground_truth"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ConfigError(f"{afile}:{n}: malformed BFCL answer line ({e})") from None
            self._answers[str(f)] = table

    def __call__(self, raw: Any, loc: Loc) -> dict:
        if not isinstance(raw, dict) or "id" not in raw:
            raise DataError(loc, "BFCL record must be an object with an 'id'")
        rid = raw["id"]
        if "function" not in raw:
            raise DataError(loc, f"BFCL record {rid!r} has no 'function' (multi-turn records are "
                                 "not supported)")
        question = raw.get("question")
        if not isinstance(question, list) or len(question) != 1 or not isinstance(question[0], list):
            raise DataError(loc, f"BFCL record {rid!r}: 'question' must hold exactly one turn")
        gt = self._answers.get(loc.file, {}).get(rid)
        if gt is None:
            raise DataError(loc, f"BFCL record {rid!r} has no ground truth")
        if not isinstance(gt, list) or not gt:
            raise DataError(loc, f"BFCL record {rid!r}: ground truth must be a non-empty list")
        calls = []
        for j, call in enumerate(gt):
            if not isinstance(call, dict) or len(call) != 1:
                raise DataError(loc, f"ground_truth[{j}] must map one function name to its args")
            (name, args), = call.items()
            if not isinstance(args, dict):
                raise DataError(loc, f"ground_truth[{j}] ({name}): arguments must be an object")
            picked = {}
            for k, accepted in args.items():
                present, value = pick_first(accepted, f"ground_truth[{j}].{name}.{k}", loc)
                if present:
                    picked[k] = value
            calls.append({"type": "function", "function": {"name": name, "arguments": picked}})
        messages = list(question[0]) + [{"role": "assistant", "content": "", "tool_calls": calls}]
        return normalize_record({"messages": messages, "tools": raw["function"]}, loc)
