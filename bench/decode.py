"""Decoding benchmark on this CPU: AR greedy vs block diffusion (threshold 0.9 / 0.95 / 0.99) vs
self-speculative, on the small tool-call model of tests/decode_fixtures.py (trained once, cached).
Rows marked "first waits" turn `first_token_commit` off (the block's first token waits for the
threshold like the others): the before/after of that option, in one run (same compiled programs).

    python bench/decode.py [--n 16] [--batch 16] [--block 32] [--max-new 64] [--repeats 2]

Per setting: wall time per generated token (best of `--repeats` timed runs after one warm-up run
that compiles), NFE (every forward a request needed: prefill, denoising steps, commit passes),
tokens per forward, and quality (tool-call validity, BFCL-style argument match, agreement with AR
greedy). Prints the table with the ratios against AR and writes bench/results/decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from clover_jax.api import load_hf  # noqa: E402
from clover_jax.decoding.generator import DecodeConfig, Decoder  # noqa: E402
from clover_jax.decoding.metrics import ar_agreement, bfcl_match, reference_calls, tool_call_validity  # noqa: E402
from clover_jax.bridge.tokenizer import load_tokenizer  # noqa: E402
from tests.decode_fixtures import encode_example, tool_call_records, trained_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16, help="held-out tool-call prompts")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--fast-compile", action="store_true", help="unoptimised XLA backend (faster compiles)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode.json"))
    args = ap.parse_args()

    ckpt = trained_checkpoint()
    cfg, model = load_hf(ckpt)
    tok = load_tokenizer(ckpt)
    recs = tool_call_records(args.n)
    ex = [encode_example(tok, r) for r in recs]
    prompts = [e[0] for e in ex]
    settings = [("AR greedy", dict(mode="ar")),
                *[(f"threshold {t}", dict(mode="threshold", threshold=t)) for t in (0.9, 0.95, 0.99)],
                ("self-speculative", dict(mode="self_speculative")),
                *[(f"threshold {t} first waits", dict(mode="threshold", threshold=t, first_token_commit=False))
                  for t in (0.9, 0.95, 0.99)],
                ("self-spec first waits", dict(mode="self_speculative", first_token_commit=False))]
    rows, ar_ids = [], None
    for name, kw in settings:
        dcfg = DecodeConfig(block_size=args.block, max_new_tokens=args.max_new, fast_compile=args.fast_compile, **kw)
        dec = Decoder(model, dcfg, vocab_limit=len(tok))
        t0 = time.perf_counter()
        runs = [[dec.generate(prompts[i: i + args.batch]) for i in range(0, len(prompts), args.batch)]]
        compile_s = time.perf_counter() - t0
        walls = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            runs.append([dec.generate(prompts[i: i + args.batch]) for i in range(0, len(prompts), args.batch)])
            walls.append(time.perf_counter() - t0)
        gens = [g for out in runs[-1] for g in out.generations]
        ids = [g.token_ids for g in gens]
        if ar_ids is None:
            ar_ids = ids
        texts = [tok.decode([t for t in g if t != cfg.eos_token_id]) for g in ids]
        tokens = sum(len(g) for g in ids)
        nfe = sum(g.stats["nfe"] for g in gens)
        wall = min(walls)
        rows.append({
            "setting": name, "block_size": args.block if kw["mode"] != "ar" else 1, **kw,
            "tokens": tokens, "nfe": nfe, "tokens_per_forward": tokens / nfe,
            "batch_forwards": sum(out.stats["batch_forwards"] for out in runs[-1]),
            "wall_s": wall, "ms_per_token": 1e3 * wall / tokens, "first_run_s": compile_s,
            "validity": float(np.mean([tool_call_validity(t, e[3], True)["valid"] for t, e in zip(texts, ex)])),
            "bfcl_accuracy": float(np.mean([bfcl_match(t, reference_calls(e[2])) for t, e in zip(texts, ex)])),
            "ar_agreement": float(np.mean([ar_agreement(a, b) for a, b in zip(ids, ar_ids)])),
            "ar_exact": float(np.mean([a == b for a, b in zip(ids, ar_ids)])),
            "rejections_per_request": float(np.mean([g.stats["rejections"] for g in gens])),
            "steps_per_block": float(np.mean([g.stats["steps_per_block"] or 0 for g in gens])),
        })
        print(f"  {name}: {rows[-1]['ms_per_token']:.2f} ms/token, NFE {nfe}, "
              f"{rows[-1]['tokens_per_forward']:.2f} tok/fwd (first run {compile_s:.1f} s)", flush=True)
    ar = rows[0]
    for r in rows:
        r["speedup_vs_ar"] = ar["ms_per_token"] / r["ms_per_token"]
        r["nfe_ratio_vs_ar"] = ar["nfe"] / r["nfe"]
    head = f"{'setting':<27}{'ms/token':>9}{'NFE':>6}{'tok/fwd':>8}{'valid':>7}{'bfcl':>6}{'AR agree':>9}" \
           f"{'speed x':>8}{'NFE x':>7}"
    print(f"\nblock {args.block}, {args.n} held-out tool-call prompts, batch {args.batch}, max_new {args.max_new}, "
          f"{jax.devices()[0].platform} ({os.cpu_count()} cores)\n{head}")
    for r in rows:
        print(f"{r['setting']:<27}{r['ms_per_token']:>9.2f}{r['nfe']:>6}{r['tokens_per_forward']:>8.2f}"
              f"{r['validity']:>7.2f}{r['bfcl_accuracy']:>6.2f}{r['ar_agreement']:>9.2f}"
              f"{r['speedup_vs_ar']:>8.2f}{r['nfe_ratio_vs_ar']:>7.2f}")
    th = rows[2]  # threshold 0.95, the Clover default
    sp = rows[4]
    print(f"\nclosing note (speed x = AR ms/token / ms/token; NFE x = AR NFE / NFE): threshold 0.95 needs "
          f"{th['nfe'] / ar['nfe']:.2f}x AR's forwards ({th['tokens_per_forward']:.2f} tokens/forward) and runs at "
          f"{th['speedup_vs_ar']:.2f}x AR's per-token speed here, validity {th['validity']:.2f} vs AR "
          f"{ar['validity']:.2f}; self-speculative equals AR on {sp['ar_exact']:.0%} of the requests with "
          f"{sp['nfe'] / ar['nfe']:.2f}x AR's forwards ({sp['rejections_per_request']:.1f} rejected drafts per request).")
    pairs = [(r, next(w for w in rows if w["setting"] == r["setting"].replace("self-speculative", "self-spec")
                       + " first waits")) for r in rows[1:5]]
    print("first-token commit (on vs first waits): " + "; ".join(
        f"{a['setting']}: NFE {a['nfe']} vs {b['nfe']}, tok/fwd {a['tokens_per_forward']:.2f} vs "
        f"{b['tokens_per_forward']:.2f}, valid {a['validity']:.2f} vs {b['validity']:.2f}" for a, b in pairs))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "checkpoint": str(ckpt), "machine": platform.platform(),
                               "cpu_count": os.cpu_count(), "rows": rows}, indent=1) + "\n")
    png = out.with_suffix(".png")
    _plot(rows, png)
    print(f"wrote {out} and {png}")


def _plot(rows: list[dict], path: Path) -> None:
    """Bars per setting: ms per token, NFE and validity, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["setting"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, key, title in zip(axes, ("ms_per_token", "nfe", "validity"), ("wall ms / token", "NFE", "validity")):
        ax.bar(range(len(rows)), [r[key] for r in rows], color="tab:blue")
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
