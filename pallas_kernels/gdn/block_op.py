"""Block-mode GDN (docs/design.md 3.2 B) as Pallas kernels with a ``jax.custom_vjp``.

Same math and convention as :func:`pallas_kernels.gdn.block_reference.block_gated_delta_rule_ref`:
the clean stream is the causal chunked GDN, and each noisy block of ``block_size`` tokens reads the
clean state entering the block through one softmax over its in-block logits and the history unit.

Both platforms run the phase split of the causal path with chunks of ``chunk_size`` whatever the
block (``block_size`` and ``chunk_size`` must divide one another; r = S_s^T (qn scale) is the history
readout of the block-start state, two readout matmuls per chunk when blocks start inside chunks:
:mod:`pallas_kernels.gdn.block_phase_math`). TPU (and the "tpu" interpret form, ``gdn.tpu_calls``):
``gdn_intra`` (parallel), ``gdn_block_sweep`` (the sequential sweep, which also takes the readouts while
the state is in VMEM), ``gdn_block_noisy`` (parallel: the in-block softmax combined with r). CUDA (and
the "gpu" interpret form, ``gdn.gpu_calls``): intra, the state sweep, then the readouts in the
parallel output kernel from the swept states, and the noisy kernel. Backward on both: the WY
recompute from the saved inverse, the state recompute, the one reverse dS sweep (the readouts'
cotangents join dS) and the parallel backward of both streams. Residuals: the inputs, the per-chunk
inverse and the history probability of every noisy token. q, k and the noisy qn, kn may be on grouped
key heads (native GQA, as the causal path). The scalars' gradient comes back through ``auxn`` (alpha
broadcast over tokens, LHIST = beta + gamma log Bk): JAX autodiff of that jnp prep sums it per head.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from . import block_math as bm
from . import block_phase_math as bpm
from . import chunk_math as cm
from ..common import sharding
from . import gpu_calls as phase_gpu
from .causal_op import INTERPRET_FORMS, kernel_dims, prepare, select_form, on_value_heads, pad_heads
from .kernel_bodies import BlockPlan, KernelConfig
from .tpu_calls import intra_call, noisy_forward_call, parallel_backward_call, state_backward_call, sweep_call
from .inputs import check_inputs, reset_flags

f32 = jnp.float32


def _prepare_tiles(segment_ids, scalars_H3, aux, B: int, T: int, H: int, plan: BlockPlan, has_initial_state: bool):
    """auxn [B, H, Tp/R, AUX, R] fp32 of the readout tiles (rows: gdn.block_phase_math). Tokens past T
    (padding to whole chunks) form blocks whose outputs are dropped."""
    N, C = aux.shape[2], aux.shape[-1]
    Tp, Bk, R = N * C, plan.block, plan.R
    reset_BT = jnp.pad(reset_flags(segment_ids, B, T), ((0, 0), (0, Tp - T)))
    run_BT = jnp.cumsum(reset_BT.astype(jnp.int32), axis=1)
    run_BNC = run_BT.reshape(B, Tp // Bk, Bk)
    # the history state belongs to the document of the token before the block (token 0 for block 0)
    prev_BN = jnp.concatenate([run_BT[:, :1], run_BNC[:, :-1, -1]], axis=1)
    has_hist = (run_BNC == prev_BN[..., None]).reshape(B, Tp)
    if not has_initial_state:
        has_hist = has_hist.at[:, :Bk].set(False)
    # softmax key: a tile-local index of the (block, document) pieces, exact in fp32
    pos = jnp.arange(Tp)
    piece = jnp.cumsum((reset_BT | (pos % Bk == 0)[None]).astype(jnp.int32), axis=1).reshape(B, -1, R)
    piece = piece - piece[..., :1]
    scal = scalars_H3.astype(f32)
    lh_H = scal[:, 1] + scal[:, 2] * math.log(Bk)
    shape = (B, H, Tp // R, R)
    tile = lambda x_BT: jnp.broadcast_to(x_BT.reshape(B, 1, -1, R), shape)  # noqa: E731
    blk = (pos % R) // Bk
    rows = [jnp.zeros(shape, f32)] * cm.AUX_WIDTH
    rows[bm.RUN_N] = tile(piece.astype(f32))
    rows[bm.ALPHA] = jnp.broadcast_to(scal[:, 0][None, :, None, None], shape)
    rows[bm.LHIST] = jnp.where(tile(has_hist), lh_H[None, :, None, None], bm.HIST_OFF)
    rows[bpm.BLK] = tile(jnp.broadcast_to(blk.astype(f32), (B, Tp)))
    rows[bpm.HDEC] = jnp.ones(shape, f32)
    rows[bpm.RUNB] = -jnp.ones(shape, f32)
    if plan.mid:  # per block of a chunk: the values of the token before its start (that block's last)
        m = C // Bk

        def before(x_BHNC, first):
            last = x_BHNC.reshape(B, -1, N, m, Bk)[..., -1]
            prev = jnp.concatenate([jnp.full(last.shape[:-1] + (1,), first, last.dtype), last[..., :-1]], axis=-1)
            return jnp.broadcast_to(jnp.repeat(prev, Bk, axis=-1), shape)
        rows[bpm.HDEC] = before(aux[:, :, :, cm.EIN], 1.0)
        rows[bpm.CUMB] = before(aux[:, :, :, cm.CUM], 0.0)
        rows[bpm.RUNB] = before(lax.stop_gradient(aux[:, :1, :, cm.RUN]), -1.0)
    return jnp.stack(rows, axis=-2)


def _forward_make(cfg, plan: BlockPlan, H, HK, K, V):
    def make(form, interpret):
        kw = dict(cfg=cfg, interpret=interpret)
        if form == "gpu":
            def call(q, k, v, aux, s0, qn, kn, vn, auxn):
                return phase_gpu.block_forward(q, k, v, aux, s0, qn, kn, vn, auxn, plan, **kw)
        else:
            def call(q, k, v, aux, s0, qn, kn, vn, auxn):
                Kx = k.shape[-1] // HK
                T_inv, w, u = intra_call(k, v, aux, K=Kx, **kw)
                final, o, r = sweep_call(q, k, w, u, aux, s0, noisy=(qn, auxn, plan), **kw)
                on, ph = noisy_forward_call(qn, kn, vn, auxn, r, K=Kx, **kw)
                return o, on, final, T_inv, ph
        Kp, Vp = kernel_dims(form, interpret, H, K, V)
        return pad_heads(call, ("q", "q", "v", None, "s", "q", "q", "v", None), ("v", "v", "s", None, None),
                         H, K, V, Kp, Vp, HK)
    return make


def _backward_make(cfg, plan: BlockPlan, H, HK, K, V):
    def make(form, interpret):
        kw = dict(cfg=cfg, interpret=interpret)
        if form == "gpu":
            def gpu_call(q, k, v, aux, s0, qn, kn, vn, auxn, T, ph, dO, dOn, dfin):
                return phase_gpu.block_backward(q, k, v, aux, s0, qn, kn, vn, auxn, plan, T, ph, dO, dOn, dfin, **kw)
            call = on_value_heads(gpu_call, H, HK, (0, 1, 5, 6), (0, 1, 5, 6))
        else:
            def call(q, k, v, aux, s0, qn, kn, vn, auxn, T, ph, dO, dOn, dfin):
                w, u = intra_call(k, v, aux, K=k.shape[-1] // HK, T_in=T, **kw)       # WY from the saved inverse
                _, states = sweep_call(q, k, w, u, aux, s0, with_o=False, with_states=True, **kw)
                dstates, ds0 = state_backward_call(q, k, w, aux, dO, dfin, noisy=(qn, auxn, ph, dOn, plan), **kw)
                dq, dk, dv, daux, dqn, dkn, dvn, dauxn = parallel_backward_call(
                    q, k, v, aux, T, w, u, states, dstates, dO, noisy=(qn, kn, vn, auxn, dOn, plan), **kw)
                return dq, dk, dv, daux, ds0, dqn, dkn, dvn, dauxn
        Kp, Vp = kernel_dims(form, interpret, H, K, V)
        kinds_in = ("q", "q", "v", None, "s", "q", "q", "v", None, None, None, "v", "v", "s")
        kinds_out = ("q", "q", "v", None, "s", "q", "q", "v", None)
        return pad_heads(call, kinds_in, kinds_out, H, K, V, Kp, Vp, HK)
    return make


def _dims_of(s0, q):
    H, K, V = s0.shape[1:]
    return H, q.shape[-1] // K, K, V


def _core_parts(q, k, v, aux, s0, qn, kn, vn, auxn, cfg, mode, plan):
    make = _forward_make(cfg, plan, *_dims_of(s0, q))
    return select_form(make, mode, q, k, v, aux, s0, qn, kn, vn, auxn)


def _core_impl(*a):
    return _core_parts(*a)[:3]


_core = jax.custom_vjp(_core_impl, nondiff_argnums=(9, 10, 11))


def _core_fwd(*a):
    o, on, final, T_inv, ph = _core_parts(*a)
    # residuals: the inputs, the per-chunk inverse and the history probabilities (one per noisy token)
    return (o, on, final), a[:9] + (T_inv, ph)


def _core_bwd(cfg, mode, plan, res, cts):
    q, k, v, aux, s0, qn, kn, vn, auxn, T_inv, ph = res
    dO, dOn, dfin = cts
    make = _backward_make(cfg, plan, *_dims_of(s0, q))
    grads = select_form(make, mode, q, k, v, aux, s0, qn, kn, vn, auxn, T_inv, ph, dO.astype(v.dtype),
                    dOn.astype(vn.dtype), dfin.astype(f32))
    return tuple(g.astype(x.dtype) for g, x in zip(grads, res[:9]))


_core.defvjp(_core_fwd, _core_bwd)


def block_gated_delta_rule_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    q_noisy: jax.Array,
    k_noisy: jax.Array,
    v_noisy: jax.Array,
    scalars_H3: jax.Array,
    *,
    block_size: int,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    interpret: bool | None = None,
    interpret_form: str = "tpu",
    block_v: int | None = None,
    mesh=None,
    batch_axes: tuple[str, ...] | None = None,
    head_axes: tuple[str, ...] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Both streams of a block-mode GDN layer as Pallas kernels (one state sweep, the rest parallel).

    Args: the clean stream as ``chunk_gated_delta_rule_pallas`` (q, k [B, T, H, dk], v [B, T, H, dv],
        g, beta [B, T, H]); the noisy stream ``q_noisy, k_noisy, v_noisy`` of the same shapes;
        ``scalars_H3`` [H, 3] fp32 (alpha, beta, gamma) per value head; ``block_size`` (T must be a
        multiple of it); the remaining options as ``chunk_gated_delta_rule_pallas``.

    Returns:
        (o_clean [B, T, H, dv] in v's dtype, o_noisy [B, T, H, dv] in v_noisy's dtype,
        final clean state [B, H, dk, dv] fp32).
    """
    B, T, H, K, V = check_inputs(q, k, v, g, beta, initial_state, segment_ids)
    HK = q.shape[2]
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int; got {block_size!r}")
    if T % block_size:
        raise ValueError(f"block mode needs T ({T}) to be a multiple of block_size ({block_size})")
    for name, x, ref in (("q_noisy", q_noisy, q), ("k_noisy", k_noisy, k), ("v_noisy", v_noisy, v)):
        if x.shape != ref.shape:
            raise ValueError(f"{name} must have the clean stream's shape {ref.shape}; got {x.shape}")
    if scalars_H3.shape != (H, 3):
        raise ValueError(f"scalars must be [H, 3] = {(H, 3)} (alpha, beta, gamma); got {scalars_H3.shape}")
    if interpret_form not in INTERPRET_FORMS:
        raise ValueError(f"interpret_form must be one of {INTERPRET_FORMS}; got {interpret_form!r}")
    plan = BlockPlan(block_size, chunk_size)
    low = None if q.dtype == f32 else jnp.dtype(q.dtype).name
    sc = float(K ** -0.5 if scale is None else scale)
    cfg = KernelConfig(chunk_size=chunk_size, scale=sc, block_v=block_v, low_dtype=low)
    mode = ({None: "auto", True: "interpret", False: "native"}[interpret], interpret_form)
    qf, kf, vf, aux, s0 = prepare(q, k, v, g, beta, initial_state, segment_ids, chunk_size)
    auxn = _prepare_tiles(segment_ids, scalars_H3, aux, B, T, H, plan, initial_state is not None)
    Tp = qf.shape[1]
    flat = lambda x: jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).reshape(B, Tp, -1)  # noqa: E731
    args = (qf, kf, vf, aux, s0, flat(q_noisy), flat(k_noisy), flat(v_noisy), auxn)

    core = lambda *a: _core(*a, cfg, mode, plan)  # noqa: E731
    mesh = sharding.active_mesh(mesh)
    if mesh is None:
        o, on, final = core(*args)
    else:
        # head axes must split the KEY heads evenly: a device's value heads then read its key heads
        b_axes, h_axes = sharding.gdn_mesh_axes(mesh, B, HK, batch_axes, head_axes)
        tok, head = P(b_axes, None, h_axes), P(b_axes, h_axes)
        o, on, final = sharding.run_sharded(core, mesh, (tok, tok, tok, head, head, tok, tok, tok, head),
                                                (tok, tok, head), *args)
    o, on = o[:, :T].reshape(B, T, H, V), on[:, :T].reshape(B, T, H, V)
    return o.astype(v.dtype), on.astype(v_noisy.dtype), final
