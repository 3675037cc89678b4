"""The ``pallas_call``s of the phase-split chunked causal GDN, TPU form (Mosaic; the interpreter runs the
same kernels on CPU; the GPU form, :mod:`pallas_kernels.gdn.gpu_calls`, runs the same parallel kernel
bodies, :mod:`pallas_kernels.gdn.kernel_bodies`). Per-chunk math: :mod:`pallas_kernels.gdn.phase_math`.

Layout (prepared by :mod:`pallas_kernels.gdn.causal_op`), T padded to Tp = N * C, H value heads, HK key
heads (value head h reads key head h // rep, rep = H / HK: native GQA, the BlockSpecs pick the key
head's tile, nothing is repeated in HBM):
``q, k`` [B, Tp, HK * K]; ``v`` [B, Tp, H * V]; ``aux`` fp32 [B, H, N, AUX, C]; per value head
``w`` [B, Tp, H * K] and ``u`` [B, Tp, H * V] (the WY form, in the input dtype), the inverse ``T``
fp32 [B, H, N, C, C] (the backward's residual), states fp32 [B, H, K, V], per-chunk states fp32
[B, H, N * K, V] (rows n*K:(n+1)*K = state before chunk n).

Kernels (grid; dimension semantics):
- ``intra_call`` (B, H, N / G; all parallel): T, w, u for G chunks per grid step; ``T_in`` given =
  only w, u from the saved inverse (the backward's recompute, no re-inversion).
- ``sweep_call`` (B, H, N; chunks "arbitrary"): the state in a VMEM scratch across chunk steps;
  o and the final state, or the per-chunk states (the backward's state recompute).
- ``state_backward_call`` (B, H, N reversed): dS in a VMEM scratch, the only sequential kernel of
  the backward (it needs neither the states nor delta); writes dS' per chunk.
- ``parallel_backward_call`` (B, HK, N / G; all parallel): every other cotangent from the states,
  the dS' per chunk and the saved inverse; a step takes one key head's rep value heads (adjacent in
  the flat head dim, so one rep * V wide tile) and sums their dq, dk in fp32 before the one store.
Block shapes: C a multiple of 8; K, V multiples of 128 (or one head: the block is then the whole dim).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import block_math as bm
from . import block_phase_math as bpm
from . import chunk_math as cm
from . import phase_math as pm
from ..common.cost import grid_estimate, spec
from .chunk_math import AUX_WIDTH as AUX
from .kernel_bodies import (KernelConfig, at_tile_start, call_dims, group_size, intra_kernel, key_head,
                            noisy_forward_kernel, parallel_backward_io, parallel_backward_kernel)

f32 = jnp.float32


def _params(n_parallel: int, sequential: bool):
    sem = ("parallel",) * n_parallel + (("arbitrary",) if sequential else ("parallel",))
    return pltpu.CompilerParams(dimension_semantics=sem)


# ----------------------------------------------------------------------------- per-step cost fns

def intra_step(k, v, aux, *, cfg):
    return pm.chunk_intra(k, v, aux, cfg.mm(), cfg.inverse_for("tpu"))


def wy_step(k, v, aux, T, *, cfg):
    return pm.chunk_wy(k, v, aux, T, cfg.mm())


def sweep_step(q, k, w, u, aux, S, *, cfg):
    return pm.chunk_sweep(q, k, w, u, aux, S, scale=cfg.scale, mm=cfg.mm())


def state_backward_step(q, k, w, aux, dO, dS, *, cfg):
    return pm.chunk_state_backward(q, k, w, aux, dO, dS, scale=cfg.scale, mm=cfg.mm())


def parallel_backward_step(q, k, v, aux, T, w, u, S, dO, dS, *, cfg):
    return pm.chunk_parallel_backward(q, k, v, aux, T, w, u, S, dO, dS, scale=cfg.scale, mm=cfg.mm())


def block_sweep_step(q, k, w, u, aux, S, qn, auxn, *, cfg):
    return bpm.chunk_block_sweep(q, k, w, u, aux, S, qn, auxn, scale=cfg.scale, mm=cfg.mm())


def readout_step(qn, auxn, S, *, cfg):
    return bpm.tile_readout(qn, auxn, S, scale=cfg.scale, mm=cfg.mm())


def noisy_forward_step(qn, kn, vn, auxn, r, *, cfg):
    return bm.readout_combine(qn, kn, vn, auxn, r, cfg.mm())


def block_state_backward_step(q, k, w, aux, dO, dS, qn, auxn, ph, dOn, *, cfg):
    return bpm.chunk_block_state_backward(q, k, w, aux, dO, dS, qn, auxn, ph, dOn, scale=cfg.scale, mm=cfg.mm())


def tile_state_backward_step(qn, auxn, ph, dOn, *, cfg):
    return bpm.tile_state_backward(qn, auxn, ph, dOn, scale=cfg.scale, mm=cfg.mm())


def block_parallel_backward_step(q, k, v, aux, T, w, u, S, dO, dS, qn, kn, vn, auxn, dOn, *, cfg):
    return bpm.chunk_block_parallel_backward(q, k, v, aux, T, w, u, S, dO, dS, qn, kn, vn, auxn, dOn,
                                             scale=cfg.scale, mm=cfg.mm())


def noisy_tile_backward_step(qn, kn, vn, auxn, S, dOn, *, cfg):
    return bpm.noisy_tile_backward(qn, kn, vn, auxn, S, dOn, scale=cfg.scale, mm=cfg.mm())


def _cost(fn, specs, cfg, count, operands, results, extra=()):
    """``extra``: further (fn, specs, count) steps of the same kernel."""
    steps = [(f, sp, (("cfg", cfg),), n) for f, sp, n in ((fn, specs, count),) + tuple(extra)]
    return grid_estimate(steps, operands, results)


def _noisy_specs(qn, vn, R: int, K: int, V: int):
    """Per-tile qn, kn [R, K], vn [R, V], auxn [AUX, R] (a readout tile's operands, for its cost)."""
    return (spec((R, K), qn.dtype), spec((R, K), qn.dtype), spec((R, V), vn.dtype), spec((AUX, R), f32))


# ------------------------------------------------------------------------------------------ phase a

def intra_call(k, v, aux, *, K: int, cfg: KernelConfig, interpret: bool, T_in=None):
    """Phase a. Returns (T [B,H,N,C,C] fp32, w [B,Tp,H*K], u [B,Tp,H*V]) or, with ``T_in``, (w, u)."""
    B, Tp, H, HK, V, C, N, rep = call_dims(k, v, aux, K)
    G = group_size(N, C)
    kq = pl.BlockSpec((None, G * C, K), lambda b, h, n: (b, n, key_head(h, rep)))
    kw = pl.BlockSpec((None, G * C, K), lambda b, h, n: (b, n, h))
    vw = pl.BlockSpec((None, G * C, V), lambda b, h, n: (b, n, h))
    ax = pl.BlockSpec((None, None, G, AUX, C), lambda b, h, n: (b, h, n, 0, 0))
    tt = pl.BlockSpec((None, None, G, C, C), lambda b, h, n: (b, h, n, 0, 0))
    wu_shape = [jax.ShapeDtypeStruct((B, Tp, H * K), k.dtype), jax.ShapeDtypeStruct((B, Tp, H * V), v.dtype)]
    T_shape = jax.ShapeDtypeStruct((B, H, N, C, C), f32)
    base = (spec((C, K), k.dtype), spec((C, V), v.dtype), spec((AUX, C), f32))
    if T_in is None:
        in_specs, out_specs, out_shape, args = [kq, vw, ax], [tt, kw, vw], [T_shape] + wu_shape, (k, v, aux)
        cost = _cost(intra_step, base, cfg, B * H * N, args, out_shape)
    else:
        in_specs, out_specs, out_shape, args = [kq, vw, ax, tt], [kw, vw], wu_shape, (k, v, aux, T_in)
        cost = _cost(wy_step, base + (spec((C, C), f32),), cfg, B * H * N, args, out_shape)
    call = pl.pallas_call(
        functools.partial(intra_kernel, cfg=cfg, G=G, C=C, with_T_in=T_in is not None, inverse=cfg.inverse_for("tpu")),
        out_shape=out_shape, grid=(B, H, N // G), in_specs=in_specs, out_specs=out_specs,
        compiler_params=_params(2, sequential=False), interpret=interpret,
        name="gdn_wy" if T_in is not None else "gdn_intra", cost_estimate=cost)
    return tuple(call(*args))


# ------------------------------------------------------------------------------------------ phase b

def _sweep_kernel(q_ref, k_ref, w_ref, u_ref, aux_ref, s0_ref, *refs, cfg, with_o, with_states, plan):
    qn_ref, auxn_ref = refs[:2] if plan else (None, None)
    refs = refs[2:] if plan else refs
    outs, S_ref = list(refs[:-1]), refs[-1]
    final_ref = outs.pop(0)
    o_ref = outs.pop(0) if with_o else None
    st_ref = outs.pop(0) if with_states else None
    r_ref = outs.pop(0) if plan else None
    n = pl.program_id(2)
    kw = dict(scale=cfg.scale, mm=cfg.mm())

    @pl.when(n == 0)
    def _():
        S_ref[...] = s0_ref[...].astype(f32)

    S = S_ref[...]
    if with_states:
        st_ref[...] = S
    chunk = (q_ref[...], k_ref[...], w_ref[...], u_ref[...], aux_ref[...], S)
    if plan and plan.mid:   # the readouts of the blocks inside this chunk, from its deltas
        o, S_new, r = bpm.chunk_block_sweep(*chunk, qn_ref[...], auxn_ref[...], **kw)
        r_ref[...] = r
    else:
        o, S_new = pm.chunk_sweep(*chunk, **kw)
        if plan:   # a block starts here: read its state out while it is in VMEM

            @at_tile_start(n, plan.rb)
            def _():
                r_ref[...] = bpm.tile_readout(qn_ref[...], auxn_ref[...], S, **kw)
    if with_o:
        o_ref[...] = o.astype(o_ref.dtype)
    S_ref[...] = S_new

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        final_ref[...] = S_new


def _sweep_specs(H, rep, C, K, V, rev=None):
    t = (lambda n: n) if rev is None else rev
    kq = pl.BlockSpec((None, C, K), lambda b, h, n: (b, t(n), key_head(h, rep)))
    kw = pl.BlockSpec((None, C, K), lambda b, h, n: (b, t(n), h))
    vw = pl.BlockSpec((None, C, V), lambda b, h, n: (b, t(n), h))
    ax = pl.BlockSpec((None, None, None, AUX, C), lambda b, h, n: (b, h, t(n), 0, 0))
    st = pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, t(n), 0))
    s = pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0))
    return kq, kw, vw, ax, st, s


def _step_specs(q, v, C, K, V):
    """Per-step tiles q, k, w [C, K], u [C, V], aux, S (the sweep step's operands, for its cost)."""
    return (spec((C, K), q.dtype), spec((C, K), q.dtype), spec((C, K), q.dtype), spec((C, V), v.dtype),
            spec((AUX, C), f32), spec((K, V), f32))


def _tile_specs(rep: int, R: int, K: int, V: int, rb: int, rev=None):
    """BlockSpecs of readout tiles (R rows) on the sweeps' (b, h, n) grid: the tile of chunk n's
    block stays resident while the sweep walks its rb chunks. qn (key head), auxn, [R, V], ph."""
    t = (lambda n: n) if rev is None else rev
    tile = (lambda n: t(n)) if rb == 1 else (lambda n: jax.lax.div(t(n), jnp.int32(rb)))
    return (pl.BlockSpec((None, R, K), lambda b, h, n: (b, tile(n), key_head(h, rep))),
            pl.BlockSpec((None, None, None, AUX, R), lambda b, h, n: (b, h, tile(n), 0, 0)),
            pl.BlockSpec((None, R, V), lambda b, h, n: (b, tile(n), h)),
            pl.BlockSpec((None, None, None, 1, R), lambda b, h, n: (b, h, tile(n), 0, 0)))


def sweep_call(q, k, w, u, aux, s0, *, cfg: KernelConfig, interpret: bool, with_o: bool = True,
               with_states: bool = False, noisy=None):
    """Phase b. Returns (final [B,H,K,V] fp32, o [B,Tp,H*V] in u's dtype if with_o, states
    [B,H,N*K,V] fp32 if with_states, r [B,Tp,H*V] fp32 with ``noisy`` = (qn [B,Tp,HK*K], auxn
    [B,H,Tp/R,AUX,R], plan: BlockPlan): the history readout of every noisy token)."""
    K = s0.shape[2]
    B, Tp, H, HK, V, C, N, rep = call_dims(q, u, aux, K)
    kq, kw, vw, ax, st, s = _sweep_specs(H, rep, C, K, V)
    out_shape, out_specs = [jax.ShapeDtypeStruct((B, H, K, V), f32)], [s]
    if with_o:
        out_shape.append(jax.ShapeDtypeStruct((B, Tp, H * V), u.dtype))
        out_specs.append(vw)
    if with_states:
        out_shape.append(jax.ShapeDtypeStruct((B, H, N * K, V), f32))
        out_specs.append(st)
    args, in_specs, plan = (q, k, w, u, aux, s0), [kq, kq, kw, vw, ax, s], None
    specs, step, extra = _step_specs(q, u, C, K, V), sweep_step, ()
    if noisy is not None:
        qn, auxn, plan = noisy
        R = plan.R
        nq, nax, nr, _ = _tile_specs(rep, R, K, V, plan.rb)
        args, in_specs = args + (qn, auxn), in_specs + [nq, nax]
        out_shape.append(jax.ShapeDtypeStruct((B, Tp, H * V), f32))
        out_specs.append(nr)
        if plan.mid:
            specs, step = specs + (spec((C, K), qn.dtype), spec((AUX, C), f32)), block_sweep_step
        else:
            extra = ((readout_step, (spec((R, K), qn.dtype), spec((AUX, R), f32), spec((K, V), f32)), B * H * (Tp // R)),)
    cost = _cost(step, specs, cfg, B * H * N, args, out_shape, extra)
    call = pl.pallas_call(
        functools.partial(_sweep_kernel, cfg=cfg, with_o=with_o, with_states=with_states, plan=plan),
        out_shape=out_shape, grid=(B, H, N), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((K, V), f32)], compiler_params=_params(2, sequential=True),
        interpret=interpret, name="gdn_block_sweep" if plan else "gdn_sweep", cost_estimate=cost)
    return tuple(call(*args))


# --------------------------------------------------------------------------- block mode, noisy

def noisy_forward_call(qn, kn, vn, auxn, r, *, K: int, cfg: KernelConfig, interpret: bool):
    """Block mode's noisy output from the readouts, parallel over (row, value head, tile group).
    Returns (on [B,Tp,H*V] in vn's dtype, ph [B,H,NT,1,R] fp32: the history unit's probability, the
    backward's residual)."""
    B, H, NT, _, R = auxn.shape
    Tp, V, rep = qn.shape[1], vn.shape[-1] // H, H // (qn.shape[-1] // K)
    G = group_size(NT, R)
    nq = pl.BlockSpec((None, G * R, K), lambda b, h, n: (b, n, key_head(h, rep)))
    nv = pl.BlockSpec((None, G * R, V), lambda b, h, n: (b, n, h))
    nax = pl.BlockSpec((None, None, G, AUX, R), lambda b, h, n: (b, h, n, 0, 0))
    nph = pl.BlockSpec((None, None, G, 1, R), lambda b, h, n: (b, h, n, 0, 0))
    out_shape = [jax.ShapeDtypeStruct((B, Tp, H * V), vn.dtype), jax.ShapeDtypeStruct((B, H, NT, 1, R), f32)]
    args = (qn, kn, vn, auxn, r)
    cost = _cost(noisy_forward_step, _noisy_specs(qn, vn, R, K, V) + (spec((R, V), f32),), cfg, B * H * NT, args,
                 out_shape)
    call = pl.pallas_call(
        functools.partial(noisy_forward_kernel, cfg=cfg, G=G, R=R), out_shape=out_shape, grid=(B, H, NT // G),
        in_specs=[nq, nq, nv, nax, nv], out_specs=[nv, nph], compiler_params=_params(2, sequential=False),
        interpret=interpret, name="gdn_block_noisy", cost_estimate=cost)
    return tuple(call(*args))


# ----------------------------------------------------------------------------------------- backward

def _state_backward_kernel(q_ref, k_ref, w_ref, aux_ref, do_ref, dfin_ref, *refs, cfg, plan):
    qn_ref, auxn_ref, ph_ref, don_ref = refs[:4] if plan else (None,) * 4
    dst_ref, ds0_ref, dS_ref = refs[4:] if plan else refs
    n = pl.program_id(2)
    kw = dict(scale=cfg.scale, mm=cfg.mm())

    @pl.when(n == 0)
    def _():
        dS_ref[...] = dfin_ref[...].astype(f32)

    dSn = dS_ref[...]
    dst_ref[...] = dSn                      # the cotangent of the state after this chunk
    chunk = (q_ref[...], k_ref[...], w_ref[...], aux_ref[...], do_ref[...], dSn)
    if plan and plan.mid:   # the readouts inside this chunk read its start state and its deltas
        dS_ref[...] = bpm.chunk_block_state_backward(*chunk, qn_ref[...], auxn_ref[...], ph_ref[...], don_ref[...],
                                                     **kw)
    else:
        dS_ref[...] = pm.chunk_state_backward(*chunk, **kw)
        if plan:   # the block starting at this chunk read the state before it

            @at_tile_start(pl.num_programs(2) - 1 - n, plan.rb)
            def _():
                dS_ref[...] += bpm.tile_state_backward(qn_ref[...], auxn_ref[...], ph_ref[...], don_ref[...], **kw)
    dS = dS_ref[...]

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        ds0_ref[...] = dS


def state_backward_call(q, k, w, aux, dO, dfinal, *, cfg: KernelConfig, interpret: bool, noisy=None):
    """Reverse sweep carrying dS (the backward's only sequential kernel). Returns (dstates
    [B,H,N*K,V] fp32: rows n*K:(n+1)*K = the cotangent of the state AFTER chunk n, ds0 [B,H,K,V]).
    ``noisy`` = (qn, auxn, ph, dOn, plan): block mode, the readouts' cotangents join dS."""
    K = dfinal.shape[2]
    B, Tp, H, HK, V, C, N, rep = call_dims(q, dO, aux, K)
    rev = lambda n: N - 1 - n  # noqa: E731
    kq, kw, vw, ax, st, s = _sweep_specs(H, rep, C, K, V, rev=rev)
    out_shape = [jax.ShapeDtypeStruct((B, H, N * K, V), f32), jax.ShapeDtypeStruct((B, H, K, V), f32)]
    args, in_specs, plan = (q, k, w, aux, dO, dfinal), [kq, kq, kw, ax, vw, s], None
    specs = (spec((C, K), q.dtype), spec((C, K), q.dtype), spec((C, K), w.dtype), spec((AUX, C), f32),
             spec((C, V), dO.dtype), spec((K, V), f32))
    step, extra = state_backward_step, ()
    if noisy is not None:
        qn, auxn, ph, dOn, plan = noisy
        R = plan.R
        nq, nax, nv, nph = _tile_specs(rep, R, K, V, plan.rb, rev=rev)
        args, in_specs = args + (qn, auxn, ph, dOn), in_specs + [nq, nax, nph, nv]
        tile = (spec((R, K), qn.dtype), spec((AUX, R), f32), spec((1, R), f32), spec((R, V), dOn.dtype))
        if plan.mid:
            specs, step = specs + tile, block_state_backward_step
        else:
            extra = ((tile_state_backward_step, tile, B * H * (Tp // R)),)
    cost = _cost(step, specs, cfg, B * H * N, args, out_shape, extra)
    call = pl.pallas_call(
        functools.partial(_state_backward_kernel, cfg=cfg, plan=plan), out_shape=out_shape, grid=(B, H, N),
        in_specs=in_specs, out_specs=[st, s],
        scratch_shapes=[pltpu.VMEM((K, V), f32)], compiler_params=_params(2, sequential=True),
        interpret=interpret, name="gdn_block_state_bwd" if plan else "gdn_state_bwd", cost_estimate=cost)
    return tuple(call(*args))


def parallel_backward_call(q, k, v, aux, T, w, u, states, dstates, dO, *, cfg: KernelConfig, interpret: bool,
                           noisy=None):
    """Every cotangent but the dS recurrence, parallel over (row, key head, chunk group): one grid
    step takes a key head's rep value heads (adjacent in the flat head dim) and sums their dq, dk.
    Returns (dq, dk [B,Tp,HK*K] in q's dtype, dv [B,Tp,H*V] in v's dtype, daux [B,H,N,AUX,C] fp32)
    and with ``noisy`` = (qn, kn, vn, auxn, dOn, plan) (block mode) also (dqn, dkn, dvn, dauxn)."""
    K = w.shape[-1] // aux.shape[1]
    B, Tp, H, HK, V, C, N, rep = call_dims(q, v, aux, K)
    plan = None if noisy is None else noisy[-1]
    G = group_size(N, C, plan.rb if plan else 1)
    args, in_specs, out_specs, out_shape = parallel_backward_io(
        q, k, v, aux, T, w, u, states, dstates, dO, noisy, G=G, rep=rep, C=C, K=K, V=V)
    specs = (spec((C, K), q.dtype), spec((C, K), k.dtype), spec((C, V), v.dtype), spec((AUX, C), f32),
             spec((C, C), f32), spec((C, K), w.dtype), spec((C, V), u.dtype), spec((K, V), f32),
             spec((C, V), dO.dtype), spec((K, V), f32))
    step, extra = parallel_backward_step, ()
    if plan is not None:
        qn, vn, dOn, R = noisy[0], noisy[2], noisy[4], plan.R
        tile = _noisy_specs(qn, vn, R, K, V)
        if plan.mid:
            specs, step = specs + tile + (spec((C, V), dOn.dtype),), block_parallel_backward_step
        else:
            extra = ((noisy_tile_backward_step, tile + (spec((K, V), f32), spec((R, V), dOn.dtype)), B * H * (Tp // R)),)
    cost = _cost(step, specs, cfg, B * H * N, args, out_shape, extra)
    call = pl.pallas_call(
        functools.partial(parallel_backward_kernel, cfg=cfg, G=G, C=C, K=K, V=V, rep=rep, plan=plan),
        out_shape=out_shape, grid=(B, HK, N // G), in_specs=in_specs, out_specs=out_specs,
        compiler_params=_params(2, sequential=False), interpret=interpret,
        name="gdn_block_parallel_bwd" if plan else "gdn_parallel_bwd", cost_estimate=cost)
    return tuple(call(*args))
