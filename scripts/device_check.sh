#!/usr/bin/env bash
# GPU checks and timings in one call, for a machine with one NVIDIA GPU (under 8 minutes):
#   1. the GPU-marked tests, 2. pinned host-to-device bandwidth and resident vs ondemand on a
#   Mixtral-shaped random-weight model (8 layers x 8 experts of 4096x14336, bf16, budget 25%).
# Usage: bash scripts/device_check.sh   (writes $OUT/gpu_bench.json when OUT is set)
# Installs into .venv with the machine's own CUDA torch if one is importable, else from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv --system-site-packages
if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  .venv/bin/pip install -q torch
fi
.venv/bin/pip install -q -e '.[test]'
nvidia-smi --query-gpu=name,memory.total --format=csv
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
timeout 240 .venv/bin/python -m pytest -q -m gpu -p no:cacheprovider || echo "gpu tests: FAILED (rc=$?)"
timeout 300 .venv/bin/python scripts/gpu_bench.py --layers 8 --experts 8 --budget 0.25 --tokens 32
