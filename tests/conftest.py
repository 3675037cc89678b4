"""Test session setup: CPU only (libtpu is installed for AOT compiles; keep it from probing for
chips), 8 simulated devices for sharding tests, fp32 matmuls at full precision."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
# libtpu (AOT compiles for TPU topologies) takes a host-wide lockfile; with no chips here nothing is
# shared, so let several test processes / compiles load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import tempfile  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    """The built-in Qwen3.6 tokenizer (clover_jax.bridge.tokenizer), from $CLOVER_JAX_CACHE or a shared tmp
    cache: the cache is fingerprinted and built atomically, so reusing it across runs is safe and
    saves the ~10 s build."""
    from clover_jax.bridge import tokenizer

    root = os.environ.get("CLOVER_JAX_CACHE") or os.path.join(tempfile.gettempdir(), "clover_jax_sft_test_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CLOVER_JAX_CACHE", root)
        yield tokenizer.load_tokenizer()
