"""Test session setup: CPU only (libtpu is installed for AOT compiles; keep it from probing for
chips), 8 simulated devices for sharding tests, fp32 matmuls at full precision."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
# libtpu (AOT compiles for TPU topologies) takes a host-wide lockfile; with no chips here nothing is
# shared, so let several test processes / compiles load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Every XLA program is compiled once per machine: a program another test file, worker, subprocess
# (environment variables reach `launch.py` runs) or earlier run already compiled - the tiny model's
# forward, a kernel at the same shapes - is read back from this cache: the same executable, so no
# result changes, only compile time is saved. Keys are content hashes (HLO, compile options, jax /
# XLA versions): changed code compiles anew. With a size limit the cache takes a file lock around
# reads and writes (the xdist workers share it).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "clover_jax_test_xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

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


def _memory_maps() -> int:
    """The number of memory mappings this process holds (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _max_memory_maps() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs(request):
    """Drop every compiled program after each test module. XLA:CPU maps each executable's code
    into its own memory regions; a long-lived xdist worker that keeps them all passes Linux's
    vm.max_map_count (65,530) about three quarters into the suite, and the next compile's mmap
    fails inside LLVM as a segfault. One test module stays under ~15k maps, so freeing them here
    bounds the worker. A module that still holds more than half the limit after the clean-up
    (programs kept alive by module globals) fails here, by name, instead of crashing a later one."""
    yield
    import gc

    jax.clear_caches()
    gc.collect()
    limit, held = _max_memory_maps(), _memory_maps()
    if limit and held > limit // 2:
        pytest.fail(f"{request.module.__name__} leaves {held} memory maps held after jax.clear_caches() "
                    f"(vm.max_map_count {limit}): compiled programs kept alive past the module")
