#!/usr/bin/env bash
# README command (1) on a runtime-only install (`pip install -e .`, no test extra: no torch), shortened
# by overrides: it must finish with a checkpoint, a metrics.jsonl and an HF export, and must not print
# transformers' "PyTorch was not found" advice. Usage: .ci/first_run.sh [VENV_DIR] (default .venv-rt).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-rt}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip && "$VENV/bin/pip" install -q -e .
RUN=$(mktemp -d)
trap 'rm -rf "$RUN"' EXIT
"$VENV/bin/python" launch.py sft --config configs/sft_tiny.yaml train.steps=3 train.eval_every=2 \
  checkpoint.every_steps=2 model.init_from="$RUN/run/init_hf" logging.run_dir="$RUN/run" \
  export.dir="$RUN/export" 2>&1 | tee "$RUN/out.txt"
fail() { echo "first run: $*" >&2; exit 1; }
grep -q "PyTorch was not found" "$RUN/out.txt" && fail "transformers' no-torch advice printed"
[ -s "$RUN/run/metrics.jsonl" ] || fail "no metrics.jsonl"
ls "$RUN/run/checkpoints" | grep -qx 3 || fail "no checkpoint of step 3 in $RUN/run/checkpoints"
[ -f "$RUN/export/config.json" ] && ls "$RUN/export"/*.safetensors > /dev/null || fail "no HF export"
echo "first run OK: checkpoint, metrics.jsonl and export written"
