"""Checkpoints, prompts and the `launch.py generate` command around `clover_jax.decoding.generator`.

Checkpoints: an HF dir (`config.json`; Clover or Qwen format, read in its own mode) or an Orbax
params checkpoint (`launch.py convert` output). The tokenizer comes from the checkpoint dir, else
from the HF dir an Orbax checkpoint was converted from, else (Qwen3.6-sized vocabularies only) the
built-in Qwen3.6 tokenizer; without one, prompts must be given as token ids.

Prompts: `--prompt TEXT` (a user turn rendered with the chat template, unless `--raw`),
`--prompts FILE.jsonl` (chat records `{"messages": [...], "tools": [...]}` rendered with the
template, tools included, up to the first assistant turn; or `{"prompt": TEXT}` lines), or
`--prompt-ids 1,2,3`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from clover_jax.decoding.generator import (DecodeConfig, DecodeError, Decoder, Generation, jsonl_lines, resolve_eos_ids,
                                 resolve_vocab_limit)
from clover_jax.decoding.metrics import split_record
from clover_jax.input_file import InputFileError, render_chat


def load_checkpoint(path: str | Path, **runtime: Any):
    """(ModelConfig, CloverModel, tokenizer or None) of an HF dir or an Orbax params checkpoint.
    `runtime` overrides ModelConfig fields (e.g. mask_token_id)."""
    from clover_jax.api import load_hf
    from clover_jax.model.clover_model import model_from_params
    from clover_jax.model.params import stack_layers
    from clover_jax.bridge.params_checkpoint import is_params_checkpoint, load_params_checkpoint, read_params_info
    from clover_jax.bridge.safetensors_io import CheckpointError

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    tok_dirs: list[Path] = [p]
    if (p / "config.json").is_file():
        cfg, model = load_hf(p, mode=None, **runtime)
    elif is_params_checkpoint(p):
        cfg, tree = load_params_checkpoint(p)
        if runtime:
            cfg = cfg.replace(**runtime)
        model = model_from_params(cfg, stack_layers(cfg, tree))
        src = (read_params_info(p)[1].get("source") or {}).get("hf_dir")
        if src:
            tok_dirs.append(Path(src))
    else:
        raise CheckpointError(f"{p}: neither an HF checkpoint dir (config.json) nor an Orbax params checkpoint")
    return cfg, model, _find_tokenizer(cfg, tok_dirs)


def _find_tokenizer(cfg, dirs: Sequence[Path]):
    from clover_jax.bridge.convert import QWEN_TOKENIZER_SIZE
    from clover_jax.bridge.tokenizer import load_tokenizer

    for d in dirs:
        if (d / "tokenizer.json").is_file():
            return load_tokenizer(d)
    if cfg.vocab_size >= QWEN_TOKENIZER_SIZE:
        return load_tokenizer(None)
    return None


def render_messages(tok, messages: list[dict], tools: list[dict] | None, where: str = "--prompt") -> list[int]:
    text = render_chat(tok, where, messages, tools, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def read_prompt_records(path: str | Path) -> list[tuple[Path, int, Any]]:
    """(path, line, parsed JSON) per non-blank line of a prompts JSONL, read before any checkpoint
    is loaded: a missing file is a FileNotFoundError, a line that is not JSON or a file without a
    prompt an InputFileError naming the file (launch.py exits 2)."""
    records = list(jsonl_lines(path, "prompts file"))
    if not records:
        raise InputFileError(f"{path}: no prompts in the file (it has no non-blank line)")
    return records


def render_prompt_records(records: Sequence[tuple[Path, int, Any]],
                          tok) -> list[tuple[str, list[int], dict[str, Any]]]:
    """(display prompt, ids, record) per record of `read_prompt_records`; errors (InputFileError)
    name the line."""
    out = []
    for p, n, rec in records:
        if tok is None:
            raise DecodeError(f"{p}:{n}: the checkpoint has no tokenizer to render prompts; use --prompt-ids")
        if isinstance(rec, dict) and "messages" in rec:
            try:
                msgs, _, tools = split_record(rec)
            except ValueError as e:
                raise InputFileError(f"{p}:{n}: {e}") from None
            text = render_chat(tok, f"{p}:{n}", msgs, tools, add_generation_prompt=True)
        elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            text = render_chat(tok, f"{p}:{n}", [{"role": "user", "content": rec["prompt"]}], add_generation_prompt=True)
        else:
            raise InputFileError(f"{p}:{n}: expected a chat record with 'messages' or an object with a 'prompt' string")
        out.append((text, tok.encode(text, add_special_tokens=False), rec))
    return out


def read_prompts_file(path: str | Path, tok) -> list[tuple[str, list[int], dict[str, Any]]]:
    """`render_prompt_records(read_prompt_records(path), tok)`."""
    return render_prompt_records(read_prompt_records(path), tok)


def parse_decode_overrides(overrides: Sequence[str], base: DecodeConfig | None = None) -> DecodeConfig:
    """`decode.key=value` strings -> DecodeConfig (unknown keys: ConfigError with a suggestion)."""
    from clover_jax.yaml_config import ConfigError, apply_overrides, from_tree, to_tree

    for o in overrides:
        if not o.startswith("decode."):
            raise ConfigError(f"override {o!r}: generate takes decode.* overrides only (e.g. decode.block_size=16)")
    tree = apply_overrides({"decode": to_tree(base or DecodeConfig())}, list(overrides))
    return from_tree(DecodeConfig, tree["decode"], where="decode")


def decode_texts(tok, gens: list[Generation], eos_ids: Sequence[int]) -> None:
    """Fills `text` of each generation (EOS dropped; special tokens skipped)."""
    for g in gens:
        ids = [t for t in g.token_ids if t not in eos_ids]
        g.text = tok.decode(ids, skip_special_tokens=True) if tok is not None else None


def run_generate(args: Any, load: Callable[..., tuple[Any, Any, Any]] = load_checkpoint) -> int:
    """`launch.py generate`: see the module docstring. ``load(path, **runtime)`` -> (ModelConfig,
    model, tokenizer or None): `load_checkpoint`, or launch's wider loader (SFT training checkpoints
    too: decoding does not import the recipe)."""
    dcfg = parse_decode_overrides(args.overrides)
    # a bad prompts file fails before a checkpoint (tens of GB on the 35B) is read
    records = read_prompt_records(args.prompts) if args.prompts is not None else None
    runtime = {} if dcfg.mask_token_id is None else {"mask_token_id": dcfg.mask_token_id}
    cfg, model, tok = load(args.checkpoint, **runtime)
    given = [x is not None for x in (args.prompt, args.prompts, args.prompt_ids)]
    if sum(given) != 1:
        raise DecodeError("give exactly one of --prompt, --prompts, --prompt-ids")
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise DecodeError(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers") from None
        prompts = [(None, ids)]
    elif args.prompt is not None:
        if tok is None:
            raise DecodeError(f"{args.checkpoint}: no tokenizer found to encode --prompt; use --prompt-ids")
        if args.raw:
            ids = tok.encode(args.prompt, add_special_tokens=False)
        else:
            ids = render_messages(tok, [{"role": "user", "content": args.prompt}], None) if args.prompt else []
        prompts = [(args.prompt, ids)]
    else:
        prompts = [(text, ids) for text, ids, _ in render_prompt_records(records, tok)]
    eos = resolve_eos_ids(dcfg, cfg, tok)
    decoder = Decoder(model, dcfg, eos_ids=eos, vocab_limit=resolve_vocab_limit(dcfg, cfg, tok))
    bs = max(1, int(args.batch_size))
    gens: list[Generation] = []
    agg: list[dict[str, Any]] = []
    for start in range(0, len(prompts), bs):
        chunk = prompts[start: start + bs]

        shown: dict[int, tuple[list[int], str]] = {}

        def stream(_block: int, new: list[list[int]], start: int = start, n: int = len(chunk)) -> None:
            """Prints each row's new text: the decoded whole minus what was printed (so a block edge
            inside a multi-token character or a leading space decodes right)."""
            if args.no_stream or tok is None:
                return
            for i, piece in enumerate(new):
                ids, text = shown.get(i, ([], ""))
                ids = ids + [t for t in piece if t not in eos]
                full = tok.decode(ids, skip_special_tokens=True)
                if full != text:
                    sys.stdout.write(full[len(text):] if n == 1 else f"[{start + i}] {full[len(text):]!r}\n")
                shown[i] = (ids, full)
            sys.stdout.flush()

        out = decoder.generate([ids for _, ids in chunk], stream=stream)
        if not args.no_stream and tok is not None and len(chunk) == 1:
            sys.stdout.write("\n")
        for (text, _), g in zip(chunk, out.generations):
            g.prompt = text
        decode_texts(tok, out.generations, eos)
        gens += out.generations
        agg.append(out.stats)
    for i, g in enumerate(gens):
        s = g.stats
        print(f"--- request {i}: {len(g.token_ids)} tokens ({g.finish_reason}), NFE {s['nfe']}, "
              f"{s['tokens_per_forward']:.2f} tokens/forward, {s['denoise_steps']} steps, "
              f"wall {s['wall_s']:.2f} s, ttft {s['ttft_s']:.2f} s")
        print(g.text if g.text is not None else json.dumps(g.token_ids))
    total_tokens = sum(a["tokens"] for a in agg)
    total_nfe = sum(a["nfe"] for a in agg)
    total_wall = sum(a["wall_s"] for a in agg)
    print(f"=== {len(gens)} requests, {total_tokens} tokens, NFE {total_nfe}, "
          f"{total_tokens / max(total_nfe, 1):.2f} tokens/forward, {total_wall:.2f} s "
          f"({dcfg.mode}, block {decoder.block}, threshold {dcfg.threshold})")
    if "history_share" in agg[0]:
        shares = [sum(a["history_share"][j] for a in agg) / len(agg) for j in range(len(agg[0]["history_share"]))]
        print("history-unit softmax share per GDN layer: " + ", ".join(f"{x:.3f}" for x in shares))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps([g.to_json() for g in gens], indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


__all__ = ["decode_texts", "load_checkpoint", "parse_decode_overrides", "read_prompt_records", "read_prompts_file",
           "render_messages", "render_prompt_records", "run_generate"]
