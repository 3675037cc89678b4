"""`load_hf` / `save_hf`: an HF checkpoint dir <-> a ready `CloverModel` (docs/design.md 6)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.bridge import convert
from clover_jax.config import ModelConfig
from clover_jax.model.clover_model import CloverModel, model_from_params, model_to_params
from clover_jax.model.params import stack_layers, unstack_layers

_DTYPE_NAMES = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16"}


def _dtype_name(dtype: Any) -> str:
    try:
        return _DTYPE_NAMES[jnp.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} unsupported (float32 or bfloat16)") from None


def load_hf(
    path: str | Path, *, dtype: Any = jnp.float32, mode: Literal["ar", "block"] | None = None, **runtime: Any
) -> tuple[ModelConfig, CloverModel]:
    """Reads an HF dir (Qwen3.6 or Clover; hub layout or `save_pretrained` layout) into a model whose
    params and compute use `dtype` (GDN `A_log` / `dt_bias` / Clover scalars stay fp32).

    `mode`: None = the checkpoint's (`clover_moe` -> "block", Qwen -> "ar"); "block" on a Qwen
    checkpoint starts the Clover params at their init values, "ar" on a Clover checkpoint drops them
    (each says so in the log). `runtime` overrides ModelConfig fields (e.g. `gdn_chunk_size=32`,
    `moe_impl="dense"`, `mask_token_id=...`, `bd_alpha_init=...`; the init values come from these)."""
    name = _dtype_name(dtype)
    cfg, tree = convert.read_hf(path, mode=mode, dtype=name, param_dtype=name, **runtime)
    return cfg, model_from_params(cfg, stack_layers(cfg, tree))


def save_hf(
    model: CloverModel, config: ModelConfig, out_dir: str | Path, *,
    format: Literal["qwen", "clover"] | None = None, dtype: Any | None = jnp.bfloat16, **kwargs: Any,
) -> Path:
    """Writes `model` as an HF dir (sharded safetensors + index, config.json, generation_config.json;
    `format="clover"` also the tokenizer with the mask token). `format` None: "clover" for a
    block-mode model, "qwen" for an AR one (see `convert.write_hf`). Weights are cast to `dtype` (None
    keeps the params' dtypes); `A_log`, the GDN norm and the Clover scalars stay fp32 as in the
    Qwen3.6 / Clover checkpoints. `kwargs` go to `convert.write_hf` (expert_layout, prefix,
    max_shard_bytes, source_dir, overwrite, provenance). The directory is written atomically, a
    non-empty `out_dir` needs `overwrite=True` (it is then replaced whole), and a NaN / Inf weight
    fails the export naming its tensor."""
    params = model_to_params(model)
    if dtype is None:
        tree = unstack_layers(config, params)  # leaves go to host one layer at a time in write_hf
    else:
        # every leaf is cast on host anyway: fetch first, so unstacking slices numpy (no per-shape
        # device op compiles) and the cast is ml_dtypes' round-to-nearest-even, as XLA's
        tree = unstack_layers(config, jax.device_get(params))
        tree = jax.tree_util.tree_map_with_path(lambda p, x: _cast_leaf(p, x, dtype), tree)
    return convert.write_hf(config, tree, out_dir, format=format, **kwargs)


def _cast_leaf(path: tuple, x: Any, dtype: Any) -> Any:
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    if "A_log" in keys or "bd_gdn_softmax_scalars" in keys or ("gdn" in keys and "norm" in keys):
        return np.asarray(x, np.float32)
    return np.asarray(x).astype(jnp.dtype(dtype))
