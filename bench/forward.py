"""Forward and forward+backward throughput: our JAX model vs transformers' torch model, same config,
same CPU, side by side. Prints a table with ratios and the fraction of measured matmul peak.

    python bench/forward.py                       # small-cpu preset, batch 4 x 512
    python bench/forward.py --batch 2 --seq 256 --repeats 3
    python bench/forward.py --loss naive          # full-logits log_softmax + gather on both sides
    python bench/forward.py --scan both           # scanned and unrolled stacks beside torch
    python bench/forward.py --breakdown           # + the per-module table

fwd+bwd loss (`--loss`): `chunked` (default) is each library's own training CE: ours the chunked
CE with its fused backward that the AR and SFT steps use (`sft.loss.weighted_ce`), torch's
`F.cross_entropy` (what transformers' loss calls); `naive` is a hand-written full-logits
log_softmax + gather on both sides. The torch side runs in its own (worker) process, alternating
with ours round by round; the ratios are medians of per-round ratios.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # sft.loss

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from clover_jax.config import get_preset  # noqa: E402
from clover_jax.model.clover_model import create_model  # noqa: E402
from common import chunked_ce, timeit  # noqa: E402  (bench/ is on sys.path: the script's folder)


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    t = timeit(lambda: f(a).block_until_ready(), repeats)
    return 2 * n**3 / t


def model_flops_per_token(cfg, seq: int) -> float:
    """Matmul FLOPs of one forward per token (active params x 2 + attention scores), the usual MFU count."""
    d = cfg.hidden_size
    active = 0
    for t in cfg.layer_types:
        if t == "full_attention":
            active += d * cfg.num_attention_heads * cfg.head_dim * 3 + 2 * d * cfg.num_key_value_heads * cfg.head_dim
            active += seq * cfg.num_attention_heads * cfg.head_dim  # QK^T and PV, causal half of 2*T
        else:
            active += d * (cfg.gdn_conv_channels + cfg.gdn_value_dim + 2 * cfg.linear_num_value_heads)
            active += cfg.gdn_value_dim * d
            active += 2 * cfg.gdn_chunk_size * cfg.linear_num_value_heads * cfg.linear_key_head_dim  # intra-chunk
            active += 2 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        active += d * cfg.num_experts + 3 * d * cfg.moe_intermediate_size * cfg.num_experts_per_tok
        active += 3 * d * cfg.shared_expert_intermediate_size
    active += d * cfg.vocab_size
    return 2.0 * active


def jax_loss(m, x, loss: str):
    """Mean next-token CE of ids x [B, T] (see the module docstring for `loss`)."""
    if loss == "naive":
        lp = jax.nn.log_softmax(m(x[:, :-1]), axis=-1)
        return -jnp.mean(jnp.take_along_axis(lp, x[:, 1:, None], axis=-1))
    return chunked_ce(m, m.hidden_states(x[:, :-1])[0], x[:, 1:])


def jax_steps(cfg, ids_np, loss="chunked"):
    """(fwd, fwd+bwd) of our model as zero-argument callables that block until done (the first call
    compiles)."""
    model = create_model(cfg)
    ids = jnp.asarray(ids_np)

    @nnx.jit
    def fwd(m, x):
        return m(x)

    def loss_fn(m, x):
        return jax_loss(m, x, loss)

    @nnx.jit
    def fwd_bwd(m, x):
        return nnx.value_and_grad(loss_fn)(m, x)

    return (lambda: fwd(model, ids).block_until_ready()), (lambda: jax.block_until_ready(fwd_bwd(model, ids)))


def torch_steps(cfg, ids_np, loss="chunked"):
    """(fwd, fwd+bwd) of transformers' model of the same config, as zero-argument callables."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    hf = Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
    hf._attn_implementation = "sdpa"
    model = Qwen3_5MoeForCausalLM(hf).float()
    ids = torch.tensor(ids_np)

    def fwd():
        with torch.no_grad():
            model(ids)

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        out = model(ids[:, :-1], labels=None)
        if loss == "naive":
            lp = torch.log_softmax(out.logits, -1)
            value = -lp.gather(-1, ids[:, 1:, None]).mean()
        else:
            value = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]),
                                                      ids[:, 1:].reshape(-1))
        value.backward()

    return fwd, fwd_bwd


# The torch worker process's model (set once by its pool initializer; lives only in that process).
_WORKER: dict = {}


def _torch_worker_init(cfg, ids_np, loss) -> None:
    _WORKER["steps"] = torch_steps(cfg, ids_np, loss)


def _torch_worker_time(repeats: int, fwd_only: bool) -> tuple[float, float, int]:
    import torch

    fwd, fwd_bwd = _WORKER["steps"]
    return timeit(fwd, repeats), (float("nan") if fwd_only else timeit(fwd_bwd, repeats)), torch.get_num_threads()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3, help="timings per round (best kept)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of ours and torch's")
    ap.add_argument("--moe-impl", default=None, help="override cfg.moe_impl (ragged|dense)")
    ap.add_argument("--scan", choices=("auto", "on", "off", "both"), default="auto",
                    help="layer stack loop: auto = what `launch.py sft` picks here (unrolled on CPU, "
                         "sft.recipe.platform_scan_default), on = lax.scan, off = unrolled, both = side by side")
    ap.add_argument("--loss", choices=("chunked", "naive"), default="chunked",
                    help="fwd+bwd loss: each library's training CE, or full-logits log_softmax + gather")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--fwd-only", action="store_true", help="skip fwd+bwd")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print fwd and fwd+bwd per module (bench/forward_breakdown.py), ours vs torch")
    args = ap.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")
    cfg = get_preset(args.preset)
    if args.moe_impl:
        cfg = cfg.replace(moe_impl=args.moe_impl)
    if args.scan == "auto":
        from sft.config import ModelSpec
        from sft.recipe import platform_scan_default

        variants = [platform_scan_default(cfg, ModelSpec(), jax.default_backend())]
    else:
        variants = [cfg.replace(scan_layers=v) for v in {"on": (True,), "off": (False,), "both": (True, False)}[args.scan]]
    cfg = variants[-1]
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (args.batch, args.seq))
    ntok = args.batch * args.seq
    peak = matmul_peak_flops()
    flops_tok = model_flops_per_token(cfg, args.seq)
    print(f"config {args.preset}: hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers} "
          f"({cfg.layer_types.count('linear_attention')} GDN), experts {cfg.num_experts} top-{cfg.num_experts_per_tok}, "
          f"vocab {cfg.vocab_size}; batch {args.batch} x {args.seq}; moe_impl {cfg.moe_impl}; loss {args.loss}")
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s ({jax.device_count()} JAX CPU device(s))")
    names = [f"clover_jax ({'scanned' if v.scan_layers else 'unrolled'})" for v in variants]
    ours = [jax_steps(v, ids, args.loss) for v in variants]
    # Rounds alternate ours and torch's (a worker process that keeps its model), so both sides see the
    # same minutes of a noisy host: each round's ratios are of neighbouring measurements.
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    torch_name = "transformers (torch)"
    pool = None if args.skip_torch else mp.get_context("spawn").Pool(1, _torch_worker_init, (cfg, ids, args.loss))
    try:
        for r in range(args.rounds):
            for n, (f, fb) in zip(names, ours):
                times[n].append((timeit(f, args.repeats), float("nan") if args.fwd_only else timeit(fb, args.repeats)))
            if pool is not None:
                t_f, t_fb, threads = pool.apply(_torch_worker_time, (args.repeats, args.fwd_only))
                torch_name = f"transformers (torch, {threads} threads)"
                times.setdefault(torch_name, []).append((t_f, t_fb))
            print(f"round {r + 1}/{args.rounds}: " + "; ".join(
                f"{n} {ntok / t[-1][0]:.0f} / {ntok / t[-1][1]:.0f}" for n, t in times.items()) + " tok/s (fwd / fwd+bwd)",
                flush=True)
    finally:
        if pool is not None:
            pool.close()
    print(f"\n{'impl (median of ' + str(args.rounds) + ' rounds)':<36} {'fwd tok/s':>10} {'fwd+bwd tok/s':>14} "
          f"{'fwd+bwd % peak':>15} {'fwd x torch':>22} {'fwd+bwd x torch':>22}")
    ref = times.get(torch_name)
    for n, t in times.items():
        f, fb = (float(np.median([x[i] for x in t])) for i in (0, 1))
        cols = ""
        if ref is not None and n != torch_name:
            # per-round ratios of neighbouring measurements: median [min, max]
            rs = [[b[i] / a[i] for a, b in zip(t, ref)] for i in (0, 1)]
            cols = "".join(f" {np.median(x):>8.2f}x [{min(x):.2f}, {max(x):.2f}]" for x in rs)
        print(f"{n:<36} {ntok / f:>10.0f} {ntok / fb:>14.0f} {100 * 3 * flops_tok * ntok / fb / peak:>14.1f}%{cols}")
    if args.breakdown:
        from forward_breakdown import print_breakdown

        print_breakdown(cfg, ids, args.repeats, args.skip_torch)


if __name__ == "__main__":
    main()
