"""Collective bytes that context parallelism adds to the GDN: read from the compiled HLO
(`train.hlo_cost`) and compared with an analytic count. A TPU AOT PREDICTION: each program is
compiled for a v5p slice through libtpu on this CPU host; nothing runs.

Program: one GDN layer's sequence mixing at the Qwen3.6-35B-A3B shapes (32 value heads over 16 key
heads, passed grouped; dk = dv = 128; bf16 q, k, v; chunk 64, block 32), forward + backward, rows of
T tokens on a mesh of `fsdp` x `context` chips: rows over fsdp (one per fsdp shard), every row's
sequence over context, as the model's activations are laid out (`batch -> fsdp`, `length -> context`).
Modes: `clean` = the causal op (`context_chunk_gated_delta_rule`, the AR / clean stream); `block` =
both block-mode streams (`context_block_gated_delta_rule`). Without the context axis this program
has no collective at all (rows and heads are independent), so every collective byte is added by
context parallelism.

Analytic count per chip and layer (as `train.hlo_cost` counts: a gather's result, a scatter's
operand, a permute's operand), Bl = rows per chip, n = context: the forward all-gathers every
shard's affine state map, A [Bl, H, dk, dk] and B [Bl, H, dk, dv] fp32 (n x Bl x H x dk x (dk + dv)
x 4 bytes) and permutes the segment id of each shard's last token to its neighbour (Bl x 4 bytes);
the backward reduce-scatters the maps' cotangents (the gather's transpose, the same bytes). Block
mode adds the all-reduce of the softmax scalars' gradient ([H, 3] fp32, replicated). Nothing of
activation size ([.., T, ..]) travels. (The model layer adds the conv halo: K-1 pre-conv tokens of
q, k, v and their segment ids per shard, `clover_jax.model.gdn_context`.)

    python bench/gdn_context.py                          # T = 4096, fsdp 2 x context 4, both modes
    python bench/gdn_context.py --seq 32768 --backend pallas
    python bench/gdn_context.py --modes layer --layouts contiguous,zigzag --out bench/results/gdn_context_layouts.json

The last compares the whole layer under both context layouts, with its HBM traffic (`train.hlo_cost`):
under zig-zag each shard's two pieces run as two rows and the entry-state scan runs over 2n piece
maps instead of n (replicated on every shard, with its [2n, B, H, dk, dv] fp32 carries and their
cotangents), bytes that grow with the number of pieces, not with T.

The analytic bytes do not depend on T (only the state maps travel); T = 4096 keeps the compile of
the jnp reference per shard to minutes on 2 CPU cores.

Results go to bench/results/gdn_context.json; the table also shows bench/results/gdn_context_before.json
(the same programs compiled before the op's shard_map was made manual over every mesh axis: jnp
reference per shard, keys repeated to the value heads; XLA moved the row sharding onto the chunk dim
and all-gathered per-chunk fp32 tensors over fsdp) when present. Measured at T = 4096 (MiB per chip
and layer, before -> after): clean 440 -> 32, block 752 -> 32, with the reference per shard as with
the Pallas kernels (the analytic count exactly); at T = 32768 with Pallas per shard: 32 MiB too.

`--modes ...,layer` also compiles the whole block-mode layer (`compile_layer`), its input in the
model's two-stream layout (`pallas_kernels/context/stream_layout.py`: each context shard holds the clean and
noisy tokens of the same positions). At T = 4096, MiB per chip: collective-permute 18.1 (a weight
gradient's re-layout and the conv halo) and no all-to-all; with the earlier clean || noisy layout
(2T contiguous over `context`: each stream on half the chips, re-laid over all of them at every
split and join) it was 234.8 and 64.0.
"""

from __future__ import annotations

import argparse
import json
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

from pallas_kernels.context.gdn_scan import context_block_gated_delta_rule, context_chunk_gated_delta_rule  # noqa: E402
from train import hlo_cost  # noqa: E402

H, HK, DK, DV, CHUNK, BLOCK = 32, 16, 128, 128, 64, 32
KINDS = hlo_cost.COLLECTIVE_KINDS
GiB = 1024**3
RESULTS = Path(__file__).parent / "results"


def analytic(mode: str, n: int, rows_local: int = 1, heads_local: int = H) -> dict[str, float]:
    """Per chip and layer (module docstring): bytes by collective kind."""
    maps = n * rows_local * heads_local * DK * (DK + DV) * 4
    out = {"all-gather": maps, "reduce-scatter": maps, "collective-permute": rows_local * 4}
    if mode == "block":
        out["all-reduce"] = H * 3 * 4
    return out


def _loss(mode: str, chunk: int, block: int, extra: dict):
    def f(seg, q, k, v, g, beta, *noisy):
        if mode == "clean":
            o, _ = context_chunk_gated_delta_rule(q, k, v, g, beta, segment_ids=seg, chunk_size=chunk, **extra)
            return jnp.sum(o.astype(jnp.float32))
        o, on, _ = context_block_gated_delta_rule(q, k, v, g, beta, *noisy, block_size=block, segment_ids=seg,
                                                  chunk_size=chunk, **extra)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(on.astype(jnp.float32))
    return f


def compile_one(mode: str, t: int, fsdp: int, n: int, devices, backend: str | None = None,
                chunk: int = CHUNK, block: int = BLOCK, key_heads: int = HK) -> dict:
    """AOT-compiles one layer's op (fwd + bwd) on a fsdp x context mesh; returns its HLO numbers.
    ``key_heads`` = H passes the keys repeated to the value heads (what the op took before grouping)."""
    mesh = jax.sharding.Mesh(np.asarray(devices[:fsdp * n]).reshape(fsdp, n), ("fsdp", "context"))
    b = fsdp
    tok = NamedSharding(mesh, P("fsdp", "context"))
    spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=tok)  # noqa: E731
    qkv = (spec(b, t, key_heads, DK), spec(b, t, key_heads, DK), spec(b, t, H, DV))
    args = qkv + (spec(b, t, H, dt=jnp.float32), spec(b, t, H, dt=jnp.float32))
    if mode == "block":
        args += qkv + (jax.ShapeDtypeStruct((H, 3), jnp.float32, sharding=NamedSharding(mesh, P())),)
    extra = {} if backend is None else {"backend": backend}
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        loss = _loss(mode, chunk, block, extra)
        fn = jax.jit(lambda seg, *a: jax.grad(loss, argnums=tuple(range(1, 1 + len(a))))(seg, *a))
        compiled = fn.lower(spec(b, t, dt=jnp.int32), *args).compile()
    text = compiled.as_text()
    walked = hlo_cost.analyze(text)
    mem = compiled.memory_analysis()
    return {"mode": mode, "T": t, "fsdp": fsdp, "context": n, "backend": backend or "default", "key_heads": key_heads,
            "compile_s": time.perf_counter() - t0,
            "hlo_collective_bytes": dict(walked.collective_bytes), "ici_bytes": dict(walked.ici_bytes),
            "analytic_bytes": analytic(mode, n), "flops": walked.flops,
            "kernel_calls": text.count('custom_call_target="tpu_custom_call"'),  # Mosaic (Pallas) kernels
            "temp_GiB": mem.temp_size_in_bytes / GiB}


def compile_layer(t: int, fsdp: int, n: int, devices, chunk: int = CHUNK, block: int = BLOCK,
                  layout: str = "contiguous") -> dict:
    """The whole block-mode GDN layer (projections, conv with its halo, both streams, gated norm,
    out_proj; Qwen3.6-35B-A3B widths, bf16 compute, fp32 params, Pallas per shard), fwd + bwd w.r.t.
    params and input, rows [fsdp, 2T] laid out by THE rule table. Its collective bytes beyond the op's
    are the FSDP weights' (each param gathered whole over fsdp x context, its gradient scattered back)
    and the conv halo. ``layout``: the row's context layout (``model.context_layout``); the layer's input
    is taken as already laid out (the model moves it once, before the stack)."""
    from flax import nnx

    from clover_jax.config import ModelConfig
    from clover_jax.model.clover_model import NO_SEGMENT
    from clover_jax.model.gdn import GatedDeltaNet
    from clover_jax.parallel import sharding as sh

    cfg = ModelConfig(mode="block", dtype="bfloat16", param_dtype="float32", gdn_backend="pallas", block_size=block,
                      gdn_chunk_size=chunk)
    mesh = jax.sharding.Mesh(np.asarray(devices[:fsdp * n]).reshape(1, fsdp, 1, n, 1), sh.MESH_AXES)
    layer = nnx.eval_shape(lambda: GatedDeltaNet(cfg, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(layer)
    params = sh.abstract_params(layer, mesh)
    x = jax.ShapeDtypeStruct((fsdp, 2 * t, cfg.hidden_size), jnp.bfloat16,
                             sharding=sh.batch_sharding(mesh, shape=(fsdp, 2 * t, cfg.hidden_size)))
    seg = jax.ShapeDtypeStruct((fsdp, t), jnp.int32, sharding=sh.batch_sharding(mesh, shape=(fsdp, t)))

    def loss(p, x, seg):
        y = nnx.merge(graphdef, p).two_stream(x, {"segment_ids": seg, "block_size": block,
                                                  "empty_segment": NO_SEGMENT, "context_layout": layout})
        return jnp.sum(y.astype(jnp.float32))

    t0 = time.perf_counter()
    with sh.use_sharding(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x, seg).compile()
    walked = hlo_cost.analyze(compiled.as_text())
    param_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(params))
    lring = cfg.linear_conv_kernel_dim - 1
    halo = lring * (2 * cfg.gdn_key_dim + cfg.gdn_value_dim) * 2 + lring * 4  # one row: q, k, v bf16 + ids
    return {"mode": "layer", "T": t, "fsdp": fsdp, "context": n, "backend": "pallas", "layout": layout,
            "compile_s": time.perf_counter() - t0, "hbm_bytes": walked.hbm_bytes,
            "hlo_collective_bytes": dict(walked.collective_bytes), "ici_bytes": dict(walked.ici_bytes),
            "param_bytes": param_bytes, "op_analytic_bytes": analytic("block", n), "conv_halo_bytes": halo,
            "kernel_calls": compiled.as_text().count('custom_call_target="tpu_custom_call"'),
            "temp_GiB": compiled.memory_analysis().temp_size_in_bytes / GiB}


def table(rows: list[dict], before: dict[tuple, dict]) -> None:
    print(f"{'mode':>6}{'kind':>20}{'before MiB':>12}{'after MiB':>11}{'analytic MiB':>14}{'after/analytic':>16}")
    for r in rows:
        old = before.get((r["mode"], r["T"], r["fsdp"], r["context"]), {}).get("hlo_collective_bytes", {})
        for kind in KINDS:
            got, want, was = r["hlo_collective_bytes"][kind], r["analytic_bytes"].get(kind, 0.0), old.get(kind)
            if got or want or was:
                ratio = f"{got / want:.3f}" if want else "n/a"
                was_s = f"{was / 2**20:.2f}" if was is not None else "-"
                print(f"{r['mode']:>6}{kind:>20}{was_s:>12}{got / 2**20:>11.2f}{want / 2**20:>14.2f}{ratio:>16}")
        total, want = sum(r["hlo_collective_bytes"].values()), sum(r["analytic_bytes"].values())
        was = f"{sum(old.values()) / 2**20:.2f}" if old else "-"
        print(f"{r['mode']:>6}{'total':>20}{was:>12}{total / 2**20:>11.2f}{want / 2**20:>14.2f}{total / want:>16.3f}"
              f"   (backend {r['backend']}, compile {r['compile_s']:.1f} s, {r['kernel_calls']} kernel calls, "
              f"temp {r['temp_GiB']:.2f} GiB)")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--fsdp", type=int, default=2)
    ap.add_argument("--context", type=int, default=4)
    ap.add_argument("--modes", default="clean,block")
    ap.add_argument("--backend", default=None, help="GDN backend inside each shard (default: the op's default)")
    ap.add_argument("--key-heads", type=int, default=HK, help=f"{H}: keys repeated to the value heads")
    ap.add_argument("--topology", default="v5p:2x2x2", help="libtpu topology string (fsdp x context chips)")
    ap.add_argument("--layouts", default="contiguous", help="context layouts of the whole-layer compile (`layer` mode)")
    ap.add_argument("--out", default=str(RESULTS / "gdn_context.json"))
    ap.add_argument("--before", default=str(RESULTS / "gdn_context_before.json"))
    a = ap.parse_args(argv)
    from jax.experimental import topologies

    devices = list(topologies.get_topology_desc(a.topology, platform="tpu").devices)
    print(f"TPU AOT PREDICTION ({a.topology}, libtpu on a CPU host; nothing runs): one GDN layer's sequence mixing, "
          f"fwd+bwd, {a.fsdp} rows of T = {a.seq} on fsdp {a.fsdp} x context {a.context}, "
          f"H {H} / key heads {a.key_heads}, "
          f"dk = dv = {DK}, bf16, chunk {CHUNK}, block {BLOCK}. Collective bytes per chip.")
    rows = [compile_one(m, a.seq, a.fsdp, a.context, devices, a.backend, key_heads=a.key_heads)
            for m in a.modes.split(",") if m != "layer"]
    before = {}
    if a.before and Path(a.before).exists():
        old = json.loads(Path(a.before).read_text())["rows"]
        before = {(r["mode"], r["T"], r["fsdp"], r["context"]): r for r in old}
    table(rows, before)
    if "layer" in a.modes.split(","):
        for layout in a.layouts.split(","):
            r = compile_layer(a.seq, a.fsdp, a.context, devices, layout=layout)
            rows.append(r)
            print(f"\nthe whole block-mode GDN layer, {layout} layout (fwd+bwd, params fp32 = "
                  f"{r['param_bytes'] / 2**20:.1f} MiB, FSDP over fsdp x context; op analytic "
                  f"{sum(r['op_analytic_bytes'].values()) / 2**20:.2f} MiB, conv halo {r['conv_halo_bytes'] / 2**10:.1f} "
                  "KiB per permute set), MiB per chip:")
            for kind in KINDS:
                print(f"{kind:>20}{r['hlo_collective_bytes'][kind] / 2**20:>11.2f}")
            print(f"   HBM traffic {r['hbm_bytes'] / 1e9:.3f} GB/chip (compile {r['compile_s']:.1f} s, "
                  f"{r['kernel_calls']} kernel calls, temp {r['temp_GiB']:.2f} GiB)")
    out = {"seq": a.seq, "topology": a.topology, "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
