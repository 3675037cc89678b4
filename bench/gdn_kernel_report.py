"""Structure of the GDN's phase-split kernels (issue 17) in both forms, TPU (Mosaic,
``gdn.tpu_calls``) and GPU (Triton, ``gdn.gpu_calls``), read from the kernels themselves: no timing,
runs on CPU. (The one-step-per-chunk kernels this replaced, with the inverse inside every sequential
step, are gone; their rows are in the git history of bench/results/gdn_kernel_report.json.)

For every ``pallas_call`` of a causal fwd + bwd (the kernel jaxprs Pallas hands to Mosaic / Triton,
traced at the 35B GDN layer's tile shapes: C = 64, dk = dv = 128, bf16 q/k/v, 32 value / 16 key heads;
the GPU sweeps at the launch table's dv tile):
- steps per (row, value head) and whether the kernel is sequential over chunks (TPU: grid steps; GPU
  sweeps: chunk-loop trips times dv tiles, the tiles concurrent programs);
- per step: number of matmuls, the longest chain of DEPENDENT matmuls (the latency a step cannot
  hide; on a sequential kernel every step is on the recurrence's critical path), and the matmul
  shapes (M x K x N) with their fill of a 128 x 128 tile, (K / ceil128(K)) * (N / ceil128(N));
- residual bytes per layer per row at 8K and 128K tokens: what the forward keeps for the backward
  (custom_vjp residuals), the backward's transient per-chunk states and their cotangents, and the GPU
  forward's transient states (its output phase reads them);
- block mode at Clover's block 32 (both streams, fwd + bwd) with chunks of 64, two block-start
  readouts per chunk (TPU: inside the sweep; GPU: in the parallel output kernel). Sequential matmuls
  are also given per 64 tokens on one program's critical path;
- the intra kernel's triangular inverse (I + A)^-1 of one C x C chunk matrix by each method of
  ``chunk_math.INVERSES`` (the TPU form runs "doubling", the GPU form "blocked"): its matmuls and their
  MACs, the dependent matmuls and the MACs along that chain, and the dependent cross-row reductions
  (the blocked method's substitution steps on its 16 x 16 diagonal tiles).

    python bench/gdn_kernel_report.py [--out bench/results/gdn_kernel_report.json]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.gdn import tpu_calls
from pallas_kernels.gdn import gpu_calls
from pallas_kernels.gdn import chunk_math as cm
from pallas_kernels.gdn.chunk_math import AUX_WIDTH
from pallas_kernels.gdn.kernel_bodies import FORM_INVERSE, BlockPlan, KernelConfig

SEQUENTIAL = {"gdn_sweep", "gdn_state_bwd", "gdn_block_sweep", "gdn_block_state_bwd",
              "gdn_gpu_sweep", "gdn_gpu_state_bwd", "gdn_gpu_block_state_bwd"}
#: GPU sweeps: one program per (row, head, dv tile) loops over the chunks (its jaxpr holds one trip)
GPU_LOOPS = {"gdn_gpu_sweep", "gdn_gpu_state_bwd", "gdn_gpu_block_state_bwd"}
BLOCK = 32
MXU = 128


def _subs(eqn):
    for p in eqn.params.values():
        for s in p if isinstance(p, (tuple, list)) else (p,):
            if hasattr(s, "eqns"):
                yield s
            elif hasattr(getattr(s, "jaxpr", None), "eqns"):
                yield s.jaxpr


def _dot_shape(eqn) -> tuple[int, int, int]:
    (lc, rc), _ = eqn.params["dimension_numbers"]
    a, b = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    kk = math.prod(a[i] for i in lc)
    return math.prod(a) // kk, kk, math.prod(b) // math.prod(b[i] for i in rc)


def count_dots(eqn) -> int:
    return int(eqn.primitive.name == "dot_general")


def dot_macs(eqn) -> int:
    return math.prod(_dot_shape(eqn)) if eqn.primitive.name == "dot_general" else 0


def count_reductions(eqn) -> int:
    return int(eqn.primitive.name == "reduce_sum")


def dot_chain(jaxpr, in_depth=None, weight=count_dots) -> tuple[int, list[tuple]]:
    """(longest chain of dependent dots, every dot's (M, K, N)) of a jaxpr. A value's depth is the
    most dots on any dataflow path from the inputs to it (with ``weight``: the most of weight(eqn)
    summed along a path, e.g. the MACs of its dots); sub-jaxprs (pjit, cond branches, custom_jvp) are
    entered with their operands' depths. Kernels return nothing (their results are ref stores), so
    the chain is the deepest value anywhere in the body."""
    depth = dict(zip(jaxpr.invars, in_depth or [0] * len(jaxpr.invars)))
    get = lambda v: 0 if hasattr(v, "val") else depth.get(v, 0)  # noqa: E731  literals: 0
    dots, best = [], 0
    for eqn in jaxpr.eqns:
        ins = [get(v) for v in eqn.invars]
        base = max(ins, default=0)
        out = base + weight(eqn)
        if eqn.primitive.name == "dot_general":
            dots.append(_dot_shape(eqn))
        for sub in _subs(eqn):
            n_in = len(sub.invars)
            d, sub_dots = dot_chain(sub, ins[-n_in:] if n_in <= len(ins) else [base] * n_in, weight)
            dots += sub_dots
            out = max(out, d)
        for v in eqn.outvars:
            depth[v] = out
        best = max(best, out)
    return best, dots


def fill(shape) -> float:
    _, kk, n = shape
    return (kk / (MXU * math.ceil(kk / MXU))) * (n / (MXU * math.ceil(n / MXU)))


def pallas_calls(fn, *args) -> list:
    out = []

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "pallas_call":
                out.append(e)
                continue
            for s in _subs(e):
                walk(s)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


def kernel_rows(fn, *args, per_row_heads: int, rep: int = 1, trips: int = 1, tiles: int = 1) -> list[dict]:
    """``trips``: chunk-loop trips of a GPU sweep program (N); ``tiles``: its concurrent dv tiles."""
    rows = []
    for e in pallas_calls(fn, *args):
        name = str(e.params["name"])
        grid = tuple(e.params["grid_mapping"].grid)
        chain, dots = dot_chain(e.params["jaxpr"])
        shapes = sorted({d for d in dots})
        steps = math.prod(grid) * (trips if name in GPU_LOOPS else 1)
        rows.append(dict(
            kernel=name, sequential=name in SEQUENTIAL, concurrent_tiles=tiles if name in GPU_LOOPS else 1,
            # the parallel backward's grid runs over key heads, rep value heads per step
            steps_per_row_head=steps * (rep if name.endswith("parallel_bwd") else 1) // per_row_heads,
            matmuls_per_step=len(dots), dependent_matmuls_per_step=chain,
            matmul_shapes=[f"{m}x{k}x{n}" for m, k, n in shapes],
            mxu_fill_mean=round(sum(fill(d) for d in dots) / max(len(dots), 1), 3),
            flops=int(e.params["cost_estimate"].flops) if e.params.get("cost_estimate") else None))
    return rows


def shapes(B: int, T: int, H: int, HK: int, K: int, V: int, C: int, bf=jnp.bfloat16):
    sd = jax.ShapeDtypeStruct
    N = T // C
    return dict(q=sd((B, T, HK * K), bf), k=sd((B, T, HK * K), bf), v=sd((B, T, H * V), bf),
                aux=sd((B, H, N, AUX_WIDTH, C), jnp.float32), s0=sd((B, H, K, V), jnp.float32),
                states=sd((B, H, N * K, V), jnp.float32), T=sd((B, H, N, C, C), jnp.float32),
                dO=sd((B, T, H * V), bf))


def gpu_tile(K: int, V: int, C: int) -> int:
    return gpu_calls.tile_width(KernelConfig(chunk_size=C), K, V)


def _label(rows, suffixes):
    for i, suffix in suffixes.items():
        rows[i]["kernel"] += suffix
    return rows


def causal(form: str, B, T, H, HK, K, V, C):
    """The causal fwd + bwd of one form, as gdn.causal_op composes it."""
    x = shapes(B, T, H, HK, K, V, C)
    cfg = KernelConfig(chunk_size=C, scale=K ** -0.5, low_dtype="bfloat16")
    kw = dict(cfg=cfg, interpret=False)

    def tpu(q, k, v, aux, s0, dO):
        Tinv, w, u = tpu_calls.intra_call(k, v, aux, K=K, **kw)
        final, o = tpu_calls.sweep_call(q, k, w, u, aux, s0, **kw)
        w2, u2 = tpu_calls.intra_call(k, v, aux, K=K, T_in=Tinv, **kw)
        _, st = tpu_calls.sweep_call(q, k, w2, u2, aux, s0, with_o=False, with_states=True, **kw)
        dst, ds0 = tpu_calls.state_backward_call(q, k, w2, aux, dO, final, **kw)
        return o, tpu_calls.parallel_backward_call(q, k, v, aux, Tinv, w2, u2, st, dst, dO, **kw)

    def gpu(q, k, v, aux, s0, dO):
        o, final, Tinv = gpu_calls.causal_forward(q, k, v, aux, s0, **kw)
        return o, gpu_calls.causal_backward(q, k, v, aux, s0, Tinv, dO, final, **kw)
    rows = kernel_rows(tpu if form == "tpu" else gpu, x["q"], x["k"], x["v"], x["aux"], x["s0"], x["dO"],
                       per_row_heads=B * H, rep=H // HK, trips=T // C, tiles=V // gpu_tile(K, V, C))
    return _label(rows, {2: " (WY recompute)", 3: " (state recompute)"} if form == "tpu"
                  else {3: " (WY recompute)", 4: " (state recompute)"})


def _noisy(x, B, T, H, HK, K, V, R):
    sd = jax.ShapeDtypeStruct
    return dict(qn=sd((B, T, HK * K), jnp.bfloat16), auxn=sd((B, H, T // R, AUX_WIDTH, R), jnp.float32),
                ph=sd((B, H, T // R, 1, R), jnp.float32), vn=x["v"], dOn=x["dO"])


def block(form: str, B, T, H, HK, K, V, C):
    """Block mode's fwd + bwd of one form at block 32 on chunks of C."""
    x = shapes(B, T, H, HK, K, V, C)
    n = _noisy(x, B, T, H, HK, K, V, C)
    cfg = KernelConfig(chunk_size=C, scale=K ** -0.5, low_dtype="bfloat16")
    kw = dict(cfg=cfg, interpret=False)
    plan = BlockPlan(BLOCK, C)

    def tpu(q, k, v, aux, s0, dO, qn, auxn, ph):
        Tinv, w, u = tpu_calls.intra_call(k, v, aux, K=K, **kw)
        final, o, r = tpu_calls.sweep_call(q, k, w, u, aux, s0, noisy=(qn, auxn, plan), **kw)
        on, _ = tpu_calls.noisy_forward_call(qn, qn, v, auxn, r, K=K, **kw)
        w2, u2 = tpu_calls.intra_call(k, v, aux, K=K, T_in=Tinv, **kw)
        _, st = tpu_calls.sweep_call(q, k, w2, u2, aux, s0, with_o=False, with_states=True, **kw)
        dst, ds0 = tpu_calls.state_backward_call(q, k, w2, aux, dO, final, noisy=(qn, auxn, ph, dO, plan), **kw)
        return o, on, tpu_calls.parallel_backward_call(q, k, v, aux, Tinv, w2, u2, st, dst, dO,
                                                       noisy=(qn, qn, v, auxn, dO, plan), **kw)

    def gpu(q, k, v, aux, s0, dO, qn, auxn, ph):
        o, on, final, Tinv, ph = gpu_calls.block_forward(q, k, v, aux, s0, qn, qn, v, auxn, plan, **kw)
        return o, on, gpu_calls.block_backward(q, k, v, aux, s0, qn, qn, v, auxn, plan, Tinv, ph, dO, dO, final, **kw)
    rows = kernel_rows(tpu if form == "tpu" else gpu, x["q"], x["k"], x["v"], x["aux"], x["s0"], x["dO"], n["qn"],
                       n["auxn"], n["ph"], per_row_heads=B * H, rep=H // HK, trips=T // C, tiles=V // gpu_tile(K, V, C))
    return _label(rows, {3: " (WY recompute)", 4: " (state recompute)"} if form == "tpu"
                  else {4: " (WY recompute)", 5: " (state recompute)"})


def inverse_rows(C: int) -> dict[str, dict]:
    """The triangular inverse of one C x C chunk matrix by each method (the jaxpr of
    ``chunk_math.invert`` at fp32, as the intra kernel runs it)."""
    rows = {}
    for method in cm.INVERSES:
        j = jax.make_jaxpr(lambda a, m=method: cm.invert(a, cm.MatmulPolicy(None), m))(
            jax.ShapeDtypeStruct((C, C), jnp.float32)).jaxpr
        chain, dots = dot_chain(j)
        rows[method] = dict(
            forms=sorted(f for f, m in FORM_INVERSE.items() if m == method), matmuls=len(dots),
            matmul_shapes=[f"{m}x{k}x{n}" for m, k, n in sorted(set(dots))],
            macs=sum(math.prod(d) for d in dots), dependent_matmuls=chain,
            dependent_macs=dot_chain(j, weight=dot_macs)[0],
            dependent_reductions=dot_chain(j, weight=count_reductions)[0])
    return rows


def residual_bytes(T: int, H: int, HK: int, K: int, V: int, C: int) -> dict:
    """Per layer, per row: the custom_vjp residuals (both forms: the inputs and the per-chunk
    inverse), the backward's transient per-chunk states and their cotangents (the parallel backward
    reads both), and the GPU forward's transient per-chunk states (its output phase reads them)."""
    N = -(-T // C)
    tok = lambda heads, d, b: T * heads * d * b  # noqa: E731
    common = tok(H, V, 2) + H * N * AUX_WIDTH * C * 4 + H * K * V * 4          # v, aux, s0
    states = H * N * K * V * 4
    return dict(residuals=common + 2 * tok(HK, K, 2) + H * N * C * C * 4, backward_states=2 * states,
                gpu_forward_states=states)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/gdn_kernel_report.json")
    p.add_argument("--T", type=int, default=8192, help="tokens of the traced kernels (structure does not depend on it)")
    a = p.parse_args(argv)
    H, HK, K, V, C = 32, 16, 128, 128, 64
    sides = dict(tpu=causal("tpu", 1, a.T, H, HK, K, V, C), gpu=causal("gpu", 1, a.T, H, HK, K, V, C),
                 block_tpu=block("tpu", 1, a.T, H, HK, K, V, C), block_gpu=block("gpu", 1, a.T, H, HK, K, V, C))
    report = dict(shapes=dict(T=a.T, H=H, HK=HK, dk=K, dv=V, C=C, dtype="bfloat16", block=BLOCK,
                              gpu_dv_tile=gpu_tile(K, V, C)),
                  **sides, residual_bytes={f"{t // 1024}K": residual_bytes(t, H, HK, K, V, C) for t in (8192, 131072)},
                  inverse=inverse_rows(C))
    for side in sides:
        print(f"\n{side}: kernel | seq | steps/(row,head) | matmuls/step | dependent | mean 128x128 fill | shapes")
        for r in report[side]:
            print(f"  {r['kernel']:<36} {'seq' if r['sequential'] else 'par':<4} {r['steps_per_row_head']:>6} "
                  f"{r['matmuls_per_step']:>4} {r['dependent_matmuls_per_step']:>4} {r['mxu_fill_mean']:>6}  "
                  f"{' '.join(r['matmul_shapes'])}")
        seq = [r for r in report[side] if r["sequential"]]
        # on one program's critical path: a GPU sweep's dv tiles run concurrently
        per64 = lambda key: sum(r[key] * r["steps_per_row_head"] // r["concurrent_tiles"]  # noqa: E731
                                for r in seq) * 64 // a.T
        report[f"{side}_sequential_per_64_tokens"] = dict(matmuls=per64("matmuls_per_step"),
                                                         dependent=per64("dependent_matmuls_per_step"))
        print(f"  sequential matmuls per chunk (fwd + bwd): {sum(r['matmuls_per_step'] for r in seq)}, "
              f"dependent: {sum(r['dependent_matmuls_per_step'] for r in seq)}; per 64 tokens: "
              f"{per64('matmuls_per_step')}, dependent: {per64('dependent_matmuls_per_step')}")
    print("\nbytes per layer per row: custom_vjp residuals | backward's transient chunk states and cotangents"
          " | GPU forward's transient chunk states:")
    for t, r in report["residual_bytes"].items():
        print(f"  {t}: {r['residuals'] / 2**20:,.0f} MiB | {r['backward_states'] / 2**20:,.0f} MiB"
              f" | {r['gpu_forward_states'] / 2**20:,.0f} MiB")
    print(f"\ntriangular inverse of one {C} x {C} chunk matrix (fp32): method (forms) | matmuls | MACs | "
          "dependent matmuls | MACs on that chain | dependent reductions | shapes")
    for m, r in report["inverse"].items():
        print(f"  {m:<9} ({'/'.join(r['forms']) or '-'}) {r['matmuls']:>4} {r['macs']:>10,} "
              f"{r['dependent_matmuls']:>4} {r['dependent_macs']:>10,} {r['dependent_reductions']:>4}  "
              f"{' '.join(r['matmul_shapes'])}")
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(main() and 0)
