"""MoE layer benchmark: our sorted/expert-parallel dispatch vs the dense one-hot einsum.

Part 1 (CPU, measured): routed-expert fwd+bwd wall time at 8, 64 and 256 experts, single device
(`blocked`, `capacity`, `ragged` vs `dense`) and expert-parallel on 8 simulated CPU devices (ragged all-to-all
and ring; the devices share this machine's cores, so those columns show overhead, not speed-up).
`ragged` is skipped where XLA:CPU's dense expansion of ragged_dot would not fit in memory.

Part 2 (compiled HLO, no run): per-device communication of one MoE layer fwd+bwd, top-8 of 256
experts at the real widths (D 2048, I 512), AOT-compiled for a TPU slice through libtpu (so the
real `ragged-all-to-all` is in the program). Bytes = sum of the operand sizes of every collective
in the optimised HLO (for ragged-all-to-all: its send buffer, which is sized for the worst case;
the payload column is what uniform routing actually moves).

    python bench/moe.py                 # both parts
    python bench/moe.py --part 1 --tokens 1024
    python bench/moe.py --part 2 --topology v5p:2x2x2

Results also go to bench/results/moe.json (the parts run, merged into what the file holds).
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
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from clover_jax.parallel import sharding as sh  # noqa: E402
from clover_jax.model.moe import experts_dense, experts_parallel, experts_sorted, route  # noqa: E402
from clover_jax.model.moe_capacity import experts_capacity  # noqa: E402
from common import best_time  # noqa: E402


def problem(tokens: int, d: int, i: int, e: int, k: int, dtype=jnp.float32, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (tokens, d), dtype)
    _, w, ex = route(jax.random.normal(ks[1], (tokens, e)), k)
    wg = (jax.random.normal(ks[2], (e, d, i)) / d**0.5).astype(dtype)
    wu = (jax.random.normal(ks[3], (e, d, i)) / d**0.5).astype(dtype)
    wo = (jax.random.normal(ks[4], (e, i, d)) / i**0.5).astype(dtype)
    return x, w, ex, wg, wu, wo


def fwd_bwd(fn):
    """jit(grad) of sum(fn(x, w, wg, wu, wo)) w.r.t. x and the expert weights."""
    return jax.jit(jax.grad(lambda x, w, ex, wg, wu, wo: jnp.sum(fn(x, w, ex, wg, wu, wo)), argnums=(0, 3, 4, 5)))


def ep_fn(mesh, dispatch, rows, cols):
    ctx = sh.ShardingContext(mesh)

    def fn(x, w, ex, wg, wu, wo):
        k = ex.shape[-1]
        y = experts_parallel(x.reshape(rows, cols, -1), w.reshape(rows, cols, k), ex.reshape(rows, cols, k),
                             wg, wu, wo, ctx=ctx, impl="auto", dispatch=dispatch)
        return y.reshape(rows * cols, -1)

    return fn


def part1(tokens: int, d: int, i: int, repeats: int) -> dict:
    print(f"\nPart 1: routed experts fwd+bwd on CPU, {tokens} tokens, D={d}, I={i}, fp32 (best of {repeats}, ms)")
    mesh = sh.make_mesh(sh.MeshConfig(fsdp=1, expert=8))
    head = (f"{'E':>5}{'k':>4}{'dense':>10}{'blocked':>10}{'capacity':>10}{'ragged':>10}{'EP a2a':>10}{'EP ring':>10}"
            f"{'dense/blocked':>15}{'dense/capacity':>15}{'dense/ragged':>14}{'dense/EP a2a':>14}")
    print(head)
    out = {"tokens": tokens, "d": d, "i": i, "dtype": "float32", "repeats": repeats, "unit": "ms", "rows": []}
    for e, k in ((8, 2), (64, 8), (256, 8)):
        args = problem(tokens, d, i, e, k)
        # each jitted function is built once (a fresh jit per call would time the compile)
        fns = {"dense": fwd_bwd(experts_dense), "blocked": fwd_bwd(lambda *a: experts_sorted(*a, impl="blocked")),
               "capacity": fwd_bwd(experts_capacity), "ragged": fwd_bwd(lambda *a: experts_sorted(*a, impl="ragged"))}
        t = {name: best_time(lambda f=f: f(*args), repeats) for name, f in fns.items() if name != "ragged"}
        # XLA:CPU lowers ragged_dot to a dense [E, rows, D] masked product: 256 experts x 8 rows per
        # token would need ~20 GB here, so the column stops where that would not fit
        t["ragged"] = (best_time(lambda: fns["ragged"](*args), repeats)
                       if e * tokens * k * d * 4 < 2**31 else float("nan"))
        with jax.set_mesh(mesh):
            for disp in ("ragged_a2a", "ring"):
                f = fwd_bwd(ep_fn(mesh, disp, 8, tokens // 8))
                t[disp] = best_time(lambda f=f: f(*args), repeats)
        ms = {k_: v * 1e3 for k_, v in t.items()}
        print(f"{e:>5}{k:>4}{ms['dense']:>10.1f}{ms['blocked']:>10.1f}{ms['capacity']:>10.1f}{ms['ragged']:>10.1f}"
              f"{ms['ragged_a2a']:>10.1f}{ms['ring']:>10.1f}{t['dense'] / t['blocked']:>15.2f}"
              f"{t['dense'] / t['capacity']:>15.2f}{t['dense'] / t['ragged']:>14.2f}{t['dense'] / t['ragged_a2a']:>14.2f}")
        out["rows"].append({"experts": e, "top_k": k, **{f"{k_}_ms": (None if v != v else v) for k_, v in ms.items()},
                            "dense_over_blocked": t["dense"] / t["blocked"],
                            "dense_over_capacity": t["dense"] / t["capacity"],
                            "dense_over_ep_a2a": t["dense"] / t["ragged_a2a"]})
    return out


_COLLECTIVES = ("ragged-all-to-all", "all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8, "f64": 8}


def _shape_bytes(text: str) -> list[int]:
    return [_DTYPE_BYTES.get(dt, 4) * int(np.prod([int(x) for x in dims.split(",") if x] or [1]))
            for dt, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text)]


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes per collective kind in an optimised HLO module text: per op the larger of its operand
    and result buffers (the optimised text may print operands without shapes; an async `-start`
    op's tuple result holds (operand, result): its largest member counts; `-done` ops do not count).
    For ragged-all-to-all that is its output buffer, sized for the worst case (dropless)."""
    out: dict[str, int] = {}
    kinds = "|".join(re.escape(c) for c in _COLLECTIVES)
    pat = re.compile(r"=\s*(\(.*?\)|[a-z]+\d*\[[\d,]*\](?:\{[^}]*\})?)\s+(" + kinds + r")(-start)?\((.*?)\)(,|$)")
    for line in hlo.splitlines():
        m = pat.search(line)
        if not m:
            continue
        result, kind, start, operands = m.group(1), m.group(2), m.group(3), m.group(4)
        res = _shape_bytes(result)
        ops = _shape_bytes(operands)
        if kind == "ragged-all-to-all":
            ops = ops[:2]  # operand, output buffer (the offsets / sizes are tiny)
        nbytes = max(max(res, default=0) if (start or result.startswith("(")) else sum(res), max(ops, default=0))
        out[kind] = out.get(kind, 0) + nbytes
    return out


def part2(topology: str, tokens_per_device: int) -> dict:
    from jax.experimental import topologies

    d, i, e, k = 2048, 512, 256, 8
    devs = topologies.get_topology_desc(topology, platform="tpu").devices
    ep = len(devs)
    mesh = sh.make_mesh(sh.MeshConfig(fsdp=1, expert=ep), devs)
    n = tokens_per_device * ep
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert", None))
    experts = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert", None, None))
    x = jax.ShapeDtypeStruct((n, d), jnp.bfloat16, sharding=rows)
    w = jax.ShapeDtypeStruct((n, k), jnp.float32, sharding=rows)
    ex = jax.ShapeDtypeStruct((n, k), jnp.int32, sharding=rows)
    wg = jax.ShapeDtypeStruct((e, d, i), jnp.bfloat16, sharding=experts)
    wo = jax.ShapeDtypeStruct((e, i, d), jnp.bfloat16, sharding=experts)
    print(f"\nPart 2: per-device collective bytes of one MoE layer fwd+bwd, top-{k} of {e}, D={d}, I={i}, bf16, "
          f"{tokens_per_device} tokens/device, expert parallel over {ep} TPU devices ({topology}, AOT)")
    print(f"{'dispatch':<12}{'collectives in the HLO (bytes/device)':<62}{'HLO KiB/token':>14}{'payload KiB/token':>18}")
    # uniform routing: a token's k rows leave for other ranks with prob (ep-1)/ep, out and back,
    # forward and backward (4 trips of D bf16); ring: all-gather + reduce-scatter of D per token
    # per other rank, forward and backward
    payload = {"ragged_a2a": 4 * k * d * 2 * (ep - 1) / ep, "ring": 4 * (ep - 1) * d * 2}
    out = {"topology": topology, "devices": ep, "d": d, "i": i, "experts": e, "top_k": k, "dtype": "bfloat16",
           "tokens_per_device": tokens_per_device, "rows": [],
           "note": ("HLO bytes: per collective op the larger of its operand / result buffers; the ragged-all-to-all "
                    "buffers are sized for the dropless worst case (every assignment to one rank), the collective "
                    "moves only the routed rows (payload column: uniform routing)")}
    for disp in ("ragged_a2a", "ring"):
        with jax.set_mesh(mesh):
            fn = fwd_bwd(ep_fn(mesh, disp, ep, tokens_per_device))
            hlo = fn.lower(x, w, ex, wg, wg, wo).compile().as_text()
        per = collective_bytes(hlo)
        total = sum(per.values())
        desc = ", ".join(f"{c} {b / 2**20:.1f}M" for c, b in sorted(per.items(), key=lambda kv: -kv[1]))
        print(f"{disp:<12}{desc:<62}{total / tokens_per_device / 1024:>14.1f}{payload[disp] / 1024:>18.1f}")
        out["rows"].append({"dispatch": disp, "collective_bytes_per_device": per,
                            "hlo_bytes_per_token": total / tokens_per_device,
                            "payload_bytes_per_token_uniform": payload[disp]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", type=int, choices=(1, 2), default=None)
    ap.add_argument("--tokens", type=int, default=1024, help="part 1: tokens per step (multiple of 8)")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--i", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--topology", default="v5p:2x2x2", help="part 2: TPU slice for the AOT compile")
    ap.add_argument("--tokens-per-device", type=int, default=2048)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "moe.json"))
    a = ap.parse_args()
    path = Path(a.out)
    res = json.loads(path.read_text()) if path.exists() else {}
    if a.part in (None, 1):
        res["part1_cpu_fwd_bwd"] = part1(a.tokens, a.d, a.i, a.repeats)
    if a.part in (None, 2):
        res["part2_comm_volume"] = part2(a.topology, a.tokens_per_device)
    res["jax"] = jax.__version__
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
