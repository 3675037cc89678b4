"""Mesh, rule table and sharded model on 8 simulated CPU devices.

The oracle of the sharded runs is the same model on one device (no mesh): logits, loss, every
gradient and the per-expert load statistics must agree to fp32 round-off on four meshes, with a
routing where one expert takes every token and another none."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from clover_jax.parallel import sharding as sh
from clover_jax.config import get_preset
from clover_jax.model.clover_model import abstract_model, create_model, model_from_params, model_to_params, shift_predictions
from tests.model.parity_utils import FAST_COMPILE, FP32_REL, assert_rel_close


def test_mesh_config_fills_and_validates():
    assert sh.MeshConfig().axis_sizes(8) == {"data": 1, "fsdp": 8, "expert": 1, "context": 1, "tensor": 1}
    assert sh.MeshConfig(data=-1, fsdp=2, expert=2).axis_sizes(8)["data"] == 2
    mesh = sh.make_mesh(sh.MeshConfig(data=2, fsdp=2, expert=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 2, "context": 1, "tensor": 1}
    assert mesh.axis_names == sh.MESH_AXES
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        sh.MeshConfig(data=-1).axis_sizes(8)
    with pytest.raises(ValueError, match="do not split"):
        sh.MeshConfig(expert=3).axis_sizes(8)
    with pytest.raises(ValueError, match="dcn_data=3"):
        sh.MeshConfig(data=2, fsdp=-1, dcn_data=3).axis_sizes(8)


@pytest.mark.parametrize("mode", ["ar", "block"])
def test_rule_table_names_every_param_axis(mode):
    """Every logical axis of every param (both modes) has a rule, and a few resolve as docs/design.md 4
    says on a (fsdp=2, expert=2, tensor=2) mesh."""
    model = abstract_model(get_preset("tiny").replace(mode=mode))
    mesh = sh.make_mesh(sh.MeshConfig(fsdp=2, expert=2, tensor=2))
    specs = sh.param_specs(model, mesh)  # raises on an unknown name
    g0, g1 = specs["groups"]["layer_0"], specs["groups"]["layer_1"]
    assert specs["embed"]["embedding"] == P("tensor", "fsdp")
    assert specs["lm_head"]["kernel"] == P("fsdp", "tensor")
    assert g0["moe"]["wi_gate"] == P(None, "expert", "fsdp", "tensor")
    assert g0["moe"]["wo"] == P(None, "expert", "tensor", "fsdp")
    assert g0["moe"]["router"]["kernel"] == P(None, "fsdp", None)
    assert g0["gdn"]["A_log"] == P(None, "tensor")
    assert g1["attn"]["q_proj"]["kernel"] == P(None, "fsdp", "tensor")
    assert g1["attn"]["q_norm"]["scale"] == P(None, None)
    if mode == "block":
        assert g0["gdn"]["bd_gdn_softmax_scalars"] == P(None, "tensor", None)
    # under context parallelism the context axis shards the weights too (FSDP over fsdp x context): a
    # row's shards hold different tokens but would otherwise each hold a whole fsdp shard of the model
    ctx = sh.param_specs(model, sh.make_mesh(sh.MeshConfig(fsdp=2, context=4)))
    assert ctx["embed"]["embedding"] == P(None, ("fsdp", "context"))
    assert ctx["groups"]["layer_1"]["attn"]["q_proj"]["kernel"] == P(None, ("fsdp", "context"), None)


def test_logical_to_spec_fallback_warns_and_never_crashes():
    mesh = sh.make_mesh(sh.MeshConfig(data=2, fsdp=2, expert=2))
    # batch 4 on (data, fsdp, expert) = 8 ways: the longest dividing prefix (data, fsdp), one warning
    # (a rule of its own, so no other test can have spent the once-per-rule warning)
    rules = sh.with_rules(sh.DEFAULT_RULES, batch=("data", "fsdp", "expert", "tensor"))
    with pytest.warns(UserWarning, match="'batch'"):
        assert sh.logical_to_spec(("batch", "length"), rules, mesh, (4, 16)) == P(("data", "fsdp"), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same rule on the same mesh warns only once
        assert sh.logical_to_spec(("batch",), rules, mesh, (6,)) == P("data")
    # nothing divides 3: replicated
    with pytest.warns(UserWarning, match="'embed'.*replication"):
        assert sh.logical_to_spec(("embed",), sh.with_rules(sh.DEFAULT_RULES, embed=("expert",)), mesh, (3,)) == P(None)
    # a mesh axis serves one dimension only: embed (fsdp) loses to batch on an activation
    assert sh.logical_to_spec(("batch", "length", "embed"), sh.DEFAULT_RULES, mesh, (8, 4, 4)) == \
        P(("data", "fsdp", "expert"), None, None)
    with pytest.raises(ValueError, match="no sharding rule for logical axis 'nope'"):
        sh.logical_to_spec(("nope",), sh.DEFAULT_RULES, mesh, (4,), what="param x")


def test_opt_state_mirrors_params_and_constrain_is_scoped():
    model = abstract_model(get_preset("tiny"))
    mesh = sh.make_mesh(sh.MeshConfig(fsdp=2, expert=4))
    shard = sh.param_shardings(model, mesh)
    params = sh.abstract_params(model, mesh)  # ShapeDtypeStructs carrying the shardings
    assert params["groups"]["layer_0"]["moe"]["wi_gate"].sharding == shard["groups"]["layer_0"]["moe"]["wi_gate"]
    opt = jax.eval_shape(optax.adamw(1e-3).init, params)
    osh = sh.opt_state_shardings(opt, params, mesh)
    adam = osh[0]
    assert adam.count.spec == P()
    assert adam.mu["groups"]["layer_0"]["moe"]["wi_gate"] == shard["groups"]["layer_0"]["moe"]["wi_gate"]
    assert adam.nu["embed"]["embedding"].spec == shard["embed"]["embedding"].spec
    x = jnp.ones((8, 4, 64))
    assert sh.constrain(x, ("batch", "length", "act_embed")) is x  # no context: identity
    with sh.use_sharding(mesh):
        y = jax.jit(lambda a: sh.constrain(a * 2, ("batch", "length", "act_embed")))(x)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(("fsdp", "expert"), None, None)), y.ndim)
    assert sh.current() is None


# ---------------------------------------------------------------------------------------------
# sharded model == single device
# The block-diffusion training model (two-stream forward): its clean stream is the AR model (the
# plain `hidden_states` path is sharded in test_multihost and test_aot), its noisy stream the
# block-mode GDN / attention. One compile per mesh covers both.
CFG = get_preset("tiny").replace(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                                 moe_impl="dense", mode="block", block_size=8, mask_token_id=2)
BATCH, LEN = 8, 16


@pytest.fixture(scope="module")
def setup():
    """Randomised params with a skewed router: a constant embedding direction that the router's
    expert 3 column follows and expert 5's opposes, so 3 is in every token's top-2 and 5 in none.
    Rows pack two block-aligned documents; a third of the noisy tokens are masked."""
    model = create_model(CFG, seed=0)
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    nnx.update(model, jax.tree.unflatten(treedef, [l + 0.1 * jax.random.normal(k, l.shape) for l, k in zip(leaves, keys)]))
    params = model_to_params(model)
    params["embed"]["embedding"] = params["embed"]["embedding"].at[:, 0].add(10.0)
    for j in ("layer_0", "layer_1"):
        r = params["groups"][j]["moe"]["router"]["kernel"]
        params["groups"][j]["moe"]["router"]["kernel"] = r.at[:, 0, 3].set(1.0).at[:, 0, 5].set(-1.0)
    rs = np.random.RandomState(0)
    ids = rs.randint(3, CFG.vocab_size, (BATCH, LEN))
    batch = {"ids": jnp.asarray(ids), "noisy": jnp.asarray(np.where(rs.rand(BATCH, LEN) < 0.35, CFG.mask_token_id, ids)),
             "seg": jnp.asarray(np.repeat(np.array([[1] * 8 + [2] * 8]), BATCH, 0))}
    ref = _step(CFG, params, batch)
    counts = np.asarray(ref[0][1][3])
    assert np.all(counts[:, 3] == 2 * BATCH * LEN) and np.all(counts[:, 5] == 0), counts
    return params, batch, ref


def _step(cfg, params, batch, mesh=None):
    """(loss, (AR logits, block logits, lb loss, expert counts [L, E])), grads of next-token CE on the
    clean stream + masked-token CE of the block predictions + 0.01 * lb loss."""
    graphdef, _ = nnx.split(model_from_params(cfg, params))
    bk = cfg.block_sizes[0]

    def loss_fn(p, b):
        model = nnx.merge(graphdef, p)
        h_c, h_n, aux = model.two_stream_hidden(b["ids"], b["noisy"], block_size=bk, segment_ids=b["seg"])
        ar = model.logits(h_c)
        bd = model.logits(shift_predictions(h_c, h_n, b["seg"], bk, cfg.logits_shift))
        nll = lambda lg, t: -jnp.take_along_axis(jax.nn.log_softmax(lg), t[..., None], -1)[..., 0]  # noqa: E731
        masked = (b["noisy"] == cfg.mask_token_id).astype(jnp.float32)
        ce = jnp.mean(nll(ar[:, :-1], b["ids"][:, 1:])) + jnp.sum(nll(bd, b["ids"]) * masked) / jnp.sum(masked)
        return ce + 0.01 * aux["lb_loss"], (ar, bd, aux["lb_loss"], aux["expert_counts"])

    # XLA:CPU's backend at optimisation level 0 (the same HLO, fp32 at HIGHEST) on the reference and every
    # mesh: about half the compile time, which is nearly all of these tests' cost
    fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), compiler_options=FAST_COMPILE)
    if mesh is None:
        return fn(params, batch)
    model = sh.shard_params(model_from_params(cfg, params), mesh)
    wi = model.groups.layer_0.moe.wi_gate[...]
    assert wi.sharding.spec == sh.param_specs(model, mesh)["groups"]["layer_0"]["moe"]["wi_gate"]
    with sh.use_sharding(mesh):
        batch = {k: jax.device_put(v, sh.batch_sharding(mesh, shape=v.shape)) for k, v in batch.items()}
        return fn(model_to_params(model), batch)


#: the q/k-norm scales' gradients (max ~1.2e-4, far below the other leaves' 1e-3..0.4) are sums over
#: every token and head of much larger terms, so their round-off is larger relative to their own
#: scale (measured up to 2.5e-5 on the 4 meshes); 1e-4 of 1.2e-4 is still ~300x tighter than the
#: whole-tree bound (1e-5 * 0.43) that this test used before
NORM_GRAD_REL = 1e-4

MESHES = [
    (dict(fsdp=8), "ragged_a2a"),
    (dict(data=2, fsdp=1, expert=4), "ring"),
    (dict(fsdp=2, expert=2, tensor=2), "ragged_a2a"),
    (dict(data=2, fsdp=2, expert=2), "ring"),
]


@pytest.mark.parametrize("mesh_shape,dispatch", MESHES, ids=lambda v: str(v))
def test_sharded_model_equals_single_device(setup, mesh_shape, dispatch):
    """Tolerance: fp32, 1e-5 of each quantity's max magnitude (FP32_REL), every gradient leaf on its
    own scale (measured: at most 4.4e-6), except the q/k-norm scales' (`NORM_GRAD_REL`)."""
    params, batch, ((ref_loss, (ref_ar, ref_bd, ref_lb, ref_counts)), ref_grads) = setup
    mesh = sh.make_mesh(sh.MeshConfig(**mesh_shape))
    (loss, (ar, bd, lb, counts)), grads = _step(CFG.replace(moe_dispatch=dispatch), params, batch, mesh)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(lb, ref_lb, rtol=1e-5)
    np.testing.assert_array_equal(counts, ref_counts)
    for what, got, want in (("AR logits", ar, ref_ar), ("block logits", bd, ref_bd)):
        assert_rel_close(got, want, FP32_REL, what)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (path, g), r in zip(flat, jax.tree.leaves(ref_grads)):
        name = jax.tree_util.keystr(path)
        assert_rel_close(g, r, NORM_GRAD_REL if re.search(r"\['[qk]_norm'\]", name) else FP32_REL, name)
