"""Throughput and MFU of the SFT train step (two streams, noise, complementary copies, chunked CE)
against the AR train step (clean stream, next-token chunked CE) of the same model, side by side.

FLOPs per step come from the compiler (`jax.jit(...).lower(...).compile().cost_analysis()`); the
peak is measured in the same run with a large fp32 matmul, so MFU = FLOPs / step time / that peak.
XLA's cost analysis counts a while-loop body once, so the step is compiled with the layer stack
unrolled (`scan_layers=False`) for the count; the rows "flops (scanned)" show what the scanned
compile reports. The step is timed with the layer loop `launch.py sft` uses on this backend
(`sft.recipe.platform_scan_default`: unrolled on CPU). Tokens/s counts the tokens of the drawn rows (the SFT step runs each row twice:
mask and complement).

    python bench/train_step.py                      # small-cpu, 2 x 512, block 32
    python bench/train_step.py --preset tiny-qwen3.6 --batch 2 --seq 512 --block 16 --chunk 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from clover_jax.config import get_preset  # noqa: E402
from clover_jax.model.clover_model import create_model, model_to_params  # noqa: E402
from sft.loss import LossConfig, ar_targets, make_sft_loss, weighted_ce  # noqa: E402
from sft.config import ModelSpec  # noqa: E402
from sft.noise import NoiseConfig  # noqa: E402
from sft.recipe import platform_scan_default  # noqa: E402
from train.config import OptimizerConfig  # noqa: E402
from train.optimizer import build_optimizer  # noqa: E402
from train.state import init_train_state  # noqa: E402
from train.step import make_train_step  # noqa: E402


def measured_peak(n: int = 2048, repeats: int = 3) -> float:
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    jax.block_until_ready(mm(a))
    best = min(_timed(lambda: mm(a)) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def make_batch(rng: np.random.Generator, b: int, t: int, vocab: int, loss_frac: float) -> dict[str, np.ndarray]:
    """One document per row: a prompt, then `loss_frac` of the row as the response (loss tokens)."""
    ids = rng.integers(4, vocab, (b, t)).astype(np.int32)
    lm = np.zeros((b, t), bool)
    lm[:, int(t * (1 - loss_frac)):] = True
    return {"input_ids": ids, "segment_ids": np.ones((b, t), np.int32),
            "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(), "loss_mask": lm}


def ar_loss_fn(graphdef, chunk: int):
    def loss_fn(params, batch, rng):
        del rng
        m = nnx.merge(graphdef, params)
        h, aux = m.hidden_states(batch["input_ids"], batch["positions"], batch["segment_ids"])
        tgt, mask = ar_targets(batch["input_ids"], batch["loss_mask"], batch["segment_ids"])
        n = jnp.maximum(jnp.sum(mask), 1)
        w = m.lm_head.kernel[...] if not m.cfg.tie_word_embeddings else m.embed.embedding[...].T
        s = weighted_ce(h, w, tgt, mask / n, mask, chunk_tokens=chunk)
        return s[0] + 1e-3 * aux["lb_loss"], {"weight": n.astype(jnp.float32), "acc": s[2] / n,
                                               "tokens": jnp.sum(batch["segment_ids"] > 0)}
    return loss_fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-cpu")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=1024, help="loss.chunk_tokens")
    ap.add_argument("--loss-frac", type=float, default=0.3, help="share of each row that is response")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/train_step.json")
    args = ap.parse_args()
    cfg = get_preset(args.preset).replace(mode="block", mask_token_id=3, block_size=args.block)
    rng = np.random.default_rng(0)
    batch = {k: jnp.asarray(v) for k, v in make_batch(rng, args.batch, args.seq, cfg.vocab_size, args.loss_frac).items()}
    opt = build_optimizer(OptimizerConfig(lr=1e-4), 100)
    peak = measured_peak()
    production_scan = platform_scan_default(cfg, ModelSpec(), jax.default_backend()).scan_layers
    rows = {}
    for name in ("ar", "sft"):
        res = {}
        for scan in (False, True):
            c = cfg.replace(scan_layers=scan)
            model = create_model(c, 0)
            graphdef, _ = nnx.split(model)
            if name == "sft":
                loss = make_sft_loss(graphdef, block_size=args.block, mask_token_id=3, noise=NoiseConfig(),
                                     loss=LossConfig(chunk_tokens=args.chunk), lb_coef=1e-3, end_pad_id=4)
            else:
                loss = ar_loss_fn(graphdef, args.chunk)
            step = make_train_step(loss, opt)
            state = init_train_state(model_to_params(model), opt)
            t0 = time.perf_counter()
            compiled = step.lower(state, batch).compile()
            compile_s = time.perf_counter() - t0
            ca = compiled.cost_analysis()
            ca = ca[0] if isinstance(ca, (list, tuple)) else ca
            res["flops_scanned" if scan else "flops"] = float(ca.get("flops", 0.0))
            if scan == production_scan:  # time the loop `launch.py sft` uses on this backend
                state, _ = compiled(state, batch)
                jax.block_until_ready(state)
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    state, m = compiled(state, batch)
                    jax.block_until_ready((state, m))
                    times.append(time.perf_counter() - t0)
                res.update(step_s=min(times), compile_s=compile_s)
        res["tokens_per_s"] = args.batch * args.seq / res["step_s"]
        res["mfu"] = res["flops"] / res["step_s"] / peak
        rows[name] = res
    print(f"{args.preset}: batch {args.batch} x {args.seq} (response share {args.loss_frac}), block {args.block}, "
          f"chunk {args.chunk}; {cfg.num_hidden_layers} layers, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}, "
          f"vocab {cfg.vocab_size}; backend {jax.default_backend()}, {os.cpu_count()} CPUs")
    print(f"measured peak (fp32 2048^3 matmul): {peak / 1e9:.1f} GFLOP/s\n")
    print(f"{'step':<6} {'step ms':>9} {'tokens/s':>10} {'GFLOP/step':>11} {'(scanned)':>10} {'MFU':>7} {'compile s':>10}")
    for name, r in rows.items():
        print(f"{name:<6} {1e3 * r['step_s']:>9.1f} {r['tokens_per_s']:>10.0f} {r['flops'] / 1e9:>11.2f} "
              f"{r['flops_scanned'] / 1e9:>10.2f} {100 * r['mfu']:>6.1f}% {r['compile_s']:>10.1f}")
    ratio = {k: rows["sft"][k] / rows["ar"][k] for k in ("step_s", "tokens_per_s", "flops", "mfu")}
    print(f"\nsft / ar: step time {ratio['step_s']:.2f}x, tokens/s {ratio['tokens_per_s']:.2f}x, "
          f"FLOPs {ratio['flops']:.2f}x, MFU {ratio['mfu']:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "peak_flops": peak, "rows": rows, "ratio": ratio,
                               "load_avg": os.getloadavg()}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
