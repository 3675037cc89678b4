"""Converters for agent trajectories: tau-bench, ToolBench answer trees, SWE-agent ``.traj``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clover_jax.yaml_config import ConfigError
from sft.data.records import DataError, Loc, normalize_record, normalize_tool, parse_arguments

__all__ = ["SweAgentConverter", "TauBenchConverter", "ToolBenchConverter", "load_tools_file"]


def load_tools_file(path: Path, where: str) -> list[dict]:
    """A JSON list of tool schemas (OpenAI-wrapped or bare), normalised."""
    if not path.is_file():
        raise ConfigError(f"{where}: options.tools_file: file not found: {path}")
    try:
        tools = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(tools, list):
            raise ValueError("top level must be a list")
        return [normalize_tool(t, f"tools[{i}]", Loc(str(path))) for i, t in enumerate(tools)]
    except (ValueError, DataError) as e:
        raise ConfigError(f"{where}: options.tools_file: {path}: {e}") from None


class TauBenchConverter:
    """tau-bench historical trajectories: ``traj`` is already OpenAI chat (system policy, simulated
    user, agent with JSON-string tool-call arguments, tool outputs).

    Trajectories with ``reward < min_reward`` are filtered out (default 1.0: only successful ones,
    as the dataset card advises for SFT). The tool schemas are not in the records: ``tools_file``,
    else the one ``*tool_schemas.json`` next to the data file.
    """

    OPTIONS = {
        "tools_file": ((str,), None, "JSON list of tool schemas; default: the single "
                                     "*tool_schemas.json next to the data file"),
        "min_reward": ((int, float), 1.0, "keep trajectories with reward >= this"),
    }

    def __init__(self, options: dict, files: list[Path], where: str):
        self._min_reward = float(options["min_reward"])
        self._tools: dict[str, list[dict]] = {}
        for f in files:
            if options["tools_file"]:
                tf = Path(options["tools_file"])
            else:
                found = sorted(f.parent.glob("*tool_schemas.json"))
                if len(found) != 1:
                    raise ConfigError(f"{where}: {len(found)} *tool_schemas.json files next to "
                                      f"{f}; set options.tools_file")
                tf = found[0]
            self._tools[str(f)] = load_tools_file(tf, where)

    def __call__(self, raw: Any, loc: Loc) -> dict | None:
        if not isinstance(raw, dict) or not isinstance(raw.get("traj"), list):
            raise DataError(loc, "tau-bench record needs a 'traj' list")
        reward = raw.get("reward")
        if not isinstance(reward, (int, float)):
            raise DataError(loc, f"tau-bench record has no numeric 'reward' (got {reward!r})")
        if reward < self._min_reward:
            return None
        return normalize_record({"messages": raw["traj"], "tools": self._tools.get(loc.file, [])},
                                loc)


class ToolBenchConverter:
    """ToolBench DFS answer trees (``answer_generation``): the final answer path, i.e. the last
    (longest) element of ``train_messages``, with legacy ``function_call`` / ``role: function``
    messages turned into tool calls / tool messages; tools from ``function``.

    Records without ``train_messages`` (``valid_data: false``) and, unless ``keep_give_up``, traces
    that gave up are filtered out. ``finish: call`` keeps the terminal ``Finish`` pseudo-tool call
    verbatim (its system prompt asks for it); ``finish: answer`` turns a final
    ``Finish(return_type=give_answer)`` into a plain assistant reply and drops the Finish schema.
    """

    OPTIONS = {
        "finish": ((str,), "call", "'call' (verbatim) or 'answer' (final Finish -> reply text)"),
        "keep_give_up": ((bool,), False, "keep traces whose finish_type is give_up"),
    }

    def __init__(self, options: dict, files: list[Path], where: str):
        del files
        if options["finish"] not in ("call", "answer"):
            raise ConfigError(f"{where}: options.finish: expected 'call' or 'answer', got "
                              f"{options['finish']!r}")
        self._finish_answer = options["finish"] == "answer"
        self._keep_give_up = options["keep_give_up"]

    def __call__(self, raw: Any, loc: Loc) -> dict | None:
        ag = raw.get("answer_generation") if isinstance(raw, dict) else None
        if not isinstance(ag, dict):
            raise DataError(loc, "ToolBench record has no 'answer_generation' object")
        if not ag.get("valid_data") or not ag.get("train_messages"):
            return None
        if ag.get("finish_type") != "give_answer" and not self._keep_give_up:
            return None
        path = ag["train_messages"][-1]
        if not isinstance(path, list):
            raise DataError(loc, "train_messages[-1] must be a list of messages")
        messages = []
        for i, m in enumerate(path):
            if not isinstance(m, dict):
                raise DataError(loc, f"train_messages[-1][{i}] must be an object")
            role = m.get("role")
            if role == "function":
                messages.append({"role": "tool", "content": m.get("content")})
            elif role == "assistant" and m.get("function_call"):
                fc = m["function_call"]
                if not isinstance(fc, dict):
                    raise DataError(loc, f"train_messages[-1][{i}].function_call must be an object")
                messages.append({"role": "assistant", "content": m.get("content"),
                                 "tool_calls": [{"type": "function", "function": fc}]})
            else:
                messages.append({k: m[k] for k in ("role", "content") if k in m})
        tools = ag.get("function") or []
        if self._finish_answer:
            messages, tools = self._finish_to_answer(messages, tools, loc)
        return normalize_record({"messages": messages, "tools": tools}, loc)

    @staticmethod
    def _finish_to_answer(messages: list, tools: list, loc: Loc) -> tuple[list, list]:
        last = messages[-1]
        calls = last.get("tool_calls") or []
        if last["role"] == "assistant" and len(calls) == 1 and \
                calls[0]["function"].get("name") == "Finish":
            args = parse_arguments(calls[0]["function"].get("arguments"), "Finish call", loc)
            if args.get("return_type") == "give_answer" and isinstance(args.get("final_answer"), str):
                messages = messages[:-1] + [{"role": "assistant", "content": args["final_answer"]}]
        tools = [t for t in tools if not (isinstance(t, dict) and t.get("name") == "Finish")]
        return messages, tools


class SweAgentConverter:
    """SWE-agent ``.traj`` files: ``history`` is the chat as the model saw it (system prompt,
    issue + observations as user or tool messages, assistant thoughts + commands, or OpenAI
    ``tool_calls`` in the function-calling variants). Demonstrations embedded in the history are
    kept (they are part of the prompt). The tool schemas are not in the files: ``tools_file``
    (optional) supplies them. ``require_submitted`` keeps only ``info.exit_status == submitted``.
    """

    OPTIONS = {
        "tools_file": ((str,), None, "JSON list of tool schemas (optional)"),
        "require_submitted": ((bool,), False, "keep only trajectories that submitted a patch"),
    }

    def __init__(self, options: dict, files: list[Path], where: str):
        del files
        self._tools = load_tools_file(Path(options["tools_file"]), where) \
            if options["tools_file"] else []
        self._require_submitted = options["require_submitted"]

    def __call__(self, raw: Any, loc: Loc) -> dict | None:
        if not isinstance(raw, dict) or not isinstance(raw.get("history"), list):
            raise DataError(loc, "SWE-agent trajectory needs a 'history' list")
        if self._require_submitted and (raw.get("info") or {}).get("exit_status") != "submitted":
            return None
        messages = []
        for i, m in enumerate(raw["history"]):
            if not isinstance(m, dict):
                raise DataError(loc, f"history[{i}] must be an object")
            messages.append({k: m[k] for k in ("role", "content", "tool_calls") if k in m})
        return normalize_record({"messages": messages, "tools": self._tools}, loc)
