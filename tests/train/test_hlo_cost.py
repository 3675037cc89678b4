"""The HLO cost walk (`train.hlo_cost`): a hand-written module whose FLOPs, bytes and collective
bytes are counted by hand, and a tiny program compiled for a TPU (AOT through libtpu on this CPU
host) against XLA's own count of the same program unrolled (XLA counts a loop body once)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from train.aot import parse_topology, topology_devices
from train.hlo_cost import analyze, parse_module

# A loop of 5 trips (counter from 2 to 7 by 1) around: a dot [8,16]x[16,32], a fusion holding a
# convolution written the TPU way (a head-batched matmul as a size-4 window over a size-1 spatial
# dim: one real tap per output), an all-gather (groups of 4) and an all-reduce (groups of 2); after
# it a reduce-scatter fusion, an all-to-all, a ragged all-to-all (send [8,16] into a [32,16] buffer), a
# collective-permute, a Mosaic call with a cost
# estimate, a kernel without one, and a conditional whose costlier branch counts.
HLO = """HloModule hand

%fused_conv (p0: bf16[2,8,16,1], p1: bf16[4,32,16,1]) -> bf16[2,8,4,32] {
  %p0 = bf16[2,8,16,1]{3,2,1,0} parameter(0)
  %p1 = bf16[4,32,16,1]{3,2,1,0} parameter(1)
  ROOT %convolution.1 = bf16[2,8,4,32]{3,2,1,0} convolution(%p0, %p1), window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}, dim_labels=0bf1_1oi0->0b1f
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.9 = f32[] add(%a, %b)
}

%body (arg: (s32[], f32[8,16], f32[16,32])) -> (s32[], f32[8,16], f32[16,32]) {
  %arg = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%arg), index=1
  %w = f32[16,32]{1,0} get-tuple-element(%arg), index=2
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %dot.1 = f32[8,32]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %q = bf16[2,8,16,1]{3,2,1,0} parameter(1)
  %k = bf16[4,32,16,1]{3,2,1,0} parameter(2)
  %fusion.1 = bf16[2,8,4,32]{3,2,1,0} fusion(%q, %k), kind=kOutput, calls=%fused_conv
  %all-gather.1 = f32[32,16]{1,0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %all-reduce.1 = f32[16,32]{1,0} all-reduce(%w), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  ROOT %tuple.1 = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) tuple(%next, %x, %w)
}

%cond (arg.1: (s32[], f32[8,16], f32[16,32])) -> pred[] {
  %arg.1 = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  %limit = s32[] constant(7)
  ROOT %lt = pred[] compare(%i.1, %limit), direction=LT
}

%all-reduce-scatter (input: f32[64,32]) -> f32[16,32] {
  %input = f32[64,32]{1,0} parameter(0)
  %all-reduce.2 = f32[64,32]{1,0} all-reduce(%input), channel_id=3, replica_groups=[2,4]<=[8], to_apply=%add
  %zero = u32[] constant(0)
  ROOT %dynamic-slice.1 = f32[16,32]{1,0} dynamic-slice(%all-reduce.2, %zero, %zero), dynamic_slice_sizes={16,32}
}

%cheap (c0: f32[8,16]) -> f32[8,16] {
  %c0 = f32[8,16]{1,0} parameter(0)
  ROOT %negate.1 = f32[8,16]{1,0} negate(%c0)
}

%dear (d0: f32[8,16]) -> f32[8,16] {
  %d0 = f32[8,16]{1,0} parameter(0)
  %m1 = f32[8,16]{1,0} multiply(%d0, %d0)
  ROOT %m2 = f32[8,16]{1,0} multiply(%m1, %d0)
}

ENTRY %main (x0: f32[8,16], w0: f32[16,32], big: f32[64,32], p: pred[], buf: f32[32,16], o: s32[4]) -> f32[8,16] {
  %buf = f32[32,16]{1,0} parameter(4)
  %o = s32[4]{0} parameter(5)
  %ragged-all-to-all.1 = f32[32,16]{1,0} ragged-all-to-all(%x0, %buf, %o, %o, %o, %o), channel_id=6, replica_groups={{0,1,2,3},{4,5,6,7}}
  %x0 = f32[8,16]{1,0} parameter(0)
  %w0 = f32[16,32]{1,0} parameter(1)
  %big = f32[64,32]{1,0} parameter(2)
  %p = pred[] parameter(3)
  %start = s32[] constant(2)
  %start.copy = s32[] copy(%start)
  %init = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) tuple(%start.copy, %x0, %w0)
  %while.1 = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) while(%init), condition=%cond, body=%body
  %fusion.2 = f32[16,32]{1,0} fusion(%big), kind=kCustom, calls=%all-reduce-scatter
  %all-to-all.1 = f32[8,16]{1,0} all-to-all(%x0), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %collective-permute-start.1 = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%x0), channel_id=5, source_target_pairs={{0,1},{1,0}}
  %collective-permute-done.1 = f32[8,16]{1,0} collective-permute-done(%collective-permute-start.1)
  %my_kernel.3 = f32[8,16]{1,0} custom-call(%x0), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"x",
"cost_estimate":{"flops":"1000","transcendentals":"0","bytes_accessed":"4096","remote_bytes_transferred":"0"}}}
  %other_kernel.1 = f32[8,16]{1,0} custom-call(%x0), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"y"}}
  ROOT %conditional.1 = f32[8,16]{1,0} conditional(%p, %x0, %x0), true_computation=%cheap, false_computation=%dear
}
"""


def test_hand_written_module_counts_by_hand():
    comps, entry = parse_module(HLO)
    assert entry == "main" and "all-reduce-scatter" in comps
    c = analyze(HLO)
    assert c.whiles == [("while.1", 5, 1.0)] and not c.unknown_trips
    dot = 2 * 8 * 32 * 16  # 2 m n k
    conv = 2 * (2 * 8 * 4 * 32) * 16  # one real tap: contracts over the 16 input features only
    per_trip = dot + conv + 2  # + the counter's add and the condition's compare
    kernels, branch = 1000, 2 * 8 * 16  # the dearer branch: two multiplies
    dyn = 0  # dynamic-slice: no FLOPs
    assert c.flops == 5 * per_trip + kernels + branch + dyn
    assert c.dot_flops == 5 * (dot + conv)
    assert c.kernels == {"my_kernel": [1.0, 1000.0]} and c.uncosted == {"other_kernel": 1.0}
    f4 = 4
    assert c.collective_bytes == {
        "all-gather": 5 * 8 * 16 * f4 * 4,  # the gathered result, 4 devices' shards
        "all-reduce": 5 * 16 * 32 * f4,
        "reduce-scatter": 64 * 32 * f4,
        "all-to-all": 8 * 16 * f4 + 8 * 16 * f4,  # + the ragged one: its [8, 16] send side, not the buffer
        "collective-permute": 8 * 16 * f4,
    }
    assert c.ici_bytes == pytest.approx({
        "all-gather": 5 * 8 * 16 * f4 * 4 * 3 / 4,  # ring: (n-1)/n of the full buffer
        "all-reduce": 5 * 16 * 32 * f4 * 2 * 1 / 2,  # 2 (n-1)/n
        "reduce-scatter": 64 * 32 * f4 * 3 / 4,
        "all-to-all": 8 * 16 * f4 * 7 / 8 + 8 * 16 * f4 * 3 / 4,
        "collective-permute": 8 * 16 * f4,
    })
    # HBM: the kernel's estimate; the fusion's operands and result, not its insides
    assert c.hbm_bytes >= 4096 + 5 * (2 * 8 * 16 + 4 * 32 * 16 + 2 * 8 * 4 * 32) * 2


def test_unreadable_trip_count_counts_once_and_says_so():
    text = HLO.replace("%limit = s32[] constant(7)", "%limit = s32[] get-tuple-element(%arg.1), index=0")
    c = analyze(text)
    assert c.unknown_trips == ["while.1"] and c.whiles == [("while.1", 1, 1.0)]


def test_kernel_cost_hook_costs_and_recosts_kernels():
    seen = {}

    def hook(name, operands, results, estimate):
        seen[name] = (tuple(o.dims for o in operands), tuple(r.dims for r in results), estimate)
        return (7.0, 8.0) if name == "other_kernel" else (estimate[0] / 2, estimate[1])

    c = analyze(HLO, hook)
    assert seen["other_kernel"] == (((8, 16),), ((8, 16),), None)
    assert seen["my_kernel"][2] == (1000.0, 4096.0)
    assert c.kernels == {"my_kernel": [1.0, 500.0], "other_kernel": [1.0, 7.0]} and not c.uncosted


def _tpu_sharding(n: int):
    devs = topology_devices(parse_topology("v5p-8"))[:n]
    return jax.sharding.Mesh(np.array(devs), ("x",))


def test_compiled_loop_counts_every_trip_like_xla_counts_the_unrolled_program():
    """A scan of 7 matmul + tanh steps over stacked weights (each step slices its own) compiled for
    a v5p chip: the walk of the rolled program equals XLA's cost analysis of the unrolled one
    (FLOPs within 2%), and XLA's count of the rolled one is about a seventh of it."""
    dev = topology_devices(parse_topology("v5p-8"))[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    s = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=sh)
    ws = jax.ShapeDtypeStruct((7, 256, 256), jnp.bfloat16, sharding=sh)

    def f(unroll):
        def run(x, w):
            return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w, unroll=unroll)[0]
        return jax.jit(run).lower(s, ws).compile()

    rolled, unrolled = f(1), f(True)
    cost = lambda c: c.cost_analysis()[0] if isinstance(c.cost_analysis(), list) else c.cost_analysis()  # noqa: E731
    walked = analyze(rolled.as_text())
    assert walked.whiles and walked.whiles[0][1] == 7
    assert walked.flops == pytest.approx(cost(unrolled)["flops"], rel=0.02)
    assert cost(rolled)["flops"] < 0.2 * walked.flops
    # HBM bytes: each trip reads its slice of the stacked weights, not the whole stack (7 trips x the
    # stack would be 7 * 7 * 128 KiB); the rolled loop costs the unrolled program plus carry copies
    stack = 7 * 256 * 256 * 2
    assert walked.hbm_bytes < 7 * stack
    flat = analyze(unrolled.as_text()).hbm_bytes
    assert flat <= walked.hbm_bytes <= 2.5 * flat


def test_compiled_collectives_have_their_shapes_bytes():
    """On 4 v5p chips, inside a loop of 3: an all-gather of a [64, 128] fp32 shard (groups of 4),
    a psum of [256, 128] fp32: the walk gives their bytes x 3."""
    mesh = _tpu_sharding(4)
    spec = NamedSharding(mesh, P("x"))
    a = jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=spec)

    def body(x):
        def step(c, _):
            g = jax.lax.all_gather(c, "x", tiled=True)  # [256, 128] from [64, 128]
            r = jax.lax.psum(g * 2.0, "x")  # [256, 128]
            return c + r[:64] + g[64:128], None
        return jax.lax.scan(step, x, None, length=3)[0]

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    c = analyze(jax.jit(fn).lower(a).compile().as_text())
    shard = 64 * 128 * 4
    assert c.collective_bytes["all-gather"] == 3 * 4 * shard
    assert c.collective_bytes["all-reduce"] + c.collective_bytes["reduce-scatter"] == 3 * 4 * shard
    assert c.ici_bytes["all-gather"] == pytest.approx(3 * 4 * shard * 3 / 4)


# A fusion that reads one [8, 32] window of a stacked f32[64, 32] operand through a pad, a convert to
# bf16 and a reshape (the shape XLA gives a windowed einsum's operand), and one that also uses the
# padded value whole: the first reads the window only, the second the whole operand.
SLICED_HLO = """HloModule sliced

%window (p0: f32[64,32], i0: s32[]) -> bf16[8,32] {
  %p0 = f32[64,32]{1,0} parameter(0)
  %i0 = s32[] parameter(1)
  %zero.f = f32[] constant(0)
  %pad.1 = f32[72,32]{1,0} pad(%p0, %zero.f), padding=0_8x0_0
  %convert.1 = bf16[72,32]{1,0} convert(%pad.1)
  %reshape.1 = bf16[9,8,32]{2,1,0} reshape(%convert.1)
  %zero.i = s32[] constant(0)
  %ds.1 = bf16[1,8,32]{2,1,0} dynamic-slice(%reshape.1, %i0, %zero.i, %zero.i), dynamic_slice_sizes={1,8,32}
  ROOT %reshape.2 = bf16[8,32]{1,0} reshape(%ds.1)
}

%whole (q0: f32[64,32], j0: s32[]) -> (bf16[8,32], f32[72,32]) {
  %q0 = f32[64,32]{1,0} parameter(0)
  %j0 = s32[] parameter(1)
  %zero.g = f32[] constant(0)
  %pad.2 = f32[72,32]{1,0} pad(%q0, %zero.g), padding=0_8x0_0
  %convert.2 = bf16[72,32]{1,0} convert(%pad.2)
  %zero.j = s32[] constant(0)
  %ds.2 = bf16[8,32]{1,0} dynamic-slice(%convert.2, %j0, %zero.j), dynamic_slice_sizes={8,32}
  ROOT %t = (bf16[8,32]{1,0}, f32[72,32]{1,0}) tuple(%ds.2, %pad.2)
}

ENTRY %main (x: f32[64,32], k: s32[]) -> bf16[8,32] {
  %x = f32[64,32]{1,0} parameter(0)
  %k = s32[] parameter(1)
  %f.2 = (bf16[8,32]{1,0}, f32[72,32]{1,0}) fusion(%x, %k), kind=kLoop, calls=%whole
  ROOT %f.1 = bf16[8,32]{1,0} fusion(%x, %k), kind=kLoop, calls=%window
}
"""


def test_a_window_read_through_pad_convert_and_reshape_counts_the_window_only():
    c = analyze(SLICED_HLO)
    window = 8 * 32 * 4 + 4 + 8 * 32 * 2  # the f32 window of x (its bf16 slice's elements), the index, the result
    whole = 64 * 32 * 4 + 4 + (8 * 32 * 2 + 72 * 32 * 4)  # x read whole: the padded value leaves the fusion
    assert c.hbm_bytes == window + whole
