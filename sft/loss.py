"""The masked-diffusion SFT loss (docs/design.md 3.3): chunked-vocabulary cross-entropy at the masked
positions of the two-stream forward, weighting and normalisation, MoE load balancing, optional AR
loss on the clean stream.

Chunked CE (`weighted_ce`): never materialises [B, T, V] logits, in the forward or the backward.
Rows are first sorted so that loss tokens come first (a stable per-row argsort), then a
`lax.scan` walks token chunks of [B, C] positions: logits chunk = h_chunk @ W ([B, C, V] fp32),
logsumexp, target logit, argmax; a chunk without any loss token is skipped (`lax.cond`), which
makes the cost follow the number of masked tokens, not the row length. The backward is a custom
VJP that computes the gradients in the same sweep (the loss is a weighted SUM of token NLLs, so
its cotangent is one scalar and ``d loss / d logits = coef * (softmax - onehot)`` is known in the
forward): 3 matmuls per chunk instead of 4 for recompute-in-backward, and the residuals are only
dh [B, T, D] and dW [D, V]. Without differentiation (eval) only the forward sweep runs.

Loss of one step (R = copies * B noisy rows, see `sft.noise`):

    loss = sum_i coef_i * nll_i  +  lb_coef * lb_loss  +  ar_loss_weight * ar_ce

with, over the masked tokens i (w_i = 1 for ``uniform``, 1 / max(t_i, t_min) for ``inverse_t``,
t_i the noise level of the token's block in its copy):

- ``token``    coef_i = w_i / (number of masked tokens);
- ``sequence`` coef_i = w_i / (masked tokens of i's document, both copies pooled) / (documents with
  a masked token): every packed document counts the same;
- ``batch``    coef_i = w_i / (copies * number of maskable tokens): the ELBO normaliser (with
  ``inverse_t`` an unbiased estimate of the per-token NELBO bound).

The ``weight`` metric is that normaliser (masked tokens, documents, copies * maskable tokens), so
`train.step` accumulates micro-batches exactly like one big batch (the lb and AR terms are then
weighted by it too). ``lb_loss`` is the model's Switch loss over both streams (mean over layers).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.model.clover_model import shift_predictions
from clover_jax.yaml_config import ConfigError
from sft.noise import NoiseConfig, noise_batch

__all__ = ["LossConfig", "ar_targets", "loss_positions", "make_sft_loss", "sequence_coefficients", "token_coefficients",
           "weighted_ce", "weighted_ce_reference"]


@dataclass(frozen=True)
class LossConfig:
    """Loss options (YAML section ``loss``). ``lb_coef`` None = the model's
    ``router_aux_loss_coef``. ``chunk_tokens``: tokens per CE chunk on each device (under a mesh
    every device sweeps its own tokens in chunks of this many; the [chunk, V] fp32 logits tile is
    the largest buffer: 2048 x 248320 x 4 B = 2 GB; lower it on small chips)."""

    weighting: Literal["uniform", "inverse_t"] = "uniform"
    normalization: Literal["token", "sequence", "batch"] = "token"
    ar_loss_weight: float = 0.0
    lb_coef: float | None = None
    chunk_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.ar_loss_weight < 0:
            raise ConfigError(f"loss.ar_loss_weight must be >= 0, got {self.ar_loss_weight}")
        if self.lb_coef is not None and self.lb_coef < 0:
            raise ConfigError(f"loss.lb_coef must be >= 0 or null, got {self.lb_coef}")
        if self.chunk_tokens < 1:
            raise ConfigError(f"loss.chunk_tokens must be >= 1, got {self.chunk_tokens}")


# ----------------------------------------------------------------------------------------------
# chunked weighted cross-entropy
def _chunk_sweep(h_NBCD, w_DV, tgt_NBC, coef_NBC, mask_NBC, with_grads: bool):
    """Scan over N chunks. Returns (sums (weighted nll, plain nll, correct), dh_NBCD | None,
    dW_DV | None). Skips chunks without a loss token."""
    d, v = w_DV.shape
    w_c = w_DV.astype(h_NBCD.dtype)

    def compute(h_BCD, t_BC, c_BC, m_BC):
        logits = jnp.einsum("bcd,dv->bcv", h_BCD, w_c, preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt_logit = jnp.take_along_axis(logits, t_BC[..., None], axis=-1)[..., 0]
        nll = lse - tgt_logit
        m = m_BC.astype(jnp.float32)
        correct = (jnp.argmax(logits, axis=-1) == t_BC).astype(jnp.float32)
        sums = jnp.stack([jnp.sum(c_BC * nll), jnp.sum(m * nll), jnp.sum(m * correct)])
        if not with_grads:
            return sums, None, None
        onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == t_BC[..., None]
        dlogits = (jnp.exp(logits - lse[..., None]) - onehot) * c_BC[..., None]
        dh = jnp.einsum("bcv,dv->bcd", dlogits.astype(w_c.dtype), w_c,
                        preferred_element_type=jnp.float32).astype(h_BCD.dtype)
        dw = jnp.einsum("bcd,bcv->dv", h_BCD, dlogits.astype(h_BCD.dtype), preferred_element_type=jnp.float32)
        return sums, dh, dw

    def body(carry, xs):
        h, t, c, m = xs

        def run(carry):
            sums, dh, dw = compute(h, t, c, m)
            if with_grads:
                return (carry[0] + sums, carry[1] + dw), dh
            return (carry[0] + sums, carry[1]), None

        def skip(carry):  # no loss token in this chunk: the carry passes through untouched
            return carry, (jnp.zeros_like(h) if with_grads else None)

        return jax.lax.cond(jnp.any(m), run, skip, carry)

    dw0 = jnp.zeros((d, v), jnp.float32) if with_grads else jnp.zeros((), jnp.float32)
    (sums, dw), dh = jax.lax.scan(body, (jnp.zeros((3,), jnp.float32), dw0), (h_NBCD, tgt_NBC, coef_NBC, mask_NBC))
    return sums, dh, (dw if with_grads else None)


@jax.custom_vjp
def _ce_chunks(h_NBCD, w_DV, tgt_NBC, coef_NBC, mask_NBC):
    return _chunk_sweep(h_NBCD, w_DV, tgt_NBC, coef_NBC, mask_NBC, with_grads=False)[0]


def _ce_chunks_fwd(h_NBCD, w_DV, tgt_NBC, coef_NBC, mask_NBC):
    sums, dh, dw = _chunk_sweep(h_NBCD, w_DV, tgt_NBC, coef_NBC, mask_NBC, with_grads=True)
    return sums, (dh, dw.astype(w_DV.dtype))


def _ce_chunks_bwd(res, g_sums):
    dh, dw = res
    g = g_sums[0]  # only the weighted-nll sum is differentiable; the others are metrics
    return ((g * dh.astype(jnp.float32)).astype(dh.dtype), (g * dw.astype(jnp.float32)).astype(dw.dtype),
            None, None, None)


_ce_chunks.defvjp(_ce_chunks_fwd, _ce_chunks_bwd)




def _sharded_ce(h_BTD: jax.Array, w_DV: jax.Array, targets_BT: jax.Array, coef_BT: jax.Array, mask_BT: jax.Array,
                chunk_tokens: int, ctx: Any) -> jax.Array:
    """`weighted_ce` under a mesh: one `shard_map` over the whole mesh in which every device sweeps
    the chunks of its own tokens ([B / batch shards, T / context shards], `chunk_tokens` positions
    per chunk: `chunk_tokens` sizes the [C, V] logits tile of each device, so a device sweeps few
    large chunks whatever the mesh; dividing a global chunk among 32 chips left 128-token chunks and
    the fp32 dW [D, V] partial sum was read and written once per chunk) and keeps its dW partial
    sum local over all its chunks. The lm_head enters
    sharded as its parameter (embed over FSDP, vocab over tensor) and is all-gathered inside in
    the compute dtype, so its gradient leaves as one reduce-scatter onto the parameter's shards per
    call; the three sums are psum'd over the token axes. Without it (rows grouped by batch shard
    only, tokens gathered over `context`) every context shard ran the same chunks, and XLA reduced
    dW across devices inside the chunk loop: an all-reduce of [D, V] per chunk."""
    from jax.sharding import PartitionSpec as P

    from clover_jax.parallel.sharding import spec_axes as _axes

    b, t, _ = h_BTD.shape
    mesh = ctx.mesh
    tok = ctx.spec(("batch", "length"), (b, t), what="CE tokens")
    w_spec = ctx.spec(("embed", "vocab"), tuple(w_DV.shape), what="lm_head")
    tok_axes = _axes(tok[0]) + _axes(tok[1])

    def body(h, w, tgt, coef, m):
        for dim, entry in enumerate(w_spec):
            if _axes(entry):
                w = jax.lax.all_gather(w, _axes(entry), axis=dim, tiled=True)
        sums = weighted_ce(h, w, tgt, coef, m, chunk_tokens=chunk_tokens, groups=1)
        return jax.lax.psum(sums, tok_axes) if tok_axes else sums

    rows = P(tok[0], tok[1])
    # check_vma=False as the MoE's shard_map: the output is psum'd over the token axes, the rest of
    # the mesh computes the same sums (the transpose divides its cotangent among them)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(tok[0], tok[1], None), w_spec, rows, rows, rows),
                       out_specs=P(), check_vma=False)
    return fn(h_BTD, w_DV.astype(h_BTD.dtype), targets_BT, coef_BT, mask_BT)


def weighted_ce(h_BTD: jax.Array, w_DV: jax.Array, targets_BT: jax.Array, coef_BT: jax.Array,
                mask_BT: jax.Array, *, chunk_tokens: int = 4096, groups: int | None = None) -> jax.Array:
    """Chunked CE sums over the tokens where `mask_BT` (coef must be 0 elsewhere).

    Returns f32 [3]: (sum coef_i * nll_i (differentiable wrt h and w), sum nll_i, number of
    argmax-correct tokens). `w_DV` is the lm_head kernel [D, V]. The B rows form `groups` groups
    (B must be divisible by it, else 1), each compacted so its loss tokens come first; a chunk holds
    C = ceil(chunk_tokens / groups) positions of every group, and never more than one [groups, C, V]
    logits tile exists. `groups` None: one group, or under a mesh (`sharding.use_sharding`) one per
    device, each device's own tokens (`_sharded_ce`)."""
    from clover_jax.parallel import sharding

    if groups is None:
        ctx = sharding.current()
        if ctx is not None and ctx.mesh.size > 1:
            return _sharded_ce(h_BTD, w_DV, targets_BT, coef_BT, mask_BT, chunk_tokens, ctx)
        groups = 1
    b, t, d = h_BTD.shape
    g = groups
    if b % g:
        g = 1
    n_tok = (b // g) * t
    h, tgt = h_BTD.reshape(g, n_tok, d), targets_BT.astype(jnp.int32).reshape(g, n_tok)
    coef, m = coef_BT.astype(jnp.float32).reshape(g, n_tok), mask_BT.astype(bool).reshape(g, n_tok)
    c = max(1, min(n_tok, -(-chunk_tokens // g)))
    n = -(-n_tok // c)
    pad = n * c - n_tok
    # loss tokens first, in their original order (stable), so trailing chunks are empty and skipped
    order = jnp.argsort(~m, axis=1, stable=True)
    take = lambda x: jnp.take_along_axis(x, order if x.ndim == 2 else order[..., None], axis=1)  # noqa: E731
    h, tgt, coef, m = take(h), take(tgt), take(coef), take(m)
    if pad:
        padw = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
        h, tgt, coef, m = padw(h), padw(tgt), padw(coef), padw(m)
    chunks = lambda x: jnp.moveaxis(x.reshape(g, n, c, *x.shape[2:]), 1, 0)  # noqa: E731
    return _ce_chunks(chunks(h), w_DV, chunks(tgt), chunks(coef), chunks(m))


def weighted_ce_reference(h_BTD, w_DV, targets_BT, coef_BT, mask_BT) -> jax.Array:
    """The plain full-logits version of `weighted_ce` (materialises [B, T, V]; tests only)."""
    logits = jnp.einsum("btd,dv->btv", h_BTD, w_DV.astype(h_BTD.dtype), preferred_element_type=jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets_BT[..., None], -1)[..., 0]
    m = mask_BT.astype(jnp.float32)
    correct = (jnp.argmax(logits, -1) == targets_BT).astype(jnp.float32)
    return jnp.stack([jnp.sum(coef_BT * nll), jnp.sum(m * nll), jnp.sum(m * correct)])


# ----------------------------------------------------------------------------------------------
# coefficients
def token_coefficients(masked_RT: jax.Array, t_RT: jax.Array, maskable_RT: jax.Array, segment_ids_RT: jax.Array,
                       *, weighting: str, normalization: str, t_min: float, copies: int
                       ) -> tuple[jax.Array, jax.Array]:
    """(coef f32 [R, T] (0 off the masked tokens), normaliser f32 []) of the module docstring.
    `maskable_RT` is the loss mask of the rows (copies included: only the first copy's rows count
    for ``batch``); `segment_ids_RT` are those of the rows (documents pool over the copies)."""
    m = masked_RT.astype(jnp.float32)
    if weighting == "uniform":
        w = m
    elif weighting == "inverse_t":
        w = m / jnp.maximum(t_RT, t_min)
    else:
        raise ConfigError(f"loss.weighting: unknown {weighting!r} (uniform | inverse_t)")
    if normalization == "token":
        norm = jnp.sum(m)
        return w / jnp.maximum(norm, 1.0), norm
    if normalization == "batch":
        b = masked_RT.shape[0] // copies
        norm = copies * jnp.sum(maskable_RT[:b].astype(jnp.float32))
        return w / jnp.maximum(norm, 1.0), norm
    if normalization == "sequence":
        per_doc, n_docs = sequence_coefficients(m, segment_ids_RT, copies)
        return w * per_doc, n_docs
    raise ConfigError(f"loss.normalization: unknown {normalization!r} (token | sequence | batch)")


def sequence_coefficients(m_RT: jax.Array, segment_ids_RT: jax.Array, copies: int) -> tuple[jax.Array, jax.Array]:
    """Per-token 1 / (masked tokens of its document) / (documents with a masked token), f32 [R, T],
    and that document count. A document is (drawn row, segment id), pooled over the copies."""
    r, t = m_RT.shape
    b = r // copies
    row = jnp.arange(r, dtype=jnp.int32)[:, None] % b
    doc = row * (t + 1) + segment_ids_RT.astype(jnp.int32)  # segment ids are < t + 1
    counts = jax.ops.segment_sum(m_RT.reshape(-1), doc.reshape(-1), num_segments=b * (t + 1))
    n_docs = jnp.sum((counts > 0).astype(jnp.float32))
    per_tok = jnp.take(counts, doc.reshape(-1)).reshape(r, t)
    coef = jnp.where(m_RT > 0, 1.0 / jnp.maximum(per_tok, 1.0), 0.0) / jnp.maximum(n_docs, 1.0)
    return coef, n_docs


def ar_targets(input_ids_BT: jax.Array, loss_mask_BT: jax.Array, segment_ids_BT: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """Next-token targets [B, T] (position p predicts p + 1) and their mask: the next token is a
    loss (assistant) token of the same document; the last position never predicts."""
    nxt = jnp.pad(input_ids_BT[:, 1:], ((0, 0), (0, 1)))
    same = jnp.pad((segment_ids_BT[:, 1:] == segment_ids_BT[:, :-1]) & loss_mask_BT[:, 1:].astype(bool),
                   ((0, 0), (0, 1)))
    return nxt, same


# ----------------------------------------------------------------------------------------------
def _lm_head(model: Any) -> jax.Array:
    if model.cfg.tie_word_embeddings:
        return model.embed.embedding[...].T
    return model.lm_head.kernel[...]


def loss_positions(loss_mask_BT: jax.Array, segment_ids_BT: jax.Array, logits_shift: bool) -> jax.Array:
    """The tokens that can carry loss, bool [B, T]: loss-mask tokens of a document (segment id != 0),
    without a document's first position under the logit shift: it has no predecessor in its
    document (`shift_predictions` gives it zeros), which happens when a hard cut starts a piece on
    a response token; it stays a known token of the noisy canvas."""
    lm = loss_mask_BT.astype(bool) & (segment_ids_BT != 0)
    if not logits_shift:
        return lm
    doc_start = jnp.concatenate([jnp.ones_like(segment_ids_BT[:, :1], bool),
                                 segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    return lm & ~doc_start


#: folded into the step's key for the adapters' dropout (any constant the noise never folds in)
_LORA_DROPOUT_STREAM = 0x4C6F5241


def make_sft_loss(
    graphdef: Any, *, block_size: int, mask_token_id: int, noise: NoiseConfig, loss: LossConfig,
    lb_coef: float, end_pad_id: int | None = None,
) -> Callable[[Any, dict[str, jax.Array], jax.Array], tuple[jax.Array, dict[str, jax.Array]]]:
    """``loss_fn(params, batch, rng) -> (loss, metrics)`` for `train.step` (see module docstring).

    params: the pure params dict of a block-mode model (`graphdef` from ``nnx.split(model)``);
    batch: the data pipeline's dict (input_ids, segment_ids, positions, loss_mask, [B, T]; optional
    ``noise_t``, a scalar: every block at that level and no complementary copy, for eval: the
    complement would be at 1 - t); rng: a typed key, for the noise. `end_pad_id`: the target of
    the slots after a response's end (``noise.after_end: pad``, `sft.noise`). Loss positions:
    `loss_positions`. Metrics: weight (normaliser), num_masked, tokens (non-pad tokens of the drawn
    rows), acc and ce (masked-token accuracy / plain CE), ar_loss (when weighted), lb_loss,
    expert_counts [L, E].
    """
    if noise.after_end == "pad" and end_pad_id is None:
        raise ConfigError("noise.after_end: pad trains the slots after a response's end to predict the end pad "
                          "token: pass end_pad_id (the recipe uses the tokenizer's pad id), or use after_end: mask")
    ce_fn = functools.partial(weighted_ce, chunk_tokens=loss.chunk_tokens)
    eval_noise = dataclasses.replace(noise, complementary=False)

    def loss_fn(params: Any, batch: dict[str, jax.Array], rng: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        model = nnx.merge(graphdef, params)
        ids, seg = batch["input_ids"], batch["segment_ids"]
        lmask = loss_positions(batch["loss_mask"], seg, model.cfg.logits_shift)
        fixed_t = batch.get("noise_t")
        ncfg = noise if fixed_t is None else eval_noise
        copies = ncfg.copies
        nz = noise_batch(rng, ids, lmask, block_size=block_size, mask_token_id=mask_token_id, cfg=ncfg,
                         fixed_t=fixed_t, segment_ids_BT=seg, end_pad_id=end_pad_id)
        rep = lambda x: jnp.concatenate([x] * copies, axis=0)  # noqa: E731
        seg_R, pos_R = rep(seg), rep(batch["positions"])
        # the adapters' dropout while training (an eval batch, `noise_t`, has none); its key is
        # folded from the step's, so the noise draws are those of a run without dropout
        lora_key = jax.random.fold_in(rng, _LORA_DROPOUT_STREAM) if fixed_t is None else None
        h_clean, h_noisy, aux = model.two_stream_hidden(nz.input_ids_RT, nz.noisy_ids_RT, block_size=block_size,
                                                        positions=pos_R, segment_ids=seg_R, lora_key=lora_key)
        h_pred = shift_predictions(h_clean, h_noisy, seg_R, block_size, model.cfg.logits_shift)
        coef, norm = token_coefficients(nz.masked_RT, nz.t_RT, nz.maskable_RT, seg_R, weighting=loss.weighting,
                                        normalization=loss.normalization, t_min=noise.t_min, copies=copies)
        w_DV = _lm_head(model)
        sums = ce_fn(h_pred, w_DV, nz.targets_RT, jax.lax.stop_gradient(coef), nz.masked_RT)
        n_masked = jnp.sum(nz.masked_RT.astype(jnp.float32))
        safe = jnp.maximum(n_masked, 1.0)
        total = sums[0] + lb_coef * aux["lb_loss"]
        metrics = {
            "weight": norm, "num_masked": n_masked.astype(jnp.int32),
            "tokens": jnp.sum(seg != 0).astype(jnp.int32),
            "acc": sums[2] / safe, "ce": sums[1] / safe, "lb_loss": aux["lb_loss"],
            "expert_counts": aux["expert_counts"],
        }
        if loss.ar_loss_weight > 0:
            b = ids.shape[0]
            tgt, amask = ar_targets(ids, lmask, seg)
            n_ar = jnp.sum(amask.astype(jnp.float32))
            ar = ce_fn(h_clean[:b], w_DV, tgt, amask / jnp.maximum(n_ar, 1.0), amask)
            total = total + loss.ar_loss_weight * ar[0]
            metrics["ar_loss"] = ar[0]
        return total, metrics

    return loss_fn
