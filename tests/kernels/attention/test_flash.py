"""The GPU flash-attention kernel (`pallas_kernels.attention.flash`) run by the Pallas interpreter
on this CPU host against the dense jnp reference (`attend` over the masks of docs/design.md 3.1), for
both training streams; and its Triton lowering for CUDA at the real model's attention shapes.

fp32: values to 1e-5 and gradients to 1e-4 of the reference's largest entry. Small tiles (16 / 32 /
64), so a row of 96 tokens spans several query and key tiles, is padded to 128 (so the padding
path runs), and the document / causal / block tile skipping decides which tiles are visited."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.flash import doc_extents, flash_attention
from pallas_kernels.attention.flash_calls import FlashConfig
from pallas_kernels.attention.reference import clean_attention_ref, noisy_attention_ref
from tests.kernels.attention.test_ops import SEG, _assert_rel
from tests.kernels.gdn.test_aot import lower_cuda

B, T, H, K, D = 2, 96, 8, 2, 24  # 4 query heads per KV head; D = 24 is zero-padded to 32 in the kernel
# fwd: 8 query tiles x (2 clean / 4 noisy) key tiles; bwd: 4 query tiles, 8 / 16 key tiles
TILES = FlashConfig(block_q=16, block_k=64, block_q_bwd=32, block_k_bwd=16)
FAST = {"xla_backend_optimization_level": 0}  # same semantics, less CPU compile time


def _value_and_grads(attention, stream: str, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 4)
    s = T if stream == "clean" else 2 * T
    q = jax.random.normal(ks[0], (B, T, H, D))
    k, v = jax.random.normal(ks[1], (B, s, K, D)), jax.random.normal(ks[2], (B, s, K, D))
    w = jax.random.normal(ks[3], (B, T, H, D))  # shapes the cotangent

    def f(q, k, v):
        out = attention(q, k, v)
        return jnp.sum(jnp.sin(out) * w), out

    fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))
    (_, out), grads = fn.lower(q, k, v).compile(compiler_options=FAST)(q, k, v)
    return out, grads


@pytest.mark.parametrize("stream,block", [("clean", 1), ("noisy", 4), ("noisy", 16), ("noisy", 32)])
def test_flash_equals_reference(stream, block):
    """Values and dq, dk, dv of the kernel (interpret mode) equal the dense reference on packed rows
    with pads and documents not on tile boundaries, GQA, for both streams at 3 block sizes."""
    seg = jnp.asarray(SEG)
    out, grads = _value_and_grads(lambda q, k, v: flash_attention(q, k, v, seg, stream=stream, block_size=block,
                                                                  config=TILES), stream)
    ref = (lambda q, k, v: clean_attention_ref(q, k, v, seg)) if stream == "clean" else (
        lambda q, k, v: noisy_attention_ref(q, k, v, seg, block))
    out_r, grads_r = _value_and_grads(ref, stream)
    _assert_rel(out, out_r, 1e-5, f"{stream} b{block} output")
    for name, g, g_r in zip("qkv", grads, grads_r):
        _assert_rel(g, g_r, 1e-4, f"{stream} b{block} d{name}")


def test_doc_extents_are_first_and_last_slot_of_the_id():
    """Also for an id that recurs after another one (pads between documents share an id)."""
    seg = np.array([[3, 3, 0, 0, 4, 4, 4, 0, 3, 5]], np.int32)
    first, last = (np.asarray(a)[0] for a in doc_extents(jnp.asarray(seg)))
    idx = np.arange(seg.shape[1])
    for t in idx:
        same = idx[seg[0] == seg[0, t]]
        assert (first[t], last[t]) == (same.min(), same.max()), t


def test_bad_inputs_name_the_tensor():
    q = jnp.zeros((1, 32, 4, 16))
    seg = jnp.ones((1, 32), jnp.int32)
    with pytest.raises(ValueError, match="needs k and v of 64 keys"):
        flash_attention(q, jnp.zeros((1, 32, 2, 16)), jnp.zeros((1, 32, 2, 16)), seg, stream="noisy", block_size=4)
    with pytest.raises(ValueError, match="not a multiple of 3 KV heads"):
        flash_attention(q, jnp.zeros((1, 32, 3, 16)), jnp.zeros((1, 32, 3, 16)), seg, stream="clean")
    with pytest.raises(ValueError, match="segment_ids"):
        flash_attention(q, jnp.zeros((1, 32, 2, 16)), jnp.zeros((1, 32, 2, 16)), seg[:, :8], stream="clean")


@pytest.mark.parametrize("stream", ["clean", "noisy"])
def test_cuda_lowering_fwd_bwd_at_model_shapes(stream):
    """The 35B layer's attention (16 query heads over 2 KV heads, head dim 256, bf16, T = 8192,
    block 32) lowers to three Triton kernels for CUDA: forward, dq, dk/dv (default tiles)."""
    t, s = 8192, 8192 * (1 if stream == "clean" else 2)
    bf = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((1, t, 16, 256), bf), jax.ShapeDtypeStruct((1, s, 2, 256), bf),
            jax.ShapeDtypeStruct((1, s, 2, 256), bf), jax.ShapeDtypeStruct((1, t), jnp.int32))

    def loss(q, k, v, seg):
        out = flash_attention(q, k, v, seg, stream=stream, block_size=32)
        assert out.dtype == bf
        return jnp.sum(jnp.square(out.astype(jnp.float32)))

    txt = lower_cuda(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), *args)
    assert txt.count("xla.gpu.triton") == 3, txt.count("xla.gpu.triton")
    assert "tpu_custom_call" not in txt


@pytest.mark.parametrize("stream", ["clean", "noisy"])
def test_cuda_lowering_of_a_context_shard(stream):
    """A context shard's kernels (`pallas_kernels.context.attention_kernels`: the shard's queries after
    the other shards' keys, ``q_offset`` > 0) at the 35B layer's shapes, a 32K row over 8 shards:
    4096 queries after 28672 gathered keys, bf16, block 32: forward, dq, dk/dv lower to Triton for CUDA."""
    from pallas_kernels.attention.flash import flash_core

    tq, off = 4096, 7 * 4096
    s = off + tq * (1 if stream == "clean" else 2)
    bf = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((1, tq, 16, 256), bf), jax.ShapeDtypeStruct((1, s, 2, 256), bf),
            jax.ShapeDtypeStruct((1, s, 2, 256), bf), jax.ShapeDtypeStruct((1, tq), jnp.int32),
            jax.ShapeDtypeStruct((1, s), jnp.int32))
    cfg = FlashConfig(stream=stream, block_size=32 if stream == "noisy" else 1, scale=256 ** -0.5, q_offset=off)

    def loss(q, k, v, q_seg, kv_seg):
        return jnp.sum(jnp.square(flash_core(q, k, v, q_seg, kv_seg, cfg=cfg, interpret=None).astype(jnp.float32)))

    txt = lower_cuda(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), *args)
    assert txt.count("xla.gpu.triton") == 3, txt.count("xla.gpu.triton")
