"""Cost estimates of the Pallas kernels (`pallas_kernels.common.cost`): what XLA's cost analysis of a program
compiled for a TPU (AOT through libtpu on this CPU host) counts for the GDN kernels, against a hand
count of the matmuls of the phase algorithm (gdn.phase_math) and of the block readouts
(gdn.block_math, gdn.block_phase_math). Without the estimates XLA counts a Mosaic call as zero FLOPs."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import block_gated_delta_rule_pallas, chunk_gated_delta_rule_pallas
from train.aot import parse_topology, topology_devices

B, T, H, K, V, C, BK = 1, 512, 2, 128, 128, 64, 128


def _phase_forward_matmul_flops() -> float:
    """The causal kernel on TPU (the phase split, gdn.phase_math): per chunk, the parallel phase's
    G = k k^T, the triangular inverse, w = T (beta k), u = T (beta v); the sweep's w S, q S,
    q k^T, P delta, (eout k)^T delta."""
    per_chunk = (2 * C * C * K + 2 * math.ceil(math.log2(C)) * 2 * C ** 3 + 2 * C * C * K + 2 * C * C * V
                 + 2 * C * K * V + 2 * C * K * V + 2 * C * C * K + 2 * C * C * V + 2 * C * K * V)
    return B * H * (T // C) * per_chunk


def _readout_forward_matmul_flops() -> float:
    """Per noisy block: qn kn^T, P vn (the parallel noisy kernel), qn S (the sweep; blocks of 2 chunks)."""
    return B * H * (T // BK) * (2 * BK * BK * K + 2 * BK * BK * V + 2 * BK * K * V)


def _mid_readout_forward_matmul_flops() -> float:
    """Blocks of 32 inside chunks of 64, per chunk: the sweep's qn S, Mn = qn k^T and Mn delta (every
    block-start state read from the chunk's start state and deltas), the noisy kernel's qn kn^T and
    P vn on the chunk's 64-row tile (its two blocks masked apart)."""
    return B * H * (T // C) * (2 * C * K * V + 2 * C * C * K + 2 * C * C * V + 2 * C * C * K + 2 * C * C * V)


def _tpu_flops(fn, *args) -> float:
    dev = topology_devices(parse_topology("v5p-8"))[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a in args]
    cost = jax.jit(fn).lower(*specs).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


def test_gdn_kernels_report_their_flops_to_xla():
    """The TPU-compiled forward of the causal and of the block-mode phase kernels: XLA's FLOPs are
    the matmul count of each algorithm plus at most 10% (the elementwise work)."""
    bf = jnp.bfloat16
    q = jax.ShapeDtypeStruct((B, T, H, K), bf)
    v = jax.ShapeDtypeStruct((B, T, H, V), bf)
    g = jax.ShapeDtypeStruct((B, T, H), jnp.float32)
    scal = jax.ShapeDtypeStruct((H, 3), jnp.float32)

    def causal(q, k, v, g, b):
        return chunk_gated_delta_rule_pallas(q, k, v, g, b, chunk_size=C)[0]

    def block(q, k, v, g, b, qn, kn, vn, s, bk=BK):
        return block_gated_delta_rule_pallas(q, k, v, g, b, qn, kn, vn, s, block_size=bk, chunk_size=C)[:2]

    got = _tpu_flops(causal, q, q, v, g, g)
    want = _phase_forward_matmul_flops()
    assert want <= got <= 1.1 * want, (got, want)
    got = _tpu_flops(block, q, q, v, g, g, q, q, v, scal)
    want = _phase_forward_matmul_flops() + _readout_forward_matmul_flops()
    assert want <= got <= 1.1 * want, (got, want)
    got = _tpu_flops(lambda *a: block(*a, bk=32), q, q, v, g, g, q, q, v, scal)
    want = _phase_forward_matmul_flops() + _mid_readout_forward_matmul_flops()
    assert want <= got <= 1.1 * want, (got, want)
    assert np.isfinite(got)
