"""sft.noise: per-block noise levels, token masks, the complementary copy, stratified (antithetic)
levels, the multi-size block draw. Oracles: set identities on the masks, the definition of
stratification, binomial bounds on the masking rate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.yaml_config import ConfigError
from sft.noise import NoiseConfig, block_noise_levels, draw_block_size, noise_batch

MASK = 7


def _batch(rng, b=6, t=64, prompt=20, pad=8):
    """Rows: `prompt` prompt tokens, then response tokens, then `pad` pads (loss only on responses)."""
    ids = rng.integers(10, 100, (b, t)).astype(np.int32)
    lmask = np.zeros((b, t), bool)
    lmask[:, prompt:t - pad] = True
    lmask[1, :] = False  # a row without any response token
    return jnp.asarray(ids), jnp.asarray(lmask)


@pytest.mark.parametrize("complementary", [True, False])
def test_levels_are_per_block_and_masks_respect_the_loss_mask(complementary):
    ids, lmask = _batch(np.random.default_rng(0))
    bk = 8
    cfg = NoiseConfig(t_min=0.05, t_max=0.95, complementary=complementary)
    nz = noise_batch(jax.random.key(1), ids, lmask, block_size=bk, mask_token_id=MASK, cfg=cfg)
    b, t = ids.shape
    copies = 2 if complementary else 1
    assert nz.noisy_ids_RT.shape == (copies * b, t) and nz.t_BN.shape == (b, t // bk)
    t_BN = np.asarray(nz.t_BN)
    assert np.all((t_BN >= 0.05) & (t_BN <= 0.95))
    # one level per block, not per sequence: constant inside a block, different across a row's blocks
    t_A = np.asarray(nz.t_RT[:b]).reshape(b, t // bk, bk)
    np.testing.assert_array_equal(t_A, np.repeat(t_BN[..., None], bk, axis=2))
    assert np.all(t_BN.std(axis=1) > 0)
    masked = np.asarray(nz.masked_RT)
    lm = np.asarray(lmask)
    for c in range(copies):
        m = masked[c * b:(c + 1) * b]
        assert not np.any(m & ~lm), "a prompt or pad token was masked"
        np.testing.assert_array_equal(np.asarray(nz.input_ids_RT[c * b:(c + 1) * b]), np.asarray(ids))
    noisy, clean = np.asarray(nz.noisy_ids_RT), np.asarray(nz.input_ids_RT)
    np.testing.assert_array_equal(noisy == MASK, masked)
    np.testing.assert_array_equal(np.where(masked, clean, noisy), clean)
    if complementary:
        a, c = masked[:b], masked[b:]
        # every response token masked exactly once per pair
        np.testing.assert_array_equal(a.astype(int) + c.astype(int), lm.astype(int))
        np.testing.assert_allclose(np.asarray(nz.t_RT[b:]), 1.0 - np.asarray(nz.t_RT[:b]), rtol=0, atol=1e-7)


def test_masking_rate_follows_the_block_level():
    """Every token maskable, fixed level t: the masked count is Binomial(n, t) (5 sigma bound); with
    drawn levels, sum of masks per block against sum of levels (same bound)."""
    b, t, bk = 64, 128, 16
    ids = jnp.zeros((b, t), jnp.int32)
    lm = jnp.ones((b, t), bool)
    cfg = NoiseConfig(complementary=False)
    for level in (0.1, 0.5, 0.9):
        nz = noise_batch(jax.random.key(2), ids, lm, block_size=bk, mask_token_id=MASK, cfg=cfg, fixed_t=level)
        n = b * t
        got = int(np.asarray(nz.masked_RT).sum())
        assert abs(got - n * level) < 5 * np.sqrt(n * level * (1 - level)), (level, got)
    nz = noise_batch(jax.random.key(3), ids, lm, block_size=bk, mask_token_id=MASK, cfg=cfg)
    p = np.repeat(np.asarray(nz.t_BN), bk, axis=1)
    got = np.asarray(nz.masked_RT).sum()
    assert abs(got - p.sum()) < 5 * np.sqrt((p * (1 - p)).sum())
    # and per block the count tracks its own level: correlation across blocks is high
    per_block = np.asarray(nz.masked_RT).reshape(b, t // bk, bk).mean(-1).ravel()
    assert np.corrcoef(per_block, np.asarray(nz.t_BN).ravel())[0, 1] > 0.9


def test_antithetic_levels_are_stratified_and_shuffled():
    cfg = NoiseConfig(t_min=0.1, t_max=0.9, antithetic=True)
    rows, blocks = 4, 8
    n = rows * blocks
    for seed in range(3):
        t = np.asarray(block_noise_levels(jax.random.key(seed), rows, blocks, cfg))
        u = (t.ravel() - 0.1) / 0.8
        strata = np.floor(u * n).astype(int)
        # exactly one level in each of the n equal sub-intervals
        np.testing.assert_array_equal(np.sort(strata), np.arange(n))
        # ... in random block order (not sorted along the batch)
        assert not np.all(np.diff(t.ravel()) > 0)
    plain = np.asarray(block_noise_levels(jax.random.key(0), rows, blocks, NoiseConfig(t_min=0.1, t_max=0.9)))
    assert len(np.unique(np.floor((plain.ravel() - 0.1) / 0.8 * n))) < n  # iid draws collide (this seed)


def test_draw_block_size_is_deterministic_and_uses_every_size():
    sizes = (8, 16, 32)
    draws = [draw_block_size(sizes, 0, s) for s in range(300)]
    assert draws == [draw_block_size(sizes, 0, s) for s in range(300)]
    counts = {s: draws.count(s) for s in sizes}
    assert all(70 < c < 130 for c in counts.values()), counts
    assert draws != [draw_block_size(sizes, 1, s) for s in range(300)]
    assert draw_block_size((16,), 0, 5) == 16


def test_config_errors():
    with pytest.raises(ConfigError, match="t_min"):
        NoiseConfig(t_min=0.0)
    with pytest.raises(ConfigError, match="t_max"):
        NoiseConfig(t_min=0.5, t_max=0.4)
    with pytest.raises(ValueError, match="multiple of block_size"):
        noise_batch(jax.random.key(0), jnp.zeros((1, 10), jnp.int32), jnp.ones((1, 10), bool), block_size=4,
                    mask_token_id=MASK, cfg=NoiseConfig())
