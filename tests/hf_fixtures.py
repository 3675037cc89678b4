"""Tiny random HF Qwen3.5-MoE checkpoints for bridge and parity tests (torch + transformers).

Import as ``from tests.hf_fixtures import ...`` (tests/ is a package; pytest puts the repository root on sys.path).

Writers are independent of our own safetensors code (they use `safetensors.torch` directly), so a
test that reads their output with `clover_jax` checks our reader against files HF-style tools make.

    model = make_hf_model(seed=0, hidden_size=64)        # every parameter randomised
    write_save_pretrained(model, d1)                     # per-expert layout, prefix `model.`
    write_fused_hub(model, d2, max_shard_bytes=20_000)   # hub layout: `model.language_model.`, fused
                                                         # experts, bf16 (+ fp32 A_log / GDN norm),
                                                         # several shards + index, mtp/visual extras
    tensors = read_all_tensors(d2)                       # {name: np.ndarray}, bf16 as ml_dtypes
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file as np_load_file
from safetensors.torch import save_file as torch_save_file
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

#: Small but with every feature: GQA 4:2, GDN dk 8 != dv 12 (key dim 16 != value dim 48), 2 key /
#: 4 value heads, 4 layers in a 2-layer repeating pattern, 4 experts top-2, shared width != expert width.
TINY_HF_CONFIG: dict[str, Any] = dict(
    vocab_size=128, hidden_size=32, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention"] * 2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=12, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0]},
    bos_token_id=None, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
)

#: What the hub keeps in fp32 when everything else is bf16.
HUB_FP32_SUFFIXES = ("linear_attn.A_log", "linear_attn.norm.weight")

TOKENIZER_FILES = {
    "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}),
    "tokenizer_config.json": json.dumps({"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>"}),
    "vocab.json": json.dumps({"a": 0, "b": 1}),
    "merges.txt": "#version: 0.2\na b\n",
    "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
}


def tiny_hf_config(**overrides: Any) -> Qwen3_5MoeTextConfig:
    kw = {**TINY_HF_CONFIG, **overrides}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = kw["num_hidden_layers"]
        kw["layer_types"] = (["linear_attention", "full_attention"] * n)[:n]
    return Qwen3_5MoeTextConfig(**kw)


@torch.no_grad()
def randomise_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random (norm weights, A_log, dt_bias too: default inits hide layout bugs)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen)))
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        elif name.endswith("linear_attn.norm.weight"):  # plain gated norm, weight ~ 1
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        elif p.ndim == 1:  # zero-centred RMSNorms (weight ~ 0)
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith("embed_tokens.weight"):
            p.copy_(torch.randn(p.shape, generator=gen))
        else:  # [.., out, in] (or conv [C, 1, K]): fan-in scaled so activations stay O(1)
            fan_in = p.shape[-1]
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
    return model


def make_hf_model(
    seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides: Any
) -> Qwen3_5MoeForCausalLM:
    """A randomised tiny `Qwen3_5MoeForCausalLM` in eval mode (eager attention, deterministic)."""
    cfg = tiny_hf_config(**config_overrides)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    randomise_(model, seed)
    return model.to(dtype)


def write_save_pretrained(model: Qwen3_5MoeForCausalLM, out_dir: str | Path) -> Path:
    """`save_pretrained` dir: per-expert tensors, prefix `model.`, one `model.safetensors`."""
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def hub_tensors(
    model: Qwen3_5MoeForCausalLM, *, dtype: torch.dtype = torch.bfloat16, extras: bool = True
) -> dict[str, torch.Tensor]:
    """The model's tensors named and typed as on the hub: `model.language_model.` prefix, fused experts
    (as held in memory), `dtype` except fp32 A_log / GDN norm; plus fake `mtp.*` and `model.visual.*`."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        if "rotary_emb" in name:
            continue
        key = "model.language_model." + name[len("model."):] if name.startswith("model.") else name
        keep_fp32 = name.endswith(HUB_FP32_SUFFIXES)
        out[key] = p.detach().to(torch.float32 if keep_fp32 else dtype).contiguous()
    if extras:
        h = model.config.hidden_size
        g = torch.Generator().manual_seed(123)
        for key, shape in extra_tensor_shapes(h).items():
            out[key] = torch.randn(shape, generator=g).to(dtype)
    return out


def extra_tensor_shapes(hidden: int) -> dict[str, tuple[int, ...]]:
    """Fake MTP (per-expert, as the real Qwen3.6 MTP layer) and vision tensors: 5 mtp, 3 visual."""
    return {
        "mtp.fc.weight": (hidden, 2 * hidden),
        "mtp.norm.weight": (hidden,),
        "mtp.layers.0.input_layernorm.weight": (hidden,),
        "mtp.layers.0.mlp.experts.0.gate_proj.weight": (8, hidden),
        "mtp.layers.0.mlp.experts.0.down_proj.weight": (hidden, 8),
        "model.visual.patch_embed.proj.weight": (16, 3, 2, 2),
        "model.visual.blocks.0.attn.qkv.weight": (48, 16),
        "model.visual.merger.linear_fc1.weight": (16, 16),
    }


def write_sharded(tensors: dict[str, torch.Tensor], out_dir: str | Path, max_shard_bytes: int) -> list[str]:
    """HF-style shards `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json` (greedy by
    bytes, insertion order). Returns the shard file names."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nbytes
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for name, shard in zip(names, shards):
        torch_save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names


def composite_config(text_cfg: Qwen3_5MoeTextConfig) -> dict[str, Any]:
    """A hub-style `qwen3_5_moe` config.json dict: text part under `text_config`, a vision stub."""
    text = text_cfg.to_dict()
    text["model_type"] = "qwen3_5_moe_text"
    text.pop("architectures", None)
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5_moe", "depth": 1, "hidden_size": 16},
        "image_token_id": 100, "video_token_id": 101, "tie_word_embeddings": text_cfg.tie_word_embeddings,
    }


def write_fused_hub(
    model: Qwen3_5MoeForCausalLM,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = 16_000,
    dtype: torch.dtype = torch.bfloat16,
    extras: bool = True,
    tokenizer: bool = True,
) -> Path:
    """Hub-style dir: sharded fused-layout tensors (see `hub_tensors`), composite config.json,
    generation_config.json and (fake) tokenizer files."""
    out_dir = Path(out_dir)
    write_sharded(hub_tensors(model, dtype=dtype, extras=extras), out_dir, max_shard_bytes)
    (out_dir / "config.json").write_text(json.dumps(composite_config(model.config), indent=2))
    gen = {"bos_token_id": 7, "eos_token_id": [1, 2], "pad_token_id": 0, "do_sample": True, "temperature": 0.6}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if tokenizer:
        write_tokenizer_files(out_dir)
    return out_dir


def write_tokenizer_files(out_dir: str | Path) -> None:
    for name, text in TOKENIZER_FILES.items():
        (Path(out_dir) / name).write_text(text)


def read_all_tensors(hf_dir: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of every `*.safetensors` file in a dir (bf16 as ml_dtypes.bfloat16)."""
    out: dict[str, np.ndarray] = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(np_load_file(str(f)))
    return out


def assert_tensors_identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    """Same names, shapes, dtypes and bytes."""
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:10]
    for k in a:
        assert a[k].dtype == b[k].dtype, (k, a[k].dtype, b[k].dtype)
        assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
        assert a[k].tobytes() == b[k].tobytes(), k


@torch.no_grad()
def hf_logits(model: torch.nn.Module, input_ids: np.ndarray) -> np.ndarray:
    """Logits [B, T, V] (fp32 numpy) of an HF causal LM for int token ids [B, T]."""
    out = model(input_ids=torch.as_tensor(np.asarray(input_ids), dtype=torch.long))
    return out.logits.float().numpy()


# ------------------------------------------------------------------------------------------
# Clover checkpoints (additive; tests/bridge/test_clover_format.py). Written from docs/design.md 2.2 / 3.2
# directly with safetensors.torch, independent of clover_jax's writer.
# ------------------------------------------------------------------------------------------

CLOVER_SCALARS = "bd_gdn_softmax_scalars"
CLOVER_CONV_RIGHT = "bd_gdn_conv_right_weight"


def clover_tensors(
    text_cfg: Qwen3_5MoeTextConfig, prefix: str = "model.language_model.", *, seed: int = 0,
    scalar_cols: int | None = 3, right_shape: str = "CK", dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """Random Clover tensors for every GDN layer: `..linear_attn.bd_gdn_softmax_scalars` fp32
    [nv, scalar_cols] ([nv] for None), `..linear_attn.bd_gdn_conv_right_weight` `dtype`
    [C, K-1] ("CK") or [C, 1, K-1] ("C1K"), C = 2 * key_dim + value_dim."""
    g = torch.Generator().manual_seed(1000 + seed)
    nv = text_cfg.linear_num_value_heads
    c = 2 * text_cfg.linear_num_key_heads * text_cfg.linear_key_head_dim + nv * text_cfg.linear_value_head_dim
    k1 = text_cfg.linear_conv_kernel_dim - 1
    out: dict[str, torch.Tensor] = {}
    for i, t in enumerate(text_cfg.layer_types):
        if t != "linear_attention":
            continue
        p = f"{prefix}layers.{i}.linear_attn."
        shape = (nv,) if scalar_cols is None else (nv, scalar_cols)
        out[p + CLOVER_SCALARS] = (torch.rand(shape, generator=g) * 4 + 0.5).to(torch.float32)
        rshape = (c, k1) if right_shape == "CK" else (c, 1, k1)
        out[p + CLOVER_CONV_RIGHT] = (0.3 * torch.randn(rshape, generator=g)).to(dtype)
    return out


#: the other public naming (llama.cpp's Clover converter): per GDN layer three scalars and the right taps
SPLIT_SCALARS = ("bd_softmax_logit_scale", "bd_softmax_history_bias", "bd_softmax_history_c")
SPLIT_CONV_RIGHT = "conv_right_weight"


def split_clover_tensors(packed: dict[str, torch.Tensor], scalar_shape: str = "V") -> dict[str, torch.Tensor]:
    """The same Clover values in the split naming: each packed [nv, 3] column (alpha, beta, gamma) as
    its own tensor ([nv] for "V", [nv, 1] for "V1"), the right taps renamed as they are."""
    out: dict[str, torch.Tensor] = {}
    for key, t in packed.items():
        layer = key[: key.rindex(".") + 1]
        if key.endswith(CLOVER_SCALARS):
            for j, name in enumerate(SPLIT_SCALARS):
                col = t[:, j].clone()
                out[layer + name] = col[:, None].contiguous() if scalar_shape == "V1" else col
        elif key.endswith(CLOVER_CONV_RIGHT):
            out[layer + SPLIT_CONV_RIGHT] = t.clone()
        else:
            raise AssertionError(key)
    return out


def clover_config(text_cfg: Qwen3_5MoeTextConfig, **fields: Any) -> dict[str, Any]:
    """A `clover_moe` config.json dict: the text config's fields plus the block-diffusion `fields`
    (e.g. block_size=[4, 8], mask_token_id=200), as given."""
    d = text_cfg.to_dict()
    d.update(model_type="clover_moe", architectures=["CloverMoeModelLM"], num_shared_experts=1, **fields)
    return d


def write_clover_hub(
    model: Qwen3_5MoeForCausalLM, out_dir: str | Path, bd: dict[str, torch.Tensor], config: dict[str, Any], *,
    max_shard_bytes: int = 40_000,
) -> Path:
    """Hub-style Clover dir: `hub_tensors(model)` (bf16 + fp32 A_log / GDN norm, fused experts,
    prefix `model.language_model.`, mtp / visual extras) plus the Clover tensors `bd`, sharded,
    with `config` as config.json and a generation_config.json (no tokenizer: add one)."""
    out_dir = Path(out_dir)
    write_sharded({**hub_tensors(model), **bd}, out_dir, max_shard_bytes)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "pad_token_id": 0}))
    return out_dir


def write_small_tokenizer(out_dir: str | Path, n_words: int = 200) -> int:
    """A real (loadable) word-level HF tokenizer over `w0 .. w{n-1}` (`wi` has id i; unknown words
    map to `w0`), saved as tokenizer.json / tokenizer_config.json. Returns its size, the id a new
    added token gets."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n_words)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w1")
    tok.save_pretrained(str(out_dir))
    return len(tok)
