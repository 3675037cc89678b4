"""Typed YAML configuration: YAML files (+ dotted overrides) -> nested frozen dataclasses.

The pipeline is ``load_yaml_tree`` (file + its ``base_config`` includes, deep-merged) ->
``apply_overrides`` (``a.b.c=value`` from the command line) -> ``from_tree`` (validation and
coercion against the dataclass type hints). ``load_config`` composes the three. There is no
global state or registry: the schema is whatever dataclass the caller passes in, so the trainer,
the SFT recipe and the tools can each own their config classes.

Every error is a ``ConfigError`` naming the file (and line, where YAML knows it) or the dotted
key, because a config typo that surfaces as a crash an hour into a TPU job is the failure this
module exists to prevent.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

__all__ = ["ConfigError", "deep_merge", "load_yaml_tree", "apply_overrides", "from_tree", "to_tree",
           "dump_yaml", "load_config"]

T = TypeVar("T")
_BASE_KEY = "base_config"
_NoneType = type(None)


class ConfigError(ValueError):
    """A config file, override or value that does not fit the schema."""


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats and duplicate-key detection.

    PyYAML follows YAML 1.1, where ``3e-4`` (no dot) is a *string*; learning rates are written
    that way all the time, so we add the 1.2 float pattern. Duplicate keys are silently
    last-wins in PyYAML, which hides copy-paste mistakes, so they are an error here.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue  # SafeLoader's own error for unhashable keys is clear enough
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


# ----------------------------------------------------------------------------- YAML files

def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{loc}: YAML syntax error: {problem}") from None


def deep_merge(base: Mapping, over: Mapping) -> dict:
    """Return ``base`` with ``over`` merged in: mappings merge recursively, anything else
    (lists included) replaces, so a list in a derived config never half-inherits its base."""
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def load_yaml_tree(path: str | Path) -> dict:
    """Read a YAML mapping, resolving ``base_config`` includes.

    ``base_config`` (a path relative to the including file, or a list of them) is loaded first,
    recursively; with a list, later bases override earlier ones; the file's own keys are then
    deep-merged on top. Include cycles raise ``ConfigError`` listing the cycle.
    """
    return _load_tree(Path(path), stack=(), included_from=None)


def _load_tree(path: Path, stack: tuple[Path, ...], included_from: Path | None) -> dict:
    resolved = path.resolve()
    if resolved in stack:
        cycle = " -> ".join(str(p) for p in stack[stack.index(resolved):] + (resolved,))
        raise ConfigError(f"base_config cycle: {cycle}")
    try:
        text = path.read_text()
    except FileNotFoundError:
        via = f" (base_config of {included_from})" if included_from else ""
        raise ConfigError(f"config file not found: {path}{via}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    data = _parse_yaml(text, str(path))
    if data is None:  # an empty file is an empty config, not an error
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    bases = data.pop(_BASE_KEY, None)
    if bases is None:
        return data
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: {_BASE_KEY} must be a path or a list of paths, got {bases!r}")
    merged: dict = {}
    for base in bases:
        base_path = Path(base) if Path(base).is_absolute() else path.parent / base
        merged = deep_merge(merged, _load_tree(base_path, stack + (resolved,), path))
    return deep_merge(merged, data)


# ----------------------------------------------------------------------------- overrides

def _split_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not p for p in parts):
        raise ConfigError(f"malformed override {item!r}: expected dotted.key=value")
    # `key=` means the empty string (as in Hydra), not YAML's null; write `key=null` for None.
    value = "" if raw.strip() == "" else _parse_yaml(raw, f"override {item!r}")
    return parts, value


def apply_overrides(tree: Mapping, overrides: Sequence[str]) -> dict:
    """Return a copy of ``tree`` with each ``a.b.c=value`` set; values parse as YAML
    (``20`` -> int, ``[1,2]`` -> list, ``true`` -> bool, ``null`` -> None, ``foo`` -> str)."""
    out = copy.deepcopy(dict(tree))
    for item in overrides:
        parts, value = _split_override(item)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:  # absent or null section: the override creates it
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"override {item!r}: {where!r} is {child!r}, not a section")
            node = child
        node[parts[-1]] = value
    return out


# ----------------------------------------------------------------------------- typed building

def _hints(cls: type) -> dict[str, Any]:
    # The class itself goes in localns so self-referencing string annotations resolve.
    try:
        return typing.get_type_hints(cls, localns={cls.__name__: cls})
    except NameError as e:
        raise ConfigError(f"cannot resolve type hints of {cls.__qualname__}: {e}") from None


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if tp is _NoneType:
        return "None"
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _type_error(where: str, key: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(f"{where}: {key or '<root>'}: expected {_type_name(tp)}, "
                       f"got {value!r} ({type(value).__name__})")


def _unknown_key(where: str, key: str, name: str, valid: Sequence[str]) -> ConfigError:
    full = _join(key, str(name))
    close = difflib.get_close_matches(str(name), list(valid), n=1, cutoff=0.6)
    hint = (f"did you mean {_join(key, close[0])!r}?" if close
            else "valid keys: " + ", ".join(_join(key, v) for v in valid))
    return ConfigError(f"{where}: unknown key {full!r} ({hint})")


def _init_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _build(cls: type, value: Any, key: str, where: str) -> Any:
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: {key or '<root>'}: expected a mapping for section "
                          f"{cls.__name__}, got {value!r} ({type(value).__name__})")
    fields, hints = _init_fields(cls), _hints(cls)
    for name in value:
        if name not in fields:
            raise _unknown_key(where, key, name, list(fields))
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        sub = _join(key, name)
        if name not in value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where}: missing required key {sub!r}")
            continue  # the dataclass fills its own default
        v = value[name]
        default = _field_default(f) if isinstance(v, Mapping) else None
        # A partial section refines the field's default *instance*, not the class defaults, so
        # `model.layers=2` on top of `model: Model = field(default_factory=tiny_model)` keeps
        # the rest of tiny_model.
        if dataclasses.is_dataclass(default):
            v = deep_merge(to_tree(default), v)
        kwargs[name] = _coerce(hints[name], v, sub, where)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str, where: str) -> Any:
    """Check ``value`` against ``tp`` and convert it (lists -> tuples, int -> float)."""
    if tp is Any or tp is object:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and _NoneType in args:
            return None
        cands = [a for a in args if a is not _NoneType]
        if len(cands) == 1:  # Optional[X]: X's own error is the precise one
            return _coerce(cands[0], value, key, where)
        # An exact type match wins first, so `float | int` keeps 3 an int.
        cands.sort(key=lambda a: 0 if type(value) is a else 1)
        for cand in cands:
            try:
                return _coerce(cand, value, key, where)
            except ConfigError:
                continue
        raise _type_error(where, key, tp, value)
    if origin is Literal:
        # Compare types too: YAML `1` must not satisfy Literal[True] and vice versa.
        if any(type(value) is type(a) and value == a for a in args):
            return value
        # YAML 1.1 reads a bare on / off (yes / no) as a bool: `logging.progress=off` means the word
        word = {True: ("on", "yes", "true"), False: ("off", "no", "false")}.get(value) if isinstance(value, bool) else ()
        hit = [a for a in args if isinstance(a, str) and a in word]
        if len(hit) == 1:
            return hit[0]
        raise ConfigError(f"{where}: {key}: expected one of "
                          f"{', '.join(repr(a) for a in args)}, got {value!r}")
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _build(tp, value, key, where)
    if origin in (tuple, list, Sequence) or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise _type_error(where, key, tp, value)
        # Sequences become tuples whatever the hint says, so frozen configs stay hashable.
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                raise _type_error(where, key, tp, value)
            return tuple(_coerce(a, v, f"{key}[{i}]", where)
                         for i, (a, v) in enumerate(zip(args, value)))
        item_tp = args[0] if args else Any
        return tuple(_coerce(item_tp, v, f"{key}[{i}]", where) for i, v in enumerate(value))
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _type_error(where, key, tp, value)
        k_tp, v_tp = args if args else (Any, Any)
        return {_coerce(k_tp, k, f"{key} (key {k!r})", where):
                _coerce(v_tp, v, _join(key, str(k)), where) for k, v in value.items()}
    # bool is an int subclass, so it needs excluding where int/float are expected; the plain
    # isinstance check below already refuses int -> bool (`flag: 1` is likelier a mistake).
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float) if tp is float else int):
            raise _type_error(where, key, tp, value)
        return float(value) if tp is float else value
    if isinstance(tp, type):  # bool, str, NoneType, and any other plain class
        if isinstance(value, tp):
            return value
        raise _type_error(where, key, tp, value)
    raise ConfigError(f"{where}: {key}: unsupported type hint {tp!r}")


def from_tree(cls: type[T], tree: Mapping | None, *, where: str = "config") -> T:
    """Build a ``cls`` instance (a dataclass, nested ones included) from a plain dict.

    ``where`` labels the source in error messages (a file path, "config", ...). Unknown keys,
    missing required keys and type mismatches raise ``ConfigError`` with the dotted key.
    """
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"from_tree needs a dataclass type, got {cls!r}")
    return _build(cls, {} if tree is None else tree, "", where)


def to_tree(instance: Any) -> Any:
    """Inverse of ``from_tree``: dataclasses -> dicts (init fields only), tuples -> lists."""
    if dataclasses.is_dataclass(instance) and not isinstance(instance, type):
        return {f.name: to_tree(getattr(instance, f.name))
                for f in dataclasses.fields(instance) if f.init}
    if isinstance(instance, Mapping):
        return {k: to_tree(v) for k, v in instance.items()}
    if isinstance(instance, (list, tuple)):
        return [to_tree(v) for v in instance]
    return instance


def dump_yaml(instance: Any, path: str | Path) -> None:
    """Write ``to_tree(instance)`` as YAML (field order kept), creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_tree(instance), sort_keys=False, default_flow_style=False))


# ----------------------------------------------------------------------------- composition

def _check_override_key(cls: type, item: str) -> None:
    """Reject an override whose key is not in the schema, naming the override itself (the
    tree-level check would only name the key, and the user should see what they typed)."""
    parts, _ = _split_override(item)
    current: Any = cls
    for i, part in enumerate(parts):
        fields = _init_fields(current)
        if part not in fields:
            raise _unknown_key(f"override {item!r}", ".".join(parts[:i]), part, list(fields))
        tp = _hints(current)[part]
        # Descend through Optional[Section]; stop at dict[...] or leaves (from_tree judges).
        args = [a for a in typing.get_args(tp) if a is not _NoneType]
        if typing.get_origin(tp) in (Union, types.UnionType) and len(args) == 1:
            tp = args[0]
        if not (dataclasses.is_dataclass(tp) and isinstance(tp, type)):
            return
        current = tp


def load_config(cls: type[T], path: str | Path | None, overrides: Sequence[str] = ()) -> T:
    """Defaults of ``cls`` <- YAML file ``path`` (with includes; None = no file) <- overrides."""
    tree = load_yaml_tree(path) if path is not None else {}
    for item in overrides:
        _check_override_key(cls, item)
    tree = apply_overrides(tree, overrides)
    where = str(path) if path is not None else "config"
    if overrides:
        where += " + overrides"
    return from_tree(cls, tree, where=where)
