"""The attention dispatch (`pallas_kernels.attention.ops`): JAX's TPU splash kernel and our GPU
flash kernel, run by the Pallas interpreter on this CPU host, against the dense jnp reference
(`attend` over the masks of docs/design.md 3.1), for both training streams, on its own, under a mesh,
and inside the model's SFT loss (the flash kernel's own parity tests at small tiles are in
attention/test_flash.py). fp32 throughout: values to 1e-5 and gradients to 1e-4 of the reference's
largest entry."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from clover_jax.config import get_preset
from clover_jax.model.clover_model import abstract_model, create_model, model_to_params
from pallas_kernels.attention.ops import resolve_attn_backend, stream_attention
from pallas_kernels.attention.reference import noisy_query_mask

B, T, H, K, D = 2, 96, 4, 2, 16  # GQA 2 query heads per KV head; T = 96 is padded to one 128-lane tile
# row 0: documents at 0 and 37 (not block aligned: the kernel's rule must not rely on it), pads at the end;
# row 1: one document and pads
SEG = np.stack([np.repeat([1, 2, 0], [37, 43, 16]), np.repeat([5, 0], [64, 32])]).astype(np.int32)


def _inputs(stream: str, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 4)
    s = T if stream == "clean" else 2 * T
    q = jax.random.normal(ks[0], (B, T, H, D))
    k = jax.random.normal(ks[1], (B, s, K, D))
    v = jax.random.normal(ks[2], (B, s, K, D))
    return q, k, v, jax.random.normal(ks[3], (B, T, H, D))  # the last: a cotangent-shaping weight


def _value_and_grads(backend: str, stream: str, block: int, **kw):
    q, k, v, w = _inputs(stream)
    seg = jnp.asarray(SEG)

    def f(q, k, v):
        out = stream_attention(q, k, v, seg, stream=stream, block_size=block, backend=backend, **kw)
        return jnp.sum(jnp.sin(out) * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


@functools.lru_cache(maxsize=None)
def _reference(stream: str, block: int):
    """`_value_and_grads` of the dense reference (unsharded), once per setting: the kernel tests share it."""
    return jax.device_get(_value_and_grads("reference", stream, block))


def _assert_rel(got, want, rel, what):
    got, want = np.asarray(got), np.asarray(want)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= rel, f"{what}: max error {err:.2e} of the largest entry > {rel}"


@pytest.mark.parametrize("stream,block", [("clean", 1), ("noisy", 4), ("noisy", 16), ("noisy", 32)])
def test_splash_equals_reference(stream, block):
    """Values and dq, dk, dv of the kernel (interpret mode) equal the dense reference on packed rows
    with pads, GQA and lane padding, for the clean stream and the noisy stream at 3 block sizes."""
    out, grads = _value_and_grads("splash", stream, block)
    out_r, grads_r = _reference(stream, block)
    _assert_rel(out, out_r, 1e-5, f"{stream} b{block} output")
    for name, g, g_r in zip("qkv", grads, grads_r):
        _assert_rel(g, g_r, 1e-4, f"{stream} b{block} d{name}")


def test_noisy_mask_of_the_kernel_is_the_design_rule():
    """The kernel's static mask (evaluated by splash's own mask slicing, as its tile planner does)
    equals `noisy_query_mask` on one document: clean keys strictly before the block start, noisy keys
    of the same block."""
    from pallas_kernels.attention.splash import NoisyBlockMask

    t, bk = 64, 16
    got = NoisyBlockMask(t, bk)[:, :]
    slots = jnp.arange(t, dtype=jnp.int32)[None]
    start = slots - slots % bk
    both = lambda a: jnp.concatenate([a, a], axis=1)  # noqa: E731
    ones = jnp.ones_like(slots)
    want = noisy_query_mask(start, ones, both(slots), both(ones), both(start), jnp.arange(2 * t) >= t)[0]
    np.testing.assert_array_equal(got, np.asarray(want))


@pytest.mark.parametrize("backend", ["splash", "flash"])
def test_kernel_under_a_mesh_equals_unsharded(backend):
    """Under a (data 2, tensor 2) mesh the kernel runs in shard_map over batch rows and KV-head groups
    and gives the unsharded reference's values and gradients."""
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        out, grads = _value_and_grads(backend, "noisy", 16)
        q, k, v, _ = _inputs("noisy")
        jaxpr = str(jax.make_jaxpr(lambda *a: stream_attention(*a, jnp.asarray(SEG), stream="noisy", block_size=16,
                                                               backend=backend))(q, k, v))
    assert "shard_map" in jaxpr and "pallas_call" in jaxpr
    out_r, grads_r = _reference("noisy", 16)
    _assert_rel(out, out_r, 1e-5, "sharded output")
    for name, g, g_r in zip("qkv", grads, grads_r):
        _assert_rel(g, g_r, 1e-4, f"sharded d{name}")


def test_auto_backend_by_platform():
    with pytest.raises(ValueError, match="unknown attention backend 'flash2'"):
        resolve_attn_backend("flash2")
    assert resolve_attn_backend("auto") == "reference"  # this CPU host
    assert [resolve_attn_backend("auto", p) for p in ("tpu", "gpu", "cpu")] == ["splash", "flash", "reference"]
    assert resolve_attn_backend("flash", "tpu") == "flash"  # an explicit choice is kept


def _model_sft_outputs(name: str):
    """((loss, grads), AR logits) of the tiny block model's two-stream SFT loss and its AR forward,
    with `attn_backend: name`, on a fixed packed batch; and the batch's segment ids."""
    from sft.loss import LossConfig, make_sft_loss
    from sft.noise import NoiseConfig

    mask_id = 255
    cfg = get_preset("tiny").replace(mode="block", mask_token_id=mask_id, attn_backend="reference", num_hidden_layers=2,
                                     layer_types=("linear_attention", "full_attention"))
    params = model_to_params(create_model(cfg, 0))
    rng = np.random.default_rng(0)
    b, t, bk = 2, 64, 16
    seg = np.array([[1] * 32 + [2] * 16 + [0] * 16, [1] * 48 + [0] * 16], np.int32)
    pos = np.concatenate([np.r_[0:32, 0:16, 0:16][None], np.r_[0:48, 0:16][None]]).astype(np.int32)
    lmask = (seg > 0) & (pos >= 4)
    batch = {k: jnp.asarray(v) for k, v in dict(input_ids=rng.integers(2, 250, (b, t)).astype(np.int32),
                                                   segment_ids=seg, positions=pos, loss_mask=lmask).items()}
    noise, lcfg = NoiseConfig(t_min=0.05), LossConfig(ar_loss_weight=0.5, chunk_tokens=64)
    key = jax.random.key(1)
    graphdef = nnx.split(abstract_model(cfg.replace(attn_backend=name)))[0]  # the structure only: no init
    loss_fn = make_sft_loss(graphdef, block_size=bk, mask_token_id=mask_id, noise=noise, loss=lcfg, lb_coef=0.01,
                            end_pad_id=1)
    f = jax.value_and_grad(lambda p: loss_fn(p, batch, key)[0])
    g = jax.jit(lambda p, ids, s: (f(p), nnx.merge(graphdef, p)(ids, segment_ids=s)))
    return jax.device_get(g(params, batch["input_ids"], batch["segment_ids"])), seg


@pytest.fixture(scope="module")
def model_sft_reference():
    """`_model_sft_outputs("reference")`, computed once for both kernels."""
    return _model_sft_outputs("reference")


@pytest.mark.parametrize("backend", ["splash", "flash"])
def test_model_sft_loss_and_grads_with_kernel_equal_reference(backend, model_sft_reference):
    """The model's two-stream SFT loss (both noisy copies, the AR term on the clean stream) and its
    gradient with respect to every parameter, `attn_backend: splash` / `flash` (interpret) vs
    `reference`; and the AR forward (`model(ids)`, the clean path without a cache) gives the same logits."""
    ((loss_r, grads_r), logits_r), seg = model_sft_reference
    ((loss_s, grads_s), logits_s), _ = _model_sft_outputs(backend)
    np.testing.assert_allclose(float(loss_s), float(loss_r), rtol=1e-5)
    flat_r, flat_s = dict(nnx.traversals.flatten_mapping(grads_r)), dict(nnx.traversals.flatten_mapping(grads_s))
    assert flat_r.keys() == flat_s.keys()
    for path, g_r in flat_r.items():
        _assert_rel(flat_s[path], g_r, 1e-4, f"d{'/'.join(map(str, path))}")
    keep = seg > 0
    _assert_rel(np.asarray(logits_s)[keep], np.asarray(logits_r)[keep], 1e-5, "AR logits")
