"""The `context` mesh axis (clover_jax/parallel/context.py, the `length -> context` rule of
parallel/sharding.py): rows split into contiguous shards, the split's validation names the keys, and
the whole model with its rows sharded over `context` equals the one-device run (and compiles for TPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.config import get_preset
from clover_jax.model.clover_model import create_model, model_from_params, model_to_params, shift_predictions
from clover_jax.parallel import sharding as sh
from clover_jax.parallel.context import check_context_split
from tests.model.parity_utils import FP32_REL, assert_rel_close


def test_length_rule_shards_rows_into_contiguous_pieces():
    mesh = sh.make_mesh(sh.MeshConfig(fsdp=2, context=4))
    assert dict(mesh.shape)["context"] == 4
    spec = sh.logical_to_spec(("batch", "length", "act_embed"), sh.DEFAULT_RULES, mesh, (2, 32, 8))
    assert spec == jax.sharding.PartitionSpec("fsdp", "context", None)
    x = np.arange(2 * 32).reshape(2, 32)
    arr = jax.device_put(x, sh.batch_sharding(mesh, shape=x.shape))
    # each device holds one row's contiguous slice of 32 / 4 = 8 tokens, in row order along the axis
    for shard in arr.addressable_shards:
        rows, cols = shard.index
        assert cols.stop - cols.start == 8
        np.testing.assert_array_equal(np.asarray(shard.data), x[rows, cols])
    ctx_of = {dev: idx[sh.MESH_AXES.index("context")] for idx, dev in np.ndenumerate(mesh.devices)}
    for shard in arr.addressable_shards:
        assert shard.index[1].start == 8 * ctx_of[shard.device]


def test_context_split_validation_names_the_keys():
    assert check_context_split(32768, 8, (4, 32), 64, 4) == 4096
    assert check_context_split(100, 1, (32,), 64, 4) == 100  # no split: nothing to check
    with pytest.raises(ValueError, match=r"data.seq_len=100 does not split into mesh.context=8"):
        check_context_split(100, 8)
    with pytest.raises(ValueError, match=r"model.block_size=32"):
        check_context_split(64 * 3, 4, (4, 32))
    with pytest.raises(ValueError, match=r"model.gdn_chunk_size=64"):
        check_context_split(32 * 4, 4, (32,), 64)
    with pytest.raises(ValueError, match=r"linear_conv_kernel_dim"):
        check_context_split(8, 4, (1,), 1, 4)
    with pytest.raises(ValueError, match=r"mesh.context must be >= 1"):
        check_context_split(8, 0)


# ---------------------------------------------------------------------------------------------
# the whole model with the row's sequence sharded over `context` equals the one-device run

CFG = get_preset("tiny").replace(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                                 moe_impl="dense", mode="block", block_size=4, mask_token_id=2, gdn_chunk_size=4)


def _params(seed: int = 0):
    """Every parameter randomised (norms, zero-init right conv taps and bd scalars included)."""
    model = create_model(CFG, seed=seed)
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    nnx.update(model, jax.tree.unflatten(treedef, [l + 0.1 * jax.random.normal(k, l.shape) for l, k in zip(leaves, keys)]))
    return model_to_params(model)


def _batch(length: int, block: int, seed: int = 0):
    """4 rows: documents on the block grid that cross shard boundaries, pads (segment 0) between and
    after documents, a document starting exactly at a shard boundary (slot length / 2), a reused id;
    a third of the noisy tokens masked."""
    rs = np.random.RandomState(seed)
    h = length // 2
    seg = np.ones((4, length), np.int32)
    seg[0, :block * 3], seg[0, block * 3:h + block], seg[0, h + block:] = 1, 2, 0  # 2 crosses the middle
    seg[1, :h], seg[1, h:] = 3, 4  # a document starting at the middle (a shard boundary)
    seg[2, :block], seg[2, block:2 * block], seg[2, 2 * block:] = 1, 0, 1  # pad run, then id 1 again
    ids = rs.randint(3, CFG.vocab_size, seg.shape)
    noisy = np.where(rs.rand(*seg.shape) < 0.35, CFG.mask_token_id, ids)
    return {"ids": jnp.asarray(ids), "noisy": jnp.asarray(noisy), "seg": jnp.asarray(seg)}


def _step(params, batch, block: int, mesh=None):
    """(loss, (AR logits of the plain forward, block logits)), grads of next-token CE on the clean
    stream + masked-token CE of the block predictions + 0.01 * lb loss."""
    graphdef, _ = nnx.split(model_from_params(CFG, params))

    def loss_fn(p, b):
        model = nnx.merge(graphdef, p)
        h_c, h_n, aux = model.two_stream_hidden(b["ids"], b["noisy"], block_size=block, segment_ids=b["seg"])
        bd = model.logits(shift_predictions(h_c, h_n, b["seg"], block, CFG.logits_shift))
        ar = model(b["ids"], segment_ids=b["seg"])  # the AR (clean) forward on its own
        nll = lambda lg, t: -jnp.take_along_axis(jax.nn.log_softmax(lg), t[..., None], -1)[..., 0]  # noqa: E731
        masked = (b["noisy"] == CFG.mask_token_id).astype(jnp.float32)
        ce = jnp.mean(nll(model.logits(h_c)[:, :-1], b["ids"][:, 1:])) + jnp.sum(nll(bd, b["ids"]) * masked) / jnp.sum(masked)
        return ce + 0.01 * aux["lb_loss"], (ar, bd)

    fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    if mesh is None:
        return fn(params, batch)
    model = sh.shard_params(model_from_params(CFG, params), mesh)
    with sh.use_sharding(mesh):
        batch = {k: jax.device_put(v, sh.batch_sharding(mesh, shape=v.shape)) for k, v in batch.items()}
        assert batch["ids"].sharding.spec[1] == "context"
        return fn(model_to_params(model), batch)


@pytest.mark.parametrize("mesh_shape,length,block", [
    (dict(fsdp=2, context=4), 32, 4),
    (dict(fsdp=2, expert=2, context=2), 64, 32),
], ids=lambda v: str(v))
def test_model_with_context_equals_single_device(mesh_shape, length, block):
    """Loss, AR logits, block logits and every gradient: fp32, 1e-5 of the reference's max magnitude
    (gradients: of the whole tree's, as in test_sharding)."""
    params, batch = _params(), _batch(length, block)
    (ref_loss, (ref_ar, ref_bd)), ref_grads = _step(params, batch, block)
    (loss, (ar, bd)), grads = _step(params, batch, block, sh.make_mesh(sh.MeshConfig(**mesh_shape)))
    assert_rel_close(loss, ref_loss, FP32_REL, "loss")
    assert_rel_close(ar, ref_ar, FP32_REL, "AR logits")
    assert_rel_close(bd, ref_bd, FP32_REL, "block logits")
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref_grads))
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (path, g), r in zip(flat, jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=0, atol=FP32_REL * scale, err_msg=jax.tree_util.keystr(path))


def test_sft_step_with_context_compiles_for_tpu():
    """TPU AOT (libtpu on this CPU host) of the recipe's SFT step at small widths on v5p-8 with
    (fsdp 2, context 2): it compiles and fits, and the program holds the context exchanges (the
    conv halo and entry-segment `ppermute`s, the K/V and shard-map all-gathers). About 4 min on 2 cores."""
    import launch

    recipe = ["model.preset=small-cpu", "model.num_hidden_layers=2", "model.layer_types=[linear_attention,full_attention]",
              "data.seq_len=128", "data.batch_size=4", "train.micro_batches=1", "mesh.fsdp=2", "mesh.expert=1",
              "mesh.context=2", "loss.chunk_tokens=256"]
    (p,) = launch._sft_compile_plans("configs/agent_mix.yaml", recipe, ["v5p-8"])
    assert p.compiled and p.fits and p.mesh_shape["context"] == 2
    hlo = p.executable.as_text()
    assert "collective-permute" in hlo and "all-gather" in hlo
