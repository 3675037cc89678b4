"""The GDN layer over a sequence-sharded row (clover_jax/model/gdn_context.py) against the same layer
on one device: the AR forward and both block-mode streams, on a context-8 mesh whose shards hold one
block of 4 tokens each, so the conv's 3-token halo and the block rings always come from the
neighbour; documents start at, just after and between shard boundaries, with pads. Mixed meshes:
rows over fsdp x context 4, and rows over data x context 2 x heads over tensor (the shard_map is
manual over every axis: each device holds one row and, on the tensor mesh, one key head and its
two value heads, with their conv channels and taps)."""

import jax
import pytest
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.config import get_preset
from clover_jax.model.clover_model import NO_SEGMENT
from clover_jax.model.gdn import GatedDeltaNet
from clover_jax.parallel import sharding as sh
from pallas_kernels.context.stream_layout import join_streams, split_streams
from tests.model.parity_utils import FAST_COMPILE, FP32_REL, assert_rel_close, rounding_floor

CFG = get_preset("tiny").replace(mode="block", block_size=4, gdn_chunk_size=4)
B, T = 2, 32


def _layer():
    layer = GatedDeltaNet(CFG, rngs=nnx.Rngs(0))
    state = nnx.state(layer, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    # every parameter randomised: the zero-init right taps too (they must stay inside the block)
    nnx.update(layer, jax.tree.unflatten(treedef, [l + 0.3 * jax.random.normal(k, l.shape) for l, k in zip(leaves, keys)]))
    return layer


def _seg():
    seg = np.ones((B, T), np.int32)
    seg[0, :8], seg[0, 8:20], seg[0, 20:24], seg[0, 24:] = 1, 2, 0, 2  # starts at shard boundaries; a reused id
    seg[1, :16], seg[1, 16:] = 5, 6
    return jnp.asarray(seg)


def _compiled(fn, layer, x, seg, mesh=None):
    """The jitted (loss, y), (d state, d x) of `sum(sin(fn(layer, x)))`, compiled for x on one device
    or row-sharded on `mesh`; returns (step, state, x placed)."""
    graphdef, state = nnx.split(layer)

    def f(state, x):
        y = fn(nnx.merge(graphdef, state), x, seg)
        return jnp.sum(jnp.sin(y)), y

    step = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    if mesh is None:
        return step.lower(state, x).compile(compiler_options=FAST_COMPILE), state, x
    x = jax.device_put(x, sh.batch_sharding(mesh, shape=x.shape))
    with sh.use_sharding(mesh):
        return step.lower(state, x).compile(compiler_options=FAST_COMPILE), state, x


MESHES = {"context8": sh.MeshConfig(fsdp=1, context=8), "fsdp2_context4": sh.MeshConfig(fsdp=2, context=4),
          "data2_context2_tensor2": sh.MeshConfig(data=2, fsdp=1, context=2, tensor=2)}


def _check(fn, width, mesh_cfg):
    layer = _layer()
    x = jax.random.normal(jax.random.key(2), (B, width, CFG.hidden_size))
    seg = _seg()
    one, state, x1 = _compiled(fn, layer, x, seg)
    (_, want), (want_gs, want_gx) = one(state, x1)
    many, state, xs = _compiled(fn, layer, x, seg, sh.make_mesh(mesh_cfg))
    (_, got), (got_gs, got_gx) = many(state, xs)
    assert_rel_close(got, want, FP32_REL, "output")
    # the gradients pass backward through the delta-rule products, whose conditioning amplifies
    # rounding past FP32_REL (half an ulp on the inputs moves the one-device gradients by up to 8e-5
    # over seeds 0-5); the sharded path composes the same products in another order, so its
    # gradients are held to 4x that floor, measured here (a wrong halo or state is off by > 1e-2)
    grad_rel = max(FP32_REL, 4 * rounding_floor(lambda s, x: one(s, x)[1], (state, x1), jax.random.key(3)))
    assert_rel_close(got_gx, want_gx, grad_rel, "dx")
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(got_gs)[0], jax.tree.leaves(want_gs)):
        assert_rel_close(g, r, grad_rel, jax.tree_util.keystr(path))


@pytest.mark.parametrize("mesh", MESHES)
def test_clean_forward_over_context_equals_one_device(mesh):
    def fn(layer, x, seg):
        ctx = {"segment_ids": seg, "ring_segment_ids": jnp.full((B, 3), NO_SEGMENT, jnp.int32)}
        return layer(x, ctx)[0]
    _check(fn, T, MESHES[mesh])


@pytest.mark.parametrize("mesh", MESHES)
def test_two_stream_over_context_equals_one_device(mesh):
    def fn(layer, x, seg):  # x, y: clean || noisy; the layer sees its mesh's layout (stream_layout)
        y = layer.two_stream(join_streams(x[:, :T], x[:, T:]),
                             {"segment_ids": seg, "block_size": 4, "empty_segment": NO_SEGMENT})
        return jnp.concatenate(split_streams(y), axis=1)
    _check(fn, 2 * T, MESHES[mesh])
