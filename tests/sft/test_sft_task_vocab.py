"""The recipe's task-restricted vocabulary (sft.task_vocab) on a small, fast variant of
configs/research_tool.yaml (the research model's recipe: sft.data.tool_task on BFCL schemas, the
Qwen3.6 tokenizer cut to the task, a compact chat template): one in-process `run_sft` of 24 steps.

- the model's embedding has the subset's rows (+ the mask token), its eos / pad ids are the subset
  ids of <|im_end|> / <|endoftext|>; the export ships the subset tokenizer and its map;
- training lowers the held-out masked CE, below the uniform predictor's log V;
- the scorer (`calibrate._metrics`: validity, argument accuracy, exact match) on hand-made outputs
  of held-out prompts and on every held-out reference, through the subset tokenizer; a turn without
  calls is right only with the reference's exact reply;
- a rebuild from other data into the same dir is refused (a resume must see the same vocabulary).
"""

import json
import math
from pathlib import Path

import pytest

from clover_jax.yaml_config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
BFCL = ROOT.parent / "shared" / "data" / "bfcl" / "BFCL_v4_simple_python.json"
STEPS = 24


def _overrides(run: Path, n_records: int = 600) -> list[str]:
    return [
        f"logging.run_dir={run}", f"export.dir={run}/hf", "logging.wandb.mode=disabled", "logging.console_every=0",
        f"data_root={ROOT.parent / 'shared' / 'data'}",
        f"vocab_subset.chat_template={ROOT / 'configs' / 'templates' / 'tools_compact.jinja'}",
        "model.hidden_size=32", "model.moe_intermediate_size=16", "model.shared_expert_intermediate_size=16",
        "model.block_size=16", "data.seq_len=128", "data.batch_size=4", "data.eval_fraction=0.05",
        "data.sources=[{name: tool_task, format: tool_task, path: bfcl/BFCL_v4_simple_python.json, "
        f"options: {{n_records: {n_records}, seed: 0}}}}]",
        f"train.steps={STEPS}", "train.eval_every=8", "train.log_every=1", "optimizer.warmup_steps=4",
        "optimizer.lr=1.0e-2", "eval.max_batches=2", "eval.t_values=[0.5]", "checkpoint.every_steps=0",
        "checkpoint.save_final=false", "count_flops=false", "devices=1",
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from sft.config import load_sft_config
    from sft.recipe import run_sft

    run = tmp_path_factory.mktemp("task_vocab") / "run"
    cfg = load_sft_config(ROOT / "configs" / "research_tool.yaml", _overrides(run))
    res = run_sft(cfg, print_fn=lambda s: None)
    return cfg, run, res


def test_model_and_export_use_the_subset(trained):
    from clover_jax.bridge.tokenizer import load_tokenizer
    from clover_jax.bridge.vocab_subset import load_vocab_subset
    from clover_jax.decoding.cli import load_checkpoint

    cfg, run, res = trained
    assert res.step == STEPS and res.export_dir is not None
    subset = load_vocab_subset(run / "tokenizer")
    base = load_tokenizer(None)
    mcfg, model, tok = load_checkpoint(res.export_dir)
    assert mcfg.vocab_size == math.ceil((len(subset) + 1) / 8) * 8 < 4096
    # the output rows: the tied embedding (the recipe ties them) or an lm_head
    head = model.embed.embedding[...].T if mcfg.tie_word_embeddings else model.lm_head.kernel[...]
    assert head.shape[-1] == mcfg.vocab_size and model.embed.embedding[...].shape[0] == mcfg.vocab_size
    assert mcfg.mask_token_id == len(subset) and tok.convert_tokens_to_ids("<|mask|>") == len(subset)
    eos = mcfg.eos_token_id[0] if isinstance(mcfg.eos_token_id, tuple) else mcfg.eos_token_id
    assert tok.convert_ids_to_tokens(eos) == "<|im_end|>" and tok.convert_ids_to_tokens(mcfg.pad_token_id) == "<|endoftext|>"
    assert subset.to_base([eos])[0] == base.convert_tokens_to_ids("<|im_end|>")
    assert load_vocab_subset(res.export_dir) is not None  # the map travels with the checkpoint
    assert tok.chat_template == (ROOT / "configs" / "templates" / "tools_compact.jinja").read_text()


def test_training_lowers_the_held_out_ce(trained):
    cfg, run, _ = trained
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    ev = [r["eval/ce_t0.5"] for r in rows if "eval/ce_t0.5" in r]
    vocab = json.loads((run / "hf" / "config.json").read_text())["vocab_size"]
    assert len(ev) == 3 and ev[-1] < ev[0] - 0.5 and ev[-1] < math.log(vocab) - 1.0, ev


def test_scorer_on_hand_made_outputs(tmp_path):
    """No training needed: the subset tokenizer the recipe builds for the task."""
    from clover_jax.bridge.tokenizer import load_tokenizer
    from clover_jax.decoding.calibrate import _metrics, build_examples
    from sft.config import load_sft_config
    from sft.data import tool_task as tt
    from sft.task_vocab import build_task_vocab

    tok = load_tokenizer(build_task_vocab(load_sft_config(ROOT / "configs" / "research_tool.yaml",
                                                          _overrides(tmp_path / "run")), None))
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    recs = tt.generate_records(40, 0, "heldout", tt.load_schemas(str(BFCL)))
    def first_string_arg(r):
        calls = r["messages"][1].get("tool_calls", [])
        return len(calls) == 2 and any(isinstance(v, str) for v in calls[0]["function"]["arguments"].values())

    call = next(r for r in recs if first_string_arg(r))
    talk = next(r for r in recs if not r["messages"][1].get("tool_calls"))
    ex_call, ex_talk = build_examples(tok, [call, talk])
    ref = tok.decode(ex_call.reference_ids)
    fn = call["messages"][1]["tool_calls"][0]["function"]
    key, value = next((k, v) for k, v in fn["arguments"].items() if isinstance(v, str))
    wrong_value = ref.replace(f'"{key}": {json.dumps(value)}', f'"{key}": {json.dumps(f"x{value}")}', 1)
    upper = ref.replace(f'"{key}": {json.dumps(value)}', f'"{key}": {json.dumps(value.upper() + "  ")}', 1)
    unoffered = ref.replace(json.dumps(fn["name"]), json.dumps("no_such_tool"), 1)
    swapped = ref.split("</tool_call>\n")  # the two calls in the other order: still a match
    reordered = swapped[1].replace("</tool_call><|im_end|>", "") + "</tool_call>\n" + swapped[0] + "</tool_call><|im_end|>"
    assert ref not in (wrong_value, upper, unoffered, reordered)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    cases = {  # output -> (valid, bfcl, exact), by hand
        ref: (1.0, 1.0, 1.0), wrong_value: (1.0, 0.0, 0.0), unoffered: (0.0, 0.0, 0.0),
        upper: (1.0, 1.0, 0.0),  # BFCL compares strings case-insensitively after stripping
        reordered: (1.0, 1.0, 0.0), "Hello!<|im_end|>": (0.0, 0.0, 0.0),
        ref.split("</tool_call>")[0]: (0.0, 0.0, 0.0),  # an unclosed call
    }
    for out, want in cases.items():
        m = _metrics(tok, ex_call, enc(out), eos, None)
        assert (m["valid"], m["bfcl"], m["exact"]) == want, (out, m)
    reply = tok.decode(ex_talk.reference_ids)
    content = talk["messages"][1]["content"]
    other = reply.replace(content, content.rsplit(" ", 1)[0] + " Zed.")  # the last word wrong
    assert other != reply
    # a turn without calls scores by its exact reply: another text is valid (no markup) but wrong
    for out, want in {reply: (1.0, 1.0, 1.0), "Sure.<|im_end|>": (1.0, 0.0, 0.0), ref: (0.0, 0.0, 0.0),
                      other: (1.0, 0.0, 0.0)}.items():
        m = _metrics(tok, ex_talk, enc(out), eos, None)
        assert (m["valid"], m["bfcl"], m["exact"]) == want, (out, m)
    # every held-out reference, as the model would write it (its token ids), scores 1 on all three
    for ex in build_examples(tok, recs):
        m = _metrics(tok, ex, ex.reference_ids, eos, None)
        assert (m["valid"], m["bfcl"], m["exact"]) == (1.0, 1.0, 1.0), m["text"]


def test_a_rebuild_from_other_data_is_refused(trained, tmp_path):
    from sft.config import load_sft_config
    from sft.task_vocab import build_task_vocab

    _, run, _ = trained
    other = load_sft_config(ROOT / "configs" / "research_tool.yaml",
                            _overrides(run, n_records=20) + [f"vocab_subset.dir={run}/tokenizer"])
    with pytest.raises(ConfigError, match="holds a different task vocabulary"):
        build_task_vocab(other, None)
    again = load_sft_config(ROOT / "configs" / "research_tool.yaml", _overrides(run))
    assert build_task_vocab(again, None) == run / "tokenizer"  # the same data: accepted
