"""Cost of the two-stream (block-diffusion) forward+backward relative to the AR forward+backward of the
same model at the same length, side by side in one run, with a per-module breakdown.

The two-stream forward runs every per-token op (projections, MoE, norms, lm_head inputs) on 2T
tokens, attention for the noisy queries over 2T keys, and a second, state-only GDN sweep with
chunks of the block size: about 2x the AR work is expected; much more is waste to find.

    python bench/block_forward.py                         # small-cpu, batch 2 x 512, block 32
    python bench/block_forward.py --batch 1 --seq 1024 --block 16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from clover_jax.config import get_preset  # noqa: E402
from clover_jax.model.clover_model import create_model, shift_predictions  # noqa: E402
from common import best_time  # noqa: E402


def masked_ce(logits, target, mask):
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), target[..., None], -1)[..., 0]
    return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-cpu")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/block_forward.json")
    args = ap.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")
    cfg = get_preset(args.preset).replace(mode="block", mask_token_id=3)
    model = create_model(cfg)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(4, cfg.vocab_size, (args.batch, args.seq)), jnp.int32)
    masked = jnp.asarray(rng.random((args.batch, args.seq)) < 0.5)
    noisy = jnp.where(masked, cfg.mask_token_id, ids)
    seg = jnp.ones(ids.shape, jnp.int32)
    bk = args.block

    def ar_loss(m):
        return masked_ce(m(ids[:, :-1]), ids[:, 1:], jnp.ones(ids[:, 1:].shape, bool))

    def block_loss(m):
        return masked_ce(m.block_logits(ids, noisy, block_size=bk), ids, masked)

    graphdef, params = nnx.split(model, nnx.Param)
    as_fn = lambda loss: jax.jit(lambda p: loss(nnx.merge(graphdef, p)))  # noqa: E731
    fwd = {"ar": as_fn(ar_loss), "two_stream": as_fn(block_loss)}
    fwd_bwd = {k: jax.jit(jax.value_and_grad(lambda p, f=f: f(nnx.merge(graphdef, p))))
               for k, f in {"ar": ar_loss, "two_stream": block_loss}.items()}
    hidden = {
        "ar": jax.jit(lambda p: nnx.merge(graphdef, p).hidden_states(ids)[0]),
        "two_stream": jax.jit(lambda p: shift_predictions(
            *nnx.merge(graphdef, p).two_stream_hidden(ids, noisy, block_size=bk)[:2], seg, bk, True)),
    }
    rows = {}
    for name in ("ar", "two_stream"):
        rows[name] = {
            "backbone_fwd_s": best_time(lambda: hidden[name](params), args.repeats),
            "fwd_s": best_time(lambda: fwd[name](params), args.repeats),
            "fwd_bwd_s": best_time(lambda: fwd_bwd[name](params), args.repeats),
        }
    ntok = args.batch * args.seq
    print(f"{args.preset}: batch {args.batch} x {args.seq}, block {bk}, {cfg.num_hidden_layers} layers, "
          f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}")
    print(f"\n{'path':<12} {'backbone fwd ms':>16} {'loss fwd ms':>12} {'fwd+bwd ms':>11} {'fwd+bwd tok/s':>14}")
    for name, r in rows.items():
        print(f"{name:<12} {1e3 * r['backbone_fwd_s']:>16.1f} {1e3 * r['fwd_s']:>12.1f} "
              f"{1e3 * r['fwd_bwd_s']:>11.1f} {ntok / r['fwd_bwd_s']:>14.0f}")
    ratio = {k: rows["two_stream"][k] / rows["ar"][k] for k in rows["ar"]}
    print(f"\ntwo_stream / ar: backbone fwd {ratio['backbone_fwd_s']:.2f}x, loss fwd {ratio['fwd_s']:.2f}x, "
          f"fwd+bwd {ratio['fwd_bwd_s']:.2f}x (about 2x expected)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "ratio": ratio}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
