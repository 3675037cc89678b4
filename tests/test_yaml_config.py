"""Tests for clover_jax.yaml_config (pure Python + PyYAML, no JAX: runs in well under a second)."""

from __future__ import annotations  # exercises string annotations through get_type_hints

import dataclasses
import textwrap
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from clover_jax.yaml_config import (
    ConfigError, apply_overrides, dump_yaml, from_tree, load_config, load_yaml_tree, to_tree,
)


@dataclass(frozen=True)
class Optim:
    lr: float = 1e-3
    betas: tuple[float, ...] = (0.9, 0.95)
    schedule: Literal["cosine", "constant"] = "cosine"


@dataclass(frozen=True)
class Train:
    steps: int = 10
    batch: int | tuple[int, ...] = 1
    name: str = "run"
    warmup: Optional[int] = None
    flag: bool = False
    optim: Optim = field(default_factory=Optim)


@dataclass(frozen=True)
class Model:
    hidden: int  # required: a Root without model.hidden must be rejected
    layers: int = 2
    kinds: list[str] = ("dense",)


@dataclass(frozen=True)
class Extra:
    tags: dict[str, int] = field(default_factory=dict)
    pair: tuple[int, str] = (0, "a")


@dataclass(frozen=True)
class Root:
    model: Model
    train: Train = field(default_factory=Train)
    extra: Extra | None = None


@dataclass(frozen=True)
class WithTinyDefault:
    # The default *instance* differs from Optim's class defaults.
    optim: Optim = field(default_factory=lambda: Optim(lr=0.5, schedule="constant"))


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# ----------------------------------------------------------------------------- includes

def test_include_chain_relative_paths_and_deep_merge(tmp_path):
    write(tmp_path / "base.yaml", """
        model: {hidden: 8, layers: 4}
        train:
          steps: 5
          optim: {lr: 0.1, betas: [0.1, 0.2, 0.3]}
    """)
    write(tmp_path / "mid" / "mid.yaml", """
        base_config: ../base.yaml
        train:
          steps: 7
          optim: {betas: [0.5]}
    """)
    top = write(tmp_path / "top" / "deep" / "top.yaml", """
        base_config: ../../mid/mid.yaml
        model: {layers: 6}
    """)
    tree = load_yaml_tree(top)
    assert "base_config" not in tree
    # dicts merge key by key; the list is replaced whole, not concatenated or merged.
    assert tree == {"model": {"hidden": 8, "layers": 6},
                    "train": {"steps": 7, "optim": {"lr": 0.1, "betas": [0.5]}}}
    cfg = load_config(Root, str(top), [])
    assert cfg.model == Model(hidden=8, layers=6)
    assert cfg.train.optim.betas == (0.5,)


def test_list_of_bases_later_wins(tmp_path):
    write(tmp_path / "a.yaml", "x: {p: 1, q: 1}\ny: a\n")
    write(tmp_path / "b.yaml", "x: {q: 2, r: 2}\n")
    top = write(tmp_path / "top.yaml", "base_config: [a.yaml, b.yaml]\nx: {r: 3}\n")
    assert load_yaml_tree(top) == {"x": {"p": 1, "q": 2, "r": 3}, "y": "a"}


def test_cycle_is_reported(tmp_path):
    write(tmp_path / "a.yaml", "base_config: sub/b.yaml\nk: 1\n")
    write(tmp_path / "sub" / "b.yaml", "base_config: ../a.yaml\n")
    with pytest.raises(ConfigError, match="cycle") as e:
        load_yaml_tree(tmp_path / "a.yaml")
    msg = str(e.value)
    assert "a.yaml" in msg and "b.yaml" in msg and " -> " in msg
    write(tmp_path / "self.yaml", "base_config: self.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_yaml_tree(tmp_path / "self.yaml")


def test_diamond_include_is_not_a_cycle(tmp_path):
    write(tmp_path / "common.yaml", "c: 1\n")
    write(tmp_path / "l.yaml", "base_config: common.yaml\nl: 1\n")
    write(tmp_path / "r.yaml", "base_config: common.yaml\nr: 1\n")
    top = write(tmp_path / "top.yaml", "base_config: [l.yaml, r.yaml]\n")
    assert load_yaml_tree(top) == {"c": 1, "l": 1, "r": 1}


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found.*nope.yaml"):
        load_yaml_tree(tmp_path / "nope.yaml")
    inc = write(tmp_path / "inc.yaml", "base_config: gone.yaml\n")
    with pytest.raises(ConfigError, match=r"gone\.yaml.*base_config of .*inc\.yaml"):
        load_yaml_tree(inc)
    bad = write(tmp_path / "bad.yaml", "a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+:\d+: YAML syntax error"):
        load_yaml_tree(bad)
    lst = write(tmp_path / "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: top level must be a mapping"):
        load_yaml_tree(lst)
    dup = write(tmp_path / "dup.yaml", "a: 1\nb: 2\na: 3\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml:3:1: .*duplicate key 'a'"):
        load_yaml_tree(dup)
    assert load_yaml_tree(write(tmp_path / "empty.yaml", "")) == {}


def test_yaml12_floats(tmp_path):
    f = write(tmp_path / "f.yaml", "a: 3e-4\nb: 1.5E+2\nc: 1e3\nd: 12\ne: '3e-4'\n")
    assert load_yaml_tree(f) == {"a": 3e-4, "b": 150.0, "c": 1000.0, "d": 12, "e": "3e-4"}


# ----------------------------------------------------------------------------- overrides

def test_overrides_parse_as_yaml():
    tree = {"train": {"steps": 1, "keep": True}}
    out = apply_overrides(tree, ["train.steps=20", "x=[1,2]", "name=foo", "flag=true",
                                 "w=null", "lr=3e-4", "a.b.c=1.5", "s='007'", "e=", "eq=a=b"])
    assert out == {"train": {"steps": 20, "keep": True}, "x": [1, 2], "name": "foo",
                   "flag": True, "w": None, "lr": 3e-4, "a": {"b": {"c": 1.5}}, "s": "007",
                   "e": "", "eq": "a=b"}
    assert type(out["train"]["steps"]) is int
    assert tree == {"train": {"steps": 1, "keep": True}}  # input untouched


@pytest.mark.parametrize("bad", ["noequals", "=3", " =3", "a..b=1", "a.=1", ".a=1"])
def test_malformed_override(bad):
    with pytest.raises(ConfigError, match="malformed override") as e:
        apply_overrides({}, [bad])
    assert repr(bad) in str(e.value)


def test_override_through_a_leaf_is_an_error():
    with pytest.raises(ConfigError, match=r"'train.steps' is 5, not a section"):
        apply_overrides({"train": {"steps": 5}}, ["train.steps.x=1"])


def test_load_config_defaults_and_overrides_only():
    cfg = load_config(Root, None, ["model.hidden=16", "train.steps=3", "train.batch=[2,4]",
                                   "train.optim.lr=1", "train.warmup=5"])
    assert cfg == Root(model=Model(hidden=16), train=Train(steps=3, batch=(2, 4), warmup=5,
                                                           optim=Optim(lr=1.0)))
    assert type(cfg.train.optim.lr) is float


def test_override_beats_file(tmp_path):
    f = write(tmp_path / "c.yaml", "model: {hidden: 8}\ntrain: {steps: 5, warmup: 2}\n")
    cfg = load_config(Root, str(f), ["train.steps=6", "train.warmup=null"])
    assert cfg.train.steps == 6 and cfg.train.warmup is None and cfg.model.hidden == 8


# ----------------------------------------------------------------------------- validation

def test_unknown_key_in_file_suggests_nearest(tmp_path):
    f = write(tmp_path / "c.yaml", "model: {hidden: 8}\ntrain:\n  stpes: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(Root, str(f), [])
    assert "unknown key 'train.stpes' (did you mean 'train.steps'?)" in str(e.value)
    assert "c.yaml" in str(e.value)
    f2 = write(tmp_path / "d.yaml", "model: {hidden: 8}\ntrain: {optim: {sched: cosine}}\n")
    with pytest.raises(ConfigError, match=r"'train\.optim\.sched' \(did you mean "
                                          r"'train\.optim\.schedule'\?\)"):
        load_config(Root, str(f2), [])


def test_unknown_key_in_override_suggests_nearest():
    with pytest.raises(ConfigError) as e:
        load_config(Root, None, ["model.hidden=8", "train.optim.lrr=0.1"])
    msg = str(e.value)
    assert "override 'train.optim.lrr=0.1'" in msg
    assert "unknown key 'train.optim.lrr' (did you mean 'train.optim.lr'?)" in msg
    with pytest.raises(ConfigError, match=r"unknown key 'trian' \(did you mean 'train'\?\)"):
        load_config(Root, None, ["trian.steps=1"])
    with pytest.raises(ConfigError, match=r"unknown key 'zzz' \(valid keys: model, train"):
        load_config(Root, None, ["zzz=1"])
    # Through an Optional section, and dict sections accept any sub-key.
    with pytest.raises(ConfigError, match=r"'extra\.tgas' \(did you mean 'extra\.tags'"):
        load_config(Root, None, ["model.hidden=1", "extra.tgas.a=1"])
    cfg = load_config(Root, None, ["model.hidden=1", "extra.tags.anything=3"])
    assert cfg.extra == Extra(tags={"anything": 3})


@pytest.mark.parametrize("override, key, expected", [
    ("train.steps=abc", "train.steps", "expected int, got 'abc'"),
    ("train.steps=true", "train.steps", "expected int, got True"),
    ("train.steps=1.5", "train.steps", "expected int, got 1.5"),
    ("train.flag=1", "train.flag", "expected bool, got 1"),
    ("train.name=3", "train.name", "expected str, got 3"),
    ("train.optim.lr=fast", "train.optim.lr", "expected float, got 'fast'"),
    ("train.optim.betas=0.9", "train.optim.betas", "expected tuple[float, ...], got 0.9"),
    ("train.optim.betas=[0.9,x]", "train.optim.betas[1]", "expected float, got 'x'"),
    ("train.batch=[1,x]", "train.batch", "expected int | tuple[int, ...]"),
    ("train.warmup=x", "train.warmup", "expected int, got 'x'"),
    ("train=5", "train", "expected a mapping for section Train, got 5"),
    ("extra.tags={a: x}", "extra.tags.a", "expected int, got 'x'"),
    ("extra.pair=[1]", "extra.pair", "expected tuple[int, str]"),
])
def test_wrong_type_names_key_type_and_value(override, key, expected):
    with pytest.raises(ConfigError) as e:
        load_config(Root, None, ["model.hidden=8", override])
    assert f"{key}: {expected}" in str(e.value)


def test_missing_required(tmp_path):
    with pytest.raises(ConfigError, match="missing required key 'model'"):
        load_config(Root, None, [])
    f = write(tmp_path / "c.yaml", "model: {layers: 3}\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: missing required key 'model\.hidden'"):
        load_config(Root, str(f), [])


def test_literal_violation_lists_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_config(Root, None, ["model.hidden=8", "train.optim.schedule=linear"])
    assert "train.optim.schedule: expected one of 'cosine', 'constant', got 'linear'" in str(e.value)
    cfg = load_config(Root, None, ["model.hidden=8", "train.optim.schedule=constant"])
    assert cfg.train.optim.schedule == "constant"


@dataclass(frozen=True)
class Switches:
    progress: Literal["auto", "on", "off"] = "auto"
    flag: Literal[True, False, "auto"] = "auto"


def test_a_bare_on_or_off_means_the_word_where_a_literal_lists_it():
    """YAML 1.1 reads `progress=off` as False: a Literal listing "off" takes the word; a Literal
    listing the bool itself keeps the bool; a bool no listed word spells is still an error."""
    assert from_tree(Switches, {"progress": False}).progress == "off"
    assert load_config(Switches, None, ["progress=on"]).progress == "on"
    assert from_tree(Switches, {"flag": False}).flag is False
    with pytest.raises(ConfigError, match="expected one of 'cosine', 'constant', got True"):
        load_config(Root, None, ["model.hidden=8", "train.optim.schedule=yes"])


def test_partial_section_refines_default_instance():
    cfg = load_config(WithTinyDefault, None, ["optim.betas=[0.1]"])
    assert cfg.optim == Optim(lr=0.5, schedule="constant", betas=(0.1,))
    assert from_tree(WithTinyDefault, {}).optim.lr == 0.5


# ----------------------------------------------------------------------------- round trip

def test_round_trip_and_frozen(tmp_path):
    cfg = Root(model=Model(hidden=8, kinds=("moe", "dense")),
               train=Train(batch=(2, 3), warmup=4, optim=Optim(betas=(0.8,))),
               extra=Extra(tags={"a": 1}, pair=(3, "z")))
    tree = to_tree(cfg)
    assert tree["train"]["batch"] == [2, 3] and tree["extra"]["pair"] == [3, "z"]
    assert tree["model"]["kinds"] == ["moe", "dense"]
    assert from_tree(Root, tree) == cfg
    dump_yaml(cfg, tmp_path / "out" / "cfg.yaml")
    assert load_config(Root, str(tmp_path / "out" / "cfg.yaml"), []) == cfg
    # Sequences come back as tuples, so configs without dict fields hash (jit static args).
    plain = load_config(Root, None, ["model.hidden=2", "model.kinds=[a, b]"])
    assert plain.model.kinds == ("a", "b")
    assert hash(plain) == hash(load_config(Root, None, ["model.hidden=2", "model.kinds=[a,b]"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain.train.steps = 3  # type: ignore[misc]


def test_from_tree_rejects_non_dataclass():
    with pytest.raises(TypeError):
        from_tree(dict, {})
