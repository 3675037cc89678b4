"""Memory planning: topology names, remat policies (on a function of our own), and the AOT compile
of the (stand-in) train step for a small TPU slice through libtpu on this CPU machine."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.parallel import remat
from clover_jax.config import get_preset
from clover_jax.parallel.sharding import MeshConfig
from clover_jax.yaml_config import ConfigError
from tests.model.parity_utils import FP32_REL, assert_rel_close
from train.aot import CompileConfig, GiB, PlanError, check, parse_topology, plan


def test_topology_names_map_to_chip_grids_and_hbm():
    cases = {  # name -> (libtpu shape, chips, HBM GiB per chip)
        "v5p-8": ("v5p:2x2x1", 4, 95), "v5p-64": ("v5p:2x4x4", 32, 95), "v5p-128": ("v5p:4x4x4", 64, 95),
        "v6e-8": ("v6e:2x4", 8, 32), "v6e-256": ("v6e:16x16", 256, 32), "v5litepod-16": ("v5e:4x4", 16, 16),
        "v4-32": ("v4:2x2x4", 16, 32), "v5p:4x4x8": ("v5p:4x4x8", 128, 95),
    }
    for name, (desc, chips, hbm) in cases.items():
        t = parse_topology(name)
        assert (t.desc, t.chips, t.hbm_bytes) == (desc, chips, hbm * GiB), name
    for bad, msg in (("v5p-7", "multiple"), ("tpu9-8", "unknown TPU family"), ("v5p", "expected e.g.")):
        with pytest.raises(ConfigError, match=msg):
            parse_topology(bad)
    with pytest.raises(ConfigError, match="compile.remat"):
        CompileConfig(remat="dots")


def _layer(x, w1, w2, w3, wb):
    """A toy layer: a plain matmul (tanh after it), a batched matmul, and the two tagged outputs."""
    h = jnp.tanh(x @ w1)  # dot [4, 5], no batch dims
    a = remat.tag(h @ w2, remat.ATTN_OUT)  # [4, 7]
    b = jnp.einsum("bij,bjk->bik", a.reshape(2, 2, 7), wb)  # batched dot [2, 2, 3]
    return remat.tag(jnp.sin(b.reshape(4, 3)) + jnp.cos(a) @ w3, remat.MOE_OUT)  # [4, 3]


def _saved_shapes(f, *args):
    _, vjp = jax.vjp(f, *args)
    return {tuple(r.shape) for r in jax.tree.leaves(vjp)}


@pytest.mark.parametrize("policy,saved,recomputed", [
    ("none", {(4, 5), (4, 7)}, set()),
    ("full", set(), {(4, 5), (4, 7), (2, 2, 3), (4, 3)}),
    ("dots_saveable", {(4, 5), (4, 7), (2, 2, 3)}, set()),
    ("dots_with_no_batch_dims_saveable", {(4, 5), (4, 7)}, {(2, 2, 3)}),
    ("save_moe_and_attn_out", {(4, 7)}, {(4, 5), (2, 2, 3)}),
    ("save_dots_and_moe_out", {(4, 5), (4, 7)}, {(2, 2, 3)}),
])
def test_remat_policies_save_what_they_say(policy, saved, recomputed):
    ks = jax.random.split(jax.random.key(0), 5)
    shapes = ((4, 6), (6, 5), (5, 7), (7, 3), (2, 7, 3))
    args = [jax.random.normal(k, s) for k, s in zip(ks, shapes)]
    f = remat.apply(_layer, policy)
    res = _saved_shapes(f, *args) - set(shapes)  # residuals other than the inputs
    assert saved <= res and not (recomputed & res), res
    loss = lambda g: lambda *a: jnp.sum(g(*a) ** 2)  # noqa: E731
    ref = jax.grad(loss(_layer), argnums=tuple(range(5)))(*args)
    for a, b in zip(jax.grad(loss(f), argnums=tuple(range(5)))(*args), ref):
        assert_rel_close(a, b, FP32_REL / 10, policy)  # the same ops, recomputed: 10x tighter, as before


def test_remat_names_and_context():
    assert remat.resolve(True) == "full" and remat.resolve(False) == "none"
    with pytest.raises(ValueError, match="did you mean 'dots_saveable'"):
        remat.resolve("dots_savable")
    assert remat.current() == "none"
    with remat.use_policy("full"):
        assert remat.current() == "full"
    assert remat.current() == "none"


def test_layer_stack_applies_the_configured_policy():
    """The policy reaches the scanned layer stack: from the model config (`model.remat`), and the
    `remat.use_policy` context overrides it. Measured by the residuals the backward would keep
    (traced only): full < save_moe_and_attn_out < none."""
    from flax import nnx

    from clover_jax.model.clover_model import abstract_model

    cfg = get_preset("tiny").replace(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    ids = jnp.zeros((2, 16), jnp.int32)

    def residual_bytes(policy, context=None):
        gd, state = nnx.split(abstract_model(cfg.replace(remat=policy)))
        f = lambda p: nnx.merge(gd, p).hidden_states(ids)[0]  # noqa: E731
        with remat.use_policy(context) if context else contextlib.nullcontext():
            res = jax.eval_shape(lambda p: jax.vjp(f, p)[1], state)
        return sum(int(np.prod(r.shape)) * r.dtype.itemsize for r in jax.tree.leaves(res))

    none, saved, full = (residual_bytes(p) for p in ("none", "save_moe_and_attn_out", "full"))
    assert full < saved < none, (full, saved, none)
    assert residual_bytes("none", context="full") == full
    with pytest.raises(Exception, match="remat: unknown policy 'dots'"):
        cfg.replace(remat="dots")


# The recipe's real SFT step (configs/agent_mix.yaml: two-stream forward, masked-diffusion loss,
# backward, adamw with bf16 mu, micro-batch accumulation, its 2048-token CE chunks per chip) for the slice and
# row length the recipe targets (v5p-64, seq 8192) at small widths: 2 layers of the bench preset
# (TPU-tile multiples, so layout padding stays small). The 35B compile itself takes 10-30 minutes on 2
# cores (docs/guides/aot_plans.md); the program's structure is the same.
SMALL_RECIPE = ["model.preset=small-cpu", "model.num_hidden_layers=2",
                "model.layer_types=[linear_attention,full_attention]", "data.seq_len=8192", "data.batch_size=32",
                "train.micro_batches=2", "mesh.fsdp=8", "mesh.expert=4"]


def test_compile_plans_the_recipe_sft_step_for_v5p_64_at_seq_8192():
    """On v5p-64 (32 chips, fsdp=8 x expert=4) at seq 8192: it fits; the argument bytes are the
    per-chip shards of the fp32 params + adam mu (bf16) / nu (fp32) from the rule table + the batch,
    up to TPU layout padding; the program holds the real TPU ragged-all-to-all, ragged dots, the
    megablox tgmm weight gradient, the Pallas (Mosaic) GDN kernels of both streams and splash
    attention for both; its FLOPs agree with the analytic count within 10% (at these widths and 8K
    tokens the attention is a third of the forward, so the splash backward's recomputed scores
    count: without that term the ratio is 1.23)."""
    from flax import nnx

    import launch
    from clover_jax.model.clover_model import abstract_model
    from clover_jax.parallel.sharding import make_mesh, param_shardings
    from sft.config import load_sft_config, model_config_from
    from train.aot import topology_devices

    (p,) = launch._sft_compile_plans("configs/agent_mix.yaml", SMALL_RECIPE, ["v5p-64"])
    assert check(p) is p and p.fits and p.compiled
    assert p.mesh_shape == {"data": 1, "fsdp": 8, "expert": 4, "context": 1, "tensor": 1}
    assert (p.micro_batches, p.micro_batch, p.seq_len, p.remat) == (2, 16, 8192, "full")
    mcfg = model_config_from(load_sft_config("configs/agent_mix.yaml", SMALL_RECIPE).model, None)
    model = abstract_model(mcfg)
    shard = param_shardings(model, make_mesh(MeshConfig(fsdp=8, expert=4), topology_devices(parse_topology("v5p-64"))))
    exact = 32 * 8192 * (3 * 4 + 1) // 32  # ids, segments, positions (int32), loss mask (bool): rows over 32 chips
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        node = shard
        for key in path:
            node = node[key]
        exact += (4 + 2 + 4) * int(np.prod(node.shard_shape(var.get_value().shape)))  # fp32 value, bf16 mu, fp32 nu
    assert exact <= p.argument_bytes <= 1.05 * exact, (p.argument_bytes, exact)
    assert 0 < p.temp_bytes < 8 * GiB
    hlo = p.executable.as_text()
    # the real collective, ragged dots, and the expert weight gradients from the megablox tgmm
    # kernel (JAX's own transpose would be a dense masked product over all local experts)
    assert "ragged-all-to-all" in hlo and "ragged-dot" in hlo and "tgmm" in hlo
    assert all(f"gdn_block_{n}" in hlo for n in ("sweep", "noisy", "state_bwd", "parallel_bwd"))
    # both streams' attention through the splash kernels, forward and backward (attn_backend auto -> splash)
    assert "splash_mha_fwd" in hlo and "splash_mha_dkv" in hlo and "splash_mha_dq" in hlo
    # the plan's FLOPs (the optimized HLO walked with loop trip counts, every kernel costed) agree
    # with the analytic count of the step (sft.step_flops, remat full: the layers' forward twice)
    assert not p.hlo.uncosted.keys() - {"ragged-dot-metadata"} and not p.hlo.unknown_trips
    assert {"splash_mha_fwd_segmented_residuals", "gdn_block_sweep", "tgmm", "ragged-dot-none"} <= p.hlo.kernels.keys()
    assert abs(p.flops_per_chip * p.topology.chips / p.analytic_flops - 1) < 0.10, p.table()
    assert p.xla_flops_per_chip < p.flops_per_chip  # XLA's own count takes each loop body once
    assert all(p.hlo.collective_bytes[k] > 0 for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all"))
    table = p.table()
    assert "fits" in table and "SFT step" in table and "roofline on v5p" in table and "not a measurement" in table
    d = p.as_dict()
    assert d["roofline"]["bound"] in ("compute", "HBM bandwidth", "interconnect") and 0 < d["roofline"]["mfu"] < 1


def test_cli_reports_a_step_that_does_not_fit(capsys):
    """Dense full attention (the jnp reference: splash would fit) over 32k tokens x 4 rows per chip of
    a 16 GiB v5e chip: the planner says it does not fit, how much it needs, and what to try; the CLI
    exits 1."""
    import launch

    rc = launch.main(["compile", "--topology", "v5litepod-4", "model.preset=tiny", "model.num_hidden_layers=2",
                      "model.layer_types=[full_attention,full_attention]", "model.dtype=bfloat16", "model.attn_backend=reference",
                      "compile.seq_len=32768", "compile.micro_batch=16", "compile.remat=none", "mesh.fsdp=4"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "DOES NOT FIT" in err and "GiB per chip but a v5e chip has 16 GiB" in err
    assert "compile.remat=full" in err and "compile.micro_batch=4" in err


@pytest.fixture(scope="module")
def cli_plan(tmp_path_factory):
    """One `launch.py compile` of the tiny model's stand-in step on v5litepod-4 with `--breakdown
    --json --hlo` (one compile shared by the two tests below): (exit code, stdout, output dir)."""
    import io

    import launch

    out_dir, buf = tmp_path_factory.mktemp("cli_plan"), io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = launch.main(["compile", "--topology", "v5litepod-4", "--breakdown", "--json", str(out_dir / "plan.json"),
                          "--hlo", str(out_dir / "plan"), "model.preset=tiny", "model.num_hidden_layers=2",
                          "compile.seq_len=128", "compile.micro_batch=4", "mesh.fsdp=4"])
    return rc, buf.getvalue(), out_dir


def test_cli_writes_the_plan_json_and_the_optimized_hlo(cli_plan):
    """`--json` holds the printed plan's numbers and `--hlo` the optimized program they come from
    (the collective counts of the JSON can be traced back to the HLO's ops)."""
    import gzip
    import json

    rc, out, tmp_path = cli_plan
    assert rc == 0, out
    (d,) = json.load(open(tmp_path / "plan.json"))
    assert d["topology"] == "v5litepod-4" and f"{d['total_bytes'] / GiB:.2f} GiB" in out
    with gzip.open(tmp_path / "plan_v5litepod-4.hlo.txt.gz", "rt") as f:
        hlo = f.read()
    assert hlo.startswith("HloModule") and ("all-gather" in hlo) == (d["hlo_cost"]["collective_bytes"]["all-gather"] > 0)


def test_cli_refuses_an_output_folder_that_does_not_exist_before_compiling(tmp_path, capsys):
    """A wrong `--hlo` / `--json` folder is named at once (exit 1), not after the compile."""
    import launch

    for flag in ("--json", "--hlo"):
        rc = launch.main(["compile", "--topology", "v5litepod-4", flag, str(tmp_path / "missing" / "plan"),
                          "model.preset=tiny"])
        err = capsys.readouterr()
        assert rc == 1 and f"{flag} {tmp_path / 'missing' / 'plan'}: the folder" in err.err, err
        assert "AOT plan" not in err.out  # nothing was compiled


TINY_RECIPE = ["model.preset=tiny", "model.num_hidden_layers=2", "data.seq_len=256", "data.batch_size=4",
               "train.micro_batches=1"]


def test_compiler_options_reach_the_compile_of_their_platform_only():
    """`train.compiler_options.tpu` goes into the TPU compile of the plan (an unknown option is
    refused by that compiler, by name); the cpu / gpu entries never reach it (it would refuse
    them: they are unknown options too). On the compiled plan: the CE chunk loop (`sft.loss` skips
    the chunks without a loss token) counted at its upper bound, and at a share of the chunks on
    request (`--ce-share`): its loss branch's bytes scaled, the roofline's HBM time below the bound's."""
    import dataclasses

    import jax

    import launch
    from clover_jax.yaml_config import ConfigError

    bogus = "{xla_no_such_option_for_the_test: 1}"
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_no_such_option_for_the_test"):
        launch._sft_compile_plans("configs/agent_mix.yaml", TINY_RECIPE + [f"train.compiler_options={{tpu: {bogus}}}"],
                                  ["v5litepod-4"])
    (p,) = launch._sft_compile_plans(
        "configs/agent_mix.yaml", TINY_RECIPE + [f"train.compiler_options={{cpu: {bogus}, gpu: {bogus}}}"],
        ["v5litepod-4"])
    assert p.compiled
    spread = p.hlo.cond_spread["CE"][0]
    q = dataclasses.replace(p, ce_share=0.25)
    d = q.as_dict()
    assert spread > 0 and d["hbm_bytes_at_ce_share"] == pytest.approx(p.hlo.hbm_bytes - 0.75 * spread)
    assert d["roofline_at_ce_share"]["hbm_s"] < d["roofline"]["hbm_s"]
    assert "with 25% of the chunks holding loss tokens" in "\n".join(q.cost_lines())
    with pytest.raises(ConfigError, match="unknown platform 'tpuv5'"):
        launch._sft_compile_plans("configs/agent_mix.yaml", TINY_RECIPE + [f"train.compiler_options={{tpuv5: {bogus}}}"],
                                  ["v5litepod-4"])


def test_cli_breakdown_books_every_hbm_byte_and_the_moe_ops_to_the_moe(cli_plan):
    """`--breakdown` on the tiny model's plan (`cli_plan`): the printed table, categories in the JSON that sum to
    the walk's total, and the MoE where the HLO's own op names (independent of the stack frames the
    categories come from) say an op is the MoE's: every ragged dot a grouped matmul, the router's
    top-k in the MoE."""
    import gzip
    import json
    import re

    from train.hlo_breakdown import CATEGORIES, MOE_MATMULS, MOE_OTHER, Categorizer
    from train.hlo_cost import parse_module

    rc, out, tmp_path = cli_plan
    assert rc == 0, out
    assert "HBM bytes per chip per step by category" in out and all(c in out for c in CATEGORIES)
    (d,) = json.load(open(tmp_path / "plan.json"))
    by_cat = d["hlo_cost"]["hbm_by_category"]
    assert set(by_cat) <= set(CATEGORIES) and sum(by_cat.values()) == pytest.approx(d["hlo_cost"]["hbm_bytes"])
    assert by_cat[MOE_MATMULS] > 0 and by_cat[MOE_OTHER] > 0
    with gzip.open(tmp_path / "plan_v5litepod-4.hlo.txt.gz", "rt") as f:
        text = f.read()
    comps, _ = parse_module(text)
    cat = Categorizer(text, comps)
    ops = [i for c in comps.values() for i in c]
    ragged = [i for i in ops if i.opcode == "custom-call" and re.search(r'op_name="[^"]*ragged_dot', i.attrs)]
    top_k = [i for i in ops if i.opcode != "parameter" and re.search(r'op_name="[^"]*/top_k"', i.attrs)]
    assert ragged and {cat(i) for i in ragged} == {MOE_MATMULS}
    assert top_k and {cat(i) for i in top_k} == {MOE_OTHER}
