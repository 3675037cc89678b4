"""Source schema -> canonical chat record converters (``sft.data.records``).

``make_converter(format, options, files, where)`` returns a callable ``(raw, loc) -> record | None``:
a record, ``None`` when the converter itself filters the item out (e.g. a failed tau-bench
trajectory; counted as filtered, not bad), or a raised ``DataError`` (counted as bad). Side files a
converter needs (BFCL answers, tool-schema files) are opened at construction, so a missing one is a
``ConfigError`` before any record is read.

``OPTIONS[format]`` lists each converter's ``options`` (name -> (type, default, doc)).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from clover_jax.yaml_config import ConfigError
from sft.data.converters.bfcl import BfclConverter
from sft.data.converters.chat import ChatConverter, HermesConverter, When2CallConverter
from sft.data.converters.traces import SweAgentConverter, TauBenchConverter, ToolBenchConverter
from sft.data.records import Loc

__all__ = ["CONVERTERS", "OPTIONS", "Converter", "check_options", "make_converter", "resolve_options"]

Converter = Callable[[Any, Loc], "dict | None"]

CONVERTERS: dict[str, type] = {
    "chat": ChatConverter,
    "synthetic": ChatConverter,  # the generator emits canonical records
    "tool_task": ChatConverter,  # so does sft.data.tool_task
    "bfcl": BfclConverter,
    "when2call": When2CallConverter,
    "hermes": HermesConverter,
    "tau_bench": TauBenchConverter,
    "toolbench": ToolBenchConverter,
    "swe_agent": SweAgentConverter,
}

OPTIONS: dict[str, dict[str, tuple[type | tuple[type, ...], Any, str]]] = {
    fmt: dict(getattr(cls, "OPTIONS", {})) for fmt, cls in CONVERTERS.items()
}
OPTIONS["synthetic"] = {
    "n_records": (int, 1000, "number of generated conversations"),
    "seed": (int, 0, "generator seed (record i depends only on (seed, i))"),
}

OPTIONS["tool_task"] = {
    "n_records": (int, 1000, "number of generated records"),
    "seed": (int, 0, "generator seed (record i depends only on (seed, split, i))"),
    "split": (str, "train", "train | heldout: disjoint user turns (sft.data.tool_task)"),
    "max_functions": (int, 32, "eligible BFCL functions in the pool (file order)"),
    "max_values": (int, 256, "string values sampled from BFCL's possible answers"),
    "value_words": (int, 0, "> 0: string values are 1-3 words of a fixed sample of that many answer words"),
    "quote_values": (bool, False, "the user turn writes string values in double quotes"),
    "name_tools": (bool, False, "the user names the function as the tool list writes it, in double quotes"),
    "unoffered_requests": (bool, True, "\"no call\" turns include requests for a function that is not offered "
                           "(off: only small talk; a requested function is always offered)"),
    "echo_share": ((float, int), 0.0, "share of copy-drill records (the user lists 2-4 values, the reply "
                   "repeats them): a training curriculum, 0 for eval splits"),
    "echo_numbers": ((float, int), 0.0, "share of copy-drill values that are 2-3 digit integers (0-1)"),
    "check_share": ((float, int), 0.0, "share of offer-check drills (\"Is there a tool to X?\" -> Yes. / No.): "
                    "a training curriculum, 0 for eval splits"),
    "unoffered_share": ((float, int), 0.0, "share of extra requests for a function that is not offered "
                        "(answered in text): a training curriculum, 0 for eval splits"),
}


def resolve_options(fmt: str, options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Defaults + ``options``, type-checked; unknown names are a ConfigError with a hint."""
    spec = OPTIONS[fmt]
    out = {k: default for k, (_, default, _) in spec.items()}
    for k, v in options.items():
        if k not in spec:
            close = difflib.get_close_matches(str(k), list(spec), n=1, cutoff=0.6)
            hint = (f"did you mean {close[0]!r}?" if close else
                    f"valid options: {', '.join(spec) or '(none)'}")
            raise ConfigError(f"{where}: options.{k}: unknown option for format {fmt!r} ({hint})")
        tp = spec[k][0]
        types_ = tp if isinstance(tp, tuple) else (tp,)
        # bool is an int subclass: `n_records: true` must not pass as an int
        if v is not None and (not isinstance(v, types_) or
                              (isinstance(v, bool) and bool not in types_)):
            names = " | ".join(t.__name__ for t in types_)
            raise ConfigError(f"{where}: options.{k}: expected {names}, got {v!r}")
        out[k] = v
    return out


def check_options(fmt: str, options: Mapping[str, Any], where: str) -> None:
    resolve_options(fmt, options, where)
    if fmt in ("synthetic", "tool_task"):
        opts = resolve_options(fmt, options, where)
        n = opts["n_records"]
        if n is None or n < 1:
            raise ConfigError(f"{where}: options.n_records: must be >= 1, got {n}")
        if fmt == "tool_task" and opts["split"] not in ("train", "heldout"):
            raise ConfigError(f"{where}: options.split: expected train or heldout, got {opts['split']!r}")
        if fmt == "tool_task" and opts["value_words"] < 0:
            raise ConfigError(f"{where}: options.value_words: must be >= 0 (0 = whole pool values), "
                              f"got {opts['value_words']}")
        if fmt == "tool_task":
            from sft.data import tool_task

            try:
                tool_task.check_curricula(**{k: opts[k] for k in tool_task.CURRICULA})
            except ValueError as e:
                raise ConfigError(f"{where}: options.{str(e).removeprefix('tool_task: ')}") from None
            if opts["unoffered_share"] > 0 and not opts["unoffered_requests"]:
                raise ConfigError(f"{where}: options.unoffered_share: {opts['unoffered_share']} adds requests for a "
                                  f"function that is not offered, but unoffered_requests is off")


def make_converter(fmt: str, options: Mapping[str, Any], files: Sequence[Path],
                   where: str) -> Converter:
    return CONVERTERS[fmt](resolve_options(fmt, options, where), list(files), where)
