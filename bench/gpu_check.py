"""The whole job checked on a GPU in one call: the SFT train step at the real widths (kernels vs the
XLA reference), decoding at the same widths, and the GDN / flash-attention kernel rows.

On a lent GPU (its image has jax with the CUDA plugin; nothing else of ours is needed), as one call with
the device tool's timeout_s 600 (no part or row starts after --budget-s; the one running then finishes,
so leave a minute or two); prefer kind nvidia-h200: its 141 GB hold the recipe's fp32 master weights,
an H100 runs the step with bf16 ones (see part a):
    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --budget-s 480 2>&1 | tee $OUT/gpu_check.log
Any host (CPU: the Pallas kernels interpreted), to check the script: the tiny preset's widths (1 GDN + 1
full-attention layer), seq and context 128, fp32, remat none, the reference step not compiled, the GDN
rows of the causal op only, the roofline as if on an H100 (about 1.5 min on 2 busy CPU cores):
    python bench/gpu_check.py --smoke --out /tmp/gpu_check_smoke.json

Parts (``--parts a,b,c``, in that order):

a. ``sft_step``: one layer group of Clover-35B-A3B (the ``clover-35b-a3b`` preset's widths: hidden 2048,
   3 GDN + 1 full-attention layer, 256 experts top 8, vocab 248320) in block mode, ``--batch`` rows of
   ``--seq`` 4096 tokens (3 packed documents), block 32, with the SFT recipe's settings
   (configs/agent_mix.yaml: bf16 compute, remat full, noise, loss, AdamW), built as ``launch.py compile``
   builds the recipe's step (`sft.recipe.SFTSetup`: its `loss_fn` and `make_step`), under a one-device
   mesh. Kernels (Pallas GDN + flash attention on GPU, splash on TPU) vs the reference (XLA) path:
   - agreement: the loss and its gradient w.r.t. every parameter (``value_and_grad`` of the recipe's
     loss, the same noise key), relative errors per leaf (max-abs and L2) and of the global norm;
   - the train step (fwd + bwd + AdamW, state donated): best time of ``--repeats`` after a warm-up,
     tokens/s, MFU (`sft.step_flops` model FLOPs over the chip's bf16 peak), and the roofline
     PREDICTION of `train.roofline` for the same compiled program on this chip: FLOPs and HBM bytes
     from `train.hlo_cost` over the optimized HLO (as ``launch.py compile``), and, since that walk
     does not count the FLOPs of GPU library / Triton custom calls, a second one with the analytic
     executed FLOPs (`sft.step_flops`) and the walked bytes; measured / predicted beside each.
   Master weights: ``--param-dtype auto`` = fp32 (the recipe's) where the device has >= 100 GiB,
   else bf16 (fp32 masters + Adam state of the 4.35B parameters do not fit an H100's 80 GB); a step
   that runs out of device memory is recorded and runs again at half the length. Each backend's
   gradients and step are tried apart: one that fails is recorded (``failed``) and the rest still runs.
b. ``decode``: the same widths, bf16 weights: a context of ``--context`` 4096 tokens prefilled by
   commit passes, then at batch 1 and 8 one block step (a 32-token canvas, half masked) with the MoE block
   coreset off and at C = ``--coreset`` 32, one AR step (`extend` of 1 token) and one commit pass
   (`extend` of the block's 32 tokens), the model methods `clover_jax.decoding.loops` calls; the cache
   is donated and chained as the decode loop carries it. Milliseconds each (the AR step and the commit
   pass route freely: the coreset applies to block steps only).
c. ``kernels``: bench/gdn_device.py (``--check-dtype bfloat16 --fp32-fit`` off --smoke: its fp32 Triton
   programs exceeded the GPU's shared memory; the fit compiles them once more to see whether the parallel
   backward's value tiles brought them under it) and bench/attention_gpu.py, called in-process with what is left of
   the budget; their JSONs land beside ``--out`` (<stem>_gdn_device.json, <stem>_attention_gpu.json).

The JSON (``--out``, default ``$OUT/gpu_check.json`` when ``$OUT`` is set, else
bench/results/gpu_check.json) is written after every part and every row inside one; a part that raises
is recorded with its traceback and the next one runs; a part that would start after ``--budget-s`` is
recorded as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

if __name__ == "__main__":
    if "--smoke" in sys.argv[1:]:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # GPU: the 35B-width step needs the room

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from clover_jax.config import ModelConfig, get_preset  # noqa: E402
from common import best_time  # noqa: E402

RECIPE = ROOT / "configs" / "agent_mix.yaml"
GiB = 1024**3
Save = Callable[[], None]


def bench_module(name: str) -> Any:
    """bench/<name>.py as a module (the scripts import `common` from bench/)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


# ------------------------------------------------------------------------------------------- setup
def base_config(smoke: bool) -> ModelConfig:
    """The model the parts run before the recipe's overrides: the 35B preset's widths, or (smoke) the
    tiny preset's (hidden 64, 8 experts top 2, vocab 256, a group of 1 GDN + 1 full-attention layer)
    with the real GDN chunk (64: block 32 starts inside chunks, as in the real one)."""
    if smoke:
        return get_preset("tiny").replace(gdn_chunk_size=64, mask_token_id=255)
    return get_preset("clover-35b-a3b")


def recipe_configs(args: argparse.Namespace, param_dtype: str) -> tuple[Any, ModelConfig]:
    """(SFTConfig of configs/agent_mix.yaml with this check's overrides, its ModelConfig at --layers)."""
    from sft.config import load_sft_config, model_config_from

    over = [f"model.num_hidden_layers={args.layers}", f"model.block_size={args.block}", "train.micro_batches=1",
            f"train.param_dtype={param_dtype}"] + (["model.dtype=float32", "model.remat=none"] if args.smoke else [])
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


# -------------------------------------------------------------------------------------- part a: SFT
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


def part_sft_step(args: argparse.Namespace, res: dict, save: Save, deadline: float) -> str:
    from clover_jax.model.clover_model import abstract_model, create_model, model_to_params
    from clover_jax.parallel import sharding as sh
    from clover_jax.parallel.remat import resolve as resolve_remat
    from sft.recipe import SFTSetup, sharded_abstract_state
    from sft.step_flops import sft_step_flops
    from train.optimizer import build_optimizer
    from train.state import init_train_state
    from train.step import cast_for_compute

    dev = jax.devices()[0]
    pdt = args.param_dtype
    if pdt == "auto":
        limit = (dev.memory_stats() or {}).get("bytes_limit", 0) if dev.platform == "gpu" else 0
        pdt = "float32" if args.smoke or dev.platform == "tpu" or limit >= 100 * GiB else "bfloat16"
    cfg, mcfg = recipe_configs(args, pdt)
    bk, B, T = args.block, args.batch, args.seq
    attn = "splash" if dev.platform == "tpu" else "flash"
    backends = {"kernels": {"gdn_backend": "pallas", "attn_backend": attn},
                "reference": {"gdn_backend": "reference", "attn_backend": "reference"}}
    mesh = sh.make_mesh(cfg.mesh, [dev])
    optimizer = build_optimizer(cfg.optimizer, cfg.train.steps)
    p_sh, state_sh, abstract_state = sharded_abstract_state(abstract_model(mcfg), optimizer, mesh, cfg.train)
    setups = {}
    for name, kw in backends.items():
        m = mcfg.replace(**kw)
        setups[name] = SFTSetup(cfg=cfg, model_cfg=m, kind="random", init_path=None, tok_dir=None, data=None,
                                mesh=mesh, graphdef=nnx.split(abstract_model(m))[0], optimizer=optimizer,
                                param_shardings=p_sh, state_shardings=state_sh, abstract_state=abstract_state)
    res.update(param_dtype=pdt, compute_dtype=mcfg.dtype, remat=mcfg.remat, batch=B, seq=T, block=bk,
               backends=backends, noise_copies=cfg.noise.copies)
    host = sft_batch(B, T, bk, mcfg.vocab_size, int(mcfg.mask_token_id), args.seed)
    batch = {k: jax.device_put(v, sh.batch_sharding(mesh, shape=v.shape)) for k, v in host.items()}
    res["loss_tokens"] = int(host["loss_mask"].sum())
    opts = {"xla_backend_optimization_level": 0} if args.smoke else None
    failed: dict[str, str] = {}
    res["failed"] = failed

    def attempt(label: str, fn: Callable[[], Any]) -> Any:
        """fn(), or None with its traceback in `failed`: one backend's failure leaves the other's rows."""
        try:
            return fn()
        except Exception:  # noqa: BLE001
            failed[label] = traceback.format_exc()[-6000:]
            print(f"  {label} FAILED\n{failed[label]}", flush=True)
            save()
            return None

    def fresh_params() -> Any:
        t0 = time.perf_counter()
        p = model_to_params(create_model(mcfg, args.seed))
        res["init_s"] = time.perf_counter() - t0
        return p

    # agreement: the recipe's loss and its gradient w.r.t. every param, one noise key, both paths
    params, key, outs, res["compile_s"] = fresh_params(), jax.random.key(args.seed + 1), {}, {}

    def grads_of(name: str, setup: Any) -> tuple:
        loss_fn, cdt = setup.loss_fn(bk), setup.compute_dtype
        fn = jax.value_and_grad(lambda p, b, k: loss_fn(cast_for_compute(p, cdt), b, k), has_aux=True)
        t0 = time.perf_counter()
        with sh.use_sharding(mesh):
            prog = jax.jit(fn).lower(params, batch, key).compile(opts)
        res["compile_s"][f"{name}_grad"] = time.perf_counter() - t0
        (loss, metrics), grads = prog(params, batch, key)
        print(f"  {name}: loss {float(loss):.6f} (compiled in {res['compile_s'][f'{name}_grad']:.1f} s)", flush=True)
        return float(loss), {k: float(metrics[k]) for k in ("ce", "acc", "num_masked", "lb_loss")}, grads

    for name, setup in setups.items():
        outs[name] = attempt(f"{name}_grad", lambda name=name, setup=setup: grads_of(name, setup))
    if outs["kernels"] and outs["reference"]:
        (lk, mk, gk), (lr, mr, gr) = outs["kernels"], outs["reference"]
        res["agreement"] = {"loss": {"kernels": lk, "reference": lr, "rel": rel(lk, lr)},
                            "metrics": {"kernels": mk, "reference": mr}, **grad_agreement(gk, gr)}
        del gk, gr
    del outs
    pool = {"params": params}  # the first train state takes (donates) their buffers
    del params
    save()

    # the train step (fwd + bwd + AdamW), kernels first; one that runs out of device memory runs again
    # at half the length (an H100 holds the bf16 state and the step at 4096 tokens only just, if at all)
    chip = args.chip or chip_of(dev.device_kind)
    res.update(chip=chip, step={})
    holder, batches = {"state": None}, {T: batch}

    def step_row(name: str, setup: Any, t: int) -> dict:
        if t not in batches:
            batches[t] = {k: jax.device_put(v, sh.batch_sharding(mesh, shape=v.shape))
                          for k, v in sft_batch(B, t, bk, mcfg.vocab_size, int(mcfg.mask_token_id), args.seed).items()}
        bt = batches[t]
        flops = sft_step_flops(mcfg, rows=B, seq_len=t, block_size=bk, copies=cfg.noise.copies,
                               remat=resolve_remat(mcfg.remat), flash_backward=name == "kernels")
        if holder["state"] is None or any(x.is_deleted() for x in jax.tree.leaves(holder["state"])):
            holder["state"] = None  # a failed step left it donated: a fresh one
            holder["state"] = init_train_state(pool.pop("params", None) or fresh_params(), optimizer,
                                               seed=cfg.train.seed, master_dtype=pdt, out_shardings=state_sh)
        t0 = time.perf_counter()
        with sh.use_sharding(mesh):
            prog = setup.make_step(bk).lower(holder["state"], bt).compile(opts)
        row: dict = {"seq": t, "compile_s": time.perf_counter() - t0}

        def run():
            holder["state"], m = prog(holder["state"], bt)
            return holder["state"], m

        row["step_s"] = best_time(run, args.repeats)
        row["metrics"] = {k: float(v) for k, v in run()[1].items() if k in ("loss", "grad_norm", "lr")}
        if dev.platform == "gpu":
            row["peak_GiB"] = (dev.memory_stats() or {}).get("peak_bytes_in_use", 0) / GiB
        res["step"][name] = row
        save()
        try:  # the HLO walk reads XLA's text: a parse failure must not lose the time
            row["cost"] = step_cost(prog, setup.model_cfg, bk)
        except Exception:  # noqa: BLE001
            row["cost"], row["cost_error"] = None, traceback.format_exc()[-3000:]
        row.update(predictions(chip, row["step_s"], row["cost"], flops, B * t, dev.device_kind))
        print(f"  {name} step (seq {t}): {row['step_s'] * 1e3:.1f} ms, {row['tokens_per_s']:,.0f} tokens/s"
              + (f", MFU {100 * row['mfu']:.1f}%" if row["mfu"] else "") + f"; {roofline_text(row)}", flush=True)
        return row

    for name, setup in setups.items():
        if args.smoke and name == "reference":  # CPU compile time: the same code as the kernels' step
            res["step"][name] = {"skipped": "--smoke compiles the kernels' step only"}
        elif time.perf_counter() >= deadline:
            res["step"][name] = {"skipped": "budget spent"}
        else:
            for t in (T, T // 2):
                if attempt(f"{name}_step_seq{t}", lambda name=name, setup=setup, t=t: step_row(name, setup, t)) \
                        or "RESOURCE_EXHAUSTED" not in failed[f"{name}_step_seq{t}"] or (T // 2) % bk \
                        or time.perf_counter() >= deadline:
                    break
        save()
    if failed:
        raise RuntimeError(f"failed: {', '.join(failed)} (tracebacks in the result's 'failed'; the rest was run)")
    return summary_sft(res)


def roofline_text(row: dict) -> str:
    r = row.get("roofline", {})
    if "unavailable" in r:
        return "roofline unavailable (" + r["unavailable"] + ")"
    a = row["roofline_analytic_flops"]
    return (f"roofline (HLO walk) {r['step_s'] * 1e3:.1f} ms {r['bound']}, measured/predicted "
            f"{r['measured_over_predicted']:.2f}; with analytic FLOPs {a['step_s'] * 1e3:.1f} ms, measured/predicted "
            f"{a['measured_over_predicted']:.2f}")


def summary_sft(res: dict) -> str:
    ag, st = res.get("agreement", {}), res.get("step", {})
    parts = []
    if ag:
        parts.append(f"loss rel {ag['loss']['rel']:.1e}, grad norm rel {ag['grad_norm']['rel']:.1e}, grad L2 rel "
                     f"{ag['grad_rel_l2_global']:.1e} (worst leaf {ag['worst_leaf_rel_l2']['rel_l2']:.1e})")
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


# ----------------------------------------------------------------------------------- part b: decode
def part_decode(args: argparse.Namespace, res: dict, save: Save, deadline: float) -> str:
    """Per decode batch: the context prefilled by commit passes (the `extend` program of one block), then
    the block step free and with the coreset (they read the cache), the AR step and the commit pass
    (they advance it: the cache is donated and chained, as the decode loop carries it)."""
    from clover_jax.model.clover_model import abstract_model, create_model

    dtype = "float32" if args.smoke else "bfloat16"
    _, mcfg = recipe_configs(args, dtype)
    mcfg = mcfg.replace(dtype=dtype, remat="none")
    bk, ctx, c = args.block, args.context, args.coreset
    t0 = time.perf_counter()
    model = create_model(mcfg, args.seed)
    graphdef, params = nnx.split(model)
    res.update(init_s=time.perf_counter() - t0, dtype=dtype, context=ctx, block=bk, coreset=c, rows={},
               note="AR step and commit pass route freely (the block coreset applies to block steps only)")
    core_def = nnx.split(abstract_model(mcfg.replace(moe_block_coreset=c)))[0]
    extend = jax.jit(lambda p, ids, cache: nnx.merge(graphdef, p).extend(ids, cache), donate_argnums=2)
    blocks = {op: jax.jit(lambda p, ids, cache, gd=gd: nnx.merge(gd, p).block_step(ids, cache))
              for op, gd in (("block_free", graphdef), (f"block_c{c}", core_def))}
    rng = np.random.default_rng(args.seed)
    mask = int(mcfg.mask_token_id)
    opts = {"xla_backend_optimization_level": 0} if args.smoke else None

    def compiled(fn: Any, x: np.ndarray, cache: Any, row: dict, op: str) -> Any:
        t0 = time.perf_counter()
        prog = fn.lower(params, jnp.asarray(x), cache).compile(opts)
        row["compile_s"][op] = time.perf_counter() - t0
        return prog

    for b in args.decode_batches:
        row: dict = {"compile_s": {}, "ms": {}}
        res["rows"][str(b)] = row
        if time.perf_counter() >= deadline:
            row["skipped"] = "budget spent"
            continue
        cache = model.init_cache(b, ctx + (args.repeats + 2) * (bk + 1))
        ids = rng.integers(2, mcfg.vocab_size - 1, (b, ctx)).astype(np.int32)
        ids[ids == mask] = 2
        commit = compiled(extend, ids[:, :bk], cache, row, "commit")
        t0 = time.perf_counter()
        for s in range(0, ctx, bk):
            _, cache = commit(params, jnp.asarray(ids[:, s:s + bk]), cache)
        jax.block_until_ready(cache)
        row["prefill_s"] = time.perf_counter() - t0
        canvas = rng.integers(2, mcfg.vocab_size - 1, (b, bk)).astype(np.int32)
        canvas[rng.random((b, bk)) < 0.5] = mask
        known = jnp.asarray(np.where(canvas == mask, 2, canvas))  # the finished block
        for op, fn in blocks.items():
            if time.perf_counter() < deadline:
                prog, x = compiled(fn, canvas, cache, row, op), jnp.asarray(canvas)
                row["ms"][op] = 1e3 * best_time(lambda prog=prog, x=x: prog(params, x, cache), args.repeats)
        holder = {"cache": cache}
        for op, x in (("ar", known[:, :1]), ("commit", known)):
            if time.perf_counter() >= deadline:
                continue
            prog = commit if op == "commit" else compiled(extend, x, holder["cache"], row, op)

            def run(prog=prog, x=x):
                logits, holder["cache"] = prog(params, x, holder["cache"])
                return logits, holder["cache"]

            row["ms"][op] = 1e3 * best_time(run, args.repeats)
        row["skipped_ops"] = [op for op in ("block_free", f"block_c{c}", "ar", "commit") if op not in row["ms"]]
        row["cache_index_after"] = int(holder["cache"]["index"])
        print(f"  batch {b}: prefill of {ctx} tokens by {ctx // bk} commit passes {row['prefill_s']:.2f} s; " + ", ".join(
            f"{op} {ms:.2f} ms" for op, ms in row["ms"].items()), flush=True)
        save()
    return summary_decode(res)


def summary_decode(res: dict) -> str:
    return "; ".join(f"B={b}: " + ", ".join(f"{op} {ms:.2f}" for op, ms in r["ms"].items()) + " ms"
                     for b, r in res.get("rows", {}).items() if r.get("ms"))


# ---------------------------------------------------------------------------------- part c: kernels
def part_kernels(args: argparse.Namespace, res: dict, save: Save, deadline: float) -> str:
    """bench/gdn_device.py and bench/attention_gpu.py in-process, with what is left of the budget (the
    GDN check gets 60% of it); each one's failure is recorded and the other still runs."""
    failed = []
    gdn_extra = ["--ops", "causal", "--no-phase-times"] if args.smoke else ["--check-dtype", "bfloat16", "--fp32-fit"]
    for name, share, extra in (("gdn_device", 0.6, gdn_extra),
                               ("attention_gpu", 1.0, [])):
        left = deadline - time.perf_counter()
        if left <= 0:
            res[name] = {"status": "skipped", "reason": "budget spent"}
            continue
        out = args.out.with_name(f"{args.out.stem}_{name}.json")
        argv = (["--smoke"] if args.smoke else []) + extra + ["--budget-s", f"{share * left:.0f}", "--out", str(out)]
        print(f"  {name}.main({argv})", flush=True)
        try:
            res[name] = {"status": "ok", "argv": argv, "out": str(out), "report": bench_module(name).main(argv)}
        except (Exception, SystemExit):  # noqa: BLE001
            res[name] = {"status": "error", "argv": argv, "error": traceback.format_exc()[-6000:]}
            failed.append(name)
            print(res[name]["error"], flush=True)
        save()
    if failed:
        raise RuntimeError(f"failed: {', '.join(failed)} (tracebacks in the part's result)")
    return summary_kernels(res)


def summary_kernels(res: dict) -> str:
    out = []
    for name, r in res.items():
        if r.get("status") != "ok":
            out.append(f"{name} {r.get('status')}")
            continue
        rows = r["report"]["rows"]
        errs = [v for row in rows for v in (row.get("errors") or {}).values()]
        bad = sum("error" in row for row in rows)
        out.append(f"{name}: {len(rows)} rows" + (f" ({bad} failed)" if bad else "")
                   + (f", worst rel error {max(errs):.1e}" if errs else "") + f", {len(r['report']['skipped'])} skipped")
        fit = r["report"].get("fp32_fit")
        if fit:
            out[-1] += f", fp32 programs compiling {sum(x['fits'] for x in fit)}/{len(fit)}"
    return "; ".join(out)


PARTS: dict[str, tuple[str, Callable[[argparse.Namespace, dict, Save, float], str]]] = {
    "a": ("sft_step", part_sft_step), "b": ("decode", part_decode), "c": ("kernels", part_kernels)}
#: what a part that failed part-way had measured, for the final table
SUMMARIES: dict[str, Callable[[dict], str]] = {"sft_step": summary_sft, "decode": summary_decode,
                                               "kernels": summary_kernels}


# ---------------------------------------------------------------------------------------------- main
def meta(args: argparse.Namespace) -> dict:
    import jaxlib

    dev = jax.devices()[0]
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    cfg = base_config(args.smoke)
    limit = (dev.memory_stats() or {}).get("bytes_limit") if dev.platform == "gpu" else None
    return {"device": f"{dev.platform}: {dev.device_kind}", "device_count": jax.device_count(), "jax": jax.__version__,
            "device_memory_limit_GiB": limit and limit / GiB,
            "xla_python_client_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
            "jaxlib": jaxlib.__version__, "git_commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "host": platform.node(), "smoke": args.smoke, "budget_s": args.budget_s, "argv": args.argv,
            "shapes": {"hidden": cfg.hidden_size, "layers": args.layers, "experts": cfg.num_experts,
                       "top_k": cfg.num_experts_per_tok, "vocab": cfg.vocab_size, "gdn_chunk": cfg.gdn_chunk_size,
                       "batch": args.batch, "seq": args.seq, "block": args.block, "context": args.context,
                       "decode_batches": args.decode_batches, "coreset": args.coreset, "repeats": args.repeats}}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="a,b,c", help="comma-separated subset of a (SFT step), b (decode), c (kernels)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="start no part or row after this many seconds")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1, help="packed rows of the SFT step (x2 with the complementary copy)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--param-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="master weights of the SFT step (auto: fp32 with >= 100 GiB of device memory, else bf16)")
    ap.add_argument("--context", type=int, default=4096, help="decode: tokens in the cache before the timed steps")
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--coreset", type=int, default=32, help="decode: the MoE block coreset C of the 'on' block step")
    ap.add_argument("--chip", default=None, help="train/roofline.py CHIPS key (default: from the device kind)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true",
                    help="checks the script on any host: the tiny preset's widths (2 layers), seq and context 128, "
                         "decode batch 2, C = 4, fp32, remat none, 1 repeat, roofline as if on an H100")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.seq, args.context, args.coreset, args.repeats = 128, 128, 4, 1
        args.layers, args.decode_batches = 2, [2]
        args.chip = args.chip or "h100"
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in args.parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {bad} (known: {', '.join(PARTS)})")
    if args.seq % args.block or args.context % args.block:
        ap.error("--seq and --context must be multiples of --block")
    args.out = args.out or (pathlib.Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT")
                            else BENCH / "results" / "gpu_check.json")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    report: dict = {"meta": meta(args), "parts": {}}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))

    m = report["meta"]
    print(f"jax {m['jax']} / jaxlib {m['jaxlib']} on {m['device']}; commit {m['git_commit']}; budget {args.budget_s:.0f} s; "
          f"parts {','.join(args.parts)}; shapes {m['shapes']}", flush=True)
    start = time.perf_counter()
    deadline = start + args.budget_s
    for key in args.parts:
        name, fn = PARTS[key]
        rec: dict = {"name": name, "status": "running", "result": {}}
        report["parts"][key] = rec
        elapsed = time.perf_counter() - start
        if elapsed >= args.budget_s:
            rec.update(status="skipped", reason=f"budget spent: {elapsed:.0f} s >= --budget-s {args.budget_s:g}")
            print(f"part {key} ({name}): skipped, {rec['reason']}", flush=True)
            save()
            continue
        print(f"part {key} ({name}) at {elapsed:.0f} s ...", flush=True)
        t0 = time.perf_counter()
        # a failing part is recorded with its traceback and the next one runs: one device call brings
        # back everything it can
        try:
            rec["summary"] = fn(args, rec["result"], save, deadline)
            rec["status"] = "ok"
        except (Exception, SystemExit):  # noqa: BLE001
            rec.update(status="error", error=traceback.format_exc()[-8000:])
            print(f"part {key} ({name}) FAILED\n{rec['error']}", flush=True)
            try:
                rec["summary"] = rec["error"].strip().splitlines()[-1] + "; " + SUMMARIES[name](rec["result"])
            except Exception:  # noqa: BLE001 - a partial result the summary cannot read
                pass
        rec["seconds"] = time.perf_counter() - t0
        gc.collect()
        save()
    print_table(report)
    print(f"wrote {args.out} ({time.perf_counter() - start:.0f} s)")
    return report


def print_table(report: dict) -> None:
    print(f"\n{'part':<13} {'status':<8} {'s':>6} | summary")
    for key, rec in report["parts"].items():
        what = rec.get("summary") or rec.get("reason") or (rec["error"].strip().splitlines()[-1] if "error" in rec else "")
        print(f"{key} {rec['name']:<11} {rec['status']:<8} {rec.get('seconds', 0.0):6.1f} | {what}", flush=True)


if __name__ == "__main__":
    main()
