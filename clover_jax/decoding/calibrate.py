"""Block-size calibration research (`launch.py calibrate --config F`).

1. Decoding sweep: modes x block sizes x thresholds x sub-block sizes x calibration overrides of the
   history unit, on an eval set of chat records. Per setting: NFE, tokens per forward, steps per
   block, tokens per step, wall time, time to first token, task validity (tool-call JSON parses,
   names an offered function, has its required arguments; a text reply where the reference has
   none), argument accuracy (`metrics.turn_match`: BFCL-style on call turns, the exact reply on
   turns without calls; overall and on the two kinds apart), exact match with the reference turn,
   repetition (repeated 3-gram rate, longest run of one token), agreement with AR greedy decoding
   (an AR baseline row is decoded first) and, where the model reports it, the mean softmax share
   of the history unit per GDN layer.
2. Training-side support: the masked-token loss of the checkpoint per block size at fixed noise
   levels t (the same masks for every block size), and the learned (alpha, beta, gamma) per GDN
   layer and head.

Writes `results.csv`, `results.json` (rows, per-example outputs, loss, scalars, config),
`loss.csv`, `scalars.csv` and PNG plots (`calibrate_plots.py`) under `out_dir`, and prints the
Pareto front of (tokens per forward, quality).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.decoding import metrics as ev
from clover_jax.decoding.generator import (DecodeConfig, DecodeError, Decoder, jsonl_lines, resolve_eos_ids,
                                 resolve_vocab_limit)
from clover_jax.input_file import InputFileError, render_chat


@dataclass(frozen=True)
class EvalSetConfig:
    """`source: synthetic` = held-out records of `sft.data.synthetic` (stream `seed`); `jsonl` = chat
    records from `path`. `tool_calls_only` keeps records whose reference turn calls a tool."""

    source: Literal["synthetic", "jsonl"] = "synthetic"
    path: str | None = None
    n: int = 16
    seed: int = 12345
    tool_calls_only: bool = False


@dataclass(frozen=True)
class CalibOverride:
    """History-unit overrides: alpha * alpha_scale, beta + beta_shift, gamma := gamma (None keeps)."""

    alpha_scale: float = 1.0
    beta_shift: float = 0.0
    gamma: float | None = None


@dataclass(frozen=True)
class SweepConfig:
    modes: tuple[str, ...] = ("threshold",)
    block_sizes: tuple[int, ...] = (4, 8, 16, 32)
    thresholds: tuple[float, ...] = (0.8, 0.9, 0.95, 0.99)
    sub_block_sizes: tuple[int, ...] = (0,)  # 0 = whole block
    calibration: tuple[CalibOverride, ...] = (CalibOverride(),)
    batch_size: int = 8
    quality_metric: Literal["validity", "bfcl_accuracy", "exact_match", "ar_agreement"] = "validity"


@dataclass(frozen=True)
class LossEvalConfig:
    enabled: bool = True
    block_sizes: tuple[int, ...] = (4, 8, 16, 32)
    t_values: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    n: int = 16
    seed: int = 0


@dataclass(frozen=True)
class FitConfig:
    """``calibration``: the split the fit reads (an `EvalSetConfig`-shaped mapping: source, path,
    n, seed); the targets, noise levels and the delta grid of the search."""

    calibration: dict[str, Any] = field(default_factory=dict)
    block_sizes: tuple[int, ...] = (4, 8, 16, 32, 64)
    t_values: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    n: int = 32
    seed: int = 0
    deltas: tuple[float, ...] = (-4.0, -3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0, 4.0)
    refine_steps: int = 8
    write_checkpoints: bool = True


@dataclass(frozen=True)
class CalibrateConfig:
    checkpoint: str = ""
    out_dir: str = "runs/calibrate"
    eval: EvalSetConfig = field(default_factory=EvalSetConfig)
    decode: DecodeConfig = field(default_factory=lambda: DecodeConfig(max_new_tokens=96))
    sweep: SweepConfig = field(default_factory=SweepConfig)
    loss: LossEvalConfig = field(default_factory=LossEvalConfig)
    history_stats: bool = True  # when the model's block_step can report it
    plots: bool = True
    fit: FitConfig = field(default_factory=FitConfig)  # `--fit`: gamma per target block size (calibrate_fit)
    # a results.json of an earlier sweep whose AR decoding this checkpoint shares (its own fitted checkpoints:
    # a fit rewrites only the block-mode scalars, which AR never reads): its AR row and outputs are reused
    ar_baseline: str = ""


def load_calibrate_config(path: str | Path | None, overrides: Sequence[str] = ()) -> CalibrateConfig:
    from clover_jax.yaml_config import load_config

    return load_config(CalibrateConfig, path, list(overrides))


# -- eval set ----------------------------------------------------------------------------------
@dataclass
class EvalExample:
    prompt_ids: list[int]
    reference_ids: list[int]
    reference_calls: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    expects_call: bool
    reference_reply: str = ""  # the reference turn's text (what a turn without calls must say)


RecordGenerator = Callable[[int, int], dict[str, Any]]  # (index, seed) -> one chat record


def eval_records(cfg: EvalSetConfig, locations: list[str] | None = None, *,
                 generate_record: RecordGenerator | None = None) -> list[dict[str, Any]]:
    """The eval records; `locations`, when given, gets each one's `file:line` (for errors).
    `source: synthetic` draws from `generate_record` (the SFT synthetic generator, handed in by the
    caller: decoding must not import the SFT recipe, docs/architecture.md)."""
    locs = locations if locations is not None else []
    if cfg.source == "synthetic":
        if generate_record is None:
            raise DecodeError("eval.source=synthetic needs a record generator (launch.py calibrate passes "
                              "sft.data.synthetic.generate_record); use eval.source=jsonl with eval.path otherwise")
        out, i = [], 0
        while len(out) < cfg.n and i < 100 * cfg.n + 100:
            rec = generate_record(i, cfg.seed)
            i += 1
            if cfg.tool_calls_only and not ev.reference_calls(ev.split_record(rec)[1]):
                continue
            out.append(rec)
            locs.append(f"synthetic eval record {i - 1}")
        return out
    if not cfg.path:
        raise DecodeError("eval.path: required with eval.source=jsonl")
    out = []
    for p, n, rec in jsonl_lines(cfg.path, "eval.path"):
        try:
            _, answer, _ = ev.split_record(rec)
        except ValueError as e:
            raise InputFileError(f"{p}:{n}: {e}") from None
        if answer is None or (cfg.tool_calls_only and not ev.reference_calls(answer)):
            continue
        out.append(rec)
        locs.append(f"{p}:{n}")
        if len(out) >= cfg.n:
            break
    return out


def build_examples(tok, records: list[dict[str, Any]], locations: list[str] | None = None) -> list[EvalExample]:
    """Prompt ids (rendered up to the first assistant turn) and the reference turn's ids (to its
    closing `<|im_end|>`). A record the chat template refuses is an InputFileError naming its
    `locations` entry."""
    out = []
    for i, rec in enumerate(records):
        prompt, answer, tools = ev.split_record(rec)
        if answer is None:
            continue
        where = locations[i] if locations else f"eval record {i}"
        p_text = render_chat(tok, where, prompt, tools, add_generation_prompt=True)
        full = render_chat(tok, where, prompt + [answer], tools)
        target = full[len(p_text):] if full.startswith(p_text) else ""
        end = target.find("<|im_end|>")
        target = target[: end + len("<|im_end|>")] if end >= 0 else target
        calls = ev.reference_calls(answer)
        out.append(EvalExample(tok.encode(p_text, add_special_tokens=False),
                               tok.encode(target, add_special_tokens=False), calls, tools, bool(calls),
                               answer.get("content") or ""))
    return out


# -- one setting -------------------------------------------------------------------------------
def _metrics(tok, ex: EvalExample, ids: list[int], eos: Sequence[int], ar_ids: list[int] | None) -> dict[str, Any]:
    body = [t for t in ids if t not in eos]
    text = tok.decode(body, skip_special_tokens=False)
    validity = ev.tool_call_validity(text, ex.tools, ex.expects_call)
    ref_body = [t for t in ex.reference_ids if t not in eos]
    return {"text": text, "call": ex.expects_call, "valid": float(validity["valid"]),
            "bfcl": float(ev.turn_match(text, ex.reference_calls, ex.reference_reply)),
            "exact": float(body == ref_body), "rep3": ev.repeated_ngram_rate(ids, 3),
            "run": ev.longest_repeated_run(ids),
            "ar_agree": ev.ar_agreement(ids, ar_ids) if ar_ids is not None else 1.0,
            "ar_exact": float(ar_ids is None or ids == ar_ids)}


def run_setting(model, tok, examples: list[EvalExample], dcfg: DecodeConfig, eos: Sequence[int],
                batch_size: int, ar_outputs: list[list[int]] | None, history: bool) -> tuple[dict, list[dict]]:
    """Decodes every example with `dcfg`; returns (aggregate row, per-example records)."""
    decoder = Decoder(model, dcfg.replace(history_stats=history), eos_ids=eos,
                      vocab_limit=resolve_vocab_limit(dcfg, model.cfg, tok))
    gens, wall, ttft, hist, pos = [], 0.0, [], [], []
    for s in range(0, len(examples), batch_size):
        out = decoder.generate([e.prompt_ids for e in examples[s: s + batch_size]])
        gens += out.generations
        wall += out.stats["wall_s"]
        ttft.append(out.stats["ttft_s"])
        if "history_share" in out.stats:
            hist.append(out.stats["history_share"])
            pos.append((out.stats["history_share_by_position"], out.stats["history_tokens_by_position"]))
    per = []
    for i, (ex, g) in enumerate(zip(examples, gens)):
        m = _metrics(tok, ex, g.token_ids, eos, ar_outputs[i] if ar_outputs is not None else None)
        per.append({"index": i, "token_ids": g.token_ids, "finish_reason": g.finish_reason,
                    **{k: g.stats[k] for k in ("nfe", "tokens", "tokens_per_forward", "denoise_steps", "blocks")},
                    **m})
    calls, talk = [p for p in per if p["call"]], [p for p in per if not p["call"]]
    tokens = sum(p["tokens"] for p in per)
    nfe = sum(p["nfe"] for p in per)
    steps = sum(g.stats["denoise_steps"] for g in gens)
    blocks = sum(g.stats["blocks"] for g in gens)
    ar_mode = dcfg.mode == "ar"
    row = {
        "mode": dcfg.mode, "block_size": decoder.block if not ar_mode else 1, "threshold": dcfg.threshold,
        "sub_block_size": dcfg.sub_block_size or 0, "alpha_scale": dcfg.alpha_scale,
        "beta_shift": dcfg.beta_shift, "gamma": "learned" if dcfg.gamma is None else dcfg.gamma,
        "n": len(per), "tokens": tokens, "nfe": nfe, "nfe_per_request": nfe / max(len(per), 1),
        "tokens_per_forward": tokens / max(nfe, 1),
        "steps_per_block": 1.0 if ar_mode else steps / max(blocks, 1),
        "tokens_per_step": 1.0 if ar_mode else tokens / max(steps, 1),
        "wall_s": wall, "s_per_token": wall / max(tokens, 1), "ttft_s": float(np.mean(ttft)),
        "validity": _mean(per, "valid"), "bfcl_accuracy": _mean(per, "bfcl"), "exact_match": _mean(per, "exact"),
        # call turns (BFCL-style argument check) and text turns (the exact reply) apart
        "n_call": sum(p["call"] for p in per), "validity_call": _mean(calls, "valid"),
        "bfcl_accuracy_call": _mean(calls, "bfcl"), "bfcl_accuracy_no_call": _mean(talk, "bfcl"),
        "repeated_3gram_rate": _mean(per, "rep3"), "longest_run_mean": _mean(per, "run"),
        "longest_run_max": max((p["run"] for p in per), default=0),
        "ar_agreement": _mean(per, "ar_agree"), "ar_exact": _mean(per, "ar_exact"),
    }
    if hist:
        share = np.mean(np.asarray(hist, np.float64), axis=0)
        row.update({f"history_share_L{j}": float(v) for j, v in enumerate(share)})
        row["history_share_mean"] = float(np.mean(share))
        # per GDN layer and position inside the block, pooled over batches by token count (JSON only)
        n_K = np.sum([np.asarray(n, np.float64) for _, n in pos], axis=0)
        s_LK = np.sum([np.nan_to_num(np.asarray(m, np.float64)) * np.asarray(n, np.float64) for m, n in pos], axis=0)
        row["history_share_by_position"] = np.where(n_K > 0, s_LK / np.maximum(n_K, 1.0), np.nan).tolist()
    return row, per


def history_position_table(rows: list[dict]) -> list[dict]:
    """The long table of the rows' `history_share_by_position` ([GDN layer][position]): one record per
    (setting, GDN layer, position inside the block) with the setting's block size, threshold and
    calibration; positions no real token reached are left out."""
    out = []
    for i, r in enumerate(rows):
        share = r.get("history_share_by_position")
        if not isinstance(share, list):
            continue
        for layer, per_k in enumerate(share):
            out += [{"setting": i, "mode": r["mode"], "block_size": r["block_size"], "threshold": r["threshold"],
                     "alpha_scale": r["alpha_scale"], "beta_shift": r["beta_shift"], "gamma": r["gamma"],
                     "gdn_layer": layer, "position": k, "share": v} for k, v in enumerate(per_k) if v == v]
    return out


def _mean(rows: list[dict], key: str) -> float:
    return float(np.mean([r[key] for r in rows])) if rows else float("nan")


def settings(cfg: CalibrateConfig) -> list[DecodeConfig]:
    """The sweep grid as DecodeConfigs (modes x block sizes x thresholds x sub-blocks x overrides);
    self-speculative ignores the threshold's effect on quality but not on speed, so it is swept too.
    Sub-block sizes >= the block size are skipped (they equal the whole block)."""
    base = cfg.decode
    out = []
    for mode in cfg.sweep.modes:
        if mode == "ar":
            continue
        for k in cfg.sweep.block_sizes:
            for th in cfg.sweep.thresholds:
                for sb in cfg.sweep.sub_block_sizes:
                    if sb and sb >= k:
                        continue
                    for cal in cfg.sweep.calibration:
                        out.append(base.replace(mode=mode, block_size=k, threshold=th, sub_block_size=sb or None,
                                                alpha_scale=cal.alpha_scale, beta_shift=cal.beta_shift,
                                                gamma=cal.gamma))
    return out


# -- training-side support ---------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _block_logits_jit(graphdef: Any) -> Any:
    def fwd(state, ids_BT, noisy_BT, seg_BT, block_size):
        return nnx.merge(graphdef, state).block_logits(ids_BT, noisy_BT, block_size=block_size, segment_ids=seg_BT)

    return jax.jit(fwd, static_argnums=(4,))


def block_logits_fn(model) -> Any:
    """`f(ids [B, T], noisy [B, T], segment_ids [B, T], block_size) -> fp32 logits [B, T, V]`: the
    training forward of both streams, jitted once per model structure (shared by every caller)."""
    graphdef, state = nnx.split(model)
    fwd = _block_logits_jit(graphdef)
    return lambda ids, noisy, seg, k: fwd(state, jnp.asarray(ids), jnp.asarray(noisy), jnp.asarray(seg), int(k))


def masked_loss_table(model, examples: list[EvalExample], cfg: LossEvalConfig, mask_id: int) -> list[dict]:
    """Masked-token CE of the model per (block size, t): reference tokens masked with probability t
    (the same uniform draws for every block size), one document per block-aligned row. A model
    trained with block-aligned responses (`response_block_align`) gets the decoder's prompt pads."""
    exs = examples[: cfg.n]
    align, pad = model.cfg.response_block_align, model.cfg.pad_token_id or 0
    rng = np.random.default_rng(cfg.seed)
    # one draw per token of the unpadded document, taken by its reference token whatever the padding
    u = rng.random((len(exs), max(len(e.prompt_ids) + len(e.reference_ids) for e in exs)))
    fwd = block_logits_fn(model)
    rows = []
    for k in cfg.block_sizes:
        unit = math.lcm(align, k) if align else 1
        n_prompt = [len(e.prompt_ids) + (-len(e.prompt_ids) % unit) for e in exs]
        longest = max(p + len(e.reference_ids) for p, e in zip(n_prompt, exs))
        t_len = -(-longest // k) * k
        ids = np.full((len(exs), t_len), pad, np.int32)
        seg = np.zeros((len(exs), t_len), np.int32)
        draw = np.ones((len(exs), t_len))
        for i, (p, e) in enumerate(zip(n_prompt, exs)):
            end = p + len(e.reference_ids)
            ids[i, : len(e.prompt_ids)], ids[i, p: end], seg[i, : end] = e.prompt_ids, e.reference_ids, 1
            draw[i, p: end] = u[i, len(e.prompt_ids): len(e.prompt_ids) + len(e.reference_ids)]
        for t in cfg.t_values:
            masked = draw < t
            noisy = np.where(masked, mask_id, ids).astype(np.int32)
            logp = jax.nn.log_softmax(fwd(ids, noisy, seg, k))
            nll = -np.asarray(jnp.take_along_axis(logp, jnp.asarray(ids)[..., None], -1)[..., 0])
            rows.append({"block_size": k, "t": t, "masked_tokens": int(masked.sum()),
                         "loss": float(nll[masked].mean()) if masked.any() else float("nan")})
    return rows


def scalar_table(model) -> list[dict]:
    """Learned (alpha, beta, gamma) per GDN layer (model order) and value head."""
    cfg = model.cfg
    rows, layer = [], 0
    per_group = []
    for j in range(cfg.group_size):
        sub = getattr(model.groups, f"layer_{j}")
        per_group.append(np.asarray(sub.gdn.bd_gdn_softmax_scalars[...]) if hasattr(sub, "gdn") else None)
    for g in range(cfg.num_groups):
        for j in range(cfg.group_size):
            if per_group[j] is None:
                continue
            for h, (a, b, c) in enumerate(per_group[j][g]):
                rows.append({"gdn_layer": layer, "model_layer": g * cfg.group_size + j, "head": h,
                             "alpha": float(a), "beta": float(b), "gamma": float(c)})
            layer += 1
    return rows


def pareto_front(rows: list[dict], quality: str) -> list[dict]:
    """Rows not dominated in (tokens_per_forward, quality): no other row at least as good in both and
    better in one."""
    def dominated(r):
        return any(o is not r and o["tokens_per_forward"] >= r["tokens_per_forward"] and o[quality] >= r[quality]
                   and (o["tokens_per_forward"] > r["tokens_per_forward"] or o[quality] > r[quality]) for o in rows)

    return sorted((r for r in rows if not dominated(r)), key=lambda r: r["tokens_per_forward"])


# -- the command -------------------------------------------------------------------------------
def _write_csv(path: Path, rows: list[dict]) -> None:
    """Scalar columns only (list values, e.g. `history_share_by_position`, live in results.json and
    `history_position.csv`)."""
    lists = {k for r in rows for k, v in r.items() if isinstance(v, list)}
    cols = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in lists]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="", extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def reused_ar_baseline(path: Path, cfg: CalibrateConfig, n_examples: int) -> tuple[dict, list[dict]]:
    """(AR row, per-example AR records) of an earlier sweep's results.json (``cfg.ar_baseline``), after
    checking that it decoded the same eval set with the same decode options: a mismatch is an error
    naming the file and the key."""
    from clover_jax.yaml_config import to_tree

    if not path.is_file():
        raise DecodeError(f"ar_baseline: {path} is no file (an earlier sweep's results.json)")
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DecodeError(f"ar_baseline: {path} is not JSON ({e})") from None
    for key, mine in (("eval", to_tree(cfg.eval)), ("decode", to_tree(cfg.decode))):
        theirs = saved.get("config", {}).get(key)
        if json.loads(json.dumps(mine, default=_json_default)) != theirs:
            raise DecodeError(f"ar_baseline: {path} was swept with another `{key}` ({theirs}) than this run's ({mine})")
    ar = [d for d in saved.get("details", []) if d.get("setting", {}).get("mode") == "ar"]
    if len(ar) != 1 or len(ar[0]["examples"]) != n_examples:
        raise DecodeError(f"ar_baseline: {path} holds no AR setting with {n_examples} examples")
    return ar[0]["setting"], ar[0]["examples"]


def run_calibrate(cfg: CalibrateConfig, *, generate_record: RecordGenerator | None = None) -> int:
    """The sweep; `generate_record` serves `eval.source: synthetic` (see `eval_records`)."""
    from clover_jax.decoding.cli import load_checkpoint

    if not cfg.checkpoint:
        raise DecodeError("calibrate: set checkpoint=DIR (an HF dir or Orbax params checkpoint)")
    t0 = time.perf_counter()
    runtime = {} if cfg.decode.mask_token_id is None else {"mask_token_id": cfg.decode.mask_token_id}
    mcfg, model, tok = load_checkpoint(cfg.checkpoint, **runtime)
    if tok is None:
        raise DecodeError(f"{cfg.checkpoint}: calibrate needs the checkpoint's tokenizer to render the eval set")
    if mcfg.mode != "block" or mcfg.mask_token_id is None:
        raise DecodeError(f"{cfg.checkpoint}: calibrate needs a block-diffusion checkpoint with a mask token")
    locations: list[str] = []
    records = eval_records(cfg.eval, locations, generate_record=generate_record)
    examples = build_examples(tok, records, locations)
    if not examples:
        raise DecodeError("calibrate: the eval set is empty")
    eos = resolve_eos_ids(cfg.decode, mcfg, tok)
    import inspect

    history = cfg.history_stats and "return_stats" in inspect.signature(model.block_step).parameters
    bs = cfg.sweep.batch_size
    if cfg.ar_baseline:
        ar_row, ar_per = reused_ar_baseline(Path(cfg.ar_baseline), cfg, len(examples))
    else:
        ar_row, ar_per = run_setting(model, tok, examples, cfg.decode.replace(mode="ar", block_size=None), eos, bs,
                                     None, False)
    ar_ids = [p["token_ids"] for p in ar_per]
    rows, details = [ar_row], [{"setting": ar_row, "examples": ar_per}]
    reused = f" (reused from {cfg.ar_baseline})" if cfg.ar_baseline else ""
    print(f"AR baseline{reused}: {_fmt(ar_row['tokens_per_forward'])} tokens/forward, validity {_fmt(ar_row['validity'])} "
          f"(call turns {_fmt(ar_row['validity_call'])}), argument accuracy {_fmt(ar_row['bfcl_accuracy'])} "
          f"(call turns {_fmt(ar_row['bfcl_accuracy_call'])} of {ar_row['n_call']}, "
          f"text turns {_fmt(ar_row['bfcl_accuracy_no_call'])} of {ar_row['n'] - ar_row['n_call']})")
    for dcfg in settings(cfg):
        row, per = run_setting(model, tok, examples, dcfg, eos, bs, ar_ids, history)
        rows.append(row)
        details.append({"setting": row, "examples": per})
        print(f"{row['mode']} block {row['block_size']} thr {row['threshold']} sub {row['sub_block_size']} "
              f"cal ({row['alpha_scale']}, {row['beta_shift']}, {row['gamma']}): "
              f"{_fmt(row['tokens_per_forward'])} tok/fwd, validity {_fmt(row['validity'])}, "
              f"bfcl {_fmt(row['bfcl_accuracy'])}, AR agree {_fmt(row['ar_agreement'])}", flush=True)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    rows = [{c: r.get(c, "n/a") for c in cols} for r in rows]  # e.g. the AR row has no history unit
    loss_rows = masked_loss_table(model, examples, cfg.loss, mcfg.mask_token_id) if cfg.loss.enabled else []
    scal = scalar_table(model)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_csv(out / "results.csv", rows)
    if loss_rows:
        _write_csv(out / "loss.csv", loss_rows)
    _write_csv(out / "scalars.csv", scal)
    by_position = history_position_table(rows)
    if by_position:
        _write_csv(out / "history_position.csv", by_position)
    from clover_jax.yaml_config import to_tree

    front = pareto_front(rows, cfg.sweep.quality_metric)
    (out / "results.json").write_text(json.dumps({
        "config": to_tree(cfg), "rows": rows, "pareto": front, "loss": loss_rows, "scalars": scal,
        "history_stats": history, "details": details, "elapsed_s": time.perf_counter() - t0,
    }, indent=1, default=_json_default) + "\n")
    if cfg.plots:
        from clover_jax.decoding.calibrate_plots import write_plots

        write_plots(out, rows, loss_rows, scal, cfg.sweep.quality_metric)
    q = cfg.sweep.quality_metric
    print(f"\nPareto front (tokens/forward vs {q}):")
    print(f"  {'mode':<17}{'block':>6}{'thr':>7}{'sub':>5}{'tok/fwd':>9}{q:>15}")
    for r in front:
        print(f"  {r['mode']:<17}{r['block_size']:>6}{r['threshold']:>7}{r['sub_block_size']:>5}"
              f"{r['tokens_per_forward']:>9.2f}{r[q]:>15.3f}")
    if scal:
        g = np.asarray([[s["alpha"], s["beta"], s["gamma"]] for s in scal])
        print(f"learned scalars over {len(scal)} (layer, head) pairs: alpha {g[:, 0].mean():.3f}, "
              f"beta {g[:, 1].mean():.3f}, gamma {g[:, 2].mean():.3f} (means)")
    print(f"wrote {out}/results.csv, results.json, loss.csv, scalars.csv and plots "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


__all__ = ["CalibOverride", "CalibrateConfig", "EvalSetConfig", "FitConfig", "LossEvalConfig", "SweepConfig",
           "build_examples", "block_logits_fn", "eval_records", "history_position_table", "load_calibrate_config",
           "masked_loss_table", "pareto_front", "run_calibrate", "run_setting", "scalar_table", "settings"]
