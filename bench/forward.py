"""Forward and forward+backward throughput: our JAX model vs transformers' torch model, same config,
same CPU, side by side. Prints a table with ratios and the fraction of measured matmul peak.

    python bench/forward.py                       # small-cpu preset, batch 4 x 512
    python bench/forward.py --batch 2 --seq 256 --repeats 3
    python bench/forward.py --loss naive          # full-logits log_softmax + gather on both sides

fwd+bwd loss (`--loss`): `chunked` (default) is each library's own training CE: ours the chunked
CE with its fused backward that the AR and SFT steps use (`sft.loss.weighted_ce`), torch's
`F.cross_entropy` (what transformers' loss calls); `naive` is a hand-written full-logits
log_softmax + gather on both sides.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # sft.loss

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from clover_jax.config import get_preset  # noqa: E402
from clover_jax.model.clover_model import create_model  # noqa: E402


def timeit(fn, repeats: int) -> float:
    fn()  # warm-up / compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


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


def chunked_ce(m, h_BTD, targets_BT):
    """Mean CE of final-normed hidden states against targets by the library's chunked CE."""
    from sft.loss import weighted_ce

    w = m.embed.embedding[...].T if m.cfg.tie_word_embeddings else m.lm_head.kernel[...]
    mask = jnp.ones(targets_BT.shape, bool)
    return weighted_ce(h_BTD, w, targets_BT, mask / mask.size, mask)[0]


def bench_jax(cfg, ids_np, repeats, fwd_only=False, loss="chunked"):
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

    t_f = timeit(lambda: fwd(model, ids).block_until_ready(), repeats)
    if fwd_only:
        return t_f, float("nan")
    t_fb = timeit(lambda: jax.block_until_ready(fwd_bwd(model, ids)), repeats)
    return t_f, t_fb


def bench_torch(cfg, ids_np, repeats, fwd_only=False, loss="chunked"):
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

    t_fb = float("nan") if fwd_only else timeit(fwd_bwd, repeats)
    return timeit(fwd, repeats), t_fb, torch.get_num_threads()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--moe-impl", default=None, help="override cfg.moe_impl (ragged|dense)")
    ap.add_argument("--no-scan", action="store_true", help="unrolled layer stack (cfg.scan_layers=False)")
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
    if args.no_scan:
        cfg = cfg.replace(scan_layers=False)
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (args.batch, args.seq))
    ntok = args.batch * args.seq
    peak = matmul_peak_flops()
    flops_tok = model_flops_per_token(cfg, args.seq)
    print(f"config {args.preset}: hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers} "
          f"({cfg.layer_types.count('linear_attention')} GDN), experts {cfg.num_experts} top-{cfg.num_experts_per_tok}, "
          f"vocab {cfg.vocab_size}; batch {args.batch} x {args.seq}; moe_impl {cfg.moe_impl}; loss {args.loss}; scan {cfg.scan_layers}")
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s ({jax.device_count()} JAX CPU device(s))")
    t_f, t_fb = bench_jax(cfg, ids, args.repeats, args.fwd_only, args.loss)
    rows = [("clover_jax", t_f, t_fb)]
    if not args.skip_torch:
        tt_f, tt_fb, threads = bench_torch(cfg, ids, args.repeats, args.fwd_only, args.loss)
        rows.append((f"transformers (torch, {threads} threads)", tt_f, tt_fb))
    print(f"\n{'impl':<34} {'fwd tok/s':>11} {'fwd+bwd tok/s':>14} {'fwd+bwd % peak':>15}")
    for name, f, fb in rows:
        mfu = 3 * flops_tok * ntok / fb / peak
        print(f"{name:<34} {ntok / f:>11.0f} {ntok / fb:>14.0f} {100 * mfu:>14.1f}%")
    if len(rows) == 2:
        print(f"\nratio clover_jax / transformers: fwd {rows[1][1] / rows[0][1]:.2f}x, "
              f"fwd+bwd {rows[1][2] / rows[0][2]:.2f}x")
    if args.breakdown:
        from forward_breakdown import print_breakdown

        print_breakdown(cfg, ids, args.repeats, args.skip_torch)


if __name__ == "__main__":
    main()
