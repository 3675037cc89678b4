"""Kernels for Clover-JAX (Pallas) and their plain-jnp references.

This package imports nothing from ``clover_jax``, ``train`` or ``sft`` (docs/architecture.md, the import rule).
"""

from .gdn.ops import BACKENDS, block_gated_delta_rule, chunk_gated_delta_rule
from .gdn.block_op import block_gated_delta_rule_pallas
from .gdn.causal_op import chunk_gated_delta_rule_pallas
from .gdn.reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref

__all__ = [
    "BACKENDS",
    "block_gated_delta_rule",
    "block_gated_delta_rule_pallas",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_pallas",
    "chunk_gated_delta_rule_ref",
    "recurrent_gated_delta_rule_ref",
]

from .gdn.block_reference import block_gated_delta_rule_ref, block_readout_ref  # noqa: E402

__all__ += ["block_gated_delta_rule_ref", "block_readout_ref"]

from .attention.ops import ATTN_BACKENDS, resolve_attn_backend, stream_attention  # noqa: E402
from .attention.flash import flash_attention  # noqa: E402
from .attention.splash import splash_attention  # noqa: E402

__all__ += ["ATTN_BACKENDS", "flash_attention", "resolve_attn_backend", "splash_attention", "stream_attention"]
