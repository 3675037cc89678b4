"""Entry point of the training streams' attention core: a kernel (splash on TPU, our flash kernel
on GPU) or the jnp reference.

Callers (the model's full-attention layer) use :func:`stream_attention` for the clean stream (and the
AR forward without a cache) and for the noisy stream of block mode; which implementation runs is a
backend choice, never a numerics choice (they agree to fp32 round-off). Backends:

- ``splash``: JAX's TPU splash kernel (:mod:`pallas_kernels.attention.splash`);
- ``flash``: our Pallas Triton flash kernel (:mod:`pallas_kernels.attention.flash`);
- ``reference``: dense jnp (:mod:`pallas_kernels.attention.reference`'s core, the kernels' oracle),
  scored chunk by chunk over only the keys each stream's mask can show
  (:mod:`pallas_kernels.attention.spans`): the CPU path;
- ``auto``: flash on GPU, splash on TPU, reference on CPU.

Both kernels run the Pallas interpreter off their platform (CPU tests) and ``shard_map`` over batch
and KV-head groups under a mesh; T stays whole on every device. A row whose T is sharded over the
``context`` mesh axis is the caller's decision (the model's attention layer): it calls
:mod:`pallas_kernels.context.attention` instead (K/V all-gathered over the axis, the same backend per
shard), which builds on this room; this room never imports that one. Every other caller keeps the
dense path whatever the backend:
prefill / decoding against a cache and the decode-side block steps (the model calls the reference
``attend`` directly: a cache-indexed mask, and query blocks of one decode block, too short for a
kernel's tiles to pay).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from .flash import flash_attention
from .reference import clean_stream_mask, two_stream_masks
from .spans import attend_spans, causal_spans, noisy_spans
from .splash import Stream, splash_attention

ATTN_BACKENDS = ("auto", "splash", "flash", "reference")
_AUTO = {"tpu": "splash", "gpu": "flash"}


def resolve_attn_backend(backend: str, platform: str | None = None) -> str:
    """"auto" -> "splash" on TPU, "flash" on GPU, else "reference", by ``platform`` (default: JAX's
    default backend; on a CPU host an AOT compile for a TPU topology therefore asks for "splash"
    explicitly)."""
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {ATTN_BACKENDS}")
    if backend == "auto":
        return _AUTO.get(platform or jax.default_backend(), "reference")
    return backend


def stream_attention(
    q_BTHD: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    segment_ids_BT: jax.Array,
    *,
    stream: Stream,
    block_size: int = 1,
    backend: str = "auto",
    mask_BTS: jax.Array | None = None,
    interpret: bool | None = None,
    mesh=None,
    batch_axes: Sequence[str] | None = None,
    head_axes: Sequence[str] | None = None,
) -> jax.Array:
    """Attention of one training stream (see ``splash_attention`` for shapes and the mask rules;
    ``flash_attention`` has the same contract).

    ``mask_BTS``: the reference's precomputed boolean mask (the model builds it once per forward, not
    once per layer); None = built here from the segment ids. Ignored by the kernel, which needs only
    the segment ids. T whole on every device (a context-sharded row: ``context.attention``).
    Returns [B, T, H, D]."""
    backend = resolve_attn_backend(backend)
    if backend == "splash":
        return splash_attention(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, stream=stream, block_size=block_size,
                                interpret=interpret, mesh=mesh, batch_axes=batch_axes, head_axes=head_axes)
    if backend == "flash":
        return flash_attention(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, stream=stream, block_size=block_size,
                               interpret=interpret, mesh=mesh, batch_axes=batch_axes, head_axes=head_axes)
    # the reference: the stream's mask, scored only over the keys its rows can see (attention.spans)
    t = q_BTHD.shape[1]
    if stream == "clean":
        if mask_BTS is None:
            mask_BTS = clean_stream_mask(segment_ids_BT)
        return attend_spans(q_BTHD, k_BSKD, v_BSKD, mask_BTS, causal_spans(t))
    if mask_BTS is None:
        mask_BTS = two_stream_masks(segment_ids_BT, block_size)[1]
    return attend_spans(q_BTHD, k_BSKD, v_BSKD, mask_BTS, noisy_spans(t, block_size))
