"""The two training streams through JAX's maintained TPU splash attention kernel
(``jax.experimental.pallas.ops.tpu.splash_attention``: forward and backward Pallas/Mosaic kernels
that skip fully masked tiles). Nothing here writes a kernel; it states the masks and the layout.

Masks (docs/design.md 3.1), both = a static position mask AND segment-id equality (``SegmentIds``: packed
documents never meet; pads are one more segment):

- clean stream: queries [T] over clean keys [T], ``CausalMask`` (key slot <= query slot);
- noisy stream: noisy queries [T] over keys [2T] = clean slots 0..T-1 || noisy slots T..2T-1,
  ``NoisyBlockMask``: a clean key is visible iff it is strictly before the query's block start, a
  noisy key iff it is in the query's block (blocks on the row grid). Splash skips the tiles where
  this is all False, so the noisy stream costs about one more causal pass, not a dense [T, 2T] one.

Layout: the model's [B, T, H, D] is moved to the kernel's [H, T, D] per row (vmapped over B); GQA
is native (query head h reads KV head h // (H / K)). T is padded to a whole number of 128-lane tiles
with a segment id no document uses (:mod:`pallas_kernels.attention.inputs`).
The 1/sqrt(D) scale is applied to q before the kernel (splash applies none).

Platform: with ``interpret=None`` the Mosaic kernel is lowered for TPU and the Pallas interpreter
everywhere else, chosen at lowering time (``lax.platform_dependent``), so an AOT compile for a TPU
topology on a CPU host gets the real kernel while CPU tests run the same kernel interpreted.
Under a multi-device mesh the kernel runs in ``shard_map`` over batch and KV-head groups
(:mod:`pallas_kernels.common.sharding`); T stays whole on every device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sa_mask
from jax.sharding import PartitionSpec as P

from ..common import sharding
from .inputs import check_stream_inputs, pad_stream_rows

LANES = 128  # splash tiles are multiples of the 128-lane vreg width
#: largest tile first: 512 x 512 tiles keep the MXU busy at head dim 256 and fit VMEM in fwd and bwd
TILE_CHOICES = (512, 256, 128)

Stream = Literal["clean", "noisy"]


class NoisyBlockMask(sa_mask._ComputableMask):
    """[T, 2T] static mask of noisy queries over clean || noisy keys (module docstring).

    ``prefix`` = P > 0 (a context shard, :mod:`pallas_kernels.context.attention`): [T, P + 2T] over
    P clean keys visible to every query (the other shards' keys), the T queries' own clean keys and
    their noisy keys; query i has slot P + i.

    The q-side index the kernel hands to ``mask_function`` is each query's block start (``q_sequence``
    is set to ``slot - slot % block_size``), so the in-kernel mask is three integer comparisons, no
    division. Hashable (splash caches the mask processing by it)."""

    def __init__(self, t: int, block_size: int, prefix: int = 0):
        if t % block_size or prefix % block_size:
            raise ValueError(f"NoisyBlockMask: length {t} (prefix {prefix}) is not a multiple of block_size "
                             f"{block_size}")
        self.t, self.block_size, self.prefix = int(t), int(block_size), int(prefix)

        def noisy_block_mask(start, kv):
            clean_ok = kv < start  # only clean keys: start <= query slot < P + T
            noisy_ok = (kv >= start + self.t) & (kv < start + (self.t + self.block_size))
            return clean_ok | noisy_ok

        super().__init__(shape=(self.t, self.prefix + 2 * self.t), mask_function=noisy_block_mask)
        slots = np.arange(self.t, dtype=np.int32)
        self.q_sequence = self.prefix + slots - slots % self.block_size

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NoisyBlockMask):
            return NotImplemented
        return (self.t, self.block_size, self.prefix) == (other.t, other.block_size, other.prefix)

    def __hash__(self) -> int:
        return hash((NoisyBlockMask, self.t, self.block_size, self.prefix))


def _tile(n: int) -> int:
    return next(b for b in TILE_CHOICES if n % b == 0)


def block_sizes_for(tq: int, tk: int) -> sa.BlockSizes:
    """Forward and backward tiles for lane-padded lengths (multiples of 128): the largest of
    ``TILE_CHOICES`` that divides each. Numerics do not depend on them."""
    bq, bk = _tile(tq), _tile(tk)
    return sa.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                         block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)


def stream_mask(stream: Stream, tp: int, block_size: int, prefix: int = 0) -> sa_mask._ComputableMask:
    """One head's static mask for ``tp`` queries after ``prefix`` clean keys they all see (a context
    shard's gathered keys; 0 on one device): [tp, prefix + tp] causal or [tp, prefix + 2 tp] noisy."""
    if stream == "clean":
        return sa.CausalMask((tp, prefix + tp), offset=prefix)
    return NoisyBlockMask(tp, block_size, prefix)


def _kernel(stream: Stream, heads: int, tp: int, block_size: int, interpret: bool, prefix: int = 0):
    """The splash kernel of one stream for ``heads`` local query heads and padded length ``tp``."""
    mask = stream_mask(stream, tp, block_size, prefix)
    tk = mask.shape[1]
    return sa.make_splash_mha(sa.MultiHeadMask([mask] * heads), block_sizes=block_sizes_for(tp, tk),
                              head_shards=1, q_seq_shards=1, interpret=interpret)


def _at_default_precision(f, q, k, v, q_seg, kv_seg, *tables):
    """``f(q, k, v, q_seg, kv_seg, *tables)`` with its forward and its backward kernels traced at
    DEFAULT matmul precision: splash's dots take the global precision, and Mosaic rejects an fp32
    contraction of bf16 operands (a global ``jax_default_matmul_precision="highest"``, as the tests
    set, would ask for one). The backward is traced when the cotangent arrives, so it is wrapped too.
    ``tables``: integer operands of the kernel (no cotangent)."""
    default = lambda: jax.default_matmul_precision("default")  # noqa: E731

    @jax.custom_vjp
    def call(q, k, v, q_seg, kv_seg, *tables):
        with default():
            return f(q, k, v, q_seg, kv_seg, *tables)

    def fwd(q, k, v, q_seg, kv_seg, *tables):
        with default():
            out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, q_seg, kv_seg, *tables), q, k, v)
        return out, vjp

    def bwd(vjp, g):
        with default():
            return (*vjp(g), None, None) + (None,) * len(tables)

    call.defvjp(fwd, bwd)
    return call(q, k, v, q_seg, kv_seg, *tables)


def per_device(stream: Stream, block_size: int, mode: bool | None, prefix: int = 0, make_kernel=None):
    """The kernel on one device's blocks: [B, H, Tp, D] (pre-scaled q), [B, K, S, D] x2, q segments
    [B, Tp], kv segments [B, S] (, *tables) -> [B, H, Tp, D]; S = ``prefix`` + Tp (clean) or + 2 Tp
    (noisy). ``make_kernel(heads, interpret, *tables)``, if given, supplies the kernel instead (its
    own mask tables, e.g. :func:`pallas_kernels.context.splash_rows.shard_kernel`; S is then
    whatever it expects); traced ``tables`` (a shard index) are passed as operands, not closed over:
    the TPU branch of ``platform_dependent`` cannot lower a captured tracer."""

    def run(q, k, v, q_seg, kv_seg, *tables, interpret: bool):
        def rows(q, k, v, q_seg, kv_seg, *tables):  # the kernel (its mask tables) is built inside every trace
            if make_kernel is not None:
                kernel = make_kernel(q.shape[1], interpret, *tables)
            else:
                kernel = _kernel(stream, q.shape[1], q.shape[2], block_size, interpret, prefix)
            one = lambda q1, k1, v1, s1, s2: kernel(q1, k1, v1, segment_ids=sa.SegmentIds(s1, s2))  # noqa: E731
            return jax.vmap(one)(q, k, v, q_seg, kv_seg)

        if q.dtype == jnp.float32:  # fp32 keeps the caller's precision (HIGHEST in the parity tests)
            return rows(q, k, v, q_seg, kv_seg, *tables)
        return _at_default_precision(rows, q, k, v, q_seg, kv_seg, *tables)

    def call(*args):
        if mode is not None:
            return run(*args, interpret=mode)
        return lax.platform_dependent(*args, tpu=lambda *a: run(*a, interpret=False),
                                      default=lambda *a: run(*a, interpret=True))

    return call


def splash_attention(
    q_BTHD: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    segment_ids_BT: jax.Array,
    *,
    stream: Stream,
    block_size: int = 1,
    interpret: bool | None = None,
    mesh=None,
    batch_axes: Sequence[str] | None = None,
    head_axes: Sequence[str] | None = None,
) -> jax.Array:
    """One training stream's attention core through splash.

    Args:
        q_BTHD: [B, T, H, D] rotated queries (unscaled).
        k_BSKD, v_BSKD: [B, S, K, D] keys / values; S = T for ``stream="clean"``, S = 2T (clean slots
            || noisy slots) for ``stream="noisy"``. H must be a multiple of K.
        segment_ids_BT: [B, T] int document ids of the row (the noisy slots share them).
        block_size: the noisy stream's row-grid block (T must be a multiple); unused for "clean".
        interpret: None = Mosaic on TPU, the interpreter elsewhere; True / False force one.
        mesh, batch_axes, head_axes: as for the GDN kernels (``pallas_kernels.common.sharding``); heads
            are split in KV groups, so the head axes must divide K.

    Returns:
        [B, T, H, D] in q's dtype (softmax statistics and accumulation are fp32 inside the kernel).
    """
    b, t = q_BTHD.shape[:2]
    kv = k_BSKD.shape[2]
    check_stream_inputs("splash_attention", q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, stream, block_size)
    tp = -(-t // LANES) * LANES
    args = pad_stream_rows(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, stream, tp)
    core = lambda *a: splash_core(*a, stream=stream, block_size=block_size, interpret=interpret)  # noqa: E731
    mesh = sharding.active_mesh(mesh)
    if mesh is None:
        out = core(*args)
    else:
        b_axes, h_axes = sharding.gdn_mesh_axes(mesh, b, kv, batch_axes, head_axes)
        heads, rows = P(b_axes, None, h_axes, None), P(b_axes)
        out = sharding.run_sharded(core, mesh, (heads, heads, heads, rows, rows), heads, *args)
    return out[:, :t]


def splash_core(q, k, v, q_seg, kv_seg, *tables, stream: Stream, block_size: int, interpret: bool | None,
                prefix: int = 0, make_kernel=None) -> jax.Array:
    """The kernel on one device's blocks in the model's layout: q [B, Tp, H, D] (unscaled), k, v
    [B, S, K, D], q_seg [B, Tp], kv_seg [B, S] int32, Tp a whole number of tiles, S = ``prefix`` +
    Tp (clean) or + 2 Tp (noisy), the queries after ``prefix`` clean keys (``stream_mask``), or the
    keys ``make_kernel`` expects, given ``tables`` (``per_device``). Returns [B, Tp, H, D]."""
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, T, H, D] <-> [B, H, T, D]
    q = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    core = per_device(stream, block_size if stream == "noisy" else 1, interpret, prefix, make_kernel)
    out = core(heads_first(q), heads_first(k.astype(q.dtype)), heads_first(v.astype(q.dtype)), q_seg, kv_seg,
               *tables)
    return heads_first(out)
