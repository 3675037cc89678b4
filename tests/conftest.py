"""Test session setup: CPU only (libtpu is installed for AOT compiles; keep it from probing for
chips), 8 simulated devices for sharding tests, fp32 matmuls at full precision."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
