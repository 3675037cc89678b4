"""Block-diffusion model (docs/design.md 3.1, 3.2): two-stream forward vs decode-side block steps, no-leak
by perturbation, the mask predicate vs brute force, the logit shift, gradients to the Clover params.

Reference points are independent of the code under test: the decode path (caches + block steps +
commit passes) for the training forward, python loops for the mask, the AR forward for the clean
stream, and perturbation properties for leaks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.model.attention import two_stream_mask
from clover_jax.config import get_preset
from clover_jax.model.clover_model import check_block_aligned, create_model, document_positions, shift_predictions
from tests.model.parity_utils import FAST_COMPILE, FP32_REL, assert_rel_close

MASK = 255
#: every program here runs a few times on tiny shapes: XLA:CPU's backend at optimisation level 0
#: (the same HLO, fp32 at HIGHEST) halves their compile time, which is nearly all of this file's cost
jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)


def randomised_block_model(seed: int = 0, **overrides):
    """tiny preset in block mode with EVERY parameter perturbed (norm scales, calibration scalars
    and right-conv taps included), so init values cannot hide a bug."""
    cfg = get_preset("tiny").replace(**({"mode": "block", "mask_token_id": MASK} | overrides))
    model = create_model(cfg, seed)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    key = jax.random.PRNGKey(seed + 100)
    for path, var in flat:
        key, sub = jax.random.split(key)
        noise = jax.random.normal(sub, var[...].shape, jnp.float32)
        scale = 0.3 if path[-1] in ("scale", "bd_gdn_softmax_scalars", "right") else 0.01
        var.set_value((var[...].astype(jnp.float32) + scale * noise).astype(var[...].dtype))
    nnx.update(model, nnx.from_flat_state(flat))
    return cfg, model


def packed_row(rng: np.random.Generator, t: int, block: int, doc_lens: list[int]):
    """One block-aligned packed row: documents at multiples of `block`, pads (id 0, segment 0) between."""
    ids = np.zeros(t, np.int32)
    seg = np.zeros(t, np.int32)
    at = 0
    for d, n in enumerate(doc_lens, start=1):
        assert at + n <= t
        ids[at:at + n] = rng.integers(2, MASK, n)
        seg[at:at + n] = d
        at = -(-(at + n) // block) * block
    return ids, seg


def noised(rng: np.random.Generator, ids: np.ndarray, seg: np.ndarray, p: float = 0.5) -> np.ndarray:
    noisy = np.where((rng.random(ids.shape) < p) & (seg > 0), MASK, ids)
    return noisy.astype(np.int32)


@functools.lru_cache(maxsize=None)
def _model(logits_shift: bool = True, coreset: int | None = None):
    return randomised_block_model(0, logits_shift=logits_shift, moe_block_coreset=coreset)


@functools.lru_cache(maxsize=None)
def _jitted(logits_shift: bool, block: int, coreset: int | None = None):
    """jit'ed training forward, block step and commit pass of the shared model for one block size."""
    _, model = _model(logits_shift, coreset)
    train = jit(lambda i, n, s: model.block_logits(i, n, block_size=block, segment_ids=s))
    step = jit(lambda c, cache, s: model.block_step(c, cache, segment_ids=s))
    commit = jit(lambda i, cache, s: model.extend(i, cache, segment_ids=s)[1])
    return model, train, step, commit


LAYOUTS = {  # block size -> (row length, document lengths): one layout per block size, two rows
    1: (24, [[9, 15], [24]]),
    4: (32, [[10, 13], [29]]),
    5: (40, [[12, 23], [37]]),   # 5 divides neither 12, 23 nor 37
    32: (96, [[40, 32], [90]]),
}


@pytest.mark.parametrize("block,logits_shift,coreset", [
    (1, True, None), (4, True, None), (5, True, None), (32, True, None), (4, False, None),
    (4, True, 3), (32, True, 2),  # block coreset routing (moe_coreset): 3 / 2 of the 8 experts per block
])
def test_two_stream_equals_block_steps_on_caches(block, logits_shift, coreset):
    """The central invariant: every block's noisy logits in the training forward equal the block-step
    logits of the same canvas against caches built by commit passes, for EVERY block of each row
    (the first, which has no history, included). fp32 criterion: max|diff| <= FP32_REL * max|ref|
    over the real (non-pad) positions. The readout both paths share (`block_readout_ref`) has its
    own float64 oracle: tests/kernels/gdn/test_block_reference.py."""
    model, train, step, commit = _jitted(logits_shift, block, coreset)
    t, layouts = LAYOUTS[block]
    rng = np.random.default_rng(block)
    rows = [packed_row(rng, t, block, lens) for lens in layouts]
    ids = np.stack([r[0] for r in rows])
    seg = np.stack([r[1] for r in rows])
    check_block_aligned(seg, block)
    noisy = noised(rng, ids, seg)
    want = np.asarray(train(ids, noisy, seg))
    # per block from an empty cache: block step, then commit
    cache = model.init_cache(2, t)
    got = np.zeros_like(want)
    for s0 in range(0, t, block):
        sl = slice(s0, s0 + block)
        got[:, sl] = np.asarray(step(noisy[:, sl], cache, seg[:, sl]))
        cache = commit(ids[:, sl], cache, seg[:, sl])
    valid = seg > 0
    assert_rel_close(got[valid], want[valid], FP32_REL, f"block {block}: train/decode")


def test_no_leak_by_perturbation():
    """Block b's noisy logits are unchanged bit for bit by any change after the block (clean or
    noisy), to a noisy token of another block, or to another packed document; a clean token before
    the block changes them."""
    block, t = 4, 32
    _, train, _, _ = _jitted(True, block)
    rng = np.random.default_rng(7)
    ids, seg = packed_row(rng, t, block, [18, 10])  # doc 1: slots 0..17, doc 2: slots 20..29
    ids, seg = ids[None], seg[None]
    noisy = noised(rng, ids, seg)
    b0, b1 = 8, 12  # block b = slots 8..11 of document 1
    base = np.asarray(train(ids, noisy, seg))[0, b0:b1]

    def changed(where: str, slot: int) -> bool:
        i, n = ids.copy(), noisy.copy()
        arr = i if where == "clean" else n
        arr[0, slot] = (arr[0, slot] + 17) % (MASK - 2) + 2
        return not np.array_equal(np.asarray(train(i, n, seg))[0, b0:b1], base)

    for where, slot in [("clean", 12), ("clean", 17), ("noisy", 13), ("noisy", 4), ("noisy", 0),
                        ("clean", 21), ("noisy", 21), ("clean", 29)]:
        assert not changed(where, slot), f"changing the {where} token at slot {slot} leaked into block 8..11"
    for slot in (2, 7):
        assert changed("clean", slot), f"block 8..11 ignores the clean token at slot {slot}"
    assert changed("noisy", 9), "block 8..11 ignores its own noisy tokens"


def test_clean_stream_equals_ar_forward():
    cfg, model = _model(True)
    rng = np.random.default_rng(3)
    ids, seg = packed_row(rng, 32, 4, [13, 16])
    ids, seg = ids[None], seg[None]
    noisy = noised(rng, ids, seg)
    h_clean, _, aux = jit(lambda i, n, s: model.two_stream_hidden(i, n, block_size=4, segment_ids=s))(
        ids, noisy, seg)
    ar = jit(lambda i, s: model(i, segment_ids=s))(ids, seg)
    got = np.asarray(model.logits(h_clean))
    assert_rel_close(got, np.asarray(ar), FP32_REL, "clean stream vs AR forward")
    # the load statistics count both streams' real tokens, pads excluded
    counts = np.asarray(aux["expert_counts"])
    assert counts.shape == (cfg.num_hidden_layers, cfg.num_experts)
    assert np.all(counts.sum(-1) == 2 * int((seg > 0).sum()) * cfg.num_experts_per_tok)


def brute_force_two_stream_mask(seg: np.ndarray, block: int) -> np.ndarray:
    """[2T, 2T] from the rules of docs/design.md 3.1 stated one pair at a time."""
    t = len(seg)
    out = np.zeros((2 * t, 2 * t), bool)
    for qi in range(2 * t):
        for ki in range(2 * t):
            q, k = qi % t, ki % t
            if seg[q] != seg[k]:
                continue
            if qi < t:  # clean query: causal over clean keys, never noisy ones
                out[qi, ki] = ki < t and k <= q
            elif ki < t:  # noisy query, clean key: strictly before the query's block
                out[qi, ki] = k < (q // block) * block
            else:  # noisy query, noisy key: the same block
                out[qi, ki] = k // block == q // block
    return out


def test_mask_predicate_matches_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(6):
        block = [1, 3, 4, 8][trial % 4]
        t = block * int(rng.integers(2, 5))
        seg = np.sort(rng.integers(0, 4, t)).astype(np.int32)  # runs of ids, pads (0) included
        rng.shuffle(seg[: t // 2])  # and some interleaving
        got = np.asarray(two_stream_mask(jnp.asarray(seg[None]), block))[0]
        np.testing.assert_array_equal(got, brute_force_two_stream_mask(seg, block))


def test_shift_predictions_rule():
    """p = block start reads the clean stream at p-1, later positions the noisy stream at p-1, a
    document's first position reads nothing; without the shift p reads the noisy stream at p."""
    t, d, block = 8, 2, 4
    h_c = np.arange(t * d, dtype=np.float32).reshape(1, t, d) + 1
    h_n = -h_c
    seg = np.array([[1, 1, 1, 1, 1, 1, 2, 2]])
    got = np.asarray(shift_predictions(jnp.asarray(h_c), jnp.asarray(h_n), jnp.asarray(seg), block, True))[0]
    want = np.stack([np.zeros(d), h_n[0, 0], h_n[0, 1], h_n[0, 2], h_c[0, 3], h_n[0, 4], np.zeros(d), h_n[0, 6]])
    np.testing.assert_array_equal(got, want)
    got = np.asarray(shift_predictions(jnp.asarray(h_c), jnp.asarray(h_n), jnp.asarray(seg), block, False))
    np.testing.assert_array_equal(got, h_n)


def test_gradients_reach_clover_parameters():
    """One backward of a masked-position loss gives non-zero gradients to the calibration scalars
    and the right-conv taps of every GDN layer (from their init values: zero right taps included)."""
    cfg = get_preset("tiny").replace(mode="block", mask_token_id=MASK)
    model = create_model(cfg, 1)
    rng = np.random.default_rng(1)
    ids, seg = packed_row(rng, 16, 4, [16])
    noisy = noised(rng, ids[None], seg[None], 0.6)
    target = ids[None]
    masked = jnp.asarray(noisy == MASK)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p):
        m = nnx.merge(graphdef, p)
        logits = m.block_logits(jnp.asarray(target), jnp.asarray(noisy), block_size=4)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(target)[..., None], -1)[..., 0]
        return jnp.sum(jnp.where(masked, nll, 0.0)) / jnp.sum(masked)

    grads = nnx.to_flat_state(jit(jax.grad(loss))(params))  # one program (op by op: a compile per op)
    seen = 0
    for path, g in grads:
        if path[-1] in ("bd_gdn_softmax_scalars", "right"):
            per_layer = np.abs(np.asarray(g[...])).reshape(g[...].shape[0], -1).max(axis=1)
            assert np.all(per_layer > 0), f"{'.'.join(map(str, path))}: zero gradient in some layer"
            seen += 1
    assert seen == 4 * (cfg.group_size - sum(t == "full_attention" for t in cfg.layer_types[: cfg.group_size]))


def test_check_block_aligned_and_errors():
    check_block_aligned(np.array([[1, 1, 0, 0, 2, 2, 2, 0]]), 4)
    with pytest.raises(ValueError, match="row 0: document 2 starts at slot 3"):
        check_block_aligned(np.array([[1, 1, 1, 2, 2, 2, 0, 0]]), 4)
    with pytest.raises(ValueError, match="multiple of block_size"):
        check_block_aligned(np.ones((1, 6), int), 4)
    _, model = _model(True)
    ids = jnp.ones((1, 6), jnp.int32)
    with pytest.raises(ValueError, match="not a multiple of block_size 4"):
        model.two_stream_hidden(ids, ids, block_size=4)
    ar = create_model(get_preset("tiny"), 0)
    with pytest.raises(ValueError, match="mode='ar'"):
        ar.block_step(ids[:, :4], ar.init_cache(1, 8))


def test_default_positions_restart_per_document():
    seg = jnp.asarray([[1, 1, 1, 0, 2, 2]])
    np.testing.assert_array_equal(np.asarray(document_positions(seg)), [[0, 1, 2, 0, 0, 1]])


def test_block_step_history_share_follows_the_calibration_logit():
    """The reported history-unit share is a probability per GDN layer: 0 on a fresh document (no
    history), near 1 when beta makes the history logit dominate, near 0 when it is very negative. Per
    position inside the block: sums over the rows where the position is a real token (a pad position
    counts no token and adds nothing), whose token-weighted mean is the layer's share."""
    cfg = get_preset("tiny").replace(mode="block", mask_token_id=MASK)
    model = create_model(cfg, 2)
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jnp.asarray(np.random.default_rng(5).integers(2, MASK, (1, 8)), jnp.int32)

    @jit
    def shares(p):
        m = nnx.merge(graphdef, p)
        _, cache = m.extend(ids[:, :4], m.init_cache(1, 8))
        fresh = m.block_step(ids[:, :4], m.init_cache(1, 8), return_stats=True)[1]["history_share"]
        return fresh, m.block_step(ids[:, 4:].at[:, 1:].set(MASK), cache, return_stats=True)[1]["history_share"]

    @jit
    def by_position(p):  # two rows, the second's last canvas position a pad
        m = nnx.merge(graphdef, p)
        ids2 = jnp.concatenate([ids, ids[:, ::-1]])
        seg = jnp.asarray([[1] * 8, [1] * 7 + [0]], jnp.int32)
        _, cache = m.extend(ids2[:, :4], m.init_cache(2, 8), segment_ids=seg[:, :4])
        return m.block_step(ids2[:, 4:].at[:, 1:].set(MASK), cache, segment_ids=seg[:, 4:], return_stats=True)[1]

    def with_beta(beta):
        flat = nnx.to_flat_state(params)
        for path, var in flat:
            if path[-1] == "bd_gdn_softmax_scalars":
                var.set_value(var[...].at[..., 1].set(beta))
        return nnx.from_flat_state(flat)

    n_gdn = sum(t != "full_attention" for t in cfg.layer_types)
    fresh, mid = (np.asarray(a) for a in shares(with_beta(0.0)))
    assert fresh.shape == (n_gdn,) and np.all(fresh == 0.0)
    assert np.all((mid > 0) & (mid < 1))
    assert np.all(np.asarray(shares(with_beta(30.0))[1]) > 0.999)
    assert np.all(np.asarray(shares(with_beta(-30.0))[1]) < 1e-6)
    for beta in (0.0, 30.0):
        st = {k: np.asarray(v) for k, v in by_position(with_beta(beta)).items()}
        np.testing.assert_array_equal(st["history_tokens"], [2, 2, 2, 1])
        assert st["history_share_sum"].shape == (n_gdn, 4)
        per_k = st["history_share_sum"] / st["history_tokens"]
        assert np.all((per_k > 0) & (per_k <= 1.0 + 1e-6))
        if beta == 30.0:
            assert np.all(per_k > 0.999)
        np.testing.assert_allclose(st["history_share"], st["history_share_sum"].sum(1) / 7, rtol=1e-6)


def test_qwen_checkpoint_in_block_mode_reproduces_hf_on_the_clean_stream(tmp_path):
    """A randomised HF Qwen3.6 checkpoint loaded in block mode (Clover params at their init values)
    gives the HF logits on the clean stream of the two-stream forward."""
    from tests.hf_fixtures import hf_logits, make_hf_model, write_save_pretrained

    import clover_jax

    hf = make_hf_model(seed=3)
    cfg, model = clover_jax.load_hf(write_save_pretrained(hf, tmp_path / "hf"), mode="block")
    assert cfg.mode == "block"
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (2, 16)).astype(np.int32)
    noisy = np.where(rng.random(ids.shape) < 0.5, 3, ids).astype(np.int32)
    h_clean, _, _ = jit(lambda i, n: model.two_stream_hidden(i, n, block_size=4))(ids, noisy)
    # the fp32 HF parity criterion of tests/model/test_parity_hf.py (REL)
    assert_rel_close(np.asarray(model.logits(h_clean)), hf_logits(hf, ids), 2e-5, "block-mode clean stream vs HF")


@pytest.mark.parametrize("mode", ["ar", "block"])
def test_pallas_backend_equals_reference_in_the_model(mode):
    """`gdn_backend: pallas` (the Pallas kernels, interpreted on CPU) gives the reference backend's
    logits in AR mode and in the two-stream block mode, on a packed row of two documents with pads,
    so the wiring (segment resets, block grid, calibration scalars) is exercised; the kernels'
    gradients against the reference are tests/kernels/gdn/test_causal_op.py and gdn/test_block_op.py."""
    cfg_ref, model_ref = randomised_block_model(3, mode=mode, gdn_backend="reference")
    model_pl = create_model(cfg_ref.replace(gdn_backend="pallas"), 3)
    nnx.update(model_pl, nnx.state(model_ref, nnx.Param))
    rng = np.random.default_rng(3)
    ids, seg = packed_row(rng, 16, 4, [7, 6])
    noisy = noised(rng, ids[None], seg[None], 0.5)
    ids, seg, noisy = jnp.asarray(ids[None]), jnp.asarray(seg[None]), jnp.asarray(noisy)
    out = []
    for model in (model_ref, model_pl):
        if mode == "block":
            fwd = jit(lambda i, n, s, m=model: m.block_logits(i, n, block_size=4, segment_ids=s))
        else:
            fwd = jit(lambda i, n, s, m=model: m(i, segment_ids=s))
        out.append(np.asarray(fwd(ids, noisy, seg)))
    ref, got = out
    keep = np.asarray(seg[0] > 0)
    assert_rel_close(got[0, keep], ref[0, keep], FP32_REL, f"{mode}: pallas vs reference backend")
