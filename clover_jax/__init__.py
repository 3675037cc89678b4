"""Clover-JAX: the Qwen3.6 / Clover block-diffusion MoE model in JAX/Flax NNX."""

from clover_jax.api import load_hf, save_hf
from clover_jax.config import PRESETS, ModelConfig, get_preset
from clover_jax.model.clover_model import CloverModel, create_model

__all__ = ["CloverModel", "ModelConfig", "PRESETS", "create_model", "get_preset", "load_hf", "save_hf"]
