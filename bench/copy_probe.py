"""Does a tool-call checkpoint copy argument values from the prompt? (issue 20, the research model)

    python bench/copy_probe.py --checkpoint runs/research_tool/hf --eval runs/research_tool/heldout.jsonl [--n 200]

Teacher-forced next-token predictions of the clean stream (the AR path: logits at p - 1 predict
token p) over the reference turns of the held-out call turns, split by the kind of token:

- format: the markup, function name and argument keys (learnable from the format and the tools);
- value: the tokens of the argument values (their JSON text: digits, strings with quotes, true /
  false), which must be read from the user turn;
- digit: the value tokens that are digits (3-digit numbers are uniform over 13..999: a model that
  does not copy them sits near 1 in 10);
- first: the first token of each value.

Prints tokens, mean CE and argmax accuracy per kind. A model whose format accuracy is high while
digit accuracy stays near 0.1 has learned the format but no copying from the prompt; AR argument
accuracy on the call turns then stays at 0 (`launch.py calibrate`, `bfcl_accuracy_call`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from clover_jax.decoding.calibrate import EvalSetConfig, build_examples, eval_records  # noqa: E402
from clover_jax.decoding.cli import load_checkpoint  # noqa: E402

KINDS = ("format", "value", "digit", "first")


def value_spans(text: str, calls: list[dict]) -> list[tuple[int, int]]:
    """Character spans [start, end) of every argument value's JSON text in the reference `text`."""
    spans = []
    for call in calls:
        for key, value in call["arguments"].items():
            head, body = f"{json.dumps(key)}: ", json.dumps(value, ensure_ascii=False)
            at = text.find(head + body)
            if at < 0:
                raise ValueError(f"argument {key}={body} not found in the reference {text!r}")
            spans.append((at + len(head), at + len(head) + len(body)))
    return spans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="HF dir of the model (with its tokenizer)")
    ap.add_argument("--eval", required=True, help="held-out JSONL (python -m sft.data.tool_task --split heldout)")
    ap.add_argument("--n", type=int, default=200, help="records read (call turns among them are scored)")
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    _, model, tok = load_checkpoint(a.checkpoint)
    examples = [e for e in build_examples(tok, eval_records(EvalSetConfig(source="jsonl", path=a.eval, n=a.n)))
                if e.expects_call]
    width = -(-max(len(e.prompt_ids) + len(e.reference_ids) for e in examples) // 64) * 64
    forward = jax.jit(lambda ids_BT: model(ids_BT))  # one shape: rows padded at the end (causal)
    nll: dict[str, list[float]] = {k: [] for k in KINDS}
    hit: dict[str, list[bool]] = {k: [] for k in KINDS}
    for s in range(0, len(examples), a.batch):
        chunk = examples[s: s + a.batch]
        ids_BT = np.zeros((a.batch, width), np.int32)
        for i, e in enumerate(chunk):
            doc = e.prompt_ids + e.reference_ids
            ids_BT[i, : len(doc)] = doc
        logits_BTV = np.asarray(forward(jnp.asarray(ids_BT)))
        for i, e in enumerate(chunk):
            p, tgt = len(e.prompt_ids), np.asarray(e.reference_ids)
            logp = np.asarray(jax.nn.log_softmax(logits_BTV[i, p - 1: p - 1 + len(tgt)], axis=-1))
            tok_nll, tok_hit = -logp[np.arange(len(tgt)), tgt], logp.argmax(-1) == tgt
            text = tok.decode(e.reference_ids)
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            if enc["input_ids"] != e.reference_ids:
                raise ValueError(f"the reference does not re-tokenise to its ids: {text!r}")
            spans = value_spans(text, e.reference_calls)
            for j, (lo, hi) in enumerate(enc["offset_mapping"]):
                inside = [x for x, y in spans if lo < y and hi > x]
                kinds = ["value"] if inside else ["format"]
                if inside and tok.decode([int(tgt[j])]).strip().isdigit():
                    kinds.append("digit")
                if any(lo <= x for x in inside):
                    kinds.append("first")
                for k in kinds:
                    nll[k].append(float(tok_nll[j]))
                    hit[k].append(bool(tok_hit[j]))
    print(f"{a.checkpoint}: {len(examples)} call turns, teacher-forced clean stream")
    print(f"  {'tokens':<8}{'n':>7}{'CE':>8}{'acc':>8}")
    for k in KINDS:
        print(f"  {k:<8}{len(nll[k]):>7}{np.mean(nll[k]):>8.3f}{np.mean(hit[k]):>8.3f}")


if __name__ == "__main__":
    main()
