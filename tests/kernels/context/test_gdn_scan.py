"""The cross-shard GDN (pallas_kernels/context/gdn_scan.py) against the one-device chunked references:
values, final state and gradients, clean stream and block mode, on meshes with context = 2, 4, 8
(8 simulated CPU devices), with an initial state, packed documents that cross shard boundaries, a
pad run, and a document that starts exactly at a shard boundary."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels import block_gated_delta_rule_ref, chunk_gated_delta_rule_ref
from pallas_kernels.context.axis import context_size
from pallas_kernels.context.gdn_scan import (augmented_sweep, context_block_gated_delta_rule,
                                             context_chunk_gated_delta_rule)
from tests.model.parity_utils import FP32_REL, assert_rel_close, fast_jit

B, T, H, DK, DV = 2, 32, 2, 8, 6


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    q, k, qn, kn = (f(unit(rng.normal(size=(B, T, H, DK)))) for _ in range(4))
    v, vn = f(rng.normal(size=(B, T, H, DV))), f(rng.normal(size=(B, T, H, DV)))
    g = f(-np.exp(rng.normal(size=(B, T, H))) * 0.2)  # slow decay: the entry state matters far in
    beta = f(1 / (1 + np.exp(-rng.normal(size=(B, T, H)))))
    scalars = f(np.stack([rng.uniform(1, 4, H), rng.normal(size=H), rng.uniform(0.5, 1.5, H)], axis=1))
    init = f(rng.normal(size=(B, H, DK, DV)) * 0.5)
    return (q, k, v, g, beta), (qn, kn, vn, scalars), init


def _segments() -> jnp.ndarray:
    """Row 0: one document over the whole row (every shard continues it). Row 1: documents that
    cross shard boundaries for every context size, a pad run (0) and a document starting at slot 16
    (a shard boundary for context 2, 4 and 8) with id 1 again (a reused id is a new document)."""
    seg = np.ones((B, T), np.int32)
    seg[1, :12], seg[1, 12:16], seg[1, 16:28], seg[1, 28:] = 1, 0, 1, 3
    return jnp.asarray(seg)


def _mesh(context: int):
    """A (fsdp, context) mesh over all 8 devices: context is combined with an automatic axis."""
    return jax.make_mesh((8 // context, context), ("fsdp", "context"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _place(mesh, *xs):
    """Rows over fsdp where they divide, sequence over context (what `length -> context` gives)."""
    out = []
    for x in xs:
        spec = P(None, "context", *([None] * (x.ndim - 2))) if x.ndim >= 2 and x.shape[:2] == (B, T) else P()
        out.append(jax.device_put(x, NamedSharding(mesh, spec)))
    return out


def test_augmented_sweep_is_the_affine_map():
    """Property the method rests on: one pass on [v | 0] from [0 | I] gives the zero-entry run and the
    map A with S_out = A S_in + B, for any S_in (checked against a direct run from S_in)."""
    (q, k, v, g, beta), _, init = _inputs(0)
    seg = _segments()
    o_aug, fin = fast_jit(lambda *a: augmented_sweep(*a, seg, 8))(q, k, v, g, beta)
    o_ref, fin_ref = fast_jit(lambda *a: chunk_gated_delta_rule_ref(*a, initial_state=init, segment_ids=seg,
                                                                    chunk_size=8))(q, k, v, g, beta)
    mapped = fin[..., DV:] @ init + fin[..., :DV]
    assert_rel_close(mapped, fin_ref, FP32_REL, "A S_in + B")
    assert_rel_close(o_aug[..., :DV] + jnp.einsum("bthk,bhkv->bthv", o_aug[..., DV:], init), o_ref, FP32_REL, "o")
    # row 1 starts a new document at slot 16: nothing of the entry state survives it
    assert float(jnp.max(jnp.abs(fin[1, ..., DV:]))) == 0.0


@pytest.mark.parametrize("context", [2, 4, 8])
@pytest.mark.parametrize("with_init", [True, False])
def test_context_chunk_gdn_matches_one_device(context, with_init):
    (q, k, v, g, beta), _, init = _inputs(context)
    init = init if with_init else None
    seg = _segments()
    kw = dict(segment_ids=seg, chunk_size=4)
    o_ref, fin_ref = fast_jit(lambda *a: chunk_gated_delta_rule_ref(*a, initial_state=init, **kw))(q, k, v, g, beta)
    mesh = _mesh(context)
    with jax.set_mesh(mesh):
        assert context_size() == context
        args = _place(mesh, q, k, v, g, beta)
        o, fin = fast_jit(lambda *a: context_chunk_gated_delta_rule(*a, initial_state=init, **kw))(*args)
    assert_rel_close(o, o_ref, FP32_REL, f"o, context {context}")
    assert_rel_close(fin, fin_ref, FP32_REL, f"final state, context {context}")


def _loss(fn):
    """A scalar of outputs and final state with random weights (so no gradient term is trivial)."""
    def loss(*a):
        outs = fn(*a)
        return sum(jnp.sum(x * jnp.sin(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape))) for x in outs)
    return loss


@pytest.mark.parametrize("context", [2, 8])
def test_context_chunk_gdn_gradients(context):
    (q, k, v, g, beta), _, init = _inputs(10 + context)
    seg = _segments()
    kw = dict(segment_ids=seg, chunk_size=4)
    argn = tuple(range(6))
    want = fast_jit(jax.grad(_loss(lambda *a: chunk_gated_delta_rule_ref(*a[:5], initial_state=a[5], **kw)), argn))(
        q, k, v, g, beta, init)
    mesh = _mesh(context)
    with jax.set_mesh(mesh):
        args = _place(mesh, q, k, v, g, beta, init)
        got = fast_jit(jax.grad(_loss(lambda *a: context_chunk_gated_delta_rule(*a[:5], initial_state=a[5], **kw)),
                                argn))(*args)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, want):
        assert_rel_close(a, b, FP32_REL, f"d{name}, context {context}")


@pytest.mark.parametrize("context,block,chunk", [(2, 4, 4), (8, 4, 2), (4, 8, 4)])
def test_context_block_gdn_matches_one_device(context, block, chunk):
    """Both streams, values and gradients; block = chunk (one sweep) and block != chunk (two)."""
    (q, k, v, g, beta), (qn, kn, vn, sc), init = _inputs(20 + context)
    seg = _segments()
    kw = dict(block_size=block, segment_ids=seg, chunk_size=chunk)
    ref = lambda *a: block_gated_delta_rule_ref(*a[:9], initial_state=a[9], **kw)  # noqa: E731
    ctx = lambda *a: context_block_gated_delta_rule(*a[:9], initial_state=a[9], **kw)  # noqa: E731
    args = (q, k, v, g, beta, qn, kn, vn, sc, init)
    want = fast_jit(ref)(*args)
    argn = tuple(range(10))
    want_g = fast_jit(jax.grad(_loss(ref), argn))(*args)
    mesh = _mesh(context)
    with jax.set_mesh(mesh):
        placed = _place(mesh, *args)
        got = fast_jit(ctx)(*placed)
        got_g = fast_jit(jax.grad(_loss(ctx), argn))(*placed)
    for name, a, b in zip(("o_clean", "o_noisy", "final"), got, want):
        assert_rel_close(a, b, FP32_REL, f"{name}, context {context}")
    names = ("q", "k", "v", "g", "beta", "q_noisy", "k_noisy", "v_noisy", "scalars", "initial_state")
    for name, a, b in zip(names, got_g, want_g):
        assert_rel_close(a, b, FP32_REL, f"d{name}, context {context}")


def test_context_block_gdn_without_initial_state():
    """No carried-in state: shard 0's first block has no history unit, later shards' first blocks do
    exactly when they continue a document."""
    (q, k, v, g, beta), (qn, kn, vn, sc), _ = _inputs(3)
    seg = _segments()
    kw = dict(block_size=4, segment_ids=seg, chunk_size=4)
    want = fast_jit(lambda *a: block_gated_delta_rule_ref(*a, **kw))(q, k, v, g, beta, qn, kn, vn, sc)
    mesh = _mesh(4)
    with jax.set_mesh(mesh):
        placed = _place(mesh, q, k, v, g, beta, qn, kn, vn, sc)
        got = fast_jit(lambda *a: context_block_gated_delta_rule(*a, **kw))(*placed)
    for name, a, b in zip(("o_clean", "o_noisy", "final"), got, want):
        assert_rel_close(a, b, FP32_REL, name)


def test_context_shard_length_is_checked():
    (q, k, v, g, beta), (qn, kn, vn, sc), _ = _inputs(0)
    with jax.set_mesh(_mesh(4)):  # shards of 8 tokens: not a multiple of block 16
        with pytest.raises(ValueError, match="multiple of 16"):
            context_block_gated_delta_rule(q, k, v, g, beta, qn, kn, vn, sc, block_size=16)


@pytest.mark.parametrize("mode", ["clean", "block"])
def test_context_gdn_runs_the_pallas_kernels_per_shard(mode):
    """backend="pallas" (the TPU kernel form, interpreted here) inside every shard of a fsdp 2 x
    context 4 mesh, keys grouped (1 key head for 2 value heads): values and gradients equal the
    one-device reference (which repeats the keys itself)."""
    (q, k, v, g, beta), (qn, kn, vn, sc), init = _inputs(40)
    q, k, qn, kn = (x[:, :, :1] for x in (q, k, qn, kn))
    seg = _segments()
    kw = dict(segment_ids=seg, chunk_size=4)
    if mode == "clean":
        args, ref = (q, k, v, g, beta, init), chunk_gated_delta_rule_ref
        ctx = context_chunk_gated_delta_rule
        call = lambda f, **b: lambda *a: f(*a[:5], initial_state=a[5], **kw, **b)  # noqa: E731
    else:
        args, ref = (q, k, v, g, beta, qn, kn, vn, sc, init), block_gated_delta_rule_ref
        ctx = context_block_gated_delta_rule
        call = lambda f, **b: lambda *a: f(*a[:9], initial_state=a[9], block_size=4, **kw, **b)  # noqa: E731
    argn = tuple(range(len(args)))
    want = fast_jit(call(ref))(*args)
    want_g = fast_jit(jax.grad(_loss(call(ref)), argn))(*args)
    mesh = _mesh(4)
    with jax.set_mesh(mesh):
        placed = _place(mesh, *args)
        got = fast_jit(call(ctx, backend="pallas"))(*placed)
        got_g = fast_jit(jax.grad(_loss(call(ctx, backend="pallas")), argn))(*placed)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_rel_close(a, b, FP32_REL, f"{mode} output {i}")
    for i, (a, b) in enumerate(zip(got_g, want_g)):
        assert_rel_close(a, b, FP32_REL, f"{mode} grad {i}")


# ---------------------------------------------------------------------------------------------
# the zig-zag layout: shard i holds row pieces i and 2n-1-i (pallas_kernels/context/layout.py); the
# inputs are permuted into that order, the outputs back, and everything must equal the row-order
# one-device run (values, final state, every gradient through the permutation)
def _zigzag(fn, n: int, tok_args: int):
    """`fn` on row-order arguments, its first `tok_args` arrays and its [B, T] token outputs in the
    zig-zag order across the call."""
    from pallas_kernels.context.layout import from_layout, to_layout

    def run(*a):
        a = [to_layout(x, n, "zigzag") if i < tok_args else x for i, x in enumerate(a)]
        outs = fn(*a)
        return tuple(from_layout(o, n, "zigzag") if o.ndim >= 2 and o.shape[:2] == (B, T) else o for o in outs)

    return run


@pytest.mark.parametrize("context", [2, 4])
def test_zigzag_chunk_gdn_matches_one_device(context):
    (q, k, v, g, beta), _, init = _inputs(50 + context)
    seg = _segments()
    kw = dict(chunk_size=4)
    ref = lambda *a: chunk_gated_delta_rule_ref(*a[:5], segment_ids=a[5], initial_state=a[6], **kw)  # noqa: E731
    ctx = _zigzag(lambda *a: context_chunk_gated_delta_rule(*a[:5], segment_ids=a[5], initial_state=a[6],
                                                            layout="zigzag", **kw), context, 6)
    args = (q, k, v, g, beta, seg, init)
    argn = (0, 1, 2, 3, 4, 6)
    want = fast_jit(ref)(*args)
    want_g = fast_jit(jax.grad(_loss(ref), argn))(*args)
    mesh = _mesh(context)
    with jax.set_mesh(mesh):
        got = fast_jit(ctx)(*args)
        got_g = fast_jit(jax.grad(_loss(ctx), argn))(*args)
    for name, a, b in zip(("o", "final"), got, want):
        assert_rel_close(a, b, FP32_REL, f"{name}, zigzag context {context}")
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got_g, want_g):
        assert_rel_close(a, b, FP32_REL, f"d{name}, zigzag context {context}")


@pytest.mark.parametrize("context,block,chunk", [(2, 4, 4), (4, 4, 2)])
def test_zigzag_block_gdn_matches_one_device(context, block, chunk):
    """Both streams; every piece's first block re-read from its entry state (the second piece of a
    shard continues a document that ran through the other shards)."""
    (q, k, v, g, beta), (qn, kn, vn, sc), init = _inputs(60 + context)
    seg = _segments()
    kw = dict(block_size=block, chunk_size=chunk)
    ref = lambda *a: block_gated_delta_rule_ref(*a[:8], a[9], segment_ids=a[8], initial_state=a[10], **kw)  # noqa: E731
    ctx = _zigzag(lambda *a: context_block_gated_delta_rule(*a[:8], a[9], segment_ids=a[8], initial_state=a[10],
                                                            layout="zigzag", **kw), context, 9)
    args = (q, k, v, g, beta, qn, kn, vn, seg, sc, init)
    argn = (0, 1, 2, 3, 4, 5, 6, 7, 9, 10)
    want = fast_jit(ref)(*args)
    want_g = fast_jit(jax.grad(_loss(ref), argn))(*args)
    mesh = _mesh(context)
    with jax.set_mesh(mesh):
        got = fast_jit(ctx)(*args)
        got_g = fast_jit(jax.grad(_loss(ctx), argn))(*args)
    for name, a, b in zip(("o_clean", "o_noisy", "final"), got, want):
        assert_rel_close(a, b, FP32_REL, f"{name}, zigzag context {context}")
    names = ("q", "k", "v", "g", "beta", "q_noisy", "k_noisy", "v_noisy", "scalars", "initial_state")
    for name, a, b in zip(names, got_g, want_g):
        assert_rel_close(a, b, FP32_REL, f"d{name}, zigzag context {context}")


def test_zigzag_piece_length_is_checked():
    (q, k, v, g, beta), (qn, kn, vn, sc), _ = _inputs(0)
    with jax.set_mesh(_mesh(4)):  # 8 pieces of 4 tokens: not a multiple of block 8
        with pytest.raises(ValueError, match="8 pieces \\(zigzag layout over 4 shards\\)"):
            context_block_gated_delta_rule(q, k, v, g, beta, qn, kn, vn, sc, block_size=8, layout="zigzag")


def test_zigzag_gdn_runs_the_pallas_kernels_per_shard():
    """The zigzag layout through backend="pallas" (interpreted) inside every shard of fsdp 2 x
    context 4: a shard's two pieces are two rows of one kernel call; values and gradients equal
    the one-device reference."""
    (q, k, v, g, beta), _, init = _inputs(70)
    q, k = q[:, :, :1], k[:, :, :1]
    seg = _segments()
    kw = dict(chunk_size=4)
    ref = lambda *a: chunk_gated_delta_rule_ref(*a[:5], segment_ids=a[5], initial_state=a[6], **kw)  # noqa: E731
    ctx = _zigzag(lambda *a: context_chunk_gated_delta_rule(*a[:5], segment_ids=a[5], initial_state=a[6],
                                                            layout="zigzag", backend="pallas", **kw), 4, 6)
    args = (q, k, v, g, beta, seg, init)
    argn = (0, 1, 2, 3, 4, 6)
    want = fast_jit(ref)(*args)
    want_g = fast_jit(jax.grad(_loss(ref), argn))(*args)
    with jax.set_mesh(_mesh(4)):
        got = fast_jit(ctx)(*args)
        got_g = fast_jit(jax.grad(_loss(ctx), argn))(*args)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_rel_close(a, b, FP32_REL, f"zigzag pallas output {i}")
    for i, (a, b) in enumerate(zip(got_g, want_g)):
        assert_rel_close(a, b, FP32_REL, f"zigzag pallas grad {i}")
