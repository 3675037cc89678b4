"""The GDN layer hands the kernels operands in the compute dtype (issue 16, item 4).

Property checked on the traced training step (jaxpr, no compile): with `dtype: bfloat16` every GDN
Pallas kernel (causal: the phase-split TPU kernels and the Triton sweeps; block forward and backward) gets
bf16 token operands and runs bf16 x bf16 -> fp32 dots; with `dtype: float32` no kernel dot is
bf16 and every one asks for HIGHEST precision. The numerics of the bf16 kernels are checked in
tests/kernels/gdn/test_causal_op.py and gdn/test_block_op.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.config import get_preset
from clover_jax.model.clover_model import create_model

T = 32


def _sub_jaxprs(eqn):
    for p in eqn.params.values():
        for sub in p if isinstance(p, (list, tuple)) else (p,):
            if hasattr(sub, "eqns"):
                yield sub
            elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                yield sub.jaxpr


def _dots(jaxpr):
    """(operand dtypes, precision, output dtype) of every dot_general under `jaxpr`, recursively."""
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            yield tuple(str(v.aval.dtype) for v in e.invars), e.params["precision"], str(e.outvars[0].aval.dtype)
        for sub in _sub_jaxprs(e):
            yield from _dots(sub)


def pallas_calls(jaxpr):
    """Every pallas_call equation under `jaxpr` (platform branches included)."""
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            yield e
        for sub in _sub_jaxprs(e):
            yield from pallas_calls(sub)


def traced_grad(mode: str, dtype: str):
    cfg = get_preset("tiny").replace(mode=mode, dtype=dtype, gdn_backend="pallas", gdn_chunk_size=16,
                                     **({"mask_token_id": 255} if mode == "block" else {}))
    graphdef, params = nnx.split(create_model(cfg, seed=0))
    ids = jnp.asarray(np.random.default_rng(0).integers(2, 255, (1, T)), jnp.int32)

    def loss(p):
        m = nnx.merge(graphdef, p)
        if mode == "block":
            h, hn, _ = m.two_stream_hidden(ids, ids.at[:, ::3].set(255), block_size=16)
            return jnp.sum(h.astype(jnp.float32) ** 2) + jnp.sum(hn.astype(jnp.float32) ** 2)
        return jnp.sum(m(ids).astype(jnp.float32) ** 2)

    return jax.make_jaxpr(jax.grad(loss))(params).jaxpr


@pytest.mark.parametrize("mode", ["ar", "block"])
def test_bf16_compute_feeds_bf16_kernel_operands(mode):
    calls = list(pallas_calls(traced_grad(mode, "bfloat16")))
    names = {e.params["name"] for e in calls}
    # both platform forms of the phase split, forward and backward
    assert {"gdn_intra", "gdn_gpu_intra"} <= names and any("bwd" in n for n in names), names
    for e in calls:
        token_ops = [v.aval for v in e.invars if v.aval.ndim == 3 and v.aval.dtype != jnp.float32]
        # q, k, v (the phase-split WY kernels read only k, v)
        n_tok = 2 if e.params["name"] in ("gdn_intra", "gdn_wy", "gdn_gpu_intra", "gdn_gpu_wy") else 3
        assert len(token_ops) >= n_tok, (e.params["name"], [v.aval for v in e.invars])
        assert all(a.dtype == jnp.bfloat16 for a in token_ops)
        dots = list(_dots(e.params["jaxpr"]))
        low = [d for d in dots if d[0] == ("bfloat16", "bfloat16")]
        assert low and all(d[2] == "float32" for d in low), (e.params["name"], dots)  # fp32 accumulation


@pytest.mark.parametrize("mode", ["ar", "block"])
def test_fp32_compute_keeps_fp32_highest_kernels(mode):
    calls = list(pallas_calls(traced_grad(mode, "float32")))
    assert calls
    hi = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    for e in calls:
        for d in _dots(e.params["jaxpr"]):
            assert d[0] == ("float32", "float32") and d[1] == hi, (e.params["name"], d)
