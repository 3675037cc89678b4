"""Block-diffusion decoding (docs/design.md 3.4): the commit rule on synthetic logits, sampling filters,
equivalences (block size 1 == AR greedy, cached == recomputed, self-speculative == AR greedy at
every block size), EOS stopping, sub-blocks, the repetition penalty against a naive loop,
calibration overrides, quality of a model trained on tool calls, and bad input.

Oracles: numpy re-statements of the rules; AR greedy decoding (an independent code path: token by
token `extend`); the training two-stream forward over the whole prefix (recompute mode); a python
loop of full clean forwards for the penalty; the JSON parser for tool calls.

The random model shares the trained model's config (same compiled functions) with a scaled-up
lm_head, so its distributions are peaked: near-ties between a random model's flat confidences
would make token-for-token comparisons a coin toss in the last float bit.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.decoding.generator import DecodeConfig, DecodeError, Decoder, apply_calibration, make_layout, resolve_eos_ids
from clover_jax.decoding.metrics import tool_call_validity
from clover_jax.decoding.rules import choose_tokens, commit_mask, filter_logits, repetition_penalty
from clover_jax.model.clover_model import CloverModel, create_model
from tests.decode_fixtures import (TinyTaskConfig, encode_example, eval_records, peaked_random_model, task_records,
                                   tool_call_records, trained_model)

MAX_NEW = 48
BUCKET = 16  # every test decodes 16-row batches (dummy rows pad): the tests share compiled programs


trained, random_model = trained_model, peaked_random_model  # shared with test_decoding_semantics.py


@functools.lru_cache(maxsize=None)
def prompts() -> tuple[tuple[int, ...], ...]:
    """Three held-out prompts of different lengths (token ids of the trained tokenizer)."""
    _, _, tok = trained()
    out = [tuple(encode_example(tok, r)[0]) for r in eval_records(6)]
    return tuple(sorted(out, key=len)[::2])


def test_held_out_prompts_are_not_training_prompts():
    """The held-out records' requests + offered tools never occur in the training stream (the
    generator repeats them, so the eval stream must be de-duplicated against it)."""
    task = TinyTaskConfig()
    seen = {(r["messages"][0]["content"], tuple(t["function"]["name"] for t in r["tools"]))
            for r in task_records(task.n_train, task.data_seed)}
    held = eval_records(64)
    assert len(held) == 64 and held[:16] == tool_call_records(16)
    assert not [r for r in held
                if (r["messages"][0]["content"], tuple(t["function"]["name"] for t in r["tools"])) in seen]


@contextlib.contextmanager
def backend_compiles():
    """Counts XLA backend compiles (jax's monitoring events) inside the block: `with ... as n`, n[0]."""
    n = [0]

    def on_event(event: str, duration: float, **kw) -> None:
        n[0] += event == "/jax/core/compile/backend_compile_duration"

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield n
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)


def dcfg(**kw) -> DecodeConfig:
    """Test decoding options: unoptimised XLA backend (compiles ~4x faster; same results)."""
    return DecodeConfig(**{"max_new_tokens": MAX_NEW, "fast_compile": True, "batch_bucket": BUCKET, **kw})


def decode(model, ps, **kw):
    out = Decoder(model, dcfg(**kw)).generate([list(p) for p in ps])
    return [g.token_ids for g in out.generations], out


# -- rules on synthetic inputs ---------------------------------------------------------------------
def test_commit_rule_on_synthetic_confidences():
    conf = jnp.asarray([[0.99, 0.2, 0.97, 0.5],   # two above 0.95
                        [0.3, 0.6, 0.6, 0.1],     # none above: top-1, tie -> lowest index (1)
                        [0.99, 0.99, 0.99, 0.99],  # all above but only two eligible
                        [0.9, 0.9, 0.9, 0.9]])    # nothing eligible
    elig = jnp.asarray([[1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 0, 1], [0, 0, 0, 0]], bool)
    got = np.asarray(commit_mask(conf, elig, 0.95))
    np.testing.assert_array_equal(got, [[1, 0, 1, 0], [0, 1, 0, 0], [0, 1, 0, 1], [0, 0, 0, 0]])
    # threshold 1.0: exactly one per row with eligible positions, the most confident one
    got = np.asarray(commit_mask(conf, elig, 1.0))
    np.testing.assert_array_equal(got.sum(-1), [1, 1, 1, 0])
    np.testing.assert_array_equal(np.argmax(got[:3], -1), [0, 1, 1])


def test_commit_rule_loop_properties():
    """Random confidences, whole blocks: every step commits >= 1 and only masked positions, all above
    the threshold or exactly the most confident masked one; a block fills in <= K steps."""
    rng = np.random.default_rng(0)
    k = 12
    rule = jax.jit(commit_mask)
    for trial in range(20):
        thr = float(rng.choice([0.5, 0.9, 1.0]))
        masked = rng.random((1, k)) < 0.8  # a block with some known positions
        n_masked, steps = int(masked.sum()), 0
        while masked.any():
            conf = rng.random((1, k)).astype(np.float32)
            c = np.asarray(rule(jnp.asarray(conf), jnp.asarray(masked), jnp.float32(thr)))
            assert not (c & ~masked).any() and c.sum() >= 1
            above = masked & (conf > thr)
            if above.any():
                np.testing.assert_array_equal(c, above)
            else:
                assert c.sum() == 1 and conf[c][0] == conf[masked].max()
            if thr >= 1.0:
                assert c.sum() == 1
            masked &= ~c
            steps += 1
        assert steps <= n_masked


def test_sampling_filters_and_penalty_against_numpy():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 50)).astype(np.float32) * 3
    # top-k: exactly the k largest survive
    got = np.asarray(filter_logits(jnp.asarray(logits), top_k=5))
    for row, lg in zip(got, logits):
        assert set(np.flatnonzero(np.isfinite(row))) == set(np.argsort(-lg)[:5])
    # top-p: the smallest prefix of the sorted distribution with mass >= p
    got = np.asarray(filter_logits(jnp.asarray(logits), top_p=0.7))
    for row, lg in zip(got, logits):
        order = np.argsort(-lg)
        p = np.exp(lg - lg.max()) / np.exp(lg - lg.max()).sum()
        n = int(np.searchsorted(np.cumsum(p[order]), 0.7) + 1)
        assert set(np.flatnonzero(np.isfinite(row))) == set(order[:n])
    # greedy: argmax and its probability; top_k=1 sampling is the argmax whatever the key
    tok, conf = choose_tokens(jnp.asarray(logits), None)
    np.testing.assert_array_equal(np.asarray(tok), logits.argmax(-1))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(conf), (p / p.sum(-1, keepdims=True)).max(-1), rtol=1e-5)
    tok, conf = choose_tokens(jnp.asarray(logits), jax.random.PRNGKey(3), temperature=0.7, top_k=1)
    np.testing.assert_array_equal(np.asarray(tok), logits.argmax(-1))
    np.testing.assert_allclose(np.asarray(conf), 1.0)
    # repetition penalty (CTRL rule) by hand
    lg = jnp.asarray([[2.0, -2.0, 1.0]])
    seen = jnp.asarray([[True, True, False]])
    np.testing.assert_allclose(np.asarray(repetition_penalty(lg, seen, 2.0)), [[1.0, -4.0, 1.0]])


def test_layout_puts_every_document_on_the_grid():
    lay = make_layout([5, 11, 3, 40], 4, 10, aligned="grid", bucket=8)
    starts = lay.left_pad
    assert np.all(starts % 4 == 0)
    first_block = starts + (lay.prompt_len // 4) * 4
    assert np.all(first_block == lay.prefill_len) and lay.prefill_len % 8 == 0
    assert lay.total_len >= lay.prefill_len + lay.n_blocks * 4 and lay.total_len % 4 == 0
    assert np.all(lay.gen_start + 10 <= lay.prefill_len + lay.n_blocks * 4)
    right = make_layout([5, 11], 4, 10, aligned="right", bucket=8)
    np.testing.assert_array_equal(right.gen_start, [right.prefill_len] * 2)


# -- equivalences ---------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["random", "trained"])
def test_block_size_one_equals_ar_greedy(which):
    """Block size 1 with the logit shift is AR greedy decoding, token for token, batched (three
    prompts of different lengths, left-padded differently in the two layouts)."""
    model = random_model() if which == "random" else trained()[1]
    ps = prompts()
    ar, ar_out = decode(model, ps, mode="ar", eos_token_ids=())
    b1, b1_out = decode(model, ps, mode="threshold", block_size=1, eos_token_ids=())
    assert all(len(r) == MAX_NEW for r in ar)
    assert b1 == ar
    assert [g.stats["nfe"] for g in ar_out.generations] == [MAX_NEW] * len(ps)  # prefill + MAX_NEW - 1


def test_cached_decoding_equals_recompute():
    """The cached decoder (block steps + commit passes on the caches) and the debug path that runs
    the training forward over the whole buffer at every step commit the same tokens in the same
    order (random model, block 4, threshold 0.9: several commits per step happen)."""
    model = random_model()
    ps = prompts()[:2]
    kw = dict(block_size=4, threshold=0.9, eos_token_ids=(), trace=True)
    a, a_out = decode(model, ps, **kw)
    b, b_out = decode(model, ps, recompute=True, **kw)
    assert a == b
    assert [g.stats["commit_order"] for g in a_out.generations] == [g.stats["commit_order"] for g in b_out.generations]
    assert [g.stats["nfe"] for g in a_out.generations] == [g.stats["nfe"] for g in b_out.generations]
    # stats: every forward counts (prefill + denoising steps + commit passes), the ratios follow
    for g in a_out.generations:
        st = g.stats
        assert st["nfe"] == 1 + st["denoise_steps"] + st["commit_passes"]
        assert st["commit_passes"] == st["blocks"] - 1  # the last block needs no commit pass
        assert st["tokens_per_forward"] == st["tokens"] / st["nfe"] and st["tokens"] == len(g.token_ids)
        assert st["steps_per_block"] == st["denoise_steps"] / st["blocks"]
        assert 0 < st["ttft_s"] <= st["wall_s"]


@pytest.mark.parametrize("block", [5, 32])
def test_self_speculative_equals_ar_greedy(block):
    """Exactly AR greedy at every block size (a size that divides neither the prompts nor the
    trained 32, and 32; the EOS test below runs it at 5 with an EOS), on the random and the trained
    model; on the trained model at the trained size it needs fewer forwards than AR."""
    for which, model in (("random", random_model()), ("trained", trained()[1])):
        ar, ar_out = decode(model, prompts(), mode="ar")
        sp, sp_out = decode(model, prompts(), mode="self_speculative", block_size=block)
        assert sp == ar, f"{which}: self-speculative at block {block} differs from AR greedy"
        if which == "trained" and block == 32:
            assert sp_out.stats["nfe"] < ar_out.stats["nfe"], (sp_out.stats, ar_out.stats)
            assert sp_out.stats["tokens_per_forward"] > 1.0


def _wrong_drafts(model, draft_id: int) -> CloverModel:
    """`model` whose denoising forward (block_step; the commit pass, `extend`, is untouched) puts
    +1e4 on `draft_id`: every drafted position is `draft_id`, confidently."""

    class WrongDrafts(CloverModel):
        def block_step(self, *a, **kw):
            out = super().block_step(*a, **kw)
            lg, st = out if isinstance(out, tuple) else (out, None)
            lg = lg + jnp.where(jnp.arange(lg.shape[-1]) == draft_id, 1e4, 0.0)
            return lg if st is None else (lg, st)

    out = WrongDrafts(model.cfg, rngs=nnx.Rngs(0))
    nnx.update(out, nnx.state(model))
    return out


def test_self_speculative_rejections_when_every_draft_is_wrong():
    """Hand count of `rejections`: drafts that are always a token AR greedy never produces are
    wrong at every position, so each verification keeps none of them and fixes one (the AR token at
    the first disagreement): a block with n positions to fill takes n rejected commit passes and a
    final verified one. With first-token commit a generated block start is known (not drafted), so
    a row of MAX_NEW tokens has MAX_NEW - (generated block starts) rejections, commit_passes =
    rejections + blocks, and the output is still AR greedy."""
    _, model, _ = trained()
    ps, k = prompts(), 5
    ar, _ = decode(model, ps, mode="ar", eos_token_ids=())
    draft = min(set(range(3, model.cfg.vocab_size)) - {t for r in ar for t in r} - {model.cfg.mask_token_id})
    sp, out = decode(_wrong_drafts(model, draft), ps, mode="self_speculative", block_size=k, eos_token_ids=())
    assert sp == ar
    for p, g in zip(ps, out.generations):
        starts = int(np.sum((len(p) + np.arange(MAX_NEW)) % k == 0))
        assert g.stats["rejections"] == MAX_NEW - starts, (len(p), g.stats)
        assert g.stats["commit_passes"] == g.stats["rejections"] + g.stats["blocks"], g.stats


def test_eos_stops_and_nothing_after_it():
    """With an EOS id that AR greedy produces mid-way, every mode returns the AR output cut right
    after that token (threshold at block 1, self-speculative at block 5); threshold decoding at
    block 4 stops at its first committed EOS with every position before it filled."""
    model = random_model()
    ps = prompts()
    ar, _ = decode(model, ps, mode="ar", eos_token_ids=())
    eos = ar[0][MAX_NEW // 3]
    want = [r[: r.index(eos) + 1] if eos in r else r for r in ar]
    for kw in ({"mode": "ar"}, {"mode": "threshold", "block_size": 1}, {"mode": "self_speculative", "block_size": 5}):
        got, out = decode(model, ps, eos_token_ids=(eos,), **kw)
        assert got == want, kw
        assert [g.finish_reason for g in out.generations] == ["eos" if eos in r else "length" for r in ar]
    got, out = decode(model, ps, eos_token_ids=(eos,), block_size=4, threshold=0.9)
    mask = trained()[0].mask_token_id
    for p, g in zip(ps, out.generations):
        toks = g.token_ids
        assert mask not in toks and eos not in toks[:-1]
        if g.finish_reason == "eos":  # no block after the one holding the EOS
            assert toks[-1] == eos
            assert g.stats["blocks"] == (len(p) % 4 + len(toks) - 1) // 4 + 1
        else:
            assert len(toks) == MAX_NEW


def test_sub_blocks_commit_in_order():
    """Sub-block decoding: no position of a later sub-block is committed before every position of
    the earlier ones; whole-block decoding at threshold 1 commits one token per step."""
    model = trained()[1]
    ps = prompts()
    _, out = decode(model, ps, block_size=4, sub_block_size=2, threshold=0.9, trace=True)
    lay = make_layout([len(p) for p in ps], 4, MAX_NEW, aligned="grid")
    n_sub = 0
    for g, gen_start in zip(out.generations, lay.gen_start):
        order = np.asarray(g.stats["commit_order"])
        slots = np.arange(gen_start, gen_start + len(order))
        assert np.all(order >= 1)
        for blk in np.unique(slots // 4):
            inside = slots // 4 == blk
            sub, steps = (slots[inside] % 4) // 2, order[inside]
            if len(np.unique(sub)) == 2:
                n_sub += 1
                assert steps[sub == 0].max() <= steps[sub == 1].min()
    assert n_sub > 0
    _, out = decode(model, ps, block_size=4, threshold=1.0, trace=True, first_token_commit=False)
    for g in out.generations:  # one commit per step: no two positions share a step
        order = g.stats["commit_order"]
        assert len(set(order)) == len(order) and g.stats["denoise_steps"] >= len(order)


def test_repetition_penalty_matches_naive_loop():
    """AR decoding with a repetition penalty equals a python loop of full clean forwards with the
    penalty applied by hand; the penalty changes the output (so the check is not vacuous)."""
    model = random_model()
    ps = prompts()[:2]
    pen, n = 1.8, MAX_NEW
    got, _ = decode(model, ps, mode="ar", repetition_penalty=pen, eos_token_ids=())
    plain, _ = decode(model, ps, mode="ar", eos_token_ids=())
    assert got != plain
    width = max(len(p) for p in ps) + n
    fwd = jax.jit(lambda ids: model(ids))
    for p, g in zip(ps, got):
        seq = list(p)
        for _ in range(n):
            buf = np.zeros((1, width), np.int32)
            buf[0, : len(seq)] = seq
            lg = np.asarray(fwd(jnp.asarray(buf)))[0, len(seq) - 1]
            seen = np.zeros(lg.shape, bool)
            seen[seq] = True
            lg = np.where(seen, np.where(lg > 0, lg / pen, lg * pen), lg)
            seq.append(int(lg.argmax()))
        assert g == seq[len(p):]


def test_calibration_overrides():
    cfg, model, _ = trained()
    assert apply_calibration(model) is model
    new = apply_calibration(model, alpha_scale=0.5, beta_shift=1.5, gamma=0.0)
    for j in range(cfg.group_size):
        layer = getattr(model.groups, f"layer_{j}")
        if not hasattr(layer, "gdn"):
            continue
        old = np.asarray(layer.gdn.bd_gdn_softmax_scalars[...])
        got = np.asarray(getattr(new.groups, f"layer_{j}").gdn.bd_gdn_softmax_scalars[...])
        np.testing.assert_allclose(got[..., 0], old[..., 0] * 0.5)
        np.testing.assert_allclose(got[..., 1], old[..., 1] + 1.5)
        np.testing.assert_array_equal(got[..., 2], 0.0)
    # the decoder runs the overridden model (same tokens as decoding the overridden copy), and the
    # override matters (the tokens differ from the learned calibration's)
    ps = prompts()
    a, _ = decode(model, ps, block_size=4, threshold=0.9, beta_shift=8.0)
    b, _ = decode(apply_calibration(model, beta_shift=8.0), ps, block_size=4, threshold=0.9)
    base, _ = decode(model, ps, block_size=4, threshold=0.9)
    assert a == b and a != base


def test_sampled_decoding_is_seeded():
    """Sampling (temperature, top-k, top-p) is reproducible per seed and depends on it; top_k = 1
    leaves one candidate, so sampling then equals greedy decoding."""
    model = trained()[1]
    ps = prompts()
    kw = dict(block_size=4, temperature=1.5, top_k=20, top_p=0.95)
    a, _ = decode(model, ps, seed=1, **kw)
    b, _ = decode(model, ps, seed=1, **kw)
    c, _ = decode(model, ps, seed=2, **kw)
    assert a == b and all(len(r) > 0 for r in a)
    assert a != c
    greedy, _ = decode(model, ps, mode="ar")
    one, _ = decode(model, ps, mode="ar", temperature=0.8, top_k=1, seed=3)
    assert one == greedy
    # in block mode top_k = 1 makes every confidence 1 (> threshold): each block fills in one step
    # (first token waiting: with first-token commit a block whose one needed slot is its first takes none)
    _, out = decode(model, ps, block_size=4, threshold=0.9, temperature=0.8, top_k=1, seed=3,
                    first_token_commit=False)
    assert all(g.stats["denoise_steps"] == g.stats["blocks"] for g in out.generations)


def test_sampling_settings_are_traced_not_compiled_in():
    """README: temperature, top-k, top-p, the threshold, the repetition penalty, first-token commit
    and vocab_limit are run-time inputs of the compiled loops. After one decode, decoding with each
    of them changed compiles nothing (XLA backend compiles, counted), and each change shows in the
    tokens or the step counts; a fresh jit inside the same count does register (the counter counts)."""
    model = trained()[1]
    ps = prompts()
    base, base_out = decode(model, ps, block_size=4)
    top = max(t for r in base for t in r)  # a token the base output uses: vocab_limit=top bans it
    settings = [dict(threshold=0.5), dict(temperature=1.5, top_k=20, top_p=0.95, seed=1),
                dict(repetition_penalty=1.5), dict(first_token_commit=False), dict(vocab_limit=top)]
    steps = lambda out: [g.stats["denoise_steps"] for g in out.generations]  # noqa: E731
    with backend_compiles() as n:
        outs = [decode(model, ps, block_size=4, **kw) for kw in settings]
        after_decodes = n[0]
        jax.jit(lambda x: x * 3 + 1)(jnp.zeros(3))
    assert after_decodes == 0 and n[0] >= 1
    for kw, (toks, out) in zip(settings, outs):
        assert toks != base or steps(out) != steps(base_out), kw


def test_length_bucket_shares_programs_between_nearby_prompt_lengths():
    """`length_bucket` rounds the buffer up so nearby prompt sets share compiled programs: at block
    4 with the default 32 the two shortest held-out prompts (33, 34 tokens) need a 96-slot buffer
    (first block at slot 32) while the test prompts (up to 46) need 128 (slot 64); with 64 both get
    128, so the short set decodes with the programs already compiled for the test prompts (no
    compile). The tokens do not depend on the bucket."""
    _, model, tok = trained()
    ps = prompts()
    short = sorted((tuple(encode_example(tok, r)[0]) for r in eval_records(64)), key=len)[:2]
    assert [len(p) for p in short] == [33, 34] and max(len(p) for p in ps) > 36
    lay = lambda b, x: Decoder(model, dcfg(block_size=4, length_bucket=b)).layout([list(p) for p in x])  # noqa: E731
    assert (lay(32, short).prefill_len, lay(32, short).total_len) == (32, 96)
    assert (lay(32, ps).prefill_len, lay(32, ps).total_len) == (lay(64, short).prefill_len, lay(64, short).total_len) == (64, 128)
    decode(model, ps, block_size=4)  # compiled (shared with test_sampling_settings...)
    with backend_compiles() as n:
        at_64, _ = decode(model, short, block_size=4, length_bucket=64)
    assert n[0] == 0
    at_32, _ = decode(model, short, block_size=4)
    assert at_64 == at_32 and all(len(r) > 0 for r in at_32)


# -- the trained model ----------------------------------------------------------------------------
def test_trained_model_decodes_valid_tool_calls_in_parallel():
    """Block 32, threshold 0.95 on 16 held-out tool-call prompts: most outputs are valid tool calls
    (JSON that parses, names an offered function, has its required arguments), with more than one
    token per forward. (test_calibrate decodes the same set: the two share compiled programs.)"""
    cfg, model, tok = trained()
    recs = tool_call_records(16)
    ps, tools = [], []
    for r in recs:
        p, _, _, t = encode_example(tok, r)
        ps.append(p)
        tools.append(t)
    eos = resolve_eos_ids(DecodeConfig(), cfg, tok)  # <|im_end|>, <|endoftext|>
    assert len(eos) == 2
    out = Decoder(model, dcfg(block_size=32, threshold=0.95), eos_ids=eos).generate(ps)
    texts = [tok.decode([t for t in g.token_ids if t not in eos]) for g in out.generations]
    valid = [tool_call_validity(t, tl, True)["valid"] for t, tl in zip(texts, tools)]
    assert np.mean(valid) > 0.5, (np.mean(valid), texts[:4])
    assert out.stats["tokens_per_forward"] > 1.0, out.stats


# -- bad input ------------------------------------------------------------------------------------
def test_bad_input_errors():
    cfg, model, _ = trained()
    d = Decoder(model, DecodeConfig(max_new_tokens=32))
    with pytest.raises(DecodeError, match="prompt 1 is empty"):
        d.layout([[1, 2, 3], []])
    with pytest.raises(DecodeError, match=r"prompt 0 has 2000 tokens, longer than the model context \(max_position_embeddings = 1024\)"):
        d.layout([[5] * 2000])
    with pytest.raises(DecodeError, match="exceeds the model context"):
        d.layout([[5] * 1000])
    with pytest.raises(DecodeError, match="block_size 32 is larger than decode.max_new_tokens 16"):
        Decoder(model, DecodeConfig(max_new_tokens=16)).layout([[1, 2]])
    with pytest.raises(DecodeError, match="outside the vocabulary"):
        d.layout([[cfg.vocab_size + 3]])
    no_mask = create_model(cfg.replace(mask_token_id=None), 0)
    with pytest.raises(DecodeError, match="no mask token"):
        Decoder(no_mask, DecodeConfig())
    ar_model = create_model(cfg.replace(mode="ar"), 0)
    with pytest.raises(DecodeError, match="mode='ar'"):
        Decoder(ar_model, DecodeConfig())
    Decoder(ar_model, DecodeConfig(mode="ar"))  # the AR baseline works on an AR model
    with pytest.raises(DecodeError, match="decode.threshold"):
        DecodeConfig(threshold=1.5)
    with pytest.raises(DecodeError, match="temperature must be 0 in self_speculative"):
        DecodeConfig(mode="self_speculative", temperature=0.5)
    with pytest.raises(DecodeError, match="decode.mode"):
        DecodeConfig(mode="fast")


def test_coreset_decoding_per_step_equals_recompute_and_first_step_is_wired():
    """A model with the block coreset at its tightest (C = top-k): the cached decoder (per-step
    coresets chosen in `block_step`) commits what the training forward over the whole buffer
    commits (which chooses them in the noisy stream); `coreset: first_step` decodes differently
    (each block keeps its first step's coresets) and not at all on the AR path."""
    base = random_model()
    cfg = base.cfg.replace(moe_block_coreset=base.cfg.num_experts_per_tok)
    model = create_model(cfg, 7)
    model.lm_head.kernel.set_value(model.lm_head.kernel[...] * 30.0)
    ps = prompts()
    kw = dict(block_size=4, threshold=0.9, eos_token_ids=(), trace=True)
    a, a_out = decode(model, ps, **kw)
    b, b_out = decode(model, ps, recompute=True, **kw)
    assert a == b
    assert [g.stats["commit_order"] for g in a_out.generations] == [g.stats["commit_order"] for g in b_out.generations]
    f, _ = decode(model, ps, coreset="first_step", **kw)
    assert f != a
    assert decode(model, ps, mode="ar", eos_token_ids=(), coreset="first_step")[0] == \
        decode(model, ps, mode="ar", eos_token_ids=())[0]


def test_prompt_alignment_pads_prompts_onto_the_grid():
    """`decode.prompt_align` A: each prompt gets pad tokens up to a multiple of lcm(A, block), which
    is decoding the hand-padded prompts without alignment (the oracle); the generation keeps the
    caller's prompt. None takes the checkpoint's `response_block_align`, AR pads to A alone."""
    model = random_model()
    ps = [list(p) for p in prompts()[:2]]
    kw = dict(block_size=4, threshold=0.9, eos_token_ids=())
    pad = Decoder(model, dcfg(**kw)).pad_id
    unit = 8  # lcm(8, 4)
    assert any(len(p) % unit for p in ps), "the prompts must need padding for this test to mean anything"
    padded = [p + [pad] * (-len(p) % unit) for p in ps]
    got, out = decode(model, ps, prompt_align=8, **kw)
    want, _ = decode(model, padded, prompt_align=0, **kw)
    assert got == want and [g.prompt_ids for g in out.generations] == ps
    trained_aligned = nnx.clone(model)
    trained_aligned.cfg = model.cfg.replace(response_block_align=8)
    assert Decoder(trained_aligned, dcfg(block_size=16)).prompt_unit == 16
    assert Decoder(trained_aligned, dcfg(mode="ar")).prompt_unit == 8
    assert Decoder(trained_aligned, dcfg(block_size=16, prompt_align=0)).prompt_unit == 1
    assert Decoder(model, dcfg(block_size=16)).prompt_unit == 1
    with pytest.raises(DecodeError, match="prompt_align"):
        DecodeConfig(prompt_align=-1)
