"""Chunked gated delta rule on this CPU: our XLA path vs transformers' torch code vs the naive scan.

    python bench/gdn.py                         # T = 1k, 4k, 16k; B = 1, 4 heads, dk = dv = 128
    python bench/gdn.py --seqs 1024 --repeats 2 # quick

Rows: forward and forward+backward wall time (best of --repeats after a warm-up) of
- ``xla``: ``chunk_gated_delta_rule_ref`` under ``jax.jit`` (what ``backend="auto"`` runs on CPU),
- ``torch``: transformers' ``torch_chunk_gated_delta_rule`` (fp32, eager, autograd backward),
- ``scan``: ``recurrent_gated_delta_rule_ref``, the literal per-token recurrence under ``lax.scan``,
side by side with ratios, plus the FLOP count of the chunked algorithm and the fraction of this
machine's matmul peak (a large fp32 matmul, timed before and after every row; the higher is used).

Two more columns say where the gap to that peak comes from:
- ``dots``: the forward's batched matmuls alone (same shapes, same layouts, same scan over chunks;
  no masks, exps, inverse or transposes). ``xla/dots`` near 1 means the elementwise work is not the
  problem; ``dots/bound`` is what XLA:CPU's batched small matmuls cost against the 2048^2 peak.
- ``bmm GF/s``: one batched matmul of the forward's most common shape ([N*H] x [C, dk] @ [dk, dv])
  through XLA with row-major operands (``nn``), through XLA in the reference's transposed-left form
  (``tn``), and through torch (MKL/oneDNN) on the same cores: XLA's small-matmul paths vs the machine.

The Pallas kernel is not timed here: on CPU it only runs in interpret mode, which measures nothing
about TPU/GPU speed.
Results go to bench/results/gdn.json (+ gdn.png). The machine is shared: rerun to see the noise.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pathlib
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref  # noqa: E402
from pallas_kernels.gdn.reference import tn  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def best_of(fn, repeats: int, warmup: bool = True) -> dict[str, float]:
    """Best wall time and best process CPU time (all threads) over ``repeats`` calls. On a shared
    machine the CPU time moves much less with other users' load than the wall time does."""
    if warmup:
        fn()
    wall = cpu = float("inf")
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return {"wall": wall, "cpu": cpu}


def matmul_peak(n: int = 2048, repeats: int = 5) -> dict[str, float]:
    """FLOP per second (wall) and per CPU-second of a large fp32 matmul through XLA: the machine's
    practical peak for this run."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    t = best_of(lambda: f(a).block_until_ready(), repeats)
    return {k: 2 * n ** 3 / v for k, v in t.items()}


def chunked_flops(T: int, H: int, dk: int, dv: int, C: int = 64, B: int = 1) -> dict[str, float]:
    """Matmul FLOPs of the chunked (WY/UT) forward per the reference's algorithm, per chunk and head:
    k_beta k^T and q k^T (2 x 2C^2 dk), the unit-triangular solve for [v_beta, k_beta decay]
    (C^2 (dk + dv), counted as a triangular solve), the state readouts w S and q S and the update
    k^T delta (3 x 2 C dk dv), and attn delta (2 C^2 dv). Elementwise work is not counted.
    The backward of such an algorithm is about 2x its forward (the usual count)."""
    N = -(-T // C)
    per_chunk = 4 * C * C * dk + C * C * (dk + dv) + 6 * C * dk * dv + 2 * C * C * dv
    fwd = float(B * H * N * per_chunk)
    return {"fwd": fwd, "fwd_bwd": 3 * fwd}


def dots_only_forward(T: int, H: int, dk: int, dv: int, C: int = 64, repeats: int = 3) -> dict[str, float]:
    """Wall/CPU time of the chunked forward's matmuls alone, as ``chunk_gated_delta_rule_ref`` issues
    them (the same shapes and the same "TN" operand layout): batched over all chunks and heads,
    [k_beta; q] k^T ([dk, C] x [dk, 2C]), T v_beta and (T k_beta)^T ([C, C] x [C, d]); then a
    ``lax.scan`` over the chunks with [w; q] S ([dk, 2C] x [dk, dv]), attn delta ([C, C] x [C, dv])
    and k^T delta ([C, dk] x [C, dv]) batched over heads. Operands are random (values do not change
    a matmul's speed); the only other work is what keeps every product live."""
    N = -(-T // C)
    X = N * H
    rng = np.random.default_rng(1)
    rnd = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    tn = tn  # the reference's own matmul
    args = (rnd(X, dk, C), rnd(X, dk, C), rnd(X, C, dk), rnd(X, C, dv), rnd(X, C, C), rnd(H, dk, dv))

    def fwd(qT, kT, k, v, t, s0):
        kk = tn(kT, jnp.concatenate([kT, qT], axis=-1))                 # [X, C, 2C]
        tt = t + kk[..., :C]
        u = tn(tt, v)                                                     # [X, C, dv]
        wT = tn(k, tt)                                                    # [X, dk, C]
        wq = jnp.concatenate([wT, qT], axis=-1)
        per_chunk = lambda x: x.reshape((N, H) + x.shape[1:])  # noqa: E731

        def step(S, x):
            u_, wq_, a_, k_ = x
            P = tn(wq_, S)
            d = u_ - P[:, :C]
            return S + tn(k_, d), P[:, C:] + tn(a_, d)

        return jax.lax.scan(step, s0, tuple(map(per_chunk, (u, wq, kk[..., C:], k))))

    f = jax.jit(fwd)
    return best_of(lambda: jax.block_until_ready(f(*args)), repeats)


def bmm_rates(T: int, H: int, dk: int, dv: int, C: int = 64, repeats: int = 5) -> dict[str, float]:
    """FLOP per wall second of one batched matmul [N*H] x [C, dk] @ [dk, dv] three ways: XLA with
    row-major operands ("nn": XLA:CPU gives it to YNNPACK), XLA with the left operand stored
    transposed ("tn": Eigen's batched GEMM, the form the reference uses), and torch.bmm (MKL/oneDNN)."""
    import torch

    n = -(-T // C) * H
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in ((n, C, dk), (n, dk, dv)))
    flops = 2 * n * C * dk * dv
    ja, jat, jb = jnp.asarray(a), jnp.asarray(np.ascontiguousarray(a.transpose(0, 2, 1))), jnp.asarray(b)
    nn = jax.jit(lambda x, y: jnp.einsum("nck,nkv->ncv", x, y))
    tn = jax.jit(lambda x, y: jnp.einsum("nkc,nkv->ncv", x, y))
    t_nn = best_of(lambda: jax.block_until_ready(nn(ja, jb)), repeats)["wall"]
    t_tn = best_of(lambda: jax.block_until_ready(tn(jat, jb)), repeats)["wall"]
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    t_torch = best_of(lambda: torch.bmm(ta, tb), repeats)["wall"]
    return {"xla_nn": flops / t_nn, "xla_tn": flops / t_tn, "torch": flops / t_torch}


def make_inputs(T: int, H: int, dk: int, dv: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    l2 = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    f32 = np.float32
    return dict(q=l2(rng.standard_normal((1, T, H, dk))).astype(f32), k=l2(rng.standard_normal((1, T, H, dk))).astype(f32),
                v=rng.standard_normal((1, T, H, dv)).astype(f32),
                g=(-np.logaddexp(0.0, rng.standard_normal((1, T, H)))).astype(f32),
                beta=(1.0 / (1.0 + np.exp(-rng.standard_normal((1, T, H))))).astype(f32),
                w=rng.standard_normal((1, T, H, dv)).astype(f32))


NAMES = ("q", "k", "v", "g", "beta")


def jax_timings(fn, x, repeats: int, backward: bool = True) -> dict[str, float]:
    args = [jnp.asarray(x[n]) for n in NAMES]
    w = jnp.asarray(x["w"])  # an argument, not a closed-over constant (XLA would constant-fold it)
    fwd = jax.jit(lambda *a: fn(*a)[0])

    def loss(q, k, v, g, beta, w):
        o, s = fn(q, k, v, g, beta)
        return jnp.sum(o * w) + jnp.sum(s)

    bwd = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5))))
    out = {"fwd": best_of(lambda: jax.block_until_ready(fwd(*args)), repeats)}
    if backward:
        out["fwd_bwd"] = best_of(lambda: jax.block_until_ready(bwd(*args, w)), repeats)
    return out


def torch_timings(x, repeats: int, C: int = 64) -> dict[str, float]:
    import torch
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    fn = inspect.unwrap(hf.torch_chunk_gated_delta_rule)  # the pure-torch code, not an fla kernel
    t = {n: torch.from_numpy(x[n]) for n in NAMES + ("w",)}

    def fwd():
        with torch.no_grad():
            fn(*(t[n] for n in NAMES), chunk_size=C, output_final_state=True, use_qk_l2norm_in_kernel=False)

    def fwd_bwd():
        args = [t[n].clone().requires_grad_() for n in NAMES]
        o, s = fn(*args, chunk_size=C, output_final_state=True, use_qk_l2norm_in_kernel=False)
        ((o * t["w"]).sum() + s.sum()).backward()

    return {"fwd": best_of(fwd, repeats), "fwd_bwd": best_of(fwd_bwd, repeats, warmup=False)}


def torch_threads() -> int:
    import torch
    return torch.get_num_threads()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "gdn.json")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--scan-bwd-max-t", type=int, default=4096,
                    help="skip the naive scan's backward above this T (its autodiff keeps every "
                         "per-token state: ~12 GB at T=16k, 4 heads)")
    args = ap.parse_args()

    print(f"jax {jax.__version__} on {platform.processor() or platform.machine()}, {os.cpu_count()} cpus; "
          f"load avg {os.getloadavg()[0]:.1f}")
    torch_timings(make_inputs(128, args.heads, args.dk, args.dv), 1)  # untimed: torch's one-off lazy init
    rows = []
    for T in args.seqs:
        x = make_inputs(T, args.heads, args.dk, args.dv)
        flops = chunked_flops(T, args.heads, args.dk, args.dv)
        # the peak is re-measured next to every row: on a shared machine it moves with the load
        peak = matmul_peak()
        r = {"T": T, "flops": flops, "loadavg": os.getloadavg()[0],
             "xla": jax_timings(chunk_gated_delta_rule_ref, x, args.repeats),
             "scan": jax_timings(lambda *a: recurrent_gated_delta_rule_ref(*a), x, args.repeats,
                                 backward=T <= args.scan_bwd_max_t),
             "torch": torch_timings(x, args.repeats)}
        r["dots"] = dots_only_forward(T, args.heads, args.dk, args.dv)
        r["bmm_flops"] = bmm_rates(T, args.heads, args.dk, args.dv)
        peak2 = matmul_peak()
        r["peak_flops"] = {k: max(peak[k], peak2[k]) for k in peak}
        r["bound_s"] = {clock: {p: f / r["peak_flops"][clock] for p, f in flops.items()} for clock in ("wall", "cpu")}
        rows.append(r)
        for clock in ("wall", "cpu"):
            print_row(r, clock, header=len(rows) == 1)
        sys.stdout.flush()
    for clock in ("wall", "cpu"):
        print(f"\n{clock} time" + (" (process CPU seconds, all threads; peak in FLOP per CPU-second)" if clock == "cpu" else ""))
        for i, r in enumerate(rows):
            print_row(r, clock, header=i == 0)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"jax": jax.__version__, "cpus": os.cpu_count(), "torch_threads": torch_threads(), "B": 1, "H": args.heads,
            "dk": args.dk, "dv": args.dv, "chunk_size": 64, "repeats": args.repeats,
            "loadavg_end": os.getloadavg()}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    if not args.no_plot:
        plot(rows, args.out.with_suffix(".png"))


def print_row(r: dict, clock: str, header: bool) -> None:
    if header:
        print(f"{'T':>6} {'pass':>8} {'clock':>5} | {'xla ms':>9} {'torch ms':>10} {'scan ms':>10} | {'torch/xla':>9} "
              f"{'scan/xla':>8} | {'GFLOP':>6} {'peak GF/s':>9} {'bound ms':>8} {'xla/bound':>9} {'% peak':>6} | "
              f"{'dots ms':>8} {'xla/dots':>8} {'dots/bound':>10} | {'bmm GF/s nn':>11} {'tn':>6} {'torch':>6}")
    for p in ("fwd", "fwd_bwd"):
        xla, torch_ = r["xla"][p][clock], r["torch"][p][clock]
        scan = r["scan"][p][clock] if p in r["scan"] else float("nan")
        bound = r["bound_s"][clock][p]
        tail = ""
        if p == "fwd":  # the matmul-only program and the bmm rates are forward measurements
            dots = r["dots"][clock]
            tail = f" | {dots * 1e3:8.1f} {xla / dots:8.2f} {dots / bound:10.2f} | "
            bmm = r["bmm_flops"]
            tail += (f"{bmm['xla_nn'] / 1e9:11.1f} {bmm['xla_tn'] / 1e9:6.1f} {bmm['torch'] / 1e9:6.1f}" if clock == "wall"
                     else f"{'-':>11} {'-':>6} {'-':>6}")
        print(f"{r['T']:>6} {p:>8} {clock:>5} | {xla * 1e3:9.1f} {torch_ * 1e3:10.1f} {scan * 1e3:10.1f} | "
              f"{torch_ / xla:9.2f} {scan / xla:8.2f} | {r['flops'][p] / 1e9:6.2f} {r['peak_flops'][clock] / 1e9:9.1f} "
              f"{bound * 1e3:8.1f} {xla / bound:9.2f} {100 * bound / xla:6.1f}{tail}")


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    Ts = [r["T"] for r in rows]
    for ax, p in zip(axes, ("fwd", "fwd_bwd")):
        for impl, style in (("xla", "o-"), ("torch", "s-"), ("scan", "^-")):
            ax.plot(Ts, [r[impl][p]["wall"] * 1e3 if p in r[impl] else float("nan") for r in rows], style, label=impl)
        if p == "fwd":
            ax.plot(Ts, [r["dots"]["wall"] * 1e3 for r in rows], "x:", label="xla matmuls only")
        ax.plot(Ts, [r["bound_s"]["wall"][p] * 1e3 for r in rows], "k--", label="FLOP bound")
        ax.set(xscale="log", yscale="log", xlabel="T", ylabel="wall ms", title=f"GDN {p} (B=1, H=4, dk=dv=128)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
