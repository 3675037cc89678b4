"""`model.block_size_schedule`, the block-size curriculum of the SFT recipe: update s trains at the
size of the last stage whose fraction of `train.steps` it has reached (checked against an exact
rational oracle over random schedules), the recipe's step follows it with each size compiled once
and continues on schedule after a resume, and a bad schedule is an error naming the key."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.yaml_config import ConfigError
from sft.config import load_sft_config
from sft.noise import schedule_starts, scheduled_block_size

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "sft_tiny.yaml"
CURRICULUM = "[[0, 4], [0.25, 8], [0.5, 16], [0.75, 32]]"


def _oracle(schedule, total: int, step: int) -> int:
    """The size of the last stage with step / total >= its fraction, in exact rationals (the fraction
    as written in decimal)."""
    return [b for f, b in schedule if Fraction(step, total) >= Fraction(str(f))][-1]


def test_schedule_follows_the_fractions_of_train_steps():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 6))
        fracs = [0.0] + sorted({round(float(x), int(rng.integers(1, 4))) for x in rng.uniform(0.01, 0.99, n - 1)})
        schedule = [(f, int(rng.choice([4, 8, 16, 32, 64]))) for f in fracs if f < 1.0]
        total = int(rng.integers(1, 400))
        got = [scheduled_block_size(schedule, total, s) for s in range(total)]
        assert got == [_oracle(schedule, total, s) for s in range(total)], (schedule, total)
        # the size changes only where a stage starts
        starts = set(schedule_starts(schedule, total))
        assert all(s in starts for s in range(1, total) if got[s] != got[s - 1])
    # the curriculum over 100 updates: 25 updates per stage, by hand
    c = [(0.0, 4), (0.25, 8), (0.5, 16), (0.75, 32)]
    assert [scheduled_block_size(c, 100, s) for s in (0, 24, 25, 49, 50, 74, 75, 99)] == [4, 4, 8, 8, 16, 16, 32, 32]
    # a boundary at 0.3 of 10 updates is update 3, not 4 (0.3 * 10 = 3.0000000000000004 in floats)
    assert [scheduled_block_size([(0.0, 4), (0.3, 8)], 10, s) for s in (2, 3)] == [4, 8]


def test_recipe_step_follows_the_schedule_compiles_each_size_once_and_resumes():
    """`BlockSizeSteps` of a recipe with the curriculum (a stub setup whose step adds its block size
    to a counter): update s runs the step of the schedule's size at s, the metrics name it, each size
    is compiled once, and a run resumed at update 9 continues the same sequence."""
    from sft.recipe import BlockSizeSteps

    cfg = load_sft_config(TINY, ["model.block_size=[4, 8, 16, 32]", f"model.block_size_schedule={CURRICULUM}",
                                 "train.steps=20"])
    assert cfg.model.block_size_schedule == ((0.0, 4), (0.25, 8), (0.5, 16), (0.75, 32))

    class S(NamedTuple):
        step: jax.Array
        total: jax.Array

    made = []

    def make_step(bk):
        made.append(bk)
        return jax.jit(lambda st, b: (S(st.step + 1, st.total + bk * b), {"loss": jnp.float32(bk)}))

    abstract = S(jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    setup = SimpleNamespace(block_sizes=(4, 8, 16, 32), cfg=cfg, make_step=make_step, abstract_state=abstract)
    want = [4] * 5 + [8] * 5 + [16] * 5 + [32] * 5  # 20 updates, a stage every 5
    steps, st, got = BlockSizeSteps(setup, jax.ShapeDtypeStruct((), jnp.int32)), S(jnp.int32(0), jnp.int32(0)), []
    for _ in range(20):
        st, m = steps(st, jnp.int32(1))
        got.append(m["block_size"])
        assert float(m["loss"]) == m["block_size"]
    assert got == want and int(st.total) == sum(want) and made == [4, 8, 16, 32]
    made.clear()
    resumed, st, got = BlockSizeSteps(setup, jax.ShapeDtypeStruct((), jnp.int32)), S(jnp.int32(9), jnp.int32(0)), []
    for _ in range(11):
        st, m = resumed(st, jnp.int32(1))
        got.append(m["block_size"])
    assert got == want[9:] and made == [8, 16, 32]


@pytest.mark.parametrize("schedule, sizes, match", [
    ("[[0.1, 4], [0.5, 8]]", "[4, 8]", r"the first stage must start at fraction 0, got 0\.1"),
    ("[[0, 4], [0.5, 8], [0.5, 16]]", "[4, 8, 16]", r"stage fractions must increase strictly and stay below 1"),
    ("[[0, 4], [1.0, 8]]", "[4, 8]", r"stage fractions must increase strictly and stay below 1"),
    ("[]", "[4, 8]", r"empty"),
    ("[[0, 4], [0.5, 24]]", "[4, 24]", r"block size 24 \(stage at 0\.5\) does not divide data\.seq_len 512"),
    ("[[0, 4], [0.5, 32]]", "[4, 8]", r"block size 32 \(stage at 0\.5\) is not one of model\.block_size \[4, 8\].*"
                                      r"model\.block_size: \[4, 32\]"),
    ("[[0, 4], [0.5, 0]]", "[4, 8]", r"block size 0 \(stage at 0\.5\) must be >= 1"),
])
def test_bad_schedule_is_an_error_naming_the_key(schedule, sizes, match):
    with pytest.raises(ConfigError, match=r"sft_tiny\.yaml \+ overrides: model\.block_size_schedule: " + match):
        load_sft_config(TINY, [f"model.block_size={sizes}", f"model.block_size_schedule={schedule}"])


def test_bad_schedule_type_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"model\.block_size_schedule\[0\]"):
        load_sft_config(TINY, ["model.block_size=[4, 8]", "model.block_size_schedule=[4, 8]"])
