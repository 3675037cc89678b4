"""The MoE's per-platform choices (clover_jax.model.moe_platform): the path `auto` takes, the megablox
`tgmm` tiling, and, on the HLO lowered for `cuda` (no GPU needed), that the GPU path multiplies
each row by its own expert only, forward and backward.

Oracles: hand-computed tilings; FLOPs counted from the lowered program's `dot_general`s against
the analytic grouped-FFN count; the `dense` and `ragged` paths as controls that the check flags.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.model.moe import experts_sorted, route
from clover_jax.model.moe_platform import resolve_impl, tgmm_tiling


@pytest.mark.parametrize("platform,want", [("tpu", "ragged"), ("gpu", "blocked"), ("cuda", "blocked"),
                                           ("rocm", "blocked"), ("cpu", "capacity")])
def test_auto_picks_the_grouped_path_per_platform(platform, want):
    assert resolve_impl("auto", platform) == want
    assert resolve_impl("dense", platform) == "dense"
    with pytest.raises(ValueError, match="unknown moe_impl 'grouped'"):
        resolve_impl("grouped", platform)


@pytest.mark.parametrize("mkn,want", [
    ((65536, 2048, 512), (512, 512, 256)),    # gate / up weight gradient of the 35B: 2 n tiles, not 1
    ((65536, 2048, 1024), (512, 512, 512)),   # gate and up fused: n = 1024 keeps 512-wide tiles
    ((65536, 512, 2048), (512, 512, 512)),    # down projection: 4 n tiles
    ((300, 384, 384), (512, 128, 128)),       # 384 = 3 x 128; a short m rounds up to a power of two
    ((20, 96, 256), (32, 96, 128)),           # no 128 multiple: the whole dim; 256 -> 2 tiles of 128
    ((5, 64, 64), (8, 64, 64)),               # tiny: whole dims, at least 8 rows
])
def test_tgmm_tiling_by_shape(mkn, want):
    assert tgmm_tiling(*mkn) == want
    (m, k, n), (tm, tk, tn) = mkn, want
    assert tm >= min(m, 512) and k % tk == 0 and n % tn == 0


_DOT = re.compile(r"stablehlo\.dot_general[^\n]*?contracting_dims = \[([\d, ]*)\] x [^\n]*?"
                  r": \(tensor<([^>]*)>, tensor<[^>]*>\) -> tensor<([^>]*)>")


def _dims(spec: str) -> list[int]:
    return [int(d) for d in spec.split("x")[:-1]]  # "30x8x32xbf16" -> [30, 8, 32]


def dot_flops(hlo: str) -> list[int]:
    """2 * output elements * contracted size, for every dot_general of a StableHLO module."""
    out = []
    for contract, lhs, res in _DOT.findall(hlo):
        lhs_d = _dims(lhs)
        c = int(np.prod([lhs_d[int(i)] for i in contract.split(",") if i.strip()] or [1]))
        out.append(2 * int(np.prod(_dims(res))) * c)
    return out


E, T, K, D, I = 16, 64, 2, 32, 16
M = T * K                      # rows after the sort: one per (token, choice)
ROWS = M + E * 8               # rows after padding each group to the blocked path's row block (8 here)


def lowered_fwd_bwd(impl: str) -> str:
    ks = jax.random.split(jax.random.key(0), 2)
    _, w, ex = route(jax.random.normal(ks[1], (T, E)), K)
    bf = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((T, D), bf), jax.ShapeDtypeStruct((E, D, I), bf),
            jax.ShapeDtypeStruct((E, D, I), bf), jax.ShapeDtypeStruct((E, I, D), bf))

    def loss(x, wg, wu, wo):
        return jnp.sum(jnp.sin(experts_sorted(x, w, ex, wg, wu, wo, impl=impl, platform="gpu")))

    # no Pallas kernel here, so no GPU target device is needed to lower for cuda
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_gpu_path_lowered_for_cuda_has_no_dense_expert_product():
    """auto on GPU: no ragged_dot for XLA:GPU to expand densely, and every product of the fwd + bwd is
    one row block's (the blocked path loops over the used row blocks, `moe_blocked`): the largest is
    one block of 8 rows through the fused gate|up projection, far from an [E, M, .] product."""
    hlo = lowered_fwd_bwd(resolve_impl("auto", "gpu"))
    assert "ragged_dot" not in hlo
    flops = dot_flops(hlo)
    one = 2 * ROWS * D * I      # one projection over all the padded rows
    per_block = 2 * 8 * D * 2 * I  # one row block (8 rows here) through the fused gate|up projection
    assert max(flops) == per_block, (max(flops), per_block)
    assert max(flops) < one // 4


def test_the_check_flags_dense_and_ragged_paths():
    """Controls: the dense path has [M, E, .] products (E/k times the FLOPs); `ragged` lowers to
    ragged_dot, which XLA:GPU expands over every group."""
    assert max(dot_flops(lowered_fwd_bwd("dense"))) >= 2 * M * E * D * I
    assert "ragged_dot" in lowered_fwd_bwd("ragged")


def test_tpu_aot_fused_gate_up_compiles_with_megablox_tgmm():
    """`ragged` on TPU at a small width, compiled for v5p from this host (libtpu, no chip): gate and up
    run as ONE ragged dot of n = 2I, and the weight gradients are megablox tgmm kernels of shapes
    [G, D, 2I] (fused gate / up) and [G, I, D] (down). bf16 operands: every grouped matmul writes
    bf16 (fp32 accumulation stays inside the kernel), so no fp32 [M, .] buffer leaves one."""
    import os

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # see tests/kernels/gdn/test_aot.py
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from clover_jax.model.moe import grouped_ffn

    dev = topologies.get_topology_desc("v5p:2x2x1", platform="tpu").devices[0]
    m, d, i, g = 1024, 256, 256, 8
    sd = lambda s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=SingleDeviceSharding(dev))  # noqa: E731

    def loss(x, wg, wu, wo, gs):
        return jnp.sum(jnp.sin(grouped_ffn(x, gs, wg, wu, wo, "ragged", "tpu")))

    args = (sd((m, d)), sd((g, d, i)), sd((g, d, i)), sd((g, i, d)), sd((g,), jnp.int32))
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(*args).lower().compile().as_text()
    # XLA:TPU runs ragged dots as its own Mosaic kernels ("ragged-dot-*" custom calls)
    assert re.search(rf"%ragged-dot\S* = bf16\[{m},{2 * i}\]\S* custom-call\(", hlo)  # fused gate / up forward
    assert not re.search(r"%ragged-dot-none\S* = f32", hlo), "a grouped matmul writes fp32"
    tgmm = re.findall(r"%\S*tgmm\S* = (\w+)\[(\d+),(\d+),(\d+)\]\S* custom-call\([^\n]*tpu_custom_call", hlo)
    assert sorted(set(tgmm)) == sorted({("bf16", str(g), str(d), str(2 * i)), ("bf16", str(g), str(i), str(d))}), tgmm
