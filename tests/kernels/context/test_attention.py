"""Attention over a sequence-sharded row (pallas_kernels/context/attention.py) against the one-device
reference of both training streams: values and dq, dk, dv, with packed documents crossing shard
boundaries, pads and GQA, on (fsdp, context) meshes of the 8 simulated CPU devices: the jnp
reference per shard, and the splash / flash kernels per shard (interpret mode) through `context_stream_attention`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.context.attention import context_stream_attention, context_two_stream_attention
from pallas_kernels.attention.ops import stream_attention
from pallas_kernels.attention.reference import clean_attention_ref, noisy_attention_ref
from tests.model.parity_utils import FP32_REL, assert_rel_close, fast_jit

B, T, H, K, D = 2, 64, 4, 2, 8
# row 0: documents crossing the shard boundaries of context 2, 4 and 8, a pad run, an id reused;
# row 1: one document, then a document starting at slot 32 (a shard boundary), then pads
SEG = np.stack([np.repeat([1, 2, 0, 1], [12, 24, 4, 24]), np.repeat([3, 4, 0], [32, 24, 8])]).astype(np.int32)


def _inputs(stream: str):
    ks = jax.random.split(jax.random.key(1), 4)
    s = T if stream == "clean" else 2 * T
    return (jax.random.normal(ks[0], (B, T, H, D)), jax.random.normal(ks[1], (B, s, K, D)),
            jax.random.normal(ks[2], (B, s, K, D)), jax.random.normal(ks[3], (B, T, H, D)))


def _vg(fn, q, k, v, w):
    def f(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(jnp.sin(out) * w), out
    (_, out), grads = fast_jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


@pytest.mark.parametrize("stream,block,context", [("clean", 1, 2), ("clean", 1, 8), ("noisy", 4, 4),
                                                  ("noisy", 4, 8), ("noisy", 32, 2)])
def test_context_attention_equals_one_device(stream, block, context):
    q, k, v, w = _inputs(stream)
    seg = jnp.asarray(SEG)
    if stream == "clean":
        ref = lambda q, k, v: clean_attention_ref(q, k, v, seg)  # noqa: E731
    else:
        ref = lambda q, k, v: noisy_attention_ref(q, k, v, seg, block)  # noqa: E731
    want, want_g = _vg(ref, q, k, v, w)
    mesh = jax.make_mesh((8 // context, context), ("fsdp", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        tok = NamedSharding(mesh, P(None, "context"))
        args = [jax.device_put(x, tok) for x in (q, k, v, w)]
        sseg = jax.device_put(seg, tok)
        got, got_g = _vg(lambda q, k, v: context_stream_attention(q, k, v, sseg, stream=stream, block_size=block),
                         *args)
    assert_rel_close(got, want, FP32_REL, f"{stream} b{block} c{context} output")
    for name, a, b in zip("qkv", got_g, want_g):
        assert_rel_close(a, b, FP32_REL, f"{stream} b{block} c{context} d{name}")


# with the two-stream test below: each backend at context 2, 4 and 8, both streams, blocks 4 and 32 (a
# shard of 8 tokens at context 8 is padded to a whole tile: 128 for splash, 32 for flash's fp32 tiles)
KERNEL_CASES = [("splash", "clean", 1, 8), ("splash", "noisy", 32, 2), ("flash", "clean", 1, 4),
                ("flash", "noisy", 4, 8)]


@pytest.mark.parametrize("backend,stream,block,context", KERNEL_CASES)
def test_context_kernels_equal_one_device_reference(backend, stream, block, context):
    """Attention over shards with a kernel backend under a context mesh (each shard's K/V padded, gathered and
    rolled; the kernel per shard, interpreted) equals the dense reference on one device: values and
    dq / dk / dv at FP32_REL of the largest entry (the acceptance asks 1e-5 / 1e-4; errors are ~4e-7)."""
    q, k, v, w = _inputs(stream)
    seg = jnp.asarray(SEG)
    want, want_g = _vg(lambda q, k, v: stream_attention(q, k, v, seg, stream=stream, block_size=block,
                                                        backend="reference"), q, k, v, w)
    mesh = jax.make_mesh((8 // context, context), ("fsdp", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        tok = NamedSharding(mesh, P(None, "context"))
        args = [jax.device_put(x, tok) for x in (q, k, v, w)]
        got, got_g = _vg(lambda q, k, v: context_stream_attention(q, k, v, jax.device_put(seg, tok), stream=stream,
                                                                  block_size=block, backend=backend), *args)
    what = f"{backend} {stream} b{block} c{context}"
    assert_rel_close(got, want, FP32_REL, f"{what} output")
    for name, a, b in zip("qkv", got_g, want_g):
        assert_rel_close(a, b, FP32_REL, f"{what} d{name}")


@pytest.mark.parametrize("backend,block,context", [("splash", 4, 4), ("flash", 32, 2), ("reference", 8, 8)])
def test_context_two_streams_over_one_exchange_equal_one_device(backend, block, context):
    """The model's two-stream call under a context mesh (a kernel backend: both streams in one
    shard_map, one K/V exchange): each stream's queries, keys and values; output and dq, dk, dv equal
    the two one-device reference streams."""
    ks = jax.random.split(jax.random.key(2), 4)
    q, w = jax.random.normal(ks[0], (B, 2 * T, H, D)), jax.random.normal(ks[3], (B, 2 * T, H, D))
    k, v = jax.random.normal(ks[1], (B, 2 * T, K, D)), jax.random.normal(ks[2], (B, 2 * T, K, D))
    seg = jnp.asarray(SEG)
    ref = lambda q, k, v: jnp.concatenate([clean_attention_ref(q[:, :T], k[:, :T], v[:, :T], seg),  # noqa: E731
                                           noisy_attention_ref(q[:, T:], k, v, seg, block)], axis=1)
    want, want_g = _vg(ref, q, k, v, w)
    mesh = jax.make_mesh((8 // context, context), ("fsdp", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        tok = NamedSharding(mesh, P(None, "context"))
        two = lambda q, k, v: jnp.concatenate(context_two_stream_attention(  # noqa: E731
            q[:, :T], q[:, T:], k[:, :T], k[:, T:], v[:, :T], v[:, T:], jax.device_put(seg, tok), block_size=block,
            backend=backend), axis=1)
        got, got_g = _vg(two, q, k, v, w)
    what = f"{backend} two streams b{block} c{context}"
    assert_rel_close(got, want, FP32_REL, f"{what} output")
    for name, a, b in zip("qkv", got_g, want_g):
        assert_rel_close(a, b, FP32_REL, f"{what} d{name}")


def test_context_attention_checks_the_split():
    q, k, v, _ = _inputs("noisy")
    mesh = jax.make_mesh((1, 8), ("fsdp", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="multiple of block_size 16"):
        fast_jit(lambda q, k, v: context_stream_attention(q, k, v, jnp.asarray(SEG), stream="noisy",
                                                          block_size=16))(q, k, v)


@pytest.mark.parametrize("stream,block,context", [("clean", 1, 4), ("noisy", 4, 4), ("noisy", 4, 8), ("clean", 1, 2)])
def test_zigzag_context_attention_equals_one_device(stream, block, context):
    """The zigzag layout (shard i holds row pieces i and 2n-1-i): inputs permuted into it, the
    output permuted back, values and dq, dk, dv equal the one-device row (the masks compare row
    positions, so a shard's late piece sees the whole row before it, its early piece only its
    own prefix). Noisy keys [B, 2T]: each stream permuted on its own."""
    from pallas_kernels.context.layout import from_layout, to_layout

    q, k, v, w = _inputs(stream)
    seg = jnp.asarray(SEG)
    if stream == "clean":
        ref = lambda q, k, v: clean_attention_ref(q, k, v, seg)  # noqa: E731
    else:
        ref = lambda q, k, v: noisy_attention_ref(q, k, v, seg, block)  # noqa: E731
    want, want_g = _vg(ref, q, k, v, w)
    lay = lambda x: to_layout(x, context, "zigzag")  # noqa: E731
    keys = lambda x: lay(x) if stream == "clean" else jnp.concatenate([lay(x[:, :T]), lay(x[:, T:])], axis=1)  # noqa: E731

    def zz(q, k, v):
        out = context_stream_attention(lay(q), keys(k), keys(v), lay(seg), stream=stream, block_size=block,
                                       layout="zigzag")
        return from_layout(out, context, "zigzag")

    mesh = jax.make_mesh((8 // context, context), ("fsdp", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        got, got_g = _vg(zz, q, k, v, w)
    assert_rel_close(got, want, FP32_REL, f"zigzag {stream} b{block} c{context} output")
    for name, a, b in zip("qkv", got_g, want_g):
        assert_rel_close(a, b, FP32_REL, f"zigzag {stream} b{block} c{context} d{name}")


@pytest.mark.parametrize("backend,stream,block,context", [("splash", "clean", 1, 4), ("flash", "noisy", 4, 4),
                                                          ("splash", "noisy", 4, 2)])
def test_zigzag_kernels_equal_one_device_reference(backend, stream, block, context):
    """The kernels per shard (interpreted) under the zigzag layout: splash runs the shard's two pieces
    as one query row over the row's keys with the shard's own block tables, flash each piece as a row
    with its own rolled keys (the row's pieces in row order, that piece last, later ones masked by
    id); values and dq, dk, dv equal the one-device reference."""
    from pallas_kernels.context.layout import from_layout, to_layout

    q, k, v, w = _inputs(stream)
    seg = jnp.asarray(SEG)
    want, want_g = _vg(lambda q, k, v: stream_attention(q, k, v, seg, stream=stream, block_size=block,
                                                        backend="reference"), q, k, v, w)
    lay = lambda x: to_layout(x, context, "zigzag")  # noqa: E731
    keys = lambda x: lay(x) if stream == "clean" else jnp.concatenate([lay(x[:, :T]), lay(x[:, T:])], axis=1)  # noqa: E731

    def zz(q, k, v):
        out = context_stream_attention(lay(q), keys(k), keys(v), lay(seg), stream=stream, block_size=block,
                                       backend=backend, layout="zigzag")
        return from_layout(out, context, "zigzag")

    mesh = jax.make_mesh((8 // context, context), ("fsdp", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        got, got_g = _vg(zz, q, k, v, w)
    what = f"zigzag {backend} {stream} b{block} c{context}"
    assert_rel_close(got, want, FP32_REL, f"{what} output")
    for name, a, b in zip("qkv", got_g, want_g):
        assert_rel_close(a, b, FP32_REL, f"{what} d{name}")
