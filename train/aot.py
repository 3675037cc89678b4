"""AOT planner: compile a train step for a TPU topology on this CPU machine and report the per-chip
memory against the chip's HBM, the step's cost per chip (FLOPs, HBM bytes, collective bytes by
kind) and a roofline prediction of its time, tokens/s and MFU (docs/design.md 4, `launch.py compile`).

Nothing of the model is materialised: params (fp32 master copies) and the optax adamw state are
`jax.ShapeDtypeStruct`s carrying their shardings (the rule table of `clover_jax.parallel.sharding`), the
topology's devices come from libtpu (`jax.experimental.topologies.get_topology_desc`), and
`compiled.memory_analysis()` gives the memory of the real TPU program. The cost is walked from the
optimized HLO (`train.hlo_cost`: every loop x its trip count; XLA's `cost_analysis()` counts a loop
body once and is kept beside it), the Pallas kernels costed by `clover_jax.model.kernel_costs`; the
roofline is `train.roofline`'s.

Two entry points: `compile_plan(jitted, abstract_args, ...)` measures any jitted step (the launcher
passes the real SFT step of a recipe: two-stream forward + masked-diffusion loss + backward +
optimizer, with its gradient accumulation), and `plan(model_cfg, mesh_cfg, compile_cfg)` builds and
measures `ar_train_step`, a generic stand-in on the clean stream only: next-token CE through
`model.hidden_states` + `model.logits` in token chunks (the [B, T, V] logits never exist), plus the
MoE load-balancing loss, adamw update. GDN and attention layers compile with the Pallas (Mosaic)
kernels: `gdn_backend` / `attn_backend: auto` become `pallas` / `splash` (`tpu_kernels`; on this CPU
host auto means the references).
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from clover_jax.parallel import remat, sharding
from clover_jax.config import ModelConfig, param_count
from clover_jax.model import kernel_costs
from clover_jax.model.clover_model import abstract_model
from clover_jax.run_config import CompileConfig  # the `compile:` section (re-exported)
from clover_jax.yaml_config import ConfigError

from . import hlo_cost
from . import roofline as roofline_lib

GiB = 1024**3

# per family: HBM per chip (GiB), TensorCores per chip (the "-N" of v4/v5p counts cores, of v5e/v6e
# chips), torus dimensions
_FAMILIES = {
    "v5p": (95, 2, 3),
    "v4": (32, 2, 3),
    "v6e": (32, 1, 2),
    "v5e": (16, 1, 2),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}


@dataclass(frozen=True)
class Topology:
    """A TPU slice: `family` ("v5p"), chip grid `shape` ((2, 4, 4)), HBM per chip in bytes."""

    name: str
    family: str
    shape: tuple[int, ...]
    hbm_bytes: int

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def desc(self) -> str:
        """The libtpu topology string, e.g. "v5p:2x4x4"."""
        return f"{self.family}:{'x'.join(map(str, self.shape))}"


def _grid(chips: int, dims: int) -> tuple[int, ...]:
    """The standard slice shape of `chips` chips. 3-D (v4, v5p): 2x2x1 for one host, then double
    the last of the smallest dims (8 -> 2x2x2, 32 -> 2x4x4, 64 -> 4x4x4, 128 -> 4x4x8). 2-D (v5e,
    v6e): the same doubling from 1x1 (8 -> 2x4, 16 -> 4x4, 256 -> 16x16)."""
    if chips < 1 or chips & (chips - 1):
        raise ConfigError(f"topology: {chips} chips is not a power of two")
    shape = [1] * dims
    start = [(2, 1, 1), (2, 2, 1)] if dims == 3 else []  # 3-D slices fill x, y before z
    for s in start:
        if math.prod(shape) < chips:
            shape = list(s)
    while math.prod(shape) < chips:
        i = max(j for j, s in enumerate(shape) if s == min(shape))
        shape[i] *= 2
    return tuple(shape)


def parse_topology(name: str) -> Topology:
    """"v5p-64" (64 TensorCores = 32 chips), "v6e-256", "v5litepod-16", "v4-32", or a raw libtpu
    string "v5p:2x4x4"."""
    raw = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)*)", name)
    named = re.fullmatch(r"([a-z0-9]+)-(\d+)", name)
    if not (raw or named):
        raise ConfigError(f"topology {name!r}: expected e.g. v5p-64, v6e-256 or v5p:2x4x4")
    fam = _ALIASES.get((raw or named).group(1), (raw or named).group(1))
    if fam not in _FAMILIES:
        raise ConfigError(f"topology {name!r}: unknown TPU family {fam!r} (known: {', '.join(_FAMILIES)}, v5litepod)")
    hbm, cores, dims = _FAMILIES[fam]
    if raw:
        shape = tuple(int(s) for s in raw.group(2).split("x"))
    else:
        n = int(named.group(2))
        if n % cores:
            raise ConfigError(f"topology {name!r}: {fam}-N counts TensorCores ({cores} per chip); {n} is not a multiple")
        shape = _grid(n // cores, dims)
    return Topology(name, fam, shape, hbm * GiB)


def topology_devices(topo: Topology) -> list[Any]:
    """The slice's devices, compile-only (needs libtpu installed: `pip install "jax[tpu]"`)."""
    import os

    from jax.experimental import topologies

    # libtpu otherwise takes /tmp/libtpu_lockfile: a second planner (or test) on the machine would abort
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return list(topologies.get_topology_desc(topo.desc, platform="tpu").devices)
    except Exception as e:  # libtpu missing or an unknown shape: say which
        raise RuntimeError(f"topology {topo.name} ({topo.desc}): libtpu could not describe it ({e})") from e


# ---------------------------------------------------------------------------------------------
class PlanError(RuntimeError):
    """The step does not fit the chip; the message holds the table and suggestions."""


@dataclass(frozen=True)
class MemoryPlan:
    model: str
    params: int
    topology: Topology
    mesh_shape: dict[str, int]
    micro_batch: int
    seq_len: int
    remat: str
    remat_applied: bool
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    flops_per_chip: float  # from the optimized HLO with loop trip counts (`hlo`); XLA's own count below
    model_flops: float  # the FLOPs MFU counts (whole step, all chips): the analytic model count
    compile_seconds: float
    micro_batches: int = 1  # gradient accumulation: micro-batches of `micro_batch` rows per step
    step_name: str = "stand-in AR step"
    xla_flops_per_chip: float = float("nan")  # XLA's cost analysis: every while body counted once
    analytic_flops: float = float("nan")  # the analytic count of what the step executes (all chips)
    tokens_per_step: int = 0  # data tokens per optimizer step (all chips)
    ce_share: float | None = None  # share of the CE chunks holding loss tokens (None: the upper bound only)
    breakdown: bool = False  # print the HBM bytes per category (train.hlo_breakdown)
    hlo: Any = field(default=None, repr=False, compare=False)  # train.hlo_cost.HloCost of the program
    executable: Any = field(default=None, repr=False, compare=False)  # the jax Compiled (None if refused)

    @property
    def total_bytes(self) -> int:
        """Peak per chip: live arguments + outputs not aliased to donated arguments + temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.topology.hbm_bytes

    @property
    def compiled(self) -> bool:
        """False when the TPU compiler refused the program for HBM (temporaries from its error)."""
        return self.flops_per_chip == self.flops_per_chip  # not NaN

    def table(self) -> str:
        hbm = self.topology.hbm_bytes
        row = lambda k, v: f"  {k:<28}{v / GiB:>9.2f} GiB {100 * v / hbm:>6.1f}%"  # noqa: E731
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        tokens = self.micro_batch * self.seq_len
        rm = self.remat if self.remat_applied else f"{self.remat} (NOT applied: the layer stack ignores clover_jax.parallel.remat)"
        accum = f"{self.micro_batches} x " if self.micro_batches > 1 else ""
        lines = [
            f"AOT plan: {self.model} ({self.params / 1e9:.2f}B params), {self.step_name}, on {self.topology.name} "
            f"({self.topology.chips} chips, {self.topology.desc}, {hbm / GiB:.0f} GiB HBM/chip)",
            f"  mesh {mesh} | {accum}micro-batch {self.micro_batch} rows x seq {self.seq_len} = {tokens} tokens "
            f"({tokens / self.topology.chips:.0f}/chip) | remat {rm} | compiled in {self.compile_seconds:.0f} s",
            f"  {'per chip':<28}{'':>13}{'of HBM':>8}",
            row("arguments (params+opt+batch)", self.argument_bytes),
            row("outputs", self.output_bytes),
            row("  aliased to donated args", -self.alias_bytes),
            row("temporaries", self.temp_bytes),
            row("generated code", self.code_bytes),
            row("total", self.total_bytes) + ("   fits" if self.fits else "   DOES NOT FIT")
            + ("" if self.compiled else " (the TPU compiler refused it: temporaries from its error)"),
            *self.cost_lines(),
        ]
        return "\n".join(lines)

    def roofline(self, ce_share: float | None = None) -> "roofline_lib.Roofline | None":
        """The step's roofline on this topology's chip (None: not compiled, or no figures for it);
        `ce_share`: with the CE's per-chunk branch run in that share of the chunks (else in all)."""
        if self.hlo is None or self.topology.family not in roofline_lib.CHIPS:
            return None
        h, s = self.hlo, (1.0 if ce_share is None else ce_share)
        return roofline_lib.roofline(self.topology.family, flops=self.flops_per_chip - (h.flops - h.flops_at(s)),
                                     hbm_bytes=h.hbm_at(s), ici_bytes=sum(h.ici_bytes.values()),
                                     chips=self.topology.chips, tokens_per_step=self.tokens_per_step,
                                     model_flops=self.model_flops)

    def cost_lines(self) -> list[str]:
        """FLOPs, HBM and collective bytes per chip per step, against the analytic count, and the
        roofline prediction."""
        if self.hlo is None:
            return [f"  FLOPs/step: n/a (not compiled); model FLOPs {self.model_flops:.3e}"]
        h, n = self.hlo, self.topology.chips
        kern = sum(f for _, f in h.kernels.values())
        lines = [f"  per chip per step (optimized HLO, every loop x its trip count): FLOPs {self.flops_per_chip:.3e} "
                 f"(dots {h.dot_flops / max(h.flops, 1):.0%}, Pallas kernels {kern / max(h.flops, 1):.0%}, "
                 f"elementwise {h.elementwise_flops / max(h.flops, 1):.0%}), HBM {h.hbm_bytes / 1e9:,.1f} GB"]
        coll = ", ".join(f"{k} {v / 1e9:,.2f}" for k, v in h.collective_bytes.items())
        lines.append(f"  collectives per chip per step (GB): {coll}; ICI traffic {sum(h.ici_bytes.values()) / 1e9:,.2f} GB")
        ratio = self.flops_per_chip * n / self.analytic_flops if self.analytic_flops == self.analytic_flops else None
        lines.append(f"  FLOPs x {n} chips = {self.flops_per_chip * n:.3e}" +
                     (f" vs the analytic count {self.analytic_flops:.3e} (ratio {ratio:.3f})" if ratio else "") +
                     f"; model FLOPs (MFU) {self.model_flops:.3e}; XLA's cost analysis (loop bodies once) "
                     f"{self.xla_flops_per_chip:.3e}/chip")
        lines += self.ce_lines()
        if self.breakdown:
            from .hlo_breakdown import table

            lines += table(h.hbm_by_category, h.hbm_bytes)
        if h.uncosted:
            lines.append(f"  kernels without a cost (counted as 0 FLOPs): {', '.join(sorted(h.uncosted))}")
        if h.unknown_trips:
            lines.append(f"  loops with an unreadable trip count (counted once): {len(h.unknown_trips)}")
        r = self.roofline()
        lines += r.lines() if r else [f"  roofline: no chip figures for {self.topology.family}"]
        return lines

    def ce_lines(self) -> list[str]:
        """The CE chunk loop's HBM bytes at the upper bound (every chunk runs its loss branch) and, with
        `ce_share`, when only that share of the chunks holds loss tokens."""
        h = self.hlo
        spread = h.cond_spread.get("CE", [0.0, 0.0])[0]
        if not spread:
            return []
        ce = h.hbm_by_category.get("CE", 0.0)
        out = [f"  CE chunk loop: {ce / 1e9:,.1f} GB HBM per chip per step at the upper bound (every chunk "
               f"computed; {spread / 1e9:,.1f} GB of it in the chunks' loss branch)"]
        if self.ce_share is not None:
            r = self.roofline(self.ce_share)
            out.append(f"    with {self.ce_share:.0%} of the chunks holding loss tokens (--ce-share): CE "
                       f"{(ce - (1 - self.ce_share) * spread) / 1e9:,.1f} GB, step HBM "
                       f"{h.hbm_at(self.ce_share) / 1e9:,.1f} GB" +
                       (f", step >= {1e3 * r.step_s:,.1f} ms ({r.bound}), MFU <= {100 * r.mfu:.1f}% (prediction)"
                        if r else ""))
        return out

    def as_dict(self) -> dict:
        """The plan as JSON-ready numbers (bytes per chip, FLOPs, the roofline prediction; with
        `ce_share`, the HBM bytes and roofline at that share of CE chunks too)."""
        r = self.roofline()
        at_share = {}
        if self.ce_share is not None and self.hlo is not None:
            rs = self.roofline(self.ce_share)
            at_share = {"ce_share": self.ce_share, "hbm_bytes_at_ce_share": self.hlo.hbm_at(self.ce_share),
                        "roofline_at_ce_share": rs.as_dict() if rs else None}
        return {"model": self.model, "params": self.params, "step": self.step_name, "topology": self.topology.name,
                "chips": self.topology.chips, "hbm_bytes_per_chip": self.topology.hbm_bytes, "mesh": self.mesh_shape,
                "micro_batches": self.micro_batches, "micro_batch": self.micro_batch, "seq_len": self.seq_len,
                "remat": self.remat, "argument_bytes": self.argument_bytes, "output_bytes": self.output_bytes,
                "alias_bytes": self.alias_bytes, "temp_bytes": self.temp_bytes, "code_bytes": self.code_bytes,
                "total_bytes": self.total_bytes, "fits": self.fits, "compiled": self.compiled,
                "compile_seconds": self.compile_seconds, "flops_per_chip": self.flops_per_chip,
                "xla_flops_per_chip": self.xla_flops_per_chip, "analytic_flops": self.analytic_flops,
                "model_flops": self.model_flops, "tokens_per_step": self.tokens_per_step,
                "hlo_cost": self.hlo.as_dict() if self.hlo is not None else None,
                "roofline": r.as_dict() if r else None, **at_share}

    def suggestions(self) -> list[str]:
        out = []
        state = self.argument_bytes
        if state > 0.8 * self.topology.hbm_bytes:
            out.append(f"params + optimizer state alone take {state / GiB:.1f} GiB/chip: shard them over more "
                       f"chips (a bigger topology, or mesh.fsdp / mesh.expert covering all {self.topology.chips})")
        if not self.remat_applied:
            out.append(f"rematerialisation: the layer stack ignored compile.remat={self.remat} (layers.run_stack "
                       "does not read clover_jax.parallel.remat yet), so every layer's activations stay live")
        elif remat.resolve(self.remat) != "full":
            out.append("compile.remat=full (recompute each layer group in the backward)")
        shards = self.mesh_shape["data"] * self.mesh_shape["fsdp"] * self.mesh_shape["expert"]
        if self.micro_batch > shards:
            knob = (f"compile.micro_batch={shards}" if self.micro_batches == 1 else
                    f"train.micro_batches={self.micro_batches * self.micro_batch // shards}")
            out.append(f"a smaller micro-batch ({knob}: one row per batch shard; accumulate gradients over "
                       "more micro-batches)")
        sft = self.step_name.startswith("SFT")
        if sft and self.micro_batch < shards and self.micro_batches > 1:
            out.append(f"fewer, larger micro-batches (train.micro_batches < {self.micro_batches}): with "
                       f"{self.micro_batch} rows per micro-batch the {shards} batch shards cannot all split them, "
                       "so activations are replicated over the rest")
        if self.mesh_shape["fsdp"] < self.topology.chips:
            out.append("more FSDP (mesh.fsdp=-1 with the other axes at 1)")
        out.append(f"a shorter {'data' if sft else 'compile'}.seq_len (now {self.seq_len})")
        return out


# ---------------------------------------------------------------------------------------------
# the stand-in step
def ar_batch_shapes(micro_batch: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Batch of `ar_train_step`: ids, next-token targets, loss mask, segment ids, all [B, T]."""
    s = (micro_batch, seq_len)
    return {"input_ids": jax.ShapeDtypeStruct(s, jnp.int32), "targets": jax.ShapeDtypeStruct(s, jnp.int32),
            "loss_mask": jax.ShapeDtypeStruct(s, jnp.float32), "segment_ids": jax.ShapeDtypeStruct(s, jnp.int32)}


def chunked_ce(model: Any, h_BTD: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array, chunk: int) -> jax.Array:
    """Sum over tokens of `mask * CE(lm_head(h), target)`, `chunk` positions at a time under
    `jax.checkpoint`: only one [B, chunk, V] logits block is ever live, forward or backward."""
    b, t, d = h_BTD.shape
    c = math.gcd(t, min(chunk, t))
    split = lambda a: a.reshape((b, t // c, c) + a.shape[2:]).swapaxes(0, 1)  # noqa: E731

    @jax.checkpoint
    def one(h, y, m):
        logits = sharding.constrain(model.logits(h), ("batch", "length", "act_vocab"))
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        return jnp.sum((lse - tgt) * m)

    def body(acc, xs):
        return acc + one(*xs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (split(h_BTD), split(targets_BT), split(mask_BT)))
    return total


def ar_train_step(graphdef: Any, tx: optax.GradientTransformation, params: Any, opt_state: Any,
                  batch: Mapping[str, jax.Array], *, loss_chunk: int, lb_coef: float) -> tuple[Any, Any, dict]:
    """STAND-IN train step (until the SFT step exists): clean-stream next-token CE (chunked) +
    `lb_coef` * MoE lb loss, adamw update. Returns (params, opt_state, metrics)."""
    def loss_fn(p):
        model = nnx.merge(graphdef, p)
        h, aux = model.hidden_states(batch["input_ids"], None, batch["segment_ids"])
        h = sharding.constrain(h, ("batch", "length", "act_embed"))
        n = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
        ce = chunked_ce(model, h, batch["targets"], batch["loss_mask"], loss_chunk) / n
        return ce + lb_coef * aux["lb_loss"], {"ce": ce, "lb_loss": aux["lb_loss"]}

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
    return optax.apply_updates(params, updates), opt_state, metrics


StepFn = Callable[..., tuple[Any, Any, Any]]


# ---------------------------------------------------------------------------------------------
def stack_honours_remat_context() -> bool:
    """Whether `layers.run_stack` takes its policy from `clover_jax.parallel.remat.use_policy` (its `remat`
    default is None); until then a requested policy cannot reach the layer stack."""
    from clover_jax.model import layers

    p = inspect.signature(layers.run_stack).parameters.get("remat")
    return p is not None and p.default is None


def active_params(cfg: ModelConfig) -> int:
    """Params a token touches: all but the (E - k)/E unused share of the routed experts."""
    routed = cfg.num_hidden_layers * 3 * cfg.num_experts * cfg.hidden_size * cfg.moe_intermediate_size
    return param_count(cfg) - routed + routed * cfg.num_experts_per_tok // cfg.num_experts


def tpu_kernels(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with its "auto" kernel backends set to the TPU kernels (Pallas GDN, splash attention):
    on this CPU host "auto" would pick the jnp references, which a TPU never runs."""
    if cfg.gdn_backend == "auto":
        cfg = cfg.replace(gdn_backend="pallas")
    if cfg.attn_backend == "auto":
        cfg = cfg.replace(attn_backend="splash")
    return cfg


def topology_mesh(topology: str, mesh_cfg: sharding.MeshConfig,
                  devices: list[Any] | None = None) -> tuple[Topology, jax.sharding.Mesh]:
    """The slice and the mesh of `mesh_cfg` over its (compile-only) devices."""
    topo = parse_topology(topology)
    devices = devices if devices is not None else topology_devices(topo)
    if len(devices) != topo.chips:  # v4 AOT exposes each TensorCore as a device: split the chip's HBM
        topo = Topology(topo.name, topo.family, topo.shape, topo.hbm_bytes * topo.chips // len(devices))
    try:
        mesh = sharding.make_mesh(mesh_cfg, devices)
    except ValueError as e:
        raise ConfigError(f"mesh on {topo.name} ({len(devices)} devices): {e}") from None
    return topo, mesh


def compile_plan(jitted: Any, args: tuple[Any, ...], *, mesh: jax.sharding.Mesh, rules: sharding.Rules,
                 remat_policy: str, state_args: Any, kernel_cost: hlo_cost.KernelCost | None = None,
                 **info: Any) -> MemoryPlan:
    """Lowers + compiles `jitted(*args)` (abstract args carrying shardings) under the mesh, the rule
    table and the remat policy, and reads the compiler's memory analysis and the program's cost
    (`train.hlo_cost` over the optimized HLO, `kernel_cost` costing the Pallas kernels; XLA's own
    count kept beside it). `state_args`: the donated part of `args` (its per-chip bytes stand in for
    the outputs when the TPU compiler refuses the program for HBM). `info`: the MemoryPlan fields
    that describe the step."""
    info = dict(info, remat=remat.resolve(remat_policy), mesh_shape=dict(mesh.shape),
                remat_applied=remat.resolve(remat_policy) == "none" or stack_honours_remat_context())
    t0 = time.perf_counter()
    with sharding.use_sharding(mesh, rules), remat.use_policy(remat_policy):
        lowered = jitted.lower(*args)
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            temp = _oom_temporaries(str(e))
            if temp is None:
                raise
            # the TPU compiler refuses programs over HBM; keep its number, size the rest ourselves
            state = _per_device_bytes(state_args)
            return MemoryPlan(**info, argument_bytes=_per_device_bytes(args), output_bytes=state, alias_bytes=state,
                              temp_bytes=temp, code_bytes=0, flops_per_chip=float("nan"),
                              compile_seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    walked = hlo_cost.analyze(compiled.as_text(), kernel_cost, breakdown=True)
    return MemoryPlan(
        **info, argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes), temp_bytes=int(mem.temp_size_in_bytes),
        code_bytes=int(getattr(mem, "generated_code_size_in_bytes", 0)),
        flops_per_chip=walked.flops, xla_flops_per_chip=float((cost or {}).get("flops", float("nan"))), hlo=walked,
        compile_seconds=seconds, executable=compiled,
    )


def plan(cfg: ModelConfig, mesh_cfg: sharding.MeshConfig, ccfg: CompileConfig, *, model_name: str = "model",
         step: StepFn = ar_train_step, batch_shapes: Callable[[int, int], Any] = ar_batch_shapes,
         tx: optax.GradientTransformation | None = None, rules: sharding.Rules = sharding.DEFAULT_RULES,
         devices: list[Any] | None = None) -> MemoryPlan:
    """AOT-compiles `step(graphdef, tx, params, opt_state, batch, loss_chunk=, lb_coef=)` for the
    topology and returns its memory plan (raises nothing when it does not fit: see `check`)."""
    topo, mesh = topology_mesh(ccfg.topology, mesh_cfg, devices)
    shards = math.prod(mesh.shape[a] for a in ("data", "fsdp", "expert"))
    b = shards if ccfg.micro_batch == -1 else ccfg.micro_batch
    cfg = cfg.replace(param_dtype="float32")  # fp32 master weights; compute in cfg.dtype
    cfg = tpu_kernels(cfg)
    model = abstract_model(cfg)
    graphdef, _ = nnx.split(model)
    tx = tx or optax.adamw(1e-5, weight_decay=0.1)
    params = sharding.abstract_params(model, mesh, rules)
    p_sh = jax.tree.map(lambda s: s.sharding, params)
    opt = jax.eval_shape(tx.init, params)
    o_sh = sharding.opt_state_shardings(opt, params, mesh)
    opt = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt, o_sh)
    batch = batch_shapes(b, ccfg.seq_len)
    b_sh = jax.tree.map(lambda s: sharding.batch_sharding(mesh, rules, shape=s.shape), batch)
    batch = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), batch, b_sh)
    lb = cfg.router_aux_loss_coef if ccfg.lb_coef is None else ccfg.lb_coef
    fn = functools.partial(step, graphdef, tx, loss_chunk=ccfg.loss_chunk, lb_coef=lb)
    jitted = jax.jit(fn, in_shardings=(p_sh, o_sh, b_sh), out_shardings=(p_sh, o_sh, None), donate_argnums=(0, 1))
    return compile_plan(jitted, (params, opt, batch), mesh=mesh, rules=rules, remat_policy=ccfg.remat,
                        state_args=(params, opt), model=model_name, params=param_count(cfg), topology=topo,
                        micro_batch=b, seq_len=ccfg.seq_len, model_flops=6.0 * active_params(cfg) * b * ccfg.seq_len,
                        tokens_per_step=b * ccfg.seq_len,
                        kernel_cost=kernel_costs.step_kernel_cost(cfg, mesh.shape["expert"], block_size=1))


def _per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs."""
    total = 0
    for s in jax.tree.leaves(tree):
        total += math.prod(s.sharding.shard_shape(s.shape)) * jnp.dtype(s.dtype).itemsize
    return total


def _oom_temporaries(message: str) -> int | None:
    """Temporaries (bytes) from the TPU compiler's "Ran out of memory in memory space hbm ...
    HLO temporaries (390.68G) exceeds ..." error, or None for any other error."""
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    m = re.search(r"temporaries \(([\d.]+)([KMGT])\)", message)
    if m is None:
        return None
    return int(float(m.group(1)) * 1024 ** "KMGT".index(m.group(2)) * 1024)


def check(p: MemoryPlan) -> MemoryPlan:
    """`p` if it fits; else PlanError with the table and what to change."""
    if p.fits:
        return p
    tips = "\n".join(f"  - {s}" for s in p.suggestions())
    raise PlanError(f"{p.table()}\nThe step needs {p.total_bytes / GiB:.1f} GiB per chip but a "
                    f"{p.topology.family} chip has {p.topology.hbm_bytes / GiB:.0f} GiB. Try:\n{tips}")


def describe(plans: list[MemoryPlan]) -> str:
    """Several plans side by side (one row each), for comparing topologies / lengths / policies."""
    head = f"{'topology':<10}{'mesh':<26}{'seq':>7}{'batch':>6}{'remat':>8}{'args GiB':>10}{'temp GiB':>10}" \
           f"{'total GiB':>10}{'of HBM':>8}{'TFLOP/chip':>11}{'step ms*':>9}{'MFU*':>6}  {'bound*':<14}{'compile s':>9}"
    rows = [head]
    for p in plans:
        mesh = ",".join(f"{k[0]}{v}" for k, v in p.mesh_shape.items() if v > 1) or "1"
        rows.append(f"{p.topology.name:<10}{mesh:<26}{p.seq_len:>7}{p.micro_batch:>6}{p.remat[:7]:>8}"
                    f"{p.argument_bytes / GiB:>10.2f}{p.temp_bytes / GiB:>10.2f}{p.total_bytes / GiB:>10.2f}"
                    f"{100 * p.total_bytes / p.topology.hbm_bytes:>7.0f}%{p.flops_per_chip / 1e12:>11.1f}"
                    + (f"{1e3 * r.step_s:>9.0f}{100 * r.mfu:>5.0f}%  {r.bound:<14}" if (r := p.roofline()) else
                       f"{'-':>9}{'-':>6}  {'-':<14}") + f"{p.compile_seconds:>9.0f}")
    rows.append("* roofline prediction from the compiled program (not a measurement)")
    return "\n".join(rows)


__all__ = ["CompileConfig", "MemoryPlan", "PlanError", "Topology", "active_params", "ar_batch_shapes",
           "ar_train_step", "check", "chunked_ce", "compile_plan", "describe", "parse_topology", "plan",
           "topology_devices", "topology_mesh", "tpu_kernels"]
