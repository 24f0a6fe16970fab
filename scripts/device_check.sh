#!/usr/bin/env bash
# GPU checks and timings in one call, for a machine with one NVIDIA GPU (under 10 minutes):
#   1. the GPU-marked tests, 2. pinned host-to-device bandwidth and resident vs ondemand on a
#   Mixtral-shaped random-weight model (8 layers x 8 experts of 4096x14336, bf16, budget 25%),
#   3. every engine side by side on the widened bundled model (python -m specter.bench, cuda link).
# Exits non-zero when the GPU tests fail (after the timings have run).
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
tests_rc=0
timeout 240 .venv/bin/python -m pytest -q -m gpu -p no:cacheprovider || tests_rc=$?
[ "$tests_rc" -eq 0 ] || echo "gpu tests: FAILED (rc=$tests_rc)"
timeout 150 .venv/bin/python scripts/gpu_bench.py --layers 8 --experts 8 --budget 0.25 --tokens 32
timeout 200 .venv/bin/python -m specter.bench recipes/bench-proxy.yaml --set max_new_tokens=16 --repeats 1 \
  --out "${OUT:-reports}/bench-proxy-gpu" --no-plots
exit "$tests_rc"
