"""The ``pallas_call``s of the phase-split chunked causal GDN (TPU form; the interpreter runs the same
kernels on CPU). Per-chunk math: :mod:`pallas_kernels.gdn_phase_math`.

Layout (prepared by :mod:`pallas_kernels.gdn_pallas`), T padded to Tp = N * C, H value heads, HK key
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

from . import gdn_phase_math as pm
from .cost import grid_estimate, spec
from .gdn_chunk_math import AUX_WIDTH as AUX
from .gdn_pallas_calls import KernelConfig

f32 = jnp.float32
#: tokens per grid step of the parallel kernels (G chunks of C): amortises the per-step overhead
GROUP_TOKENS = 256


def _key_head(h, rep: int):
    """The key head of value head h (h // rep for h >= 0). Truncating `lax.div`, not `//`: Python's
    floor division lowers through `sign`, whose Mosaic rule asks for the local TPU's generation and
    so fails in an AOT compile whose default device is a CPU."""
    return jax.lax.div(h, jnp.int32(rep))

def group_size(N: int, C: int) -> int:
    """G: the largest divisor of N with G * C <= GROUP_TOKENS (at least 1)."""
    return max(g for g in range(1, N + 1) if N % g == 0 and (g == 1 or g * C <= GROUP_TOKENS))


def _params(n_parallel: int, sequential: bool):
    sem = ("parallel",) * n_parallel + (("arbitrary",) if sequential else ("parallel",))
    return pltpu.CompilerParams(dimension_semantics=sem)


def _shape(q, v, aux, K: int):
    B, Tp, HKK = q.shape
    _, H, N, _, C = aux.shape
    HK, V = HKK // K, v.shape[-1] // H
    if N * C != Tp or H % HK:
        raise ValueError(f"q {q.shape}, v {v.shape}, aux {aux.shape}: need Tp = N*C and H % HK == 0")
    return B, Tp, H, HK, V, C, N, H // HK


# ----------------------------------------------------------------------------- per-step cost fns

def intra_step(k, v, aux, *, cfg):
    return pm.chunk_intra(k, v, aux, cfg.mm())


def wy_step(k, v, aux, T, *, cfg):
    return pm.chunk_wy(k, v, aux, T, cfg.mm())


def sweep_step(q, k, w, u, aux, S, *, cfg):
    return pm.chunk_sweep(q, k, w, u, aux, S, scale=cfg.scale, mm=cfg.mm())


def state_backward_step(q, k, w, aux, dO, dS, *, cfg):
    return pm.chunk_state_backward(q, k, w, aux, dO, dS, scale=cfg.scale, mm=cfg.mm())


def parallel_backward_step(q, k, v, aux, T, w, u, S, dO, dS, *, cfg):
    return pm.chunk_parallel_backward(q, k, v, aux, T, w, u, S, dO, dS, scale=cfg.scale, mm=cfg.mm())


def _cost(fn, specs, cfg, count, operands, results):
    return grid_estimate([(fn, specs, (("cfg", cfg),), count)], operands, results)


# ------------------------------------------------------------------------------------------ phase a

def _intra_kernel(*refs, cfg, G, C, with_T_in):
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
            T = pm.chunk_inverse(k, aux, mm)
            T_ref[j] = T
        w, u = pm.chunk_wy(k, v, aux, T, mm)
        w_ref[rows, :] = w.astype(w_ref.dtype)
        u_ref[rows, :] = u.astype(u_ref.dtype)


def intra_call(k, v, aux, *, K: int, cfg: KernelConfig, interpret: bool, T_in=None):
    """Phase a. Returns (T [B,H,N,C,C] fp32, w [B,Tp,H*K], u [B,Tp,H*V]) or, with ``T_in``, (w, u)."""
    B, Tp, H, HK, V, C, N, rep = _shape(k, v, aux, K)
    G = group_size(N, C)
    kq = pl.BlockSpec((None, G * C, K), lambda b, h, n: (b, n, _key_head(h, rep)))
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
        functools.partial(_intra_kernel, cfg=cfg, G=G, C=C, with_T_in=T_in is not None),
        out_shape=out_shape, grid=(B, H, N // G), in_specs=in_specs, out_specs=out_specs,
        compiler_params=_params(2, sequential=False), interpret=interpret,
        name="gdn_wy" if T_in is not None else "gdn_intra", cost_estimate=cost)
    return tuple(call(*args))


# ------------------------------------------------------------------------------------------ phase b

def _sweep_kernel(q_ref, k_ref, w_ref, u_ref, aux_ref, s0_ref, *refs, cfg, with_o, with_states):
    outs, S_ref = list(refs[:-1]), refs[-1]
    final_ref = outs.pop(0)
    o_ref = outs.pop(0) if with_o else None
    st_ref = outs.pop(0) if with_states else None
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        S_ref[...] = s0_ref[...].astype(f32)

    S = S_ref[...]
    if with_states:
        st_ref[...] = S
    o, S_new = pm.chunk_sweep(q_ref[...], k_ref[...], w_ref[...], u_ref[...], aux_ref[...], S,
                              scale=cfg.scale, mm=cfg.mm())
    if with_o:
        o_ref[...] = o.astype(o_ref.dtype)
    S_ref[...] = S_new

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        final_ref[...] = S_new


def _sweep_specs(H, rep, C, K, V, rev=None):
    t = (lambda n: n) if rev is None else rev
    kq = pl.BlockSpec((None, C, K), lambda b, h, n: (b, t(n), _key_head(h, rep)))
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


def sweep_call(q, k, w, u, aux, s0, *, cfg: KernelConfig, interpret: bool, with_o: bool = True,
               with_states: bool = False):
    """Phase b. Returns (final [B,H,K,V] fp32, o [B,Tp,H*V] in u's dtype if with_o, states
    [B,H,N*K,V] fp32 if with_states)."""
    K = s0.shape[2]
    B, Tp, H, HK, V, C, N, rep = _shape(q, u, aux, K)
    kq, kw, vw, ax, st, s = _sweep_specs(H, rep, C, K, V)
    out_shape, out_specs = [jax.ShapeDtypeStruct((B, H, K, V), f32)], [s]
    if with_o:
        out_shape.append(jax.ShapeDtypeStruct((B, Tp, H * V), u.dtype))
        out_specs.append(vw)
    if with_states:
        out_shape.append(jax.ShapeDtypeStruct((B, H, N * K, V), f32))
        out_specs.append(st)
    args = (q, k, w, u, aux, s0)
    cost = _cost(sweep_step, _step_specs(q, u, C, K, V), cfg, B * H * N, args, out_shape)
    call = pl.pallas_call(
        functools.partial(_sweep_kernel, cfg=cfg, with_o=with_o, with_states=with_states),
        out_shape=out_shape, grid=(B, H, N), in_specs=[kq, kq, kw, vw, ax, s], out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((K, V), f32)], compiler_params=_params(2, sequential=True),
        interpret=interpret, name="gdn_sweep", cost_estimate=cost)
    return tuple(call(*args))


# ----------------------------------------------------------------------------------------- backward

def _state_backward_kernel(q_ref, k_ref, w_ref, aux_ref, do_ref, dfin_ref, dst_ref, ds0_ref, dS_ref, *, cfg):
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        dS_ref[...] = dfin_ref[...].astype(f32)

    dSn = dS_ref[...]
    dst_ref[...] = dSn                      # the cotangent of the state after this chunk
    dS = pm.chunk_state_backward(q_ref[...], k_ref[...], w_ref[...], aux_ref[...], do_ref[...], dSn,
                                 scale=cfg.scale, mm=cfg.mm())
    dS_ref[...] = dS

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        ds0_ref[...] = dS


def state_backward_call(q, k, w, aux, dO, dfinal, *, cfg: KernelConfig, interpret: bool):
    """Reverse sweep carrying dS (the backward's only sequential kernel). Returns (dstates
    [B,H,N*K,V] fp32: rows n*K:(n+1)*K = the cotangent of the state AFTER chunk n, ds0 [B,H,K,V])."""
    K = dfinal.shape[2]
    B, Tp, H, HK, V, C, N, rep = _shape(q, dO, aux, K)
    kq, kw, vw, ax, st, s = _sweep_specs(H, rep, C, K, V, rev=lambda n: N - 1 - n)
    out_shape = [jax.ShapeDtypeStruct((B, H, N * K, V), f32), jax.ShapeDtypeStruct((B, H, K, V), f32)]
    args = (q, k, w, aux, dO, dfinal)
    specs = (spec((C, K), q.dtype), spec((C, K), q.dtype), spec((C, K), w.dtype), spec((AUX, C), f32),
             spec((C, V), dO.dtype), spec((K, V), f32))
    cost = _cost(state_backward_step, specs, cfg, B * H * N, args, out_shape)
    call = pl.pallas_call(
        functools.partial(_state_backward_kernel, cfg=cfg), out_shape=out_shape, grid=(B, H, N),
        in_specs=[kq, kq, kw, ax, vw, s], out_specs=[st, s],
        scratch_shapes=[pltpu.VMEM((K, V), f32)], compiler_params=_params(2, sequential=True),
        interpret=interpret, name="gdn_state_bwd", cost_estimate=cost)
    return tuple(call(*args))


def _parallel_backward_kernel(q_ref, k_ref, v_ref, aux_ref, T_ref, w_ref, u_ref, st_ref, dst_ref, do_ref,
                              dq_ref, dk_ref, dv_ref, daux_ref, *, cfg, G, C, K, V, rep):
    for j in range(G):
        r = pl.ds(j * C, C)
        q, k = q_ref[r, :], k_ref[r, :]
        dq_sum = dk_sum = None
        for h in range(rep):  # the value heads of this key head: their dq, dk sum here
            kc, vc = pl.ds(h * K, K), pl.ds(h * V, V)
            dq, dk, dv, daux = pm.chunk_parallel_backward(
                q, k, v_ref[r, vc], aux_ref[h, j], T_ref[h, j], w_ref[r, kc], u_ref[r, vc],
                st_ref[h, pl.ds(j * K, K), :], do_ref[r, vc], dst_ref[h, pl.ds(j * K, K), :],
                scale=cfg.scale, mm=cfg.mm())
            dq_sum = dq if dq_sum is None else dq_sum + dq
            dk_sum = dk if dk_sum is None else dk_sum + dk
            dv_ref[r, vc] = dv.astype(dv_ref.dtype)
            daux_ref[h, j] = daux
        dq_ref[r, :] = dq_sum.astype(dq_ref.dtype)
        dk_ref[r, :] = dk_sum.astype(dk_ref.dtype)


def parallel_backward_call(q, k, v, aux, T, w, u, states, dstates, dO, *, cfg: KernelConfig, interpret: bool):
    """Every cotangent but the dS recurrence, parallel over (row, key head, chunk group): one grid
    step takes a key head's rep value heads (adjacent in the flat head dim) and sums their dq, dk.
    Returns (dq, dk [B,Tp,HK*K] in q's dtype, dv [B,Tp,H*V] in v's dtype, daux [B,H,N,AUX,C] fp32)."""
    K = w.shape[-1] // aux.shape[1]
    B, Tp, H, HK, V, C, N, rep = _shape(q, v, aux, K)
    G = group_size(N, C)
    kq = pl.BlockSpec((None, G * C, K), lambda b, h, n: (b, n, h))
    kw = pl.BlockSpec((None, G * C, rep * K), lambda b, h, n: (b, n, h))
    vw = pl.BlockSpec((None, G * C, rep * V), lambda b, h, n: (b, n, h))
    ax = pl.BlockSpec((None, rep, G, AUX, C), lambda b, h, n: (b, h, n, 0, 0))
    tt = pl.BlockSpec((None, rep, G, C, C), lambda b, h, n: (b, h, n, 0, 0))
    st = pl.BlockSpec((None, rep, G * K, V), lambda b, h, n: (b, h, n, 0))
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(aux.shape, f32)]
    args = (q, k, v, aux, T, w, u, states, dstates, dO)
    specs = (spec((C, K), q.dtype), spec((C, K), k.dtype), spec((C, V), v.dtype), spec((AUX, C), f32),
             spec((C, C), f32), spec((C, K), w.dtype), spec((C, V), u.dtype), spec((K, V), f32),
             spec((C, V), dO.dtype), spec((K, V), f32))
    cost = _cost(parallel_backward_step, specs, cfg, B * H * N, args, out_shape)
    call = pl.pallas_call(
        functools.partial(_parallel_backward_kernel, cfg=cfg, G=G, C=C, K=K, V=V, rep=rep), out_shape=out_shape,
        grid=(B, HK, N // G), in_specs=[kq, kq, vw, ax, tt, kw, vw, st, st, vw],
        out_specs=[kq, kq, vw, ax], compiler_params=_params(2, sequential=False), interpret=interpret,
        name="gdn_parallel_bwd", cost_estimate=cost)
    return tuple(call(*args))
