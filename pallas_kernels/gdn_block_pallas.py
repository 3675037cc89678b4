"""Fused block-mode GDN (docs/design.md 3.2 B) as Pallas kernels with a ``jax.custom_vjp``.

Same math and convention as :func:`pallas_kernels.gdn_block_reference.block_gated_delta_rule_ref`:
the clean stream is the causal chunked GDN, and each noisy block of ``block_size`` tokens reads the
clean state entering the block through one softmax over its in-block logits and the history unit.
One sweep computes both streams: the readout of a block runs while the state at the block start is
in fast memory (VMEM scratch / loop carry), so the per-block states never go to HBM in the forward.

Kernel chunk: the sweep's chunk must tile the block grid, so it is ``chunk_size`` when that divides
``block_size`` (a block is then r = block_size / chunk_size chunks) and ``block_size`` when
``block_size`` divides ``chunk_size``; other pairs are an error. The clean output does not depend on
the chunk length (fp32 round-off).

Backward: the causal state-recompute sweep (``forward_call(with_states=True)``), then one fused
reverse sweep that emits the clean gradients, the noisy gradients, and adds each block readout's
d(state) into the carried dS. The scalars' gradient comes back through ``auxn`` (alpha broadcast
over tokens, LHIST = beta + gamma log Bk): JAX autodiff of that jnp prep sums it per head.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import gdn_block_math as bm
from . import gdn_chunk_math as cm
from . import gdn_sharding
from .gdn_block_pallas_calls import block_backward_call, block_forward_call
from .gdn_pallas import INTERPRET_FORMS, _forward, _padded_dims, _prepare, _select, pad_heads
from .gdn_pallas_calls import KernelConfig
from .gdn_reference import _check_inputs, _reset_flags

f32 = jnp.float32


def kernel_chunk(chunk_size: int, block_size: int) -> int:
    """The sweep's chunk length for a block size (see the module docstring)."""
    if block_size % chunk_size == 0:
        return chunk_size
    if chunk_size % block_size == 0:
        return block_size
    raise ValueError(f"block_size {block_size} and chunk_size {chunk_size}: one must divide the other "
                     "(the kernel's chunks must tile the block grid)")


def _prepare_noisy(segment_ids, scalars_H3, B: int, T: int, H: int, block_size: int, has_initial_state: bool):
    """auxn [B, H, NB, AUX, Bk] fp32 with rows RUN_N, ALPHA, LHIST (gdn_block_math)."""
    NB = T // block_size
    run_BT = jnp.cumsum(_reset_flags(segment_ids, B, T).astype(jnp.int32), axis=1)
    run_BNC = run_BT.reshape(B, NB, block_size)
    # the history state belongs to the document of the token before the block (token 0 for block 0)
    prev_BN = jnp.concatenate([run_BT[:, :1], run_BNC[:, :-1, -1]], axis=1)
    has_hist = run_BNC == prev_BN[..., None]
    if not has_initial_state:
        has_hist = has_hist.at[:, 0].set(False)
    scal = scalars_H3.astype(f32)
    lh_H = scal[:, 1] + scal[:, 2] * math.log(block_size)
    shape = (B, H, NB, block_size)
    rows = [jnp.zeros(shape, f32)] * cm.AUX_WIDTH
    rows[bm.RUN_N] = jnp.broadcast_to(run_BNC.astype(f32)[:, None], shape)
    rows[bm.ALPHA] = jnp.broadcast_to(scal[:, 0][None, :, None, None], shape)
    rows[bm.LHIST] = jnp.where(has_hist[:, None], lh_H[None, :, None, None], bm.HIST_OFF)
    return jnp.stack(rows, axis=-2)


def _block_forward(args, cfg, mode, r):
    H, K, V = args[4].shape[1:]

    def make(form, interpret):
        def call(*a):
            return tuple(block_forward_call(*a, cfg=cfg, r=r, form=form, interpret=interpret))
        Kp, Vp = (K, V) if interpret else _padded_dims(form, H, K, V)
        return pad_heads(call, ("k", "k", "v", None, "s", "k", "k", "v", None), ("s", "v", "v"), H, K, V, Kp, Vp)

    return _select(make, mode, *args)


def _block_backward(args, cfg, mode, r):
    H, K, V = args[6].shape[1:]

    def make(form, interpret):
        def call(*a):
            dq, dk, dv, daux, ds0, dqn, dkn, dvn, dauxn = block_backward_call(
                *a, cfg=cfg, r=r, form=form, interpret=interpret)
            dt = a[0].dtype  # value-block partial sums -> totals (platform branches must agree)
            return (dq.sum(0).astype(dt), dk.sum(0).astype(dt), dv, daux.sum(0), ds0,
                    dqn.sum(0).astype(dt), dkn.sum(0).astype(dt), dvn, dauxn.sum(0))
        Kp, Vp = (K, V) if interpret else _padded_dims(form, H, K, V)
        kinds_in = ("k", "k", "v", None, "st", "v", "s", "k", "k", "v", None, "v")
        kinds_out = ("k", "k", "v", None, "s", "k", "k", "v", None)
        return pad_heads(call, kinds_in, kinds_out, H, K, V, Kp, Vp)

    return _select(make, mode, *args)


def _core_impl(q, k, v, aux, s0, qn, kn, vn, auxn, cfg, mode, r):
    final, o, on = _block_forward((q, k, v, aux, s0, qn, kn, vn, auxn), cfg, mode, r)
    return o, on, final


_core = jax.custom_vjp(_core_impl, nondiff_argnums=(9, 10, 11))


def _core_fwd(q, k, v, aux, s0, qn, kn, vn, auxn, cfg, mode, r):
    return _core_impl(q, k, v, aux, s0, qn, kn, vn, auxn, cfg, mode, r), (q, k, v, aux, s0, qn, kn, vn, auxn)


def _core_bwd(cfg, mode, r, res, cts):
    q, k, v, aux, s0, qn, kn, vn, auxn = res
    dO, dOn, dfin = cts
    _, states = _forward(q, k, v, aux, s0, cfg, mode, with_o=False, with_states=True)
    dq, dk, dv, daux, ds0, dqn, dkn, dvn, dauxn = _block_backward(
        (q, k, v, aux, states, dO.astype(v.dtype), dfin.astype(f32), qn, kn, vn, auxn, dOn.astype(vn.dtype)),
        cfg, mode, r)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), daux, ds0.astype(s0.dtype),
            dqn.astype(qn.dtype), dkn.astype(kn.dtype), dvn.astype(vn.dtype), dauxn)


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
    """Both streams of a block-mode GDN layer in one fused Pallas sweep.

    Args: the clean stream as ``chunk_gated_delta_rule_pallas`` (q, k [B, T, H, dk], v [B, T, H, dv],
        g, beta [B, T, H]); the noisy stream ``q_noisy, k_noisy, v_noisy`` of the same shapes;
        ``scalars_H3`` [H, 3] fp32 (alpha, beta, gamma) per value head; ``block_size`` (T must be a
        multiple of it); the remaining options as ``chunk_gated_delta_rule_pallas``.

    Returns:
        (o_clean [B, T, H, dv] in v's dtype, o_noisy [B, T, H, dv] in v_noisy's dtype,
        final clean state [B, H, dk, dv] fp32).
    """
    B, T, H, K, V = _check_inputs(q, k, v, g, beta, initial_state, segment_ids)
    if q.shape[2] != H:
        raise ValueError(f"block mode needs q and k repeated to the {H} value heads; got {q.shape[2]} heads")
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
    C = kernel_chunk(chunk_size, block_size)
    r = block_size // C
    low = None if q.dtype == f32 else jnp.dtype(q.dtype).name
    cfg = KernelConfig(chunk_size=C, scale=float(K ** -0.5 if scale is None else scale), block_v=block_v, low_dtype=low)
    mode = ({None: "auto", True: "interpret", False: "native"}[interpret], interpret_form)
    qf, kf, vf, aux, s0 = _prepare(q, k, v, g, beta, initial_state, segment_ids, C)
    auxn = _prepare_noisy(segment_ids, scalars_H3, B, T, H, block_size, initial_state is not None)
    flat = lambda x: x.reshape(B, T, -1)  # noqa: E731
    args = (qf, kf, vf, aux, s0, flat(q_noisy), flat(k_noisy), flat(v_noisy), auxn)

    core = lambda *a: _core(*a, cfg, mode, r)  # noqa: E731
    mesh = gdn_sharding.active_mesh(mesh)
    if mesh is None:
        o, on, final = core(*args)
    else:
        b_axes, h_axes = gdn_sharding.gdn_mesh_axes(mesh, B, H, batch_axes, head_axes)
        tok, head = P(b_axes, None, h_axes), P(b_axes, h_axes)
        o, on, final = gdn_sharding.run_sharded(core, mesh, (tok, tok, tok, head, head, tok, tok, tok, head),
                                                (tok, tok, head), *args)
    return o.reshape(B, T, H, V).astype(v.dtype), on.reshape(B, T, H, V).astype(v_noisy.dtype), final
