"""The `context` mesh axis (pallas_kernels/context/split.py, the `length -> context` rule of
parallel/sharding.py): rows split into contiguous shards, the split's validation names the keys, and
the whole model with its rows sharded over `context` equals the one-device run, and the recipe's step
compiles for TPU in both layouts (its gradients reduce-scattered, no whole row gathered)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from clover_jax.config import get_preset
from clover_jax.model.clover_model import (
    abstract_model, create_model, model_from_params, model_to_params, shift_predictions,
)
from clover_jax.parallel import sharding as sh
from pallas_kernels.context.split import check_context_split
from tests.model.parity_utils import FAST_COMPILE, FP32_REL, assert_rel_close


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
    # zigzag: two pieces per shard, each a whole number of blocks and chunks
    assert check_context_split(32768, 8, (4, 32), 64, 4, layout="zigzag", pieces=2) == 2048
    with pytest.raises(ValueError, match=r"into 16 equal pieces \(mesh.context=8, model.context_layout=zigzag"):
        check_context_split(808, 8, layout="zigzag", pieces=2)  # 808 = 8 x 101: contiguous shards would do
    with pytest.raises(ValueError, match=r"context piece holds data.seq_len / 8 = 256 / 8 = 32 tokens .*block_size=64"):
        check_context_split(256, 4, (64,), layout="zigzag", pieces=2)


# ---------------------------------------------------------------------------------------------
# the whole model with the row's sequence sharded over `context` equals the one-device run, over a
# short training run: one compiled program per mesh (and one reference per length and block size)

CFG = get_preset("tiny").replace(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                                 moe_impl="dense", mode="block", block_size=4, mask_token_id=2, gdn_chunk_size=4,
                                 num_experts_per_tok=8)  # every expert: routing weights continuous in the params
STEPS, LR = 3, 0.2  # plain SGD: a gradient error shows up in the next step's loss, never normalised away


@pytest.fixture(scope="module")
def params():
    """Every parameter randomised (norms, zero-init right conv taps and bd scalars included). The
    init runs as one compiled program (eager init costs a compile per op), the noise in numpy."""
    init = jax.jit(lambda: model_to_params(create_model(CFG, seed=0))).lower().compile(compiler_options=FAST_COMPILE)
    rs = np.random.RandomState(1)
    return jax.tree.map(lambda w: jnp.asarray(np.asarray(w) + 0.1 * rs.normal(size=w.shape).astype(np.float32)), init())


def _batch(length: int, block: int, seed: int):
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
    return {"ids": ids, "noisy": noisy, "seg": seg}


def _batches(length: int, block: int):
    """STEPS batches stacked on a leading axis (new ids and noise every step, the same layout)."""
    each = [_batch(length, block, seed) for seed in range(STEPS)]
    return {k: jnp.asarray(np.stack([b[k] for b in each])) for k in each[0]}


def _train(params, batches, block: int, mesh=None, layout: str = "contiguous", base_cfg=CFG):
    """STEPS SGD steps in one program: per step (loss, AR logits of the plain forward, block logits,
    gradients), stacked, and the final params. Loss = next-token CE of the clean stream + masked-token
    CE of the block predictions + 0.01 * lb loss. `layout`: the model's context layout; `base_cfg`:
    the model (default `CFG`)."""
    cfg = base_cfg.replace(context_layout=layout)
    graphdef, _ = nnx.split(abstract_model(cfg))

    def loss_fn(p, b):
        model = nnx.merge(graphdef, p)
        h_c, h_n, aux = model.two_stream_hidden(b["ids"], b["noisy"], block_size=block, segment_ids=b["seg"])
        bd = model.logits(shift_predictions(h_c, h_n, b["seg"], block, CFG.logits_shift))
        ar = model(b["ids"], segment_ids=b["seg"])  # the AR (clean) forward on its own
        nll = lambda lg, t: -jnp.take_along_axis(jax.nn.log_softmax(lg), t[..., None], -1)[..., 0]  # noqa: E731
        masked = (b["noisy"] == CFG.mask_token_id).astype(jnp.float32)
        ce = jnp.mean(nll(model.logits(h_c)[:, :-1], b["ids"][:, 1:])) + jnp.sum(nll(bd, b["ids"]) * masked) / jnp.sum(masked)
        return ce + 0.01 * aux["lb_loss"], (ar, bd)

    def step(p, b):
        (loss, (ar, bd)), g = jax.value_and_grad(loss_fn, has_aux=True)(p, b)
        return jax.tree.map(lambda w, d: w - LR * d, p, g), (loss, ar, bd, g)

    run = lambda p, bs: lax.scan(step, p, bs)  # noqa: E731
    if mesh is None:
        return jax.jit(run).lower(params, batches).compile(compiler_options=FAST_COMPILE)(params, batches)
    params = model_to_params(sh.shard_params(model_from_params(cfg, params), mesh))
    spec = sh.batch_sharding(mesh, shape=batches["ids"].shape[1:]).spec
    assert spec[1] == "context"
    batches = {k: jax.device_put(v, NamedSharding(mesh, P(None, *spec))) for k, v in batches.items()}
    with sh.use_sharding(mesh):
        lowered = jax.jit(run).lower(params, batches)
    return lowered.compile(compiler_options=FAST_COMPILE)(params, batches)


@pytest.fixture(scope="module")
def reference(params):
    """{(length, block): the one-device run}, computed once per key."""
    runs = {}

    def get(length: int, block: int):
        if (length, block) not in runs:
            runs[length, block] = _train(params, _batches(length, block), block)
        return runs[length, block]
    return get


@pytest.mark.parametrize("mesh_shape,length,block,layout", [
    (dict(fsdp=1, context=8), 64, 4, "contiguous"),  # shards of 8 tokens: 2 blocks, 2 GDN chunks, the halo from the neighbour
    (dict(fsdp=2, context=4), 64, 4, "contiguous"),
    (dict(fsdp=2, expert=2, context=2), 64, 32, "contiguous"),  # one 32-token block per shard
    # zigzag: shard i holds row pieces i and 2n-1-i (pieces of 8 tokens); the halo, the GDN entry
    # states and the attention masks follow the row order across the pieces (context 8, pieces of 4
    # tokens, passed too; not kept: CI time)
    (dict(fsdp=2, context=4), 64, 4, "zigzag"),
], ids=lambda v: str(v))
def test_model_training_with_context_equals_single_device(params, reference, mesh_shape, length, block, layout):
    """STEPS training steps. Every step: the same loss; the first: AR logits, block logits and every
    gradient too (fp32, 1e-5 of the reference's max magnitude; gradients: of the whole tree's, as in
    test_sharding). Later steps' logits are not compared element by element: after a step the two
    runs' params differ by fp32 round-off (~1e-6 of the gradient scale), which the next step grows
    to ~1e-5 in single logits, while the loss (a mean) stays within 1e-7. The router picks every
    expert (CFG): with a smaller top-k that round-off flips a near-tie expert choice of a token and
    the loss jumps (1e-4 measured at step 2 with top-2)."""
    ref_params, (ref_loss, ref_ar, ref_bd, ref_grads) = reference(length, block)
    mesh = sh.make_mesh(sh.MeshConfig(**mesh_shape))
    _, (loss, ar, bd, grads) = _train(params, _batches(length, block), block, mesh, layout)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(params)))
    assert moved > 1e-2, "the SGD steps must move the params (else later losses check nothing new)"
    for i in range(STEPS):
        assert_rel_close(loss[i], ref_loss[i], FP32_REL, f"step {i} loss")
    assert_rel_close(ar[0], ref_ar[0], FP32_REL, "AR logits")
    assert_rel_close(bd[0], ref_bd[0], FP32_REL, "block logits")
    scale = max(float(jnp.max(jnp.abs(g[0]))) for g in jax.tree.leaves(ref_grads))
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g[0], r[0], rtol=0, atol=FP32_REL * scale, err_msg=jax.tree_util.keystr(path))


# The recipe's SFT step compiled for TPU (libtpu on this CPU host) with (fsdp 2, context 2) on v5p-8, at
# the smallest widths that keep both mixers (the `tiny` preset, 2 layers, 2 rows x 64 tokens, block 16:
# two blocks per shard, one per zigzag piece). One compile per layout, shared by the tests below.
CONTEXT_RECIPE = ["model.preset=tiny", "model.num_hidden_layers=2", "model.layer_types=[linear_attention,full_attention]",
                  "data.seq_len=64", "data.batch_size=2", "train.micro_batches=1", "mesh.fsdp=2", "mesh.expert=1",
                  "mesh.context=2", "loss.chunk_tokens=128", "model.block_size=16"]


@pytest.fixture(scope="module")
def context_plan():
    """layout -> the compiled AOT plan of the recipe's SFT step (CONTEXT_RECIPE), compiled once."""
    import launch

    plans = {}

    def get(layout: str):
        if layout not in plans:
            (plans[layout],) = launch._sft_compile_plans("configs/agent_mix.yaml",
                                                         CONTEXT_RECIPE + [f"model.context_layout={layout}"], ["v5p-8"])
        return plans[layout]
    return get


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_sft_step_with_context_compiles_for_tpu(context_plan, layout):
    """TPU AOT of the recipe's SFT step (CONTEXT_RECIPE) in both context layouts: it compiles and
    fits, and the program holds the context exchanges (the conv halo and entry-segment `ppermute`s, the K/V and shard-map
    all-gathers), and the attention runs the splash kernels per shard (the recipe's TPU backend under
    a context mesh). It only has to prove the context step compiles for a TPU topology."""
    p = context_plan(layout)
    assert p.compiled and p.fits and p.mesh_shape["context"] == 2
    hlo = p.executable.as_text()
    assert "collective-permute" in hlo and "all-gather" in hlo
    assert all(f"%splash_mha_{k}" in hlo for k in ("fwd", "dq", "dkv")), "no splash kernel per context shard"


def test_fsdp_context_step_reduce_scatters_gradients_and_never_gathers_whole_rows(context_plan):
    """agent_long's layout (no expert axis; weights' embed dim FSDP-sharded over fsdp x context; two
    rows per batch shard: the complementary copy) on the contiguous plan above: the gradients of the
    expert weights (the MoE's shard_map) and of the lm_head (the chunked CE's) leave as
    reduce-scatters onto the parameters' shards (gate and up as one [E, D/4, 2I]: the MoE joins them
    on the shard before its all-gather; [E, I, D/4]; [D/4, V]), never as an all-reduce of the whole
    weight (shard_map's transpose psums the whole cotangent of an operand that enters replicated; the
    CE reduced dW across devices per chunk: in the agent_long 32K plan ~0.39 TB + ~0.78 TB of
    all-reduce per chip per step); and no [rows, 2T, D] hidden state is all-gathered over context
    (the MoE router flattened [B, 2T] to [B*2T], no sharding XLA can hold with two rows per device:
    0.73 TB/chip/step and 2 + 4 GiB buffers per layer in the 128K plan). Oracle: the parameter
    shapes, the rule table's 4-way split of the embed dim and the row shape, against the optimized
    HLO's collectives."""
    from train import hlo_cost

    p = context_plan("contiguous")
    assert p.compiled and p.mesh_shape == {"data": 1, "fsdp": 2, "expert": 1, "context": 2, "tensor": 1}
    cfg = get_preset("tiny")
    e, d, i, v = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.vocab_size
    assert not cfg.tie_word_embeddings
    full = {(e, d, i), (e, d, 2 * i), (e, i, d), (d, v)}
    shards = {(e, d // 4, 2 * i), (e, i, d // 4), (d // 4, v)}
    comps, _ = hlo_cost.parse_module(p.executable.as_text())
    all_reduced, scattered, rows_gathered = [], set(), []
    for comp, instrs in comps.items():
        for ins in instrs:
            dims = [tuple(x for j, x in enumerate(s.dims) if x != 1 or j >= len(s.dims) - 3) for s in ins.results]
            if ins.opcode in ("all-reduce", "all-reduce-start") and not comp.startswith("all-reduce-scatter"):
                all_reduced += [x for x in dims if x in full]
            if ins.opcode in ("reduce-scatter", "reduce-scatter-start"):
                scattered |= {x for x in dims if x in shards}
            if ins.opcode in ("all-gather", "all-gather-start"):
                rows_gathered += [x for x in dims if x[-2:] == (2 * 64, d)]  # both streams of a 64-token row
    assert not all_reduced, f"gradients all-reduced whole: {all_reduced}"
    assert scattered == shards, f"gradients reduce-scattered to {scattered}, want {shards}"
    assert not rows_gathered, f"whole rows all-gathered over context: {rows_gathered}"
