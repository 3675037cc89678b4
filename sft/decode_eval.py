"""Decode quality measured during SFT training (`eval.decode`, `sft.config.DecodeEvalConfig`).

At every eval step that is a multiple of `eval.decode.every`, the held-out prompts are decoded with
the training params, twice: AR greedy (the baseline) and block decoding in threshold mode. Both
runs and every metric are `clover_jax.decoding.calibrate.run_setting`, the code `launch.py
calibrate` scores a checkpoint with; prompts are built from chat records by its `build_examples`
(the prompt is everything before the first assistant turn, that turn is the reference).

Logged as ``decode/<name>`` (metrics.jsonl, console, wandb), means over the prompts:

    validity            tool calls parse, name an offered function and carry its required
                        arguments (a text reply where the reference has no call)
    arg_accuracy        BFCL-style argument match on call turns, the exact reply on text turns
    exact_match         the output equals the reference turn token for token
    tokens_per_forward  generated tokens / model forwards (prefill, denoising steps, commit passes)
    ar_agreement        per prompt, positions where the block output equals AR greedy decoding,
                        over the longer of the two outputs (`metrics.ar_agreement`)
    ar_exact            fraction of prompts whose block output is identical to AR greedy decoding
    ar_validity, ar_arg_accuracy   the AR baseline's validity and argument accuracy
    time_s              wall time of this decode eval (both runs; the first one includes compiling)

Invariants: the prompts are fixed at start-up and decoded as one batch of the same shape every time
(prompt layout from the same lengths, the same `max_new_tokens`), so the decoder's programs compile
at the first eval and are reused (`Loops.compiled` caches them per model structure). The model is
the train state's params (as sharded) cast to the compute dtype, merged into the train step's graph:
no copy to the host and no checkpoint read. Single process only (the prompts are host arrays).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
from flax import nnx

from clover_jax.decoding import metrics as ev
from clover_jax.decoding.calibrate import EvalExample, EvalSetConfig, build_examples, eval_records, run_setting
from clover_jax.decoding.generator import DecodeConfig, resolve_eos_ids
from clover_jax.yaml_config import ConfigError

__all__ = ["DecodeEval", "decode_line", "decode_metrics", "decode_summary", "plot_decode", "with_decode_eval"]

#: the logged names, in console order (``decode/<name>``)
METRICS = ("validity", "arg_accuracy", "exact_match", "tokens_per_forward", "ar_agreement", "ar_exact",
           "ar_validity", "ar_arg_accuracy", "time_s")


def decode_metrics(model: Any, tok: Any, examples: list[EvalExample], dcfg: DecodeConfig,
                   eos: tuple[int, ...]) -> dict[str, float]:
    """`METRICS` of `model` on `examples`: AR greedy decoding, then `dcfg` (block decoding) scored
    against it; every example in one batch."""
    t0 = time.perf_counter()
    n = len(examples)
    ar_row, ar_per = run_setting(model, tok, examples, dcfg.replace(mode="ar", block_size=None), eos, n, None, False)
    row, _ = run_setting(model, tok, examples, dcfg, eos, n, [p["token_ids"] for p in ar_per], False)
    return {"validity": row["validity"], "arg_accuracy": row["bfcl_accuracy"], "exact_match": row["exact_match"],
            "tokens_per_forward": row["tokens_per_forward"], "ar_agreement": row["ar_agreement"],
            "ar_exact": row["ar_exact"], "ar_validity": ar_row["validity"],
            "ar_arg_accuracy": ar_row["bfcl_accuracy"], "time_s": time.perf_counter() - t0}


def _split_candidates(setup: Any) -> Iterator[tuple[dict, str]]:
    """Eval-split records (source, then file order) that offer tools and have an assistant turn."""
    for s in setup.data.sources:
        for rec, loc in s.eval:
            try:
                answer = ev.split_record(rec)[1]
            except ValueError:
                continue
            if rec.get("tools") and answer is not None:
                yield rec, loc


def _file_candidates(path: str) -> Iterator[tuple[dict, str]]:
    """Chat records of `path` with an assistant turn (a bad line: InputFileError naming file:line)."""
    if not Path(path).is_file():
        raise ConfigError(f"eval.decode.prompts_file {path} does not exist (JSONL chat records)")
    locs: list[str] = []
    recs = eval_records(EvalSetConfig(source="jsonl", path=path, n=1 << 30), locs)
    yield from zip(recs, locs)


class DecodeEval:
    """The decode eval of one run: its prompts (built once, at start-up) and settings;
    ``self(params) -> {name: value}`` decodes them with the train state's params."""

    def __init__(self, setup: Any):
        cfg = setup.cfg
        dc = cfg.eval.decode
        if jax.process_count() > 1:
            raise ConfigError("eval.decode: decoding during training runs in a single process; set "
                              "eval.decode.every=0 for a multi-process run")
        self.tok = setup.data.tokenizer
        self.graphdef, self.compute_dtype = setup.graphdef, setup.compute_dtype
        block = dc.block_size or setup.block_sizes[0]
        if block > dc.max_new_tokens:
            raise ConfigError(f"eval.decode.block_size {block} is larger than eval.decode.max_new_tokens "
                              f"{dc.max_new_tokens}")
        limit = setup.model_cfg.max_position_embeddings
        source = _file_candidates(dc.prompts_file) if dc.prompts_file else _split_candidates(setup)
        self.examples: list[EvalExample] = []
        for rec, loc in source:
            ex = build_examples(self.tok, [rec], [loc])[0]
            if len(ex.prompt_ids) + dc.max_new_tokens > limit:
                if dc.prompts_file:  # the user's own prompt: say so rather than skip it
                    raise ConfigError(f"{loc}: prompt of {len(ex.prompt_ids)} tokens + eval.decode.max_new_tokens "
                                      f"{dc.max_new_tokens} exceeds the model context ({limit})")
                continue
            self.examples.append(ex)
            if len(self.examples) == dc.prompts:
                break
        if not self.examples:
            where = (f"eval.decode.prompts_file {dc.prompts_file} has no chat record with an assistant turn"
                     if dc.prompts_file else "eval.decode: the eval split (data.eval_fraction) has no chat record "
                     "that offers tools and has an assistant turn; set eval.decode.prompts_file")
            raise ConfigError(where)
        # one batch of fixed shape: batch_bucket = its size, so every eval reuses the compiled programs
        self.dcfg = DecodeConfig(mode="threshold", block_size=block, threshold=dc.threshold,
                                 max_new_tokens=dc.max_new_tokens, batch_bucket=len(self.examples))
        self.eos = resolve_eos_ids(self.dcfg, setup.model_cfg, self.tok)

    def model(self, params: Any) -> Any:
        """The model the decoder runs: `params` (master dtype) cast to the compute dtype."""
        from train.step import cast_for_compute

        return nnx.merge(self.graphdef, cast_for_compute(params, self.compute_dtype))

    def __call__(self, params: Any) -> dict[str, float]:
        return decode_metrics(self.model(params), self.tok, self.examples, self.dcfg, self.eos)


def with_decode_eval(setup: Any, eval_fn: Callable[[Any], dict[str, float]] | None
                     ) -> Callable[[Any], dict[str, float]] | None:
    """`eval_fn` (the CE eval, or None) with the decode metrics added as ``decode/<name>`` at the
    eval steps that are multiples of `eval.decode.every`; `eval_fn` itself when that is 0."""
    every = setup.cfg.eval.decode.every
    if not every or not setup.cfg.train.eval_every:
        return eval_fn
    dec = DecodeEval(setup)

    def fn(state: Any) -> dict[str, float]:
        out = dict(eval_fn(state)) if eval_fn is not None else {}
        if int(jax.device_get(state.step)) % every == 0:
            out.update({f"decode/{k}": v for k, v in dec(state.params).items()})
        return out

    return fn


def _records(metrics_path: Path) -> list[dict]:
    return [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]


def decode_summary(metrics_path: Path) -> dict[str, Any]:
    """The decode evals of the run's last process (a resume restarts `elapsed_s`): their count, the
    first and last values, their total time and its share of the training loop's time (the last
    record's `elapsed_s`, evals and checkpoints included). Empty without decode evals."""
    recs = [r for r in _records(metrics_path) if "elapsed_s" in r]
    start = max([i for i in range(1, len(recs)) if recs[i]["elapsed_s"] < recs[i - 1]["elapsed_s"]], default=0)
    recs = recs[start:]
    dec = [r for r in recs if "decode/validity" in r]
    if not dec:
        return {}
    total = float(sum(r["decode/time_s"] for r in dec))
    loop = float(recs[-1]["elapsed_s"])
    out: dict[str, Any] = {"decode_evals": len(dec), "decode_time_s": total,
                           "decode_time_share": total / loop if loop > 0 else None}
    for k in ("validity", "arg_accuracy", "tokens_per_forward", "ar_agreement"):
        out[f"decode_{k}_first"], out[f"decode_{k}_last"] = dec[0][f"decode/{k}"], dec[-1][f"decode/{k}"]
    return out


def plot_decode(metrics_path: Path, out: Path) -> bool:
    """``decode.png`` beside loss.png: the quality metrics (0-1) and tokens per forward (right
    axis) against the step. False (nothing written) without decode evals or matplotlib."""
    dec = [r for r in _records(metrics_path) if "decode/validity" in r]
    if not dec:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [r["step"] for r in dec]
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, label in (("validity", "validity"), ("arg_accuracy", "argument accuracy"),
                     ("exact_match", "exact match"), ("ar_agreement", "AR agreement (tokens)"),
                     ("ar_validity", "AR validity")):
        ax.plot(steps, [r[f"decode/{k}"] for r in dec], "o-", ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of held-out prompts / tokens")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    right = ax.twinx()
    right.plot(steps, [r["decode/tokens_per_forward"] for r in dec], "k--", lw=1, label="tokens per forward")
    right.set_ylabel("tokens per forward")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True


def decode_line(summary: dict[str, Any]) -> str | None:
    """The end-of-run console line of `decode_summary`'s result (None without decode evals)."""
    if "decode_evals" not in summary:
        return None
    share = summary["decode_time_share"]
    return (f"decode evals: {summary['decode_evals']}, validity {summary['decode_validity_first']:.3f} -> "
            f"{summary['decode_validity_last']:.3f}, argument accuracy {summary['decode_arg_accuracy_first']:.3f} -> "
            f"{summary['decode_arg_accuracy_last']:.3f}, tokens/forward {summary['decode_tokens_per_forward_last']:.2f}; "
            f"{summary['decode_time_s']:.1f} s"
            + (f" ({100 * share:.1f}% of the training loop)" if share is not None else ""))
