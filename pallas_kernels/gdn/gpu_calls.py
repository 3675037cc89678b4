"""The ``pallas_call``s of the phase-split chunked GDN (causal, and block mode's both streams), GPU form
(Pallas Triton; the interpreter runs the same kernels on CPU). Same layout and per-chunk math as the TPU form
(:mod:`pallas_kernels.gdn.tpu_calls`, :mod:`pallas_kernels.gdn.phase_math`), fla's
``chunk_gated_delta_rule`` plan: only the state recurrence is sequential.

Triton runs the programs of a grid concurrently, so nothing may carry across grid steps: each
sequential kernel is one program per (row, value head, value tile) that loops over the chunks
(``fori_loop``) with the state (or its cotangent) as the loop carry; each parallel kernel takes one
chunk per program. The state's columns are independent in the delta rule, so the sweeps split dv into
tiles of W (more programs, a [K, W] carry that fits in registers).

Kernels (grid):
- ``intra_call`` (B, H, N / G): T = (I + A)^-1, w, u per chunk (the TPU kernel body, G =
  ``GpuLaunch.intra_chunks`` chunks a program, by default with the blocked inverse:
  ``kernel_bodies.FORM_INVERSE``); with ``T_in``: only w, u from the saved inverse (the backward's
  recompute, no re-inversion).
- ``sweep_call`` (B, H, NV), sequential: S' = sdec S + kd^T (u - w S), two dependent matmuls per
  chunk; writes every chunk's start state and the final state.
- ``output_call`` (B, H, N, NV): o = diag(ein) (q s) S + P (u - w S) from the states.
- ``state_backward_call`` (B, H, NV), reverse: dS = sdec dS' + qe^T dO - w^T ddelta; writes dS' per
  chunk and the initial state's cotangent (needs neither the states nor delta).
- ``parallel_backward_call`` (B, HK, N): every other cotangent (the TPU kernel body, one chunk a
  step; a key head's rep value heads in value tiles of ``backward_tile_width`` columns, their dq, dk,
  daux summed in fp32).

Block mode (``noisy=``; :mod:`pallas_kernels.gdn.block_phase_math`, readout tiles of R = max(block,
chunk) rows): the output kernel also takes the history readouts r from the swept states (every
chunk when blocks start inside chunks, else at each tile's first chunk), ``noisy_forward_call``
(B, H, NT) combines them with the in-block softmax, the dS sweep adds the readouts' cotangents (one
tile of rb chunks per loop trip) and the parallel backward takes one readout tile per step.

Launch parameters come from :data:`LAUNCH`, keyed by (dk, dv, chunk), :data:`DEFAULT_LAUNCH` for
other shapes. Triton needs every value a kernel holds to have power-of-two dims (>= 16 for a dot's
operands): the caller pads dk, dv (``gdn.causal_op.pad_heads``), C must be a power of two >= 16, and
rep must be a power of two (the caller repeats key heads otherwise).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import block_phase_math as bpm
from . import phase_math as pm
from .chunk_math import AUX_WIDTH as AUX
from .kernel_bodies import (
    KernelConfig, at_tile_start, intra_kernel, key_head, noisy_forward_kernel, parallel_backward_kernel,
    call_dims, parallel_backward_io,
)

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GpuLaunch:
    """Triton launch options of one shape: warps of the sequential sweeps, of the parallel forward
    kernels (intra / WY, output, noisy) and of the parallel backward, software-pipelining stages of the
    sweeps' chunk loop, the value-tile width W of the sweeps and the output kernel (min(dv, block_v)),
    chunks per intra / WY program (``intra_chunks``, independent chunks unrolled in one program: their
    dependent inverse chains interleave; it must divide N, else 1 is used) and the parallel backward's
    value-tile width (``backward_block_v``, 0: all of dv; fp32 inputs take at most
    :data:`FP32_BACKWARD_BLOCK_V`)."""
    sweep_warps: int = 4
    parallel_warps: int = 4
    backward_warps: int = 4
    num_stages: int = 1
    block_v: int = 32
    intra_chunks: int = 1
    backward_block_v: int = 0


#: (dk, dv, chunk) -> launch options. Starting points from fla's autotune ranges for its
#: chunk_gated_delta_rule kernels (BV 32 / 64, 2-4 warps, 2-4 stages): W = 32 gives B * H * dv / 32
#: sweep programs (128 for one row of the 35B layer's 32 heads on an H200's 132 SMs); the parallel
#: backward holds a [dk, dv] fp32 tile, hence 8 warps at 128. (128, 128, 64) measured on an H200
#: (bf16, T = 8192, 32 heads; bench/results/gdn_device_h200_fp32check.json "tune", 3 variants): 4
#: warps halve the output kernel (0.68 vs 1.23-1.34 ms) and trim the intra one (4.29 vs 4.73-4.86),
#: 8 keep the backward ahead (4.47-4.56 vs 5.26); the other entries are not measured.
LAUNCH: dict[tuple[int, int, int], GpuLaunch] = {
    (128, 128, 64): GpuLaunch(sweep_warps=4, parallel_warps=4, backward_warps=8, num_stages=2, block_v=32),
    (128, 128, 32): GpuLaunch(sweep_warps=4, parallel_warps=8, backward_warps=8, num_stages=2, block_v=32),
    (64, 64, 64): GpuLaunch(sweep_warps=4, parallel_warps=4, backward_warps=4, num_stages=2, block_v=32),
}
#: any other shape: 4 warps everywhere, no pipelining, W = min(dv, 32)
DEFAULT_LAUNCH = GpuLaunch()


#: the parallel backward's value tile for fp32 q / k / v: whole-dv tiles at dk = dv = 128 asked 384 KiB
#: (causal) / 236 KiB (block) of an H200's 227 KiB of shared memory (bench/results/gdn_device_h200_fp32check.json);
#: [dk, 32] state tiles are a quarter of the [dk, dv] ones. Whether every fp32 program then fits is not measured yet
#: (bench/gdn_device.py --fp32-fit), so ``ops.auto_backend`` keeps its fp32 fallback.
FP32_BACKWARD_BLOCK_V = 32


def launch_for(K: int, V: int, C: int) -> GpuLaunch:
    """The launch options of a (dk, dv, chunk) shape (the padded dims the kernels run at)."""
    return LAUNCH.get((K, V, C), DEFAULT_LAUNCH)


def tile_width(cfg: KernelConfig, K: int, V: int) -> int:
    """W: ``cfg.block_v`` if set, else the launch table's, capped at dv; it must divide dv."""
    W = cfg.block_v if cfg.block_v is not None else min(V, launch_for(K, V, cfg.chunk_size).block_v)
    if V % W:
        raise ValueError(f"block_v={W} must divide dv={V}")
    return W


def backward_tile_width(K: int, V: int, C: int, dtype) -> int:
    """The parallel backward's value-tile width: the launch table's ``backward_block_v`` (0: dv), at
    most FP32_BACKWARD_BLOCK_V for fp32 inputs, capped at dv; it must divide dv."""
    W = launch_for(K, V, C).backward_block_v or V
    if jnp.dtype(dtype).itemsize >= 4:
        W = min(W, FP32_BACKWARD_BLOCK_V)
    W = min(W, V)
    if V % W:
        raise ValueError(f"backward_block_v={W} must divide dv={V}")
    return W


def intra_group(K: int, V: int, C: int, N: int) -> int:
    """Chunks per intra / WY program: the launch table's ``intra_chunks`` where it divides N, else 1."""
    G = launch_for(K, V, C).intra_chunks
    return G if G >= 1 and N % G == 0 else 1


def _params(interpret: bool, num_warps: int, num_stages: int = 1):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu
    params = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return params(num_warps=num_warps, num_stages=num_stages)


def _parallel_params(cfg: KernelConfig, K: int, V: int, interpret: bool):
    return _params(interpret, launch_for(K, V, cfg.chunk_size).parallel_warps)


def _backward_params(cfg: KernelConfig, K: int, V: int, interpret: bool):
    return _params(interpret, launch_for(K, V, cfg.chunk_size).backward_warps)


def _sweep_params(cfg: KernelConfig, K: int, V: int, interpret: bool):
    lc = launch_for(K, V, cfg.chunk_size)
    return _params(interpret, lc.sweep_warps, lc.num_stages)


# ------------------------------------------------------------------------------------ parallel

def intra_call(k, v, aux, *, K: int, cfg: KernelConfig, interpret: bool, T_in=None):
    """Phase a. Returns (T [B,H,N,C,C] fp32, w [B,Tp,H*K], u [B,Tp,H*V]) or, with ``T_in``, (w, u)."""
    B, Tp, H, HK, V, C, N, rep = call_dims(k, v, aux, K)
    G = intra_group(K, V, C, N)
    kq = pl.BlockSpec((None, G * C, K), lambda b, h, n: (b, n, key_head(h, rep)))
    kw = pl.BlockSpec((None, G * C, K), lambda b, h, n: (b, n, h))
    vw = pl.BlockSpec((None, G * C, V), lambda b, h, n: (b, n, h))
    ax = pl.BlockSpec((None, None, G, AUX, C), lambda b, h, n: (b, h, n, 0, 0))
    tt = pl.BlockSpec((None, None, G, C, C), lambda b, h, n: (b, h, n, 0, 0))
    wu_shape = [jax.ShapeDtypeStruct((B, Tp, H * K), k.dtype), jax.ShapeDtypeStruct((B, Tp, H * V), v.dtype)]
    if T_in is None:
        in_specs, out_specs, out_shape, args = [kq, vw, ax], [tt, kw, vw], [
            jax.ShapeDtypeStruct((B, H, N, C, C), f32)] + wu_shape, (k, v, aux)
    else:
        in_specs, out_specs, out_shape, args = [kq, vw, ax, tt], [kw, vw], wu_shape, (k, v, aux, T_in)
    call = pl.pallas_call(
        functools.partial(intra_kernel, cfg=cfg, G=G, C=C, with_T_in=T_in is not None, inverse=cfg.inverse_for("gpu")),
        out_shape=out_shape, grid=(B, H, N // G), in_specs=in_specs, out_specs=out_specs,
        compiler_params=_parallel_params(cfg, K, V, interpret), interpret=interpret,
        name="gdn_gpu_wy" if T_in is not None else "gdn_gpu_intra")
    return tuple(call(*args))


def _output_kernel(q_ref, k_ref, w_ref, u_ref, aux_ref, st_ref, *refs, cfg, plan):
    qn_ref, auxn_ref, o_ref, r_ref = refs if plan else (None, None, refs[0], None)
    kw = dict(scale=cfg.scale, mm=cfg.mm())
    S = st_ref[...]
    chunk = (q_ref[...], k_ref[...], w_ref[...], u_ref[...], aux_ref[...], S)
    if plan and plan.mid:   # the readouts of the blocks inside this chunk, from its deltas
        o, _, r = bpm.chunk_block_sweep(*chunk, qn_ref[...], auxn_ref[...], **kw)
        r_ref[...] = r
    else:
        o = pm.chunk_output(*chunk, **kw)
        if plan:   # a block starts at this chunk: its readout is of this chunk's start state

            @at_tile_start(pl.program_id(2), plan.rb)
            def _():
                r_ref[...] = bpm.tile_readout(qn_ref[...], auxn_ref[...], S, **kw)
    o_ref[...] = o.astype(o_ref.dtype)


def output_call(q, k, w, u, aux, states, *, cfg: KernelConfig, interpret: bool, noisy=None):
    """The output phase, parallel over (row, value head, chunk, value tile): o [B,Tp,H*V] in u's
    dtype, and with ``noisy`` = (qn [B,Tp,HK*K], auxn [B,H,Tp/R,AUX,R], plan: BlockPlan) (block
    mode) also r [B,Tp,H*V] fp32, the history readout of every noisy token."""
    K = w.shape[-1] // aux.shape[1]
    B, Tp, H, HK, V, C, N, rep = call_dims(q, u, aux, K)
    W = tile_width(cfg, K, V)
    NV = V // W
    kq = pl.BlockSpec((None, C, K), lambda b, h, n, j: (b, n, key_head(h, rep)))
    kw = pl.BlockSpec((None, C, K), lambda b, h, n, j: (b, n, h))
    vw = pl.BlockSpec((None, C, W), lambda b, h, n, j: (b, n, h * NV + j))
    ax = pl.BlockSpec((None, None, None, AUX, C), lambda b, h, n, j: (b, h, n, 0, 0))
    st = pl.BlockSpec((None, None, K, W), lambda b, h, n, j: (b, h, n, j))
    args, in_specs, plan = (q, k, w, u, aux, states), [kq, kq, kw, vw, ax, st], None
    out_shape, out_specs = [jax.ShapeDtypeStruct((B, Tp, H * V), u.dtype)], [vw]
    if noisy is not None:
        qn, auxn, plan = noisy
        R, rb = plan.R, plan.rb
        tile = (lambda n: n) if rb == 1 else (lambda n: lax.div(n, jnp.int32(rb)))
        args = args + (qn, auxn)
        in_specs += [pl.BlockSpec((None, R, K), lambda b, h, n, j: (b, tile(n), key_head(h, rep))),
                     pl.BlockSpec((None, None, None, AUX, R), lambda b, h, n, j: (b, h, tile(n), 0, 0))]
        out_shape.append(jax.ShapeDtypeStruct((B, Tp, H * V), f32))
        out_specs.append(pl.BlockSpec((None, R, W), lambda b, h, n, j: (b, tile(n), h * NV + j)))
    call = pl.pallas_call(
        functools.partial(_output_kernel, cfg=cfg, plan=plan), out_shape=out_shape,
        grid=(B, H, N, NV), in_specs=in_specs, out_specs=out_specs,
        compiler_params=_parallel_params(cfg, K, V, interpret), interpret=interpret,
        name="gdn_gpu_block_output" if plan else "gdn_gpu_output")
    outs = tuple(call(*args))
    return outs if plan else outs[0]


def noisy_forward_call(qn, kn, vn, auxn, r, *, K: int, cfg: KernelConfig, interpret: bool):
    """Block mode's noisy output from the readouts, parallel over (row, value head, readout tile).
    Returns (on [B,Tp,H*V] in vn's dtype, ph [B,H,NT,1,R] fp32: the history unit's probability)."""
    B, H, NT, _, R = auxn.shape
    Tp, V, rep = qn.shape[1], vn.shape[-1] // H, H // (qn.shape[-1] // K)
    nq = pl.BlockSpec((None, R, K), lambda b, h, t: (b, t, key_head(h, rep)))
    nv = pl.BlockSpec((None, R, V), lambda b, h, t: (b, t, h))
    nax = pl.BlockSpec((None, None, 1, AUX, R), lambda b, h, t: (b, h, t, 0, 0))
    nph = pl.BlockSpec((None, None, 1, 1, R), lambda b, h, t: (b, h, t, 0, 0))
    out_shape = [jax.ShapeDtypeStruct((B, Tp, H * V), vn.dtype), jax.ShapeDtypeStruct((B, H, NT, 1, R), f32)]
    call = pl.pallas_call(
        functools.partial(noisy_forward_kernel, cfg=cfg, G=1, R=R), out_shape=out_shape, grid=(B, H, NT),
        in_specs=[nq, nq, nv, nax, nv], out_specs=[nv, nph], compiler_params=_parallel_params(cfg, K, V, interpret),
        interpret=interpret, name="gdn_gpu_block_noisy")
    return tuple(call(qn, kn, vn, auxn, r))


def parallel_backward_call(q, k, v, aux, T, w, u, states, dstates, dO, *, cfg: KernelConfig, interpret: bool,
                           noisy=None):
    """Every cotangent but the dS recurrence, parallel over (row, key head, chunk; block mode: readout
    tile). Returns (dq, dk [B,Tp,HK*K] in q's dtype, dv [B,Tp,H*V] in v's dtype, daux [B,H,N,AUX,C]
    fp32) and with ``noisy`` = (qn, kn, vn, auxn, dOn, plan) also (dqn, dkn, dvn, dauxn). rep = H / HK
    must be a power of two (one key head's rep value heads per step, in value tiles of
    :func:`backward_tile_width`)."""
    K = w.shape[-1] // aux.shape[1]
    B, Tp, H, HK, V, C, N, rep = call_dims(q, v, aux, K)
    if rep & (rep - 1):
        raise ValueError(f"{H} value heads on {HK} key heads: the GPU form needs a power-of-two ratio")
    plan = None if noisy is None else noisy[-1]
    G = plan.rb if plan else 1   # one readout tile per step
    # one key-head grid for both streams (an unrepeated qn would read out of bounds)
    if plan is not None and (noisy[0].shape != q.shape or noisy[1].shape != k.shape):
        raise ValueError(f"noisy qn {noisy[0].shape}, kn {noisy[1].shape} must match q {q.shape}, k {k.shape}")
    args, in_specs, out_specs, out_shape = parallel_backward_io(
        q, k, v, aux, T, w, u, states, dstates, dO, noisy, G=G, rep=rep, C=C, K=K, V=V)
    call = pl.pallas_call(
        functools.partial(parallel_backward_kernel, cfg=cfg, G=G, C=C, K=K, V=V, rep=rep, plan=plan,
                          W=backward_tile_width(K, V, C, q.dtype)),
        out_shape=out_shape, grid=(B, HK, N // G), in_specs=in_specs, out_specs=out_specs,
        compiler_params=_backward_params(cfg, K, V, interpret), interpret=interpret,
        name="gdn_gpu_block_parallel_bwd" if plan else "gdn_gpu_parallel_bwd")
    return tuple(call(*args))


# ---------------------------------------------------------------------------------- sequential

def _sweep_specs(Tp: int, N: int, rep: int, C: int, K: int, W: int, NV: int):
    """BlockSpecs on the (b, h, j) grid of a sweep: key-head and value-head [Tp, K] columns, the value
    tile's [Tp, W] columns, aux [N, AUX, C], a state tile [K, W] and the per-chunk state tiles [N*K, W]."""
    kq = pl.BlockSpec((None, Tp, K), lambda b, h, j: (b, 0, key_head(h, rep)))
    kw = pl.BlockSpec((None, Tp, K), lambda b, h, j: (b, 0, h))
    vw = pl.BlockSpec((None, Tp, W), lambda b, h, j: (b, 0, h * NV + j))
    ax = pl.BlockSpec((None, None, N, AUX, C), lambda b, h, j: (b, h, 0, 0, 0))
    s = pl.BlockSpec((None, None, K, W), lambda b, h, j: (b, h, 0, j))
    st = pl.BlockSpec((None, None, N * K, W), lambda b, h, j: (b, h, 0, j))
    return kq, kw, vw, ax, s, st


def _sweep_kernel(k_ref, w_ref, u_ref, aux_ref, s0_ref, final_ref, st_ref, *, cfg, N: int, C: int, K: int):
    mm = cfg.mm()

    def body(n, S):
        rows = pl.ds(n * C, C)
        st_ref[pl.ds(n * K, K), :] = S
        return pm.chunk_state_step(k_ref[rows, :], w_ref[rows, :], u_ref[rows, :], aux_ref[n], S, mm=mm)

    final_ref[...] = lax.fori_loop(0, N, body, s0_ref[...].astype(f32))


def sweep_call(k, w, u, aux, s0, *, cfg: KernelConfig, interpret: bool):
    """The state sweep. Returns (final [B,H,K,V] fp32, states [B,H,N*K,V] fp32: rows n*K:(n+1)*K =
    the state before chunk n)."""
    K = s0.shape[2]
    B, Tp, H, HK, V, C, N, rep = call_dims(k, u, aux, K)
    W = tile_width(cfg, K, V)
    kq, kw, vw, ax, s, st = _sweep_specs(Tp, N, rep, C, K, W, V // W)
    out_shape = [jax.ShapeDtypeStruct((B, H, K, V), f32), jax.ShapeDtypeStruct((B, H, N * K, V), f32)]
    call = pl.pallas_call(
        functools.partial(_sweep_kernel, cfg=cfg, N=N, C=C, K=K), out_shape=out_shape, grid=(B, H, V // W),
        in_specs=[kq, kw, vw, ax, s], out_specs=[s, st], compiler_params=_sweep_params(cfg, K, V, interpret),
        interpret=interpret, name="gdn_gpu_sweep")
    return tuple(call(k, w, u, aux, s0))


def _state_backward_kernel(q_ref, k_ref, w_ref, aux_ref, do_ref, dfin_ref, *refs, cfg, N: int, C: int, K: int,
                           plan):
    qn_ref, auxn_ref, ph_ref, don_ref = refs[:4] if plan else (None,) * 4
    dst_ref, ds0_ref = refs[4:] if plan else refs
    kw = dict(scale=cfg.scale, mm=cfg.mm())
    rb = plan.rb if plan else 1
    R = plan.R if plan else C

    def body(i, dS):
        t = N // rb - 1 - i     # one readout tile (block mode) of rb chunks, or one chunk, per step
        for c in reversed(range(rb)):
            n = t * rb + c
            rows = pl.ds(n * C, C)
            dst_ref[pl.ds(n * K, K), :] = dS          # the cotangent of the state after chunk n
            chunk = (q_ref[rows, :], k_ref[rows, :], w_ref[rows, :], aux_ref[n], do_ref[rows, :], dS)
            if plan and plan.mid:   # the readouts inside this chunk read its start state and its deltas
                dS = bpm.chunk_block_state_backward(*chunk, qn_ref[rows, :], auxn_ref[n], ph_ref[n], don_ref[rows, :],
                                                    **kw)
            else:
                dS = pm.chunk_state_backward(*chunk, **kw)
        if plan and not plan.mid:   # the block starting at this tile read the state before it
            tr = pl.ds(t * R, R)
            dS = dS + bpm.tile_state_backward(qn_ref[tr, :], auxn_ref[t], ph_ref[t], don_ref[tr, :], **kw)
        return dS

    ds0_ref[...] = lax.fori_loop(0, N // rb, body, dfin_ref[...].astype(f32))


def state_backward_call(q, k, w, aux, dO, dfinal, *, cfg: KernelConfig, interpret: bool, noisy=None):
    """The reverse sweep carrying dS, the backward's only sequential kernel. Returns (dstates
    [B,H,N*K,V] fp32: rows n*K:(n+1)*K = the cotangent of the state AFTER chunk n, ds0 [B,H,K,V]).
    ``noisy`` = (qn, auxn, ph, dOn, plan): block mode, the readouts' cotangents join dS."""
    K = dfinal.shape[2]
    B, Tp, H, HK, V, C, N, rep = call_dims(q, dO, aux, K)
    W = tile_width(cfg, K, V)
    NV = V // W
    kq, kw, vw, ax, s, st = _sweep_specs(Tp, N, rep, C, K, W, NV)
    args, in_specs, plan = (q, k, w, aux, dO, dfinal), [kq, kq, kw, ax, vw, s], None
    if noisy is not None:
        qn, auxn, ph, dOn, plan = noisy
        NT, R = auxn.shape[2], plan.R
        args += (qn, auxn, ph, dOn)
        in_specs += [kq, pl.BlockSpec((None, None, NT, AUX, R), lambda b, h, j: (b, h, 0, 0, 0)),
                     pl.BlockSpec((None, None, NT, 1, R), lambda b, h, j: (b, h, 0, 0, 0)), vw]
    out_shape = [jax.ShapeDtypeStruct((B, H, N * K, V), f32), jax.ShapeDtypeStruct((B, H, K, V), f32)]
    call = pl.pallas_call(
        functools.partial(_state_backward_kernel, cfg=cfg, N=N, C=C, K=K, plan=plan), out_shape=out_shape,
        grid=(B, H, NV), in_specs=in_specs, out_specs=[st, s], compiler_params=_sweep_params(cfg, K, V, interpret),
        interpret=interpret, name="gdn_gpu_block_state_bwd" if plan else "gdn_gpu_state_bwd")
    return tuple(call(*args))


# ---------------------------------------------------------------------------------- compositions

def causal_forward(q, k, v, aux, s0, *, cfg: KernelConfig, interpret: bool):
    """(o [B,Tp,H*V], final [B,H,K,V] fp32, T [B,H,N,C,C] fp32: the backward's residual)."""
    K = s0.shape[2]
    kw = dict(cfg=cfg, interpret=interpret)
    T, w, u = intra_call(k, v, aux, K=K, **kw)
    final, states = sweep_call(k, w, u, aux, s0, **kw)
    return output_call(q, k, w, u, aux, states, **kw), final, T


def causal_backward(q, k, v, aux, s0, T, dO, dfinal, *, cfg: KernelConfig, interpret: bool):
    """(dq, dk [B,Tp,HK*K], dv [B,Tp,H*V], daux [B,H,N,AUX,C], ds0 [B,H,K,V]): the WY form from the
    saved inverse, the states re-swept, one reverse dS sweep, the rest parallel."""
    kw = dict(cfg=cfg, interpret=interpret)
    w, u = intra_call(k, v, aux, K=s0.shape[2], T_in=T, **kw)
    _, states = sweep_call(k, w, u, aux, s0, **kw)
    dstates, ds0 = state_backward_call(q, k, w, aux, dO, dfinal, **kw)
    return parallel_backward_call(q, k, v, aux, T, w, u, states, dstates, dO, **kw) + (ds0,)


def block_forward(q, k, v, aux, s0, qn, kn, vn, auxn, plan, *, cfg: KernelConfig, interpret: bool):
    """Block mode (both streams): (o, on [B,Tp,H*V], final [B,H,K,V], T [B,H,N,C,C], ph [B,H,NT,1,R]);
    the readouts are taken in the parallel output kernel from the swept states."""
    K = s0.shape[2]
    kw = dict(cfg=cfg, interpret=interpret)
    T, w, u = intra_call(k, v, aux, K=K, **kw)
    final, states = sweep_call(k, w, u, aux, s0, **kw)
    o, r = output_call(q, k, w, u, aux, states, noisy=(qn, auxn, plan), **kw)
    on, ph = noisy_forward_call(qn, kn, vn, auxn, r, K=K, **kw)
    return o, on, final, T, ph


def block_backward(q, k, v, aux, s0, qn, kn, vn, auxn, plan, T, ph, dO, dOn, dfinal, *, cfg: KernelConfig,
                   interpret: bool):
    """(dq, dk, dv, daux, ds0, dqn, dkn, dvn, dauxn): as :func:`causal_backward`, the readouts'
    cotangents joining the dS sweep and the parallel backward."""
    kw = dict(cfg=cfg, interpret=interpret)
    w, u = intra_call(k, v, aux, K=s0.shape[2], T_in=T, **kw)
    _, states = sweep_call(k, w, u, aux, s0, **kw)
    dstates, ds0 = state_backward_call(q, k, w, aux, dO, dfinal, noisy=(qn, auxn, ph, dOn, plan), **kw)
    dq, dk, dv, daux, dqn, dkn, dvn, dauxn = parallel_backward_call(
        q, k, v, aux, T, w, u, states, dstates, dO, noisy=(qn, kn, vn, auxn, dOn, plan), **kw)
    return dq, dk, dv, daux, ds0, dqn, dkn, dvn, dauxn
