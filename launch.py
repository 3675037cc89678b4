"""Clover-JAX command line: `python launch.py <command> ...` (DESIGN.md 6).

    demo      --config F [k=v ...]          the embedded default job (tiny Qwen3.6-shaped round trip)
    convert   --hf DIR --out DIR [--mode ar|block]                HF safetensors -> Orbax params checkpoint
    export    --checkpoint DIR --out DIR [--format qwen|clover]   Orbax -> HF safetensors
    sft | generate | calibrate | compile    land with their issues (they say so and exit 2)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

os.environ.setdefault("WANDB_MODE", "offline")

PENDING = {
    "sft": "the masked-diffusion SFT issue",
    "generate": "the block-diffusion decoding issue",
    "calibrate": "the block-diffusion decoding issue",
    "compile": "the scale issue",
}


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("clover_jax").setLevel(logging.INFO)
    for noisy in ("absl", "orbax", "jax", "tensorstore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_convert(args: argparse.Namespace) -> int:
    from clover_jax.bridge import convert_hf_to_orbax

    t0 = time.perf_counter()
    out = convert_hf_to_orbax(args.hf, args.out, mode=args.mode, overwrite=args.overwrite)
    print(f"converted {args.hf} -> {out} in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from clover_jax.bridge import export_orbax_to_hf

    t0 = time.perf_counter()
    out = export_orbax_to_hf(
        args.checkpoint, args.out, format=args.format, expert_layout=args.expert_layout, prefix=args.prefix,
        max_shard_bytes=int(args.max_shard_gb * 10**9), overwrite=args.overwrite,
    )
    fmt = args.format or "format by the checkpoint mode"
    print(f"exported {args.checkpoint} -> {out} ({fmt}) in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from clover_jax.demo import run_demo
    from clover_jax.run_config import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    return run_demo(cfg)


def cmd_pending(args: argparse.Namespace) -> int:
    print(f"`launch.py {args.command}` is not available yet: it lands with {PENDING[args.command]}.",
          file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="launch.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-v", "--verbose", action="store_true", help="log INFO from every library")
    sub = ap.add_subparsers(dest="command", required=True)

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
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--format", choices=("qwen", "clover"), default=None,
                   help="clover: clover_moe with the block-diffusion tensors and the mask token; qwen: "
                        "qwen3_5_moe_text without them; default: clover for a block-mode checkpoint, else qwen")
    p.add_argument("--expert-layout", choices=("fused", "per_expert"), default=None,
                   help="default: the layout of the checkpoint's HF source")
    p.add_argument("--prefix", choices=("model.", "model.language_model."), default=None,
                   help="default: the key prefix of the checkpoint's HF source")
    p.add_argument("--max-shard-gb", type=float, default=5.0)
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(fn=cmd_export)

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
    from clover_jax.safetensors_io import CheckpointError
    from clover_jax.yaml_config import ConfigError
    from clover_jax.config import ModelConfigError

    try:
        return args.fn(args)
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
