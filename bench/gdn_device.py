"""Device check of the Pallas GDN kernels: errors against the jnp reference, and kernel vs XLA-path time.

    python bench/gdn_device.py                   # GPU / TPU host: T = 8k, 32k; B = 1, 32 heads, dk = dv = 128
    python bench/gdn_device.py --smoke           # any host (CPU: interpret mode), tiny shapes: checks the script

On a lent H200 (its image has jax with the CUDA plugin; nothing else of ours is needed), as one call:
    PYTHONUNBUFFERED=1 python3 bench/gdn_device.py --check-dtype bfloat16 2>&1 | tee $OUT/gdn_device.log
(the fp32 Triton programs at dk = dv = 128 exceeded the H200's shared memory: measured 2026-12-04,
bench/results/gdn_device_h200_fp32check.json; the bf16 results are bench/results/gdn_device_h200.json;
``--fp32-fit`` compiles the fp32 programs once more, since the parallel backward takes dv in tiles).

The kernels are the phase split on both platforms (issue 17): on a GPU the Triton kernels of
``pallas_kernels/gdn/gpu_calls.py`` with the launch options of its table for (dk, dv, chunk) (recorded
in the JSON's meta), on a TPU the Mosaic kernels of ``gdn/tpu_calls.py``.

For each T and each op (``causal``: ``chunk_gated_delta_rule``; ``block``: ``block_gated_delta_rule``
with block 32, chunk 64, both streams), on one packed row (3 documents) with an initial state:
- errors: max |kernel - reference| / max |reference| of the outputs, the final state and every
  gradient of a random scalar loss (q, k, v, g, beta, s0; block: also the noisy q, k, v and the
  calibration scalars), fp32 inputs; the reference is ``backend="reference"`` (the XLA path);
- time: best wall time of the jitted forward and forward+backward, kernel vs reference, in
  ``--time-dtype`` (bf16 q / k / v by default, the training dtype; state and accumulation are fp32);
- on a GPU (and with ``--smoke``, interpreted), the causal op's phase kernels timed one by one
  (intra, WY recompute, state sweep, output, dS sweep, parallel backward; bf16): where the time goes.

It writes the JSON after every row (``--out``, default ``$OUT/gdn_device.json`` when ``$OUT`` is set,
else bench/results/gdn_device.json), so a run cut short by the device's time limit keeps what it
measured, and it skips what would start after ``--budget-s``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import best_time  # noqa: E402
from pallas_kernels import block_gated_delta_rule, chunk_gated_delta_rule  # noqa: E402

BLOCK, CHUNK = 32, 64
CAUSAL_ARGS = ("q", "k", "v", "g", "beta", "s0")
BLOCK_ARGS = CAUSAL_ARGS + ("qn", "kn", "vn", "scalars")


def make_case(T: int, H: int, dk: int, dv: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One row of 3 packed documents (about T/2, T/4, T/4 tokens, the boundaries 3 tokens off the
    chunk grid) with realistic gates; scalars off their init so every term counts."""
    rng = np.random.default_rng(seed)
    f32 = np.float32
    n = lambda *s: rng.standard_normal(s).astype(f32)  # noqa: E731
    l2 = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    cut = [T // 2 + 3, T // 4 - 3, T - (T // 2 + 3) - (T // 4 - 3)]
    return dict(q=l2(n(1, T, H, dk)), k=l2(n(1, T, H, dk)), v=n(1, T, H, dv),
                g=(-np.logaddexp(0.0, n(1, T, H))).astype(f32), beta=(1 / (1 + np.exp(-n(1, T, H)))).astype(f32),
                s0=0.5 * n(1, H, dk, dv), qn=l2(n(1, T, H, dk)), kn=l2(n(1, T, H, dk)), vn=n(1, T, H, dv),
                scalars=np.stack([np.sqrt(dk) * (1 + 0.2 * n(H)), n(H), 1 + 0.3 * n(H)], -1).astype(f32),
                seg=np.repeat(np.arange(1, 4, dtype=np.int32), cut)[None],
                w_o=n(1, T, H, dv), w_on=n(1, T, H, dv), w_s=n(1, H, dk, dv))


def op_fns(op: str, backend: str, interpret: bool | None):
    """(forward, loss) of one op and backend; both take the op's arrays in order, then seg and the
    loss weights. The loss is a random linear function of every output (o, o_noisy, final state)."""
    def forward(*a):
        if op == "causal":
            q, k, v, g, beta, s0, seg = a[:7]
            o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, segment_ids=seg,
                                          chunk_size=CHUNK, backend=backend, interpret=interpret)
            return (o, s)
        q, k, v, g, beta, s0, qn, kn, vn, scalars, seg = a[:11]
        return block_gated_delta_rule(q, k, v, g, beta, qn, kn, vn, scalars, block_size=BLOCK,
                                      initial_state=s0, segment_ids=seg, chunk_size=CHUNK,
                                      backend=backend, interpret=interpret)

    def loss(*a):
        outs = forward(*a)
        weights = a[-len(outs):]  # w_o, (w_on,) w_s
        return sum(jnp.sum(o.astype(jnp.float32) * w) for o, w in zip(outs, weights))

    return forward, loss


def op_arrays(op: str, x: dict[str, np.ndarray], dtype) -> list:
    """The op's arrays in order, then seg and the loss weights; q / k / v (both streams) in ``dtype``."""
    names = CAUSAL_ARGS if op == "causal" else BLOCK_ARGS
    extra = ("seg", "w_o", "w_on", "w_s") if op == "block" else ("seg", "w_o", "w_s")
    cast = {"q", "k", "v", "qn", "kn", "vn"}
    return [jnp.asarray(x[n], dtype) if n in cast else jnp.asarray(x[n]) for n in names + extra]


def op_programs(op: str, backend: str, interpret: bool | None) -> dict:
    """{"fwd": jitted forward, "fwd_bwd": jitted value_and_grad of the loss w.r.t. the op's arrays}."""
    fwd, loss = op_fns(op, backend, interpret)
    argnums = tuple(range(len(CAUSAL_ARGS if op == "causal" else BLOCK_ARGS)))
    return {"fwd": jax.jit(fwd), "fwd_bwd": jax.jit(jax.value_and_grad(loss, argnums=argnums))}


def fp32_fit(T: int, H: int, dk: int, dv: int, ops: list[str], interpret: bool | None,
             compiler_options: dict | None = None) -> list[dict]:
    """Whether each op's kernel programs compile with fp32 q / k / v (forward, forward+backward): on a
    GPU the fp32 tiles are what exceed shared memory (``ops.GPU_FP32_MAX_HEAD_DIM``, the parallel
    backward's value tiles ``gpu_calls.FP32_BACKWARD_BLOCK_V``). A program that fails keeps the last
    line of its error (the shared memory it asked for); nothing runs, so this costs compiles only."""
    x, rows = make_case(T, H, dk, dv), []
    for op in ops:
        args = op_arrays(op, x, jnp.float32)
        for label, fn in op_programs(op, "pallas", interpret).items():
            t0 = time.perf_counter()
            row: dict = {"T": T, "op": op, "pass": label}
            try:
                fn.lower(*args).compile(compiler_options)
                row["fits"] = True
            except Exception as e:  # noqa: BLE001
                row["fits"], row["error"] = False, (str(e).strip().splitlines() or [repr(e)])[-1][-500:]
            row["compile_s"] = time.perf_counter() - t0
            rows.append(row)
            print(f"  fp32 fit T={T} {op} {label}: " + ("compiles" if row["fits"] else f"FAILS: {row['error']}"),
                  flush=True)
    return rows


def run_op(op: str, x: dict[str, np.ndarray], time_dtype, interpret: bool | None, repeats: int,
           compiler_options: dict | None = None, check_dtype=jnp.float32) -> dict:
    """Errors (check_dtype, fp32 by default) and timings (time_dtype) of one op, kernel vs reference.
    Each program is compiled once per dtype (with `compiler_options`): where the two dtypes agree the
    error programs are the timed ones."""
    names = CAUSAL_ARGS if op == "causal" else BLOCK_ARGS

    def compiled(dtype) -> tuple[list, dict, dict]:
        """(the arrays, {backend_pass: compiled program}, {backend_pass: compile seconds}) for one input dtype."""
        args, progs, secs = op_arrays(op, x, dtype), {}, {}
        for backend in ("pallas", "reference"):
            for label, fn in op_programs(op, backend, interpret).items():
                t0 = time.perf_counter()
                progs[f"{backend}_{label}"] = fn.lower(*args).compile(compiler_options)
                secs[f"{backend}_{label}"] = time.perf_counter() - t0
        return args, progs, secs

    c_args, progs, secs = compiled(check_dtype)
    out_k, out_r = (jax.device_get(progs[f"{b}_fwd"](*c_args)) for b in ("pallas", "reference"))
    g_k, g_r = (jax.device_get(progs[f"{b}_fwd_bwd"](*c_args)[1]) for b in ("pallas", "reference"))
    rel = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))  # noqa: E731
                             / max(float(np.max(np.abs(np.asarray(b, np.float64)))), 1e-30))
    out_names = ("o", "final_state") if op == "causal" else ("o_clean", "o_noisy", "final_state")
    res: dict = {"errors": {**{n: rel(a, b) for n, a, b in zip(out_names, out_k, out_r)},
                            **{f"d{n}": rel(a, b) for n, a, b in zip(names, g_k, g_r)}}}

    t_args = c_args
    if jnp.dtype(time_dtype) != jnp.dtype(check_dtype):
        t_args, progs, secs = compiled(time_dtype)
    res["compile_s"] = secs
    res["time_s"] = {k: best_time(lambda p=p: p(*t_args), repeats) for k, p in progs.items()}
    return res


def kernel_times(T: int, H: int, dk: int, dv: int, repeats: int, interpret: bool) -> dict[str, float]:
    """Best time (s) of each GPU phase kernel of the causal op alone (``gdn.gpu_calls``, bf16 q / k / v,
    one row of H heads): where the fwd / fwd+bwd time goes, for tuning the launch table."""
    from pallas_kernels.gdn import gpu_calls as g
    from pallas_kernels.gdn.causal_op import prepare
    from pallas_kernels.gdn.kernel_bodies import KernelConfig

    x, bf = make_case(T, H, dk, dv), jnp.bfloat16
    q, k, v, aux, s0 = prepare(*(jnp.asarray(x[n], bf) for n in ("q", "k", "v")), x["g"], x["beta"], x["s0"],
                                x["seg"], CHUNK)
    dO = jnp.asarray(x["w_o"], bf).reshape(1, T, H * dv)
    kw = dict(cfg=KernelConfig(chunk_size=CHUNK, scale=dk ** -0.5, low_dtype="bfloat16"), interpret=interpret)
    calls = {
        "intra": lambda k, v, aux: g.intra_call(k, v, aux, K=dk, **kw),
        "wy": lambda k, v, aux, Ti: g.intra_call(k, v, aux, K=dk, T_in=Ti, **kw),
        "sweep": lambda *a: g.sweep_call(*a, **kw),
        "output": lambda *a: g.output_call(*a, **kw),
        "state_bwd": lambda *a: g.state_backward_call(*a, **kw),
        "parallel_bwd": lambda *a: g.parallel_backward_call(*a, **kw),
    }
    jitted = {n: jax.jit(f) for n, f in calls.items()}
    Ti, w, u = jitted["intra"](k, v, aux)
    final, states = jitted["sweep"](k, w, u, aux, s0)
    dstates, _ = jitted["state_bwd"](q, k, w, aux, dO, final)
    args = dict(intra=(k, v, aux), wy=(k, v, aux, Ti), sweep=(k, w, u, aux, s0), output=(q, k, w, u, aux, states),
                state_bwd=(q, k, w, aux, dO, final), parallel_bwd=(q, k, v, aux, Ti, w, u, states, dstates, dO))
    return {n: best_time(lambda f=f, a=args[n]: f(*a), repeats) for n, f in jitted.items()}


#: launch variants the --tune sweep times, as changes to the table's entry for the shape: the entry
#: itself, then the knobs no device has timed yet (chunks per intra program, the backward's value
#: tiles: a budget that stops the sweep early still reaches them), then one warp / stage knob at a
#: time, then the narrower / wider value-tile corners
TUNE_VARIANTS = [{}, {"intra_chunks": 2}, {"intra_chunks": 4}, {"backward_block_v": 64}, {"backward_block_v": 32},
                 {"parallel_warps": 8}, {"backward_warps": 4}, {"num_stages": 1}, {"num_stages": 3},
                 {"block_v": 16}, {"block_v": 64}, {"sweep_warps": 2, "block_v": 16},
                 {"sweep_warps": 8, "block_v": 64}]


def tune_launch(T: int, H: int, dk: int, dv: int, repeats: int, budget_s: float, interpret: bool,
                variants: list[dict] = TUNE_VARIANTS) -> list[dict]:
    """The phase kernels timed alone under each launch variant of ``variants`` (the table's entry for
    (dk, dv, chunk), or the default launch, changed by the variant, restored after): the data for the launch table. A
    variant that fails to compile is recorded with its error; none starts after ``budget_s``."""
    from pallas_kernels.gdn import gpu_calls as g
    key, rows, start = (dk, dv, CHUNK), [], time.perf_counter()
    saved, base = g.LAUNCH.get(key), g.launch_for(*key)
    try:
        for change in variants:
            launch = dataclasses.replace(base, **change)
            if time.perf_counter() - start > budget_s or dv % launch.block_v:
                continue
            g.LAUNCH[key] = launch
            row: dict = {"launch": dataclasses.asdict(launch)}
            try:
                row["time_s"] = kernel_times(T, H, dk, dv, repeats, interpret)
                row["total_s"] = sum(row["time_s"].values())
            except Exception:  # noqa: BLE001
                row["error"] = traceback.format_exc()[-3000:]
            rows.append(row)
            print(f"    tune {row['launch']}: " + (f"total {row['total_s'] * 1e3:.2f} ms: " + ", ".join(
                f"{k} {v * 1e3:.2f}" for k, v in row["time_s"].items()) if "time_s" in row
                else "FAILED " + row["error"].strip().splitlines()[-1]), flush=True)
    finally:
        if saved is None:
            g.LAUNCH.pop(key, None)
        else:
            g.LAUNCH[key] = saved
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with --smoke's shapes and the default time dtype applied."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--ops", nargs="+", default=["causal", "block"], choices=["causal", "block"])
    ap.add_argument("--time-dtype", default=None, choices=["bfloat16", "float32"],
                    help="q / k / v dtype of the timed runs (default bfloat16; float32 with --smoke)")
    ap.add_argument("--check-dtype", default="float32", choices=["bfloat16", "float32"],
                    help="q / k / v dtype of the error check (bfloat16: the timed programs' errors, one compile per program)")
    ap.add_argument("--no-phase-times", action="store_true", help="skip the GPU phase kernels timed one by one")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=480.0, help="start no new (T, op) after this many seconds")
    ap.add_argument("--tune-seq", type=int, default=0,
                    help="after the rows, time the GPU phase kernels at this T under each launch variant (0: no sweep)")
    ap.add_argument("--tune-budget-s", type=float, default=120.0, help="start no new launch variant after this many seconds")
    ap.add_argument("--fp32-fit", action="store_true",
                    help="after the rows, compile each op's fp32 kernel programs at the first T: do they fit the device")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (T = 256, 2 heads, dk = dv = 32), fp32, 1 repeat, XLA backend opt level 0")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.seqs, args.heads, args.dk, args.dv, args.repeats = [256], 2, 32, 32, 1
    bad = [T for T in args.seqs if T < 2 * CHUNK or T % BLOCK]
    if bad:
        ap.error(f"--seqs {bad}: each T must be a multiple of the block size {BLOCK} and at least {2 * CHUNK}")
    # fp32 timing reuses the error programs (half the compiles): the smoke default
    args.time_dtype = args.time_dtype or ("float32" if args.smoke else "bfloat16")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # smoke (a check of the script, its times mean nothing): XLA's backend optimisation level 0,
    # the same semantics at about half the CPU compile time
    fast = {"xla_backend_optimization_level": 0} if args.smoke else None
    out = args.out or (pathlib.Path(os.environ["OUT"]) / "gdn_device.json" if os.environ.get("OUT")
                       else pathlib.Path(__file__).resolve().parent / "results" / "gdn_device.json")
    interpret = None  # the dispatch default: interpret on CPU only
    dev = jax.devices()[0]
    meta = {"jax": jax.__version__, "device": f"{dev.platform}: {dev.device_kind}", "host": platform.node(),
            "B": 1, "H": args.heads, "dk": args.dk, "dv": args.dv, "block": BLOCK, "chunk": CHUNK,
            "time_dtype": args.time_dtype, "check_dtype": args.check_dtype, "repeats": args.repeats}
    if dev.platform == "gpu":
        from pallas_kernels.gdn import gpu_calls
        launch = gpu_calls.launch_for(args.dk, args.dv, CHUNK)
        meta["gpu_launch"] = {**dataclasses.asdict(launch),
                              "from_table": (args.dk, args.dv, CHUNK) in gpu_calls.LAUNCH}
    print(f"jax {jax.__version__} on {meta['device']}; H={args.heads} dk={args.dk} dv={args.dv}"
          + (f"; launch {meta['gpu_launch']}" if "gpu_launch" in meta else ""), flush=True)
    report = {"meta": meta, "rows": [], "skipped": []}
    start = time.perf_counter()
    for T in args.seqs:
        x = make_case(T, args.heads, args.dk, args.dv)
        for op in args.ops:
            elapsed = time.perf_counter() - start
            if elapsed > args.budget_s:
                report["skipped"].append({"T": T, "op": op, "after_s": elapsed})
                print(f"T={T} {op}: skipped ({elapsed:.0f} s > --budget-s {args.budget_s:.0f})", flush=True)
                continue
            # a failing row is recorded with its traceback and the run goes on: one device call has
            # to bring back everything it can
            try:
                r = {"T": T, "op": op, **run_op(op, x, jnp.dtype(args.time_dtype), interpret, args.repeats, fast,
                                                 jnp.dtype(args.check_dtype))}
            except Exception:  # noqa: BLE001
                r = {"T": T, "op": op, "error": traceback.format_exc()[-6000:]}
            if op == "causal" and (dev.platform == "gpu" or args.smoke) and not args.no_phase_times:   # smoke: the GPU kernels interpreted
                try:
                    r["gpu_kernel_time_s"] = kernel_times(T, args.heads, args.dk, args.dv, args.repeats,
                                                          interpret=dev.platform != "gpu")
                except Exception:  # noqa: BLE001
                    r["gpu_kernel_error"] = traceback.format_exc()[-6000:]
            report["rows"].append(r)
            print_row(r)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1))
    if args.tune_seq and (dev.platform == "gpu" or args.smoke):
        report["tune"] = {"T": args.tune_seq, "rows": tune_launch(
            args.tune_seq, args.heads, args.dk, args.dv, args.repeats, args.tune_budget_s,
            interpret=dev.platform != "gpu")}
    if args.fp32_fit:
        if time.perf_counter() - start > args.budget_s:
            report["skipped"].append({"fp32_fit": True, "after_s": time.perf_counter() - start})
        else:
            report["fp32_fit"] = fp32_fit(args.seqs[0], args.heads, args.dk, args.dv, args.ops, interpret, fast)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print_table(report["rows"])
    print(f"wrote {out}")
    return report


def print_table(rows: list[dict]) -> None:
    """One line per (T, op): kernel and reference times (ms), speed-ups, the worst error."""
    print(f"\n{'T':>6} {'op':>6} | {'fwd':>9} {'ref fwd':>9} {'x':>5} | {'fwd+bwd':>9} {'ref f+b':>9} {'x':>5} "
          "| worst rel error")
    for r in rows:
        if "error" in r:
            print(f"{r['T']:>6} {r['op']:>6} | failed: {r['error'].strip().splitlines()[-1]}")
            continue
        t = {k: v * 1e3 for k, v in r["time_s"].items()}
        worst = max(r["errors"], key=r["errors"].get)
        print(f"{r['T']:>6} {r['op']:>6} | {t['pallas_fwd']:9.2f} {t['reference_fwd']:9.2f} "
              f"{t['reference_fwd'] / t['pallas_fwd']:5.1f} | {t['pallas_fwd_bwd']:9.2f} {t['reference_fwd_bwd']:9.2f} "
              f"{t['reference_fwd_bwd'] / t['pallas_fwd_bwd']:5.1f} | {worst} {r['errors'][worst]:.1e}", flush=True)


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"T={r['T']:>6} {r['op']:>6} | FAILED\n{r['error']}", flush=True)
    if "gpu_kernel_error" in r:
        print(f"T={r['T']:>6} phase kernels alone | FAILED\n{r['gpu_kernel_error']}", flush=True)
    if "error" in r:
        return
    t = r["time_s"]
    worst = max(r["errors"], key=r["errors"].get)
    print(f"T={r['T']:>6} {r['op']:>6} | fwd kernel {t['pallas_fwd'] * 1e3:8.2f} ms  xla {t['reference_fwd'] * 1e3:8.2f} ms "
          f"({t['reference_fwd'] / t['pallas_fwd']:5.1f}x) | fwd+bwd kernel {t['pallas_fwd_bwd'] * 1e3:8.2f} ms  "
          f"xla {t['reference_fwd_bwd'] * 1e3:8.2f} ms ({t['reference_fwd_bwd'] / t['pallas_fwd_bwd']:5.1f}x) | "
          f"worst rel error {worst} {r['errors'][worst]:.1e}", flush=True)
    print("    errors: " + ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items()), flush=True)
    if "gpu_kernel_time_s" in r:
        print("    GPU phase kernels alone (bf16): " + ", ".join(
            f"{k} {v * 1e3:.2f} ms" for k, v in r["gpu_kernel_time_s"].items()), flush=True)


if __name__ == "__main__":
    main()
