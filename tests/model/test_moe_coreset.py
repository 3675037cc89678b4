"""Block coreset routing (clover_jax/model/moe_coreset.py, `ModelConfig.moe_block_coreset`).

References: a numpy oracle written from the rule's words (per (row, block) the C experts of largest
router mass over the block's non-pad tokens, ties to the lower index; each token's top-k inside them),
free routing (C = E must equal it bit for bit), the clean stream (never restricted), every MoE path
against the others, and the one-device run for the expert- and context-parallel meshes. The central
train/decode invariant with the coreset on is in tests/model/test_block_diffusion.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from clover_jax.config import ModelConfigError, get_preset
from clover_jax.model import moe_coreset
from clover_jax.model.clover_model import model_from_params, model_to_params
from clover_jax.model.moe import route
from clover_jax.parallel import sharding as sh
from tests.model.parity_utils import FP32_REL, assert_rel_close
from tests.model.test_block_diffusion import MASK, noised, packed_row, randomised_block_model


def oracle(probs_BTE: np.ndarray, valid_BT: np.ndarray, c: int, block: int, k: int):
    """(coreset sets per (row, block), experts [B, T, k], weights [B, T, k]) by loops."""
    b, t, e = probs_BTE.shape
    experts = np.zeros((b, t, k), np.int64)
    weights = np.zeros((b, t, k))
    cores = {}
    for r in range(b):
        for s0 in range(0, t, block):
            mass = [sum(float(probs_BTE[r, s, x]) for s in range(s0, s0 + block) if valid_BT[r, s]) for x in range(e)]
            core = sorted(range(e), key=lambda x: (-mass[x], x))[:c]
            cores[r, s0 // block] = set(core)
            for s in range(s0, s0 + block):
                top = sorted(core, key=lambda x: (-float(probs_BTE[r, s, x]), x))[:k]
                experts[r, s] = top
                w = np.array([float(probs_BTE[r, s, x]) for x in top])
                weights[r, s] = w / w.sum()
    return cores, experts, weights


@pytest.mark.parametrize("c,block", [(3, 4), (5, 8), (8, 4)])
def test_route_with_coreset_equals_the_oracle(c, block):
    rng = np.random.default_rng(c)
    b, t, e, k = 2, 16, 8, 2
    logits = rng.standard_normal((b, t, e)).astype(np.float32) * 2
    valid = rng.random((b, t)) < 0.8
    probs, w, ex = route(jnp.asarray(logits), k, lambda p: moe_coreset.restrict(p, jnp.asarray(valid), c, block))
    cores, want_e, want_w = oracle(np.asarray(probs), valid, c, block, k)
    np.testing.assert_array_equal(np.asarray(ex), want_e)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-6)
    for (r, blk), core in cores.items():  # every token's experts lie in its block's coreset
        assert set(np.asarray(ex)[r, blk * block:(blk + 1) * block].ravel()) <= core
    np.testing.assert_array_equal(np.asarray(probs), np.asarray(jax.nn.softmax(jnp.asarray(logits), -1)))


def test_ties_go_to_the_lower_expert_and_pads_carry_no_mass():
    e = 6
    probs = np.full((1, 4, e), 1.0 / e, np.float32)  # every mass equal: experts 0, 1, 2
    valid = np.ones((1, 4), bool)
    allowed = np.asarray(moe_coreset.restrict(jnp.asarray(probs), jnp.asarray(valid), 3, 4))
    assert (allowed == (np.arange(e) < 3)).all()
    # a pad token that puts all its mass on expert 5 changes nothing; the same token as real does
    probs[0, 3] = np.eye(e)[5]
    valid[0, 3] = False
    assert (np.asarray(moe_coreset.restrict(jnp.asarray(probs), jnp.asarray(valid), 3, 4))[0, 0] == (np.arange(e) < 3)).all()
    valid[0, 3] = True
    assert np.asarray(moe_coreset.restrict(jnp.asarray(probs), jnp.asarray(valid), 3, 4))[0, 0, 5]


def test_coreset_setting_is_validated_with_its_name():
    cfg = get_preset("tiny")
    with pytest.raises(ModelConfigError, match=r"moe_block_coreset 1 must be null or in \[num_experts_per_tok=2, num_experts=8\]"):
        cfg.replace(moe_block_coreset=1)
    with pytest.raises(ValueError, match=r"do not hold whole blocks of 4"):
        moe_coreset.blocks_of(jnp.zeros((1, 12)), 4, pieces=2)


def _batch(t: int = 32, block: int = 4):
    rng = np.random.default_rng(7)
    rows = [packed_row(rng, t, block, lens) for lens in ([10, 13], [29])]
    ids, seg = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    return ids, noised(rng, ids, seg), seg


def _streams(c, **overrides):
    _, model = randomised_block_model(0, moe_block_coreset=c, **overrides)
    ids, noisy, seg = _batch()
    return jax.jit(lambda: model.two_stream_hidden(ids, noisy, block_size=4, segment_ids=seg))()


def test_c_equal_to_the_experts_is_free_routing_bit_for_bit_and_the_clean_stream_is_never_restricted():
    free_c, free_n, free_aux = _streams(None)
    all_c, all_n, all_aux = _streams(8)
    assert np.asarray(all_n).tobytes() == np.asarray(free_n).tobytes()
    assert np.asarray(all_aux["expert_counts"]).tobytes() == np.asarray(free_aux["expert_counts"]).tobytes()
    small_c, small_n, small_aux = _streams(2)
    assert np.asarray(small_c).tobytes() == np.asarray(free_c).tobytes()  # the clean stream routes freely
    assert not np.allclose(np.asarray(small_n), np.asarray(free_n), atol=1e-3)  # the noisy stream does not
    # a coreset of 2 in 8 experts concentrates the noisy tokens' load
    assert float(jnp.max(small_aux["expert_counts"])) > float(jnp.max(free_aux["expert_counts"]))


@pytest.mark.parametrize("impl", ["blocked", "ragged", "dense"])
def test_every_moe_path_routes_inside_the_coreset(impl):
    want_c, want_n, _ = _streams(3, moe_impl="capacity")
    got_c, got_n, _ = _streams(3, moe_impl=impl)
    assert_rel_close(np.asarray(got_n), np.asarray(want_n), FP32_REL, f"{impl} noisy")
    assert_rel_close(np.asarray(got_c), np.asarray(want_c), FP32_REL, f"{impl} clean")


@pytest.mark.parametrize("mesh_shape,layout", [
    (dict(fsdp=2, expert=4), "contiguous"),              # expert parallel: the ragged all-to-all dispatch
    (dict(fsdp=2, expert=2, context=2), "zigzag"),       # context pieces of 8 tokens: two blocks each
], ids=str)
def test_coreset_under_expert_and_context_parallelism_equals_one_device(mesh_shape, layout):
    cfg, model = randomised_block_model(0, moe_block_coreset=3, context_layout=layout)
    ids, noisy, seg = _batch()

    want_c, want_n, _ = jax.jit(lambda: model.two_stream_hidden(ids, noisy, block_size=4, segment_ids=seg))()
    mesh = sh.make_mesh(sh.MeshConfig(**mesh_shape))
    sharded = sh.shard_params(model_from_params(cfg, model_to_params(model)), mesh)
    spec = sh.batch_sharding(mesh, shape=ids.shape).spec
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(*spec)))  # noqa: E731
    with sh.use_sharding(mesh):
        got_c, got_n, _ = jax.jit(lambda i, n, s: sharded.two_stream_hidden(i, n, block_size=4, segment_ids=s))(
            put(ids), put(noisy), put(seg))
    assert_rel_close(np.asarray(got_n), np.asarray(want_n), FP32_REL, "noisy")
    assert_rel_close(np.asarray(got_c), np.asarray(want_c), FP32_REL, "clean")


def test_block_step_with_a_given_coreset_routes_inside_it():
    """`block_step(coreset=..., use_coreset=...)` (decoding's `coreset: first_step`): the canvas' own
    coresets given back change nothing; another canvas' replace them (the stats say so, and every
    routed assignment lies inside them); `use_coreset=False` ignores them."""
    cfg, model = randomised_block_model(0, moe_block_coreset=3)
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 200, (2, 12)).astype(np.int32)
    _, cache = model.extend(jnp.asarray(ids[:, :4]), model.init_cache(2, 12))
    first, later = ids[:, 4:8].copy(), ids[:, 4:8].copy()
    first[:, 1:], later[:, 3:] = MASK, MASK
    step = jax.jit(lambda c, core, use: model.block_step(c, cache, return_stats=True, coreset=core, use_coreset=use))
    _, own_first = model.block_step(jnp.asarray(first), cache, return_stats=True)
    want, own = model.block_step(jnp.asarray(later), cache, return_stats=True)
    assert own["coreset"].shape == (cfg.num_groups, cfg.group_size, 2, 3)
    same, st = step(jnp.asarray(later), own["coreset"], True)
    assert np.asarray(same).tobytes() == np.asarray(want).tobytes()
    got, st = step(jnp.asarray(later), own_first["coreset"], True)
    np.testing.assert_array_equal(np.asarray(st["coreset"]), np.asarray(own_first["coreset"]))
    assert not np.allclose(np.asarray(got), np.asarray(want), atol=1e-3)
    # row 0 alone (batch 1, so the counts are its own): every assignment inside its given coresets
    _, cache0 = model.extend(jnp.asarray(ids[:1, :4]), model.init_cache(1, 12))
    _, st0 = model.block_step(jnp.asarray(later[:1]), cache0, return_stats=True,
                              coreset=own_first["coreset"][:, :, :1])
    counts = np.asarray(st0["expert_counts"]).reshape(cfg.num_groups, cfg.group_size, -1)
    core = np.asarray(own_first["coreset"])[:, :, 0]
    for g in range(cfg.num_groups):
        for j in range(cfg.group_size):
            assert counts[g, j].sum() > 0 and set(np.flatnonzero(counts[g, j])) <= set(core[g, j]), (g, j)
    ignored, _ = step(jnp.asarray(later), own_first["coreset"], False)
    assert np.asarray(ignored).tobytes() == np.asarray(want).tobytes()
