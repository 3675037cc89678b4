"""LoRA adapters (clover_jax.model.lora) against independent oracles: the base model (B = 0), the
dense update ``W + (alpha / r) A B`` written out by hand, and the merged params tree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.config import PRESETS
from clover_jax.model import lora
from clover_jax.model.clover_model import create_model, model_from_params, model_to_params
from clover_jax.model.moe import MoE
from clover_jax.model.nn import Dense
from clover_jax.model.params import flatten, unflatten
from clover_jax.parallel import sharding as sh

CFG = PRESETS["tiny"]
RANK, ALPHA = 4, 8.0


def _randomize_adapters(params, seed: int = 1):
    """Every adapter leaf (B included) random, so the update is not zero."""
    flat = flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(flat))
    out = {k: (0.1 * jax.random.normal(kk, v.shape, jnp.float32) if lora.is_adapter(k) else v)
           for kk, (k, v) in zip(keys, flat.items())}
    return unflatten(out)


def test_adapters_sit_on_the_default_targets_with_their_shapes_and_axes():
    model = create_model(CFG.replace(lora_rank=RANK, lora_alpha=ALPHA), 0)
    flat = flatten(model_to_params(model))
    g = CFG.num_groups
    d = CFG.hidden_size
    q = flat["groups.layer_1.attn.q_proj.kernel"]
    assert flat["groups.layer_1.attn.q_proj.lora_a"].shape == (g, d, RANK)
    assert flat["groups.layer_1.attn.q_proj.lora_b"].shape == (g, RANK, q.shape[-1])
    e, i = CFG.num_experts, CFG.moe_intermediate_size
    assert flat["groups.layer_0.moe.wi_gate_lora_a"].shape == (g, e, d, RANK)
    assert flat["groups.layer_0.moe.wo_lora_b"].shape == (g, e, RANK, d)
    assert not any(k.startswith(("embed.", "lm_head.")) and lora.is_adapter(k) for k in flat)
    assert "groups.layer_0.moe.router.lora_a" not in flat  # the router is not a default target
    assert all(flat[k].dtype == jnp.float32 for k in flat if lora.is_adapter(k))
    assert all(not np.any(flat[k]) for k in flat if k.endswith("lora_b"))
    # logical axes: the adapter's outer dims follow its base weight, the rank dim has its own name
    specs = flatten(sh.param_specs(model, jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1, 1),
                                                            sh.MESH_AXES)))
    assert len(specs["groups.layer_0.moe.wi_gate_lora_a"]) == 4
    ax = {p: var.get_metadata()["logical_axes"] for p, var in nnx.iter_graph(model) if isinstance(var, nnx.Param)}
    a_axes = ax[("groups", "layer_0", "moe", "wi_gate_lora_a")]
    assert a_axes == ("layers", "experts", "embed", lora.LORA_RANK_AXIS)
    assert ax[("groups", "layer_1", "attn", "o_proj", "lora_b")] == ("layers", lora.LORA_RANK_AXIS, "embed")


def test_base_weights_are_the_base_models_and_zero_b_changes_no_module_output():
    """B = 0: the adapted model's base params equal the base model's, and every adapted module
    (a Dense, the MoE with merged experts) gives its base module's output bit for bit."""
    base = create_model(CFG, 0)
    model = create_model(CFG.replace(lora_rank=RANK, lora_alpha=ALPHA), 0)
    fb, fl = flatten(model_to_params(base)), flatten(model_to_params(model))
    assert set(fl) - set(fb) == {k for k in fl if lora.is_adapter(k)}
    for k in fb:
        np.testing.assert_array_equal(fb[k], fl[k], err_msg=k)

    x = jax.random.normal(jax.random.key(3), (2, 8, CFG.hidden_size), jnp.float32)
    rngs = nnx.Rngs(0)
    dense = Dense(CFG.hidden_size, 12, ("embed", "mlp"), rngs=rngs)
    ref = jax.jit(lambda m, x: m(x))(dense, x)
    lora.add_adapters(dense, RANK, ALPHA, (r"kernel$",), nnx.Rngs(1))
    np.testing.assert_array_equal(jax.jit(lambda m, x: m(x))(dense, x), ref)

    moe = MoE(CFG, rngs=nnx.Rngs(0))
    ctx = {"valid": jnp.ones(x.shape[:2], bool)}
    ref = jax.jit(lambda m, x: m(x, ctx)[0])(moe, x)
    lora.add_adapters(moe, RANK, ALPHA, (r"(wi_gate|wi_up|wo)$",), nnx.Rngs(1))
    np.testing.assert_array_equal(jax.jit(lambda m, x: m(x, ctx)[0])(moe, x), ref)


def test_the_update_is_alpha_over_r_times_a_b():
    """A Dense with random A, B equals x (W + s A B) written out; an expert stack merges the same."""
    x = jax.random.normal(jax.random.key(3), (5, 16), jnp.float32)
    dense = Dense(16, 12, ("embed", "mlp"), rngs=nnx.Rngs(0))
    lora.add_adapters(dense, RANK, ALPHA, (r"kernel$",), nnx.Rngs(1))
    dense.lora_b[...] = jax.random.normal(jax.random.key(4), dense.lora_b[...].shape)
    w, a, b = (np.asarray(v[...], np.float64) for v in (dense.kernel, dense.lora_a, dense.lora_b))
    want = np.asarray(x, np.float64) @ (w + ALPHA / RANK * a @ b)
    np.testing.assert_allclose(dense(x), want, rtol=1e-5, atol=1e-6)

    moe = MoE(CFG, rngs=nnx.Rngs(0))
    lora.add_adapters(moe, RANK, ALPHA, (r"wo$",), nnx.Rngs(1))
    moe.wo_lora_b[...] = jax.random.normal(jax.random.key(5), moe.wo_lora_b[...].shape)
    w, a, b = (np.asarray(v[...], np.float64) for v in (moe.wo, moe.wo_lora_a, moe.wo_lora_b))
    want = w + ALPHA / RANK * np.einsum("eir,erd->eid", a, b)
    np.testing.assert_allclose(lora.expert_weight(moe, "wo", jnp.float32), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(lora.expert_weight(moe, "wi_gate", jnp.float32), moe.wi_gate[...])


def test_merged_params_give_the_adapted_models_logits():
    """`merge_adapters` (the default export's weights) in the base model = the adapted model (fp32)."""
    lcfg = CFG.replace(lora_rank=RANK, lora_alpha=ALPHA)
    params = _randomize_adapters(model_to_params(create_model(lcfg, 0)))
    ids = jax.random.randint(jax.random.key(0), (2, 16), 0, CFG.vocab_size)
    fwd = nnx.jit(lambda m, ids: m(ids))
    adapted = fwd(model_from_params(lcfg, params), ids)
    merged = fwd(model_from_params(lora.base_config(lcfg), lora.merge_adapters(params, RANK, ALPHA)), ids)
    base = fwd(create_model(CFG, 0), ids)
    assert float(jnp.max(jnp.abs(adapted - base))) > 1e-2  # the adapters change the logits
    np.testing.assert_allclose(merged, adapted, rtol=1e-5, atol=1e-5)


def test_adapter_init_follows_the_path_not_the_order():
    shapes = {"x.q_proj.lora_a": (16, RANK), "x.q_proj.lora_b": (RANK, 8),
              "x.moe.wo_lora_a": (3, 8, RANK), "x.moe.wo_lora_b": (3, RANK, 16), "x.q_proj.kernel": (16, 8)}
    one = lora.init_adapters(shapes, jax.random.key(0))
    two = lora.init_adapters(dict(reversed(list(shapes.items()))), jax.random.key(0))
    assert set(one) == set(shapes) - {"x.q_proj.kernel"}
    for k in one:
        np.testing.assert_array_equal(one[k], two[k])
    assert float(jnp.max(jnp.abs(one["x.q_proj.lora_a"]))) <= 1 / np.sqrt(16)
    assert not np.any(one["x.moe.wo_lora_b"])
    assert lora.base_path("x.moe.wo_lora_b") == "x.moe.wo" and lora.base_path("x.q_proj.lora_a") == "x.q_proj.kernel"


def test_a_target_that_matches_nothing_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"q_projj"):
        create_model(CFG.replace(lora_rank=RANK, lora_targets=(r"\.attn\.q_projj\.kernel$",)), 0)


def test_default_targets_fit_a_stack_without_attention():
    """The defaults name attention projections; an all-GDN model simply has none to adapt."""
    cfg = CFG.replace(num_hidden_layers=2, layer_types=("linear_attention", "linear_attention"),
                      lora_rank=RANK)
    flat = flatten(model_to_params(create_model(cfg, 0)))
    assert "groups.layer_0.gdn.in_proj_q.lora_a" in flat and not any(".attn." in k for k in flat)


def test_dropout_zeroes_the_low_rank_paths_inputs_at_the_rate_and_rescales_the_rest():
    """Dense with W = 0, A = B = I (rank = in): y = s * dropout(x), so on x = 1 every output is 0 or
    s / (1 - p), zero at rate p (a binomial bound over 8192 draws); no key (eval) = no dropout; the
    same key draws the same mask, another key or another projection another."""
    p, n, d = 0.25, 512, 16
    x = jnp.ones((n, d), jnp.float32)

    def identity_adapter(seed: int) -> Dense:
        dense = Dense(d, d, ("embed", "mlp"), rngs=nnx.Rngs(seed))
        lora.add_adapters(dense, d, ALPHA, (r"kernel$",), nnx.Rngs(1), dropout=p)
        dense.kernel[...] = jnp.zeros((d, d))
        dense.lora_a[...], dense.lora_b[...] = jnp.eye(d), jnp.eye(d)
        return dense

    dense = identity_adapter(0)
    s = ALPHA / d
    np.testing.assert_allclose(dense(x), s * np.ones((n, d)), rtol=1e-6)  # no key: no dropout
    key = jax.random.key(7)
    y = np.asarray(dense(x, key))
    kept = np.isclose(y, s / (1 - p), rtol=1e-6)
    assert np.all(kept | (y == 0))
    dropped = 1.0 - kept.mean()
    assert abs(dropped - p) < 4 * np.sqrt(p * (1 - p) / y.size), dropped
    np.testing.assert_array_equal(dense(x, key), y)
    assert np.mean(np.asarray(dense(x, jax.random.key(8))) != y) > 0.2
    other = identity_adapter(0)
    other.lora_id = dense.lora_id + 1  # another projection of the same layer group
    assert np.mean(np.asarray(other(x, key)) != y) > 0.2


def test_model_dropout_acts_in_training_only_and_the_scanned_and_unrolled_stacks_agree():
    """A tiny model with adapter dropout: with a key the noisy stream's hidden states move (against
    the same model without one: evaluation, decoding), the same under the scanned and the
    unrolled layer stack (each layer group slices its own key)."""
    mask, bk = CFG.vocab_size - 1, 4
    lcfg = CFG.replace(lora_rank=RANK, lora_alpha=ALPHA, lora_dropout=0.5, mode="block", mask_token_id=mask,
                       block_size=bk)
    params = _randomize_adapters(model_to_params(create_model(lcfg, 0)))
    ids = jax.random.randint(jax.random.key(0), (2, 16), 0, mask)
    noisy = ids.at[:, 3::4].set(mask)

    def hidden(cfg, key):
        fwd = nnx.jit(lambda m, k: m.two_stream_hidden(ids, noisy, block_size=bk, lora_key=k)[:2])
        return jnp.concatenate(fwd(model_from_params(cfg, params), key), axis=1)

    key = jax.random.key(11)
    dropped = hidden(lcfg, key)
    assert float(jnp.max(jnp.abs(dropped - hidden(lcfg, None)))) > 1e-2
    np.testing.assert_allclose(hidden(lcfg.replace(scan_layers=not lcfg.scan_layers), key), dropped,
                               rtol=1e-5, atol=1e-5)


def test_the_moe_gives_its_shared_experts_adapters_dropout_and_the_routed_experts_none():
    """The routed experts' adapters are merged into their weights, so a dropout key changes nothing
    there (as PEFT's fused-parameter adapters, which refuse dropout); the shared expert's Dense
    adapters take it."""
    x = jax.random.normal(jax.random.key(3), (2, 8, CFG.hidden_size), jnp.float32)

    def moe_out(targets, key):
        moe = MoE(CFG, rngs=nnx.Rngs(0))
        lora.add_adapters(moe, RANK, ALPHA, targets, nnx.Rngs(1), dropout=0.5)
        for name, var in nnx.iter_graph(moe):
            if isinstance(var, nnx.LoRAParam):
                var[...] = 0.1 * jax.random.normal(jax.random.key(len(str(name))), var[...].shape)
        ctx = {"valid": jnp.ones(x.shape[:2], bool)} | ({} if key is None else {"lora_key": key})
        return moe(x, ctx)[0]

    key = jax.random.key(5)
    routed = (r"(wi_gate|wi_up|wo)$",)
    np.testing.assert_array_equal(moe_out(routed, key), moe_out(routed, None))
    shared = (r"shared_(gate|up|down)_proj\.kernel$",)
    assert float(jnp.max(jnp.abs(moe_out(shared, key) - moe_out(shared, None)))) > 1e-3
