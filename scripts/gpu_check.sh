#!/usr/bin/env bash
# Runs every test that needs CUDA (each skips on a machine without it) and reports the GPU seen.
# Usage: scripts/gpu_check.sh [extra pytest args]. Uses .venv/bin/python if present, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
"$PY" - <<'PYEOF'
import torch
if not torch.cuda.is_available():
    raise SystemExit("gpu_check: no CUDA device visible; nothing to check")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
PYEOF
# CUDA-only tests: Triton kernels compiled on the device (same tests run interpreted on CPU),
# CUDA IPC KV transfer between two processes.
exec "$PY" -m pytest -q -rs \
  tests/common/test_attention.py \
  tests/kvtransfer/test_cuda_ipc.py \
  "$@"
