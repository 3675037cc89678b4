"""The embedded default job (`python launch.py demo --config configs/demo.yaml`).

Until the SFT issue lands this is the end-to-end path a new user can run on a laptop: build a tiny
Qwen3.6-shaped model with the real 248320-row vocabulary, write it as a hub-style HF checkpoint with
the real Qwen3.6 tokenizer, `convert` it to an Orbax params checkpoint, `export` it back to HF, check
that every tensor survived byte for byte, greedy-decode a chat prompt with the KV/GDN caches, and
check that the exported model gives the source's logits on the prompt and its continuation and
that full recomputation gives the decoded tokens.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.console import Console
from rich.table import Table

from clover_jax.api import load_hf, save_hf
from clover_jax.bridge.convert import convert_hf_to_orbax, export_orbax_to_hf
from clover_jax.model.clover_model import create_model
from clover_jax.run_config import RunConfig
from clover_jax.bridge.safetensors_io import SafetensorsIndex
from clover_jax.bridge.tokenizer import load_tokenizer, save_tokenizer


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def compare_tensors(a_dir: Path, b_dir: Path) -> tuple[int, list[str]]:
    """(number of tensors compared, names that differ in name set, dtype, shape or bytes)."""
    a, b = SafetensorsIndex(a_dir), SafetensorsIndex(b_dir)
    bad = sorted(set(a.keys()) ^ set(b.keys()))
    for k in sorted(set(a.keys()) & set(b.keys())):
        x, y = a.get(k), b.get(k)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            bad.append(k)
    return len(a.keys()), bad


def greedy_decode(model, prompt_ids: list[int], max_new: int) -> list[int]:
    """Cached greedy decoding: one prefill, then one `extend` per token (jitted, fixed shapes)."""
    cache = model.init_cache(1, len(prompt_ids) + max_new)
    step = nnx.jit(lambda m, x, c: m.extend(x, c))
    logits, cache = step(model, jnp.asarray([prompt_ids]), cache)
    out = []
    for _ in range(max_new):
        tok = int(jnp.argmax(logits[0, -1]))
        out.append(tok)
        logits, cache = step(model, jnp.asarray([[tok]]), cache)
    return out


def run_demo(run: RunConfig) -> int:
    console = Console()
    cfg, d = run.model, run.demo
    root = Path(d.out_dir).resolve()
    src, ckpt, exp = root / "hf_source", root / "orbax", root / "hf_export"
    timings: dict[str, float] = {}

    def step(name: str):
        console.print(f"[bold cyan]>[/] {name}")
        return time.perf_counter()

    t = step(f"building a random {cfg.num_hidden_layers}-layer Qwen3.6-shaped model "
             f"(hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {cfg.num_experts} experts)")
    model = create_model(cfg, seed=d.seed)
    tok = load_tokenizer(None)
    timings["build model + tokenizer"] = time.perf_counter() - t

    t = step(f"writing hub-style HF checkpoint -> {src}")
    save_hf(model, cfg, src, dtype=jnp.dtype(d.weights_dtype), expert_layout=d.expert_layout, prefix=d.prefix,
            overwrite=d.overwrite)
    save_tokenizer(tok, src)
    timings["write HF source"] = time.perf_counter() - t

    t = step(f"launch.py convert --hf {src} --out {ckpt}")
    convert_hf_to_orbax(src, ckpt, overwrite=d.overwrite)
    timings["convert HF -> Orbax"] = time.perf_counter() - t

    t = step(f"launch.py export --checkpoint {ckpt} --out {exp} --format qwen")
    export_orbax_to_hf(ckpt, exp, format="qwen", overwrite=d.overwrite)
    timings["export Orbax -> HF"] = time.perf_counter() - t

    t = step("checking every tensor of the export against the source")
    n_tensors, bad = compare_tensors(src, exp)
    timings["compare tensors"] = time.perf_counter() - t

    t = step("loading both HF dirs")
    messages = [{"role": "user", "content": d.prompt}]
    prompt_text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt_text, add_special_tokens=False)
    _, m_src = load_hf(src)
    _, m_exp = load_hf(exp)
    timings["load"] = time.perf_counter() - t

    t = step(f"greedy decoding {d.max_new_tokens} tokens of a chat prompt with caches (the export)")
    new = greedy_decode(m_exp, list(prompt_ids), d.max_new_tokens)
    timings["decode"] = time.perf_counter() - t

    # one jitted full forward (the two models share a graph), on the prompt and its continuation:
    # source vs export logits, and the decoded tokens recomputed without caches
    t = step("comparing logits source vs export, and recomputing the decoded tokens without caches")
    forward = nnx.jit(lambda m, x: m(x))
    ids = jnp.asarray([list(prompt_ids) + new])
    full = forward(m_exp, ids)
    logit_diff = float(jnp.max(jnp.abs(forward(m_src, ids) - full)))
    recomputed = [int(x) for x in np.asarray(jnp.argmax(full[0, len(prompt_ids) - 1:-1], axis=-1))]
    timings["logits + recompute"] = time.perf_counter() - t

    table = Table(title="Clover-JAX demo: HF -> Orbax -> HF round trip")
    table.add_column("step")
    table.add_column("seconds", justify="right")
    for k, v in timings.items():
        table.add_row(k, f"{v:.2f}")
    console.print(table)
    ok_bytes, ok_logits, ok_decode = not bad, logit_diff == 0.0, recomputed == new
    summary = {
        "tensors": n_tensors, "tensors_differing": bad, "source_bytes": _dir_bytes(src),
        "export_bytes": _dir_bytes(exp), "max_logit_diff": logit_diff, "prompt_tokens": len(prompt_ids),
        "generated_ids": new, "generated_text": tok.decode(new), "cached_equals_recomputed": ok_decode,
        "timings_s": timings, "jax_backend": jax.default_backend(),
    }
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(f"tensors byte-identical: {n_tensors - len(bad)}/{n_tensors}   "
                  f"max |logit diff| source vs export: {logit_diff:.3g}   "
                  f"cached decode == recompute: {ok_decode}")
    console.print(f"generated (random weights, so gibberish): {summary['generated_text']!r}")
    console.print(f"summary: {root / 'summary.json'}")
    if not (ok_bytes and ok_logits and ok_decode):
        console.print("[bold red]demo FAILED[/]: see the line above")
        return 1
    console.print("[bold green]demo passed[/]")
    return 0
