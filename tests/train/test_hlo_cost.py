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


# A module with the source stack frames JAX records (the tables XLA prints at the top; a frame's
# parent printed one above its id, a root as its own id): a CE chunk loop of 4 trips whose
# conditional runs a loss branch (exp + multiply of f32[256,128]: 262144 + 393216 bytes, unfused)
# or skips (the parameter itself: 0 bytes), and one op of each other kind.
FRAMES_HLO = """HloModule frames

FileNames
1 "/w/sft/loss.py"
2 "/w/clover_jax/model/moe.py"
3 "/w/clover_jax/model/nn.py"
4 "/w/.venv/lib/python3.11/site-packages/optax/_src/update.py"
5 "/w/train/step.py"

FunctionNames
1 "_chunk_sweep.<locals>.body"
2 "MoE.__call__"
3 "Dense.__call__"
4 "apply_updates"
5 "make_train_step.<locals>.step"

FileLocations
1 {file_name_id=1 function_name_id=1 line=111 end_line=111 column=8 end_column=8}
2 {file_name_id=2 function_name_id=2 line=500 end_line=500 column=8 end_column=8}
3 {file_name_id=3 function_name_id=3 line=60 end_line=60 column=8 end_column=8}
4 {file_name_id=4 function_name_id=4 line=40 end_line=40 column=8 end_column=8}
5 {file_name_id=5 function_name_id=5 line=146 end_line=146 column=8 end_column=8}

StackFrames
1 {file_location_id=5 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=2}
3 {file_location_id=2 parent_frame_id=2}
4 {file_location_id=3 parent_frame_id=4}
5 {file_location_id=4 parent_frame_id=2}

%dear (a: f32[256,128]) -> f32[256,128] {
  %a = f32[256,128]{1,0} parameter(0)
  %e = f32[256,128]{1,0} exponential(%a), metadata={op_name="exp" stack_frame_id=2}
  ROOT %m = f32[256,128]{1,0} multiply(%e, %a), metadata={op_name="mul" stack_frame_id=2}
}

%skip (b: f32[256,128]) -> f32[256,128] {
  ROOT %b = f32[256,128]{1,0} parameter(0)
}

%body (arg: (s32[], f32[256,128], pred[])) -> (s32[], f32[256,128], pred[]) {
  %arg = (s32[], f32[256,128]{1,0}, pred[]) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[256,128]{1,0} get-tuple-element(%arg), index=1
  %p = pred[] get-tuple-element(%arg), index=2
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %c = f32[256,128]{1,0} conditional(%p, %x, %x), true_computation=%dear, false_computation=%skip, metadata={op_name="cond" stack_frame_id=2}
  ROOT %t = (s32[], f32[256,128]{1,0}, pred[]) tuple(%next, %c, %p)
}

%cond (arg.1: (s32[], f32[256,128], pred[])) -> pred[] {
  %arg.1 = (s32[], f32[256,128]{1,0}, pred[]) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  %limit = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.1, %limit), direction=LT
}

ENTRY %main (x0: f32[256,128], p0: pred[], xa: f32[8,16], wb: f32[16,32], w: bf16[64,32], big: f32[64,32]) -> f32[256,128] {
  %x0 = f32[256,128]{1,0} parameter(0)
  %p0 = pred[] parameter(1)
  %xa = f32[8,16]{1,0} parameter(2)
  %wb = f32[16,32]{1,0} parameter(3)
  %w = bf16[64,32]{1,0} parameter(4)
  %big = f32[64,32]{1,0} parameter(5)
  %moe = bf16[64,32]{1,0} negate(%w), metadata={op_name="neg" stack_frame_id=3}
  %moe_dot = f32[8,32]{1,0} dot(%xa, %wb), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="dot" stack_frame_id=3}
  %router = f32[8,32]{1,0} dot(%xa, %wb), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="dot" stack_frame_id=4}
  %ragged-dot-none.2 = f32[8,32]{1,0} custom-call(%xa, %wb), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"k",
"cost_estimate":{"flops":"8192","transcendentals":"0","bytes_accessed":"1000","remote_bytes_transferred":"0"}}}
  %all-gather.1 = f32[32,16]{1,0} all-gather(%xa), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}
  %update = f32[16,32]{1,0} add(%wb, %wb), metadata={op_name="add" stack_frame_id=5}
  %norm = f32[16,32]{1,0} subtract(%wb, %wb), metadata={op_name="sub" stack_frame_id=1}
  %slice-start.1 = ((f32[64,32]{1,0}), f32[8,32]{1,0}, s32[]) slice-start(%big), slice={[0:8], [0:32]}
  %slice-done.1 = f32[8,32]{1,0} slice-done(%slice-start.1)
  %other = f32[8,16]{1,0} negate(%xa)
  %init = (s32[], f32[256,128]{1,0}, pred[]) tuple(%one.0, %x0, %p0)
  %one.0 = s32[] constant(0)
  %while.1 = (s32[], f32[256,128]{1,0}, pred[]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[256,128]{1,0} get-tuple-element(%while.1), index=1
}
"""


def test_breakdown_books_each_op_to_its_source_and_the_ce_loop_scales_by_its_share():
    """By hand. Categories from the stack frames, innermost first: the conditional and its branch ops
    in sft/loss.py's chunk body -> CE; MoE.__call__ -> MoE other, its dot -> MoE grouped matmuls; a
    Dense called inside it -> dense projections (the innermost frame wins); optax -> optimizer;
    train/step.py as the innermost frame -> optimizer (only there: it is every op's outer frame); the
    grouped-matmul kernel by name; the all-gather by opcode; an async slice reads its slice only;
    no frame -> norms / other. The CE loop: 4 chunks x 655,360 bytes of its loss branch at the
    upper bound; with a share s of the chunks holding loss tokens, the skip branch (0 bytes) runs
    in the rest."""
    from train.hlo_breakdown import CE, COLLECTIVES, DENSE, MOE_MATMULS, MOE_OTHER, OPTIMIZER, OTHER

    c = analyze(FRAMES_HLO, breakdown=True)
    branch = 256 * 128 * 4 * 2 + 256 * 128 * 4 * 3  # exp (read, write), multiply (2 reads, write)
    dot = 8 * 16 * 4 + 16 * 32 * 4 + 8 * 32 * 4
    want = {CE: 4 * branch, MOE_OTHER: 2 * 64 * 32 * 2, MOE_MATMULS: dot + 1000, DENSE: dot,
            COLLECTIVES: 8 * 16 * 4 + 32 * 16 * 4, OPTIMIZER: 2 * 3 * 16 * 32 * 4,
            OTHER: 2 * 8 * 32 * 4 + 2 * 8 * 16 * 4 + 4 * (3 * 4) + 4 * (4 + 4 + 1)}  # + the loop's counter
    assert c.hbm_by_category == pytest.approx(want), c.hbm_by_category
    assert c.hbm_bytes == pytest.approx(sum(want.values()))
    assert c.cond_spread == {CE: [4 * branch, 4 * 256 * 128]}  # bytes, FLOPs (the multiply)
    for share in (0.0, 0.25, 1.0):
        assert c.hbm_at(share) == pytest.approx(c.hbm_bytes - (1 - share) * 4 * branch)
        assert c.flops_at(share) == pytest.approx(c.flops - (1 - share) * 4 * 256 * 128)
    with pytest.raises(ValueError, match="share 1.5"):
        c.hbm_at(1.5)
    plain = analyze(FRAMES_HLO)  # without a breakdown: the same total, the spread under "all"
    assert plain.hbm_bytes == c.hbm_bytes and plain.hbm_by_category == {} and plain.cond_spread == {"all": c.cond_spread[CE]}
