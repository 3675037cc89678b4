"""The ``pallas_call``s of the chunked causal GDN: forward sweep and reverse (backward) sweep, each in
a TPU form and a GPU form around the same per-chunk math (:mod:`pallas_kernels.gdn_chunk_math`).

Layout (prepared by :mod:`pallas_kernels.gdn_pallas`), T padded to Tp = N * C: ``q, k``
[B, Tp, H * K] and ``v`` [B, Tp, H * V] (the caller's [B, T, H, .] arrays, reshaped for free: no
head-major transpose; a block (C, K) at column block h is head h), ``aux`` fp32 [B, H, N, AUX, C]
(see gdn_chunk_math), states fp32 [B, H, K, V]; per-chunk states ``states`` fp32 [B, H, N * K, V]
(rows n*K:(n+1)*K = state before chunk n). The value dim may be split into blocks of width W
(columns of the state are independent in the delta rule); dq, dk and d_aux then come back as
per-block partial sums with a leading NV axis.

- TPU form (Mosaic, also the interpret form): grid (B, H, NV, N), the chunk axis innermost and
  "arbitrary"; the running state (forward) or its cotangent (backward) lives in a VMEM scratch that
  persists across the chunk steps, so every grid step touches one (C, K) / (C, W) tile and Pallas
  pipelines the HBM traffic. Block shapes: C a multiple of 8; K, W multiples of 128 (or H = 1).
- GPU form (Triton): grid programs run concurrently, so nothing may carry across grid steps; the grid
  is (B, H, NV) and each program loops over the chunks (``fori_loop``) with the state as the loop
  carry, loading one chunk per iteration. Triton needs power-of-two block dims >= 16 (the wrapper pads
  K and V; C must be a power of two >= 16).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import gdn_chunk_math as cm
from .cost import grid_estimate, spec

AUX = cm.AUX_WIDTH
f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static kernel options.

    chunk_size: C, tokens per chunk (64 default, the value HF and fla use).
    scale: multiplier of q (dk ** -0.5 by convention), applied in fp32 inside the kernel.
    block_v: value-block width W; None = the whole dv (TPU / interpret) or min(dv, 64) (GPU).
    low_dtype: operand dtype of the chunk matmuls for low-precision inputs (None = fp32 HIGHEST).
    num_warps, num_stages: Triton launch options.
    """
    chunk_size: int = 64
    scale: float = 1.0
    block_v: int | None = None
    low_dtype: str | None = None
    num_warps: int = 4
    num_stages: int = 1

    def mm(self) -> cm.MatmulPolicy:
        return cm.MatmulPolicy(None if self.low_dtype is None else jnp.dtype(self.low_dtype))

    def width(self, V: int, gpu: bool) -> int:
        W = self.block_v if self.block_v is not None else (min(V, 64) if gpu else V)
        if V % W:
            raise ValueError(f"block_v={W} must divide dv={V}")
        return W


def _tpu_params(n_parallel: int):
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * n_parallel + ("arbitrary",))


def _gpu_params(cfg: KernelConfig):
    from jax.experimental.pallas import triton as plgpu
    params = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return params(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ------------------------------------------------------------------------------------ cost estimates

def chunk_forward_step(q, k, v, aux, S, *, cfg):
    """One grid step of the forward sweep (the per-chunk math the kernels run)."""
    return cm.chunk_forward(q, k, v, aux, S, scale=cfg.scale, mm=cfg.mm())


def chunk_backward_step(q, k, v, aux, S, dO, dS, *, cfg):
    """One grid step of the reverse sweep."""
    return cm.chunk_backward(q, k, v, aux, S, dO, dS, scale=cfg.scale, mm=cfg.mm())


def chunk_specs(q, v, C: int, K: int, W: int) -> tuple:
    """Per-step tiles q, k [C, K], v [C, W], aux [AUX, C], state [K, W] (for the step cost)."""
    return (spec((C, K), q.dtype), spec((C, K), q.dtype), spec((C, W), v.dtype), spec((AUX, C), f32),
            spec((K, W), f32))


def sweep_cost(cfg: KernelConfig, q, v, dims, operands, results, backward: bool, extra_steps=()):
    """CostEstimate of a forward / reverse sweep over B*H*NV*N chunk steps (plus ``extra_steps``)."""
    B, Tp, H, K, V, C, N, W, NV = dims
    specs = chunk_specs(q, v, C, K, W)
    step = chunk_forward_step
    if backward:
        specs, step = specs + (spec((C, W), v.dtype), spec((K, W), f32)), chunk_backward_step
    steps = [(step, specs, (("cfg", cfg),), B * H * NV * N), *extra_steps]
    return grid_estimate(steps, operands, results)


# ------------------------------------------------------------------------------------------ forward

def _fwd_kernel_tpu(q_ref, k_ref, v_ref, aux_ref, s0_ref, *refs, cfg, with_o, with_states):
    outs = list(refs[:-1])
    S_ref = refs[-1]
    final_ref = outs.pop(0)
    o_ref = outs.pop(0) if with_o else None
    st_ref = outs.pop(0) if with_states else None
    n = pl.program_id(3)

    @pl.when(n == 0)
    def _():
        S_ref[...] = s0_ref[...].astype(f32)

    S = S_ref[...]
    if with_states:
        st_ref[...] = S
    o, S_new = cm.chunk_forward(q_ref[...], k_ref[...], v_ref[...], aux_ref[...], S,
                                scale=cfg.scale, mm=cfg.mm())
    if with_o:
        o_ref[...] = o.astype(o_ref.dtype)
    S_ref[...] = S_new

    @pl.when(n == pl.num_programs(3) - 1)
    def _():
        final_ref[...] = S_new


def _fwd_kernel_gpu(q_ref, k_ref, v_ref, aux_ref, s0_ref, *outs, cfg, n_chunks, with_o, with_states):
    outs = list(outs)
    final_ref = outs.pop(0)
    o_ref = outs.pop(0) if with_o else None
    st_ref = outs.pop(0) if with_states else None
    C = cfg.chunk_size
    K = q_ref.shape[-1]

    def body(n, S):
        rows = pl.ds(n * C, C)
        if with_states:
            st_ref[pl.ds(n * K, K), :] = S
        o, S_new = cm.chunk_forward(q_ref[rows, :], k_ref[rows, :], v_ref[rows, :], aux_ref[n], S,
                                    scale=cfg.scale, mm=cfg.mm())
        if with_o:
            o_ref[rows, :] = o.astype(o_ref.dtype)
        return S_new

    final_ref[...] = lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(f32))


def _dims(q, v, aux, cfg: KernelConfig, gpu: bool):
    B, Tp, HK = q.shape
    _, H, N, _, C = aux.shape
    K, V = HK // H, v.shape[-1] // H
    if C != cfg.chunk_size or N * C != Tp:
        raise ValueError(f"aux {aux.shape} does not match chunk_size {cfg.chunk_size} and Tp {Tp}")
    W = cfg.width(V, gpu)
    return B, Tp, H, K, V, C, N, W, V // W


def forward_call(q, k, v, aux, s0, *, cfg: KernelConfig, form: str, interpret: bool,
                 with_o: bool = True, with_states: bool = False):
    """Forward sweep. Returns (final [B,H,K,V] fp32, o [B,Tp,H*V] in v's dtype if with_o,
    states [B,H,N*K,V] fp32 if with_states)."""
    gpu = form == "gpu"
    dims = _dims(q, v, aux, cfg, gpu)
    B, Tp, H, K, V, C, N, W, NV = dims
    out_shape = [jax.ShapeDtypeStruct((B, H, K, V), f32)]
    if with_o:
        out_shape.append(jax.ShapeDtypeStruct((B, Tp, H * V), v.dtype))
    if with_states:
        out_shape.append(jax.ShapeDtypeStruct((B, H, N * K, V), f32))
    cost = sweep_cost(cfg, q, v, dims, (q, k, v, aux, s0), out_shape, backward=False)

    if not gpu:
        qk_spec = pl.BlockSpec((None, C, K), lambda b, h, j, n: (b, n, h))
        vw_spec = pl.BlockSpec((None, C, W), lambda b, h, j, n: (b, n, h * NV + j))
        kw_spec = pl.BlockSpec((None, None, K, W), lambda b, h, j, n: (b, h, 0, j))
        in_specs = [qk_spec, qk_spec, vw_spec,
                    pl.BlockSpec((None, None, None, AUX, C), lambda b, h, j, n: (b, h, n, 0, 0)), kw_spec]
        out_specs = [kw_spec]
        if with_o:
            out_specs.append(vw_spec)
        if with_states:
            out_specs.append(pl.BlockSpec((None, None, K, W), lambda b, h, j, n: (b, h, n, j)))
        kernel = functools.partial(_fwd_kernel_tpu, cfg=cfg, with_o=with_o, with_states=with_states)
        call = pl.pallas_call(
            kernel, out_shape=out_shape, grid=(B, H, NV, N), in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((K, W), f32)], compiler_params=_tpu_params(3),
            interpret=interpret, name="gdn_chunk_fwd", cost_estimate=cost)
    else:
        qk_spec = pl.BlockSpec((None, Tp, K), lambda b, h, j: (b, 0, h))
        vw_spec = pl.BlockSpec((None, Tp, W), lambda b, h, j: (b, 0, h * NV + j))
        kw_spec = pl.BlockSpec((None, None, K, W), lambda b, h, j: (b, h, 0, j))
        in_specs = [qk_spec, qk_spec, vw_spec,
                    pl.BlockSpec((None, None, N, AUX, C), lambda b, h, j: (b, h, 0, 0, 0)), kw_spec]
        out_specs = [kw_spec]
        if with_o:
            out_specs.append(vw_spec)
        if with_states:
            out_specs.append(pl.BlockSpec((None, None, N * K, W), lambda b, h, j: (b, h, 0, j)))
        kernel = functools.partial(_fwd_kernel_gpu, cfg=cfg, n_chunks=N, with_o=with_o,
                                   with_states=with_states)
        call = pl.pallas_call(
            kernel, out_shape=out_shape, grid=(B, H, NV), in_specs=in_specs, out_specs=out_specs,
            compiler_params=None if interpret else _gpu_params(cfg), interpret=interpret,
            name="gdn_chunk_fwd", cost_estimate=cost)
    return call(q, k, v, aux, s0)


# ----------------------------------------------------------------------------------------- backward

def _bwd_kernel_tpu(q_ref, k_ref, v_ref, aux_ref, st_ref, do_ref, dfin_ref,
                    dq_ref, dk_ref, dv_ref, daux_ref, ds0_ref, dS_ref, *, cfg):
    n = pl.program_id(3)

    @pl.when(n == 0)
    def _():
        dS_ref[...] = dfin_ref[...].astype(f32)

    dq, dk, dv, daux, dS = cm.chunk_backward(
        q_ref[...], k_ref[...], v_ref[...], aux_ref[...], st_ref[...], do_ref[...], dS_ref[...],
        scale=cfg.scale, mm=cfg.mm())
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    daux_ref[...] = daux
    dS_ref[...] = dS

    @pl.when(n == pl.num_programs(3) - 1)
    def _():
        ds0_ref[...] = dS


def _bwd_kernel_gpu(q_ref, k_ref, v_ref, aux_ref, st_ref, do_ref, dfin_ref,
                    dq_ref, dk_ref, dv_ref, daux_ref, ds0_ref, *, cfg, n_chunks):
    C = cfg.chunk_size
    K = q_ref.shape[-1]

    def body(r, dSn):
        n = n_chunks - 1 - r
        rows = pl.ds(n * C, C)
        dq, dk, dv, daux, dS = cm.chunk_backward(
            q_ref[rows, :], k_ref[rows, :], v_ref[rows, :], aux_ref[n], st_ref[pl.ds(n * K, K), :],
            do_ref[rows, :], dSn, scale=cfg.scale, mm=cfg.mm())
        dq_ref[rows, :] = dq.astype(dq_ref.dtype)
        dk_ref[rows, :] = dk.astype(dk_ref.dtype)
        dv_ref[rows, :] = dv.astype(dv_ref.dtype)
        daux_ref[n] = daux
        return dS

    ds0_ref[...] = lax.fori_loop(0, n_chunks, body, dfin_ref[...].astype(f32))


def backward_call(q, k, v, aux, states, dO, dfinal, *, cfg: KernelConfig, form: str, interpret: bool):
    """Reverse sweep over chunks carrying dS. Returns (dq [NV,B,Tp,H*K], dk [NV,B,Tp,H*K],
    dv [B,Tp,H*V], daux [NV,B,H,N,AUX,C], ds0 [B,H,K,V]); dq, dk, daux to be summed over NV.
    dq, dk are in q's dtype if NV == 1 else fp32; dv in v's dtype; daux, ds0 fp32."""
    gpu = form == "gpu"
    dims = _dims(q, v, aux, cfg, gpu)
    B, Tp, H, K, V, C, N, W, NV = dims
    # With one value block a token's dq / dk are complete after its chunk step: store them in the
    # input dtype (halves the backward's largest buffers for bf16); partial sums stay fp32.
    dqk_dtype = q.dtype if NV == 1 else f32
    out_shape = [jax.ShapeDtypeStruct((NV, B, Tp, H * K), dqk_dtype),
                 jax.ShapeDtypeStruct((NV, B, Tp, H * K), dqk_dtype),
                 jax.ShapeDtypeStruct((B, Tp, H * V), v.dtype), jax.ShapeDtypeStruct((NV,) + aux.shape, f32),
                 jax.ShapeDtypeStruct((B, H, K, V), f32)]
    cost = sweep_cost(cfg, q, v, dims, (q, k, v, aux, states, dO, dfinal), out_shape, backward=True)
    if not gpu:
        rev = lambda n: N - 1 - n  # noqa: E731  the sweep runs from the last chunk to the first
        qk_spec = pl.BlockSpec((None, C, K), lambda b, h, j, n: (b, rev(n), h))
        vw_spec = pl.BlockSpec((None, C, W), lambda b, h, j, n: (b, rev(n), h * NV + j))
        kw_spec = pl.BlockSpec((None, None, K, W), lambda b, h, j, n: (b, h, 0, j))
        in_specs = [qk_spec, qk_spec, vw_spec,
                    pl.BlockSpec((None, None, None, AUX, C), lambda b, h, j, n: (b, h, rev(n), 0, 0)),
                    pl.BlockSpec((None, None, K, W), lambda b, h, j, n: (b, h, rev(n), j)),
                    vw_spec, kw_spec]
        part_k = pl.BlockSpec((None, None, C, K), lambda b, h, j, n: (j, b, rev(n), h))
        out_specs = [part_k, part_k, vw_spec,
                     pl.BlockSpec((None, None, None, None, AUX, C), lambda b, h, j, n: (j, b, h, rev(n), 0, 0)),
                     kw_spec]
        call = pl.pallas_call(
            functools.partial(_bwd_kernel_tpu, cfg=cfg), out_shape=out_shape, grid=(B, H, NV, N),
            in_specs=in_specs, out_specs=out_specs, scratch_shapes=[pltpu.VMEM((K, W), f32)],
            compiler_params=_tpu_params(3), interpret=interpret, name="gdn_chunk_bwd", cost_estimate=cost)
    else:
        qk_spec = pl.BlockSpec((None, Tp, K), lambda b, h, j: (b, 0, h))
        vw_spec = pl.BlockSpec((None, Tp, W), lambda b, h, j: (b, 0, h * NV + j))
        kw_spec = pl.BlockSpec((None, None, K, W), lambda b, h, j: (b, h, 0, j))
        in_specs = [qk_spec, qk_spec, vw_spec,
                    pl.BlockSpec((None, None, N, AUX, C), lambda b, h, j: (b, h, 0, 0, 0)),
                    pl.BlockSpec((None, None, N * K, W), lambda b, h, j: (b, h, 0, j)),
                    vw_spec, kw_spec]
        part_k = pl.BlockSpec((None, None, Tp, K), lambda b, h, j: (j, b, 0, h))
        out_specs = [part_k, part_k, vw_spec,
                     pl.BlockSpec((None, None, None, N, AUX, C), lambda b, h, j: (j, b, h, 0, 0, 0)),
                     kw_spec]
        call = pl.pallas_call(
            functools.partial(_bwd_kernel_gpu, cfg=cfg, n_chunks=N), out_shape=out_shape,
            grid=(B, H, NV), in_specs=in_specs, out_specs=out_specs,
            compiler_params=None if interpret else _gpu_params(cfg), interpret=interpret,
            name="gdn_chunk_bwd", cost_estimate=cost)
    return call(q, k, v, aux, states, dO, dfinal)
