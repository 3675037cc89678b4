"""What a decoding forward costs on a 256-expert MoE: the experts it touches, the bytes it reads, and
the decode speed a roofline predicts from them (issue 44).

At batch 1 decoding is memory bound: a forward reads every weight it uses once, and a block forward
whose tokens route freely touches far more experts than one AR token. Three parts, one JSON:

1. `research`: the research model (models/calibration_study/<B>, learned routing, 8 experts top 2)
   on held-out tool_task prompts, teacher-forced: per forward of batch 1 the distinct experts per MoE
   layer of an AR step (one answer token), a block step (the answer's blocks as canvases with 100 /
   75 / 50 / 25 % of their positions masked), and a commit pass (the block's tokens, clean stream),
   with the block coreset off and at each C (`model.moe_block_coreset`).
2. `random_35b`: the Qwen3.6-35B-A3B / Clover config (256 experts, top 8) with random router logits
   (iid normal: the independent-routing case; learned routing correlates within a block and touches
   fewer): distinct experts per layer at batch 1 and 8 for AR, a free block step, a block step with
   C = 8 / 16 / 32 / 64, and a commit pass (a free 32-token forward).
3. `roofline`: per chip (H100, H200, v5p; train/roofline.py's peaks) and batch (1, 8) the bytes per
   forward (bf16 weights read once: the dense part, the lm_head, the touched experts; the GDN states
   and the KV cache at `--context` tokens), its time max(bytes / HBM bandwidth, FLOPs / peak), and
   tokens/s: AR at one token per forward; block decoding at the tokens per forward the calibration
   study measured (its `measured.json`, threshold 0.9 and 0.95, the block-32 models) plus a commit
   pass per block. Anchors beside it: the AR physical limit (active bytes / bandwidth) and Clover's
   reported 515 tokens/s on one H200 at batch 1. A PREDICTION from byte counts, not a measurement.

    python bench/decode_cost.py --out bench/results/decode_cost.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clover_jax.config import FULL, LINEAR, ModelConfig, get_preset, param_count  # noqa: E402
from clover_jax.model import moe_coreset  # noqa: E402
from clover_jax.model.moe import route  # noqa: E402
from train.roofline import CHIPS  # noqa: E402

CLOVER_REPORTED_TOKS = 515.0  # Clover's reported decode speed on one H200 at batch 1 (as issue 44 cites it)
MASK_LEVELS = (1.0, 0.75, 0.5, 0.25)


# -------------------------------------------------------------------------------------- research
def _examples(model_dir: Path, n: int, bfcl: str):
    """Held-out tool_task prompts with their reference answers, in the model's own tokenizer."""
    from clover_jax.bridge.tokenizer import load_tokenizer
    from clover_jax.decoding.calibrate import build_examples
    from sft.config import load_sft_config
    from sft.data.converters import resolve_options
    from sft.data.tool_task import generate_records, schemas_from_options

    recipe = load_sft_config(ROOT / "configs/research_tool.yaml")
    src = next(s for s in recipe.data.sources if s.format == "tool_task")
    schemas = schemas_from_options(bfcl, resolve_options("tool_task", src.options, "research_tool.yaml"))
    tok = load_tokenizer(model_dir)
    return build_examples(tok, generate_records(n, 1, "heldout", schemas))


def _distinct(counts_LE: jax.Array, moe_layers: int) -> float:
    """Mean over MoE layers of the experts with at least one assignment."""
    return float(jnp.sum(counts_LE > 0)) / moe_layers


def research_touch(model_dir: Path, n: int, coresets: list[int], bfcl: str, seed: int = 0) -> dict:
    """Distinct experts per MoE layer per forward (batch 1) on the research model, teacher-forced."""
    from clover_jax.api import load_hf

    examples = _examples(model_dir, n, bfcl)
    out: dict = {"model": str(model_dir.relative_to(ROOT)), "prompts": len(examples), "by_coreset": {}}
    for c in [None] + coresets:
        cfg, model = load_hf(model_dir, moe_block_coreset=c)
        bk, layers = cfg.block_sizes[0], cfg.num_hidden_layers
        mask = cfg.mask_token_id
        # fixed shapes (one compile each): a cache of max_len slots, the prompt fed one token at a time
        ext = jax.jit(lambda ids, cache: model.extend(ids, cache, return_stats=True))
        step = jax.jit(lambda ids, cache: model.block_step(ids, cache, return_stats=True)[1]["expert_counts"])
        max_len = max(len(e.prompt_ids) + len(e.reference_ids) for e in examples)
        rng = np.random.default_rng(seed)
        ar, commit, blocks = [], [], {f: [] for f in MASK_LEVELS}
        for ex in examples:
            answer = ex.reference_ids[: len(ex.reference_ids) // bk * bk]  # whole blocks only
            if not answer:
                continue
            cache = model.init_cache(1, max_len)
            for t in ex.prompt_ids:
                _, cache, _ = ext(jnp.asarray([[t]], jnp.int32), cache)
            if c is None:  # AR routes freely: once
                ar_cache = cache
                for t in answer:
                    _, ar_cache, st = ext(jnp.asarray([[t]], jnp.int32), ar_cache)
                    ar.append(_distinct(st["expert_counts"], layers))
            for s0 in range(0, len(answer), bk):
                blk = np.asarray(answer[s0:s0 + bk], np.int32)
                for f in MASK_LEVELS:
                    masked = rng.permutation(bk)[: max(1, round(f * bk))]
                    canvas = blk.copy()
                    canvas[masked] = mask
                    blocks[f].append(_distinct(step(jnp.asarray(canvas[None]), cache), layers))
                _, cache, st = ext(jnp.asarray(blk[None]), cache)
                commit.append(_distinct(st["expert_counts"], layers))
        row = {"block_step": {str(f): float(np.mean(v)) for f, v in blocks.items()},
               "block_step_mean": float(np.mean([x for v in blocks.values() for x in v])),
               "commit": float(np.mean(commit)), "blocks": len(commit)}
        if c is None:
            row["ar"] = float(np.mean(ar))
            out.update(experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, block_size=bk,
                       independent_block_expectation=_independent(cfg.num_experts, cfg.num_experts_per_tok, bk))
        out["by_coreset"]["off" if c is None else str(c)] = row
        print(f"  research C={c or 'off'}: {row}", flush=True)
    return out


# -------------------------------------------------------------------------------------- random 35B
def _independent(e: int, k: int, tokens: int) -> float:
    """Expected distinct experts of `tokens` tokens each picking k of e uniformly (no repeats)."""
    return e * (1.0 - (1.0 - k / e) ** tokens)


def random_touch(cfg: ModelConfig, block: int, coresets: list[int], trials: int, seed: int = 0) -> dict:
    """Distinct experts per layer for one forward, random router logits, batch 1 and 8."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    key = jax.random.PRNGKey(seed)
    out: dict = {"experts": e, "top_k": k, "block_size": block, "trials": trials}
    for batch in (1, 8):
        key, sub = jax.random.split(key)
        logits = jax.random.normal(sub, (trials, batch, block, e))
        valid = jnp.ones((batch, block), bool)

        def distinct(c: int | None, tokens: int) -> float:
            def one(lg):
                allowed = None if c is None else (lambda p: moe_coreset.restrict(p, valid[:, :tokens], c, tokens))
                _, _, ex = route(lg[:, :tokens], k, allowed)
                return jnp.sum(jnp.zeros((e,), jnp.int32).at[ex.reshape(-1)].add(1) > 0)
            return float(jnp.mean(jax.vmap(one)(logits)))

        row = {"ar": distinct(None, 1), "block_free": distinct(None, block), "commit": distinct(None, block)}
        row |= {f"block_c{c}": distinct(c, block) for c in coresets}
        row["independent_ar"] = _independent(e, k, batch)
        row["independent_block"] = _independent(e, k, batch * block)
        out[f"batch{batch}"] = row
        print(f"  35B random routing, batch {batch}: {row}", flush=True)
    return out


# -------------------------------------------------------------------------------------- roofline
def _moe_layer_params(cfg: ModelConfig) -> tuple[int, int]:
    """(params of one routed expert, routed-expert params of one layer)."""
    one = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return one, one * cfg.num_experts


def forward_cost(cfg: ModelConfig, experts_per_layer: float, tokens: int, context: int, batch: int,
                 writes_state: bool) -> dict:
    """Bytes and FLOPs of one decoding forward of `tokens` new tokens per row (bf16 weights read once
    per forward; the embedding is a gather and not counted)."""
    d, v, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    one_expert, experts_all = _moe_layer_params(cfg)
    embed = v * d
    head = v * d  # tied or not, the logits read a [D, V] matrix
    dense = param_count(cfg) - layers * experts_all - embed - (0 if cfg.tie_word_embeddings else head)
    n_gdn = sum(t == LINEAR for t in cfg.layer_types)
    n_attn = sum(t == FULL for t in cfg.layer_types)
    state = n_gdn * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    kv_per_token = n_attn * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    bytes_ = 2 * (dense + head + experts_per_layer * layers * one_expert)
    bytes_ += batch * (state * (2 if writes_state else 1) + kv_per_token * (context + tokens))
    active = dense + head + cfg.num_experts_per_tok * layers * one_expert
    flops = 2 * active * tokens * batch
    flops += batch * tokens * n_attn * 4 * cfg.num_attention_heads * cfg.head_dim * (context + tokens)
    return {"bytes": bytes_, "flops": flops}


def _time(cost: dict, chip) -> float:
    return max(cost["bytes"] / chip.hbm_bandwidth, cost["flops"] / chip.peak_flops)


def measured_tpf(block: int) -> dict[str, float]:
    """Tokens per forward of the calibration study's block-`block` models at their own block size."""
    out = {}
    for name in (str(block), "mix"):
        path = ROOT / "models/calibration_study" / name / "measured.json"
        if not path.is_file():
            continue
        for r in json.loads(path.read_text())["rows"]:
            if (r["mode"] == "threshold" and r["block_size"] == block and r["gamma"] == "learned"
                    and r["threshold"] in (0.9, 0.95)):
                # the first row of a setting: the study's report reads the same one
                out.setdefault(f"trained {name}, threshold {r['threshold']}", float(r["tokens_per_forward"]))
    return out


def roofline_table(cfg: ModelConfig, touch: dict, coresets: list[int], tpf: dict[str, float], context: int) -> list[dict]:
    block = touch["block_size"]
    rows = []
    one_expert, _ = _moe_layer_params(cfg)
    for batch in (1, 8):
        t = touch[f"batch{batch}"]
        ar = forward_cost(cfg, t["ar"], 1, context, batch, True)
        commit = forward_cost(cfg, t["commit"], block, context, batch, True)
        steps = {"free": forward_cost(cfg, t["block_free"], block, context, batch, False)}
        steps |= {f"C={c}": forward_cost(cfg, t[f"block_c{c}"], block, context, batch, False) for c in coresets}
        for name, chip in (("h100", CHIPS["h100"]), ("h200", CHIPS["h200"]), ("v5p", CHIPS["v5p"])):
            ar_s = _time(ar, chip)
            row = {"chip": chip.name, "batch": batch, "ar_ms": 1e3 * ar_s, "ar_gb": ar["bytes"] / 1e9,
                   "ar_tok_s": batch / ar_s, "commit_ms": 1e3 * _time(commit, chip), "commit_gb": commit["bytes"] / 1e9}
            for s, cost in steps.items():
                step_s = _time(cost, chip)
                row[f"block_{s}_ms"] = 1e3 * step_s
                row[f"block_{s}_gb"] = cost["bytes"] / 1e9
                for label, x in tpf.items():
                    per_block = block / x * step_s + _time(commit, chip)
                    row[f"block_{s}_tok_s @ {x:.2f} tpf ({label})"] = batch * block / per_block
            rows.append(row)
    active = forward_cost(cfg, cfg.num_experts_per_tok, 1, 0, 1, False)
    for r in rows:
        if r["batch"] == 1:  # the active weights once per token, no cache: the AR floor of one row
            chip = next(c for c in CHIPS.values() if c.name == r["chip"])
            r["ar_limit_tok_s"] = chip.hbm_bandwidth / active["bytes"]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--research-model", default="models/calibration_study/32")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--bfcl", default=str(ROOT.parent / "shared/data/bfcl/BFCL_v4_simple_python.json"))
    p.add_argument("--coresets", default="8,16,32,64", help="C values for the 35B config")
    p.add_argument("--research-coresets", default="2,4", help="C values for the research model (8 experts)")
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--context", type=int, default=4096, help="KV-cache tokens per row in the roofline")
    p.add_argument("--skip-research", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    coresets = [int(x) for x in a.coresets.split(",")]
    big = get_preset("clover-35b-a3b")
    result: dict = {"context": a.context}
    if not a.skip_research:
        print("research model (learned routing), teacher-forced canvases:", flush=True)
        result["research"] = research_touch(ROOT / a.research_model, a.prompts,
                                            [int(x) for x in a.research_coresets.split(",")], a.bfcl)
    print("35B config, random routing:", flush=True)
    result["random_35b"] = random_touch(big, big.block_sizes[0], coresets, a.trials)
    tpf = measured_tpf(big.block_sizes[0])
    result["tokens_per_forward"] = tpf
    result["roofline"] = roofline_table(big, result["random_35b"], coresets, tpf, a.context)
    active = forward_cost(big, big.num_experts_per_tok, 1, 0, 1, False)["bytes"]
    result["anchors"] = {"active_weight_gb_per_ar_forward": active / 1e9,
                         "ar_limit_tok_s_h200_batch1": CHIPS["h200"].hbm_bandwidth / active,
                         "clover_reported_tok_s_h200_batch1": CLOVER_REPORTED_TOKS}
    _print(result, coresets)
    result["wall_s"] = time.perf_counter() - t0
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        _plot(result, coresets, Path(a.out).with_suffix(".png"))
        print(f"wrote {a.out} and {Path(a.out).with_suffix('.png')}")
    return 0


def _print(result: dict, coresets: list[int]) -> None:
    rnd = result["random_35b"]
    print("\ndistinct experts per MoE layer per forward (35B, random routing)")
    print("| batch | AR | block free | " + " | ".join(f"block C={c}" for c in coresets) + " | commit |")
    print("|---|---|---|" + "---|" * len(coresets) + "---|")
    for b in (1, 8):
        t = rnd[f"batch{b}"]
        print(f"| {b} | {t['ar']:.1f} | {t['block_free']:.1f} | "
              + " | ".join(f"{t[f'block_c{c}']:.1f}" for c in coresets) + f" | {t['commit']:.1f} |")
    if "research" in result:
        r = result["research"]
        print(f"\nresearch model ({r['experts']} experts, top {r['top_k']}, block {r['block_size']}; independent "
              f"routing would touch {r['independent_block_expectation']:.2f} per block):")
        for c, row in r["by_coreset"].items():
            ar = f"AR {row['ar']:.2f}, " if "ar" in row else ""
            print(f"  coreset {c}: {ar}block step {row['block_step_mean']:.2f} (by masked share "
                  f"{row['block_step']}), commit {row['commit']:.2f}")
    tpf = result["tokens_per_forward"]
    label = next(iter(tpf), None)
    print(f"\npredicted decode tokens/s (a roofline PREDICTION from bytes; block decoding at {tpf.get(label, 0):.2f} "
          f"tokens per forward = {label}, plus one free commit pass per block; every setting in the JSON)")
    print("| chip | batch | AR | block free | " + " | ".join(f"block C={c}" for c in coresets)
          + " | GB per forward: AR / free step / commit |")
    print("|---|---|---|---|" + "---|" * len(coresets) + "---|")
    for r in result["roofline"]:
        cells = [f"{r[f'block_{s}_tok_s @ {tpf[label]:.2f} tpf ({label})']:.0f}" for s in
                 ["free"] + [f"C={c}" for c in coresets]] if label else []
        print(f"| {r['chip']} | {r['batch']} | {r['ar_tok_s']:.0f} | " + " | ".join(cells)
              + f" | {r['ar_gb']:.1f} / {r['block_free_gb']:.1f} / {r['commit_gb']:.1f} |")
    print(f"\nanchors: {result['anchors']}")


def _plot(result: dict, coresets: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["roofline"] if r["chip"] == CHIPS["h200"].name]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        names = ["AR"] + ["free"] + [f"C={c}" for c in coresets]
        gb = [r["ar_gb"], r["block_free_gb"]] + [r[f"block_C={c}_gb"] for c in coresets]
        ax[0].plot(names, gb, marker="o", label=f"batch {r['batch']}")
        keys = [k for k in r if "tok_s @" in k and "threshold 0.9)" in k and "trained 32" in k]
        if keys:
            suffix = keys[0].split(" @ ", 1)[1]
            toks = [r["ar_tok_s"]] + [r[f"block_{s}_tok_s @ {suffix}"] for s in ["free"] + [f"C={c}" for c in coresets]]
            ax[1].plot(names, toks, marker="o", label=f"batch {r['batch']}")
    ax[0].set_ylabel("GB read per forward (H200)")
    ax[1].set_ylabel("predicted tokens/s (H200)")
    ax[1].axhline(CLOVER_REPORTED_TOKS, color="gray", ls="--", label="Clover reported (batch 1)")
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    fig.suptitle("35B decoding per forward: AR vs block step (free / coreset C); a roofline prediction")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
