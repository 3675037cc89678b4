"""Device check of the flash-attention kernel (`attn_backend: flash`) on a GPU: errors against the
dense jnp reference, kernel vs reference time and memory, and the model's two-stream SFT step.

    python bench/attention_gpu.py                # GPU host: T = 8k, 32k; 16 q heads / 2 KV heads, D = 256
    python bench/attention_gpu.py --smoke        # any host (CPU: interpret mode), tiny shapes: checks the script

On a lent H200 (its image has jax with the CUDA plugin), as one call:
    PYTHONUNBUFFERED=1 python3 bench/attention_gpu.py 2>&1 | tee $OUT/attention_gpu.log

Per T, one full-attention layer's core, both streams (clean: causal in-document over T keys; noisy:
the block rule over 2T keys, block 32), on one packed row (3 documents on the block grid, then pads):
- errors (T <= --check-max-t): max |flash - reference| / max |reference| of both outputs and of
  the gradients of a random linear loss w.r.t. q_clean, q_noisy, k, v; fp32 inputs;
- time: best wall time of the jitted forward and forward+backward in bf16, flash vs reference, and
  the compiled programs' temporaries (``memory_analysis``). The reference is only compiled, not run,
  where its dense scores would not fit (--dense-max-gib).
- model: the tiny preset in block mode (1 GDN + 1 full-attention layer, T = 64), the two-stream
  SFT loss and its gradient w.r.t. every parameter, flash vs reference, fp32. Not in --smoke (its
  CPU compile alone takes about 40 s; tests/kernels/attention/test_ops.py checks the same
  parity in interpret mode); ``--model`` adds it there.

It writes the JSON after every row (``--out``, default ``$OUT/attention_gpu.json`` when ``$OUT`` is
set, else bench/results/attention_gpu.json) and starts nothing after ``--budget-s``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import best_time  # noqa: E402
from pallas_kernels.attention.ops import stream_attention  # noqa: E402

BLOCK = 32
GiB = 1024**3
NAMES = ("q_clean", "q_noisy", "k", "v")


def make_case(T: int, H: int, K: int, D: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One row: documents of T/2, T/4 and T/4 - 1 block tokens (on the block grid, as packing
    places them), then a block of pads (segment 0); keys are clean || noisy slots."""
    rng = np.random.default_rng(seed)
    n = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    cut = [T // 2, T // 4, T // 4 - BLOCK, BLOCK]
    return dict(q_clean=n(1, T, H, D), q_noisy=n(1, T, H, D), k=n(1, 2 * T, K, D), v=n(1, 2 * T, K, D),
                seg=np.repeat(np.array([1, 2, 3, 0], np.int32), cut)[None], w_c=n(1, T, H, D), w_n=n(1, T, H, D))


def layer_fns(backend: str):
    """(forward, loss) of both streams; arguments q_clean, q_noisy, k, v, seg, w_c, w_n."""
    def forward(q_clean, q_noisy, k, v, seg, *_):
        t = q_clean.shape[1]
        out_c = stream_attention(q_clean, k[:, :t], v[:, :t], seg, stream="clean", backend=backend)
        out_n = stream_attention(q_noisy, k, v, seg, stream="noisy", block_size=BLOCK, backend=backend)
        return out_c, out_n

    def loss(*a):
        out_c, out_n = forward(*a)
        return jnp.sum(out_c.astype(jnp.float32) * a[5]) + jnp.sum(out_n.astype(jnp.float32) * a[6])

    return forward, loss


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def _arrays(x: dict, dtype) -> list:
    return [jnp.asarray(x[n], dtype) for n in NAMES] + [jnp.asarray(x[n]) for n in ("seg", "w_c", "w_n")]


def dense_gib(T: int, H: int) -> float:
    """fp32 scores of both streams' dense reference (H x T x (T + 2T)), one copy."""
    return H * T * 3 * T * 4 / GiB


def compile_layer(x: dict, dtype, compiler_options: dict | None) -> tuple[list, dict, dict]:
    """(arrays, {backend_pass: compiled program}, {backend_pass: compile seconds}) in one dtype."""
    args, progs, secs = _arrays(x, dtype), {}, {}
    for backend in ("flash", "reference"):
        fwd, loss = layer_fns(backend)
        for label, fn in (("fwd", jax.jit(fwd)), ("fwd_bwd", jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))))):
            t0 = time.perf_counter()
            progs[f"{backend}_{label}"] = fn.lower(*args).compile(compiler_options=compiler_options)
            secs[f"{backend}_{label}"] = time.perf_counter() - t0
    return args, progs, secs


def errors_of(args: list, progs: dict) -> dict:
    """Flash vs reference: both outputs and the gradients (run the fp32 programs)."""
    run = {k: jax.device_get(p(*args)) for k, p in progs.items()}
    outs, outs_r, grads, grads_r = (run[f"{b}_{p}"] for p in ("fwd", "fwd_bwd") for b in ("flash", "reference"))
    errors = {n: rel(a, b) for n, a, b in zip(("out_clean", "out_noisy"), outs, outs_r)}
    errors.update({f"d{n}": rel(a, b) for n, a, b in zip(NAMES, grads[1], grads_r[1])})
    return errors


def run_layer(x: dict, dtype, repeats: int, check: bool, run_reference: bool, compiler_options=None) -> dict:
    """Errors (fp32, if ``check``), times and temporaries (``dtype``) of one T. With fp32 timing the
    error programs are the timed ones (half the compiles)."""
    res: dict = {"errors": None}
    if check or dtype == jnp.float32:
        args, progs, secs = compile_layer(x, jnp.float32, compiler_options)
        if check:
            res["errors"] = errors_of(args, progs)
    if dtype != jnp.float32:
        args, progs, secs = compile_layer(x, dtype, compiler_options)
    res["compile_s"] = secs
    res["temp_GiB"] = {k: None if (m := p.memory_analysis()) is None else m.temp_size_in_bytes / GiB
                       for k, p in progs.items()}
    res["time_s"] = {k: best_time(lambda p=p: p(*args), repeats) for k, p in progs.items()
                     if k.startswith("flash") or run_reference}
    return res


def check_model(t: int = 64, compiler_options: dict | None = None) -> dict:
    """The tiny block-mode model's two-stream SFT loss and parameter gradients, flash vs reference (fp32)."""
    from flax import nnx

    from clover_jax.config import get_preset
    from clover_jax.model.clover_model import create_model, model_to_params
    from sft.loss import LossConfig, make_sft_loss
    from sft.noise import NoiseConfig

    cfg = get_preset("tiny").replace(mode="block", mask_token_id=255, num_hidden_layers=2,
                                     layer_types=("linear_attention", "full_attention"))
    params = model_to_params(create_model(cfg, 0))
    half = t // 2
    seg = np.array([[1] * half + [2] * (half // 2) + [0] * (half // 2)], np.int32)
    pos = np.r_[0:half, 0:half // 2, 0:half // 2][None].astype(np.int32)
    ids = np.random.default_rng(0).integers(2, 250, (1, t)).astype(np.int32)
    batch = {k: jnp.asarray(v) for k, v in dict(input_ids=ids, segment_ids=seg, positions=pos,
                                                   loss_mask=(seg > 0) & (pos >= 4)).items()}
    out = {}
    for backend in ("reference", "flash"):
        graphdef, _ = nnx.split(create_model(cfg.replace(attn_backend=backend), 0))
        loss_fn = make_sft_loss(graphdef, block_size=16, mask_token_id=255, noise=NoiseConfig(t_min=0.05),
                                loss=LossConfig(ar_loss_weight=0.5, chunk_tokens=64), lb_coef=0.01, end_pad_id=1)
        fn = jax.jit(jax.value_and_grad(lambda p, f=loss_fn: f(p, batch, jax.random.key(1))[0]))
        out[backend] = jax.device_get(fn.lower(params).compile(compiler_options=compiler_options)(params))
    (loss_r, g_r), (loss_f, g_f) = out["reference"], out["flash"]
    flat_r, flat_f = (dict(nnx.traversals.flatten_mapping(g)) for g in (g_r, g_f))
    worst = max(flat_r, key=lambda p: rel(flat_f[p], flat_r[p]))
    return {"loss_rel": abs(float(loss_f) - float(loss_r)) / abs(float(loss_r)),
            "grad_rel_max": rel(flat_f[worst], flat_r[worst]), "grad_worst": "/".join(map(str, worst))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--check-max-t", type=int, default=8192, help="fp32 error check only up to this T")
    ap.add_argument("--dense-max-gib", type=float, default=40.0,
                    help="run the reference only where its dense fp32 scores (both streams) stay under this")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-model", action="store_true", help="skip the model's two-stream SFT step check")
    ap.add_argument("--model", action="store_true", help="with --smoke: run the model check too")
    ap.add_argument("--budget-s", type=float, default=480.0, help="start no new row after this many seconds")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes (T = 256, 4 / 2 heads, D = 32), fp32 timing, 1 repeat")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.seqs, args.heads, args.kv_heads, args.head_dim, args.repeats = [256], 4, 2, 32, 1
    bad = [t for t in args.seqs if t % BLOCK or t < 8 * BLOCK]
    if bad or args.heads % args.kv_heads:
        ap.error(f"--seqs {bad}: each T must be a multiple of the block size {BLOCK} and at least {8 * BLOCK}; "
                 f"--heads must be a multiple of --kv-heads")
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    # smoke (CPU interpret): the same programs at XLA's lowest optimisation level, far less compile time
    fast = {"xla_backend_optimization_level": 0} if args.smoke else None
    out = args.out or (pathlib.Path(os.environ["OUT"]) / "attention_gpu.json" if os.environ.get("OUT")
                       else pathlib.Path(__file__).resolve().parent / "results" / "attention_gpu.json")
    dev = jax.devices()[0]
    meta = {"jax": jax.__version__, "device": f"{dev.platform}: {dev.device_kind}", "host": platform.node(),
            "B": 1, "H": args.heads, "K": args.kv_heads, "D": args.head_dim, "block": BLOCK,
            "time_dtype": jnp.dtype(dtype).name, "repeats": args.repeats}
    print(f"jax {jax.__version__} on {meta['device']}; H={args.heads} K={args.kv_heads} D={args.head_dim}", flush=True)
    report: dict = {"meta": meta, "rows": [], "skipped": [], "model": None}

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))

    start = time.perf_counter()
    for t in args.seqs:
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            report["skipped"].append({"T": t, "after_s": elapsed})
            print(f"T={t}: skipped ({elapsed:.0f} s > --budget-s {args.budget_s:.0f})", flush=True)
            continue
        x = make_case(t, args.heads, args.kv_heads, args.head_dim)
        run_ref = dense_gib(t, args.heads) <= args.dense_max_gib
        row = {"T": t, "reference_run": run_ref,
               **run_layer(x, dtype, args.repeats, t <= args.check_max_t, run_ref, fast)}
        report["rows"].append(row)
        print_row(row)
        save()
    if not args.no_model and (args.model or not args.smoke):
        if time.perf_counter() - start > args.budget_s:
            report["skipped"].append({"model": True})
        else:
            report["model"] = check_model(compiler_options=fast)
            print(f"model two-stream SFT loss rel {report['model']['loss_rel']:.1e}, worst grad "
                  f"{report['model']['grad_worst']} {report['model']['grad_rel_max']:.1e}", flush=True)
    save()
    print(f"wrote {out}")
    return report


def print_row(r: dict) -> None:
    t, m = r["time_s"], r["temp_GiB"]
    ms = lambda k: f"{t[k] * 1e3:9.2f} ms" if k in t else "   not run"  # noqa: E731
    gib = lambda k: "   n/a" if m.get(k) is None else f"{m[k]:6.2f}"  # noqa: E731
    for p in ("fwd", "fwd_bwd"):
        ratio = f"{t[f'reference_{p}'] / t[f'flash_{p}']:6.1f}x" if f"reference_{p}" in t else "     -"
        print(f"T={r['T']:>6} {p:>7} | flash {ms(f'flash_{p}')} temp {gib(f'flash_{p}')} GiB | reference "
              f"{ms(f'reference_{p}')} temp {gib(f'reference_{p}')} GiB | speedup {ratio}", flush=True)
    if r["errors"]:
        print("    errors: " + ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items()), flush=True)


if __name__ == "__main__":
    main()
