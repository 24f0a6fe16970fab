#!/usr/bin/env bash
# GPU checks and timings in one call, for a machine with one NVIDIA GPU (under 10 minutes):
#   1. the GPU-marked tests but the slow ones (every engine eager and compiled on the cuda link, the
#      cuda cache and link, INT4 tinygemm; every other layout compiled on CUDA is `gpu and slow`, run
#      apart: pytest -m "gpu and slow" tests/test_cuda_engines.py), 2. pinned host-to-device bandwidth and resident vs ondemand on a
#      Mixtral-shaped random-weight model (8 layers x 8 experts of 4096x14336, bf16, budget 25%),
#   3. every engine side by side on the widened bundled model (python -m specter.bench, eager on the
#      local and cuda links at 25% and 50%; compiled on the cuda link at 50%).
# Exits non-zero when the GPU tests fail (after the timings have run). Logs and bench JSON go to
# $OUT when it is set, else reports/device-check/.
# Python: $PYTHON if set, else a python3 whose torch sees a GPU, else .venv with torch from PyPI.
# Offline machines: wheels for missing packages in .whl/ are installed into /tmp/site first
# (e.g. torchao; see the note under README's "Tests").
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-reports/device-check}"
mkdir -p "$out"
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
py="${PYTHON:-python3}"
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  python3 -m venv .venv --system-site-packages && .venv/bin/pip install -q torch && py=.venv/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c "import specter, torchao, pluggy, hypothesis, transformers, accelerate, yaml" 2>/dev/null; then
  "$py" -m pip install -q -e '.[test]' || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$py" -c "import torch, specter; print('torch', torch.__version__, 'specter', specter.__version__)"
tests_rc=0
mapfile -t gpu_files < <(grep -rl "mark.gpu" tests --include='test_*.py' | sort)
timeout 150 "$py" -m pytest -q -m "gpu and not slow" -p no:cacheprovider -p no:logging -rs "${gpu_files[@]}" 2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
[ "$tests_rc" -eq 0 ] || echo "gpu tests: FAILED (rc=$tests_rc)"
timeout 90 "$py" scripts/gpu_bench.py --layers 8 --experts 8 --budget 0.25 --tokens 32 2>&1 | tee "$out/gpu_bench.log"
links='{"local": {"kind": "local"}, "cuda": {"kind": "cuda"}}'
timeout 130 "$py" -m specter.bench recipes/bench-proxy.yaml --set max_new_tokens=16 --repeats 1 --twins "" \
  --compile eager --links "$links" --out "$out/bench-eager" --no-plots 2>&1 | tee "$out/bench_eager.log"
timeout 130 "$py" -m specter.bench recipes/bench-proxy.yaml --set max_new_tokens=16 --repeats 1 --twins "" \
  --compile compiled --budgets 0.5 --k 4 --engines resident,ondemand,specter --links '{"cuda": {"kind": "cuda"}}' --out "$out/bench-compiled" \
  --no-plots 2>&1 | tee "$out/bench_compiled.log"
[ -z "${OUT:-}" ] || rm -f "$out"/bench-*/*.md  # the logs hold the same tables; at most 8 files come back from a device call
exit "$tests_rc"
