"""The Pallas chunked causal GDN (interpret mode on CPU) against independent oracles.

Oracles: transformers' ``torch_chunk_gated_delta_rule`` (run per document: it knows no packing),
the jnp chunked reference, and autodiff of the jnp reference for the custom VJP.
Compiles dominate the runtime, so every op is compiled once, on one packed, initial-state case: a
jitted ``value_and_grad`` (cached per op) returns the outputs and all six gradients.
"""

from __future__ import annotations

import functools
import inspect
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pallas_kernels import (  # noqa: E402
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_pallas,
    chunk_gated_delta_rule_ref,
)
from pallas_kernels.gdn import chunk_math as cm  # noqa: E402
from pallas_kernels.gdn import causal_op  # noqa: E402
from tests.model.parity_utils import FP32_REL, assert_rel_close  # noqa: E402

#: fp32 criterion for the kernels against the references, values and gradients: max|diff| <= FP32_REL
#: * max|ref| (the suite's convention, tests/model/parity_utils.py); measured <= 2.5e-7 on this file's case
REL = FP32_REL
NAMES = ("q", "k", "v", "g", "beta", "s0")


def l2(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def make_case(B: int, T: int, HK: int, H: int, DK: int, DV: int, seed: int) -> dict[str, np.ndarray]:
    """GDN inputs with HK key heads repeated to H value heads (value head j uses key head j // (H // HK))."""
    rng = np.random.default_rng(seed)
    rep = lambda x: np.repeat(x, H // HK, axis=2)  # noqa: E731
    f32 = np.float32
    return dict(
        q=rep(l2(rng.standard_normal((B, T, HK, DK)))).astype(f32),
        k=rep(l2(rng.standard_normal((B, T, HK, DK)))).astype(f32),
        v=rng.standard_normal((B, T, H, DV)).astype(f32),
        g=(-np.logaddexp(0.0, rng.standard_normal((B, T, H)))).astype(f32),
        beta=(1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))).astype(f32),
        s0=(0.5 * rng.standard_normal((B, H, DK, DV))).astype(f32),
        w_o=rng.standard_normal((B, T, H, DV)).astype(f32),
        w_s=rng.standard_normal((B, H, DK, DV)).astype(f32),
    )


def packed_segments(T: int) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
    """Two rows of (id, length) runs: documents shorter than a chunk, starting mid-chunk, pad runs
    (id 0) between them, a reused id (7 ... 7 is two documents), row 1 starting with a pad run."""
    rows = [[(7, 41), (0, 3), (3, 9), (0, 2), (7, T - 55)],
            [(0, 4), (5, 70), (2, 20), (7, T - 94)]]
    seg = np.stack([np.concatenate([np.full(n, i, np.int32) for i, n in r]) for r in rows])
    return seg, rows


def maxdiff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def rel(a, b) -> float:
    """max|a - b| / max|b| (b the oracle)."""
    return maxdiff(a, b) / float(np.max(np.abs(np.asarray(b, np.float64))))


@functools.cache
def _value_and_grad(fn, C: int):
    """One jitted value_and_grad per (op, chunk size): cases of equal shapes share the compile."""
    def loss(q, k, v, g, beta, s0, seg, w_o, w_s):
        o, s = fn(q, k, v, g, beta, initial_state=s0, segment_ids=seg, chunk_size=C)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s), (o, s)
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))


def loss_and_grads(fn, x, seg, C, cast=None):
    """(o, final state, grads of sum(o * w_o) + sum(s * w_s) w.r.t. q, k, v, g, beta, s0)."""
    args = [jnp.asarray(x[n], cast) if cast is not None and n in ("q", "k", "v") else x[n] for n in NAMES]
    (_, (o, s)), grads = _value_and_grad(fn, C)(*args, seg, x["w_o"], x["w_s"])
    return np.asarray(o), np.asarray(s), [np.asarray(a) for a in grads]


def hf_per_document(x, rows, C):
    """transformers' torch chunked GDN on every document separately (only the first run of a row
    inherits the initial state): the packed-row oracle, independent of our segment logic."""
    import torch  # a declared test dependency: a missing one fails loudly, never skips
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as hf
    hf_chunk = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
    torch.set_num_threads(1)  # tiny per-document calls: threads only contend on the shared CPU
    B, T, H, DV = x["v"].shape
    o = np.zeros((B, T, H, DV))
    finals = []
    for b, row in enumerate(rows):
        start = 0
        for r, (_, n) in enumerate(row):
            sl = slice(start, start + n)
            t = [torch.from_numpy(np.ascontiguousarray(x[name][b:b + 1, sl])) for name in NAMES[:5]]
            s_in = torch.from_numpy(x["s0"][b:b + 1]) if r == 0 else None
            with torch.no_grad():
                o_d, s_d = hf_chunk(*t, chunk_size=C, initial_state=s_in, output_final_state=True,
                                    use_qk_l2norm_in_kernel=False)
            o[b, sl] = o_d[0].numpy()
            start += n
        finals.append(s_d[0].numpy())
    return o, np.stack(finals)


# One case for both forms: T = 150 is not a multiple of C = 32; 2 key heads -> 4 value heads;
# dk = 32 != dv = 16 (the GPU form also splits dv into 2 value blocks of 8).
CASE = dict(B=2, T=150, HK=2, H=4, DK=32, DV=16, seed=1)
C = 32


@pytest.fixture(scope="module")
def case():
    x = make_case(**CASE)
    seg, rows = packed_segments(CASE["T"])
    ref = loss_and_grads(chunk_gated_delta_rule_ref, x, seg, C)
    return x, seg, rows, ref


def pallas_tpu_form(*a, **kw):
    return chunk_gated_delta_rule_pallas(*a, interpret=True, interpret_form="tpu", **kw)


def pallas_gpu_form(*a, **kw):  # also splits dv = 16 into 2 value tiles of 8
    return chunk_gated_delta_rule_pallas(*a, interpret=True, interpret_form="gpu", block_v=8, **kw)


def dispatch_pallas(*a, **kw):
    return chunk_gated_delta_rule(*a, backend="pallas", **kw)


def grouped(x):
    """The case with q, k on its HK key heads (make_case repeats them: every rep-th head is one)."""
    rep = CASE["H"] // CASE["HK"]
    return dict(x, q=x["q"][:, :, ::rep], k=x["k"][:, :, ::rep])


def to_key_heads(g_BTHK):
    """Gradient w.r.t. repeated heads -> w.r.t. the key heads (the VJP of the repeat: a sum)."""
    B, T, H, K = g_BTHK.shape
    return g_BTHK.reshape(B, T, CASE["HK"], H // CASE["HK"], K).sum(3)


def pallas_calls(fn, *args) -> list:
    """Every pallas_call equation in fn's jaxpr (nested jaxprs included), in order."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(eqn)
            for p in eqn.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                    if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                        walk(getattr(sub, "jaxpr", sub))
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def kernel_inputs(fn, *args) -> list[tuple]:
    """Shapes of the first operand of every pallas_call in fn's jaxpr, by kernel name."""
    return [(str(e.params["name"]), e.invars[0].aval.shape) for e in pallas_calls(fn, *args)]


@pytest.mark.parametrize("form", ["tpu", "gpu"])
def test_pallas_matches_oracles(case, form):
    """Both forms are the phase split (TPU: Mosaic kernels; GPU: Triton kernels, here with dv split
    into 2 value tiles) and run on the grouped key heads (native GQA: the kernels read key head
    h // rep, nothing repeated)."""
    x, seg, rows, (o_ref, s_ref, g_ref) = case
    xg = grouped(x)
    g_ref = [to_key_heads(g_ref[0]), to_key_heads(g_ref[1])] + list(g_ref[2:])
    o, s, grads = loss_and_grads(pallas_tpu_form if form == "tpu" else pallas_gpu_form, xg, seg, C)
    assert o.shape == x["v"].shape and o.dtype == np.float32 and s.shape == x["s0"].shape
    assert grads[0].shape == xg["q"].shape and grads[1].shape == xg["k"].shape
    # forward: transformers per document, and the jnp chunked reference
    o_hf, s_hf = hf_per_document(x, rows, C)
    assert rel(o, o_hf) <= REL and rel(s, s_hf) <= REL
    assert rel(o, o_ref) <= REL and rel(s, s_ref) <= REL
    # backward (custom VJP) against autodiff of the reference, relative to each gradient's scale
    for name, a, b in zip(NAMES, grads, g_ref):
        assert a.shape == b.shape and np.all(np.isfinite(a)), name
        assert rel(a, b) <= REL, name
    # the phase kernels read q, k at their HK * dk columns: no repeat before them
    fn = pallas_tpu_form if form == "tpu" else pallas_gpu_form
    ins = dict(kernel_inputs(lambda *a: fn(*a, chunk_size=C), *(xg[n] for n in NAMES[:5])))
    first = ("gdn_intra", "gdn_sweep") if form == "tpu" else ("gdn_gpu_intra", "gdn_gpu_output")
    assert ins[first[0]][-1] == ins[first[1]][-1] == CASE["HK"] * CASE["DK"], ins


def pallas_grids(fn, *args) -> dict[str, list[tuple]]:
    """The grid of every pallas_call in fn's jaxpr, by kernel name."""
    found: dict[str, list[tuple]] = {}
    for e in pallas_calls(fn, *args):
        found.setdefault(str(e.params["name"]), []).append(tuple(e.params["grid_mapping"].grid))
    return found


def test_gpu_form_with_grouped_intra_and_value_tiled_backward(monkeypatch):
    """The GPU launch knobs that change a kernel's work split, not its math: 2 chunks per intra / WY
    program, and the parallel backward in value tiles of 4 of dv = 16 (each tile's dq, dk, daux partial,
    summed in the kernel; what lets fp32 fit a GPU's shared memory). Oracles: transformers per document
    and the jnp reference's autodiff, at the fp32 criterion."""
    from pallas_kernels.gdn import gpu_calls
    x = make_case(B=2, T=128, HK=2, H=4, DK=32, DV=16, seed=3)
    seg, rows = packed_segments(128)
    monkeypatch.setitem(gpu_calls.LAUNCH, (32, 16, C), gpu_calls.GpuLaunch(block_v=8, intra_chunks=2,
                                                                          backward_block_v=4))
    fn = functools.partial(chunk_gated_delta_rule_pallas, interpret=True, interpret_form="gpu")
    xg = dict(x, q=x["q"][:, :, ::2], k=x["k"][:, :, ::2])
    grids = pallas_grids(lambda *a: fn(*a, chunk_size=C), *(xg[n] for n in NAMES[:5]))
    assert grids["gdn_gpu_intra"] == [(2, 4, 2)]   # B, H, N / 2 (N = 4 chunks of 32)
    o, s, grads = loss_and_grads(fn, xg, seg, C)
    o_r, s_r, g_r = loss_and_grads(chunk_gated_delta_rule_ref, x, seg, C)
    o_hf, s_hf = hf_per_document(x, rows, C)
    assert rel(o, o_hf) <= REL and rel(s, s_hf) <= REL
    assert rel(o, o_r) <= REL and rel(s, s_r) <= REL
    g_r = [g_r[0].reshape(2, 128, 2, 2, 32).sum(3), g_r[1].reshape(2, 128, 2, 2, 32).sum(3)] + list(g_r[2:])
    for name, a, b in zip(NAMES, grads, g_r):
        assert a.shape == b.shape and rel(a, b) <= REL, name


# bf16 bound, relative to each array's max: 4 u with u = 2^-8 the bf16 unit roundoff. Measured on
# this case against the fp32 reference on the fp32 (unrounded) inputs, the worst output / gradient
# error is 6.1e-3 (o), 5.2e-3 (dq), 4.9e-3 (state) for both forms (the same phase math, w, u stored
# in bf16 between the phases): the rounding of the inputs, of each dot's operands and of the bf16
# results, a few u; the bound leaves ~2.5x.
BF16_RTOL = 4 * 2.0 ** -8


@pytest.mark.parametrize("form", ["tpu", "gpu"])
def test_bf16_inputs(case, form):
    """bf16 q/k/v (the training path with `dtype: bfloat16`): fp32 state and accumulation, bf16
    matmul operands, fp32 triangular inverse. Oracle: the fp32 reference on the fp32 inputs."""
    x, seg, _, (o_r, s_r, g_r) = case
    o, s, grads = loss_and_grads(pallas_tpu_form if form == "tpu" else pallas_gpu_form, x, seg, C,
                                 cast=jnp.bfloat16)
    assert o.dtype == jnp.bfloat16 and s.dtype == np.float32
    assert all(a.dtype == jnp.bfloat16 for a in grads[:3]) and grads[3].dtype == np.float32
    assert maxdiff(o.astype(np.float32), o_r) <= BF16_RTOL * float(np.max(np.abs(o_r)))
    assert maxdiff(s, s_r) <= BF16_RTOL * float(np.max(np.abs(s_r)))
    for name, a, b in zip(NAMES, grads, g_r):
        assert maxdiff(a.astype(np.float32), b) <= BF16_RTOL * float(np.max(np.abs(b))), name


# ------------------------------------------------------------------ pieces of the kernel


@pytest.mark.parametrize("kind", ["random", "repeated_keys"])
def test_unit_lower_inverse(kind):
    """(I + A)^-1 by recursive blocks vs float64 numpy. 'repeated_keys' is the case where a Neumann
    product (I - A)(I + A^2)... cancels catastrophically: A = all ones below the diagonal."""
    n = 64
    rng = np.random.default_rng(4)
    A = np.tril(rng.uniform(-1, 1, (n, n)) if kind == "random" else np.ones((n, n)), -1).astype(np.float32)
    T = np.asarray(jax.jit(lambda a: cm.invert_unit_lower(a, cm.MatmulPolicy(None)))(A), np.float64)
    want = np.linalg.inv(np.eye(n) + A.astype(np.float64))
    assert_rel_close(T, want, FP32_REL, kind)  # max|want| >= 1: the identity diagonal


@pytest.mark.parametrize("form", ["tpu", "gpu"])
def test_head_padding_is_exact_for_the_phase_kernels(monkeypatch, form):
    """The phase kernels under the padding wrapper (key heads grouped: HK = 1 for H = 3, so the "q"
    arrays pad per key head; on GPU a ratio of 3 also takes the repeated-key-head backward), forced
    to pad dk 12 -> 16 and dv 6 -> 16 in the interpreter: outputs and gradients equal the reference's."""
    x = make_case(B=1, T=32, HK=1, H=3, DK=12, DV=6, seed=9)
    xg = dict(x, q=x["q"][:, :, :1], k=x["k"][:, :, :1])
    monkeypatch.setattr(causal_op, "kernel_dims", lambda form, interpret, H, K, V: (16, 16))
    fn = functools.partial(chunk_gated_delta_rule_pallas, interpret=True, interpret_form=form)
    o, s, grads = loss_and_grads(fn, xg, None, 16)
    o_r, s_r, g_r = loss_and_grads(chunk_gated_delta_rule_ref, xg, None, 16)
    assert rel(o, o_r) <= REL and rel(s, s_r) <= REL
    for name, a, b in zip(NAMES, grads, g_r):
        assert a.shape == b.shape and rel(a, b) <= REL, name


# ------------------------------------------------------------------ dispatch and sharding


def test_dispatch_and_shard_map_on_8_devices(case):
    """backend="pallas" under jax.set_mesh: the kernel runs under shard_map (batch over "data",
    heads over "tensor": one row x one head per device) and equals the unsharded reference,
    gradients included."""
    assert len(jax.devices()) == 8
    x, seg, _, (o_r, s_r, g_r) = case
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    with jax.set_mesh(mesh):
        o, s, grads = loss_and_grads(dispatch_pallas, x, seg, C)
        jaxpr = str(jax.make_jaxpr(lambda *a: dispatch_pallas(*a, chunk_size=C))(*(x[n] for n in NAMES[:5])))
    assert "shard_map" in jaxpr and "pallas_call" in jaxpr
    assert rel(o, o_r) <= REL and rel(s, s_r) <= REL
    for name, a, b in zip(NAMES, grads, g_r):
        assert rel(a, b) <= REL, name


def test_auto_on_cpu_is_the_reference_and_errors_are_clear():
    x = make_case(B=1, T=20, HK=1, H=1, DK=8, DV=8, seed=6)
    args = tuple(x[n] for n in NAMES[:5])
    jaxpr = lambda backend: str(jax.make_jaxpr(  # noqa: E731
        lambda *a: chunk_gated_delta_rule(*a, chunk_size=16, backend=backend))(*args))
    assert jaxpr("auto") == jaxpr("reference") and "pallas_call" not in jaxpr("auto")  # CPU: the reference
    assert "pallas_call" in jaxpr("pallas")
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta_rule_pallas(*args, chunk_size=0)
    with pytest.raises(ValueError, match="interpret_form"):
        chunk_gated_delta_rule_pallas(*args, interpret_form="metal")
    with pytest.raises(ValueError, match="beta must be"):
        chunk_gated_delta_rule_pallas(*args[:4], args[4][..., :0])
    mesh = jax.make_mesh((8,), ("tensor",))
    with pytest.raises(ValueError, match="head dim 1 is not divisible"):
        chunk_gated_delta_rule_pallas(*args, mesh=mesh, head_axes=("tensor",))
    with pytest.raises(ValueError, match="'model' is not a mesh axis"):
        chunk_gated_delta_rule_pallas(*args, mesh=mesh, batch_axes=("model",))
