"""Which grouped-matmul path, and which kernel tiling, the routed experts take on each platform.

Paths (`moe.grouped_ffn`): `ragged` (`jax.lax.ragged_dot` + the megablox `tgmm` weight gradient),
`blocked` (a loop of dots over expert-aligned row blocks), `capacity` (one batched dot over a fixed
per-expert capacity, the overflow by a loop of row blocks), `dense` (the reference). `auto` picks:

* TPU: `ragged`. XLA:TPU runs `ragged_dot` as a grouped kernel and the weight gradient is the
  megablox `tgmm` Pallas kernel, tiled by :func:`tgmm_tiling`.
* GPU: `blocked`. JAX lowers `ragged_dot` to `chlo.ragged_dot`, which XLA:GPU expands into a dense
  dot over every group (XLA's ragged-dot rewriter) unless an experimental Triton lowering is
  enabled, and the weight gradient off TPU is JAX's transpose of `ragged_dot`, a masked dense
  product: either one multiplies every row by all E local experts (E/k times the FLOPs). The
  blocked path pads each expert's rows to whole row blocks and runs one batched matmul, so no
  product spans more than about M + E*block rows (tests/model/test_moe_platform.py checks it on
  the HLO lowered for `cuda`, forward and backward).
* CPU: `capacity`. XLA:CPU also expands `ragged_dot` densely, and it runs a loop of per-block dots
  at about half the speed of one batched dot over [E, C, D] (issue 19: the routed experts' fwd+bwd
  1.5x faster than `blocked` at small-cpu, `bench/forward.py --breakdown`). Not measured on a GPU,
  so GPU keeps `blocked`.
"""

from __future__ import annotations

import jax

IMPLS = ("ragged", "blocked", "capacity", "dense")
#: megablox tile edges tried, largest first (multiples of the 128-lane MXU width)
TILES = (512, 256, 128)


def resolve_impl(impl: str, platform: str | None = None, rows: int | None = None, experts: int | None = None
                 ) -> str:
    """`auto` -> `ragged` on TPU, `blocked` on GPU, `capacity` on CPU (`platform` default: JAX's
    backend; a device's `platform` string: "tpu", "gpu", "cuda", "rocm", "cpu"), except on CPU when
    fewer `rows` (token-expert assignments) than `experts` are known to come: the capacity path reads
    every expert's weights, the blocked loop only the used ones (decoding one token of a 256-expert
    model: 80 vs 102 ms at D 256, I 512; from one row per expert on, capacity is faster). Other
    names pass through."""
    if impl == "auto":
        platform = platform or jax.default_backend()
        if platform == "cpu":
            few = rows is not None and experts is not None and rows < experts
            return "blocked" if few else "capacity"
        return "ragged" if platform == "tpu" else "blocked"
    if impl not in IMPLS:
        raise ValueError(f"unknown moe_impl {impl!r}; expected auto or one of {sorted(IMPLS)}")
    return impl


def _edge(dim: int, min_tiles: int = 1) -> int:
    """Largest tile of `TILES` dividing `dim` into at least `min_tiles` tiles; else the largest
    dividing one; else the whole dim (a block equal to the array dim is always legal)."""
    fits = [t for t in TILES if dim % t == 0]
    return next((t for t in fits if dim // t >= min_tiles), fits[0] if fits else dim)


def tgmm_tiling(m: int, k: int, n: int, cores: int = 2) -> tuple[int, int, int]:
    """(tm, tk, tn) for megablox `tgmm` of lhs [m, k] and rhs [m, n] -> [G, k, n].

    The kernel's grid is (n tiles, k tiles, row tiles) and only the n axis is "parallel", which is
    the axis a megacore chip (v4, v5p: 2 TensorCores) splits over its cores. So tn is the largest
    tile that still gives at least `cores` n tiles: n = 512 (the gate / up projections of the 35B)
    gets 256, not one 512 tile that leaves a core idle; n = 1024 (gate and up fused) keeps 512.
    tm: 512 rows, or the next power of two (>= 8) for fewer rows; the caller pads m to it."""
    tm = 512 if m >= 512 else max(8, 1 << (m - 1).bit_length())
    return tm, _edge(k), _edge(n, cores)
