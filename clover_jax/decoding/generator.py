"""Block-diffusion decoding (docs/design.md 3.4): threshold, self-speculative and AR modes, batched.

Layout. All rows share the cache's slot index, so every row's block boundaries must fall on the same
slots: row b (prompt of P_b tokens) is LEFT-padded (pad tokens, segment 0) by L_b, a multiple of the
block size K, so that its document starts on the grid and the block holding its first generated
position starts at slot S0 for every row. The prompt tail (P_b mod K tokens) is known in the first
canvas; later blocks are all masks. Slots [0, S0) are prefilled in one clean-stream pass. AR mode
needs no grid and right-aligns the prompts instead (all end at S0).

Per block (threshold mode): a `lax.while_loop` of denoising steps (`model.block_step` on the
canvas against the caches; commit rule of `rules.commit_mask`), then the commit pass
(`model.extend` of the finished block), whose last logits give the next block's first token
(known before that block's first step with `first_token_commit`). The mask token and the rows at
or above `vocab_limit` are never chosen (`rules.suppress_tokens`). Self-speculative mode
verifies the finished block against the commit pass's AR argmax, keeps the agreeing prefix plus
the AR token at the first disagreement, re-masks the rest and denoises again; the caches are kept from before the block
until a commit pass whose block verifies completely, so the result is exactly AR greedy decoding.
The host loops over blocks (one jitted call each, fixed shapes, preallocated caches), which lets it
stream finished blocks and measure the time to the first token.

Stopping: a row stops once an EOS token is committed and every position before it is filled
(nothing after it is returned), or after `max_new_tokens`. `recompute=True` (a debug oracle) runs the
same loop without caches: every step is the training two-stream forward over the whole buffer.

NFE counts every forward a request needed: the prefill, every denoising step while the row had
masked positions, every commit pass before the row finished (the last block of a threshold-mode
request needs none).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.decoding.loops import LoopSpec, Loops, init_history
from clover_jax.model.clover_model import PAD_SEGMENT, CloverModel

MODES = ("threshold", "ar", "self_speculative")
DEFAULT_EOS = ("<|im_end|>", "<|endoftext|>")


class DecodeError(ValueError):
    """Bad decoding input (prompt, option or checkpoint); the message names what is wrong."""


def jsonl_lines(path: str | Path, what: str) -> Iterator[tuple[Path, int, Any]]:
    """(path, 1-based line number, parsed value) for every non-blank line of a JSONL file; a missing
    file or a line that is not JSON is an error naming `what`, the file and the line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} {p} does not exist")
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield p, n, json.loads(line)
        except json.JSONDecodeError as e:
            from clover_jax.input_file import InputFileError

            raise InputFileError(f"{p}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None


@dataclass(frozen=True)
class DecodeConfig:
    """Decoding options (`decode.*` on the command line).

    `block_size` None = the model's (first) trained size; any size works (research). `sub_block_size`
    k: inside a block only the first sub-block of k positions with masked positions is eligible.
    `alpha_scale`, `beta_shift`, `gamma`: inference-time overrides of every GDN layer's history-unit
    scalars (alpha *= scale, beta += shift, gamma := value). EOS: `eos_token_ids` if given, else
    `eos_tokens` looked up in the tokenizer by the caller (`resolve_eos_ids`), else the model config's
    `eos_token_id`. `recompute`: debug path without caches. `history_stats`: require the mean
    softmax share of the history unit per GDN layer (`block_step(..., return_stats=True)`; it is
    reported whenever the model offers it). `first_token_commit` (default on): a block whose first
    position is generated starts with that token known: with the logit shift its prediction comes
    from the clean state before the block (the commit pass or the prefill) and no step inside the
    block can change it, so it does not wait for the threshold (Fast-dLLM v2 does the same;
    `decoding_loops`). It is the token the loop would commit there at temperature 0 without the
    penalty, so it changes the order, not that token; bench/decode.py measures the effect.
    `vocab_limit`: ids >= it (embedding rows without a token) are never chosen; None: the
    `vocab_limit` given to `Decoder` (callers with a tokenizer pass its size), else every row. The
    mask token is never chosen in any mode. Temperature, top-k, top-p, threshold, the penalty,
    `first_token_commit` and `vocab_limit` are run-time inputs of the compiled loops (changing them
    does not recompile); `length_bucket` and `batch_bucket` round the buffer length and the batch
    (finished dummy rows) up, so nearby request sets share compiled programs."""

    mode: Literal["threshold", "ar", "self_speculative"] = "threshold"
    block_size: int | None = None
    threshold: float = 0.95
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    sub_block_size: int | None = None
    first_token_commit: bool = True
    repetition_penalty: float = 1.0
    alpha_scale: float = 1.0
    beta_shift: float = 0.0
    gamma: float | None = None
    eos_tokens: tuple[str, ...] = DEFAULT_EOS
    eos_token_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    pad_token_id: int | None = None
    vocab_limit: int | None = None
    seed: int = 0
    trace: bool = False
    recompute: bool = False
    history_stats: bool = False
    length_bucket: int = 32  # prompt / buffer lengths round up to this: fewer recompiles
    batch_bucket: int = 1  # the batch is padded (with finished dummy rows) to a multiple of this
    fast_compile: bool = False  # XLA backend optimisations off: ~4x faster compiles, slower steps (CPU tests)
    # a model with the block coreset (moe_block_coreset): "per_step" chooses each step's coresets from
    # its canvas (what training does at every noise level); "first_step" keeps the block's first step's
    # coresets for the rest of the block
    coreset: Literal["per_step", "first_step"] = "per_step"
    # pad tokens after each prompt up to a multiple of lcm(prompt_align, block size) (AR: of
    # prompt_align), so the response starts on the block grid; None = the checkpoint's
    # `response_block_align` (what its training data did: data.align_responses), 0 = no padding
    prompt_align: int | None = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise DecodeError(f"decode.{msg}")

        if self.mode not in MODES:
            bad(f"mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.coreset not in ("per_step", "first_step"):
            bad(f"coreset: {self.coreset!r} is not one of per_step, first_step")
        if self.block_size is not None and self.block_size < 1:
            bad(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 <= self.threshold <= 1.0:
            bad(f"threshold must be in [0, 1], got {self.threshold}")
        if self.max_new_tokens < 1:
            bad(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.sub_block_size is not None and self.sub_block_size < 1:
            bad(f"sub_block_size must be >= 1, got {self.sub_block_size}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.mode == "self_speculative" and self.temperature != 0:
            bad("temperature must be 0 in self_speculative mode (it verifies against AR greedy decoding)")
        if self.length_bucket < 1:
            bad(f"length_bucket must be >= 1, got {self.length_bucket}")
        if self.batch_bucket < 1:
            bad(f"batch_bucket must be >= 1, got {self.batch_bucket}")
        if self.prompt_align is not None and self.prompt_align < 0:
            bad(f"prompt_align must be >= 0 or null, got {self.prompt_align}")
        if self.vocab_limit is not None and self.vocab_limit < 1:
            bad(f"vocab_limit must be >= 1 or null, got {self.vocab_limit}")
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        object.__setattr__(self, "eos_tokens", tuple(self.eos_tokens))

    def replace(self, **changes: Any) -> DecodeConfig:
        return dataclasses.replace(self, **changes)


def resolve_eos_ids(dcfg: DecodeConfig, model_cfg: Any, tokenizer: Any | None = None) -> tuple[int, ...]:
    """The EOS ids: `dcfg.eos_token_ids`, else the tokenizer's ids of `dcfg.eos_tokens` (those it
    knows), else the model config's `eos_token_id`."""
    if dcfg.eos_token_ids is not None:
        return dcfg.eos_token_ids
    ids: list[int] = []
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        ids = [vocab[t] for t in dcfg.eos_tokens if t in vocab]
    if not ids:
        eos = model_cfg.eos_token_id
        ids = [] if eos is None else list(eos) if isinstance(eos, (tuple, list)) else [int(eos)]
    return tuple(dict.fromkeys(int(i) for i in ids))


def resolve_vocab_limit(dcfg: DecodeConfig, model_cfg: Any, tokenizer: Any | None = None) -> int:
    """Ids below this can be generated: `dcfg.vocab_limit`, else the tokenizer's size (rows past it
    are padding of the embedding), else the model's vocabulary."""
    if dcfg.vocab_limit is not None:
        return int(dcfg.vocab_limit)
    if tokenizer is not None:
        return min(len(tokenizer), int(model_cfg.vocab_size))
    return int(model_cfg.vocab_size)


@dataclass(frozen=True)
class Layout:
    """Where each row lives in the slot buffer. `left_pad` [B] pads before the document,
    `prompt_len` [B]; generated tokens of row b start at slot `left_pad + prompt_len` (=
    `gen_start`); `prefill_len` S0 slots are prefilled; the buffer has `total_len` slots and
    `n_blocks` blocks of `block` slots follow the prefill."""

    block: int
    prefill_len: int
    total_len: int
    n_blocks: int
    left_pad: np.ndarray
    prompt_len: np.ndarray

    @property
    def gen_start(self) -> np.ndarray:
        return self.left_pad + self.prompt_len


def _padded(ids: Sequence[int], quantum: int = 8) -> list[int]:
    """`ids` padded with -1 to a multiple of `quantum` (a fixed shape for the compiled loops)."""
    n = max(quantum, _round_up(len(ids), quantum))
    return list(ids) + [-1] * (n - len(ids))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def make_layout(prompt_lens: Sequence[int], block: int, max_new: int, *, aligned: Literal["grid", "right"],
                bucket: int = 32) -> Layout:
    """Grid layout (block modes): every document starts on the block grid and every row's first
    generated position lies in the block at S0. Right layout (AR): every prompt ends at S0."""
    p = np.asarray(prompt_lens, np.int64)
    if aligned == "grid":
        quantum = block * max(1, math.ceil(bucket / block))  # a multiple of the block >= bucket
        base = (p // block) * block  # document offset of the block holding the first new token
        s0 = max(quantum, _round_up(int(base.max()), quantum))  # >= one quantum: short prompts share shapes
        left = s0 - base
        # room for the worst-case prompt tail (K - 1), so the buffer shape depends on S0 and max_new
        # only (fewer recompiles); rows stop at their budget, so the spare block is never decoded
        n_blocks = math.ceil((block - 1 + max_new) / block)
        total = _round_up(s0 + n_blocks * block, quantum)
    else:
        s0 = _round_up(int(p.max()), bucket)
        left = s0 - p
        n_blocks = math.ceil(max_new / block)
        total = _round_up(s0 + n_blocks * block, bucket)
    return Layout(block, s0, total, n_blocks, left.astype(np.int32), p.astype(np.int32))


@dataclass
class Generation:
    """One request's result: `token_ids` (generated, the EOS included when it stopped there),
    `text` (filled by callers with a tokenizer), `finish_reason` "eos" | "length", `stats`."""

    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    stats: dict[str, Any]
    text: str | None = None
    prompt: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "prompt_ids": self.prompt_ids, "text": self.text,
                "token_ids": self.token_ids, "finish_reason": self.finish_reason, "stats": self.stats}


@dataclass
class DecodeOutput:
    generations: list[Generation]
    stats: dict[str, Any] = field(default_factory=dict)


def apply_calibration(model: CloverModel, alpha_scale: float = 1.0, beta_shift: float = 0.0,
                      gamma: float | None = None) -> CloverModel:
    """A copy of `model` with every GDN layer's `bd_gdn_softmax_scalars` [G, nv, 3] = (alpha, beta,
    gamma) changed: alpha * scale, beta + shift, gamma := value. The original is untouched."""
    if alpha_scale == 1.0 and beta_shift == 0.0 and gamma is None:
        return model
    if model.cfg.mode != "block":
        raise DecodeError("calibration overrides need a block-mode model (it has no history-unit scalars)")
    out = nnx.clone(model)
    for j in range(model.cfg.group_size):
        layer = getattr(out.groups, f"layer_{j}")
        if not hasattr(layer, "gdn"):
            continue
        var = layer.gdn.bd_gdn_softmax_scalars
        s = var[...]
        new_gamma = s[..., 2] if gamma is None else jnp.full_like(s[..., 2], gamma)
        var.set_value(jnp.stack([s[..., 0] * alpha_scale, s[..., 1] + beta_shift, new_gamma], axis=-1))
    return out


class Decoder:
    """`Decoder(model, dcfg, eos_ids=...).generate(prompts)`: batched decoding of token-id prompts.

    Compiled functions are cached by shape (batch, buffer length, block size); prompt and buffer
    lengths are rounded up to `dcfg.length_bucket` so nearby prompt sets share them."""

    def __init__(self, model: CloverModel, dcfg: DecodeConfig, *, eos_ids: Sequence[int] | None = None,
                 vocab_limit: int | None = None):
        cfg = model.cfg
        self.cfg, self.dcfg = cfg, dcfg
        self.block = int(dcfg.block_size or cfg.block_sizes[0])
        self.eos_ids = tuple(eos_ids) if eos_ids is not None else resolve_eos_ids(dcfg, cfg)
        self.vocab_limit = int(dcfg.vocab_limit or vocab_limit or cfg.vocab_size)
        if not 0 < self.vocab_limit <= cfg.vocab_size:
            raise DecodeError(f"decode.vocab_limit {self.vocab_limit} is outside [1, {cfg.vocab_size}] (the "
                              "model's vocabulary)")
        self.mask_id = dcfg.mask_token_id if dcfg.mask_token_id is not None else cfg.mask_token_id
        self.pad_id = dcfg.pad_token_id if dcfg.pad_token_id is not None else (cfg.pad_token_id or 0)
        align = cfg.response_block_align if dcfg.prompt_align is None else dcfg.prompt_align
        self.prompt_unit = (align if dcfg.mode == "ar" else math.lcm(align, self.block)) if align else 1
        if dcfg.mode != "ar":
            if cfg.mode != "block":
                raise DecodeError(f"decode.mode={dcfg.mode} needs a block-diffusion (clover_moe) checkpoint; this "
                                  "model is AR (mode='ar'): load it in block mode or use decode.mode=ar")
            if self.mask_id is None:
                raise DecodeError("the checkpoint has no mask token (config mask_token_id is unset): set "
                                  "decode.mask_token_id=ID or use decode.mode=ar")
            if not 0 <= self.mask_id < cfg.vocab_size:
                raise DecodeError(f"decode.mask_token_id {self.mask_id} is outside the vocabulary [0, {cfg.vocab_size})")
        if dcfg.sub_block_size is not None and dcfg.sub_block_size > self.block:
            raise DecodeError(f"decode.sub_block_size {dcfg.sub_block_size} > block size {self.block}")
        supported = "return_stats" in inspect.signature(model.block_step).parameters
        if dcfg.history_stats and dcfg.mode != "ar":
            if dcfg.recompute:
                raise DecodeError("decode.history_stats needs the cached path (recompute=False)")
            if not supported:
                raise DecodeError("decode.history_stats: this model's block_step has no return_stats option")
        # measured whenever the cached block path runs (cheap), so the sweep shares compiled programs
        self.history = supported and dcfg.mode != "ar" and not dcfg.recompute
        self.n_gdn = sum(t != "full_attention" for t in cfg.layer_types)
        model = apply_calibration(model, dcfg.alpha_scale, dcfg.beta_shift, dcfg.gamma)
        self.graphdef, self.state = nnx.split(model)
        self.loops = Loops.compiled(self.graphdef, LoopSpec(
            mode=dcfg.mode, block=self.block, mask_id=-1 if self.mask_id is None else int(self.mask_id),
            sub_block=dcfg.sub_block_size, recompute=dcfg.recompute, history=self.history,
            vocab=cfg.vocab_size, fast_compile=dcfg.fast_compile,
            coreset_first_step=(dcfg.coreset == "first_step" and cfg.moe_block_coreset is not None
                                and dcfg.mode != "ar" and not dcfg.recompute)))
        self._prefill, self._block_call = self.loops.prefill_jit, self.loops.block_jit

    # -- host side -------------------------------------------------------------------------------
    def layout(self, prompts: Sequence[Sequence[int]]) -> Layout:
        d = self.dcfg
        if not prompts:
            raise DecodeError("no prompts given")
        ctx = self.cfg.max_position_embeddings
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise DecodeError(f"prompt {i} is empty: decoding needs at least one prompt token")
            if len(p) > ctx:
                raise DecodeError(f"prompt {i} has {len(p)} tokens, longer than the model context "
                                  f"(max_position_embeddings = {ctx})")
            if len(p) + d.max_new_tokens > ctx:
                raise DecodeError(f"prompt {i} ({len(p)} tokens) + decode.max_new_tokens ({d.max_new_tokens}) "
                                  f"exceeds the model context ({ctx}): lower decode.max_new_tokens")
            bad = [t for t in p if not 0 <= int(t) < self.cfg.vocab_size]
            if bad:
                raise DecodeError(f"prompt {i}: token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
        if d.mode != "ar" and self.block > d.max_new_tokens:
            raise DecodeError(f"decode.block_size {self.block} is larger than decode.max_new_tokens "
                              f"{d.max_new_tokens}: lower the block size or raise max_new_tokens")
        return make_layout([len(p) for p in prompts], self.block, d.max_new_tokens,
                           aligned="right" if d.mode == "ar" else "grid", bucket=d.length_bucket)

    def generate(self, prompts: Sequence[Sequence[int]], *,
                 stream: Callable[[int, list[list[int]]], None] | None = None) -> DecodeOutput:
        """Decodes every prompt (lists of token ids) in one batch. `stream(block_index, new_tokens)`
        is called after every block with each row's newly finished tokens (EOS cut)."""
        n_real, given = len(prompts), prompts
        # a checkpoint trained with block-aligned responses: pads after each prompt (see prompt_align)
        prompts = [list(p) + [self.pad_id] * (-len(p) % self.prompt_unit) for p in prompts]
        if n_real and self.dcfg.batch_bucket > 1:  # dummy rows (finished from the start): fewer shapes
            prompts = list(prompts) + [prompts[0]] * (_round_up(n_real, self.dcfg.batch_bucket) - n_real)
        lay = self.layout(prompts)
        b, s = len(prompts), lay.total_len
        real = np.arange(b) < n_real
        tokens = np.full((b, s), self.pad_id, np.int32)
        seg = np.full((b, s), 1, np.int32)
        for i, p in enumerate(prompts):
            seg[i, : lay.left_pad[i]] = PAD_SEGMENT
            tokens[i, lay.left_pad[i]: lay.gen_start[i]] = np.asarray(p, np.int32)
        pos = np.where(seg == PAD_SEGMENT, np.arange(s)[None], np.arange(s)[None] - lay.left_pad[:, None])
        consts = {"segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos, jnp.int32),
                  "gen_start": jnp.asarray(lay.gen_start, jnp.int32),
                  "max_new": jnp.asarray(self.dcfg.max_new_tokens, jnp.int32),
                  "threshold": jnp.asarray(self.dcfg.threshold, jnp.float32),
                  "eos_ids": jnp.asarray(_padded(self.eos_ids), jnp.int32),
                  "temperature": jnp.asarray(self.dcfg.temperature, jnp.float32),
                  "top_k": jnp.asarray(self.dcfg.top_k, jnp.int32),
                  "top_p": jnp.asarray(self.dcfg.top_p, jnp.float32),
                  "repetition_penalty": jnp.asarray(self.dcfg.repetition_penalty, jnp.float32),
                  "first_commit": jnp.asarray(self.dcfg.first_token_commit and self.dcfg.mode != "ar"),
                  "vocab_limit": jnp.asarray(self.vocab_limit, jnp.int32),
                  "prefill_rows": jnp.asarray((lay.left_pad < lay.prefill_len) & real)}
        carry = self._init_carry(lay, jnp.asarray(tokens))
        carry["finished"] = jnp.asarray(~real)
        t0 = time.perf_counter()
        carry = self._prefill(self.state, carry, consts, lay.prefill_len)
        ttft, emitted = None, np.zeros(b, np.int64)
        n_iter = lay.n_blocks + (1 if self.dcfg.mode == "ar" else 0)
        for it in range(n_iter):
            if self.dcfg.mode == "ar":  # the first call yields one token (time to first token)
                carry["limit"] = jnp.asarray(1 if it == 0 else lay.block, jnp.int32)
            carry = self._block_call(self.state, carry, consts)
            finished = np.asarray(carry["finished"])
            if ttft is None:
                ttft = time.perf_counter() - t0
            if stream is not None:  # only slots decoded so far (later ones still hold pads)
                rows = self._extract(np.asarray(carry["tokens"]), lay, upto=int(carry["index"]))[:n_real]
                stream(it, [r[e:] for r, e in zip(rows, emitted)])
                emitted = np.asarray([len(r) for r in rows])
            if finished.all():
                break
        host = jax.device_get(carry)
        wall = time.perf_counter() - t0
        return self._results(given, lay, host, wall, ttft or wall)

    def _extract(self, tokens: np.ndarray, lay: Layout, upto: int | None = None) -> list[list[int]]:
        """Generated tokens per row (slots < `upto`), cut after the first EOS and at the first
        still-masked slot."""
        out = []
        for i in range(tokens.shape[0]):
            end = lay.gen_start[i] + self.dcfg.max_new_tokens
            g = tokens[i, lay.gen_start[i]: end if upto is None else min(end, upto)].tolist()
            for j, t in enumerate(g):
                if t in self.eos_ids:
                    g = g[: j + 1]
                    break
                if self.mask_id is not None and t == self.mask_id and self.dcfg.mode != "ar":
                    g = g[:j]
                    break
            out.append(g)
        return out

    def _results(self, prompts, lay: Layout, c: dict[str, Any], wall: float, ttft: float) -> DecodeOutput:
        rows = self._extract(c["tokens"], lay)[: len(prompts)]  # without the dummy rows
        gens = []
        for i, toks in enumerate(rows):
            n = len(toks)
            nfe = int(c["nfe"][i])
            steps, blocks = int(c["steps"][i]), int(c["blocks"][i])
            st = {"nfe": nfe, "tokens": n, "tokens_per_forward": n / max(nfe, 1),
                  "denoise_steps": steps, "commit_passes": int(c["commits"][i]), "blocks": blocks,
                  "steps_per_block": steps / max(blocks, 1), "tokens_per_step": n / max(steps, 1),
                  "rejections": int(c["rejections"][i]), "wall_s": wall, "ttft_s": ttft}
            if self.dcfg.mode == "ar":
                st["tokens_per_step"] = 1.0
                st["steps_per_block"] = None
            if self.dcfg.trace:
                st["commit_order"] = [int(x) for x in c["commit_step"][i, lay.gen_start[i]: lay.gen_start[i] + n]]
            finish = "eos" if toks and toks[-1] in self.eos_ids else "length"
            gens.append(Generation([int(t) for t in prompts[i]], [int(t) for t in toks], finish, st))
        tot_tokens = sum(len(r) for r in rows)
        tot_nfe = sum(g.stats["nfe"] for g in gens)
        agg = {"mode": self.dcfg.mode, "block_size": self.block, "threshold": self.dcfg.threshold,
               "requests": len(gens), "tokens": tot_tokens, "nfe": tot_nfe,
               "batch_forwards": int(c["forwards"]),
               "tokens_per_forward": tot_tokens / max(tot_nfe, 1),
               "wall_s": wall, "ttft_s": ttft, "tokens_per_s": tot_tokens / max(wall, 1e-9),
               "s_per_token": wall / max(tot_tokens, 1)}
        if self.history:
            h = jax.device_get(c["hist"])
            cnt = float(h["cnt"])
            agg["history_share"] = [float(x) / cnt if cnt else float("nan") for x in h["sum"]]
            # per GDN layer, per position inside the block (NaN where no real token was there)
            agg["history_share_by_position"] = [[float(s) / n if n else float("nan") for s, n in zip(row, h["pos_cnt"])]
                                                for row in h["pos_sum"]]
            agg["history_tokens_by_position"] = [float(n) for n in h["pos_cnt"]]
        return DecodeOutput(gens, agg)

    # -- device side -----------------------------------------------------------------------------
    def _model(self, state) -> CloverModel:
        return nnx.merge(self.graphdef, state)

    def _init_carry(self, lay: Layout, tokens: jax.Array) -> dict[str, Any]:
        b, s = tokens.shape
        z = jnp.zeros((b,), jnp.int32)
        carry = {"tokens": tokens, "index": jnp.asarray(lay.prefill_len, jnp.int32),
                 "finished": jnp.zeros((b,), bool), "nfe": z, "steps": z, "commits": z, "blocks": z,
                 "rejections": z, "forwards": jnp.zeros((), jnp.int32),
                 "commit_step": jnp.full((b, s), -1, jnp.int32), "next_ar": z,
                 "key": jax.random.PRNGKey(self.dcfg.seed)}
        if not self.dcfg.recompute:
            carry["cache"] = self._model(self.state).init_cache(b, s)
        if self.dcfg.mode == "ar":
            carry["next_logits"] = jnp.zeros((b, self.cfg.vocab_size), jnp.float32)
            carry["limit"] = jnp.asarray(lay.block, jnp.int32)
        if self.history:
            carry["hist"] = init_history(self.n_gdn, self.block)
        return carry

