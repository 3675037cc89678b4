"""Decoding semantics against the reference dLLM decoders (issue 22): a block's first token is known
before denoising starts (first-token commit), and the mask token and the unused vocabulary rows
never win.

Oracles: the commit rule's count at threshold 1 (exactly one commit per step, so the step count
says whether the first token waited); the clean stream's argmax at s - 1 from one full forward of
the finished sequence (an independent code path); a model whose logits for the mask token and the
unused rows are boosted must decode exactly like the unboosted one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.decoding.generator import DecodeConfig, Decoder
from clover_jax.model.clover_model import CloverModel
from tests.decode_fixtures import encode_example, eval_records, peaked_random_model, trained_model

MAX_NEW, BUCKET = 48, 16  # as tests/decoding/test_decoding.py (the model's block size 32): shared compiled programs


_trained, _random_model = trained_model, peaked_random_model


@functools.lru_cache(maxsize=None)
def _prompts() -> tuple[tuple[int, ...], ...]:
    _, _, tok = _trained()
    return tuple(tuple(encode_example(tok, r)[0]) for r in eval_records(3))


def _decode(model, eos=None, vocab_limit=None, **kw):
    dcfg = DecodeConfig(**{"max_new_tokens": MAX_NEW, "fast_compile": True, "batch_bucket": BUCKET, **kw})
    return Decoder(model, dcfg, eos_ids=eos, vocab_limit=vocab_limit).generate([list(p) for p in _prompts()])


# -- item 3: first-token commit --------------------------------------------------------------------
def test_block_first_token_is_known_before_denoising():
    """Threshold 1 commits exactly one masked position per step. With first-token commit, every
    block that starts on a generated position costs one step less (its first token is in the
    canvas before the block's first step and is recorded with that step), and that token is the
    clean stream's argmax at s - 1. Without it, one step per token. No EOS: rows run to max_new."""
    model = _random_model()
    k = model.cfg.block_sizes[0]
    on = _decode(model, eos=(), threshold=1.0, trace=True)
    off = _decode(model, eos=(), threshold=1.0, first_token_commit=False)
    width = max(len(p) for p in _prompts()) + MAX_NEW
    seqs = [list(p) + g.token_ids for p, g in zip(_prompts(), on.generations)]
    full = jnp.asarray([s + [0] * (width - len(s)) for s in seqs], jnp.int32)
    ar = np.asarray(jnp.argmax(nnx.jit(lambda m, x: m(x))(model, full), -1))  # one program, not op by op
    n_starts = 0
    for i, (p, g, g_off) in enumerate(zip(_prompts(), on.generations, off.generations)):
        assert len(g.token_ids) == len(g_off.token_ids) == MAX_NEW
        assert g_off.stats["denoise_steps"] == MAX_NEW
        doc_pos = len(p) + np.arange(MAX_NEW)
        starts = np.flatnonzero(doc_pos % k == 0)  # generated tokens at a block start
        n_starts += len(starts)
        assert g.stats["denoise_steps"] == MAX_NEW - len(starts)
        order = np.asarray(g.stats["commit_order"])
        for j in starts:
            others = ((doc_pos // k) == doc_pos[j] // k) & (np.arange(MAX_NEW) != j)
            if others.any():  # recorded with the block's first step
                assert order[j] == order[others].min()
            assert g.token_ids[j] == ar[i, len(p) + j - 1]  # the clean argmax at s - 1 (causal: padding is after)
    assert n_starts >= 2


# -- item 4: the mask token and unused rows never win ----------------------------------------------
class _Boosted(CloverModel):
    """A model whose mask-token and last-4-rows logits are +1e4: they win every argmax."""

    def logits(self, h_BTD: jax.Array) -> jax.Array:
        lg = super().logits(h_BTD)
        v = lg.shape[-1]
        ids = jnp.arange(v)
        return lg + jnp.where((ids == self.cfg.mask_token_id) | (ids >= v - 4), 1e4, 0.0)


@functools.lru_cache(maxsize=None)
def _boosted() -> CloverModel:
    cfg, model, _ = _trained()
    out = _Boosted(cfg, rngs=nnx.Rngs(0))
    nnx.update(out, nnx.state(model))
    return out


def test_mask_token_and_unused_rows_are_never_generated():
    """Threshold mode (AR, the commit pass and self-speculative verification share the same
    suppression in `Loops._choose` / `suppress_tokens`)."""
    cfg, model, _ = _trained()
    limit = cfg.vocab_size - 4
    want = _decode(model, vocab_limit=limit)
    got = _decode(_boosted(), vocab_limit=limit)
    for w, g in zip(want.generations, got.generations):
        assert g.token_ids == w.token_ids
        assert g.token_ids and all(0 <= t < limit and t != cfg.mask_token_id for t in g.token_ids)
