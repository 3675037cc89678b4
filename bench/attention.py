"""Full-attention core of one layer, both training streams (clean: causal in-document over T keys;
noisy: the block rule over 2T keys), forward + backward, at the real head shapes (16 query heads
over 2 KV heads, head dim 256, bf16): the dense jnp reference vs the splash kernel path.

Nothing runs: each variant is AOT-compiled for one TPU v5p chip through libtpu on this host, and
the table shows the compiler's memory analysis (temporaries = the peak beyond inputs and outputs)
and XLA's FLOP count. Splash's Pallas calls carry no cost estimate (JAX's kernel), so its FLOPs
column shows only the XLA-visible part; the "visible pairs" column is the work the kernel cannot skip
(query-key pairs its static mask allows, per head, both streams). Interpret-mode CPU time says
nothing about TPU speed, so nothing is timed.

    python bench/attention.py                      # T = 2048, 8192, 32768, one row of one document
    python bench/attention.py --seqs 2048 --rows 2

Results also go to bench/results/attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.attention.ops import stream_attention  # noqa: E402
from pallas_kernels.attention.splash import NoisyBlockMask  # noqa: E402

H, K, D, BLOCK = 16, 2, 256, 32
GiB = 1024**3


def layer_loss(backend: str, seg):
    """Sum of both streams' outputs (fp32), a scalar to differentiate w.r.t. q, k, v."""
    def f(q_clean, q_noisy, k, v):
        t = q_clean.shape[1]
        out_c = stream_attention(q_clean, k[:, :t], v[:, :t], seg, stream="clean", backend=backend)
        out_n = stream_attention(q_noisy, k, v, seg, stream="noisy", block_size=BLOCK, backend=backend)
        return jnp.sum(out_c.astype(jnp.float32)) + jnp.sum(out_n.astype(jnp.float32))
    return f


def visible_pairs(t: int) -> int:
    """Query-key pairs the static masks allow (one document): clean causal + noisy block rule."""
    noisy = sum(int(np.sum(NoisyBlockMask(t, BLOCK)[i:i + 1024, :])) for i in range(0, t, 1024))
    return t * (t + 1) // 2 + noisy


def compile_one(backend: str, rows: int, t: int, device) -> dict:
    sh = jax.sharding.SingleDeviceSharding(device)
    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sh)  # noqa: E731
    seg = jnp.ones((rows, t), jnp.int32)
    fn = jax.jit(jax.grad(layer_loss(backend, seg), argnums=(0, 1, 2, 3)))
    args = (spec(rows, t, H, D), spec(rows, t, H, D), spec(rows, 2 * t, K, D), spec(rows, 2 * t, K, D))
    try:
        compiled = fn.lower(*args).compile()
    except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses programs over HBM
        m = re.search(r"temporaries \(([\d.]+)([KMGT])\)", str(e))
        if m is None:
            raise
        temp = float(m.group(1)) * 1024 ** "KMGT".index(m.group(2)) * 1024
        return {"backend": backend, "T": t, "temp_GiB": temp / GiB, "fits": False, "xla_TFLOP": None}
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"backend": backend, "T": t, "temp_GiB": mem.temp_size_in_bytes / GiB, "fits": True,
            "xla_TFLOP": float(cost.get("flops", 0.0)) / 1e12}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="2048,8192,32768")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "attention.json"))
    args = ap.parse_args(argv)
    from jax.experimental import topologies

    device = topologies.get_topology_desc("v5p:2x2x1", platform="tpu").devices[0]
    rows = []
    print(f"one full-attention layer core, both streams, fwd+bwd, {args.rows} row(s), H {H} / KV {K}, "
          f"head dim {D}, bf16, block {BLOCK}; AOT for one v5p chip (95 GiB HBM)")
    print(f"{'T':>7}{'backend':>11}{'temp GiB':>10}{'fits':>6}{'XLA TFLOP':>11}{'visible pairs/head':>20}")
    for t in (int(s) for s in args.seqs.split(",")):
        pairs = visible_pairs(t) * args.rows
        for backend in ("reference", "splash"):
            r = compile_one(backend, args.rows, t, device) | {"visible_pairs_per_head": pairs}
            rows.append(r)
            fl = "n/a" if r["xla_TFLOP"] is None else f"{r['xla_TFLOP']:.3f}"
            print(f"{t:>7}{backend:>11}{r['temp_GiB']:>10.2f}{'yes' if r['fits'] else 'NO':>6}{fl:>11}{pairs:>20.3e}",
                  flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
