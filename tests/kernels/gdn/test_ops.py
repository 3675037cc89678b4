"""pallas_kernels/gdn/ops.py: what ``backend="auto"`` picks, per platform, dtype and head dim.

The oracle is the device measurement it encodes (bench/results/gdn_device_h200*.json, issue 17): on an
H200 the fp32 Triton kernels at dk = dv = 128 exceed shared memory, the bf16 ones run.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gdn import ops as gdn_ops


@pytest.mark.parametrize("platform,dtype,dk,dv,expected", [
    ("cpu", jnp.bfloat16, 128, 128, "reference"),      # no Pallas compiler: the jnp reference
    ("tpu", jnp.float32, 128, 128, "pallas"),          # Mosaic takes fp32 at the 35B shapes (TPU AOT)
    ("gpu", jnp.bfloat16, 128, 128, "pallas"),         # measured on the H200
    ("gpu", jnp.float32, 128, 128, "reference"),       # measured not to fit: XLA instead
    ("gpu", jnp.float32, 64, 128, "reference"),        # either head dim counts
    ("gpu", jnp.float32, 64, 64, "pallas"),            # not measured: a quarter of the tiles at 128
    ("gpu", jnp.float16, 128, 128, "pallas"),
])
def test_auto_backend_by_platform_dtype_and_head_dim(platform, dtype, dk, dv, expected):
    assert gdn_ops.auto_backend(platform, dtype, dk, dv) == expected


def test_auto_on_this_host_is_the_reference_bit_for_bit():
    rng = np.random.default_rng(0)
    B, T, H, K = 1, 32, 2, 16
    l2 = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = (jnp.asarray(l2(rng.standard_normal((B, T, H, K))), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32)
    g = jnp.asarray(-np.logaddexp(0, rng.standard_normal((B, T, H))), jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((B, T, H)))), jnp.float32)
    auto = gdn_ops.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16)
    ref = gdn_ops.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, backend="reference")
    for a, b in zip(auto, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
