#!/usr/bin/env bash
# Runs every test that needs CUDA (each skips on a machine without it), then short GPU benchmarks
# that print tables: eager vs CUDA-graph decode steps, Triton paged attention vs SDPA, and the Triton
# W4A16/W8A16 dequantize-GEMM vs the bf16 matmul at decode batch sizes (with the bandwidth floor).
# Usage: scripts/gpu_check.sh [extra pytest args]. Uses .venv/bin/python if present, else python3.
# Under 10 minutes on one H100/H200-class GPU (mostly Triton compiling).
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
# CUDA-only tests: Triton kernels compiled on the device (the same tests run interpreted on the
# CPU), CUDA graph replay against eager, CUDA IPC KV transfer between two processes.
status=0
"$PY" -m pytest -q -rs \
  tests/common/kernels/test_attention.py \
  tests/common/kernels/test_triton_quant.py \
  tests/common/model/test_cuda_graph.py \
  tests/kvtransfer/test_cuda_ipc.py \
  "$@" || status=$?
"$PY" benchmarks/gpu_decode.py || status=$?
"$PY" benchmarks/gpu_quant.py || status=$?
exit "$status"
