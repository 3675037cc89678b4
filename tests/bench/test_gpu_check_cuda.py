"""The programs bench/gpu_check.py runs on a lent GPU lower for CUDA from this CPU host, at the real
widths (the clover-35b-a3b preset's layer group: 3 GDN + 1 attention layer, hidden 2048, 256 experts,
vocab 248320; bf16), with the Triton kernels in them: the SFT train step of part a and the decode
programs of part b. Lowering runs the Pallas -> Triton lowering of every kernel inside the whole
program (not ptxas, not XLA's GPU compiler), on shapes only: no weight is allocated.

The model's "auto" choices are resolved as a GPU resolves them (`on_gpu`: the library's own resolvers
asked for platform "gpu"), since on this host they would resolve for CPU. Expected kernels, from the
kernels' design: per GDN layer the block-mode forward (intra, sweep, block output, noisy readout), again
in the backward under remat "full" (the recipe's), and the backward (WY recompute, state recompute
sweep, dS sweep, parallel backward); per attention layer the flash forward of both streams (twice,
remat) and their dq / dkv kernels. The decode commit pass runs the causal GDN forward (intra, sweep,
output) per GDN layer; the AR step (one token: the recurrence's step) and the block step run no kernel.
"""

from __future__ import annotations

import collections
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from clover_jax.model.moe_platform import resolve_impl  # noqa: E402
from pallas_kernels.attention.ops import resolve_attn_backend  # noqa: E402
from pallas_kernels.gdn.ops import auto_backend  # noqa: E402
from tests.bench.bench_import import bench_module  # noqa: E402
from tests.kernels.gdn.test_aot import cuda_target, lower_cuda  # noqa: E402

gpu_check = bench_module("gpu_check")
sft_check = bench_module("gpu_check_sft")


def on_gpu(mcfg):
    """The config with its "auto" choices as a GPU makes them."""
    gdn = mcfg.gdn_backend
    if gdn == "auto":
        gdn = auto_backend("gpu", mcfg.dtype, mcfg.linear_key_head_dim, mcfg.linear_value_head_dim)
    return mcfg.replace(moe_impl=resolve_impl(mcfg.moe_impl, "gpu"), gdn_backend=gdn,
                        attn_backend=resolve_attn_backend(mcfg.attn_backend, "gpu"))


def kernels(txt: str) -> collections.Counter:
    """Triton kernels of a lowered module by name (each one named: the count matches the calls)."""
    names = re.findall(r'name = "((?:gdn_gpu|flash)_[a-z_]+)"', txt)
    assert len(names) == txt.count("xla.gpu.triton"), (collections.Counter(names), txt.count("xla.gpu.triton"))
    return collections.Counter(names)


def layer_counts(mcfg) -> tuple[int, int]:
    gdn = sum(t == "linear_attention" for t in mcfg.layer_types)
    return gdn, len(mcfg.layer_types) - gdn


def test_the_sft_step_lowers_for_cuda_at_the_real_widths(monkeypatch):
    real = sft_check.recipe_configs
    monkeypatch.setattr(sft_check, "recipe_configs", lambda args, pdt: (lambda c, m: (c, on_gpu(m)))(*real(args, pdt)))
    args = gpu_check.parse(["--param-dtype", "bfloat16"])  # an H100's master weights
    chk = sft_check.SftCheck(args, {}, lambda: None)
    setup = chk.setups["kernels"]
    mcfg = setup.model_cfg
    assert (mcfg.hidden_size, mcfg.num_experts, mcfg.vocab_size, mcfg.dtype, mcfg.remat) == (
        2048, 256, 248320, "bfloat16", "full")
    assert mcfg.moe_impl == "blocked" and (mcfg.gdn_backend, mcfg.attn_backend) == ("pallas", "flash")
    host = sft_check.sft_batch(args.batch, args.seq, args.block, mcfg.vocab_size, int(mcfg.mask_token_id), 0)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in host.items()}
    from clover_jax.parallel import sharding as sh

    # the step's shardings name the one-device mesh: set inside the CUDA target's abstract mesh
    with cuda_target(), sh.use_sharding(chk.mesh):
        step = setup.make_step(args.block).trace(setup.abstract_state, batch)
        got = kernels(step.lower(lowering_platforms=("cuda",)).as_text())
    g, a = layer_counts(mcfg)
    assert (g, a) == (3, 1)
    assert got == {"gdn_gpu_intra": 2 * g, "gdn_gpu_sweep": 3 * g, "gdn_gpu_block_output": 2 * g,
                   "gdn_gpu_block_noisy": 2 * g, "gdn_gpu_wy": g, "gdn_gpu_block_state_bwd": g,
                   "gdn_gpu_block_parallel_bwd": g, "flash_clean_fwd": 2 * a, "flash_noisy_fwd": 2 * a,
                   "flash_clean_dq": a, "flash_clean_dkv": a, "flash_noisy_dq": a, "flash_noisy_dkv": a}


def test_the_decode_programs_lower_for_cuda_at_the_real_widths():
    from clover_jax.model.clover_model import abstract_model
    from flax import nnx

    args = gpu_check.parse([])
    mcfg = on_gpu(gpu_check.decode_config(args))
    assert mcfg.dtype == "bfloat16" and mcfg.hidden_size == 2048 and mcfg.gdn_backend == "pallas"
    model = abstract_model(mcfg)
    params = nnx.state(model)
    cache = jax.eval_shape(lambda: model.init_cache(1, args.context + 64))
    extend, blocks = gpu_check.decode_programs(mcfg, args.coreset)
    g, _ = layer_counts(mcfg)
    commit = lower_cuda(extend, params, jax.ShapeDtypeStruct((1, args.block), jnp.int32), cache)
    assert kernels(commit) == {"gdn_gpu_intra": g, "gdn_gpu_sweep": g, "gdn_gpu_output": g}
    # the AR step: one token, the GDN recurrence's single step in XLA (no chunk padded from one token)
    assert kernels(lower_cuda(extend, params, jax.ShapeDtypeStruct((1, 1), jnp.int32), cache)) == {}
    canvas = jax.ShapeDtypeStruct((1, args.block), jnp.int32)
    for op, fn in blocks.items():
        assert kernels(lower_cuda(fn, params, canvas, cache)) == {}, op
