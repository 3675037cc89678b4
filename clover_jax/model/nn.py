"""Small building blocks: parameters with logical axis names, dense layer, the two RMSNorms.

Every parameter is an `nnx.Param` whose metadata `logical_axes` names its dimensions (docs/design.md 4);
`clover_jax.parallel.sharding` (a later issue) maps those names to mesh axes with one rule table. We keep
the names out of nnx's own `out_sharding` metadata on purpose: that one makes nnx shard eagerly and
requires a mesh at construction time, which tests and the HF bridge do not have.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax.model.lora import dropout_input, low_rank
from clover_jax.parallel import sharding

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def dtype_of(name: str) -> jnp.dtype:
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def normal(stddev: float = 0.02) -> Initializer:
    return lambda key, shape, dtype: (stddev * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def constant(value: float) -> Initializer:
    return lambda key, shape, dtype: jnp.full(shape, value, dtype)


def make_param(
    rngs: nnx.Rngs, init: Initializer, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype: jnp.dtype
) -> nnx.Param:
    """A parameter of `shape` with one logical axis name per dimension."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=tuple(axes))


class Dense(nnx.Module):
    """`y = x @ kernel` with kernel [in, out], no bias (no projection of this model has one)."""

    takes_lora = True  # `clover_jax.model.lora.add_adapters` may attach lora_a / lora_b

    def __init__(
        self, d_in: int, d_out: int, axes: tuple[str | None, str | None], *, rngs: nnx.Rngs,
        param_dtype: jnp.dtype = jnp.float32, dtype: jnp.dtype = jnp.float32, init: Initializer | None = None,
    ):
        self.kernel = make_param(rngs, init or normal(), (d_in, d_out), axes, param_dtype)
        self.dtype = dtype

    def __call__(self, x: jax.Array, lora_key: jax.Array | None = None) -> jax.Array:
        """x [..., in] -> [..., out]; plus the LoRA term ``s (x A) B`` when `clover_jax.model.lora`
        attached an adapter (`lora_a` [in, r], `lora_b` [r, out]); with `lora_key` (training) the
        term reads the adapter's dropout of x (`lora.dropout_input`)."""
        x, kernel = x.astype(self.dtype), self.kernel[...].astype(self.dtype)
        mesh_ctx = sharding.current()
        if x.ndim > 2 and (mesh_ctx is None or mesh_ctx.mesh.size == 1):
            # as one [N, in] @ [in, out]: the weight gradient of a 3-D product is a dot contracting
            # two dims, which XLA:CPU feeds a [out, N] transposed copy fused into the cotangent's
            # producer (20 ms of a 105 ms GDN layer fwd+bwd at small-cpu, issue 19). Not under a
            # mesh: rows and sequence may be sharded over different axes, and merging them gathers.
            return self._project(x.reshape(-1, x.shape[-1]), kernel, lora_key).reshape(*x.shape[:-1], kernel.shape[-1])
        return self._project(x, kernel, lora_key)

    def _project(self, x: jax.Array, kernel: jax.Array, lora_key: jax.Array | None) -> jax.Array:
        y = jnp.dot(x, kernel)
        lora_a = getattr(self, "lora_a", None)
        if lora_a is None:
            return y
        x_in = dropout_input(x, self.lora_dropout, lora_key, self.lora_id)
        return y + low_rank(x_in, lora_a[...], self.lora_b[...], self.lora_scale, self.dtype)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """`x * rsqrt(mean(x^2) + eps)` over the last axis, in fp32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm (Qwen3.5 layer/final/q/k norms): `rmsnorm(x) * (1 + scale)`.

    Scale initialises at 0, so the norm starts as the plain normalisation. Computed in fp32 and cast
    back to the input dtype at the end, as transformers does.
    """

    def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs, axis_name: str = "norm",
                 param_dtype: jnp.dtype = jnp.float32):
        self.scale = make_param(rngs, constant(0.0), (dim,), (axis_name,), param_dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        y = rms_normalize(x, self.eps) * (1.0 + self.scale[...].astype(jnp.float32))
        return y.astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """The GDN output norm, per head: `scale * rmsnorm(x) * silu(z)` (plain scale, init 1).

    Order as in transformers: normalise in fp32, cast to the input dtype, multiply by the scale, then
    by `silu(z)` computed in fp32, and cast back.
    """

    def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs, param_dtype: jnp.dtype = jnp.float32):
        self.scale = make_param(rngs, constant(1.0), (dim,), ("norm",), param_dtype)
        self.eps = eps

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        y = self.scale[...].astype(x.dtype) * rms_normalize(x, self.eps).astype(x.dtype)
        y = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        return y.astype(x.dtype)
