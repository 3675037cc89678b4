"""One GDN token against a carried state (an AR decode step): the recurrence's single step vs the
chunked form, which pads the token to a whole chunk.

    python bench/gdn_decode_step.py          # the 35B's GDN layer: 32 value / 16 key heads, dk = dv = 128

Rows per batch (1, 8): best wall time of the jitted op (bf16 q / k / v, fp32 gates and state, an
initial state), for ``recurrent`` (`recurrent_gated_delta_rule_ref`: what the model's cached one-token
extend runs), ``chunked`` (`chunk_gated_delta_rule_ref`, chunk 64: what it ran before, and what
``backend="auto"`` runs on CPU for longer extends), and on a GPU / TPU ``chunked_pallas`` (the kernels);
the ratio to ``recurrent``, and the largest output / state difference to it (the same function).
Results: bench/results/gdn_decode_step.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import best_time  # noqa: E402
from pallas_kernels import chunk_gated_delta_rule, recurrent_gated_delta_rule_ref  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def inputs(B: int, H: int, HK: int, K: int, V: int, seed: int = 0) -> tuple:
    """(q, k, v, g, beta, state, segment_ids) of one token per row; q, k l2-normalised as the model's."""
    r = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = (jnp.asarray(unit(r.normal(size=(B, 1, HK, K))), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(r.normal(size=(B, 1, H, V)), jnp.bfloat16)
    g = jnp.asarray(-np.abs(r.normal(size=(B, 1, H))), jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-r.normal(size=(B, 1, H)))), jnp.float32)
    state = jnp.asarray(r.normal(size=(B, H, K, V)) * 0.1, jnp.float32)
    return q, k, v, g, beta, state, jnp.ones((B, 1), jnp.int32)


def programs(chunk: int) -> dict:
    """{row name: the jitted op (q, k, v, g, beta, state, segment_ids) -> (o, final state)}."""
    on_device = jax.default_backend() in ("gpu", "tpu")
    progs = {"recurrent": lambda q, k, v, g, b, s, seg: recurrent_gated_delta_rule_ref(
        q, k, v, g, b, initial_state_BHKV=s, segment_ids_BT=seg)}
    for name, backend in (("chunked", "reference"),) + ((("chunked_pallas", "pallas"),) if on_device else ()):
        progs[name] = lambda q, k, v, g, b, s, seg, backend=backend: chunk_gated_delta_rule(
            q, k, v, g, b, initial_state=s, segment_ids=seg, chunk_size=chunk, backend=backend)
    return {n: jax.jit(f) for n, f in progs.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--key-heads", type=int, default=16)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "gdn_decode_step.json")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    report = {"meta": {"device": f"{dev.platform}: {dev.device_kind}", "jax": jax.__version__, "host": platform.node(),
                       "H": args.heads, "HK": args.key_heads, "dk": args.dk, "dv": args.dv, "chunk": args.chunk,
                       "repeats": args.repeats}, "rows": []}
    progs = programs(args.chunk)
    print(f"{'B':>3} | " + " | ".join(f"{n:>15}" for n in progs) + " | ratios to recurrent | max diff o / state")
    for B in args.batches:
        x = inputs(B, args.heads, args.key_heads, args.dk, args.dv)
        outs = {n: p(*x) for n, p in progs.items()}
        ms = {n: 1e3 * best_time(lambda p=p: p(*x), args.repeats) for n, p in progs.items()}
        ref_o, ref_s = outs["recurrent"]
        diff = {n: (float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref_o.astype(jnp.float32)))),
                    float(jnp.max(jnp.abs(s - ref_s)))) for n, (o, s) in outs.items() if n != "recurrent"}
        row = {"B": B, "ms": ms, "ratio_to_recurrent": {n: t / ms["recurrent"] for n, t in ms.items()},
               "max_diff_o_state": diff}
        report["rows"].append(row)
        print(f"{B:>3} | " + " | ".join(f"{t:12.3f} ms" for t in ms.values()) + " | "
              + ", ".join(f"{n} {r:.1f}x" for n, r in row["ratio_to_recurrent"].items() if n != "recurrent") + " | "
              + ", ".join(f"{n} {a:.1e} / {b:.1e}" for n, (a, b) in diff.items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
