"""Clover-JAX command line: `python launch.py <command> ...` (docs/design.md 6).

    sft       --config F [k=v ...]          masked-diffusion SFT (configs/agent_mix.yaml; configs/sft_tiny.yaml
                                            is the embedded default); resumes from checkpoint.dir
    demo      --config F [k=v ...]          tiny Qwen3.6-shaped HF -> Orbax -> HF round trip
    convert   --hf DIR --out DIR [--mode ar|block]                HF safetensors -> Orbax params checkpoint
    export    --checkpoint DIR --out DIR [--format qwen|clover]   Orbax (params or SFT training checkpoint) -> HF
              [--adapters]: a LoRA run's training checkpoint -> a PEFT LoRA adapter dir
    compile   --config F --topology v5p-64 [k=v ...]   AOT-compile the train step for a TPU slice
              on this machine; per-chip memory vs HBM (exit 1 when it does not fit)
    generate  --checkpoint DIR (--prompt T | --prompts F.jsonl | --prompt-ids 1,2) [--out F.json] [decode.k=v]
              block-diffusion (or AR / self-speculative) decoding with stats; streams finished blocks
    data      --config F [--batches N] [--show K] [k=v ...]   inspect an SFT mix without training: per
              source records read/kept/bad/filtered, documents, tokens, loss tokens, drawn share vs
              weight, padding, pieces per row, overlong splits; --show K prints K packed rows
    calibrate --config F [k=v ...]          block size x threshold (x calibration x sub-block) sweeps:
              CSV, JSON, PNG plots, Pareto front; masked-token loss per block size; learned scalars
    calibrate --config F --fit [k=v ...]    gamma fitted per target block size on fit.calibration, no sweep
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# transformers' import-time advice "PyTorch was not found. Models won't be available ...": this
# runtime needs only its tokenizers and chat templates (no torch), so the advice misleads a user
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

PENDING: dict[str, str] = {}


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("clover_jax").setLevel(logging.INFO)
    for noisy in ("absl", "orbax", "jax", "tensorstore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_convert(args: argparse.Namespace) -> int:
    from clover_jax.bridge.convert import convert_hf_to_orbax

    t0 = time.perf_counter()
    out = convert_hf_to_orbax(args.hf, args.out, mode=args.mode, overwrite=args.overwrite)
    print(f"converted {args.hf} -> {out} in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from clover_jax.bridge.convert import export_orbax_to_hf
    from clover_jax.bridge.params_checkpoint import is_params_checkpoint
    from clover_jax.bridge.safetensors_io import CheckpointError
    from clover_jax.yaml_config import ConfigError
    from sft.train_checkpoint import export_training_checkpoint, training_step_dir

    t0 = time.perf_counter()
    kw = dict(format=args.format, expert_layout=args.expert_layout, prefix=args.prefix,
              max_shard_bytes=int(args.max_shard_gb * 10**9), clover_naming=args.clover_naming)
    if args.adapters:  # a LoRA run's adapters as a PEFT adapter dir, not a checkpoint
        from sft.train_checkpoint import export_training_adapter

        given = [f for f, v in (("--format clover", args.format == "clover"), ("--expert-layout", args.expert_layout),
                                ("--prefix", args.prefix)) if v]
        if given:  # the adapter is for transformers' Qwen3.5-MoE: its names, no Clover tensors
            raise ConfigError(f"--adapters writes a PEFT adapter for transformers' Qwen3.5-MoE: {given[0]} does not apply")
        if is_params_checkpoint(args.checkpoint) or training_step_dir(args.checkpoint) is None:
            raise CheckpointError(f"{args.checkpoint}: --adapters needs the training checkpoint of a LoRA run "
                                  "(<run_dir>/checkpoints or one of its steps)")
        out = export_training_adapter(args.checkpoint, args.out, overwrite=args.overwrite)
        print(f"exported the PEFT LoRA adapter of {args.checkpoint} -> {out} in {time.perf_counter() - t0:.1f} s")
        return 0
    if not is_params_checkpoint(args.checkpoint) and training_step_dir(args.checkpoint) is not None:
        # an SFT run's checkpoint: exported as the run's own export would be (its format and dtype)
        out = export_training_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite, **kw)
    else:
        out = export_orbax_to_hf(args.checkpoint, args.out, overwrite=args.overwrite, **kw)
    fmt = args.format or "format by the checkpoint mode"
    print(f"exported {args.checkpoint} -> {out} ({fmt}) in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from clover_jax.demo import run_demo
    from clover_jax.run_config import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    return run_demo(cfg)


#: top-level sections that make a YAML an SFT recipe (compiled with its real train step)
SFT_SECTIONS = ("data", "data_root", "noise", "loss", "eval", "train", "optimizer", "checkpoint", "export", "logging")


def _sft_compile_plans(path: str, overrides: list[str], topologies: list[str] | None) -> list:
    """AOT memory plans of an SFT recipe's real train step (two-stream forward, masked-diffusion
    loss, backward, adamw, `train.micro_batches` accumulation) on each topology. Batch and length are
    the recipe's (`data.batch_size`, `data.seq_len`), the remat policy its `model.remat` (or
    `compile.remat=...`); `compile.topology` is the default slice. Weights are never read: the architecture is `model.init_from`'s config.json when that is
    an HF dir here, else `model.preset` (else the Qwen3.6-35B-A3B defaults), plus the overrides."""
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from clover_jax.parallel import sharding as sh
    from clover_jax.bridge.convert import QWEN_TOKENIZER_SIZE
    from clover_jax.config import ModelConfig, param_count
    from clover_jax.model.clover_model import abstract_model
    from clover_jax.yaml_config import ConfigError, apply_overrides, from_tree
    from sft.config import load_sft_config, model_config_from
    from sft.lora import optimizer_config, train_model_config
    from sft.recipe import SFTSetup, sharded_abstract_state
    from clover_jax.model.kernel_costs import step_kernel_cost
    from clover_jax.parallel.remat import resolve as resolve_remat
    from sft.step_flops import sft_step_flops
    from train.aot import CompileConfig, compile_plan, topology_mesh, tpu_kernels
    from train.optimizer import build_optimizer

    comp = [o for o in overrides if o.split("=", 1)[0].startswith("compile.")]
    rest = [o for o in overrides if o not in comp]
    ctree = apply_overrides({}, comp).get("compile", {})
    for k in ("seq_len", "micro_batch", "loss_chunk"):
        if k in ctree:
            alt = {"seq_len": "data.seq_len", "micro_batch": "data.batch_size / train.micro_batches",
                   "loss_chunk": "loss.chunk_tokens"}[k]
            raise ConfigError(f"compile.{k}: an SFT recipe compiles its own batch; set {alt} instead")
    ccfg = from_tree(CompileConfig, ctree, where="compile overrides")
    cfg = load_sft_config(path, rest)
    init = Path(cfg.model.init_from) if cfg.model.init_from else None
    base = ModelConfig.from_hf_file(init) if init is not None and (init / "config.json").is_file() else None
    if base is None and init is not None:
        print(f"note: model.init_from {init} is not an HF dir here: using "
              f"{cfg.model.preset or 'the Qwen3.6-35B-A3B defaults'} for the architecture", flush=True)
    mcfg = train_model_config(cfg, model_config_from(cfg.model, base))
    mcfg = tpu_kernels(mcfg)  # the TPU kernels ("auto" means the jnp reference on this CPU host)
    if mcfg.mask_token_id is None:
        mcfg = mcfg.replace(mask_token_id=min(QWEN_TOKENIZER_SIZE, mcfg.vocab_size - 1))
    rows, mb, t = cfg.data.batch_size, cfg.train.micro_batches, cfg.data.seq_len
    if rows % mb:
        raise ConfigError(f"data.batch_size {rows} is not divisible by train.micro_batches {mb}")
    bk, copies = mcfg.block_sizes[0], cfg.noise.copies
    policy = ctree.get("remat") or mcfg.remat  # compile.remat=... overrides the recipe's model.remat
    model = abstract_model(mcfg)
    graphdef, _ = nnx.split(model)
    optimizer = build_optimizer(optimizer_config(cfg), cfg.train.steps)
    plans = []
    for topo_name in topologies or [ccfg.topology]:
        print(f"compiling the SFT train step of {path} for {topo_name} ({rows} rows x {t} tokens, {mb} "
              f"micro-batches, block {bk}, remat {policy}, GDN {mcfg.gdn_backend}, attention {mcfg.attn_backend}, "
              f"context layout {mcfg.context_layout}) ...",
              flush=True)
        topo, mesh = topology_mesh(topo_name, cfg.mesh)
        p_sh, state_sh, state = sharded_abstract_state(model, optimizer, mesh, cfg.train)
        b_sh = sh.batch_sharding(mesh, shape=(rows, t))
        batch = {k: jax.ShapeDtypeStruct((rows, t), dt, sharding=b_sh)
                 for k, dt in (("input_ids", jnp.int32), ("segment_ids", jnp.int32), ("positions", jnp.int32),
                               ("loss_mask", jnp.bool_))}
        setup = SFTSetup(cfg=cfg, model_cfg=mcfg, kind="abstract", init_path=None, tok_dir=None, data=None,
                         mesh=mesh, graphdef=graphdef, optimizer=optimizer, param_shardings=p_sh,
                         state_shardings=state_sh, abstract_state=state)
        # the TPU GDN kernels run dk, dv padded to whole 128-lane tiles (gdn.causal_op._padded_dims)
        flops = sft_step_flops(mcfg, rows=rows, seq_len=t, block_size=bk, copies=copies, remat=resolve_remat(policy),
                               gdn_lanes=128, flash_backward=mcfg.attn_backend in ("splash", "flash"), micro_batches=mb)
        plans.append(compile_plan(
            setup.make_step(bk), (state, batch), mesh=mesh, rules=sh.DEFAULT_RULES, remat_policy=policy,
            state_args=state, model=Path(path).stem, params=param_count(mcfg), topology=topo,
            micro_batch=rows // mb, micro_batches=mb, seq_len=t, model_flops=flops.model,
            analytic_flops=flops.executed, tokens_per_step=rows * t,
            kernel_cost=step_kernel_cost(mcfg, mesh.shape["expert"], bk, mesh.shape.get("context", 1)),
            step_name=f"SFT step ({copies} noisy copies x clean+noisy streams, fwd+bwd+adamw)"))
    return plans


def cmd_compile(args: argparse.Namespace) -> int:
    """AOT plans: an SFT recipe (a YAML with SFT sections) compiles its real train step; a plain
    run config (model/mesh/compile sections, or only overrides) the generic stand-in step."""
    import dataclasses

    # compile-only TPU devices come from libtpu on this host: no local accelerator backend, and no
    # libtpu lockfile (a second planner or test on the machine would otherwise abort)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from clover_jax.yaml_config import ConfigError, load_yaml_tree
    from train.aot import PlanError, check, describe

    # the outputs' folders are checked before a compile that can take half an hour, not after it
    for flag, out in (("--json", args.json), ("--hlo", args.hlo)):
        if out and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            raise ConfigError(f"{flag} {out}: the folder {os.path.dirname(os.path.abspath(out))} does not exist")
    if args.ce_share is not None and not 0.0 <= args.ce_share <= 1.0:
        raise ConfigError(f"--ce-share {args.ce_share}: a share of the CE chunks, from 0 to 1")
    topologies = args.topology.split(",") if args.topology else None
    tree = load_yaml_tree(args.config) if args.config else {}
    if any(k in tree for k in SFT_SECTIONS):
        plans = _sft_compile_plans(args.config, list(args.overrides), topologies)
    else:
        from clover_jax.run_config import load_run_config
        from train.aot import plan

        cfg = load_run_config(args.config, args.overrides)
        name = args.config or "defaults"
        plans = []
        for topo in topologies or [cfg.compile.topology]:
            ccfg = dataclasses.replace(cfg.compile, topology=topo)
            print(f"compiling the stand-in AR train step of {name} for {topo} (seq {ccfg.seq_len}, remat "
                  f"{ccfg.remat}) ...", flush=True)
            plans.append(plan(cfg.model, cfg.mesh, ccfg, model_name=name))
    plans = [dataclasses.replace(p, breakdown=args.breakdown, ce_share=args.ce_share) for p in plans]
    failed = False
    for p in plans:
        try:
            print(check(p).table(), flush=True)
        except PlanError as e:
            print(str(e), file=sys.stderr, flush=True)
            failed = True
    if len(plans) > 1:
        print(describe(plans))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump([p.as_dict() for p in plans], f, indent=1)
    if args.hlo:
        import gzip

        for p in plans:
            if p.executable is None:
                print(f"no HLO for the {p.topology.name} plan: XLA refused to compile it", flush=True)
                continue
            # the optimized HLO behind the numbers, to answer "which op moves these bytes" later
            path = f"{args.hlo}_{p.topology.name.replace(':', '_')}.hlo.txt.gz"
            with gzip.open(path, "wt") as f:
                f.write(p.executable.as_text())
            print(f"optimized HLO of the {p.topology.name} plan written to {path}", flush=True)
    return 1 if failed else 0


#: exit code of an `sft` run stopped by SIGTERM after writing its checkpoint (128 + SIGTERM, as a
#: shell reports a process killed by it, so schedulers see "preempted", not "done")
EXIT_PREEMPTED = 143


def cmd_sft(args: argparse.Namespace) -> int:
    from sft.preemption import sigterm_exits

    loaded: list = []  # the config, once loaded: its checkpoint dir goes into the SIGTERM message
    # before anything starts the JAX backend: SIGTERM outside the training loop's own handler ends
    # with one line and EXIT_PREEMPTED, never libtpu's C++ stack dump (sft/preemption.py)
    with sigterm_exits(lambda: loaded[0].checkpoint_dir if loaded else None, EXIT_PREEMPTED):
        return _sft(args, loaded)


def _sft(args: argparse.Namespace, loaded: list) -> int:
    from sft.config import load_sft_config
    from sft.recipe import run_sft
    from train.checkpoint import CheckpointError as TrainCheckpointError
    from train.config_diff import ResumeConfigError
    from train.run_lock import RunLockError, run_lock

    for name in ("sft", "train"):
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        cfg = load_sft_config(args.config, args.overrides)
        loaded.append(cfg)
        # the run dirs are locked before any compile, so a second run refuses at once
        with run_lock([cfg.logging.run_dir, cfg.checkpoint_dir], message=print):
            res = run_sft(cfg)
    except (RunLockError, ResumeConfigError) as e:  # the user's to resolve: another run, another config
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainCheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if res.nonfinite_step is not None:
        print(f"error: non-finite loss / gradient at step {res.nonfinite_step} (train.on_nonfinite="
              f"{cfg.train.on_nonfinite}): stopped, nothing exported; the checkpoints in {cfg.checkpoint_dir} "
              "hold only finite steps (lower optimizer.lr, or train.on_nonfinite=skip)", file=sys.stderr)
        return 1
    return EXIT_PREEMPTED if res.preempted else 0


def cmd_data(args: argparse.Namespace) -> int:
    from sft.config import load_sft_config
    from sft.mix_report import run_data

    if args.batches < 1 or args.show < 0:
        raise SystemExit(f"launch.py data: --batches must be >= 1 and --show >= 0 (got {args.batches}, {args.show})")
    from train.aot import parse_topology

    return run_data(load_sft_config(args.config, args.overrides), args.batches, args.show,
                    chips=parse_topology(args.topology).chips)


def cmd_generate(args: argparse.Namespace) -> int:
    from clover_jax.decoding.generator import DecodeError
    from clover_jax.decoding.cli import run_generate
    from sft.train_checkpoint import load_model  # launch owns the wiring: decoding never imports sft

    try:
        return run_generate(args, load=load_model)
    except DecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def cmd_calibrate(args: argparse.Namespace) -> int:
    from clover_jax.decoding.calibrate import load_calibrate_config, run_calibrate
    from clover_jax.decoding.generator import DecodeError
    from sft.data.synthetic import generate_record  # launch owns the wiring: decoding never imports sft

    try:
        from sft.calibration_study import default_steps, is_study_config, load_study_config, run_study

        if is_study_config(args.config):  # the whole study: trains what is missing, then measures
            study = load_study_config(args.config, args.overrides)
            run_study(study, default_steps(study), command=" ".join(["python launch.py calibrate --config",
                                                                     args.config, *args.overrides]))
            return 0
        cfg = load_calibrate_config(args.config, args.overrides)
        if args.fit:
            from clover_jax.decoding.calibrate_fit import run_fit

            run_fit(cfg, generate_record=generate_record)
            return 0
        return run_calibrate(cfg, generate_record=generate_record)
    except DecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def cmd_pending(args: argparse.Namespace) -> int:
    print(f"`launch.py {args.command}` is not available yet: it lands with {PENDING[args.command]}.",
          file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="launch.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-v", "--verbose", action="store_true", help="log INFO from every library")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("sft", help="masked-diffusion SFT (train; resumes from checkpoint.dir; exports at the end)")
    p.add_argument("--config", required=True, help="YAML recipe (configs/agent_mix.yaml, configs/sft_tiny.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20 data.batch_size=4")
    p.set_defaults(fn=cmd_sft)

    p = sub.add_parser("data", help="inspect an SFT mix without training (per-source table, --show packed rows)")
    p.add_argument("--config", required=True, help="YAML recipe (configs/agent_mix.yaml data_root=DIR)")
    p.add_argument("--batches", type=int, default=1, help="training batches to draw and measure (default 1)")
    p.add_argument("--show", type=int, default=0, metavar="K",
                   help="print the first K packed rows with the trained (loss-masked) spans highlighted")
    p.add_argument("--topology", default="v5p-64", help="the slice whose chips split the CE positions, for the "
                   "share of CE chunks holding loss tokens (default v5p-64)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data_root=/mnt/agent-data data.seq_len=4096")
    p.set_defaults(fn=cmd_data)

    p = sub.add_parser("demo", help="embedded default job: tiny Qwen3.6-shaped convert/export round trip")
    p.add_argument("--config", default=None, help="YAML run config (configs/demo.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. demo.max_new_tokens=8")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("convert", help="HF safetensors dir -> Orbax params checkpoint")
    p.add_argument("--hf", required=True, help="HF checkpoint dir (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output checkpoint dir (written atomically)")
    p.add_argument("--mode", choices=("ar", "block"), default=None,
                   help="default: the checkpoint's (clover_moe: block, Qwen: ar); block on a Qwen dir starts "
                        "the Clover params at their init values, ar on a Clover dir drops them")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at --out")
    p.set_defaults(fn=cmd_convert)

    p = sub.add_parser("export", help="Orbax params checkpoint -> HF safetensors dir")
    p.add_argument("--checkpoint", required=True, help="Orbax params checkpoint dir (`convert` output), or an "
                   "SFT training checkpoint (<run_dir>/checkpoints: its newest step, or <run_dir>/checkpoints/<step>)")
    p.add_argument("--out", required=True, help="output HF dir (config.json, safetensors shards, tokenizer)")
    p.add_argument("--format", choices=("qwen", "clover"), default=None,
                   help="clover: clover_moe with the block-diffusion tensors and the mask token; qwen: "
                        "qwen3_5_moe_text without them; default: clover for a block-mode checkpoint, else qwen")
    p.add_argument("--clover-naming", choices=("split", "packed"), default="split",
                   help="the Clover tensors' names (format clover): split = conv_right_weight and the three "
                        "bd_softmax_* scalars per GDN layer (what llama.cpp's converter reads); packed = "
                        "bd_gdn_conv_right_weight and bd_gdn_softmax_scalars [nv, 3]")
    p.add_argument("--expert-layout", choices=("fused", "per_expert"), default=None,
                   help="default: the layout of the checkpoint's HF source")
    p.add_argument("--prefix", choices=("model.", "model.language_model."), default=None,
                   help="default: the key prefix of the checkpoint's HF source")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard in GB (default 5)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out whole (default: refuse it)")
    p.add_argument("--adapters", action="store_true", help="a LoRA run's training checkpoint -> its adapters as a "
                   "PEFT LoRA adapter dir (adapter_config.json, adapter_model.safetensors) for transformers' "
                   "Qwen3.5-MoE, instead of the merged checkpoint")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("compile", help="AOT-compile the train step for a TPU topology; per-chip memory vs HBM")
    p.add_argument("--config", default=None, help="YAML run config (model:, mesh:, compile: sections)")
    p.add_argument("--topology", default=None, help="v5p-64, v5p-128, v6e-256, v5litepod-16, v4-32, v5p:2x4x4, "
                   "or several comma-separated (then also a side-by-side table); default: compile.topology")
    p.add_argument("--json", default=None, help="also write the plans (memory, FLOPs, collectives, roofline) "
                   "to this JSON file")
    p.add_argument("--hlo", default=None, help="also write each plan's optimized HLO to "
                   "<HLO>_<topology>.hlo.txt.gz")
    p.add_argument("--breakdown", action="store_true", help="also print the HBM bytes per category (MoE grouped "
                   "matmuls, MoE other, GDN kernels / other, attention, CE, dense projections, norms / other, "
                   "collectives, optimizer) from the HLO's source stack frames (the JSON holds them always)")
    p.add_argument("--ce-share", type=float, default=None, metavar="S",
                   help="share of the CE chunks that hold loss tokens (0..1; `launch.py data` estimates it for a "
                   "recipe): also report the step's HBM bytes and roofline with only those chunks computed "
                   "(the plan's own numbers count every chunk: an upper bound)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.seq_len=4096 mesh.expert=4 (an SFT recipe; "
                   "a plain run config: compile.seq_len=4096)")
    p.set_defaults(fn=cmd_compile)

    p = sub.add_parser("generate", help="decode prompts with a checkpoint (threshold | ar | self_speculative)")
    p.add_argument("--checkpoint", required=True, help="HF dir (Clover / Qwen), Orbax params checkpoint, or SFT "
                   "training checkpoint (<run_dir>/checkpoints[/<step>])")
    p.add_argument("--prompt", default=None, help="a user message, rendered with the chat template")
    p.add_argument("--prompts", default=None, help="JSONL of chat records (messages, tools) or {\"prompt\": ...}")
    p.add_argument("--prompt-ids", default=None, help="a prompt as comma-separated token ids")
    p.add_argument("--raw", action="store_true", help="encode --prompt as plain text, no chat template")
    p.add_argument("--out", default=None, help="write [{prompt, text, token_ids, stats}] as JSON")
    p.add_argument("--batch-size", type=int, default=8, help="requests decoded together")
    p.add_argument("--no-stream", action="store_true", help="do not print blocks as they finish")
    p.add_argument("overrides", nargs="*", help="decode.* overrides, e.g. decode.block_size=16 decode.threshold=0.9")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("calibrate", help="block-size / threshold sweeps on an eval set (CSV, JSON, PNG)")
    p.add_argument("--config", required=True, help="YAML (configs/calibrate_tiny.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. checkpoint=DIR sweep.block_sizes=[4,8]")
    p.add_argument("--fit", action="store_true", help="fit gamma per target block size on fit.calibration (the "
                   "masked-token CE), write fit/fit.json and a checkpoint per size; no sweep")
    p.set_defaults(fn=cmd_calibrate)

    for name in PENDING:
        p = sub.add_parser(name, help=f"(lands with {PENDING[name]})")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(fn=cmd_pending)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    # pending commands accept anything (`sft --config F k=v`) so they can say what they are waiting for
    args, unknown = ap.parse_known_args(argv)
    if unknown and args.fn is not cmd_pending:
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    _setup_logging(args.verbose)
    from clover_jax.config import ModelConfigError
    from clover_jax.input_file import InputFileError
    from clover_jax.bridge.safetensors_io import CheckpointError
    from clover_jax.yaml_config import ConfigError

    try:
        return args.fn(args)
    except InputFileError as e:  # a record of a user's file (prompts, eval set, SFT data): file:line
        print(f"error: {e}", file=sys.stderr)
        return 2
    except FileExistsError as e:
        print(f"error: {e} (pass --overwrite to replace it)", file=sys.stderr)
        return 1
    except (CheckpointError, ConfigError, ModelConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except NotImplementedError as e:
        print(f"not available yet: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
