"""Part a of bench/gpu_check.py: the SFT train step of one Clover-35B-A3B layer group at the real
widths, kernels (Pallas GDN + flash attention on GPU, splash on TPU) vs the reference (XLA) path, and
the roofline's prediction beside the measured time. Also what parts a and b share: the model
(`base_config`) and the recipe's configs at the check's widths (`recipe_configs`).

`SftCheck` builds the setup once (configs, both backends' `sft.recipe.SFTSetup`, the one-device mesh,
the batch); each of its stages builds the device state it needs and drops it on return, since the next
stage may be another part's and need the memory:
- ``kernels_step`` / ``reference_step``: the train step (fwd + bwd + AdamW, state donated), best time of
  ``--repeats`` after a warm-up, tokens/s, MFU (`sft.step_flops` model FLOPs over the chip's bf16 peak),
  and `train.roofline`'s PREDICTION for the same compiled program on this chip: FLOPs and HBM bytes from
  `train.hlo_cost` over the optimized HLO (as ``launch.py compile``), and, since that walk does not
  count the FLOPs of GPU library / Triton custom calls, a second one with the analytic executed FLOPs
  and the walked bytes. A step that runs out of device memory runs again at half the length;
- ``agreement``: the recipe's loss and its gradient w.r.t. every parameter (``value_and_grad``, one
  noise key), both paths: relative errors per leaf (max-abs and L2) and of the global norm.
"""

from __future__ import annotations

import argparse
import pathlib
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.config import ModelConfig, get_preset
from common import best_time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "agent_mix.yaml"
GiB = 1024**3
Save = Callable[[], None]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def base_config(smoke: bool) -> ModelConfig:
    """The model the parts run before the recipe's overrides: the 35B preset's widths, or (smoke) the
    tiny preset's (hidden 64, 8 experts top 2, vocab 256, a group of 1 GDN + 1 full-attention layer)
    with the real GDN chunk (64: block 32 starts inside chunks, as in the real one)."""
    if smoke:
        return get_preset("tiny").replace(gdn_chunk_size=64, mask_token_id=255)
    return get_preset("clover-35b-a3b")


def recipe_configs(args: argparse.Namespace, param_dtype: str) -> tuple[Any, ModelConfig]:
    """(SFTConfig of configs/agent_mix.yaml with this check's overrides, its ModelConfig at --layers).
    --smoke: fp32, and the MoE path a GPU takes (`blocked`) instead of CPU's, so the smoke runs the
    step the device will."""
    from sft.config import load_sft_config, model_config_from

    over = [f"model.num_hidden_layers={args.layers}", f"model.block_size={args.block}", "train.micro_batches=1",
            f"train.param_dtype={param_dtype}"] + (["model.dtype=float32", "model.moe_impl=blocked"] if args.smoke else [])
    cfg = load_sft_config(RECIPE, over)
    return cfg, model_config_from(cfg.model, base_config(args.smoke)).replace(param_dtype=param_dtype)


def chip_of(device_kind: str) -> str | None:
    """The `train.roofline.CHIPS` key of a device kind, None when the table has no such chip."""
    from train.roofline import CHIPS

    k = device_kind.lower()
    for key, names in (("h200", ("h200",)), ("h100", ("h100",)), ("v5p", ("v5p",)), ("v5e", ("v5 lite", "v5e")),
                       ("v6e", ("v6 lite", "v6e"))):
        if key in CHIPS and any(n in k for n in names):
            return key
    return None


def sft_batch(b: int, t: int, block: int, vocab: int, mask_id: int, seed: int) -> dict[str, np.ndarray]:
    """Rows of 3 packed documents on the block grid (t/2, t/4, t/4 - block tokens) and a block of pads;
    positions restart per document; the last 60% of each document is the response (loss tokens)."""
    rng = np.random.default_rng(seed)
    lens = [t // 2 // block * block, t // 4 // block * block]
    lens += [t - sum(lens) - block, block]
    seg = np.repeat(np.array([1, 2, 3, 0], np.int32), lens)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    doc_len = np.repeat(np.array(lens), lens)
    ids = rng.integers(2, vocab - 1, (b, t)).astype(np.int32)
    ids[ids == mask_id] = 2
    return {"input_ids": ids, "segment_ids": np.tile(seg, (b, 1)), "positions": np.tile(pos, (b, 1)),
            "loss_mask": np.tile((seg > 0) & (pos >= 0.4 * doc_len), (b, 1))}


def grad_agreement(gk: Any, gr: Any) -> dict:
    """Kernel vs reference gradients: per leaf max|a-b| / max|b| and ||a-b|| / ||b||, and the global norms."""
    @jax.jit
    def stats(a, b):
        f = lambda x: x.astype(jnp.float32)  # noqa: E731
        return jax.tree.map(lambda x, y: jnp.stack([jnp.max(jnp.abs(f(x) - f(y))), jnp.max(jnp.abs(f(y))),
                                                    jnp.sum((f(x) - f(y)) ** 2), jnp.sum(f(y) ** 2),
                                                    jnp.sum(f(x) ** 2)]), a, b)

    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(stats(gk, gr)))[0]
    leaves = {jax.tree_util.keystr(p, simple=True, separator="."): s for p, s in flat}
    tot = np.sum([s for s in leaves.values()], axis=0, dtype=np.float64)
    per = {n: {"rel_max": float(s[0] / max(s[1], 1e-30)), "rel_l2": float(np.sqrt(s[2] / max(s[3], 1e-30)))}
           for n, s in leaves.items()}
    worst_max = max(per, key=lambda n: per[n]["rel_max"])
    worst_l2 = max(per, key=lambda n: per[n]["rel_l2"])
    return {"grad_norm": {"kernels": float(np.sqrt(tot[4])), "reference": float(np.sqrt(tot[3])),
                          "rel": rel(float(np.sqrt(tot[4])), float(np.sqrt(tot[3])))},
            "grad_rel_l2_global": float(np.sqrt(tot[2] / max(tot[3], 1e-30))),
            "worst_leaf_rel_max": {"leaf": worst_max, **per[worst_max]},
            "worst_leaf_rel_l2": {"leaf": worst_l2, **per[worst_l2]}, "leaves": per}


def step_cost(compiled: Any, mcfg: ModelConfig, block: int) -> dict:
    """FLOPs and HBM bytes of one run of the compiled step: `train.hlo_cost`'s walk (as `launch.py
    compile`), XLA's cost analysis, and the memory analysis."""
    from clover_jax.model.kernel_costs import step_kernel_cost
    from train import hlo_cost

    walked = hlo_cost.analyze(compiled.as_text(), step_kernel_cost(mcfg, 1, block))
    ca = compiled.cost_analysis()
    ca = (ca[0] if ca else {}) if isinstance(ca, (list, tuple)) else (ca or {})
    mem = compiled.memory_analysis()
    return {"hlo_flops": walked.flops, "hlo_hbm_bytes": walked.hbm_bytes,
            "hlo_ici_bytes": sum(walked.ici_bytes.values()),
            "hlo_uncosted_kernels": dict(walked.uncosted), "hlo_unknown_trip_whiles": len(walked.unknown_trips),
            "xla_flops": ca.get("flops"), "xla_bytes_accessed": ca.get("bytes accessed"),
            "temp_GiB": None if mem is None else mem.temp_size_in_bytes / GiB,
            "argument_GiB": None if mem is None else mem.argument_size_in_bytes / GiB}


def predictions(chip: str | None, step_s: float, cost: dict | None, flops: Any, tokens: int, device_kind: str) -> dict:
    """MFU and the roofline predictions of `train.roofline` (`chip`: a CHIPS key or None) beside the
    measured step time."""
    from sft.recipe import KNOWN_PEAKS
    from train.roofline import CHIPS, roofline

    out: dict = {"tokens_per_s": tokens / step_s, "model_flops": flops.model, "analytic_executed_flops": flops.executed}
    peak = CHIPS[chip].peak_flops if chip else next(
        (p for k, p in KNOWN_PEAKS.items() if device_kind.startswith(k)), None)
    out["peak_flops"], out["mfu"] = peak, (flops.model / step_s / peak if peak else None)
    if chip is None or cost is None:
        out["roofline"] = {"unavailable": "the HLO walk failed (cost_error)" if cost is None
                           else f"train/roofline.py has no chip figures for {device_kind!r}"}
        return out
    for name, f in (("roofline", cost["hlo_flops"]), ("roofline_analytic_flops", flops.executed)):
        r = roofline(chip, flops=f, hbm_bytes=cost["hlo_hbm_bytes"], ici_bytes=cost["hlo_ici_bytes"],
                     tokens_per_step=tokens, chips=1, model_flops=flops.model)
        out[name] = {**r.as_dict(), "flops": f, "measured_over_predicted": step_s / r.step_s if r.step_s else None}
    return out


def roofline_text(row: dict) -> str:
    r = row.get("roofline", {})
    if "unavailable" in r:
        return "roofline unavailable (" + r["unavailable"] + ")"
    a = row["roofline_analytic_flops"]
    return (f"roofline (HLO walk) {r['step_s'] * 1e3:.1f} ms {r['bound']}, measured/predicted "
            f"{r['measured_over_predicted']:.2f}; with analytic FLOPs {a['step_s'] * 1e3:.1f} ms, measured/predicted "
            f"{a['measured_over_predicted']:.2f}")


def agreement_text(ag: dict) -> str:
    return (f"loss rel {ag['loss']['rel']:.1e}, grad norm rel {ag['grad_norm']['rel']:.1e}, grad L2 rel "
            f"{ag['grad_rel_l2_global']:.1e} (worst leaf {ag['worst_leaf_rel_l2']['rel_l2']:.1e})")


def summary_sft(res: dict) -> str:
    ag, st = res.get("agreement", {}), res.get("step", {})
    parts = [agreement_text(ag)] if ag else []
    k, r = st.get("kernels", {}), st.get("reference", {})
    if "step_s" in k:
        x = f" (xla {r['step_s'] * 1e3:.1f} ms, {r['step_s'] / k['step_s']:.2f}x)" if "step_s" in r else ""
        mfu = f", MFU {100 * k['mfu']:.1f}%" if k.get("mfu") else ""
        rl, an = k.get("roofline", {}), k.get("roofline_analytic_flops", {})
        pred = (f"; predicted {rl['step_s'] * 1e3:.1f} ms (x{rl['measured_over_predicted']:.2f}) / analytic "
                f"{an['step_s'] * 1e3:.1f} ms (x{an['measured_over_predicted']:.2f})" if "step_s" in rl
                else "; no roofline prediction")
        parts.append(f"step {k['step_s'] * 1e3:.1f} ms{x}, {k['tokens_per_s']:,.0f} tok/s{mfu}{pred}")
    return "; ".join(parts)


class SftCheck:
    """Part a (module docstring). Master weights: ``--param-dtype auto`` = fp32 (the recipe's) where the
    device has >= 100 GiB, else bf16 (fp32 masters + Adam state of the 4.35B parameters do not fit an
    H100's 80 GB)."""

    def __init__(self, args: argparse.Namespace, res: dict, save: Save):
        from clover_jax.model.clover_model import abstract_model
        from clover_jax.parallel import sharding as sh
        from sft.recipe import SFTSetup, sharded_abstract_state
        from train.optimizer import build_optimizer

        self.args, self.res, self.save = args, res, save
        self.dev = dev = jax.devices()[0]
        pdt = args.param_dtype
        if pdt == "auto":
            limit = (dev.memory_stats() or {}).get("bytes_limit", 0) if dev.platform == "gpu" else 0
            pdt = "float32" if args.smoke or dev.platform == "tpu" or limit >= 100 * GiB else "bfloat16"
        self.pdt = pdt
        self.cfg, self.mcfg = cfg, mcfg = recipe_configs(args, pdt)
        attn = "splash" if dev.platform == "tpu" else "flash"
        backends = {"kernels": {"gdn_backend": "pallas", "attn_backend": attn},
                    "reference": {"gdn_backend": "reference", "attn_backend": "reference"}}
        self.mesh = sh.make_mesh(cfg.mesh, [dev])
        self.optimizer = build_optimizer(cfg.optimizer, cfg.train.steps)
        p_sh, self.state_sh, abstract_state = sharded_abstract_state(abstract_model(mcfg), self.optimizer, self.mesh,
                                                                     cfg.train)
        self.setups = {}
        for name, kw in backends.items():
            m = mcfg.replace(**kw)
            self.setups[name] = SFTSetup(
                cfg=cfg, model_cfg=m, kind="random", init_path=None, tok_dir=None, data=None, mesh=self.mesh,
                graphdef=nnx.split(abstract_model(m))[0], optimizer=self.optimizer, param_shardings=p_sh,
                state_shardings=self.state_sh, abstract_state=abstract_state)
        self.opts = {"xla_backend_optimization_level": 0} if args.smoke else None
        self.batches: dict[int, dict] = {}
        res.update(param_dtype=pdt, compute_dtype=mcfg.dtype, remat=mcfg.remat, batch=args.batch, seq=args.seq,
                   block=args.block, backends=backends, noise_copies=cfg.noise.copies,
                   chip=args.chip or chip_of(dev.device_kind))
        res.setdefault("step", {})
        res.setdefault("failed", {})

    def batch(self, t: int) -> dict:
        """The device batch of rows of length t (kept: a few int arrays)."""
        from clover_jax.parallel import sharding as sh

        if t not in self.batches:
            host = sft_batch(self.args.batch, t, self.args.block, self.mcfg.vocab_size, int(self.mcfg.mask_token_id),
                             self.args.seed)
            self.res.setdefault("loss_tokens", {})[str(t)] = int(host["loss_mask"].sum())
            self.batches[t] = {k: jax.device_put(v, sh.batch_sharding(self.mesh, shape=v.shape)) for k, v in host.items()}
        return self.batches[t]

    def fresh_params(self) -> Any:
        from clover_jax.model.clover_model import create_model, model_to_params

        t0 = time.perf_counter()
        p = model_to_params(create_model(self.mcfg, self.args.seed))
        self.res["init_s"] = time.perf_counter() - t0
        return p

    def expected_s(self, stage: str) -> float:
        """Seconds a stage should take, from this run's compile of the kernels' step (0 before it): the
        agreement compiles two programs of about its size, the reference step one."""
        c = self.res["step"].get("kernels", {}).get("compile_s")
        return 0.0 if c is None else {"agreement": 2 * c, "reference_step": c}.get(stage, 0.0)

    # ------------------------------------------------------------------------------------ stages
    def agreement(self, deadline: float) -> str:
        """Loss and gradients, kernels vs reference, from the same params, batch and noise key."""
        from clover_jax.parallel import sharding as sh
        from train.step import cast_for_compute

        bk, batch = self.args.block, self.batch(self.args.seq)
        params, key, outs = self.fresh_params(), jax.random.key(self.args.seed + 1), {}
        compile_s = self.res.setdefault("compile_s", {})
        for name, setup in self.setups.items():
            loss_fn, cdt = setup.loss_fn(bk), setup.compute_dtype
            fn = jax.value_and_grad(lambda p, b, k, loss_fn=loss_fn, cdt=cdt: loss_fn(cast_for_compute(p, cdt), b, k),
                                    has_aux=True)
            t0 = time.perf_counter()
            with sh.use_sharding(self.mesh):
                prog = jax.jit(fn).lower(params, batch, key).compile(self.opts)
            compile_s[f"{name}_grad"] = time.perf_counter() - t0
            (loss, metrics), grads = prog(params, batch, key)
            print(f"  {name}: loss {float(loss):.6f} (compiled in {compile_s[f'{name}_grad']:.1f} s)", flush=True)
            outs[name] = float(loss), {k: float(metrics[k]) for k in ("ce", "acc", "num_masked", "lb_loss")}, grads
        (lk, mk, gk), (lr, mr, gr) = outs.pop("kernels"), outs.pop("reference")
        self.res["agreement"] = ag = {"loss": {"kernels": lk, "reference": lr, "rel": rel(lk, lr)},
                                      "metrics": {"kernels": mk, "reference": mr}, **grad_agreement(gk, gr)}
        return agreement_text(ag)

    def kernels_step(self, deadline: float) -> str:
        return self.step("kernels", deadline)

    def reference_step(self, deadline: float) -> str:
        if self.args.smoke:  # CPU compile time: the same code as the kernels' step
            self.res["step"]["reference"] = {"skipped": "--smoke compiles the kernels' step only"}
            return "skipped (--smoke)"
        return self.step("reference", deadline)

    def step(self, name: str, deadline: float) -> str:
        """The train step at --seq; one that runs out of device memory runs again at half the length (an
        H100 holds the bf16 state and the step at 4096 tokens only just, if at all)."""
        T, bk, failed = self.args.seq, self.args.block, self.res["failed"]
        for t in (T, T // 2):
            try:
                row = self.step_row(name, t)
                return (f"seq {t}: {row['step_s'] * 1e3:.1f} ms, {row['tokens_per_s']:,.0f} tok/s"
                        + (f", MFU {100 * row['mfu']:.1f}%" if row["mfu"] else "") + f"; {roofline_text(row)}")
            except Exception:  # noqa: BLE001 - recorded; re-raised unless a shorter step may fit
                failed[f"{name}_step_seq{t}"] = tb = traceback.format_exc()[-6000:]
                print(f"  {name} step (seq {t}) FAILED\n{tb}", flush=True)
                self.save()
                if t != T or "RESOURCE_EXHAUSTED" not in tb or (T // 2) % bk or time.perf_counter() >= deadline:
                    raise
        raise AssertionError("unreachable")

    def step_row(self, name: str, t: int) -> dict:
        from clover_jax.parallel import sharding as sh
        from clover_jax.parallel.remat import resolve as resolve_remat
        from sft.step_flops import sft_step_flops
        from train.state import init_train_state

        a, setup, bt = self.args, self.setups[name], self.batch(t)
        flops = sft_step_flops(self.mcfg, rows=a.batch, seq_len=t, block_size=a.block, copies=self.cfg.noise.copies,
                               remat=resolve_remat(self.mcfg.remat), flash_backward=name == "kernels")
        holder = {"state": init_train_state(self.fresh_params(), self.optimizer, seed=self.cfg.train.seed,
                                            master_dtype=self.pdt, out_shardings=self.state_sh)}
        t0 = time.perf_counter()
        with sh.use_sharding(self.mesh):
            prog = setup.make_step(a.block).lower(holder["state"], bt).compile(self.opts)
        row: dict = {"seq": t, "compile_s": time.perf_counter() - t0}

        def run():
            holder["state"], m = prog(holder["state"], bt)
            return holder["state"], m

        row["step_s"] = best_time(run, a.repeats)
        row["metrics"] = {k: float(v) for k, v in run()[1].items() if k in ("loss", "grad_norm", "lr")}
        if self.dev.platform == "gpu":
            row["peak_GiB"] = (self.dev.memory_stats() or {}).get("peak_bytes_in_use", 0) / GiB
        self.res["step"][name] = row
        self.save()
        try:  # the HLO walk reads XLA's text: a parse failure must not lose the time
            row["cost"] = step_cost(prog, setup.model_cfg, a.block)
        except Exception:  # noqa: BLE001
            row["cost"], row["cost_error"] = None, traceback.format_exc()[-3000:]
        row.update(predictions(self.res["chip"], row["step_s"], row["cost"], flops, a.batch * t, self.dev.device_kind))
        print(f"  {name} step (seq {t}): {row['step_s'] * 1e3:.1f} ms, {row['tokens_per_s']:,.0f} tokens/s"
              + (f", MFU {100 * row['mfu']:.1f}%" if row["mfu"] else "") + f"; {roofline_text(row)}", flush=True)
        return row
