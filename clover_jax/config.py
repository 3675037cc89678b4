"""Model configuration: the frozen `ModelConfig`, named presets, and HF `config.json` conversion.

The field names follow HF `Qwen3_5MoeTextConfig` where one exists, so a reader can map them one to
one; runtime choices (compute dtype, chunk size, MoE implementation) live beside them with defaults.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

LINEAR = "linear_attention"
FULL = "full_attention"
_LAYER_TYPES = (LINEAR, FULL)

#: HF model types this config reads. `clover_moe` carries the same text fields (plus block-diffusion
#: fields that the block-diffusion issue adds).
HF_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "clover_moe")
#: The `architectures` entry of a `clover_moe` config.json: the HF class llama.cpp's Clover converter
#: registers (docs/design.md 2.2).
CLOVER_ARCHITECTURE = "CloverMoeModelLM"
#: Block-diffusion fields a `clover_moe` config.json carries besides the text fields (docs/design.md 3).
CLOVER_HF_FIELDS = ("block_size", "mask_token_id", "logits_shift", "bd_alpha_init", "bd_beta_init", "bd_gamma_init",
                    "moe_block_coreset", "response_block_align")


class ModelConfigError(ValueError):
    """A model config that cannot describe a valid model; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture (HF names) plus runtime options of the Qwen3.6 / Clover text model.

    Invariants (checked in `__post_init__`): `len(layer_types) == num_hidden_layers`; query heads are a
    multiple of KV heads; GDN value heads a multiple of key heads; top-k <= experts.
    """

    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    layer_types: tuple[str, ...] = ()
    # full attention
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    partial_rotary_factor: float = 0.25
    rope_theta: float = 1e7
    mrope_section: tuple[int, ...] = (11, 11, 10)
    # Gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # MoE
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    router_aux_loss_coef: float = 0.001
    # misc HF fields
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = 248046
    pad_token_id: int | None = None
    # runtime (not in HF config.json)
    dtype: Literal["float32", "bfloat16"] = "float32"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    gdn_chunk_size: int = 64
    gdn_backend: Literal["auto", "pallas", "reference"] = "auto"
    # full attention of the training streams: "splash" = the TPU splash kernel, "flash" = our GPU
    # (Pallas Triton) flash kernel (both interpreted off their platform), "reference" = dense jnp,
    # "auto" = splash on TPU, flash on GPU, else reference (pallas_kernels.attention.ops)
    attn_backend: Literal["auto", "splash", "flash", "reference"] = "auto"
    moe_impl: Literal["auto", "ragged", "blocked", "capacity", "dense"] = "auto"
    moe_dispatch: Literal["ragged_a2a", "ring"] = "ragged_a2a"  # expert-parallel dispatch under a mesh
    # order of a row's tokens over the `context` mesh axis (used only when it is > 1): "contiguous"
    # shards, or "zigzag" (shard i holds row pieces i and 2n-1-i: equal causal attention work per
    # shard; pallas_kernels.context.layout)
    context_layout: Literal["contiguous", "zigzag"] = "contiguous"
    scan_layers: bool = True
    remat: str = "none"  # activation checkpointing of each layer group: a clover_jax.parallel.remat policy name
    # block diffusion (docs/design.md 3; written to config.json of `clover_moe` checkpoints)
    mode: Literal["ar", "block"] = "ar"  # "block" adds the Clover parameters to every GDN layer
    block_size: int | tuple[int, ...] = 32  # a tuple: one size drawn per training step
    mask_token_id: int | None = None
    logits_shift: bool = True  # position p is predicted from p-1 (Dream lineage)
    bd_alpha_init: float | None = None  # in-block softmax temperature; None = sqrt(linear_key_head_dim)
    bd_beta_init: float = 0.0  # history-unit logit offset
    bd_gamma_init: float = 1.0  # history-unit log(B) coefficient (block-size calibration)
    # block coreset routing (clover_jax.model.moe_coreset): the noisy tokens of a block (training's
    # noisy stream, decoding's block steps) take their top-k among the block's C experts of largest
    # router mass; None = free routing
    moe_block_coreset: int | None = None
    # trained with every assistant response starting on the block grid (data.align_responses: block):
    # the alignment in tokens, 0 = not; the decoder then pads each prompt to a multiple of it
    response_block_align: int = 0
    # LoRA adapters (clover_jax.model.lora): rank 0 = none; targets are regexes over base weight paths
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()  # empty: clover_jax.model.lora.DEFAULT_TARGETS
    lora_dropout: float = 0.0  # the Dense adapters' input dropout while training (not the experts')

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
                     "moe_intermediate_size", "shared_expert_intermediate_size", "gdn_chunk_size"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        bad = [t for t in self.layer_types if t not in _LAYER_TYPES]
        if bad:
            raise ModelConfigError(f"layer_types: unknown type {bad[0]!r} (allowed: {_LAYER_TYPES})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError("num_experts_per_tok must be in [1, num_experts]")
        c = self.moe_block_coreset
        if c is not None and not self.num_experts_per_tok <= c <= self.num_experts:
            raise ModelConfigError(f"moe_block_coreset {c} must be null or in [num_experts_per_tok="
                                   f"{self.num_experts_per_tok}, num_experts={self.num_experts}]")
        if self.lora_rank < 0:
            raise ModelConfigError(f"lora_rank must be >= 0 (0: no adapters), got {self.lora_rank}")
        if self.lora_rank and self.lora_alpha <= 0:
            raise ModelConfigError(f"lora_alpha must be > 0, got {self.lora_alpha}")
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ModelConfigError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.response_block_align < 0:
            raise ModelConfigError(f"response_block_align must be >= 0, got {self.response_block_align}")
        sizes = self.block_size if isinstance(self.block_size, tuple) else (self.block_size,)
        if isinstance(self.block_size, list):
            object.__setattr__(self, "block_size", tuple(self.block_size))
            sizes = self.block_size
        if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes):
            raise ModelConfigError(f"block_size must be a positive int or a non-empty list of them, got {self.block_size!r}")
        from pallas_kernels.attention.ops import ATTN_BACKENDS

        if self.attn_backend not in ATTN_BACKENDS:
            raise ModelConfigError(f"attn_backend: unknown backend {self.attn_backend!r} (known: {', '.join(ATTN_BACKENDS)})")
        from pallas_kernels.context.layout import LAYOUTS

        if self.context_layout not in LAYOUTS:
            raise ModelConfigError(f"context_layout: unknown layout {self.context_layout!r} (known: {', '.join(LAYOUTS)})")
        from clover_jax.parallel.remat import POLICIES  # jax only; no model import

        if self.remat not in POLICIES:
            raise ModelConfigError(f"remat: unknown policy {self.remat!r} (known: {', '.join(POLICIES)})")
        if self.mode not in ("ar", "block"):
            raise ModelConfigError(f"mode must be 'ar' or 'block', got {self.mode!r}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ModelConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ModelConfigError(
                f"partial_rotary_factor {self.partial_rotary_factor} gives rotary dim {self.rotary_dim}, "
                f"which must be even and <= head_dim {self.head_dim}"
            )

    # derived sizes -----------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_channels(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def group_size(self) -> int:
        """Length of the repeating layer pattern the stack scans over (4 for Qwen3.6; all layers if
        the pattern does not repeat)."""
        n = self.num_hidden_layers
        for p in range(1, n + 1):
            if n % p == 0 and all(self.layer_types[i] == self.layer_types[i % p] for i in range(n)):
                return p
        return n

    @property
    def num_groups(self) -> int:
        return self.num_hidden_layers // self.group_size

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """`block_size` as a tuple (one entry unless multi-size training)."""
        return self.block_size if isinstance(self.block_size, tuple) else (self.block_size,)

    @property
    def bd_scalar_init(self) -> tuple[float, float, float]:
        """Init (alpha, beta, gamma) of `bd_gdn_softmax_scalars` (docs/design.md 3.2 B)."""
        alpha = self.linear_key_head_dim ** 0.5 if self.bd_alpha_init is None else self.bd_alpha_init
        return float(alpha), float(self.bd_beta_init), float(self.bd_gamma_init)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # HF conversion -----------------------------------------------------------------------------
    def to_hf_dict(self, model_type: str = "qwen3_5_moe_text") -> dict[str, Any]:
        """The HF text `config.json` dict. `qwen3_5_moe_text` loads in `Qwen3_5MoeForCausalLM`;
        `clover_moe` is the same text fields plus the block-diffusion ones (`CLOVER_HF_FIELDS`;
        `block_size` as an int or a list). `mode` is not written: `clover_moe` means block mode."""
        if model_type not in HF_MODEL_TYPES or model_type == "qwen3_5_moe":
            raise ModelConfigError(f"cannot write model_type {model_type!r}")
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        out = {
            "architectures": [CLOVER_ARCHITECTURE if model_type == "clover_moe" else "Qwen3_5MoeForCausalLM"],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_section": list(self.mrope_section),
            },
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "dtype": "bfloat16",
        }
        if model_type == "clover_moe":
            out["num_shared_experts"] = 1  # what llama.cpp's Clover converter reads (Qwen3.6: one)
            for name in CLOVER_HF_FIELDS:
                value = getattr(self, name)
                out[name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], *, source: str = "config.json", **runtime: Any) -> ModelConfig:
        """Reads an HF config dict (`qwen3_5_moe` composite: its `text_config`; `qwen3_5_moe_text`;
        `clover_moe`). Unknown model types and unsupported features fail naming `source`.

        `clover_moe` gives `mode="block"` and reads `CLOVER_HF_FIELDS` (absent ones keep their
        defaults; no `mask_token_id` is fine); the Qwen types give `mode="ar"` and ignore those fields.
        `runtime` overrides anything, `mode` included (e.g. a Qwen checkpoint read in block mode)."""
        model_type = hf.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise ModelConfigError(
                f"{source}: unknown model_type {model_type!r} (supported: {', '.join(HF_MODEL_TYPES)})"
            )
        text = hf.get("text_config", hf) if model_type == "qwen3_5_moe" else hf
        if model_type == "qwen3_5_moe" and "text_config" not in hf:
            raise ModelConfigError(f"{source}: model_type 'qwen3_5_moe' without a text_config")
        if int(text.get("num_shared_experts", 1)) != 1:
            raise ModelConfigError(f"{source}: num_shared_experts={text['num_shared_experts']} unsupported "
                                   "(this architecture has exactly one shared expert)")
        if text.get("attention_bias"):
            raise ModelConfigError(f"{source}: attention_bias=true is not supported by this architecture")
        if text.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"{source}: hidden_act {text.get('hidden_act')!r} unsupported (silu only)")
        rope = dict(text.get("rope_parameters") or {})
        for k in ("rope_theta", "partial_rotary_factor"):  # older configs keep them at top level
            if k in text and k not in rope:
                rope[k] = text[k]
        if rope.get("rope_type", "default") != "default":
            raise ModelConfigError(f"{source}: rope_type {rope.get('rope_type')!r} unsupported")
        defaults = cls()
        n_layers = int(text.get("num_hidden_layers", defaults.num_hidden_layers))
        layer_types = text.get("layer_types") or default_layer_types(
            n_layers, int(text.get("full_attention_interval", 4))
        )
        eos = text.get("eos_token_id", defaults.eos_token_id)
        clover = model_type == "clover_moe"
        # `mode` is never read from the file (the model type says it); the block-diffusion fields
        # only from a Clover config (a Qwen config that happens to carry them stays AR-default)
        skip = {"layer_types", "eos_token_id", "dtype", "mode"} | (set() if clover else set(CLOVER_HF_FIELDS))
        kwargs: dict[str, Any] = {
            f.name: text[f.name] for f in dataclasses.fields(cls) if f.name in text and f.name not in skip
        }
        if clover and isinstance(kwargs.get("block_size"), list):
            kwargs["block_size"] = tuple(kwargs["block_size"])
        kwargs.update(
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            rope_theta=float(rope.get("rope_theta", defaults.rope_theta)),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", defaults.partial_rotary_factor)),
            mrope_section=tuple(rope.get("mrope_section", defaults.mrope_section)),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            mode="block" if clover else "ar",
        )
        kwargs.update(runtime)
        try:
            return cls(**kwargs)
        except (ModelConfigError, TypeError) as e:
            raise ModelConfigError(f"{source}: {e}") from None

    @classmethod
    def from_hf_file(cls, path: str | Path, **runtime: Any) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{path}: no config.json")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(hf, source=str(path), **runtime)


def default_layer_types(num_layers: int, full_attention_interval: int = 4) -> tuple[str, ...]:
    """HF's default pattern: every `interval`-th layer is full attention, the rest GDN."""
    return tuple(FULL if (i + 1) % full_attention_interval == 0 else LINEAR for i in range(num_layers))


def _pattern(n_linear: int, n_full: int, repeats: int) -> tuple[str, ...]:
    return ((LINEAR,) * n_linear + (FULL,) * n_full) * repeats


PRESETS: dict[str, ModelConfig] = {
    # docs/design.md 2 table
    "qwen3.6-35b-a3b": ModelConfig(),
    # Same backbone plus the block-diffusion parameters; <|mask|> is the first unused row (248077).
    "clover-35b-a3b": ModelConfig(max_position_embeddings=131072, mode="block", block_size=32,
                                  mask_token_id=248077),
    # `bench/forward.py` config: hidden 256, 6 GDN + 2 attention, 16 experts top-4, vocab 8192.
    "small-cpu": ModelConfig(
        vocab_size=8192, hidden_size=256, num_hidden_layers=8, layer_types=_pattern(3, 1, 2),
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, mrope_section=(4, 4, 0),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=256,
        max_position_embeddings=4096, eos_token_id=1,
    ),
    # The embedded default (docs/quickstart.md): Qwen3.6-shaped with the real 248320-row vocabulary and tokenizer,
    # small enough to convert, export and decode on 2 CPU cores in seconds.
    "tiny-qwen3.6": ModelConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        mrope_section=(2, 2, 0), linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, max_position_embeddings=4096, pad_token_id=248044,
    ),
    # Unit tests: fast to compile, every feature exercised (GQA 2, dk != dv, 2 groups of 2 layers).
    "tiny": ModelConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, layer_types=_pattern(1, 1, 2),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mrope_section=(1, 1, 0),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=24,
        max_position_embeddings=512, eos_token_id=1, gdn_chunk_size=16,
    ),
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        import difflib

        near = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ModelConfigError(f"unknown model preset {name!r}{hint}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def param_count(cfg: ModelConfig) -> int:
    """Parameter count of the text model (no MTP), for logs and memory plans."""
    d = cfg.hidden_size
    attn = d * cfg.num_attention_heads * cfg.head_dim * 2 + 2 * d * cfg.num_key_value_heads * cfg.head_dim
    attn += cfg.num_attention_heads * cfg.head_dim * d + 2 * cfg.head_dim
    gdn = d * (cfg.gdn_conv_channels + cfg.gdn_value_dim + 2 * cfg.linear_num_value_heads)
    gdn += cfg.gdn_conv_channels * cfg.linear_conv_kernel_dim + 2 * cfg.linear_num_value_heads
    gdn += cfg.linear_value_head_dim + cfg.gdn_value_dim * d
    moe = d * cfg.num_experts + 3 * cfg.num_experts * d * cfg.moe_intermediate_size
    moe += 3 * d * cfg.shared_expert_intermediate_size + d
    total = 0
    for t in cfg.layer_types:
        total += (attn if t == FULL else gdn) + moe + 2 * d
    heads = 1 if cfg.tie_word_embeddings else 2
    return total + heads * cfg.vocab_size * d + d


__all__ = [
    "FULL", "HF_MODEL_TYPES", "LINEAR", "ModelConfig", "ModelConfigError", "PRESETS",
    "default_layer_types", "get_preset", "param_count",
]
