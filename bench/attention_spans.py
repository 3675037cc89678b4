"""The CPU attention core of the training streams, dense vs span-restricted (issue 19): fwd and
fwd+bwd of `attend` over the full mask against `attend_spans` with 2 / 4 / 8 query chunks, clean
stream ([T, T], causal) and noisy stream ([T, 2T], block rule), side by side in one process, rounds
alternating so every variant sees the same minutes of a noisy host. The table gives medians of
per-round ratios to the dense core.

    python bench/attention_spans.py                          # the research model's shapes
    python bench/attention_spans.py --batch 4 --seq 512 --heads 8 --kv-heads 2 --head-dim 64
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.forward import timeit  # noqa: E402
from pallas_kernels.attention.reference import attend, two_stream_masks  # noqa: E402
from pallas_kernels.attention.spans import attend_spans, causal_spans, noisy_spans  # noqa: E402


def variants(stream: str, t: int, block: int, chunk_counts: list[int]):
    """(name, core(q, k, v, mask)) of the dense core and each chunk count."""
    out = [("dense", attend)]
    for c in chunk_counts:
        spans = causal_spans(t, c) if stream == "clean" else noisy_spans(t, block, c)
        out.append((f"spans x{c}", lambda q, k, v, m, s=spans: attend_spans(q, k, v, m, s)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    b, t = a.batch, a.seq
    seg = np.ones((b, t), np.int32)
    seg[::2, t // 2:] = 2  # every other row packs two documents
    clean, noisy = two_stream_masks(jnp.asarray(seg), a.block)
    rng = np.random.RandomState(0)
    print(f"batch {b} x {t}, block {a.block}, {a.heads} query / {a.kv_heads} KV heads, head dim {a.head_dim}, fp32; "
          f"{a.rounds} alternating rounds (best of {a.repeats} each)")
    print(f"{'stream':<7} {'core':<10} {'fwd ms':>8} {'f+b ms':>8} {'fwd x dense':>12} {'f+b x dense':>12}")
    for stream, mask in (("clean", clean), ("noisy", noisy)):
        s = mask.shape[2]
        q = jnp.asarray(rng.randn(b, t, a.heads, a.head_dim).astype(np.float32))
        k, v = (jnp.asarray(rng.randn(b, s, a.kv_heads, a.head_dim).astype(np.float32)) for _ in range(2))
        fns = []
        for name, core in variants(stream, t, a.block, a.chunks):
            f = jax.jit(core)
            g = jax.jit(jax.grad(lambda q, k, v, m, core=core: jnp.sum(core(q, k, v, m) ** 2), argnums=(0, 1, 2)))
            fns.append((name, lambda f=f: f(q, k, v, mask).block_until_ready(),
                        lambda g=g: jax.block_until_ready(g(q, k, v, mask))))
        times = {n: [] for n, _, _ in fns}
        for _ in range(a.rounds):
            for n, f, g in fns:
                times[n].append((timeit(f, a.repeats), timeit(g, a.repeats)))
        dense = np.array(times["dense"])
        for n, tt in times.items():
            x = np.array(tt)
            r = np.median(dense / x, axis=0)  # speed-up over dense, per round
            print(f"{stream:<7} {n:<10} {np.median(x[:, 0]) * 1e3:8.1f} {np.median(x[:, 1]) * 1e3:8.1f} "
                  f"{r[0]:11.2f}x {r[1]:11.2f}x", flush=True)


if __name__ == "__main__":
    main()
