"""Collective bytes that context parallelism adds to attention: read from the compiled HLO
(`train.hlo_cost`) and compared with an analytic count (the all-gathered K/V). A TPU AOT PREDICTION:
each program is compiled for a v5p slice through libtpu on this CPU host; nothing runs.

Program: one full-attention layer's attention core at the agent_mix shapes (16 query heads over 2 KV
heads, head dim 256, bf16, block 32), both training streams (clean: causal in-document; noisy: the
block rule over the gathered clean keys and the shard's own noisy keys), forward + backward, one row
of T tokens split over `context` = n chips (a mesh of that one axis), the splash kernel per shard
(`pallas_kernels.context.attention_kernels`), both streams over one exchange, as the model runs them
(`context_two_stream_attention`). Without the axis this program has no collective at all
(the row stays on one chip), so every collective byte in it is added by context parallelism.

Analytic count per chip and layer (as `train.hlo_cost` counts: a gather's result, a scatter's
operand), Tp = a shard's length padded to 128 lanes: the forward all-gathers the clean K and V
(2 x n Tp x K x D x 2 bytes) and the segment ids (n Tp x 4 bytes) once for both streams; the backward
reduce-scatters dK and dV (the gather's transpose, 2 x n Tp x K x D x 2 bytes), the two streams'
cotangents summed on the chip first. The noisy K/V never travel. XLA:TPU may write a reduce-scatter as
an all-reduce of the same operand (twice the ring traffic): the table shows what the program holds.

Both layouts (`--layouts`): under zig-zag each shard holds row pieces i and 2n - 1 - i and splash
runs the shard's own block tables (`pallas_kernels.context.splash_rows`); the K/V exchange is the
same all-gather (the pieces put in row order on the chip), so the analytic bytes are the same; the
splash FLOPs per chip (what the shard's kernels run) fall to about the causal share.

Per step (agent_mix at 32K on the planned context mesh, an extrapolation, labelled so): the layer's
bytes x full-attention layers x rows a context group processes per step (batch x copies / groups) x
(forward gathers twice: `remat: full` recomputes each layer's forward in the backward).

    python bench/context.py                      # T = 32768, context 2, 4, 8, both layouts
    python bench/context.py --seq 4096 --contexts 2

Results also go to bench/results/context.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from pallas_kernels.context.attention_kernels import sharded_stream_attention  # noqa: E402
from clover_jax.model.splash_cost import kernel_cost  # noqa: E402
from pallas_kernels.attention.splash import LANES  # noqa: E402
from train import hlo_cost  # noqa: E402

H, K, D, BLOCK = 16, 2, 256, 32
#: agent_mix at 32K on the planned mesh (issue 18: v5p-128 = 64 chips, fsdp 8 x context 8): 64 rows
#: per step, 2 copies (complementary noise), 10 full-attention layers of 40 (every 4th)
STEP = {"rows": 64, "copies": 2, "chips": 64, "full_attention_layers": 10}
GiB = 1024**3


def layer_loss(seg, layout: str = "contiguous"):
    """Sum of both streams' outputs (fp32): a scalar to differentiate w.r.t. q, k, v of both streams.
    The clean and the noisy K/V come in apart, each [B, T] over `context` (as a layer whose streams
    are laid out per shard sees them: `sharded_stream_attention`): slicing one [B, 2T] array sharded
    over `context` into its halves would move each half across the chips (collective-permutes, and
    an all-reduce for the backward's reduce-scatter), a cost of that layout, not of the attention."""
    def f(q_clean, q_noisy, k_clean, k_noisy, v_clean, v_noisy):
        out_c, out_n = sharded_stream_attention(q_clean, q_noisy, k_clean, v_clean, seg, backend="splash",
                                                block_size=BLOCK, noisy_kv=(k_noisy, v_noisy), layout=layout)
        return jnp.sum(out_c.astype(jnp.float32)) + jnp.sum(out_n.astype(jnp.float32))
    return f


def analytic(t: int, n: int, rows: int = 1) -> dict[str, float]:
    """Per chip and layer, both streams over one exchange (module docstring): bytes by collective kind."""
    tp = -(-(t // n) // LANES) * LANES
    kv = 2 * rows * n * tp * K * D * 2  # K and V, bf16, gathered
    return {"all-gather": kv + rows * n * tp * 4, "reduce-scatter": kv}


def compile_one(t: int, n: int, devices, layout: str = "contiguous") -> dict:
    mesh = jax.sharding.Mesh(np.asarray(devices[:n]), ("context",))
    tok = NamedSharding(mesh, P(None, "context"))
    spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=tok)  # noqa: E731
    args = (spec(1, t, H, D), spec(1, t, H, D)) + (spec(1, t, K, D),) * 4
    seg_spec = spec(1, t, dt=jnp.int32)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda seg, *a: jax.grad(layer_loss(seg, layout), argnums=tuple(range(6)))(*a))
        compiled = fn.lower(seg_spec, *args).compile()
    text = compiled.as_text()
    walked = hlo_cost.analyze(text, functools.partial(kernel_cost, block_size=BLOCK, context=n, layout=layout))
    mem = compiled.memory_analysis()
    return {"T": t, "context": n, "layout": layout, "compile_s": time.perf_counter() - t0,
            "splash_flops": sum(f for name, (_, f) in walked.kernels.items() if name.startswith("splash_mha")),
            "hlo_collective_bytes": dict(walked.collective_bytes), "ici_bytes": dict(walked.ici_bytes),
            "analytic_bytes": analytic(t, n), "splash_calls": sum("custom-call(" in ln for ln in text.splitlines() if ln.lstrip().startswith("%splash_mha")),
            "temp_GiB": mem.temp_size_in_bytes / GiB}


def per_step(layer_bytes: float, n: int) -> float:
    """Bytes per chip per step (extrapolated): layer x full-attention layers x rows per context group
    per step, forward gathers counted twice (remat)."""
    groups = STEP["chips"] // n
    return layer_bytes * STEP["full_attention_layers"] * STEP["rows"] * STEP["copies"] / groups


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--contexts", default="2,4,8")
    ap.add_argument("--topology", default="v5p:2x2x2", help="libtpu topology string (enough chips for the largest n)")
    ap.add_argument("--layouts", default="contiguous,zigzag", help="context layouts to compare (model.context_layout)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "context.json"))
    a = ap.parse_args(argv)
    from jax.experimental import topologies

    devices = list(topologies.get_topology_desc(a.topology, platform="tpu").devices)
    print(f"TPU AOT PREDICTION ({a.topology}, libtpu on a CPU host; nothing runs): one full-attention layer's core, "
          f"both streams, fwd+bwd, 1 row of T = {a.seq}, H {H} / KV {K}, head dim {D}, bf16, block {BLOCK}, splash "
          "per context shard. Collective bytes per chip (a gather's result, a scatter's operand); splash FLOPs per "
          "chip: the tiles the shard's kernels run (`clover_jax.model.splash_cost.kernel_cost`).")
    print(f"{'n':>3}{'layout':>12}{'kind':>16}{'HLO MiB':>11}{'analytic MiB':>14}{'HLO/analytic':>14}{'ICI MiB':>10}")
    rows = []
    for n in (int(x) for x in a.contexts.split(",")):
        for layout in a.layouts.split(","):
            r = compile_one(a.seq, n, devices, layout)
            rows.append(r)
            for kind in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"):
                got, want = r["hlo_collective_bytes"][kind], r["analytic_bytes"].get(kind, 0.0)
                if got or want:
                    ratio = f"{got / want:.3f}" if want else "n/a"
                    print(f"{n:>3}{layout:>12}{kind:>16}{got / 2**20:>11.2f}{want / 2**20:>14.2f}{ratio:>14}"
                          f"{r['ici_bytes'][kind] / 2**20:>10.2f}")
            total = sum(r["hlo_collective_bytes"].values())
            r["step_GiB_extrapolated"] = per_step(total + r["hlo_collective_bytes"]["all-gather"], n) / GiB
            want = sum(r["analytic_bytes"].values())
            base = next(x for x in rows if x["context"] == n)  # the first layout of this n
            print(f"{n:>3}{layout:>12}{'total':>16}{total / 2**20:>11.2f}{want / 2**20:>14.2f}{total / want:>14.3f}"
                  f"   splash {r['splash_flops'] / 1e12:.3f} TFLOP/chip ({r['splash_flops'] / base['splash_flops']:.3f}x "
                  f"{base['layout']}; compile {r['compile_s']:.1f} s, {r['splash_calls']} splash calls, "
                  f"temp {r['temp_GiB']:.2f} GiB)")
    print(f"\nper step, EXTRAPOLATED from the layer (agent_mix at {a.seq}: {STEP['rows']} rows x {STEP['copies']} copies "
          f"over {STEP['chips']} chips, {STEP['full_attention_layers']} full-attention layers, forward gathers x2 "
          "for remat), per chip:")
    for r in rows:
        print(f"  context {r['context']} {r['layout']}: {r['step_GiB_extrapolated']:.2f} GiB")
    out = {"seq": a.seq, "topology": a.topology, "step_assumptions": STEP, "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
