"""A small block-diffusion model trained on a structured task, for decoding tests and bench/decode.py.

Task (our generator, `task_record`): a user request ("What's the weather in Oslo?", "Convert 50 EUR
to CHF.", flights between two cities on a day) with 2-3 tools offered; the target is the tool call
in Qwen3.6's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` JSON whose argument values
are words of the request, then `<|im_end|>`. A small byte-level BPE tokenizer (~560 ids) trained on
the rendered records and a compact chat template (tools listed as `name(required args)`) keep a
record under 96 tokens (3 blocks of 32), so a 2-layer model (one GDN + one attention layer, 4
experts) learns it in a few hundred steps on 2 CPU cores.

Training (compact, ours): two-stream masked diffusion on block-aligned rows, one document per row
padded to the block end with `<|endoftext|>` inside the document (so the model learns to fill the
rest of a block after the end), noise t ~ U[t_min, 1] drawn per block, CE on masked positions,
plus the clean stream's next-token CE on the target (so AR decoding of the same model is a fair
baseline), plus the MoE load-balancing loss; optax AdamW with warmup + cosine decay.

The trained model is saved as a Clover HF dir (fp32, with the tokenizer) under
`$CLOVER_JAX_CACHE` (default ~/.cache/clover_jax) keyed by a hash of `TinyTaskConfig`, so tests and
the bench share it: `trained_checkpoint()` returns its path (training first, under a file lock, if
absent).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<|mask|>")

# Compact ChatML: tools as one `name(required, args)` line each; tool calls as in Qwen3.6, on one line.
TINY_TEMPLATE = r"""
{%- if tools -%}
{{- '<|im_start|>tools\n' -}}
{%- for t in tools -%}{%- set f = t.function if t.function is defined else t -%}
{{- f.name + '(' + ((f.parameters.required or []) | join(', ')) + ')\n' -}}{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' + (m.content or '') -}}
{%- for call in m.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- '<tool_call>{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
{{- '}</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""".strip()


@dataclass(frozen=True)
class TinyTaskConfig:
    """Everything that determines the trained model (its hash names the cache entry)."""

    n_train: int = 2000
    data_seed: int = 0
    bpe_vocab: int = 640
    seq_len: int = 96
    block_size: int = 32
    hidden_size: int = 64
    layers: int = 2  # one GDN + one full-attention layer: one scanned group
    experts: int = 4
    moe_impl: str = "auto"
    steps: int = 400
    batch: int = 8
    lr: float = 3e-3
    warmup: int = 30
    t_min: float = 0.1
    ar_loss_weight: float = 0.5
    lb_loss_weight: float = 0.01
    seed: int = 0
    version: int = 2  # bump when the training code changes

    def key(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:12]


# -- the task: short tool-call records (our generator; argument values are words of the request) ----
_CITIES = ("Paris", "Rome", "Tokyo", "Berlin", "Madrid", "Lisbon", "Oslo", "Cairo", "Lima", "Seoul",
           "Toronto", "Sydney", "Dublin", "Vienna", "Prague", "Boston")
_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CHF", "CAD")
_AMOUNTS = ("10", "20", "50", "100", "200", "500")


def _tool(name: str, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "parameters": {"type": "object", "properties": {r: {"type": "string"} for r in required},
                                     "required": required}}}


TASK_TOOLS = {t["function"]["name"]: t for t in [
    _tool("get_weather", ["city"]), _tool("get_time", ["city"]),
    _tool("search_flights", ["origin", "destination", "day"]),
    _tool("convert_currency", ["amount", "source", "target"]),
]}
_ASKS = {
    "get_weather": ("What's the weather in {city}?", "Is it raining in {city}?", "Weather for {city}, please."),
    "get_time": ("What time is it in {city}?", "Current time in {city}?", "Tell me the time in {city}."),
    "search_flights": ("Flights from {origin} to {destination} on {day}?",
                       "Find me a flight {origin} to {destination}, {day}."),
    "convert_currency": ("Convert {amount} {source} to {target}.", "How much is {amount} {source} in {target}?"),
}


def _call(rng, name: str) -> tuple[str, dict]:
    c1, c2 = rng.choice(_CITIES, 2, replace=False)
    x1, x2 = rng.choice(_CURRENCIES, 2, replace=False)
    values = {"city": str(c1), "origin": str(c1), "destination": str(c2), "day": str(rng.choice(_DAYS)),
              "amount": str(rng.choice(_AMOUNTS)), "source": str(x1), "target": str(x2)}
    args = {r: values[r] for r in TASK_TOOLS[name]["function"]["parameters"]["required"]}
    return str(rng.choice(_ASKS[name])).format(**args), args


def task_record(i: int, seed: int) -> dict:
    """Record `i` of stream `seed`: a user request and the assistant's tool call; the tools offered
    are the needed one plus 1-2 others, shuffled."""
    rng = np.random.default_rng([seed, i])
    names = list(TASK_TOOLS)
    needed = [str(rng.choice(names))]
    asks, calls = [], []
    for name in needed:
        text, args = _call(rng, str(name))
        asks.append(text)
        calls.append({"type": "function", "function": {"name": str(name), "arguments": args}})
    others = [n for n in names if n not in needed]
    offered = needed + list(rng.choice(others, min(len(others), int(rng.integers(1, 3))), replace=False))
    offered = [TASK_TOOLS[str(n)] for n in rng.permutation(offered)]
    return {"messages": [{"role": "user", "content": " ".join(asks)},
                         {"role": "assistant", "content": "", "tool_calls": calls}], "tools": offered}


def task_records(n: int, seed: int) -> list[dict]:
    return [task_record(i, seed) for i in range(n)]


EVAL_SEED = 12345  # held-out records: another stream of the generator


def cache_root() -> Path:
    env = os.environ.get("CLOVER_JAX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "clover_jax"


def split_example(rec: dict) -> tuple[list[dict], dict, list[dict]]:
    from clover_jax.decoding.metrics import split_record

    prompt, answer, tools = split_record(rec)
    return prompt, answer, tools


def build_tokenizer(records: list[dict], vocab: int):
    """Byte-level BPE trained on the rendered records, with the specials and TINY_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    renderer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), chat_template=TINY_TEMPLATE)
    texts = []
    for rec in records:
        prompt, answer, tools = split_example(rec)
        texts.append(renderer.apply_chat_template(prompt + [answer], tools=tools or None, tokenize=False))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(SPECIALS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=TINY_TEMPLATE, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", mask_token="<|mask|>")


def encode_example(tok, rec: dict) -> tuple[list[int], list[int], dict, list[dict]]:
    """(prompt ids, target ids ending with <|im_end|>, reference message, tools)."""
    prompt, answer, tools = split_example(rec)
    p_text = tok.apply_chat_template(prompt, tools=tools or None, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(prompt + [answer], tools=tools or None, tokenize=False)
    assert full.startswith(p_text)
    target = full[len(p_text):]
    target = target[: target.rindex("<|im_end|>") + len("<|im_end|>")]
    return (tok.encode(p_text, add_special_tokens=False), tok.encode(target, add_special_tokens=False),
            answer, tools)


def model_config(tok, task: TinyTaskConfig):
    from clover_jax.config import get_preset

    vocab = -(-len(tok) // 8) * 8
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    base = get_preset("tiny")
    return base.replace(
        vocab_size=vocab, hidden_size=task.hidden_size, mode="block", block_size=task.block_size,
        num_hidden_layers=task.layers, layer_types=base.layer_types[: task.layers], num_experts=task.experts,
        moe_impl=task.moe_impl,
        mask_token_id=ids["<|mask|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        max_position_embeddings=1024)


def _rows(tok, records: list[dict], task: TinyTaskConfig):
    """Block-aligned rows: ids [N, T], segment ids, loss mask (target + in-document end padding)."""
    end_pad = tok.convert_tokens_to_ids("<|endoftext|>")
    ids, seg, loss = [], [], []
    for rec in records:
        p, t, _, _ = encode_example(tok, rec)
        doc = p + t
        n = -(-len(doc) // task.block_size) * task.block_size
        if n > task.seq_len:
            continue
        row = np.full(task.seq_len, end_pad, np.int32)
        row[: len(doc)] = doc
        s = np.zeros(task.seq_len, np.int32)
        s[:n] = 1
        lm = np.zeros(task.seq_len, bool)
        lm[len(p): n] = True
        ids.append(row), seg.append(s), loss.append(lm)
    return np.stack(ids), np.stack(seg), np.stack(loss)


def train(task: TinyTaskConfig, out_dir: Path) -> dict[str, Any]:
    """Trains the model and writes `out_dir/hf` (Clover HF dir + tokenizer) and `out_dir/train.json`."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from clover_jax.api import save_hf
    from clover_jax.model.clover_model import create_model, shift_predictions
    from clover_jax.bridge.tokenizer import save_tokenizer
    t0 = time.perf_counter()
    records = task_records(task.n_train, task.data_seed)
    tok = build_tokenizer(records, task.bpe_vocab)
    cfg = model_config(tok, task)
    ids, seg, loss_mask = _rows(tok, records, task)
    model = create_model(cfg, task.seed)
    graphdef, params = nnx.split(model, nnx.Param)
    sched = optax.warmup_cosine_decay_schedule(0.0, task.lr, task.warmup, task.steps, task.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    opt_state = opt.init(params)
    k, mask_id = task.block_size, cfg.mask_token_id

    def loss_fn(p, x, noisy, s, lm):
        m = nnx.merge(graphdef, p)
        h_c, h_n, aux = m.two_stream_hidden(x, noisy, block_size=k, segment_ids=s)
        logp_n = jax.nn.log_softmax(m.logits(shift_predictions(h_c, h_n, s, k, cfg.logits_shift)))
        nll_n = -jnp.take_along_axis(logp_n, x[..., None], -1)[..., 0]
        masked = noisy == mask_id
        diff = jnp.sum(jnp.where(masked, nll_n, 0.0)) / jnp.maximum(masked.sum(), 1)
        logp_c = jax.nn.log_softmax(m.logits(h_c[:, :-1]))
        nll_c = -jnp.take_along_axis(logp_c, x[:, 1:, None], -1)[..., 0]
        ar = jnp.sum(jnp.where(lm[:, 1:], nll_c, 0.0)) / jnp.maximum(lm[:, 1:].sum(), 1)
        total = diff + task.ar_loss_weight * ar + task.lb_loss_weight * aux["lb_loss"]
        return total, (diff, ar)

    @jax.jit
    def step(p, st, x, noisy, s, lm):
        (_, (diff, ar)), g = jax.value_and_grad(loss_fn, has_aux=True)(p, x, noisy, s, lm)
        upd, st = opt.update(g, st, p)
        return optax.apply_updates(p, upd), st, diff, ar

    rng = np.random.default_rng(task.seed)
    history = []
    n_blocks = task.seq_len // k
    for i in range(task.steps):
        pick = rng.integers(0, len(ids), task.batch)
        x, s, lm = ids[pick], seg[pick], loss_mask[pick]
        t = rng.uniform(task.t_min, 1.0, (task.batch, n_blocks)).repeat(k, axis=1)
        noisy = np.where(lm & (rng.random(x.shape) < t), mask_id, x).astype(np.int32)
        params, opt_state, diff, ar = step(params, opt_state, x, noisy, s, lm)
        if i % 25 == 0 or i == task.steps - 1:
            history.append({"step": i, "diffusion_loss": float(diff), "ar_loss": float(ar),
                            "elapsed_s": time.perf_counter() - t0})
            log.info("tiny task step %d: diffusion %.3f ar %.3f", i, float(diff), float(ar))
    nnx.update(model, params)
    tok_dir = out_dir / "tokenizer"
    save_tokenizer(tok, tok_dir)
    save_hf(model, cfg, out_dir / "hf", format="clover", dtype=None, source_dir=tok_dir, overwrite=True)
    info = {"task": dataclasses.asdict(task), "rows": int(len(ids)), "history": history,
            "train_s": time.perf_counter() - t0}
    (out_dir / "train.json").write_text(json.dumps(info, indent=2))
    return info


def trained_checkpoint(task: TinyTaskConfig = TinyTaskConfig()) -> Path:
    """Path of the trained Clover HF dir for `task`, training it (once, under a file lock) if the
    cache has none."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"decode-tiny-task-{task.key()}"
    if (final / "hf" / "config.json").is_file():
        return final / "hf"
    with open(root / f".decode-tiny-task-{task.key()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / "hf" / "config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-decode-tiny-", dir=root))
            try:
                train(task, tmp)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return final / "hf"


@functools.lru_cache(maxsize=None)
def trained_model(task: TinyTaskConfig = TinyTaskConfig()) -> tuple[Any, Any, Any]:
    """(config, CloverModel, tokenizer) of `trained_checkpoint(task)`, loaded once per process (the
    decoding tests share it, and with it their compiled programs)."""
    from clover_jax.api import load_hf
    from clover_jax.bridge.tokenizer import load_tokenizer

    path = trained_checkpoint(task)
    cfg, model = load_hf(path)
    return cfg, model, load_tokenizer(path)


@functools.lru_cache(maxsize=None)
def peaked_random_model(task: TinyTaskConfig = TinyTaskConfig()) -> Any:
    """A random model on the trained config (same compiled functions) with its lm_head scaled by 30:
    peaked distributions, confident but arbitrary (near-ties between a random model's flat
    confidences would make token-for-token comparisons a coin toss in the last float bit)."""
    from clover_jax.model.clover_model import create_model

    model = create_model(trained_model(task)[0], 7)
    model.lm_head.kernel.set_value(model.lm_head.kernel[...] * 30.0)
    return model


def prompt_key(rec: dict) -> str:
    """What the model is shown for `rec` (prompt messages + offered tools), as a comparable string."""
    prompt, _, tools = split_example(rec)
    return json.dumps([prompt, tools], sort_keys=True)


@functools.lru_cache(maxsize=4)
def train_prompt_keys(task: TinyTaskConfig = TinyTaskConfig()) -> frozenset[str]:
    """The prompts of `task`'s training stream (the generator repeats prompts, ~20% of EVAL_SEED's)."""
    return frozenset(prompt_key(r) for r in task_records(task.n_train, task.data_seed))


def eval_records(n: int, seed: int = EVAL_SEED, task: TinyTaskConfig = TinyTaskConfig()) -> list[dict]:
    """The first `n` records of generator stream `seed` whose prompt is not among `task`'s training
    prompts: held out for real (the training stream and so the trained model are unchanged)."""
    if seed == task.data_seed:
        raise ValueError(f"eval seed {seed} is the training stream's seed")
    train, out, i = train_prompt_keys(task), [], 0
    while len(out) < n:
        rec, i = task_record(i, seed), i + 1
        if prompt_key(rec) not in train:
            out.append(rec)
    return out


def tool_call_records(n: int, seed: int = EVAL_SEED) -> list[dict]:
    """The first `n` held-out records (every first assistant turn of the task is a tool call)."""
    return eval_records(n, seed)


def write_eval_jsonl(path: Path, n: int = 16, seed: int = EVAL_SEED) -> Path:
    """Held-out records as a JSONL eval set (`launch.py calibrate` with eval.source=jsonl)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in eval_records(n, seed)))
    return path


def main(argv: list[str] | None = None) -> None:
    """`python tests/decode_fixtures.py [--export DIR]`: train (or find) the cached model; `--export`
    copies its HF dir to DIR/hf and writes DIR/eval.jsonl (configs/calibrate_tiny.yaml reads both)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--export", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    path = trained_checkpoint()
    print(path)
    print(json.dumps(json.loads((path.parent / "train.json").read_text())["history"][-2:], indent=1))
    if args.export:
        dst = Path(args.export) / "hf"
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(path, dst)
        print(f"copied to {dst}; held-out eval set {write_eval_jsonl(Path(args.export) / 'eval.jsonl')}")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
