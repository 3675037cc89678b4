"""Peak host memory of the streaming HF -> Orbax `convert` and Orbax -> HF `export`.

Synthesises a multi-GB Qwen3.6-shaped HF checkpoint tensor by tensor (hub prefix
``model.language_model.``, fused experts, bf16 with fp32 ``A_log`` / GDN norm, sharded + index,
composite ``qwen3_5_moe`` config.json), then runs convert and export each in a subprocess, polling
its RSS (children included) every ~20 ms and reading the kernel's max RSS when it exits. The export
is checked tensor by tensor against CRCs taken at generation (byte-exact round trip).

    python bench/convert_memory.py                     # ~3 GB checkpoint, files under /tmp, deleted
    python bench/convert_memory.py --gb 6 --keep --work-dir /tmp/cm
    python bench/convert_memory.py --out-json runs/bench/convert_memory.json

The budget is ``largest tensor + largest decoder layer`` (what the bridge promises to hold); the
``ratio`` columns are peak RSS over it, raw and with the jax/orbax import baseline subtracted.
The HF source is deleted after convert unless ``--keep``, so disk use peaks at ~2x ``--gb``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import psutil

from clover_jax.bridge import hf_keys as hk
from clover_jax.config import FULL, LINEAR, ModelConfig
from clover_jax.bridge.safetensors_io import SafetensorsIndex, ShardedSafetensorsWriter

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
MiB = 2**20
LAYOUT = hk.HFLayout(hk.HUB_PREFIX, hk.FUSED)
FP32_SUFFIXES = ("linear_attn.A_log", "linear_attn.norm.weight")
Plan = list[tuple[str, tuple[int, ...], np.dtype]]


def make_config(gb: float, hidden: int, layers: int, width: int) -> ModelConfig:
    """Qwen3.6 heads and vocab, 3 GDN + 1 attention pattern; experts (multiple of 8) sized to ``gb``."""
    def cfg(e: int) -> ModelConfig:
        return ModelConfig(hidden_size=hidden, num_hidden_layers=layers, num_experts=e,
                           layer_types=tuple(FULL if i % 4 == 3 else LINEAR for i in range(layers)),
                           moe_intermediate_size=width, shared_expert_intermediate_size=width)
    s8, s16 = plan_bytes(make_plan(cfg(8))), plan_bytes(make_plan(cfg(16)))
    e = max(8, 8 * round((gb * GB - s8) / (s16 - s8) + 1))
    return cfg(e)


def make_plan(cfg: ModelConfig) -> Plan:
    """(key, shape, dtype) of every HF tensor in write order (globals, then layer by layer)."""
    return [(k, s, np.dtype(np.float32 if k.endswith(FP32_SUFFIXES) else ml_dtypes.bfloat16))
            for k, s in hk.all_expected_keys(cfg, LAYOUT).items()]


def plan_bytes(plan: Plan) -> int:
    return sum(math.prod(s) * d.itemsize for _, s, d in plan)


def group_bytes(plan: Plan) -> dict[str, int]:
    """Bytes per item as the bridge streams them: "globals" and "layer.{i}"."""
    out: dict[str, int] = {}
    for k, s, d in plan:
        rest = k.split("layers.", 1)
        g = "layer." + rest[1].split(".")[0] if len(rest) == 2 else "globals"
        out[g] = out.get(g, 0) + math.prod(s) * d.itemsize
    return out


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Finite random values, generated for this tensor only (bf16 from raw bits: fast)."""
    if dtype == np.float32:
        return rng.standard_normal(shape, dtype=np.float32)
    bits = np.frombuffer(bytearray(rng.bytes(math.prod(shape) * 2)), np.uint16)
    bits &= 0x81FF  # random sign, mantissa, 2 low exponent bits; exponent 120..123: |x| in [2^-7, 2^-3)
    bits |= 0x3C00  # 10 random bits of 16: zstd shrinks it about as much as real bf16 weights
    return bits.view(ml_dtypes.bfloat16).reshape(shape)


def synthesise(cfg: ModelConfig, plan: Plan, out: Path, shard_bytes: int) -> dict[str, int]:
    """Writes the HF dir one tensor at a time; returns {key: crc32} for the round-trip check."""
    rng, crcs = np.random.default_rng(0), {}
    with ShardedSafetensorsWriter(out, shard_bytes) as w:
        w.plan(plan)
        for key, shape, dtype in plan:
            arr = random_tensor(rng, shape, dtype)
            crcs[key] = zlib.crc32(arr.reshape(-1).view(np.uint8))
            w.write(key, arr)
            del arr
    text = cfg.to_hf_dict("qwen3_5_moe_text")
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "text_config": text, "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return crcs


def verify(hf_dir: Path, plan: Plan, crcs: dict[str, int]) -> bool:
    idx = SafetensorsIndex(hf_dir)
    return set(idx.keys()) == set(crcs) and all(
        (idx.dtype(k), idx.shape(k)) == (d, s) and zlib.crc32(idx.get(k).reshape(-1).view(np.uint8)) == crcs[k]
        for k, s, d in plan)


def _proc_status(pid: int) -> dict[str, int]:
    """VmRSS / RssAnon / RssFile / RssShmem of one process in bytes ({} if it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {n: int(v.split()[0]) * 1024 for n, _, v in (ln.partition(":") for ln in lines)
            if n in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}


def _shrink_self() -> None:
    """Lowers this process's RSS and resets its peak-RSS mark before a child is started: the child's
    ``ru_maxrss`` starts from the parent's high-water mark (the child begins as a fork / vfork of
    this process), so without this ``maxrss`` would report the synthesis step's peak, not the child's."""
    gc.collect()
    if platform.libc_ver()[0] == "glibc":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
    except OSError:
        pass


def measure(cmd: list[str], interval: float = 0.02) -> dict[str, Any]:
    """Runs ``cmd``; peak RSS of it + its children (polled), its kernel max RSS, wall time."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    _shrink_self()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    peak, done = Counter(VmRSS=0), threading.Event()

    def poll() -> None:
        nonlocal peak
        ps = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                pids = [proc.pid] + [c.pid for c in ps.children(recursive=True)]
            except psutil.Error:
                pids = [proc.pid]
            tot = sum((Counter(_proc_status(p)) for p in pids), Counter())
            if tot["VmRSS"] > peak["VmRSS"]:
                peak = tot
            done.wait(interval)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    err = proc.stderr.read()  # stderr is small (logs); reading it avoids a full-pipe deadlock
    _, status, ru = os.wait4(proc.pid, 0)  # this child's own rusage (RUSAGE_CHILDREN is a max so far)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    poller.join()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{err[-4000:]}")
    return {"wall_s": wall, "peak_rss": peak["VmRSS"], "peak_anon": peak.get("RssAnon", 0),
            "peak_file": peak.get("RssFile", 0) + peak.get("RssShmem", 0), "maxrss_wait4": ru.ru_maxrss * 1024,
            "maxrss_children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}


def commands(hf: Path, ckpt: Path, export: Path, shard_bytes: int) -> tuple[list[str], list[str]]:
    launch = ROOT / "launch.py"
    text = launch.read_text() if launch.is_file() else ""
    py = sys.executable
    if '"convert"' in text and "--hf" in text:
        conv = [py, str(launch), "convert", "--hf", str(hf), "--out", str(ckpt)]
    else:
        conv = [py, "-c", "import sys; from clover_jax.bridge.convert import convert_hf_to_orbax as f; "
                "f(sys.argv[1], sys.argv[2])", str(hf), str(ckpt)]
    if '"export"' in text and "--ckpt" in text:
        exp = [py, str(launch), "export", "--ckpt", str(ckpt), "--out", str(export)]
    else:
        exp = [py, "-c", "import sys; from clover_jax.bridge.convert import export_orbax_to_hf as f; "
               "f(sys.argv[1], sys.argv[2], max_shard_bytes=int(sys.argv[3]))",
               str(ckpt), str(export), str(shard_bytes)]
    return conv, exp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=3.0, help="target checkpoint size (GB, 1e9 bytes)")
    for flag, default in (("--hidden", 1024), ("--layers", 8), ("--expert-width", 512)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--shard-gb", type=float, default=1.0)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp"), help="a fresh subdir is made here")
    ap.add_argument("--out-json", type=Path, default=ROOT / "runs/bench/convert_memory.json")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    a = ap.parse_args()

    cfg = make_config(a.gb, a.hidden, a.layers, a.expert_width)
    plan = make_plan(cfg)
    size, groups = plan_bytes(plan), group_bytes(plan)
    largest = max(math.prod(s) * d.itemsize for _, s, d in plan)
    layer = max(v for k, v in groups.items() if k != "globals")
    budget = largest + layer
    a.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="convert_memory_", dir=a.work_dir))  # only this is deleted
    need = size * (3 if a.keep else 2) * 1.05
    if shutil.disk_usage(work).free < need:
        raise SystemExit(f"{work}: need {need / GB:.1f} GB free")
    hf, ckpt, export = work / "hf", work / "orbax", work / "export"
    try:
        print(f"config: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_experts} experts "
              f"x {cfg.moe_intermediate_size}, vocab {cfg.vocab_size}; {size / GB:.2f} GB", flush=True)
        t0 = time.perf_counter()
        crcs = synthesise(cfg, plan, hf, int(a.shard_gb * GB))
        synth_s = time.perf_counter() - t0
        print(f"synthesised {hf} in {synth_s:.0f} s", flush=True)
        base = measure([sys.executable, "-c", "import clover_jax.bridge.convert"])
        base_ox = measure([sys.executable, "-c", "import jax; jax.devices(); "
                           "from clover_jax.bridge.params_checkpoint import _checkpointer; _checkpointer()"])
        conv_cmd, exp_cmd = commands(hf, ckpt, export, int(a.shard_gb * GB))
        conv = measure(conv_cmd)
        print(f"convert done in {conv['wall_s']:.0f} s", flush=True)
        if not a.keep:
            shutil.rmtree(hf)  # disk: at most two copies at a time
        exp = measure(exp_cmd)
        ok = verify(export, plan, crcs)
        if not a.keep:
            shutil.rmtree(ckpt)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)

    res: dict[str, Any] = {
        "config": {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "experts": cfg.num_experts,
                   "expert_width": cfg.moe_intermediate_size, "vocab": cfg.vocab_size},
        "commands": [conv_cmd, exp_cmd], "synthesise_s": synth_s, "checkpoint_bytes": size,
        "largest_tensor_bytes": largest, "largest_layer_bytes": layer, "globals_bytes": groups["globals"],
        "budget_bytes": budget,
        "baseline_import_bridge": base, "baseline_import_orbax": base_ox,
        "convert": conv, "export": exp, "roundtrip_byte_exact": ok, "work_dir": str(work) if a.keep else None,
    }
    for r in (conv, exp):
        r.update(gb_per_s=size / GB / r["wall_s"], ratio=r["peak_rss"] / budget,
                 ratio_minus_baseline=(r["peak_rss"] - base_ox["peak_rss"]) / budget)
    a.out_json.parent.mkdir(parents=True, exist_ok=True)
    a.out_json.write_text(json.dumps(res, indent=2) + "\n")

    m = lambda b: f"{b / MiB:,.0f} MiB"  # noqa: E731
    print(f"\ncheckpoint {size / GB:.2f} GB | largest tensor {m(largest)} | largest layer {m(layer)} | "
          f"globals {m(groups['globals'])} (one item per tensor) | budget (tensor + layer) {m(budget)}")
    print(f"baseline RSS: import clover_jax.bridge.convert {m(base['peak_rss'])}, "
          f"+ jax/orbax/checkpointer {m(base_ox['peak_rss'])}")
    rows = [("step", "peak RSS", "anon", "file", "maxrss", "ratio", "ratio-base", "time", "GB/s")]
    rows += [(name, m(r["peak_rss"]), m(r["peak_anon"]), m(r["peak_file"]), m(r["maxrss_wait4"]),
              f"{r['ratio']:.2f}x", f"{r['ratio_minus_baseline']:.2f}x", f"{r['wall_s']:.1f} s",
              f"{r['gb_per_s']:.3f}") for name, r in (("convert", conv), ("export", exp))]
    print("\n" + "\n".join("".join(f"{c:>12}" for c in row) for row in rows))
    print(f"\nround trip byte exact: {ok}; JSON: {a.out_json}")


if __name__ == "__main__":
    main()
