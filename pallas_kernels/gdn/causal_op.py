"""Chunked causal gated delta rule as Pallas kernels, differentiable through ``jax.custom_vjp``.

Structure (who does what):

1. ``prepare`` (plain jnp, differentiated by JAX autodiff): the transformers argument convention
   [B, T, H, .] -> [B, Tp, H * .] (T padded to whole chunks only when T % C != 0; otherwise a free
   reshape: the kernel's BlockSpecs pick head h's (C, d) tile out of the flat head dim), and the
   per-token scalars the kernel needs (segment-restarting in-chunk cumsum of g, beta, state-in /
   state-out decays, chunk state decay, document index) packed into ``aux`` [B, H, N, 8, C] fp32
   (see :mod:`pallas_kernels.gdn.chunk_math`). Segment semantics are those
   of :mod:`pallas_kernels.gdn.reference`: a document starts where the id changes from the previous
   token, never at t = 0; the initial state belongs to token 0's document.
2. ``_core`` (``jax.custom_vjp``): the phase split of fla's ``chunk_gated_delta_rule`` (per-chunk
   math: :mod:`pallas_kernels.gdn.phase_math`): a parallel intra-chunk kernel (k k^T, the triangular
   inverse T, the WY form w, u), the sequential state sweep, the output -> (o, final state).
   Residuals: the inputs and T. Backward: the WY form from T (no re-inversion), the states re-swept,
   one reverse sweep carrying dS, every other cotangent parallel over chunks.
3. Backend choice inside ``_core``: ``jax.lax.platform_dependent`` picks the Mosaic kernels on TPU
   (:mod:`pallas_kernels.gdn.tpu_calls`: grid steps over chunks, the state in VMEM scratch, the
   output inside the sweep), the Triton kernels on CUDA / ROCm (:mod:`pallas_kernels.gdn.gpu_calls`:
   the sweeps loop over chunks per (row, head, dv tile), the output a parallel kernel), and the
   interpret form elsewhere (CPU), at lowering time, so an AOT compile for a TPU topology on a CPU
   host gets the real kernel.
4. With a multi-device mesh, ``_core`` runs under ``shard_map`` over batch and heads
   (:mod:`pallas_kernels.common.sharding`).

Numerics: inputs may be fp32 or bf16; the state, the accumulation and every elementwise step are
fp32. fp32 inputs run every matmul at HIGHEST precision; bf16 inputs run the chunk matmuls with bf16
operands (fp32 accumulation) and only the triangular inverse in fp32 at HIGHEST.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from . import chunk_math as cm
from . import gpu_calls as phase_gpu
from ..common import sharding
from .kernel_bodies import KernelConfig
from .tpu_calls import intra_call, parallel_backward_call, state_backward_call, sweep_call
from .inputs import check_inputs, reset_flags
from .reference import decay_to_last, masked_exp, segmented_cumsum

f32 = jnp.float32
INTERPRET_FORMS = ("tpu", "gpu")


def prepare(q, k, v, g, beta, initial_state, segment_ids, C: int):
    """-> (q, k [B, Tp, H*K], v [B, Tp, H*V] in their dtypes, aux [B, H, N, AUX, C] fp32, s0 fp32)."""
    B, T, _, K = q.shape
    H, V = v.shape[2:]
    N = -(-T // C)
    pad = N * C - T
    reset_BT = reset_flags(segment_ids, B, T)
    run_BT = jnp.cumsum(reset_BT.astype(jnp.int32), axis=1)
    # Pad tokens (q = k = v = g = beta = 0) continue the last document: exact no-ops on the state.
    reset_BT = jnp.pad(reset_BT, ((0, 0), (0, pad)))
    run_BT = jnp.pad(run_BT, ((0, 0), (0, pad)), mode="edge")

    def pad_t(x):
        return x if pad == 0 else jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))

    def per_chunk(x_BTH):  # [B, T, H] -> fp32 [B, H, N, C]
        return jnp.moveaxis(pad_t(x_BTH.astype(f32)), 2, 1).reshape(B, H, N, C)

    g_BHNC, beta_BHNC = per_chunk(g), per_chunk(beta)
    run_BNC = run_BT.reshape(B, N, C)
    prev_BN = jnp.concatenate([run_BNC[:, :1, 0], run_BNC[:, :-1, -1]], axis=1)
    from_prev_B1NC = (run_BNC == prev_BN[..., None])[:, None]
    to_last_B1NC = (run_BNC == run_BNC[..., -1:])[:, None]
    keep_prev_B1N = (run_BNC[..., -1] == prev_BN)[:, None]
    if segment_ids is None:
        cum_BHNC = jnp.cumsum(g_BHNC, axis=-1)
    else:
        cum_BHNC = segmented_cumsum(g_BHNC, reset_BT.reshape(B, 1, N, C))
    rows = [None] * cm.AUX_WIDTH
    rows[cm.CUM], rows[cm.BETA] = cum_BHNC, beta_BHNC
    rows[cm.EIN] = masked_exp(cum_BHNC, from_prev_B1NC)
    rows[cm.EOUT] = decay_to_last(cum_BHNC, to_last_B1NC)
    rows[cm.SDEC] = jnp.broadcast_to(masked_exp(cum_BHNC[..., -1], keep_prev_B1N)[..., None], (B, H, N, C))
    rows[cm.RUN] = jnp.broadcast_to(lax.stop_gradient(run_BNC.astype(f32))[:, None], (B, H, N, C))
    zeros = jnp.zeros_like(cum_BHNC)
    aux = jnp.stack([r if r is not None else zeros for r in rows], axis=-2)   # [B, H, N, AUX, C]
    s0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)
    flat = lambda x: pad_t(x).reshape(B, N * C, -1)  # noqa: E731  free reshape when T % C == 0
    return flat(q), flat(k), flat(v), aux, s0


# ------------------------------------------------------------------------- platform selection

def _pad_dim(x: jax.Array, axis: int, n: int) -> jax.Array:
    if x.shape[axis] == n:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, widths)


def pad_heads(fn, in_kinds: tuple, out_kinds: tuple, H: int, K: int, V: int, Kp: int, Vp: int,
              HK: int | None = None):
    """Wraps a kernel call ``fn(*arrays) -> tuple`` so it sees key / value head dims zero-padded to
    Kp / Vp (exact: padded key dims add 0 to every dot, padded state rows and value columns stay 0)
    and slices its results back. Kinds per operand / result: "k" and "v" for flat-head token arrays
    [B, T, H*K] / [B, T, H*V], "q" for [B, T, HK*K] (the key heads of grouped queries), "s" for a
    state [B, H, K, V], "st" for per-chunk states [B, H, N*K, V], None for arrays without head dims
    (aux, the per-chunk inverse)."""
    if (Kp, Vp) == (K, V):
        return fn
    heads = {"k": H, "v": H, "q": H if HK is None else HK}

    def pad(x, kind):
        if kind in ("k", "v", "q"):
            d, dp = (V, Vp) if kind == "v" else (K, Kp)
            B, Tp = x.shape[:2]
            return _pad_dim(x.reshape(B, Tp, heads[kind], d), 3, dp).reshape(B, Tp, heads[kind] * dp)
        if kind == "s":
            return _pad_dim(_pad_dim(x, 2, Kp), 3, Vp)
        if kind == "st":
            B = x.shape[0]
            x = x.reshape(B * H, -1, K, V)
            return _pad_dim(_pad_dim(x, 2, Kp), 3, Vp).reshape(B, H, -1, Vp)
        return x

    def unpad(x, kind):
        if kind in ("k", "v", "q"):
            d, dp = (V, Vp) if kind == "v" else (K, Kp)
            B, Tp = x.shape[:2]
            return x.reshape(B, Tp, heads[kind], dp)[..., :d].reshape(B, Tp, heads[kind] * d)
        if kind == "s":
            return x[:, :, :K, :V]
        if kind == "st":
            B = x.shape[0]
            return x.reshape(B, H, -1, Kp, Vp)[..., :K, :V].reshape(B, H, -1, V)
        return x

    def wrapped(*arrays):
        outs = fn(*(pad(x, kd) for x, kd in zip(arrays, in_kinds, strict=True)))
        return tuple(unpad(x, kd) for x, kd in zip(outs, out_kinds, strict=True))
    return wrapped


def _padded_dims(form: str, H: int, K: int, V: int) -> tuple[int, int]:
    """Head dims each native form can tile: TPU lanes need multiples of 128 (unless H = 1, the
    block is then the whole last dim); Triton needs powers of two >= 16."""
    if form == "gpu":
        p2 = lambda n: max(16, 1 << (n - 1).bit_length())  # noqa: E731
        return p2(K), p2(V)
    if form == "tpu" and H > 1:
        r128 = lambda n: -(-n // 128) * 128  # noqa: E731
        return r128(K), r128(V)
    return K, V


def kernel_dims(form: str, interpret: bool, H: int, K: int, V: int) -> tuple[int, int]:
    """Head dims the causal kernels run at: the padded native dims, unpadded in the interpreter."""
    return (K, V) if interpret else _padded_dims(form, H, K, V)


def select_form(make, mode: tuple[str, str], *args):
    """Runs the right form of a kernel. ``make(form, interpret)`` builds a call; ``mode`` is
    (kind, interpret_form). kind "interpret": always the interpreter; "native": Mosaic on TPU,
    Triton on CUDA / ROCm, Mosaic elsewhere (fails on CPU with Pallas' own error); "auto": like
    native, but the interpreter on any other platform. Chosen at lowering time, not from the host."""
    if mode[0] == "interpret":
        return make(mode[1], True)(*args)
    gpu = make("gpu", False)
    return lax.platform_dependent(*args, tpu=make("tpu", False), cuda=gpu, rocm=gpu,
                                  default=make(mode[1], True) if mode[0] == "auto" else make("tpu", False))


# ------------------------------------------------------------------------------ custom VJP core
# The phase split on every platform: TPU (and the "tpu" interpret form) runs the Mosaic kernels of
# gdn.tpu_calls, CUDA / ROCm (and the "gpu" interpret form) the Triton kernels of gdn.gpu_calls;
# both return the same residuals (the per-chunk inverse).

def _to_key_heads(x_BTX, HK: int, K: int):
    """Per-value-head [B, Tp, H*K] -> per-key-head [B, Tp, HK*K]: sums value head h into key head h // rep."""
    B, Tp, HX = x_BTX.shape
    return x_BTX.reshape(B, Tp, HK, HX // (HK * K), K).sum(3).reshape(B, Tp, HK * K)


def _to_value_heads(x_BTX, H: int, K: int):
    """[B, Tp, HK*K] -> [B, Tp, H*K]: key head j repeated to value heads j*rep .. (j+1)*rep - 1."""
    B, Tp, HX = x_BTX.shape
    return jnp.repeat(x_BTX.reshape(B, Tp, HX // K, K), H // (HX // K), axis=2).reshape(B, Tp, H * K)


def on_value_heads(call, H: int, HK: int, grouped_in: tuple[int, ...], grouped_out: tuple[int, ...]):
    """Wraps a GPU-form backward call for a head ratio rep = H / HK that is not a power of two (its
    parallel kernel reads a key head's rep value heads as one rep * dv tile, and Triton tiles are
    powers of two): the operands at ``grouped_in`` ([B, Tp, HK*K]) run repeated to the H value heads,
    the results at ``grouped_out`` come back summed (fp32) to the key heads."""
    rep = H // HK
    if rep & (rep - 1) == 0:
        return call

    def wrapped(*a):
        K = a[grouped_in[0]].shape[-1] // HK
        outs = call(*(_to_value_heads(x, H, K) if i in grouped_in else x for i, x in enumerate(a)))
        return tuple(_to_key_heads(x.astype(f32), HK, K).astype(x.dtype) if i in grouped_out else x
                     for i, x in enumerate(outs))
    return wrapped


def _causal_forward_make(cfg: KernelConfig, H: int, HK: int, K: int, V: int):
    def make(form, interpret):
        def call(q, k, v, aux, s0):
            if form == "gpu":
                return phase_gpu.causal_forward(q, k, v, aux, s0, cfg=cfg, interpret=interpret)
            T, w, u = intra_call(k, v, aux, K=k.shape[-1] // HK, cfg=cfg, interpret=interpret)
            final, o = sweep_call(q, k, w, u, aux, s0, cfg=cfg, interpret=interpret)
            return o, final, T
        Kp, Vp = kernel_dims(form, interpret, H, K, V)
        return pad_heads(call, ("q", "q", "v", None, "s"), ("v", "s", None), H, K, V, Kp, Vp, HK)

    return make


def _causal_backward_make(cfg: KernelConfig, H: int, HK: int, K: int, V: int):
    def make(form, interpret):
        kw = dict(cfg=cfg, interpret=interpret)
        if form == "gpu":
            call = on_value_heads(functools.partial(phase_gpu.causal_backward, **kw), H, HK, (0, 1), (0, 1))
        else:
            def call(q, k, v, aux, s0, T, dO, dfin):
                w, u = intra_call(k, v, aux, K=k.shape[-1] // HK, T_in=T, **kw)   # WY from the saved inverse
                _, states = sweep_call(q, k, w, u, aux, s0, with_o=False, with_states=True, **kw)
                dstates, ds0 = state_backward_call(q, k, w, aux, dO, dfin, **kw)
                dq, dk, dv, daux = parallel_backward_call(q, k, v, aux, T, w, u, states, dstates, dO, **kw)
                return dq, dk, dv, daux, ds0
        Kp, Vp = kernel_dims(form, interpret, H, K, V)
        return pad_heads(call, ("q", "q", "v", None, "s", None, "v", "s"), ("q", "q", "v", None, "s"),
                         H, K, V, Kp, Vp, HK)

    return make


def _core_parts(q, k, v, aux, s0, cfg, mode):
    H, K, V = s0.shape[1:]
    return select_form(_causal_forward_make(cfg, H, q.shape[-1] // K, K, V), mode, q, k, v, aux, s0)


def _core_impl(q, k, v, aux, s0, cfg, mode):
    o, final, _ = _core_parts(q, k, v, aux, s0, cfg, mode)
    return o, final


_core = jax.custom_vjp(_core_impl, nondiff_argnums=(5, 6))


def _core_fwd(q, k, v, aux, s0, cfg, mode):
    o, final, T = _core_parts(q, k, v, aux, s0, cfg, mode)
    # Residuals: the inputs and the per-chunk inverse (C fp32 values per token and head), so the
    # backward never re-inverts; states and the WY form are recomputed (cheap: no inverse).
    return (o, final), (q, k, v, aux, s0, T)


def _core_bwd(cfg, mode, res, cts):
    q, k, v, aux, s0, T = res
    dO, dfin = cts
    H, K, V = s0.shape[1:]
    make = _causal_backward_make(cfg, H, q.shape[-1] // K, K, V)
    dq, dk, dv, daux, ds0 = select_form(make, mode, q, k, v, aux, s0, T, dO.astype(v.dtype), dfin.astype(f32))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), daux, ds0.astype(s0.dtype)


_core.defvjp(_core_fwd, _core_bwd)


# ------------------------------------------------------------------------------------ public op

def chunk_gated_delta_rule_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
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
) -> tuple[jax.Array, jax.Array]:
    """Pallas chunked causal GDN; same math and convention as ``chunk_gated_delta_rule_ref``.

    Args:
        q, k: [B, T, HK, dk] l2-normalised, HK = H or grouped (HK divides H: value head h reads key
            head h // (H / HK), natively on TPU, nothing repeated); v [B, T, H, dv];
            g, beta [B, T, H]; fp32 or bf16 (g, beta are used in fp32).
        initial_state: optional [B, H, dk, dv]; segment_ids: optional int [B, T].
        chunk_size: C (TPU: a multiple of 8; GPU: a power of two >= 16).
        scale: q multiplier, default dk ** -0.5.
        interpret: None = Mosaic on TPU, Triton on CUDA, interpret elsewhere; True = always
            interpret; False = never (fails on CPU).
        interpret_form: which kernel form the interpreter runs, "tpu" (the Mosaic kernels: grid over
            chunks with the state in scratch) or "gpu" (the Triton kernels: sweeps of one program
            per (b, h, dv tile) looping over chunks).
        block_v: the GPU form's dv tile width (see ``KernelConfig``; None: its launch table).
        mesh, batch_axes, head_axes: sharding of the kernel call, see :mod:`pallas_kernels.common.sharding`.

    Returns:
        (o [B, T, H, dv] in v's dtype, final_state [B, H, dk, dv] fp32).
    """
    B, T, H, K, V = check_inputs(q, k, v, g, beta, initial_state, segment_ids)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    if interpret_form not in INTERPRET_FORMS:
        raise ValueError(f"interpret_form must be one of {INTERPRET_FORMS}; got {interpret_form!r}")
    low = None if q.dtype == f32 else jnp.dtype(q.dtype).name
    cfg = KernelConfig(chunk_size=chunk_size, scale=float(K ** -0.5 if scale is None else scale),
                       block_v=block_v, low_dtype=low)
    mode = ({None: "auto", True: "interpret", False: "native"}[interpret], interpret_form)
    qf, kf, vf, aux, s0 = prepare(q, k, v, g, beta, initial_state, segment_ids, chunk_size)

    core = lambda *a: _core(*a, cfg, mode)  # noqa: E731
    mesh = sharding.active_mesh(mesh)
    if mesh is None:
        o_BTX, final = core(qf, kf, vf, aux, s0)
    else:
        # head axes must split the KEY heads evenly: a device's value heads then read its key heads
        b_axes, h_axes = sharding.gdn_mesh_axes(mesh, B, q.shape[2], batch_axes, head_axes)
        tok = P(b_axes, None, h_axes)     # [B, Tp, H*d]: the flat head dim splits into whole heads
        head = P(b_axes, h_axes)          # [B, H, ...]
        o_BTX, final = sharding.run_sharded(core, mesh, (tok, tok, tok, head, head), (tok, head),
                                                qf, kf, vf, aux, s0)
    o_BTHV = o_BTX[:, :T].reshape(B, T, H, V)
    return o_BTHV.astype(v.dtype), final
