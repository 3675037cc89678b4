"""train.config_diff through train.loop.run: a resume under a config that differs where the caller
says it must match is refused with a `key: stored -> now` diff; other differences pass; with
`train.resume: force` it resumes and logs the differences."""

from __future__ import annotations

import pytest

from train.config_diff import config_diff

from tests.train.toy_loop import steps_on_disk, toy_run

MUST = ("optimizer", "train.seed")


def _cfg(lr, steps, seed=0):
    return {"optimizer": {"lr": lr, "no_decay": ["a", "b"]}, "train": {"steps": steps, "seed": seed},
            "logging": {"run_dir": "x"}}


def test_config_diff_lists_only_covered_keys():
    from train.config_diff import config_diff

    a = {"optimizer": {"lr": 1e-3, "no_decay": ("a", "b")}, "train": {"steps": 4, "seed": 0}, "x": {"y": 1}}
    b = {"optimizer": {"lr": 2e-3, "no_decay": ["a", "b"], "b1": 0.9, "new_off": None}, "train": {"steps": 8, "seed": 1},
         "x": {"y": 2}}
    # optimizer.new_off: a field added since the checkpoint, null (off) now: not a difference
    assert config_diff(a, b, MUST) == ["optimizer.b1: <absent> -> 0.9", "optimizer.lr: 0.001 -> 0.002",
                                       "train.seed: 0 -> 1"]
    assert config_diff(b, a, MUST)[0] == "optimizer.b1: 0.9 -> <absent>"  # only that direction is forgiven
    assert "optimizer.new_off: null -> <absent>" in config_diff(b, a, MUST)


def test_resume_with_another_lr_is_refused_and_force_resumes_and_logs(tmp_path):
    from train.config_diff import ResumeConfigError

    run, ck = tmp_path / "run", tmp_path / "ckpt"
    toy_run(run, ck, steps=4, every=4, run_config=_cfg(3e-2, 4), must_match=MUST)
    # train.steps and logging may change: resumes
    res = toy_run(run, ck, steps=6, every=4, run_config=_cfg(3e-2, 6), must_match=MUST)
    assert res.resumed_from == 4 and res.step == 6
    with pytest.raises(ResumeConfigError) as e:
        toy_run(run, ck, steps=8, every=4, lr=5e-2, run_config=_cfg(5e-2, 8), must_match=MUST)
    msg = str(e.value)
    assert f"checkpoint {ck / '6'} was written with another config" in msg and "\n  optimizer.lr: 0.03 -> 0.05\n" in msg
    assert "train.steps" not in msg and "train.resume=force" in msg, msg
    assert steps_on_disk(ck) == [4, 6]
    msgs: list[str] = []
    res = toy_run(run, ck, steps=8, every=4, lr=5e-2, resume="force", run_config=_cfg(5e-2, 8), must_match=MUST,
                  messages=msgs)
    assert res.resumed_from == 6 and res.step == 8
    assert any("train.resume=force" in m and "optimizer.lr: 0.03 -> 0.05" in m for m in msgs), msgs


def test_a_section_added_since_the_checkpoint_matches_at_its_default():
    """A checkpoint written before a section existed (no `lora` in its stored config) resumes while
    the section is at its default, and is refused once the run sets it."""
    from clover_jax.yaml_config import to_tree
    from sft.config import RESUME_MUST_MATCH, SFTConfig

    defaults = to_tree(SFTConfig())
    stored = {k: v for k, v in defaults.items() if k != "lora"}
    assert config_diff(stored, defaults, RESUME_MUST_MATCH, defaults) == []
    now = {**defaults, "lora": {**defaults["lora"], "rank": 8}}
    assert config_diff(stored, now, RESUME_MUST_MATCH, defaults) == ["lora.rank: <absent> -> 8"]
    assert "lora.rank: <absent> -> 0" in config_diff(stored, defaults, RESUME_MUST_MATCH)  # no defaults given
