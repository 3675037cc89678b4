"""Our fwd and fwd+bwd tokens/s under candidate XLA CPU flag sets, side by side: each set runs
`bench/forward.py --skip-torch` in its own process (XLA reads XLA_FLAGS once, at backend start) and
the table gives every set's ratio to the first (no extra flags). What wins here may go into
`launch.py` as a default (issue 19: only the process owner sets process-wide flags).

    python bench/xla_flags.py                              # the built-in candidates
    python bench/xla_flags.py --sets "" "--xla_cpu_enable_fast_math=true" --scan on
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

CANDIDATES = (
    "",
    "--xla_cpu_enable_concurrency_optimized_scheduler=true",
    "--xla_cpu_experimental_ynn_fusion_type=",
    "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_DISABLED",
    "--xla_cpu_disable_new_fusion_emitters=true",
)
_ROW = re.compile(r"^clover_jax \(\w+\)\s+(\d+)\s+(\d+)")


def run_set(flags: str, extra: list[str]) -> tuple[float, float] | str:
    """(fwd tok/s, fwd+bwd tok/s) of one flag set, or the error's last line."""
    env = dict(os.environ, XLA_FLAGS=" ".join(x for x in (os.environ.get("XLA_FLAGS", ""), flags) if x))
    cmd = [sys.executable, str(Path(__file__).with_name("forward.py")), "--skip-torch", *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        m = _ROW.match(line)
        if m:
            return float(m.group(1)), float(m.group(2))
    tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
    return f"failed (rc {out.returncode}): {tail[:120]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="*", default=list(CANDIDATES), help="XLA flag strings; the first is the baseline")
    args, extra = ap.parse_known_args()
    base = None
    print(f"{'XLA flags':<78} {'fwd tok/s':>10} {'f+b tok/s':>10} {'fwd x':>6} {'f+b x':>6}", flush=True)
    for flags in args.sets:
        r = run_set(flags, extra)
        name = flags or "(none)"
        if isinstance(r, str):
            print(f"{name:<78} {r}", flush=True)
            continue
        base = base or r
        print(f"{name:<78} {r[0]:>10.0f} {r[1]:>10.0f} {r[0] / base[0]:>6.2f} {r[1] / base[1]:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
