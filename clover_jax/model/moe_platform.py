"""Which grouped-matmul path the routed experts take on each platform.

Paths (`moe.grouped_ffn`): `ragged` (`jax.lax.ragged_dot` + the megablox `tgmm` weight gradient),
`blocked` (batched dots over expert-aligned row blocks), `dense` (the reference). `auto` picks:

* TPU: `ragged`. XLA:TPU runs `ragged_dot` as a grouped kernel and the weight gradient is the
  megablox `tgmm` Pallas kernel.
* GPU: `blocked`. JAX lowers `ragged_dot` to `chlo.ragged_dot`, which XLA:GPU expands into a dense
  dot over every group (XLA's ragged-dot rewriter) unless an experimental Triton lowering is
  enabled, and the weight gradient off TPU is JAX's transpose of `ragged_dot`, a masked dense
  product: either one multiplies every row by all E local experts (E/k times the FLOPs). The
  blocked path pads each expert's rows to whole row blocks and runs one batched matmul, so no
  product spans more than about M + E*block rows (tests/model/test_moe_platform.py checks it on
  the HLO lowered for `cuda`, forward and backward).
* CPU: `blocked`, for the same reason (XLA:CPU also expands `ragged_dot` densely).
"""

from __future__ import annotations

import jax

IMPLS = ("ragged", "blocked", "dense")
def resolve_impl(impl: str, platform: str | None = None) -> str:
    """`auto` -> `ragged` on TPU, `blocked` on GPU and CPU (`platform` default: JAX's backend; a
    device's `platform` string: "tpu", "gpu", "cuda", "rocm", "cpu"). Others pass through."""
    if impl == "auto":
        return "ragged" if (platform or jax.default_backend()) == "tpu" else "blocked"
    if impl not in IMPLS:
        raise ValueError(f"unknown moe_impl {impl!r}; expected auto or one of {sorted(IMPLS)}")
    return impl
