"""The recipe's task-restricted vocabulary option (YAML section ``vocab_subset``; issue 20).

With ``vocab_subset.enabled``, `sft.recipe.prepare` builds a subset of the data tokenizer from the
rendered records of every configured source (train and eval splits: the eval CE then sees the
tokenisation of the base), `clover_jax.bridge.vocab_subset`, writes it to ``vocab_subset.dir``
(default ``<logging.run_dir>/tokenizer``), with ``vocab_subset.chat_template`` (a Jinja file) as its
chat template when set (a compact one keeps tiny models' rows short), and trains a random-init model whose embedding and
lm_head have only those rows (plus `<|mask|>`, padded to a multiple of ``pad_to``). The token ids
of the model config (bos / eos / pad) are mapped into the subset. The export ships the subset
tokenizer (with `vocab_subset.json`, the map back to the base ids), so decoding and scoring read
plain text as with the full vocabulary.

A rerun (resume) rebuilds the subset from the same data and must get the same one: a different
one (the data changed under a checkpoint) is a ConfigError.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover_jax.yaml_config import ConfigError

__all__ = ["VocabSubsetConfig", "build_task_vocab", "subset_model_ids"]


@dataclass(frozen=True)
class VocabSubsetConfig:
    enabled: bool = False
    dir: str | None = None  # None: <logging.run_dir>/tokenizer
    chat_template: str | None = None  # a Jinja file for the subset tokenizer (None: the base's)
    pad_to: int = 8  # embedding rows rounded up to a multiple (the mask token included)

    def __post_init__(self) -> None:
        if self.pad_to < 1:
            raise ConfigError(f"vocab_subset.pad_to must be >= 1, got {self.pad_to}")


def _template(cfg: Any) -> str | None:
    path = cfg.vocab_subset.chat_template
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"vocab_subset.chat_template: {p} is not a file (a Jinja chat template)")
    return p.read_text()


def _corpus(cfg: Any, base: Any, template: str | None) -> list[str]:
    from sft.data.render import ChatRenderer
    from sft.data.sources import load_source

    renderer = ChatRenderer(base, cfg.data.think, chat_template=template)
    texts = []
    for src in cfg.data.sources:
        loaded = load_source(src, cfg.data)
        for record, _ in loaded.train + loaded.eval:
            msgs, tools = renderer.prepare(record)
            texts.append(renderer.text(msgs, tools))
    return texts


def build_task_vocab(cfg: Any, base_dir: Path | None) -> Path:
    """Builds (or checks) the subset tokenizer of `cfg`'s sources from the base tokenizer
    (`data.tokenizer`, else `base_dir`, else the built-in Qwen3.6 one); returns its dir."""
    import numpy as np

    from clover_jax.bridge.tokenizer import load_tokenizer
    from clover_jax.bridge.vocab_subset import build_vocab_subset, load_vocab_subset, save_vocab_subset

    out = Path(cfg.vocab_subset.dir or Path(cfg.logging.run_dir) / "tokenizer")
    base = load_tokenizer(cfg.data.tokenizer or base_dir)
    template = _template(cfg)
    tok, subset = build_vocab_subset(base, _corpus(cfg, base, template), chat_template=template)
    old = load_vocab_subset(out) if out.is_dir() else None
    if old is not None and not np.array_equal(old.base_ids, subset.base_ids):
        raise ConfigError(f"vocab_subset.dir: {out} holds a different task vocabulary ({len(old)} tokens) than the "
                          f"data gives now ({len(subset)}); the data changed under this run: use a new run dir")
    if old is None:
        save_vocab_subset(tok, subset, out)
    return out


def subset_model_ids(mcfg: Any, tok_dir: Path, pad_to: int) -> Any:
    """`mcfg` on the subset: vocab_size = subset + the mask token, rounded up to `pad_to`; bos /
    eos / pad ids mapped (a base id outside the subset is a ConfigError naming its token)."""
    from clover_jax.bridge.vocab_subset import load_vocab_subset

    subset = load_vocab_subset(tok_dir)
    base_index = {int(b): i for i, b in enumerate(subset.base_ids.tolist())}

    def remap(field: str, v: Any) -> Any:
        if v is None:
            return None
        ids = list(v) if isinstance(v, (tuple, list)) else [v]
        bad = [i for i in ids if int(i) not in base_index]
        if bad:
            raise ConfigError(f"model.{field}: base id {bad[0]} is not in the task vocabulary ({tok_dir}); "
                              "set it to a subset id or leave it to the base checkpoint's token")
        new = [base_index[int(i)] for i in ids]
        return tuple(new) if isinstance(v, (tuple, list)) else new[0]

    changes = {f: remap(f, getattr(mcfg, f)) for f in ("bos_token_id", "eos_token_id", "pad_token_id")}
    rows = -(-(len(subset) + 1) // pad_to) * pad_to
    return mcfg.replace(vocab_size=rows, mask_token_id=None, **changes)
