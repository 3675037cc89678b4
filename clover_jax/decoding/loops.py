"""Device side of `clover_jax.decoding.generator`: the jitted prefill and the per-block loops of the three modes.

Every function maps (model state, carry, consts) -> carry with fixed shapes. The carry (a dict):
`tokens` [B, S] slot buffer (pads, prompts, generated tokens; masks where a block stopped early:
the slots after a row's EOS),
`index` () first slot of the next block (AR: the next token's slot), `finished` [B], per-row
counters `nfe`, `steps`, `commits`, `blocks`, `rejections` [B], `forwards` () batch forwards,
`commit_step` [B, S] (the row's denoising step that committed each slot, -1 none), `next_ar` [B]
(the token chosen for the slot at `index` from the last clean pass's logits: the AR argmax at
temperature 0, a draw otherwise; penalised and suppressed like a step), `key`, and `cache` (not in
recompute mode), `next_logits` [B, V] (AR mode), `hist` (history stats: `init_history`).
consts: `segment_ids`, `positions` [B, S], `gen_start` [B] (first generated slot), `max_new` (),
`threshold` (), `eos_ids` [E] (-1 padded), `temperature`, `top_k`, `top_p`, `repetition_penalty` ()
(traced, so one program serves every sampling setting), `prefill_rows` [B] (the row has prompt
tokens before the first block), `first_commit` () bool (a generated block start is known before
the block's first step: `next_ar`), `vocab_limit` () (ids >= it are never chosen; nor the mask).

First-token commit: with the logit shift a block's first position is predicted from the clean
hidden state at s - 1 (the previous commit pass or the prefill), which no step inside the block
changes, so its token is known before denoising starts (Fast-dLLM v2 takes the update pass's
argmax as the next block's first token). It enters the canvas as a known token at the block's
first step (recorded with that step in `commit_step`); the steps then condition on it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from clover_jax.decoding.rules import (choose_tokens, commit_mask, first_index, repetition_penalty, seen_tokens,
                                      suppress_tokens)
from clover_jax.model.clover_model import PAD_SEGMENT

Carry = dict[str, Any]


@dataclass(frozen=True)
class LoopSpec:
    """Static settings of the compiled loops (hashable)."""

    mode: str
    block: int
    mask_id: int
    sub_block: int | None
    recompute: bool
    history: bool
    vocab: int
    fast_compile: bool = False
    coreset_first_step: bool = False  # DecodeConfig.coreset == "first_step" on a coreset model


#: XLA options of `DecodeConfig.fast_compile`: the LLVM backend without its optimisation passes
#: compiles the decode loops ~4x faster on CPU and runs them slower (same HLO, same results).
FAST_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def init_history(n_gdn: int, block: int) -> Carry:
    """History-unit stats summed over denoising forwards: `sum` [n_gdn] of each forward's mean share
    per GDN layer and `cnt` () forwards; `pos_sum` [n_gdn, K] the share summed per canvas position
    over the (forward, row) pairs where it is a real token and `pos_cnt` [K] their count."""
    return {"sum": jnp.zeros((n_gdn,), jnp.float32), "cnt": jnp.zeros((), jnp.float32),
            "pos_sum": jnp.zeros((n_gdn, block), jnp.float32), "pos_cnt": jnp.zeros((block,), jnp.float32)}


def accumulate_history(hist: Carry, stats: dict[str, jax.Array]) -> Carry:
    """`hist` (`init_history`) plus one `block_step(..., return_stats=True)`'s stats."""
    return {"sum": hist["sum"] + stats["history_share"], "cnt": hist["cnt"] + 1.0,
            "pos_sum": hist["pos_sum"] + stats["history_share_sum"], "pos_cnt": hist["pos_cnt"] + stats["history_tokens"]}


class Loops:
    """The compiled pieces; `graphdef` + a state give the model inside each trace. `compiled(...)`
    shares one instance (and so one jit cache) per (graphdef, spec)."""

    def __init__(self, graphdef: Any, spec: LoopSpec):
        self.graphdef, self.spec = graphdef, spec
        opts = FAST_COMPILE_OPTIONS if spec.fast_compile else None
        self.prefill_jit = jax.jit(self.prefill, static_argnums=(3,), compiler_options=opts)
        fn = {"threshold": self.threshold_block, "self_speculative": self.spec_block, "ar": self.ar_block}[spec.mode]
        self.block_jit = jax.jit(fn, compiler_options=opts)

    @staticmethod
    @functools.lru_cache(maxsize=32)
    def compiled(graphdef: Any, spec: LoopSpec) -> "Loops":
        return Loops(graphdef, spec)

    # -- helpers --------------------------------------------------------------------------------
    def _blk(self, x_BS: jax.Array, idx: jax.Array) -> jax.Array:
        return lax.dynamic_slice_in_dim(x_BS, idx, self.spec.block, axis=1)

    def _put(self, x_BS: jax.Array, blk_BK: jax.Array, idx: jax.Array) -> jax.Array:
        return lax.dynamic_update_slice_in_dim(x_BS, blk_BK.astype(x_BS.dtype), idx, axis=1)

    @staticmethod
    def _is_eos(tok: jax.Array, consts: Carry) -> jax.Array:
        """`consts["eos_ids"]` [E] is padded with -1 (never a token)."""
        return jnp.any(tok[..., None] == consts["eos_ids"], axis=-1)

    def _seen(self, tokens_BS: jax.Array, consts: Carry, upto: jax.Array) -> jax.Array:
        """[B, V] document tokens in slots < upto (the repetition-penalty context)."""
        s = tokens_BS.shape[1]
        valid = (consts["segment_ids"] != PAD_SEGMENT) & (jnp.arange(s)[None] < upto)
        return seen_tokens(tokens_BS, valid, self.spec.vocab)

    def _choose(self, logits: jax.Array, key: jax.Array, consts: Carry) -> tuple[jax.Array, jax.Array]:
        """(token, confidence) from penalised logits, the never-chosen ids suppressed first."""
        logits = suppress_tokens(logits, consts["vocab_limit"], self.spec.mask_id)
        return choose_tokens(logits, key, temperature=consts["temperature"], top_k=consts["top_k"],
                             top_p=consts["top_p"])

    def _next_token(self, last_BV: jax.Array, tokens_BS: jax.Array, consts: Carry, upto: jax.Array,
                    key: jax.Array) -> jax.Array:
        """`next_ar` [B]: the token for slot `upto` from the clean logits at `upto - 1` [B, V], with
        the penalty over the document's slots < `upto`."""
        pen = repetition_penalty(last_BV, self._seen(tokens_BS, consts, upto), consts["repetition_penalty"])
        return self._choose(pen, key, consts)[0]

    def _denoise_logits(self, model, carry: Carry, consts: Carry, canvas: jax.Array, core: Carry | None = None):
        """One block-mode forward of `canvas` [B, K] at slots [index, index + K) -> (logits [B,K,V],
        `block_step`'s stats or None). `core` {"core": [G, p, B, C], "have": bool}: the block's
        coresets once its first step has chosen them (`coreset_first_step`)."""
        idx = carry["index"]
        if self.spec.recompute:  # the training forward over the whole buffer (debug oracle)
            toks = self._put(carry["tokens"], canvas, idx)
            full = model.block_logits(toks, toks, block_size=self.spec.block, positions=consts["positions"],
                                      segment_ids=consts["segment_ids"])
            return lax.dynamic_slice_in_dim(full, idx, self.spec.block, axis=1), None
        kw = dict(positions=self._blk(consts["positions"], idx), segment_ids=self._blk(consts["segment_ids"], idx))
        if core is not None:
            return model.block_step(canvas, carry["cache"], return_stats=True, coreset=core["core"],
                                    use_coreset=core["have"], **kw)
        if self.spec.history:
            logits, st = model.block_step(canvas, carry["cache"], return_stats=True, **kw)
            return logits, st
        return model.block_step(canvas, carry["cache"], **kw), None

    def _clean_pass(self, model, carry: Carry, consts: Carry, block_ids: jax.Array):
        """The commit pass of a finished block: (AR logits [B, K, V], extended cache or None)."""
        idx = carry["index"]
        if self.spec.recompute:
            toks = self._put(carry["tokens"], block_ids, idx)
            full = model(toks, positions=consts["positions"], segment_ids=consts["segment_ids"])
            return lax.dynamic_slice_in_dim(full, idx, self.spec.block, axis=1), None
        return model.extend(block_ids, carry["cache"], positions=self._blk(consts["positions"], idx),
                            segment_ids=self._blk(consts["segment_ids"], idx))

    def _block_setup(self, carry: Carry, consts: Carry):
        """(needed [B, K]: generated positions inside the budget of unfinished rows, prev tokens,
        starting canvas with the known prompt tail, the first token when `first_commit` and the
        block starts on a generated position (module docstring), masks elsewhere, its cstep)."""
        k, idx = self.spec.block, carry["index"]
        g = idx + jnp.arange(k)[None] - consts["gen_start"][:, None]
        needed = (g >= 0) & (g < consts["max_new"]) & ~carry["finished"][:, None]
        prev = self._blk(carry["tokens"], idx)
        canvas = jnp.where(g >= 0, self.spec.mask_id, prev)
        first = (jnp.arange(k)[None] == 0) & needed & consts["first_commit"]
        cstep = self._blk(carry["commit_step"], idx)
        canvas = jnp.where(first, carry["next_ar"][:, None], canvas)
        return needed, prev, canvas, jnp.where(first, carry["steps"][:, None] + 1, cstep)

    def _denoise(self, model, carry: Carry, consts: Carry, canvas: jax.Array, needed: jax.Array,
                 cstep: jax.Array) -> Carry:
        """Denoising steps until no row has an eligible position: masked, needed and before the
        row's first committed EOS. Returns canvas, cstep and the updated counters."""
        sp, k = self.spec, self.spec.block
        mask = sp.mask_id
        pos_K = jnp.arange(k)[None]
        base_seen = self._seen(carry["tokens"], consts, carry["index"])

        def eligible_of(cv):
            e = first_index(needed & self._is_eos(cv, consts))
            return needed & (cv == mask) & (pos_K < e[:, None])

        def cond(c):
            return jnp.any(eligible_of(c["canvas"])) & (c["i"] < k)

        def body(c):
            elig = eligible_of(c["canvas"])
            active = jnp.any(elig, axis=-1)
            if sp.sub_block is not None:  # only the first sub-block that still has masks
                cur = first_index(elig) // sp.sub_block
                elig = elig & ((pos_K // sp.sub_block) == cur[:, None])
            key, sub = jax.random.split(c["key"])
            logits, hist = self._denoise_logits(model, carry, consts, c["canvas"], c.get("core"))
            seen = base_seen | seen_tokens(c["canvas"], c["canvas"] != mask, sp.vocab)  # penalty first
            logits = repetition_penalty(logits, seen[:, None], consts["repetition_penalty"])
            tok, conf = self._choose(logits, sub, consts)
            commit = commit_mask(conf, elig, consts["threshold"])
            steps = c["steps"] + active
            out = dict(c, canvas=jnp.where(commit, tok, c["canvas"]),
                       cstep=jnp.where(commit, steps[:, None], c["cstep"]), steps=steps,
                       nfe=c["nfe"] + active, forwards=c["forwards"] + 1, i=c["i"] + 1, key=key)
            if sp.coreset_first_step:  # the first step's coresets stay for the rest of the block
                out["core"] = {"core": hist["coreset"], "have": jnp.ones((), bool)}
            if sp.history:
                out["hist"] = accumulate_history(c["hist"], hist)
            return out

        init = {"canvas": canvas, "cstep": cstep, "steps": carry["steps"], "nfe": carry["nfe"],
                "forwards": carry["forwards"], "i": jnp.zeros((), jnp.int32), "key": carry["key"]}
        if sp.history:
            init["hist"] = carry["hist"]
        if sp.coreset_first_step:
            cfg = model.cfg
            shape = (cfg.num_groups, cfg.group_size, canvas.shape[0], cfg.moe_block_coreset)
            init["core"] = {"core": jnp.zeros(shape, jnp.int32), "have": jnp.zeros((), bool)}
        return lax.while_loop(cond, body, init)

    def _finish_block(self, carry: Carry, consts: Carry, needed, prev, canvas, cstep) -> Carry:
        """Writes the block into the buffers; updates `finished`, `blocks`, `index`."""
        idx, k = carry["index"], self.spec.block
        written = needed & (canvas != self.spec.mask_id)
        out = dict(carry)
        # needed slots still masked (after the row's EOS) keep the mask, which `_extract` cuts at
        out["tokens"] = self._put(carry["tokens"], jnp.where(needed, canvas, prev), idx)
        out["commit_step"] = self._put(carry["commit_step"],
                                       jnp.where(written, cstep, self._blk(carry["commit_step"], idx)), idx)
        fin_eos = jnp.any(needed & self._is_eos(canvas, consts), axis=-1)
        fin_len = idx + k >= consts["gen_start"] + consts["max_new"]
        out["finished"] = carry["finished"] | fin_eos | fin_len
        out["blocks"] = carry["blocks"] + (~carry["finished"]).astype(jnp.int32)
        out["index"] = idx + k
        return out

    def _with_counters(self, carry: Carry, d: Carry) -> Carry:
        out = dict(carry, steps=d["steps"], nfe=d["nfe"], forwards=d["forwards"], key=d["key"])
        if self.spec.history:
            out["hist"] = d["hist"]
        return out

    # -- prefill --------------------------------------------------------------------------------
    def prefill(self, state, carry: Carry, consts: Carry, s0: int) -> Carry:
        """Clean pass over slots [0, s0) (static): caches, `next_ar`, AR `next_logits`."""
        if s0 == 0:
            return carry
        model = nnx.merge(self.graphdef, state)
        out = dict(carry)
        if self.spec.recompute:
            last = model(carry["tokens"], positions=consts["positions"], segment_ids=consts["segment_ids"])[:, s0 - 1]
        else:
            logits, out["cache"] = model.extend(carry["tokens"][:, :s0], carry["cache"],
                                                positions=consts["positions"][:, :s0],
                                                segment_ids=consts["segment_ids"][:, :s0])
            last = logits[:, -1]
        out["key"], sub = jax.random.split(carry["key"])
        out["next_ar"] = self._next_token(last, carry["tokens"], consts, jnp.asarray(s0), sub)
        if self.spec.mode == "ar":
            out["next_logits"] = last
        out["nfe"] = carry["nfe"] + consts["prefill_rows"].astype(jnp.int32)
        out["forwards"] = carry["forwards"] + 1
        return out

    # -- threshold mode -------------------------------------------------------------------------
    def threshold_block(self, state, carry: Carry, consts: Carry) -> Carry:
        sp = self.spec
        model = nnx.merge(self.graphdef, state)
        needed, prev, canvas, cstep = self._block_setup(carry, consts)
        d = self._denoise(model, carry, consts, canvas, needed, cstep)
        out = self._finish_block(self._with_counters(carry, d), consts, needed, prev, d["canvas"], d["cstep"])
        cont = ~out["finished"]
        b = canvas.shape[0]

        def commit_pass():  # unless no row needs another block; the recompute path has no cache
            logits, cache = self._clean_pass(model, carry, consts, d["canvas"])
            return logits[:, -1], cache

        zeros = jnp.zeros((b, sp.vocab), jnp.float32)
        if sp.recompute:
            last = lax.cond(jnp.any(cont), lambda: commit_pass()[0], lambda: zeros)
        else:
            last, out["cache"] = lax.cond(jnp.any(cont), commit_pass, lambda: (zeros, carry["cache"]))
        out["key"], sub = jax.random.split(out["key"])
        out["next_ar"] = self._next_token(last, out["tokens"], consts, out["index"], sub)
        out["nfe"] = out["nfe"] + cont.astype(jnp.int32)
        out["commits"] = carry["commits"] + cont.astype(jnp.int32)
        out["forwards"] = out["forwards"] + jnp.any(cont).astype(jnp.int32)
        return out

    # -- self-speculative mode ------------------------------------------------------------------
    def spec_block(self, state, carry: Carry, consts: Carry) -> Carry:
        """Draft by denoising, verify with the commit pass's AR argmax, repair, repeat (module doc
        of `decoding`). The cache is replaced only by a commit pass whose block verified in every
        row, so it never holds a rejected token."""
        sp, k = self.spec, self.spec.block
        model = nnx.merge(self.graphdef, state)
        needed, prev, canvas0, cstep0 = self._block_setup(carry, consts)
        base_seen = self._seen(carry["tokens"], consts, carry["index"])
        pos_K = jnp.arange(k)[None]

        def ar_predictions(ar_logits, canvas):
            """pred [B, K]: AR greedy token at each block position given the canvas before it;
            and the prediction for the slot after the block [B]."""
            ar_logits = suppress_tokens(ar_logits, consts["vocab_limit"], sp.mask_id)

            def penalised():
                oh = jax.nn.one_hot(canvas, sp.vocab, dtype=jnp.int32) * (canvas != sp.mask_id)[..., None]
                seen_j = base_seen[:, None] | (jnp.cumsum(oh, axis=1) > 0)  # tokens through position j
                return jnp.argmax(repetition_penalty(ar_logits, seen_j, consts["repetition_penalty"]), axis=-1)

            nxt = lax.cond(consts["repetition_penalty"] != 1.0, penalised,
                           lambda: jnp.argmax(ar_logits, axis=-1)).astype(jnp.int32)
            return jnp.concatenate([carry["next_ar"][:, None], nxt[:, :-1]], axis=1), nxt[:, -1]

        def cond(r):
            return jnp.any(~r["verified"]) & (r["round"] <= k)

        def body(r):
            being = ~r["verified"]
            needed_r = needed & being[:, None]
            view = self._with_counters(carry, r)
            d = self._denoise(model, view, consts, r["canvas"], needed_r, r["cstep"])
            cv = d["canvas"]
            ar_logits, new_cache = self._clean_pass(model, carry, consts, cv)
            pred, after = ar_predictions(ar_logits, cv)
            e = first_index(needed_r & self._is_eos(cv, consts))
            check = needed_r & (pos_K <= e[:, None])
            m = first_index(check & (cv != pred))
            ok = m == k
            fix = needed_r & (pos_K == m[:, None])
            remask = needed_r & (pos_K > m[:, None])
            cstep = jnp.where(fix, d["steps"][:, None], jnp.where(remask, -1, d["cstep"]))
            cv = jnp.where(fix, pred, jnp.where(remask, sp.mask_id, cv))
            verified = r["verified"] | ok
            all_ok = jnp.all(verified)
            out = dict(r, canvas=cv, cstep=cstep, verified=verified, round=r["round"] + 1,
                       steps=d["steps"], key=d["key"], nfe=d["nfe"] + being, forwards=d["forwards"] + 1,
                       commits=r["commits"] + being, rejections=r["rejections"] + (being & ~ok),
                       next_ar=jnp.where(all_ok, after, r["next_ar"]))
            if sp.history:
                out["hist"] = d["hist"]
            if not sp.recompute:
                out["cache"] = jax.tree.map(lambda a, b: jnp.where(all_ok, a, b), new_cache, r["cache"])
            return out

        init = {"canvas": canvas0, "cstep": cstep0,
                "verified": carry["finished"], "round": jnp.zeros((), jnp.int32),
                "steps": carry["steps"], "nfe": carry["nfe"], "forwards": carry["forwards"], "key": carry["key"],
                "commits": carry["commits"], "rejections": carry["rejections"], "next_ar": carry["next_ar"]}
        if sp.history:
            init["hist"] = carry["hist"]
        if not sp.recompute:
            init["cache"] = carry["cache"]
        r = lax.while_loop(cond, body, init)
        base = dict(self._with_counters(carry, r), commits=r["commits"], rejections=r["rejections"],
                    next_ar=r["next_ar"])
        if not sp.recompute:
            base["cache"] = r["cache"]
        return self._finish_block(base, consts, needed, prev, r["canvas"], r["cstep"])

    # -- AR mode --------------------------------------------------------------------------------
    def ar_block(self, state, carry: Carry, consts: Carry) -> Carry:
        """Up to `carry["limit"]` tokens of AR decoding of the clean stream, one `extend` each."""
        sp = self.spec
        model = nnx.merge(self.graphdef, state)

        def cond(c):
            return jnp.any(~c["finished"]) & (c["j"] < carry["limit"])

        def body(c):
            s = c["index"]
            logits = c["next_logits"]
            logits = repetition_penalty(logits, self._seen(c["tokens"], consts, s), consts["repetition_penalty"])
            key, sub = jax.random.split(c["key"])
            tok, _ = self._choose(logits, sub, consts)
            active = ~c["finished"]
            col = lax.dynamic_index_in_dim(c["tokens"], s, axis=1, keepdims=False)
            tok = jnp.where(active, tok, col)
            tokens = lax.dynamic_update_index_in_dim(c["tokens"], tok, s, axis=1)
            steps = c["steps"] + active
            cstep = lax.dynamic_update_index_in_dim(
                c["commit_step"], jnp.where(active, steps, -1), s, axis=1)
            fin = c["finished"] | (active & self._is_eos(tok, consts)) | (s + 1 - consts["gen_start"] >= consts["max_new"])
            cont = jnp.any(~fin)
            pos = lax.dynamic_slice_in_dim(consts["positions"], s, 1, axis=1)
            seg = lax.dynamic_slice_in_dim(consts["segment_ids"], s, 1, axis=1)

            def forward():
                if sp.recompute:
                    full = model(tokens, positions=consts["positions"], segment_ids=consts["segment_ids"])
                    return lax.dynamic_index_in_dim(full, s, axis=1, keepdims=False), None
                lg, cache = model.extend(tok[:, None], c["cache"], positions=pos, segment_ids=seg)
                return lg[:, 0], cache

            nl, cache = lax.cond(cont, forward, lambda: (c["next_logits"], c.get("cache")))
            out = dict(c, tokens=tokens, commit_step=cstep, steps=steps, finished=fin, next_logits=nl,
                       nfe=c["nfe"] + (~fin).astype(jnp.int32), forwards=c["forwards"] + cont.astype(jnp.int32),
                       index=s + 1, j=c["j"] + 1, key=key)
            if not sp.recompute:
                out["cache"] = cache
            return out

        c = lax.while_loop(cond, body, dict(carry, j=jnp.zeros((), jnp.int32)))
        c.pop("j")
        return c


__all__ = ["LoopSpec", "Loops"]
