"""SFT semantics against the reference dLLM recipes (issue 22): the end of a response never sees what
follows it in the noisy stream (the next turn is a mask there, as at decode time), per-level eval
uses the masks of that level only, antithetic strata are spent on blocks with response tokens, a
piece that starts with a response token drops that zero-context position, and the inverse_t +
token normalisation check.

Oracles: bit-identity under a perturbation of the next turn (a no-leak property), hand-built
expectations of which slots are hidden and what they predict, the definition of stratification,
the plain-numpy CE at the masks of a single copy, and equality with an explicitly unmasked batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.config import get_preset
from clover_jax.model.clover_model import create_model, model_to_params
from clover_jax.yaml_config import ConfigError
from sft.config import load_sft_config
from sft.loss import LossConfig, make_sft_loss
from sft.noise import NoiseConfig, after_response_end, noise_batch

MASK, PAD, BK, T = 255, 254, 8, 32
FAST = {"xla_backend_optimization_level": 0}  # same semantics, half the CPU compile time


@functools.lru_cache(maxsize=None)
def _model():
    model = create_model(get_preset("tiny").replace(mode="block", mask_token_id=MASK), 0)
    return nnx.split(model)[0], model_to_params(model)


@functools.lru_cache(maxsize=None)
def _block_logits():
    graphdef, _ = _model()

    def f(p, clean, noisy, seg):
        return nnx.merge(graphdef, p).block_logits(clean, noisy, block_size=BK, segment_ids=seg)

    return jax.jit(f, compiler_options=FAST)


@functools.lru_cache(maxsize=None)
def _loss_fn(after_end: str = "pad", antithetic: bool = False):
    graphdef, _ = _model()
    fn = make_sft_loss(graphdef, block_size=BK, mask_token_id=MASK, lb_coef=0.0, end_pad_id=PAD,
                       noise=NoiseConfig(t_min=0.05, after_end=after_end, antithetic=antithetic),
                       loss=LossConfig(chunk_tokens=16))
    return jax.jit(fn, compiler_options=FAST)


def _two_turns(rng):
    """One document per row: prompt [0, 6), response 1 [6, 11) ending in block [8, 16), the next
    (user) turn [11, 20), response 2 [20, 28), a closing non-loss tail [28, 32)."""
    ids = rng.integers(2, 200, (2, T)).astype(np.int32)
    seg = np.ones((2, T), np.int32)
    lmask = np.zeros((2, T), bool)
    lmask[:, 6:11] = lmask[:, 20:28] = True
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (2, T)).copy()
    return ids, seg, lmask, pos


def _batch(ids, seg, lmask, pos, **extra):
    return {"input_ids": jnp.asarray(ids), "segment_ids": jnp.asarray(seg), "loss_mask": jnp.asarray(lmask),
            "positions": jnp.asarray(pos), **extra}


# -- item 1: the end of a response ------------------------------------------------------------------
def test_after_response_end_slots_hand_built():
    # block 8: loss 0-2, tail 3-7; block [8, 16): doc 1 ends at 10 (loss 9-10), then pad (segment 0);
    # block [16, 24): a second document whose loss starts at 20 (nothing before it is "after");
    # block [24, 32): loss 25, then a non-loss token, then loss again at 28, then two non-loss
    seg = np.array([[1] * 11 + [0] * 5 + [2] * 16], np.int32)
    lm = np.zeros((1, T), bool)
    lm[0, 0:3] = lm[0, 9:11] = lm[0, 20:24] = lm[0, 25] = lm[0, 28] = True
    want = np.zeros((1, T), bool)
    want[0, 3:8] = True
    want[0, 26:28] = want[0, 29:32] = True
    np.testing.assert_array_equal(np.asarray(after_response_end(jnp.asarray(lm), jnp.asarray(seg), BK)), want)


@pytest.mark.parametrize("after_end", ["pad", "mask"])
def test_after_end_slots_are_hidden_and_trained_as_configured(after_end):
    ids, seg, lmask, _ = _two_turns(np.random.default_rng(0))
    cfg = NoiseConfig(after_end=after_end)
    nz = noise_batch(jax.random.key(0), jnp.asarray(ids), jnp.asarray(lmask), block_size=BK, mask_token_id=MASK,
                     cfg=cfg, segment_ids_BT=jnp.asarray(seg), end_pad_id=PAD)
    end = np.zeros((2, T), bool)
    end[:, 11:16] = True  # the next turn's slots inside response 1's last block
    end[:, 28:32] = True  # the tail after response 2
    end2 = np.concatenate([end, end])
    noisy, masked, tgt = np.asarray(nz.noisy_ids_RT), np.asarray(nz.masked_RT), np.asarray(nz.targets_RT)
    clean2 = np.concatenate([ids, ids])
    np.testing.assert_array_equal(np.asarray(nz.input_ids_RT), clean2)  # the clean stream keeps the turn
    # the noisy stream never shows a next-turn token in those slots
    assert not np.any(end2 & (noisy == clean2) & (clean2 != PAD))
    if after_end == "pad":
        np.testing.assert_array_equal(tgt, np.where(end2, PAD, clean2))
        np.testing.assert_array_equal(np.asarray(nz.maskable_RT), np.concatenate([lmask | end] * 2))
        np.testing.assert_array_equal(noisy, np.where(masked, MASK, tgt))  # shown as the pad where unmasked
        np.testing.assert_array_equal(masked[:2].astype(int) + masked[2:], (lmask | end).astype(int))
    else:
        np.testing.assert_array_equal(tgt, clean2)
        assert not np.any(masked & end2)  # no loss there
        np.testing.assert_array_equal(noisy, np.where(masked | end2, MASK, clean2))


@pytest.mark.parametrize("after_end", ["pad", "mask"])
def test_response_last_block_logits_ignore_the_next_turn(after_end):
    """Perturb the next turn (non-loss tokens after response 1): the logits of response 1's last
    block [8, 16) are bit-identical; a later block that sees the turn in its clean prefix changes."""
    _, params = _model()
    ids, seg, lmask, _ = _two_turns(np.random.default_rng(1))
    other = ids.copy()
    other[:, 11:20] = (ids[:, 11:20] + 17) % 200 + 2
    cfg = NoiseConfig(after_end=after_end)
    out = []
    for x in (ids, other):
        nz = noise_batch(jax.random.key(2), jnp.asarray(x), jnp.asarray(lmask), block_size=BK, mask_token_id=MASK,
                         cfg=cfg, segment_ids_BT=jnp.asarray(seg), end_pad_id=PAD)
        out.append(np.asarray(_block_logits()(params, nz.input_ids_RT, nz.noisy_ids_RT,
                                              jnp.concatenate([jnp.asarray(seg)] * 2))))
    np.testing.assert_array_equal(out[0][:, 8:16], out[1][:, 8:16])
    assert not np.array_equal(out[0][:, 24:32], out[1][:, 24:32])


def test_sft_loss_does_not_depend_on_the_turn_after_the_last_response():
    """Whole loss_fn: a document whose only later tokens are a non-loss tail after the last
    response; changing that tail changes no loss term (lb off)."""
    _, params = _model()
    ids, seg, lmask, pos = _two_turns(np.random.default_rng(3))
    lmask[:, 20:] = False
    lmask[:, 20:26] = True  # response 2 ends at 25 inside block [24, 32); the tail 26-31 is non-loss
    other = ids.copy()
    other[:, 26:] = (ids[:, 26:] + 5) % 200 + 2
    key = jax.random.key(4)
    a = _loss_fn()(params, _batch(ids, seg, lmask, pos), key)
    b = _loss_fn()(params, _batch(other, seg, lmask, pos), key)
    assert float(a[0]) == float(b[0]) and float(a[1]["ce"]) == float(b[1]["ce"])
    assert int(a[1]["num_masked"]) == int(b[1]["num_masked"])


# -- item 2: per-level eval ------------------------------------------------------------------------
def test_eval_at_a_level_uses_masks_of_that_level_only():
    """`noise_t` = 0.25: the eval CE and masked count are those of one copy at 0.25 (plain-numpy CE
    from materialised logits), not pooled with the complement at 0.75."""
    _, params = _model()
    ids, seg, lmask, pos = _two_turns(np.random.default_rng(5))
    key = jax.random.key(6)
    loss, met = _loss_fn()(params, _batch(ids, seg, lmask, pos, noise_t=jnp.float32(0.25)), key)
    nz = noise_batch(key, jnp.asarray(ids), jnp.asarray(lmask), block_size=BK, mask_token_id=MASK,
                     cfg=NoiseConfig(complementary=False), fixed_t=0.25, segment_ids_BT=jnp.asarray(seg),
                     end_pad_id=PAD)
    masked = np.asarray(nz.masked_RT)
    assert masked.shape == (2, T)
    n_maskable = int(np.asarray(nz.maskable_RT).sum())
    assert 0 < masked.sum() < 0.5 * n_maskable  # level 0.25, not every token once (the pooled pair)
    assert int(met["num_masked"]) == int(masked.sum())
    logits = np.asarray(_block_logits()(params, nz.input_ids_RT, nz.noisy_ids_RT, jnp.asarray(seg)), np.float64)
    mx = logits.max(-1, keepdims=True)
    logp = logits - mx - np.log(np.exp(logits - mx).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, np.asarray(nz.targets_RT)[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(met["ce"]), nll[masked].mean(), rtol=2e-5)


# -- item 5 ----------------------------------------------------------------------------------------
def test_antithetic_strata_cover_the_blocks_with_response_tokens():
    """Only 9 of the 16 blocks hold maskable tokens: their 9 levels fall one in each ninth of
    [t_min, t_max], for every key."""
    ids, seg, lmask, _ = _two_turns(np.random.default_rng(7))
    ids, seg, lmask = np.concatenate([ids] * 2), np.concatenate([seg] * 2), np.concatenate([lmask] * 2)
    lmask[2:] = False
    lmask[2, 9] = True  # rows 0, 1: blocks 0-3 each; row 2: block 1; row 3: none
    cfg = NoiseConfig(t_min=0.1, t_max=0.9, antithetic=True, after_end="mask")

    def levels(key):
        return noise_batch(key, jnp.asarray(ids), jnp.asarray(lmask), block_size=BK, mask_token_id=MASK, cfg=cfg,
                           segment_ids_BT=jnp.asarray(seg)).t_BN

    t_KBN = np.asarray(jax.vmap(levels)(jax.random.split(jax.random.key(8), 20)))
    live = lmask.reshape(4, T // BK, BK).any(-1)
    assert live.sum() == 9
    for t in t_KBN:
        strata = np.floor((t[live] - 0.1) / 0.8 * 9).astype(int)
        np.testing.assert_array_equal(np.sort(strata), np.arange(9))


def test_piece_starting_with_a_response_token_drops_that_position():
    """A row whose second document starts on a response token (a hard-cut piece): with the logit
    shift that position has no context, so it is neither masked nor in the loss; the loss equals
    that of the same batch with its loss mask cleared."""
    _, params = _model()
    ids, _, _, _ = _two_turns(np.random.default_rng(9))
    seg = np.array([[1] * 16 + [2] * 16] * 2, np.int32)
    pos = np.array([list(range(16)) * 2] * 2, np.int32)
    lmask = np.zeros((2, T), bool)
    lmask[:, 10:16] = lmask[:, 16:24] = True  # document 2 starts with a response token at 16
    cleared = lmask.copy()
    cleared[:, 16] = False
    key = jax.random.key(10)
    a = _loss_fn()(params, _batch(ids, seg, lmask, pos), key)
    b = _loss_fn()(params, _batch(ids, seg, cleared, pos), key)
    assert int(a[1]["num_masked"]) == int(b[1]["num_masked"]) == int(cleared.sum())  # complementary pair
    assert float(a[0]) == float(b[0])


def test_inverse_t_with_token_normalisation_needs_the_complementary_copy():
    base = ["model.preset=tiny", "loss.weighting=inverse_t"]
    with pytest.raises(ConfigError, match="normalization: batch"):
        load_sft_config(None, base + ["noise.complementary=false"])
    load_sft_config(None, base + ["noise.complementary=false", "loss.normalization=batch"])
    load_sft_config(None, base)  # complementary on: the token mean is the ELBO
    with pytest.raises(ConfigError, match="after_end"):
        NoiseConfig(after_end="eos")
