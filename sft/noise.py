"""Masked-diffusion noise for SFT (docs/design.md 3.3): per-block noise levels, token masks, the
complementary copy, and the per-step block size of multi-size training (a draw, or a curriculum:
`model.block_size_schedule`).

Blocks lie on the row grid of the step's block size: packing starts every document on that grid
(block-aligned packing), so a grid block never holds two documents.

- Noise level: one ``t`` per block (not per sequence), uniform on ``[t_min, t_max]``. With
  ``antithetic`` the levels of the ``n`` blocks that hold a maskable token are stratified: exactly
  one falls in each of the ``n`` equal sub-intervals of ``[t_min, t_max]`` (in random block order,
  so a block's position says nothing about its level); blocks without one (prompt, pad) draw iid
  levels that nothing uses. Lower variance, same marginal.
- Masking: each maskable token (``loss_mask``: assistant tokens) of a block with level ``t`` is
  replaced by the mask token with probability ``t``, independently. Prompt and pad tokens are never
  masked.
- The end of a response (``after_end``; needs the segment ids): in the block where a response
  ends, the tokens of the same document that follow it inside the block (``<|im_end|>``'s newline,
  the next turn's ``<|im_start|>user`` ...) are never shown to the noisy stream, because at decode
  time those slots are still masks when the response is generated (else the model learns to end a
  response on a cue it never has). What they are trained to predict:

  * ``pad`` (default; SDAR pads a response's last block with loss-bearing pad targets, dllm's
    ``AppendEOSBlockWrapper`` and LLaDA with EOS): the slots become maskable tokens whose target
    is the end pad id (the tokenizer's pad, ``<|endoftext|>`` on Qwen3.6, one of the decoder's
    default EOS tokens), masked with the block's level like response tokens and shown as that pad
    where not masked: the model learns that a block is filled with pads after the end, which is
    what the decoder's first-EOS stop reads.
  * ``mask`` (Fast-dLLM v2 fills a sample's last block with mask tokens excluded from the loss):
    the slots are always the mask token in the noisy stream and carry no loss.

  Only non-loss tokens are affected: when another response starts inside the same block its tokens
  keep their own masks and targets (the turn between is hidden from them in that block). The
  clean stream always has the real tokens (later blocks see the real next turn).
- Complementary masking (default on): every drawn row is run twice, first with the mask ``m``,
  then with its complement over the maskable tokens, ``loss_mask & ~m``; every response token is
  then masked exactly once per pair. The complementary copy of a block with level ``t`` masks each
  maskable token with probability ``1 - t``, which is that copy's noise level (what ``inverse_t``
  weighting uses).

Batch counting: ``data.batch_size`` counts the packed rows drawn from the data pipeline (the
"examples" of the step, and what ``tokens_per_s`` counts). With complementary masking the model
runs ``2 * batch_size`` rows, each with a clean and a noisy stream; the copies of row ``r`` are rows
``r`` and ``r + batch_size`` of the doubled batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.yaml_config import ConfigError

__all__ = ["NoiseConfig", "NoisedBatch", "after_response_end", "block_noise_levels", "check_block_size_schedule",
           "draw_block_size", "noise_batch", "schedule_starts", "scheduled_block_size"]


@dataclass(frozen=True)
class NoiseConfig:
    """Noise options (YAML section ``noise``)."""

    t_min: float = 1e-3
    t_max: float = 1.0
    antithetic: bool = False
    complementary: bool = True
    after_end: Literal["pad", "mask"] = "pad"

    def __post_init__(self) -> None:
        if not 0.0 < self.t_min <= self.t_max <= 1.0:
            raise ConfigError(f"noise: need 0 < t_min <= t_max <= 1, got t_min={self.t_min}, t_max={self.t_max}")
        if self.after_end not in ("pad", "mask"):
            raise ConfigError(f"noise.after_end: {self.after_end!r} is not one of pad, mask")

    @property
    def copies(self) -> int:
        """Noisy copies per drawn row: 2 with complementary masking, else 1."""
        return 2 if self.complementary else 1


class NoisedBatch(NamedTuple):
    """A noised batch of ``R = copies * B`` rows (copy c of drawn row r is row ``c * B + r``).

    input_ids_RT: clean tokens (the clean stream), each drawn row repeated per copy, int32 [R, T];
    noisy_ids_RT: the noisy stream: targets with masked positions replaced by the mask token (and,
      with ``after_end: mask``, the slots after a response's end too), int32 [R, T];
    masked_RT: True where the token was masked (a subset of `maskable_RT`): the loss positions, bool [R, T];
    t_RT: the noise level of each token's block in its copy (t, or 1 - t in the complement), f32 [R, T];
    t_BN: the drawn levels, one per block of the drawn rows, f32 [B, T // block_size];
    targets_RT: what each position is trained to predict: the clean tokens, or the end pad id at the
      slots after a response's end (``after_end: pad``), int32 [R, T];
    maskable_RT: the tokens that could be masked: the loss mask, plus those slots with ``pad``, bool [R, T].
    """

    input_ids_RT: jax.Array
    noisy_ids_RT: jax.Array
    masked_RT: jax.Array
    t_RT: jax.Array
    t_BN: jax.Array
    targets_RT: jax.Array
    maskable_RT: jax.Array


def block_noise_levels(key: jax.Array, rows: int, blocks: int, cfg: NoiseConfig,
                       has_loss_BN: jax.Array | None = None) -> jax.Array:
    """Noise levels f32 [rows, blocks] on [t_min, t_max]. With ``cfg.antithetic`` the levels of the
    blocks where `has_loss_BN` (bool [rows, blocks]; None: every block) are stratified over those
    blocks only (module docstring); the other blocks keep iid levels."""
    n = rows * blocks
    k_u, k_perm = jax.random.split(key)
    u = jax.random.uniform(k_u, (n,), jnp.float32)
    if cfg.antithetic:
        live = jnp.ones((n,), bool) if has_loss_BN is None else has_loss_BN.reshape(n).astype(bool)
        n_live = jnp.sum(live.astype(jnp.int32))
        # a random order of the live blocks: rank r in [0, n_live) gets stratum [r/n_live, (r+1)/n_live)
        score = jnp.where(live, jax.random.uniform(k_perm, (n,), jnp.float32), 2.0)
        rank = jnp.zeros((n,), jnp.int32).at[jnp.argsort(score)].set(jnp.arange(n, dtype=jnp.int32))
        strat = (rank.astype(jnp.float32) + u) / jnp.maximum(n_live, 1).astype(jnp.float32)
        u = jnp.where(live, jnp.minimum(strat, jnp.nextafter(jnp.float32(1.0), jnp.float32(0.0))), u)
    t = cfg.t_min + (cfg.t_max - cfg.t_min) * u
    return t.reshape(rows, blocks)


def after_response_end(loss_mask_BT: jax.Array, segment_ids_BT: jax.Array, block_size: int) -> jax.Array:
    """bool [B, T]: the non-loss tokens of a document (segment id != 0) that follow a loss token of
    the same document inside the same block of the row grid (module docstring, ``after_end``)."""
    b, t = loss_mask_BT.shape
    lm = loss_mask_BT.astype(bool)
    pos_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    last = jnp.where(lm, pos_BT, -1).reshape(b, t // block_size, block_size)
    last_BT = jax.lax.cummax(last, axis=2).reshape(b, t)  # latest loss slot at or before p in p's block
    seg = segment_ids_BT.astype(jnp.int32)
    same_doc = jnp.take_along_axis(seg, jnp.maximum(last_BT, 0), axis=1) == seg
    return ~lm & (last_BT >= 0) & same_doc & (seg != 0)


def noise_batch(
    key: jax.Array, input_ids_BT: jax.Array, loss_mask_BT: jax.Array, *, block_size: int, mask_token_id: int,
    cfg: NoiseConfig, fixed_t: float | jax.Array | None = None, segment_ids_BT: jax.Array | None = None,
    end_pad_id: int | None = None,
) -> NoisedBatch:
    """Draws block levels and masks for a batch of drawn rows (module docstring).

    `fixed_t`: every block gets this level (eval at fixed noise); the complement still follows
    `cfg.complementary`. T must be a multiple of `block_size`. `segment_ids_BT` (the documents, 0 =
    pad) turns on the ``cfg.after_end`` handling of the slots after a response's end (None: off,
    only the loss mask is maskable); ``after_end: pad`` needs `end_pad_id`.
    """
    b, t_len = input_ids_BT.shape
    if t_len % block_size:
        raise ValueError(f"sequence length {t_len} is not a multiple of block_size {block_size}")
    nb = t_len // block_size
    k_t, k_tok = jax.random.split(key)
    lm_BT = loss_mask_BT.astype(bool)
    if segment_ids_BT is None:
        end_BT = jnp.zeros_like(lm_BT)
    else:
        end_BT = after_response_end(lm_BT, segment_ids_BT, block_size)
    pad_fill = segment_ids_BT is not None and cfg.after_end == "pad"
    if pad_fill and end_pad_id is None:
        raise ValueError("noise.after_end: pad needs the end pad id (end_pad_id)")
    maskable_BT = lm_BT | end_BT if pad_fill else lm_BT
    targets_BT = jnp.where(end_BT, jnp.asarray(end_pad_id, input_ids_BT.dtype), input_ids_BT) if pad_fill \
        else input_ids_BT
    if fixed_t is None:
        has_loss_BN = jnp.any(maskable_BT.reshape(b, nb, block_size), axis=2)
        t_BN = block_noise_levels(k_t, b, nb, cfg, has_loss_BN)
    else:
        t_BN = jnp.full((b, nb), fixed_t, jnp.float32)
    t_BT = jnp.repeat(t_BN, block_size, axis=1)
    u_BT = jax.random.uniform(k_tok, (b, t_len), jnp.float32)
    masked = [maskable_BT & (u_BT < t_BT)]
    levels = [t_BT]
    if cfg.complementary:
        masked.append(maskable_BT & ~masked[0])
        levels.append(1.0 - t_BT)
    rep = lambda x: jnp.concatenate([x] * cfg.copies, axis=0)  # noqa: E731
    masked_RT = jnp.concatenate(masked, axis=0)
    hidden_RT = masked_RT if pad_fill else masked_RT | rep(end_BT)  # `mask`: the end slots always hidden
    targets_RT = rep(targets_BT)
    noisy_RT = jnp.where(hidden_RT, jnp.asarray(mask_token_id, targets_RT.dtype), targets_RT)
    return NoisedBatch(rep(input_ids_BT), noisy_RT, masked_RT, jnp.concatenate(levels, axis=0), t_BN,
                       targets_RT, rep(maskable_BT))


def draw_block_size(block_sizes: Sequence[int], seed: int, step: int) -> int:
    """The block size of optimizer step `step` (0-based count of updates done) in multi-size
    training: a deterministic host-side draw from (seed, step), so a resumed run draws the same
    sizes, and each size is its own static shape (its own compiled step)."""
    sizes = tuple(int(s) for s in block_sizes)
    if not sizes:
        raise ValueError("block_sizes is empty")
    if len(sizes) == 1:
        return sizes[0]
    return sizes[int(np.random.default_rng([int(seed), int(step), 0x5EED]).integers(len(sizes)))]


#: one stage of a block-size curriculum: (fraction of train.steps where it starts, block size)
Stage = tuple[float, int]


def schedule_starts(schedule: Sequence[Stage], total_steps: int) -> list[int]:
    """The first update of each stage: ceil(fraction * total_steps), the first update s with
    s / total_steps >= fraction. The fraction is read as the decimal it was written as (0.3, not
    0.29999...), so a boundary never moves by one update through float round-off."""
    return [math.ceil(Fraction(repr(float(f))) * int(total_steps)) for f, _ in schedule]


def scheduled_block_size(schedule: Sequence[Stage], total_steps: int, step: int) -> int:
    """The block size of update `step` (0-based count of updates done) under a curriculum: the size of
    the last stage that has started (`schedule_starts`). A function of the step alone, like
    `draw_block_size`, so a resumed run continues on schedule."""
    size = int(schedule[0][1])
    for start, (_, b) in zip(schedule_starts(schedule, total_steps), schedule):
        if step >= start:
            size = int(b)
    return size


def check_block_size_schedule(schedule: Sequence[Stage], *, seq_len: int | None = None,
                              block_sizes: Sequence[int] | None = None, where: str = "model.block_size_schedule"
                              ) -> None:
    """ConfigError naming `where` unless the schedule is non-empty, its fractions start at 0 and
    increase strictly below 1, and its sizes are positive, divide `seq_len` and are among the model's
    `block_sizes` (the sizes the run compiles a step for and aligns its packing to); None skips a check."""
    if not schedule:
        raise ConfigError(f"{where}: empty; give stages [[fraction, block size], ...] starting at fraction 0, "
                          "or null for no schedule")
    fracs = [float(f) for f, _ in schedule]
    if fracs[0] != 0.0:
        raise ConfigError(f"{where}: the first stage must start at fraction 0, got {fracs[0]:g}")
    if any(b <= a for a, b in zip(fracs, fracs[1:])) or fracs[-1] >= 1.0:
        raise ConfigError(f"{where}: stage fractions must increase strictly and stay below 1 (fractions of "
                          f"train.steps), got {fracs}")
    for f, b in schedule:
        if int(b) < 1:
            raise ConfigError(f"{where}: block size {b} (stage at {float(f):g}) must be >= 1")
        if seq_len is not None and seq_len % int(b):
            raise ConfigError(f"{where}: block size {b} (stage at {float(f):g}) does not divide data.seq_len {seq_len}")
        if block_sizes is not None and int(b) not in tuple(block_sizes):
            raise ConfigError(f"{where}: block size {b} (stage at {float(f):g}) is not one of model.block_size "
                              f"{list(block_sizes)}; list every size of the schedule there "
                              f"(model.block_size: {list(dict.fromkeys(int(x) for _, x in schedule))})")
