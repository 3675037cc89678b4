"""Peak host memory of starting SFT from a checkpoint: the whole-tree path vs the streamed one.

Synthesises a Qwen3.6-shaped HF checkpoint (hub layout, fused experts, bf16; `convert_memory.synthesise`)
at a real width by default, optionally converts it to an Orbax params checkpoint, then runs each
variant in a fresh subprocess on ``--devices`` simulated CPU devices (mesh fsdp = all of them):

* ``old_load_hf``: `clover_jax.api.load_hf` (the whole tree, fp32);
* ``new_stream_params``: `sft.init_params.stream_params` (one layer / global tensor at a time into
  the param shardings);
* ``old_init_state`` / ``new_init_state``: the recipe's start-up, whole tree through the host
  (`init_state_host`) vs streamed (`init_state`, what `SFTSetup.init_state` runs); ``..._orbax``:
  the same from the Orbax params checkpoint (``--orbax``).

The child resets its peak-RSS mark after its imports and the abstract setup
(``/proc/self/clear_refs``), so ``peak - base`` is what the variant itself added (VmHWM); the
parent's RSS poll (`convert_memory.measure`) is recorded too. On CPU the "devices" live in host RAM:
the result (P = the fp32 parameter bytes) counts in the RSS. The Adam moments are zeros made on the
devices by both paths alike; by default only ``final_norm`` trains (``--train-all``: every param, +2P
of moments), and ``host`` = peak - base - moments. Target: ``host <= 1.3 P + the largest layer``
(fp32). Every variant prints a CRC of its params: old and new must agree.

    python bench/load_memory.py                                   # 1 layer, 8 experts (~4.3 GB fp32)
    python bench/load_memory.py --experts 256 --orbax             # ~7.4 GB fp32; needs ~20 GB free
    python bench/load_memory.py --hidden 64 --vocab 512 --experts 4 --moe-intermediate 16   # seconds

Variants whose predicted peak does not fit in the available memory are skipped (and say so).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

GB = 1e9
#: predicted peak over base in units of P (measured at 64 experts, +0.1) plus the largest layer L:
#: only for skipping what would not fit
PREDICT = {"old_load_hf": (2.1, 0), "new_stream_params": (1.25, 1), "old_init_state": (2.3, 0),
           "new_init_state": (1.25, 1), "old_init_state_orbax": (2.45, 0), "new_init_state_orbax": (1.25, 1)}


def model_config(a: argparse.Namespace) -> Any:
    from clover_jax.config import FULL, LINEAR, ModelConfig

    n = a.layers
    return ModelConfig(hidden_size=a.hidden, num_hidden_layers=n, num_experts=a.experts,
                       num_experts_per_tok=min(8, a.experts), vocab_size=a.vocab,
                       layer_types=tuple(FULL if i % 4 == 3 else LINEAR for i in range(n)),
                       moe_intermediate_size=a.moe_intermediate, shared_expert_intermediate_size=a.moe_intermediate)


def _status(field: str) -> int:
    for ln in Path("/proc/self/status").read_text().splitlines():
        if ln.startswith(field + ":"):
            return int(ln.split()[1]) * 1024
    return 0


def _device_bytes(tree: Any) -> int:
    """Bytes the devices of this process hold for `tree` (replicas counted each)."""
    import jax

    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)


def _crc(params: Any) -> int:
    """CRC32 of every param's bytes, in key order (a fingerprint old and new must share)."""
    import numpy as np

    from clover_jax.model.params import flatten

    flat, crc = flatten(params), 0
    for k in sorted(flat):
        crc = zlib.crc32(np.ascontiguousarray(np.asarray(flat[k])).view(np.uint8), crc)
    return crc


def child(a: argparse.Namespace) -> None:
    """One variant in this (fresh) process; writes its numbers to ``a.out``."""
    import jax
    import numpy as np

    import clover_jax.api  # noqa: F401  (imports before the base mark)
    import orbax.checkpoint  # noqa: F401
    from clover_jax.bridge.params_checkpoint import release_host_memory
    from clover_jax.model.clover_model import model_to_params
    from sft import init_params as ip
    from sft.config import SFTConfig
    from sft.recipe import bare_setup

    cfg = SFTConfig()
    opt = replace(cfg.optimizer, trainable=None if a.train_all else ("final_norm",))
    cfg = replace(cfg, optimizer=opt, train=replace(cfg.train, steps=10))
    orbax = a.child.endswith("_orbax")
    setup = bare_setup(cfg, "orbax" if orbax else "hf", a.orbax_dir if orbax else a.hf)
    gc.collect()
    release_host_memory()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    t0 = time.perf_counter()
    if a.child == "old_load_hf":
        params = model_to_params(clover_jax.api.load_hf(a.hf, dtype=np.float32, mode="block")[1])
        result = params
    elif a.child == "new_stream_params":
        params = result = ip.stream_params("hf", setup.init_path, setup.model_cfg, setup.param_shardings)
    else:
        result = (ip.init_state if a.child.startswith("new") else ip.init_state_host)(setup)
        params = result.params
    jax.block_until_ready(result)
    wall = time.perf_counter() - t0
    peak = _status("VmHWM")
    moments = _device_bytes(result.opt_state) if hasattr(result, "opt_state") else 0
    out = {"variant": a.child, "wall_s": wall, "base_rss": base, "peak_rss": peak, "end_rss": _status("VmRSS"),
           "device_bytes": _device_bytes(result), "moments_bytes": moments,
           "params_global_bytes": sum(x.nbytes for x in jax.tree.leaves(params)), "params_crc": _crc(params)}
    Path(a.out).write_text(json.dumps(out))


def sizes(a: argparse.Namespace) -> tuple[int, int]:
    """(P: fp32 bytes of the block-mode params, L: fp32 bytes of the largest layer)."""
    from clover_jax.model.params import flatten, global_param_shapes, layer_param_shapes

    cfg = model_config(a).replace(mode="block")
    nbytes = lambda tree: sum(4 * math.prod(s) for s in flatten(tree).values())  # noqa: E731
    layers = [nbytes(layer_param_shapes(cfg, i)) for i in range(cfg.num_hidden_layers)]
    return nbytes(global_param_shapes(cfg)) + sum(layers), max(layers)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("--hidden", 2048), ("--vocab", 248320), ("--experts", 8), ("--moe-intermediate", 512),
                          ("--layers", 1), ("--devices", 8)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--orbax", action="store_true", help="also start from an Orbax params checkpoint")
    ap.add_argument("--train-all", action="store_true", help="every param trains (Adam moments: +2P)")
    ap.add_argument("--variants", nargs="*", help=f"subset of {list(PREDICT)}")
    ap.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--out-json", type=Path, default=ROOT / "bench/results/load_memory.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    ap.add_argument("--orbax-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a)
        return {}
    import psutil

    from convert_memory import make_plan, measure, synthesise

    variants = a.variants or [v for v in PREDICT if a.orbax or not v.endswith("_orbax")]
    cfg = model_config(a)
    p_bytes, l_bytes = sizes(a)
    budget = 1.3 * p_bytes + l_bytes
    work = Path(tempfile.mkdtemp(prefix="load_memory_", dir=a.work_dir))
    env_flags = f"--xla_force_host_platform_device_count={a.devices}"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + env_flags).strip()
    rows: dict[str, Any] = {}
    try:
        hf = work / "hf"
        synthesise(cfg, make_plan(cfg), hf, 2 * 10**9)
        print(f"hidden {a.hidden}, {a.layers} layer(s), {a.experts} experts x {a.moe_intermediate}, vocab {a.vocab}: "
              f"P = {p_bytes / GB:.2f} GB fp32, largest layer L = {l_bytes / GB:.2f} GB; {a.devices} devices",
              flush=True)
        if a.orbax:
            subprocess.run([sys.executable, "-c", "import sys; from clover_jax.bridge.convert import "
                            "convert_hf_to_orbax as f; f(sys.argv[1], sys.argv[2])", str(hf), str(work / "orbax")],
                           check=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
        for v in variants:
            k, nl = PREDICT[v]
            need = k * p_bytes + nl * l_bytes + 1.5 * GB + (2 * p_bytes if a.train_all else 0)
            avail = psutil.virtual_memory().available
            if need > avail:
                rows[v] = {"variant": v, "skipped": f"predicted {need / GB:.1f} GB > {avail / GB:.1f} GB available"}
                print(f"{v}: {rows[v]['skipped']}", flush=True)
                continue
            out = work / f"{v}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", v, "--hf", str(hf), "--out", str(out),
                   "--orbax-dir", str(work / "orbax")] + (["--train-all"] if a.train_all else [])
            try:
                ext = measure(cmd)
            except RuntimeError as e:  # e.g. killed for memory
                msg = str(e).splitlines()
                rows[v] = {"variant": v, "error": msg[0].split(" failed ")[-1] + " " + " | ".join(msg[-3:])}
                print(f"{v}: failed: {rows[v]['error']}", flush=True)
                continue
            r = json.loads(out.read_text())
            over = r["peak_rss"] - r["base_rss"]
            r.update(polled_peak_rss=ext["peak_rss"], peak_over_base=over, ratio_p=over / p_bytes,
                     host=over - r["moments_bytes"], host_ratio_p=(over - r["moments_bytes"]) / p_bytes,
                     within_target=over - r["moments_bytes"] <= budget)
            rows[v] = r
            print(f"{v}: peak - base {over / GB:.2f} GB ({over / p_bytes:.2f} P), {r['wall_s']:.1f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res = {"config": {"hidden": a.hidden, "layers": a.layers, "experts": a.experts,
                      "moe_intermediate": a.moe_intermediate, "vocab": a.vocab, "devices": a.devices,
                      "train_all": a.train_all},
           "command": "python bench/load_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "params_fp32_bytes": p_bytes, "largest_layer_fp32_bytes": l_bytes, "target_host_bytes": budget,
           "variants": rows}
    a.out_json.parent.mkdir(parents=True, exist_ok=True)
    a.out_json.write_text(json.dumps(res, indent=2) + "\n")
    g = lambda b: f"{b / GB:.2f} GB"  # noqa: E731
    head = ("variant", "peak-base", "x P", "moments", "host", "host/P", "<=1.3P+L", "time", "crc")
    lines = ["".join(f"{c:>22}" if i == 0 else f"{c:>11}" for i, c in enumerate(head))]
    for v, r in rows.items():
        if "peak_rss" not in r:
            lines.append(f"{v:>22}  {r.get('skipped') or r.get('error')}")
            continue
        cells = (v, g(r["peak_over_base"]), f"{r['ratio_p']:.2f}", g(r["moments_bytes"]), g(r["host"]),
                 f"{r['host_ratio_p']:.2f}", str(r["within_target"]), f"{r['wall_s']:.1f} s", f"{r['params_crc']:08x}")
        lines.append("".join(f"{c:>22}" if i == 0 else f"{c:>11}" for i, c in enumerate(cells)))
    print(f"\nP = {g(p_bytes)}, L = {g(l_bytes)}, target host <= 1.3 P + L = {g(budget)}\n" + "\n".join(lines))
    print(f"JSON: {a.out_json}")
    return res


if __name__ == "__main__":
    main()
