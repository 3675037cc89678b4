"""Clover-JAX: the Qwen3.6 / Clover block-diffusion MoE model in JAX/Flax NNX."""

from clover_jax.config import PRESETS, ModelConfig, get_preset

__all__ = ["ModelConfig", "PRESETS", "get_preset"]
