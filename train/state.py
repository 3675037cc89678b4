"""The train state pytree: master params, optimizer state, step counter, PRNG key data.

`rng` holds raw uint32 key data (``jax.random.key_data``), not a typed key, so every leaf is a plain
array that Orbax saves and restores byte for byte; the step wraps it with `jax.random.wrap_key_data`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp

from train.optimizer import Optimizer, path_str

#: Params that the model keeps in fp32 whatever the master dtype (its own numerics need them).
FP32_ONLY_PATTERNS: tuple[str, ...] = (r"A_log$", r"dt_bias$", r"bd_gdn_softmax_scalars$", r"lora_[ab]$")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """params: master weights (pytree); opt_state: the optax state; step: int32 [] updates done;
    rng: uint32 [2]-like key data, split once per step."""

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array

    def replace(self, **changes: Any) -> "TrainState":
        return dataclasses.replace(self, **changes)


def cast_master(params: Any, master_dtype: jnp.dtype, keep_fp32: tuple[str, ...], frozen: Any = None,
                 frozen_dtype: jnp.dtype | None = None) -> Any:
    """`params` in their master dtypes: floating leaves in `master_dtype`, those matching `keep_fp32`
    in fp32, and with `frozen` (params-shaped bools, True = frozen) and `frozen_dtype` the frozen
    leaves in that dtype (what `init_train_state` holds)."""
    def cast(path: tuple[Any, ...], x: Any, is_frozen: bool = False) -> jax.Array:
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        if any(re.search(p, path_str(path)) for p in keep_fp32):
            return x.astype(jnp.float32)
        return x.astype(frozen_dtype if is_frozen and frozen_dtype is not None else master_dtype)

    if frozen is None or frozen_dtype is None:
        return jax.tree_util.tree_map_with_path(cast, params)
    return jax.tree_util.tree_map_with_path(cast, params, frozen)


def init_train_state(
    params: Any, optimizer: Optimizer, *, seed: int = 0, master_dtype: str | jnp.dtype = "float32",
    keep_fp32: tuple[str, ...] = FP32_ONLY_PATTERNS, out_shardings: Any = None, donate: bool = False,
    frozen_dtype: str | jnp.dtype | None = None,
) -> TrainState:
    """A fresh state around an explicit params tree (random init or loaded HF weights).

    Floating params are cast to `master_dtype` (those matching `keep_fp32` stay fp32). With
    `out_shardings` (a TrainState-shaped tree of shardings, or one sharding) the state is built by a
    jitted function straight into that layout. The state may share buffers with `params` (no copy
    where the dtype already fits), and the train step donates them: keep host copies if you need them.
    `donate` (with `out_shardings`): `params` (global arrays) are donated, so a param already in its
    master dtype and sharding becomes the state's without a second copy on the devices.
    `frozen_dtype`: the dtype of params the optimizer freezes (LoRA: the compute dtype; they never
    update, so they need no higher-precision master); None: the master dtype like every param.
    """
    dtype = jnp.dtype(master_dtype)
    fdt = None if frozen_dtype is None else jnp.dtype(frozen_dtype)

    def build(p: Any) -> TrainState:
        frozen = None if fdt is None else jax.tree.map(lambda t: not t, optimizer.trainable_mask(p))
        p = cast_master(p, dtype, keep_fp32, frozen, fdt)
        return TrainState(
            params=p, opt_state=optimizer.init(p), step=jnp.zeros((), jnp.int32),
            rng=jax.random.key_data(jax.random.key(seed)),
        )

    if out_shardings is None:
        return build(params)
    return jax.jit(build, out_shardings=out_shardings, donate_argnums=(0,) if donate else ())(params)


def abstract_train_state(init_fn: Callable[[], TrainState]) -> TrainState:
    """Shapes, dtypes (and shardings, where `init_fn` is jitted with them) of the state, no memory."""
    return jax.eval_shape(init_fn)


__all__ = ["FP32_ONLY_PATTERNS", "TrainState", "abstract_train_state", "cast_master", "init_train_state"]
