"""The Pallas GDN kernels compile for real accelerators from this CPU host (no execution).

TPU: ``jax.experimental.topologies.get_topology_desc`` loads libtpu on demand and returns TPU
devices even with JAX_PLATFORMS=cpu (conftest); ``jit(...).lower(...).compile()`` on arrays sharded
over those devices runs the real TPU compiler, Mosaic included. libtpu logs harmless warnings about
TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES on a host without chips.
GPU: ``lower(lowering_platforms=("cuda",))`` runs the Pallas -> Triton lowering (not ptxas). jax >= 0.11
asks the local device for the target GPU's compute capability; without one it needs an abstract
target device (``cuda_target``), which jax 0.10.2 accepts too.

Shapes are the 35B GDN layer's: 32 value heads, 16 key heads (both ops take them grouped, as the
model passes them), dk = dv = 128, T = 8192, bf16 q/k/v,
fp32 g/beta and state, packed segment ids. The TPU compiles are of the whole fwd + bwd under
``shard_map`` on a 2x2 mesh (per chip: 1 row x 16 value heads), the GPU lowerings of B = 1 with all
32 heads. Block mode runs with Clover's block size 32 on the phase kernels with chunks of 64 (two
block-start readouts per chunk), on CUDA also with block 128 (a readout tile of two chunks).
"""

from __future__ import annotations

import contextlib
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes /tmp/libtpu_lockfile on load; any other process holding it (a concurrent test, a run
# that touched libtpu) makes get_topology_desc fail with "Internal error when accessing libtpu
# multi-process lockfile". On a host without chips nothing is shared, so allow concurrent loads.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from pallas_kernels import block_gated_delta_rule, chunk_gated_delta_rule  # noqa: E402
from pallas_kernels.gdn import gpu_calls  # noqa: E402

T, H, HK, DK, DV = 8192, 32, 16, 128, 128


def specs(B: int, mesh=None, T: int = T, H: int = H, DK: int = DK, DV: int = DV, HK: int | None = None):
    """q, k on HK heads (default H: repeated), v and the gates on H."""
    def sd(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=None if mesh is None else NamedSharding(mesh, spec))
    bf, f32 = jnp.bfloat16, jnp.float32
    tok, gate = P("data", None, "tensor", None), P("data", None, "tensor")
    HK = H if HK is None else HK
    return (sd((B, T, HK, DK), bf, tok), sd((B, T, HK, DK), bf, tok), sd((B, T, H, DV), bf, tok),
            sd((B, T, H), f32, gate), sd((B, T, H), f32, gate), sd((B, H, DK, DV), f32, P("data", "tensor")),
            sd((B, T), jnp.int32, P("data")))


def loss_and_grads(mesh=None):
    def loss(q, k, v, g, beta, s0, seg):
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, segment_ids=seg, backend="pallas",
                                      mesh=mesh)
        return jnp.sum(jnp.square(o.astype(jnp.float32))) + jnp.sum(jnp.square(s))
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6))))


def block_loss_and_grads(mesh=None, block_size: int = 32):
    def loss(q, k, v, g, beta, s0, seg, qn, kn, vn, scalars):
        o, on, s = block_gated_delta_rule(q, k, v, g, beta, qn, kn, vn, scalars, block_size=block_size,
                                          initial_state=s0, segment_ids=seg, backend="pallas", mesh=mesh)
        sq = lambda a: jnp.sum(jnp.square(a.astype(jnp.float32)))  # noqa: E731
        return sq(o) + sq(on) + sq(s)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5, 7, 8, 9, 10)))


def block_specs(B: int, mesh=None):
    base = specs(B, mesh, HK=HK)
    scal = jax.ShapeDtypeStruct((H, 3), jnp.float32, sharding=None if mesh is None else NamedSharding(mesh, P()))
    return base + base[:3] + (scal,)


def tpu_mesh():
    from jax.experimental import topologies

    topo = topologies.get_topology_desc("v5p:2x2x1", platform="tpu")
    assert len(topo.devices) == 4 and topo.devices[0].platform == "tpu"
    return Mesh(np.array(topo.devices).reshape(2, 2), ("data", "tensor"))


def compile_and_report(lowered, what: str, n_kernels: int) -> None:
    txt = lowered.as_text()
    assert txt.count("tpu_custom_call") == n_kernels, txt.count("tpu_custom_call")  # Mosaic, not the interpreter
    mem = lowered.compile().memory_analysis()
    print(f"\nTPU v5p per-chip bytes, {what} fwd+bwd (B=1 x 16 heads x T={T}): args {mem.argument_size_in_bytes:,} "
          f"out {mem.output_size_in_bytes:,} temp {mem.temp_size_in_bytes:,}")
    assert mem.argument_size_in_bytes > 0


def test_tpu_aot_compile_fwd_bwd_sharded():
    mesh = tpu_mesh()
    # phase kernels: intra + sweep forward; WY recompute, state sweep, dS sweep, intra backward
    compile_and_report(loss_and_grads(mesh).trace(*specs(2, mesh, HK=HK)).lower(), "causal GDN", 6)


def test_tpu_aot_compile_block_fwd_bwd_sharded():
    mesh = tpu_mesh()
    # phase kernels: intra, block sweep (readouts), noisy forward; WY recompute, state recompute,
    # block dS sweep, block parallel backward
    compile_and_report(block_loss_and_grads(mesh).trace(*block_specs(2, mesh)).lower(), "block GDN", 7)


def cuda_target(device_kind: str = "NVIDIA H200"):
    """Context naming the GPU the Triton lowering targets (an abstract device on a 1-device mesh)."""
    AbstractDevice = getattr(jax.sharding, "AbstractDevice", None)
    if AbstractDevice is None:
        return contextlib.nullcontext()
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Auto,),
                                     abstract_device=AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu"))
    return jax.sharding.use_abstract_mesh(mesh)


def lower_cuda(fn, *args):
    with cuda_target():
        return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def triton_kernels(txt: str) -> list[str]:
    """Names of the Triton kernels in a lowered module, in order (after checking they are all named)."""
    names = re.findall(r'name = "(gdn_[a-z_]+)"', txt)
    assert len(names) == txt.count("xla.gpu.triton"), (names, txt.count("xla.gpu.triton"))
    return names


#: the GPU phase split (gpu_calls): forward intra, sweep, output; backward WY recompute, state
#: recompute, the dS sweep, the parallel backward
CAUSAL_GPU = ["gdn_gpu_intra", "gdn_gpu_sweep", "gdn_gpu_output",
              "gdn_gpu_wy", "gdn_gpu_sweep", "gdn_gpu_state_bwd", "gdn_gpu_parallel_bwd"]


def launches(txt: str) -> list[tuple[int, int, int]]:
    """(num_warps, num_stages, grid size) of every Triton call, in order."""
    grids = [int(x) * int(y) * int(z) for x, y, z in
             re.findall(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+) : i32", txt)]
    warps = [int(n) for n in re.findall(r"num_warps = (\d+) : i32", txt)]
    stages = [int(n) for n in re.findall(r"num_stages = (\d+) : i32", txt)]
    return list(zip(warps, stages, grids, strict=True))


def test_cuda_lowering_fwd_bwd():
    txt = lower_cuda(loss_and_grads(), *specs(1, HK=HK))
    assert triton_kernels(txt) == CAUSAL_GPU
    assert "tpu_custom_call" not in txt
    # the launch table's options for (dk, dv, chunk) = (128, 128, 64): the sweeps on dv tiles
    lc = gpu_calls.LAUNCH[(DK, DV, 64)]
    N, NV = T // 64, DV // lc.block_v
    par, seq, bwd = (lc.parallel_warps, 1), (lc.sweep_warps, lc.num_stages), (lc.backward_warps, 1)
    assert launches(txt) == [(*par, H * N), (*seq, H * NV), (*par, H * N * NV),
                             (*par, H * N), (*seq, H * NV), (*seq, H * NV), (*bwd, HK * N)]


def test_cuda_lowering_block_fwd_bwd():
    """Block 32 on chunks of 64 (two readouts inside each chunk) and block 128 (a readout tile of two
    chunks): the phase split, the readouts in the output kernel."""
    block = ["gdn_gpu_intra", "gdn_gpu_sweep", "gdn_gpu_block_output", "gdn_gpu_block_noisy",
             "gdn_gpu_wy", "gdn_gpu_sweep", "gdn_gpu_block_state_bwd", "gdn_gpu_block_parallel_bwd"]
    for block_size in (32, 128):
        assert triton_kernels(lower_cuda(block_loss_and_grads(block_size=block_size), *block_specs(1))) == block


def test_gpu_launch_table():
    """Every entry's Triton options are valid (powers of two, dv tiles >= 16 dividing dv); other shapes
    take the default; ``block_v`` overrides the tile and must divide dv."""
    from pallas_kernels.gdn.kernel_bodies import KernelConfig
    p2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    for (dk, dv, C), lc in gpu_calls.LAUNCH.items():
        assert all(map(p2, (dk, dv, C, lc.sweep_warps, lc.parallel_warps, lc.backward_warps, lc.block_v))) and 16 <= lc.block_v <= dv
        assert gpu_calls.tile_width(KernelConfig(chunk_size=C), dk, dv) == lc.block_v
    assert gpu_calls.launch_for(32, 16, 64) == gpu_calls.DEFAULT_LAUNCH
    assert gpu_calls.tile_width(KernelConfig(chunk_size=64), 32, 16) == 16       # min(dv, 32)
    assert gpu_calls.tile_width(KernelConfig(chunk_size=64, block_v=8), 32, 16) == 8
    with pytest.raises(ValueError, match="block_v=12 must divide dv=16"):
        gpu_calls.tile_width(KernelConfig(chunk_size=64, block_v=12), 32, 16)


def test_gpu_work_split_knobs(monkeypatch):
    """The parallel backward's value tile: the table's ``backward_block_v`` (0: all of dv), at most
    FP32_BACKWARD_BLOCK_V for fp32 inputs, capped at dv, dividing dv; chunks per intra program: the
    table's ``intra_chunks`` where it divides N, else 1."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    fp32_w = gpu_calls.FP32_BACKWARD_BLOCK_V
    assert gpu_calls.backward_tile_width(128, 128, 64, bf16) == 128          # measured entry: whole dv
    assert gpu_calls.backward_tile_width(128, 128, 64, f32) == fp32_w == 32
    assert gpu_calls.backward_tile_width(32, 16, 64, f32) == 16               # capped at dv
    monkeypatch.setitem(gpu_calls.LAUNCH, (64, 96, 64), gpu_calls.GpuLaunch(backward_block_v=64, intra_chunks=4))
    with pytest.raises(ValueError, match="backward_block_v=64 must divide dv=96"):
        gpu_calls.backward_tile_width(64, 96, 64, bf16)
    assert gpu_calls.intra_group(64, 96, 64, N=8) == 4 and gpu_calls.intra_group(64, 96, 64, N=6) == 1
    assert gpu_calls.intra_group(128, 128, 64, N=8) == 1                     # the table's default


def test_cuda_lowering_odd_shapes():
    """dk, dv not powers of two and T not a multiple of the chunk: the wrapper pads for Triton."""
    args = specs(1, T=130, H=4, DK=24, DV=40)
    fwd = jax.jit(lambda *a: chunk_gated_delta_rule(*a[:5], initial_state=a[5], segment_ids=a[6], backend="pallas"))
    assert triton_kernels(lower_cuda(fwd, *args)) == CAUSAL_GPU[:3]


def test_cuda_lowering_fp32_value_tiled_backward():
    """fp32 q / k / v at dk = dv = 128: the parallel backward runs in value tiles of
    FP32_BACKWARD_BLOCK_V (4 per value head, slices of the state and value columns) and lowers to
    Triton, both ops (whether it fits a GPU's shared memory is for `gdn_device.py --fp32-fit`)."""
    f32 = jnp.float32
    args = tuple(jax.ShapeDtypeStruct(a.shape, f32 if i < 3 else a.dtype) for i, a in enumerate(specs(1, T=256, H=4)))
    assert gpu_calls.backward_tile_width(DK, DV, 64, f32) == DV // 4
    assert triton_kernels(lower_cuda(loss_and_grads(), *args)) == CAUSAL_GPU
    block_args = args + args[:3] + (jax.ShapeDtypeStruct((4, 3), f32),)
    assert "gdn_gpu_block_parallel_bwd" in triton_kernels(lower_cuda(block_loss_and_grads(), *block_args))


def test_cuda_lowering_non_power_of_two_head_ratio():
    """3 value heads per key head: the GPU backward runs on repeated key heads (rep * dv tiles of
    Triton must be powers of two; the kernel refuses others); the gradients come back on the key
    heads (custom_vjp checks their shapes). Both ops."""
    args = specs(1, T=128, H=6, DK=32, DV=32, HK=2)
    assert triton_kernels(lower_cuda(loss_and_grads(), *args)) == CAUSAL_GPU
    block_args = args + args[:3] + (jax.ShapeDtypeStruct((6, 3), jnp.float32),)
    assert "gdn_gpu_block_parallel_bwd" in triton_kernels(lower_cuda(block_loss_and_grads(), *block_args))
