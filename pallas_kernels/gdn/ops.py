"""Entry points for the GDN ops: each picks the Pallas kernel or the jnp reference.

Callers (the model's GDN layer) use only :func:`chunk_gated_delta_rule` (causal, the clean stream /
AR mode) and :func:`block_gated_delta_rule` (both streams of block mode); which implementation runs
is a backend choice, never a numerics choice (they agree to fp32 round-off).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from .block_op import block_gated_delta_rule_pallas
from .block_reference import block_gated_delta_rule_ref
from .causal_op import chunk_gated_delta_rule_pallas
from .reference import chunk_gated_delta_rule_ref

BACKENDS = ("auto", "pallas", "reference")


#: fp32 q / k / v on a GPU above this head dim (dk or dv) run on the XLA path: on an H200 (227 KiB of
#: shared memory per block) the fp32 phase kernels at dk = dv = 128 ask 384 KiB (causal) / 236 KiB
#: (block mode) and fail to compile, while bf16 q / k / v (the training path) fit
#: (bench/results/gdn_device_h200_fp32check.json vs gdn_device_h200.json, issue 17). fp32 at 64 was
#: not measured: its tiles are a quarter of those at 128, so it is left on the kernels. Since then the
#: parallel backward takes fp32 in value tiles (gpu_calls.FP32_BACKWARD_BLOCK_V); the fallback stays until a
#: device says every fp32 program fits (bench/gdn_device.py --fp32-fit, the stage c.gdn_fp32_fit of bench/gpu_check.py).
GPU_FP32_MAX_HEAD_DIM = 64


def auto_backend(platform: str, dtype, dk: int, dv: int) -> str:
    """What ``backend="auto"`` runs: "pallas" where the platform has a Pallas compiler (TPU: Mosaic;
    GPU: Triton) and the kernels fit it, else "reference". fp32 q / k / v on a GPU with a head dim
    above GPU_FP32_MAX_HEAD_DIM run the reference (XLA), which compiles; an explicit "pallas" does not
    fall back."""
    if platform not in ("tpu", "gpu"):
        return "reference"
    if platform == "gpu" and jax.numpy.dtype(dtype).itemsize >= 4 and max(dk, dv) > GPU_FP32_MAX_HEAD_DIM:
        return "reference"
    return "pallas"


def _auto_backend(q: jax.Array, v: jax.Array) -> str:
    return auto_backend(jax.default_backend(), jax.numpy.result_type(q, v), q.shape[-1], v.shape[-1])


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    chunk_size: int = 64,
    backend: str = "auto",
    interpret: bool | None = None,
    mesh=None,
    batch_axes: Sequence[str] | None = None,
    head_axes: Sequence[str] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Chunked causal gated delta rule (argument convention of transformers' ``torch_chunk_gated_delta_rule``).

    Args:
        q: [B, T, HK, dk] queries, already l2-normalised (the dk^-0.5 scale is applied inside);
            HK = H, or grouped: HK divides H and value head h reads key head h // (H / HK) (the TPU
            kernels index it natively, the reference and the Triton form repeat it).
        k: [B, T, HK, dk] keys, same convention as q.
        v: [B, T, H, dv] values.
        g: [B, T, H] log-decay (<= 0).
        beta: [B, T, H] write strength in (0, 1).
        initial_state: optional [B, H, dk, dv] state carried in (belongs to token 0's segment).
        segment_ids: optional int [B, T]; the state resets wherever the id changes from the previous token.
        chunk_size: chunk length of the WY/UT form (any value gives the same result; the Pallas
            kernel needs a multiple of 8 on TPU and a power of two >= 16 on GPU).
        backend: "auto" = the Pallas kernel when the default JAX backend is TPU or GPU (see
            :func:`auto_backend` for fp32 on a GPU; the phase
            split of fla's chunk_gated_delta_rule on both: TPU the Mosaic kernels of
            ``gdn.tpu_calls``, CUDA the Triton kernels of ``gdn.gpu_calls``), else the jnp reference
            (so on a CPU host, AOT-compiling for a TPU topology needs "pallas");
            "pallas" = the kernel (Mosaic on TPU, Triton on GPU, chosen at lowering time; the
            interpreter on CPU); "reference" = ``chunk_gated_delta_rule_ref``.
        interpret: Pallas interpret mode; None means interpret on CPU. Ignored by the reference.
        mesh, batch_axes, head_axes: the Pallas kernel runs under ``shard_map`` over batch and heads
            when a multi-device mesh is given or set with ``jax.set_mesh`` (see
            :mod:`pallas_kernels.common.sharding`: default axes batch -> data, fsdp, expert and
            heads -> tensor). Ignored by the reference (plain jnp, partitioned by XLA).

    Returns:
        (o [B, T, H, dv] in v's dtype, final_state [B, H, dk, dv] fp32).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown GDN backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        backend = _auto_backend(q, v)
    if backend == "pallas":
        return chunk_gated_delta_rule_pallas(
            q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
            chunk_size=chunk_size, interpret=interpret, mesh=mesh, batch_axes=batch_axes,
            head_axes=head_axes)
    return chunk_gated_delta_rule_ref(
        q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size)


def block_gated_delta_rule(
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
    backend: str = "auto",
    interpret: bool | None = None,
    mesh=None,
    batch_axes: Sequence[str] | None = None,
    head_axes: Sequence[str] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Both streams of a block-mode GDN layer (docs/design.md 3.2 B): see ``block_gated_delta_rule_ref``
    for the math and ``chunk_gated_delta_rule`` for backend / interpret / mesh (q, k and the noisy qn,
    kn may be grouped key heads, as there). The Pallas path is the causal phase split with the block
    readouts (``gdn.block_op``: inside the sweep on TPU, in the parallel output kernel on CUDA);
    ``block_size`` and ``chunk_size`` must divide one another.

    Returns (o_clean [B, T, H, dv], o_noisy [B, T, H, dv], final clean state [B, H, dk, dv] fp32).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown GDN backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        backend = _auto_backend(q, v)
    if backend == "pallas":
        return block_gated_delta_rule_pallas(
            q, k, v, g, beta, q_noisy, k_noisy, v_noisy, scalars_H3, block_size=block_size,
            initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size, interpret=interpret,
            mesh=mesh, batch_axes=batch_axes, head_axes=head_axes)
    return block_gated_delta_rule_ref(
        q, k, v, g, beta, q_noisy, k_noisy, v_noisy, scalars_H3, block_size=block_size,
        initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size)
