"""The resume check: the config a checkpoint was written with against the run's config now.

A resume under another learning rate, model shape, data mix or noise would silently continue a
different experiment from the old one's state. The caller (the recipe) says which parts must match,
as dotted key prefixes (``"optimizer"`` covers every ``optimizer.*`` key, ``"train.seed"`` one
key); the generic loop knows no recipe keys. Differences outside those prefixes (``train.steps``,
logging, checkpoint cadence, export) are allowed. Configs compare as JSON (the checkpoint's
``config`` item is JSON: tuples came back as lists), so a value compares equal to its round trip.
A key the checkpoint lacks that is null now, or at its default (`defaults`: the schema's default
config), is a field added since, left off: no difference.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from clover_jax.yaml_config import ConfigError

_ABSENT = "<absent>"


class ResumeConfigError(ConfigError):
    """The checkpoint's stored config differs where it must match; the message lists the diff."""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> {dotted key: leaf}; lists and scalars are leaves (compared whole)."""
    if isinstance(tree, Mapping) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def _covered(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _show(v: Any) -> str:
    return _ABSENT if v is _ABSENT else json.dumps(v)


def config_diff(stored: Mapping[str, Any], now: Mapping[str, Any], must_match: Sequence[str],
                defaults: Mapping[str, Any] | None = None) -> list[str]:
    """``"key: stored -> now"`` for every key under `must_match` whose value differs (sorted)."""
    a = flatten(json.loads(json.dumps(stored)))
    b = flatten(json.loads(json.dumps(now)))
    d = flatten(json.loads(json.dumps(defaults or {})))
    lines = []
    for k in sorted(set(a) | set(b)):
        if not _covered(k, must_match):
            continue
        va, vb = a.get(k, _ABSENT), b.get(k, _ABSENT)
        if va is _ABSENT and (vb is None or d.get(k, _ABSENT) == vb):  # a field added since, at its default
            continue
        if va != vb:
            lines.append(f"{k}: {_show(va)} -> {_show(vb)}")
    return lines


def check_resume_config(stored: Mapping[str, Any], now: Mapping[str, Any], must_match: Sequence[str], *,
                        where: str, force: bool, defaults: Mapping[str, Any] | None = None) -> list[str]:
    """The diff (empty: same experiment). Non-empty without `force`: `ResumeConfigError` naming the
    checkpoint `where`, one ``key: stored -> now`` line per difference and the way to accept them."""
    diff = config_diff(stored, now, must_match, defaults)
    if diff and not force:
        body = "\n".join(f"  {d}" for d in diff)
        raise ResumeConfigError(
            f"checkpoint {where} was written with another config ({len(diff)} difference(s) in "
            f"{', '.join(must_match)}; key: stored -> now):\n{body}\n"
            "resume anyway with train.resume=force, or use a new checkpoint.dir / logging.run_dir")
    return diff


__all__ = ["ResumeConfigError", "check_resume_config", "config_diff", "flatten"]
