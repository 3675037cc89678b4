"""Masked-diffusion noise for SFT (DESIGN.md 3.3): per-block noise levels, token masks, the
complementary copy, and the per-step block-size draw of multi-size training.

Blocks lie on the row grid of the step's block size: packing starts every document on that grid
(block-aligned packing), so a grid block never holds two documents.

- Noise level: one ``t`` per block (not per sequence), uniform on ``[t_min, t_max]``. With
  ``antithetic`` the ``N = rows * blocks`` levels of a batch are stratified: exactly one falls in
  each of the ``N`` equal sub-intervals of ``[t_min, t_max]`` (then randomly permuted over the
  blocks, so a block's position says nothing about its level). Lower variance, same marginal.
- Masking: each maskable token (``loss_mask``: assistant tokens) of a block with level ``t`` is
  replaced by the mask token with probability ``t``, independently. Prompt and pad tokens are never
  masked.
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

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.yaml_config import ConfigError

__all__ = ["NoiseConfig", "NoisedBatch", "block_noise_levels", "draw_block_size", "noise_batch"]


@dataclass(frozen=True)
class NoiseConfig:
    """Noise options (YAML section ``noise``)."""

    t_min: float = 1e-3
    t_max: float = 1.0
    antithetic: bool = False
    complementary: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.t_min <= self.t_max <= 1.0:
            raise ConfigError(f"noise: need 0 < t_min <= t_max <= 1, got t_min={self.t_min}, t_max={self.t_max}")

    @property
    def copies(self) -> int:
        """Noisy copies per drawn row: 2 with complementary masking, else 1."""
        return 2 if self.complementary else 1


class NoisedBatch(NamedTuple):
    """A noised batch of ``R = copies * B`` rows (copy c of drawn row r is row ``c * B + r``).

    input_ids_RT: clean tokens, each drawn row repeated per copy, int32 [R, T];
    noisy_ids_RT: the same with masked positions replaced by the mask token, int32 [R, T];
    masked_RT: True where the token was masked (a subset of the maskable tokens), bool [R, T];
    t_RT: the noise level of each token's block in its copy (t, or 1 - t in the complement), f32 [R, T];
    t_BN: the drawn levels, one per block of the drawn rows, f32 [B, T // block_size].
    """

    input_ids_RT: jax.Array
    noisy_ids_RT: jax.Array
    masked_RT: jax.Array
    t_RT: jax.Array
    t_BN: jax.Array


def block_noise_levels(key: jax.Array, rows: int, blocks: int, cfg: NoiseConfig) -> jax.Array:
    """Noise levels f32 [rows, blocks] on [t_min, t_max] (stratified over all rows * blocks with
    ``cfg.antithetic``; see the module docstring)."""
    n = rows * blocks
    k_u, k_perm = jax.random.split(key)
    u = jax.random.uniform(k_u, (n,), jnp.float32)
    if cfg.antithetic:
        # one uniform per stratum [k/n, (k+1)/n), then shuffled over the blocks
        u = (jnp.arange(n, dtype=jnp.float32) + u) / n
        u = jax.random.permutation(k_perm, u)
        u = jnp.minimum(u, jnp.nextafter(jnp.float32(1.0), jnp.float32(0.0)))
    t = cfg.t_min + (cfg.t_max - cfg.t_min) * u
    return t.reshape(rows, blocks)


def noise_batch(
    key: jax.Array, input_ids_BT: jax.Array, loss_mask_BT: jax.Array, *, block_size: int, mask_token_id: int,
    cfg: NoiseConfig, fixed_t: float | jax.Array | None = None,
) -> NoisedBatch:
    """Draws block levels and masks for a batch of drawn rows (module docstring).

    `fixed_t`: every block gets this level (eval at fixed noise); the complement still follows
    `cfg.complementary`. T must be a multiple of `block_size`.
    """
    b, t_len = input_ids_BT.shape
    if t_len % block_size:
        raise ValueError(f"sequence length {t_len} is not a multiple of block_size {block_size}")
    nb = t_len // block_size
    k_t, k_tok = jax.random.split(key)
    if fixed_t is None:
        t_BN = block_noise_levels(k_t, b, nb, cfg)
    else:
        t_BN = jnp.full((b, nb), fixed_t, jnp.float32)
    t_BT = jnp.repeat(t_BN, block_size, axis=1)
    maskable_BT = loss_mask_BT.astype(bool)
    u_BT = jax.random.uniform(k_tok, (b, t_len), jnp.float32)
    masked = [maskable_BT & (u_BT < t_BT)]
    levels = [t_BT]
    if cfg.complementary:
        masked.append(maskable_BT & ~masked[0])
        levels.append(1.0 - t_BT)
    masked_RT = jnp.concatenate(masked, axis=0)
    ids_RT = jnp.concatenate([input_ids_BT] * cfg.copies, axis=0)
    noisy_RT = jnp.where(masked_RT, jnp.asarray(mask_token_id, ids_RT.dtype), ids_RT)
    return NoisedBatch(ids_RT, noisy_RT, masked_RT, jnp.concatenate(levels, axis=0), t_BN)


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
