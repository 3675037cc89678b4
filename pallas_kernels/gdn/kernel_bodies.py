"""The kernel bodies of the phase-split GDN that both platforms' ``pallas_call``s run (the TPU form,
:mod:`pallas_kernels.gdn.tpu_calls`, and the GPU form, :mod:`pallas_kernels.gdn.gpu_calls`): their
static options (``KernelConfig``, ``BlockPlan``), the grid helpers, and the bodies of the parallel
kernels (intra-chunk WY, the noisy readout, the parallel backward with its operands and specs).

Layout as in :mod:`pallas_kernels.gdn.tpu_calls`: ``q, k`` [B, Tp, HK * K], ``v`` [B, Tp, H * V],
``aux`` fp32 [B, H, N, AUX, C]; a body sees one grid step's tiles (G chunks of C tokens of one row
and head). Per-chunk math: :mod:`pallas_kernels.gdn.phase_math`; block mode:
:mod:`pallas_kernels.gdn.block_phase_math`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import block_math as bm
from . import block_phase_math as bpm
from . import chunk_math as cm
from . import phase_math as pm
from .chunk_math import AUX_WIDTH as AUX

f32 = jnp.float32
#: tokens per grid step of the parallel kernels (G chunks of C): amortises the per-step overhead
GROUP_TOKENS = 256


def key_head(h, rep: int):
    """The key head of value head h (h // rep for h >= 0). Truncating `lax.div`, not `//`: Python's
    floor division lowers through `sign`, whose Mosaic rule asks for the local TPU's generation and
    so fails in an AOT compile whose default device is a CPU."""
    return jax.lax.div(h, jnp.int32(rep))


def group_size(N: int, C: int, multiple: int = 1) -> int:
    """G: the largest divisor of N that is a multiple of ``multiple`` with G * C <= GROUP_TOKENS
    (at least ``multiple``, which must divide N)."""
    return max(g for g in range(multiple, N + 1, multiple)
               if N % g == 0 and (g == multiple or g * C <= GROUP_TOKENS))


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static options of the phase kernels (both forms).

    chunk_size: C, tokens per chunk (64 default, the value HF and fla use).
    scale: multiplier of q (dk ** -0.5 by convention), applied in fp32 inside the kernels.
    block_v: value-tile width W of the GPU form's sweeps and output kernel (None: its launch table,
        :mod:`pallas_kernels.gdn.gpu_calls`); the TPU form always takes the whole dv.
    low_dtype: operand dtype of the chunk matmuls for low-precision inputs (None = fp32 HIGHEST).
    inverse: the intra kernel's triangular inverse, one of ``chunk_math.INVERSES`` (None: the form's
        default, :data:`FORM_INVERSE`).
    """
    chunk_size: int = 64
    scale: float = 1.0
    block_v: int | None = None
    low_dtype: str | None = None
    inverse: str | None = None

    def __post_init__(self):
        if self.inverse is not None and self.inverse not in cm.INVERSES:
            raise ValueError(f"KernelConfig.inverse must be one of {cm.INVERSES} or None; got {self.inverse!r}")

    def mm(self) -> cm.MatmulPolicy:
        return cm.MatmulPolicy(None if self.low_dtype is None else jnp.dtype(self.low_dtype))

    def inverse_for(self, form: str) -> str:
        """The triangular inverse the ``form`` ("tpu" / "gpu") runs."""
        return self.inverse or FORM_INVERSE[form]


#: each form's default inverse. GPU: the blocked one (16 x 16 diagonal tiles, then merges: 4 dependent
#: matmuls of 16 / 32 wide blocks instead of 12 of 64 x 64 x 64, which Triton runs as fp32 FMA, not
#: on tensor cores). TPU: the doubling one, unchanged (its splits of a [64, 64] value into 16-lane
#: pieces would be relayouts in Mosaic; not measured).
FORM_INVERSE = {"tpu": "doubling", "gpu": "blocked"}


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Block mode on the phases (:mod:`pallas_kernels.gdn.block_phase_math`): noisy blocks of
    ``block`` tokens, clean chunks of ``chunk``; one must divide the other. A readout tile is R =
    max(block, chunk) rows starting at every rb-th chunk; ``mid``: blocks start inside chunks."""
    block: int
    chunk: int

    def __post_init__(self):
        if self.block % self.chunk and self.chunk % self.block:
            raise ValueError(f"block_size {self.block} and chunk_size {self.chunk}: one must divide the other "
                             "(the readout tiles must tile both grids)")

    @property
    def R(self) -> int:
        return max(self.block, self.chunk)

    @property
    def rb(self) -> int:
        return self.R // self.chunk

    @property
    def mid(self) -> bool:
        return self.block < self.chunk


def at_tile_start(c, rb: int):
    """Decorator: run the body at chunks c % rb == 0 (always when rb == 1)."""
    if rb == 1:
        return lambda body: body()
    return pl.when(jax.lax.rem(c, jnp.int32(rb)) == 0)


def call_dims(q, v, aux, K: int):
    B, Tp, HKK = q.shape
    _, H, N, _, C = aux.shape
    HK, V = HKK // K, v.shape[-1] // H
    if N * C != Tp or H % HK:
        raise ValueError(f"q {q.shape}, v {v.shape}, aux {aux.shape}: need Tp = N*C and H % HK == 0")
    return B, Tp, H, HK, V, C, N, H // HK


def intra_kernel(*refs, cfg, G, C, with_T_in, inverse: str = "doubling"):
    if with_T_in:
        k_ref, v_ref, aux_ref, Tin_ref, w_ref, u_ref = refs
    else:
        k_ref, v_ref, aux_ref, T_ref, w_ref, u_ref = refs
    mm = cfg.mm()
    for j in range(G):  # static unroll: G independent chunks, their matmuls interleave freely
        rows = pl.ds(j * C, C)
        k, v, aux = k_ref[rows, :], v_ref[rows, :], aux_ref[j]
        if with_T_in:
            T = Tin_ref[j]
        else:
            T = pm.chunk_inverse(k, aux, mm, inverse)
            T_ref[j] = T
        w, u = pm.chunk_wy(k, v, aux, T, mm)
        w_ref[rows, :] = w.astype(w_ref.dtype)
        u_ref[rows, :] = u.astype(u_ref.dtype)


def noisy_forward_kernel(qn_ref, kn_ref, vn_ref, auxn_ref, r_ref, on_ref, ph_ref, *, cfg, G, R):
    for j in range(G):  # static unroll: G independent readout tiles
        rows = pl.ds(j * R, R)
        on, ph = bm.readout_combine(qn_ref[rows, :], kn_ref[rows, :], vn_ref[rows, :], auxn_ref[j], r_ref[rows, :],
                                    cfg.mm())
        on_ref[rows, :] = on.astype(on_ref.dtype)
        ph_ref[j] = ph


def parallel_backward_kernel(q_ref, k_ref, v_ref, aux_ref, T_ref, w_ref, u_ref, st_ref, dst_ref, do_ref, *refs,
                              cfg, G, C, K, V, rep, plan, W: int | None = None):
    """One grid step of the parallel backward: G chunks of one key head and its rep value heads, each
    value head in value tiles of W columns (None: all of dv). The delta rule's columns are independent and
    every cotangent is linear in (dO, dS'), so a tile's dq, dk, daux are partial sums over its columns
    (summed here in fp32) and its dv is its own; a tile holds [K, W] states, not [K, dv]."""
    n_in = 5 if plan else 0
    qn_ref, kn_ref, vn_ref, auxn_ref, don_ref = refs[:n_in] if plan else (None,) * 5
    dq_ref, dk_ref, dv_ref, daux_ref = refs[n_in:n_in + 4]
    dqn_ref, dkn_ref, dvn_ref, dauxn_ref = refs[n_in + 4:] if plan else (None,) * 4
    kw = dict(scale=cfg.scale, mm=cfg.mm())
    R = plan.R if plan else C
    W = W or V
    outs = dict(dq=dq_ref, dk=dk_ref, dqn=dqn_ref, dkn=dkn_ref)
    sums = {}   # (output, first row) -> its sum over this key head's value heads and value tiles

    def add(name, at, x, into=sums):
        into[name, at] = x if (name, at) not in into else into[name, at] + x

    for j in range(G):
        r = pl.ds(j * C, C)
        q, k = q_ref[r, :], k_ref[r, :]
        for h in range(rep):  # the value heads of this key head: their dq, dk (dqn, dkn) sum here
            kc = pl.ds(h * K, K)
            tiles = {}   # this value head's daux (dauxn), summed over its value tiles
            for i in range(V // W):
                vc, sc = pl.ds(h * V + i * W, W), pl.ds(i * W, W)
                S = st_ref[h, pl.ds(j * K, K), sc]
                clean = (q, k, v_ref[r, vc], aux_ref[h, j], T_ref[h, j], w_ref[r, kc], u_ref[r, vc], S,
                         do_ref[r, vc], dst_ref[h, pl.ds(j * K, K), sc])
                if plan and plan.mid:   # the chunk's readouts are in its deltas: one composition
                    dq, dk, dv, daux, *noisy = bpm.chunk_block_parallel_backward(
                        *clean, qn_ref[r, :], kn_ref[r, :], vn_ref[r, vc], auxn_ref[h, j], don_ref[r, vc], **kw)
                else:
                    dq, dk, dv, daux = pm.chunk_parallel_backward(*clean, **kw)
                    noisy = None
                    if plan and j % plan.rb == 0:   # a block starts at this chunk: its state is S
                        t = pl.ds(j * C, R)
                        noisy = bpm.noisy_tile_backward(qn_ref[t, :], kn_ref[t, :], vn_ref[t, vc],
                                                        auxn_ref[h, j // plan.rb], S, don_ref[t, vc], **kw)[:4]
                add("dq", j * C, dq)
                add("dk", j * C, dk)
                dv_ref[r, vc] = dv.astype(dv_ref.dtype)
                add("daux", j, daux, tiles)
                if noisy is not None:
                    dqn, dkn, dvn, dauxn = noisy
                    add("dqn", j * C, dqn)
                    add("dkn", j * C, dkn)
                    dvn_ref[pl.ds(j * C, R), vc] = dvn.astype(dvn_ref.dtype)
                    add("dauxn", j // plan.rb, dauxn, tiles)
            for (name, at), x in tiles.items():
                (daux_ref if name == "daux" else dauxn_ref)[h, at] = x
    for (name, row), x in sums.items():
        ref = outs[name]
        ref[pl.ds(row, x.shape[0]), :] = x.astype(ref.dtype)


def parallel_backward_io(q, k, v, aux, T, w, u, states, dstates, dO, noisy, *, G: int, rep: int, C: int, K: int,
                         V: int):
    """(args, in_specs, out_specs, out_shape) of the parallel backward on the (row, key head, chunk
    group of G) grid, shared by the TPU and GPU forms: key columns [G*C, K], a key head's rep value
    heads' columns [G*C, rep*K | rep*V], aux [rep, G, AUX, C], inverses [rep, G, C, C], states
    [rep, G*K, V]; with ``noisy`` (block mode) the noisy stream's q, k, v, aux and dO too, its aux in
    readout tiles of R tokens (G / plan.rb tiles per step)."""
    kq = pl.BlockSpec((None, G * C, K), lambda b, h, n: (b, n, h))
    kw = pl.BlockSpec((None, G * C, rep * K), lambda b, h, n: (b, n, h))
    vw = pl.BlockSpec((None, G * C, rep * V), lambda b, h, n: (b, n, h))
    ax = pl.BlockSpec((None, rep, G, AUX, C), lambda b, h, n: (b, h, n, 0, 0))
    tt = pl.BlockSpec((None, rep, G, C, C), lambda b, h, n: (b, h, n, 0, 0))
    st = pl.BlockSpec((None, rep, G * K, V), lambda b, h, n: (b, h, n, 0))
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(aux.shape, f32)]
    args = (q, k, v, aux, T, w, u, states, dstates, dO)
    in_specs, out_specs = [kq, kq, vw, ax, tt, kw, vw, st, st, vw], [kq, kq, vw, ax]
    if noisy is not None:
        qn, kn, vn, auxn, dOn, plan = noisy
        nax = pl.BlockSpec((None, rep, G // plan.rb, AUX, plan.R), lambda b, h, n: (b, h, n, 0, 0))
        args = args + (qn, kn, vn, auxn, dOn)
        in_specs += [kq, kq, vw, nax, vw]
        out_specs += [kq, kq, vw, nax]
        out_shape += [jax.ShapeDtypeStruct(qn.shape, qn.dtype), jax.ShapeDtypeStruct(kn.shape, kn.dtype),
                      jax.ShapeDtypeStruct(vn.shape, vn.dtype), jax.ShapeDtypeStruct(auxn.shape, f32)]
    return args, in_specs, out_specs, out_shape
