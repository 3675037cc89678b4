"""The ``pallas_call``s of the fused block-mode GDN: the causal sweep of
:mod:`pallas_kernels.gdn_pallas_calls` plus, at the first chunk of every noisy block, the block's
bidirectional readout against the state that is in fast memory at that moment (docs/design.md 5: the
[chunks, H, dk, dv] states are never written out in the forward).

Extra operands (same flat-head layout as the clean ones): ``qn, kn`` [B, T, H*K], ``vn``
[B, T, H*V], ``auxn`` fp32 [B, H, NB, AUX, Bk] (rows in :mod:`pallas_kernels.gdn_block_math`).
A noisy block is ``r`` kernel chunks (Bk = r * C); its tiles are indexed by ``chunk // r`` so they
stay resident while the sweep walks the block's chunks, and are computed at chunk ``r * blk``
(forward) / written at the same chunk, the last one the reverse sweep visits (backward).
The backward adds the readout's d(state) to the carried dS before leaving that chunk.
The state recompute for the backward is the causal ``forward_call(with_states=True)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import gdn_block_math as bm
from . import gdn_chunk_math as cm
from .cost import spec
from .gdn_pallas_calls import AUX, KernelConfig, _dims, _gpu_params, _tpu_params, sweep_cost

f32 = jnp.float32


def _is_block_start(n, r: int):
    return lax.rem(n, r) == 0   # rem, not %: jnp's % lowers through sign, which Mosaic lacks here


# ------------------------------------------------------------------------------------ cost estimates

def readout_forward_step(qn, kn, vn, auxn, S, *, cfg):
    """One noisy block's readout (forward), as the kernels run it at the block's first chunk."""
    return bm.block_readout_forward(qn, kn, vn, auxn, S, scale=cfg.scale, mm=cfg.mm())


def readout_backward_step(qn, kn, vn, auxn, S, dOn, *, cfg):
    return bm.block_readout_backward(qn, kn, vn, auxn, S, dOn, scale=cfg.scale, mm=cfg.mm())


def _readouts(cfg: KernelConfig, qn, vn, dims, r: int, backward: bool):
    """The (step, tiles, static, count) of the B*H*NV*(N/r) block readouts."""
    B, Tp, H, K, V, C, N, W, NV = dims
    Bk = C * r
    specs = (spec((Bk, K), qn.dtype), spec((Bk, K), qn.dtype), spec((Bk, W), vn.dtype), spec((AUX, Bk), f32),
             spec((K, W), f32))
    step = readout_forward_step
    if backward:
        specs, step = specs + (spec((Bk, W), vn.dtype),), readout_backward_step
    return ((step, specs, (("cfg", cfg),), B * H * NV * (N // r)),)


# ------------------------------------------------------------------------------------------ forward

def _fwd_kernel_tpu(q_ref, k_ref, v_ref, aux_ref, s0_ref, qn_ref, kn_ref, vn_ref, auxn_ref,
                    final_ref, o_ref, on_ref, S_ref, *, cfg, r):
    n = pl.program_id(3)

    @pl.when(n == 0)
    def _():
        S_ref[...] = s0_ref[...].astype(f32)

    S = S_ref[...]

    @pl.when(_is_block_start(n, r))
    def _():
        on = bm.block_readout_forward(qn_ref[...], kn_ref[...], vn_ref[...], auxn_ref[...], S,
                                      scale=cfg.scale, mm=cfg.mm())
        on_ref[...] = on.astype(on_ref.dtype)

    o, S_new = cm.chunk_forward(q_ref[...], k_ref[...], v_ref[...], aux_ref[...], S, scale=cfg.scale, mm=cfg.mm())
    o_ref[...] = o.astype(o_ref.dtype)
    S_ref[...] = S_new

    @pl.when(n == pl.num_programs(3) - 1)
    def _():
        final_ref[...] = S_new


def _fwd_kernel_gpu(q_ref, k_ref, v_ref, aux_ref, s0_ref, qn_ref, kn_ref, vn_ref, auxn_ref,
                    final_ref, o_ref, on_ref, *, cfg, r, n_chunks):
    C = cfg.chunk_size
    Bk = C * r

    def body(n, S):
        rows = pl.ds(n * C, C)

        @pl.when(_is_block_start(n, r))
        def _():
            blk = lax.div(n, r)
            brows = pl.ds(blk * Bk, Bk)
            on = bm.block_readout_forward(qn_ref[brows, :], kn_ref[brows, :], vn_ref[brows, :], auxn_ref[blk], S,
                                          scale=cfg.scale, mm=cfg.mm())
            on_ref[brows, :] = on.astype(on_ref.dtype)

        o, S_new = cm.chunk_forward(q_ref[rows, :], k_ref[rows, :], v_ref[rows, :], aux_ref[n], S,
                                    scale=cfg.scale, mm=cfg.mm())
        o_ref[rows, :] = o.astype(o_ref.dtype)
        return S_new

    final_ref[...] = lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(f32))


def block_forward_call(q, k, v, aux, s0, qn, kn, vn, auxn, *, cfg: KernelConfig, r: int, form: str, interpret: bool):
    """Fused forward. Returns (final [B,H,K,V] fp32, o [B,T,H*V], on [B,T,H*V] in v's dtype)."""
    gpu = form == "gpu"
    dims = _dims(q, v, aux, cfg, gpu)
    B, Tp, H, K, V, C, N, W, NV = dims
    Bk = C * r
    out_shape = [jax.ShapeDtypeStruct((B, H, K, V), f32), jax.ShapeDtypeStruct((B, Tp, H * V), v.dtype),
                 jax.ShapeDtypeStruct((B, Tp, H * V), vn.dtype)]
    cost = sweep_cost(cfg, q, v, dims, (q, k, v, aux, s0, qn, kn, vn, auxn), out_shape, backward=False,
                      extra_steps=_readouts(cfg, qn, vn, dims, r, backward=False))
    if not gpu:
        qk = pl.BlockSpec((None, C, K), lambda b, h, j, n: (b, n, h))
        vw = pl.BlockSpec((None, C, W), lambda b, h, j, n: (b, n, h * NV + j))
        kw = pl.BlockSpec((None, None, K, W), lambda b, h, j, n: (b, h, 0, j))
        nqk = pl.BlockSpec((None, Bk, K), lambda b, h, j, n: (b, lax.div(n, r), h))
        nvw = pl.BlockSpec((None, Bk, W), lambda b, h, j, n: (b, lax.div(n, r), h * NV + j))
        in_specs = [qk, qk, vw, pl.BlockSpec((None, None, None, AUX, C), lambda b, h, j, n: (b, h, n, 0, 0)), kw,
                    nqk, nqk, nvw, pl.BlockSpec((None, None, None, AUX, Bk), lambda b, h, j, n: (b, h, lax.div(n, r), 0, 0))]
        call = pl.pallas_call(
            functools.partial(_fwd_kernel_tpu, cfg=cfg, r=r), out_shape=out_shape, grid=(B, H, NV, N),
            in_specs=in_specs, out_specs=[kw, vw, nvw], scratch_shapes=[pltpu.VMEM((K, W), f32)],
            compiler_params=_tpu_params(3), interpret=interpret, name="gdn_block_fwd",
            cost_estimate=cost)
    else:
        qk = pl.BlockSpec((None, Tp, K), lambda b, h, j: (b, 0, h))
        vw = pl.BlockSpec((None, Tp, W), lambda b, h, j: (b, 0, h * NV + j))
        kw = pl.BlockSpec((None, None, K, W), lambda b, h, j: (b, h, 0, j))
        in_specs = [qk, qk, vw, pl.BlockSpec((None, None, N, AUX, C), lambda b, h, j: (b, h, 0, 0, 0)), kw,
                    qk, qk, vw, pl.BlockSpec((None, None, N // r, AUX, Bk), lambda b, h, j: (b, h, 0, 0, 0))]
        call = pl.pallas_call(
            functools.partial(_fwd_kernel_gpu, cfg=cfg, r=r, n_chunks=N), out_shape=out_shape, grid=(B, H, NV),
            in_specs=in_specs, out_specs=[kw, vw, vw],
            compiler_params=None if interpret else _gpu_params(cfg), interpret=interpret, name="gdn_block_fwd",
            cost_estimate=cost)
    return call(q, k, v, aux, s0, qn, kn, vn, auxn)


# ----------------------------------------------------------------------------------------- backward

def _store_grads(refs, grads):
    for ref, g in zip(refs, grads):
        ref[...] = g.astype(ref.dtype)


def _bwd_kernel_tpu(q_ref, k_ref, v_ref, aux_ref, st_ref, do_ref, dfin_ref, qn_ref, kn_ref, vn_ref, auxn_ref,
                    don_ref, dq_ref, dk_ref, dv_ref, daux_ref, ds0_ref, dqn_ref, dkn_ref, dvn_ref, dauxn_ref,
                    dS_ref, *, cfg, r):
    n = pl.program_id(3)
    c = pl.num_programs(3) - 1 - n   # the chunk this step handles

    @pl.when(n == 0)
    def _():
        dS_ref[...] = dfin_ref[...].astype(f32)

    S = st_ref[...]
    dq, dk, dv, daux, dS = cm.chunk_backward(q_ref[...], k_ref[...], v_ref[...], aux_ref[...], S, do_ref[...],
                                             dS_ref[...], scale=cfg.scale, mm=cfg.mm())
    _store_grads((dq_ref, dk_ref, dv_ref, daux_ref), (dq, dk, dv, daux))
    dS_ref[...] = dS

    @pl.when(_is_block_start(c, r))
    def _():
        grads = bm.block_readout_backward(qn_ref[...], kn_ref[...], vn_ref[...], auxn_ref[...], S, don_ref[...],
                                          scale=cfg.scale, mm=cfg.mm())
        _store_grads((dqn_ref, dkn_ref, dvn_ref, dauxn_ref), grads[:4])
        dS_ref[...] = dS_ref[...] + grads[4]   # the readout read the state entering this chunk

    @pl.when(n == pl.num_programs(3) - 1)
    def _():
        ds0_ref[...] = dS_ref[...]


def _bwd_kernel_gpu(q_ref, k_ref, v_ref, aux_ref, st_ref, do_ref, dfin_ref, qn_ref, kn_ref, vn_ref, auxn_ref,
                    don_ref, dq_ref, dk_ref, dv_ref, daux_ref, ds0_ref, dqn_ref, dkn_ref, dvn_ref, dauxn_ref,
                    *, cfg, r, n_chunks):
    C = cfg.chunk_size
    K = q_ref.shape[-1]
    Bk = C * r

    def body(i, dSn):
        n = n_chunks - 1 - i
        rows = pl.ds(n * C, C)
        S = st_ref[pl.ds(n * K, K), :]
        dq, dk, dv, daux, dS = cm.chunk_backward(q_ref[rows, :], k_ref[rows, :], v_ref[rows, :], aux_ref[n], S,
                                                 do_ref[rows, :], dSn, scale=cfg.scale, mm=cfg.mm())
        for ref, g in zip((dq_ref, dk_ref, dv_ref), (dq, dk, dv)):
            ref[rows, :] = g.astype(ref.dtype)
        daux_ref[n] = daux
        blk = lax.div(n, r)
        brows = pl.ds(blk * Bk, Bk)

        def readout(dS):
            dqn, dkn, dvn, dauxn, dSb = bm.block_readout_backward(
                qn_ref[brows, :], kn_ref[brows, :], vn_ref[brows, :], auxn_ref[blk], S, don_ref[brows, :],
                scale=cfg.scale, mm=cfg.mm())
            for ref, g in zip((dqn_ref, dkn_ref, dvn_ref), (dqn, dkn, dvn)):
                ref[brows, :] = g.astype(ref.dtype)
            dauxn_ref[blk] = dauxn
            return dS + dSb

        return lax.cond(_is_block_start(n, r), readout, lambda dS: dS, dS)

    ds0_ref[...] = lax.fori_loop(0, n_chunks, body, dfin_ref[...].astype(f32))


def block_backward_call(q, k, v, aux, states, dO, dfinal, qn, kn, vn, auxn, dOn, *, cfg: KernelConfig, r: int,
                        form: str, interpret: bool):
    """Fused reverse sweep. Returns (dq, dk [NV,B,T,H*K], dv [B,T,H*V], daux [NV,B,H,N,AUX,C],
    ds0 [B,H,K,V], dqn, dkn [NV,B,T,H*K], dvn [B,T,H*V], dauxn [NV,B,H,NB,AUX,Bk]); the NV-leading
    ones are value-block partial sums (in q's dtype if NV == 1, else fp32)."""
    gpu = form == "gpu"
    dims = _dims(q, v, aux, cfg, gpu)
    B, Tp, H, K, V, C, N, W, NV = dims
    Bk = C * r
    dqk = q.dtype if NV == 1 else f32
    part_k = jax.ShapeDtypeStruct((NV, B, Tp, H * K), dqk)
    out_shape = [part_k, part_k, jax.ShapeDtypeStruct((B, Tp, H * V), v.dtype), jax.ShapeDtypeStruct((NV,) + aux.shape, f32),
                 jax.ShapeDtypeStruct((B, H, K, V), f32), part_k, part_k, jax.ShapeDtypeStruct((B, Tp, H * V), vn.dtype),
                 jax.ShapeDtypeStruct((NV,) + auxn.shape, f32)]
    cost = sweep_cost(cfg, q, v, dims, (q, k, v, aux, states, dO, dfinal, qn, kn, vn, auxn, dOn), out_shape,
                      backward=True, extra_steps=_readouts(cfg, qn, vn, dims, r, backward=True))
    if not gpu:
        rev = lambda n: N - 1 - n  # noqa: E731
        qk = pl.BlockSpec((None, C, K), lambda b, h, j, n: (b, rev(n), h))
        vw = pl.BlockSpec((None, C, W), lambda b, h, j, n: (b, rev(n), h * NV + j))
        kw = pl.BlockSpec((None, None, K, W), lambda b, h, j, n: (b, h, 0, j))
        nqk = pl.BlockSpec((None, Bk, K), lambda b, h, j, n: (b, lax.div(rev(n), r), h))
        nvw = pl.BlockSpec((None, Bk, W), lambda b, h, j, n: (b, lax.div(rev(n), r), h * NV + j))
        auxn_spec = pl.BlockSpec((None, None, None, AUX, Bk), lambda b, h, j, n: (b, h, lax.div(rev(n), r), 0, 0))
        in_specs = [qk, qk, vw, pl.BlockSpec((None, None, None, AUX, C), lambda b, h, j, n: (b, h, rev(n), 0, 0)),
                    pl.BlockSpec((None, None, K, W), lambda b, h, j, n: (b, h, rev(n), j)), vw, kw,
                    nqk, nqk, nvw, auxn_spec, nvw]
        part = pl.BlockSpec((None, None, C, K), lambda b, h, j, n: (j, b, rev(n), h))
        npart = pl.BlockSpec((None, None, Bk, K), lambda b, h, j, n: (j, b, lax.div(rev(n), r), h))
        out_specs = [part, part, vw,
                     pl.BlockSpec((None, None, None, None, AUX, C), lambda b, h, j, n: (j, b, h, rev(n), 0, 0)), kw,
                     npart, npart, nvw,
                     pl.BlockSpec((None, None, None, None, AUX, Bk), lambda b, h, j, n: (j, b, h, lax.div(rev(n), r), 0, 0))]
        call = pl.pallas_call(
            functools.partial(_bwd_kernel_tpu, cfg=cfg, r=r), out_shape=out_shape, grid=(B, H, NV, N),
            in_specs=in_specs, out_specs=out_specs, scratch_shapes=[pltpu.VMEM((K, W), f32)],
            compiler_params=_tpu_params(3), interpret=interpret, name="gdn_block_bwd",
            cost_estimate=cost)
    else:
        qk = pl.BlockSpec((None, Tp, K), lambda b, h, j: (b, 0, h))
        vw = pl.BlockSpec((None, Tp, W), lambda b, h, j: (b, 0, h * NV + j))
        kw = pl.BlockSpec((None, None, K, W), lambda b, h, j: (b, h, 0, j))
        in_specs = [qk, qk, vw, pl.BlockSpec((None, None, N, AUX, C), lambda b, h, j: (b, h, 0, 0, 0)),
                    pl.BlockSpec((None, None, N * K, W), lambda b, h, j: (b, h, 0, j)), vw, kw,
                    qk, qk, vw, pl.BlockSpec((None, None, N // r, AUX, Bk), lambda b, h, j: (b, h, 0, 0, 0)), vw]
        part = pl.BlockSpec((None, None, Tp, K), lambda b, h, j: (j, b, 0, h))
        out_specs = [part, part, vw, pl.BlockSpec((None, None, None, N, AUX, C), lambda b, h, j: (j, b, h, 0, 0, 0)),
                     kw, part, part, vw,
                     pl.BlockSpec((None, None, None, N // r, AUX, Bk), lambda b, h, j: (j, b, h, 0, 0, 0))]
        call = pl.pallas_call(
            functools.partial(_bwd_kernel_gpu, cfg=cfg, r=r, n_chunks=N), out_shape=out_shape, grid=(B, H, NV),
            in_specs=in_specs, out_specs=out_specs,
            compiler_params=None if interpret else _gpu_params(cfg), interpret=interpret, name="gdn_block_bwd",
            cost_estimate=cost)
    return call(q, k, v, aux, states, dO, dfinal, qn, kn, vn, auxn, dOn)
