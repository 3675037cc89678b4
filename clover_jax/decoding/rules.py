"""Per-step rules of block-diffusion decoding (docs/design.md 3.4): token choice, confidence, the commit
rule, the repetition penalty, the ids never chosen. Pure jnp functions on fixed shapes, safe under `jax.jit`.

Shapes: B rows, K canvas positions, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def seen_tokens(tokens_BS: jax.Array, valid_BS: jax.Array, vocab: int) -> jax.Array:
    """[B, V] bool: token v occurs at some valid slot of row b (the repetition-penalty context)."""
    b = tokens_BS.shape[0]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], tokens_BS.shape)
    ids = jnp.where(valid_BS, tokens_BS, vocab)  # invalid slots scatter out of range and are dropped
    return jnp.zeros((b, vocab), bool).at[rows, ids].set(True, mode="drop")


def repetition_penalty(logits: jax.Array, seen: jax.Array, penalty: float | jax.Array) -> jax.Array:
    """CTRL / HF rule on tokens already seen: positive logits divided by `penalty`, negative ones
    multiplied. `seen` broadcasts against `logits` ([B, V] or [B, K, V]). penalty 1 = identity
    (a traced penalty is applied arithmetically: 1 leaves every logit unchanged)."""
    if isinstance(penalty, (int, float)) and penalty == 1.0:
        return logits
    hit = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(seen, hit, logits)


def filter_logits(logits: jax.Array, top_k: int | jax.Array = 0, top_p: float | jax.Array = 1.0) -> jax.Array:
    """Top-k then top-p (nucleus) filtering over the last axis: removed tokens get -inf. The most
    likely token always survives; ties at the cut-off value survive together. `top_k` (0 = off)
    and `top_p` (1 = off) may be traced scalars, so one compiled program serves every setting."""
    v = logits.shape[-1]
    desc = -jnp.sort(-logits, axis=-1)
    k = jnp.clip(jnp.asarray(top_k, jnp.int32), 0, v)
    kth = jnp.take_along_axis(desc, jnp.broadcast_to(jnp.maximum(k - 1, 0), desc.shape[:-1] + (1,)), axis=-1)
    logits = jnp.where((k > 0) & (logits < kth), NEG_INF, logits)
    desc = jnp.where((k > 0) & (desc < kth), NEG_INF, desc)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    keep = before < top_p
    cut = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((jnp.asarray(top_p) < 1.0) & (logits < cut), NEG_INF, logits)


def _greedy(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    tok = jnp.argmax(logits, axis=-1)
    conf = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
    return tok.astype(jnp.int32), conf


def _sampled(logits: jax.Array, key: jax.Array, temperature, top_k, top_p) -> tuple[jax.Array, jax.Array]:
    scaled = filter_logits(logits / jnp.maximum(temperature, 1e-6), top_k, top_p)
    tok = jax.random.categorical(key, scaled, axis=-1)
    probs = jax.nn.softmax(scaled, axis=-1)
    conf = jnp.take_along_axis(probs, tok[..., None], axis=-1)[..., 0]
    return tok.astype(jnp.int32), conf


def choose_tokens(logits: jax.Array, key: jax.Array | None, *, temperature: float | jax.Array = 0.0,
                  top_k: int | jax.Array = 0, top_p: float | jax.Array = 1.0) -> tuple[jax.Array, jax.Array]:
    """(token [...], confidence [...]) per position of fp32 logits [..., V].

    Greedy (temperature 0): the argmax (lowest id on ties) and its softmax probability. Sampled:
    logits / temperature, top-k / top-p filtered, one categorical draw per position; the
    confidence is the drawn token's probability under that filtered distribution. A traced
    `temperature` picks the branch at run time (`lax.cond`: greedy steps skip the sort)."""
    logits = logits.astype(jnp.float32)
    if isinstance(temperature, (int, float)):
        if temperature == 0.0:
            return _greedy(logits)
        if key is None:
            raise ValueError("sampling (temperature > 0) needs a PRNG key")
        return _sampled(logits, key, temperature, top_k, top_p)
    if key is None:
        raise ValueError("a traced temperature needs a PRNG key")
    return jax.lax.cond(temperature > 0, lambda: _sampled(logits, key, temperature, top_k, top_p),
                        lambda: _greedy(logits))


def commit_mask(conf_BK: jax.Array, eligible_BK: jax.Array, threshold: float | jax.Array) -> jax.Array:
    """The confidence-threshold rule ("LowConfidence"), [B, K] bool: commit every eligible position
    whose confidence exceeds `threshold`; a row with eligible positions but none above it commits
    its single most confident one (the lowest index among equal confidences). Nothing outside
    `eligible` is ever committed, so a step commits at most the masked positions of the block;
    threshold >= 1 commits exactly one per row and step."""
    above = eligible_BK & (conf_BK > threshold)
    masked_conf = jnp.where(eligible_BK, conf_BK, NEG_INF)
    best = jnp.argmax(masked_conf, axis=-1)  # first maximum = lowest index on ties
    k = conf_BK.shape[-1]
    fallback = (jnp.arange(k)[None, :] == best[:, None]) & eligible_BK
    need_fallback = jnp.any(eligible_BK, axis=-1) & ~jnp.any(above, axis=-1)
    return above | (fallback & need_fallback[:, None])


def suppress_tokens(logits: jax.Array, vocab_limit: int | jax.Array, mask_id: int) -> jax.Array:
    """`logits` [..., V] with -inf at the ids that are never a generated token: the mask token
    (`mask_id`; -1 = none) and the embedding rows without a token, ids >= `vocab_limit` (BD3-LM's
    SUBS projection also gives the mask class zero probability). Applied before every choice, so a
    committed token is never the mask (which would read as still masked) nor an unused row."""
    ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    bad = (ids >= jnp.asarray(vocab_limit, jnp.int32)) | (ids == mask_id)
    return jnp.where(bad, NEG_INF, logits)


def first_index(flags_BK: jax.Array) -> jax.Array:
    """Index of the first True per row, K where none: [B] int32."""
    k = flags_BK.shape[-1]
    return jnp.min(jnp.where(flags_BK, jnp.arange(k)[None, :], k), axis=-1).astype(jnp.int32)


__all__ = ["choose_tokens", "commit_mask", "filter_logits", "first_index", "repetition_penalty", "seen_tokens",
           "suppress_tokens"]
