#!/usr/bin/env bash
# GPU checks and timings in one call, for a machine with one NVIDIA GPU (the whole run fits
# DEVICE_CHECK_BUDGET_S, default 510 s: each stage's time limit is cut to what is left of it):
#   1. the GPU-marked tests but the slow ones (every engine eager and compiled on the cuda link, the
#      cuda cache and link, INT4 tinygemm; every other layout compiled on CUDA is `gpu and slow`, run
#      apart: pytest -m "gpu and slow" tests/test_cuda_engines.py), 2. pinned host-to-device bandwidth
#      and resident vs ondemand on a Mixtral-shaped random-weight model (8 layers x 8 experts of
#      4096x14336, bf16, budget 25%),
#   3. every engine side by side on the widened bundled model (python -m specter.bench): resident,
#      ondemand, ondemand@same-memory, router-lookahead, specter and hf-offload eager on the local
#      and cuda links at 25% and 50%; resident, ondemand and specter compiled on the cuda link at 50%.
# Exit status: the GPU tests' pytest status when they fail (124: timed out; the timings still run
# after them); else 1 when a timing stage failed, timed out or was skipped for lack of time; 2, at
# once and with nothing installed, when no torch here sees a CUDA device. The last lines printed
# are a summary, one line a stage. Logs and bench JSON (7 files) go to $OUT when it is set, else
# reports/device-check/.
# Python: $PYTHON if set (it must see the GPU), else a python3 whose torch sees a GPU, else
# .venv/bin/python if its torch does, else (only where nvidia-smi finds a GPU and there is no .venv
# yet) a new .venv with torch from PyPI.
# Offline machines: wheels for missing packages in .whl/ are installed into /tmp/site first
# (e.g. torchao; see the note under README's "Tests").
set -uo pipefail
cd "$(dirname "$0")/.."
budget_s="${DEVICE_CHECK_BUDGET_S:-510}"
min_stage_s=10  # a stage with less time than this left is skipped (and counts as failed)
case "$budget_s" in
  ''|*[!0-9]*) echo "device_check.sh: DEVICE_CHECK_BUDGET_S must be whole seconds, got '$budget_s'" >&2; exit 2 ;;
esac
die() { echo "device_check.sh: $*" >&2; exit 2; }
has_cuda() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
py="${PYTHON:-python3}"
if ! has_cuda "$py"; then
  if [ -n "${PYTHON:-}" ]; then
    die "PYTHON=$PYTHON: its torch sees no CUDA device (or does not import); this script is for a machine with an NVIDIA GPU"
  elif [ -x .venv/bin/python ] && has_cuda .venv/bin/python; then
    py=.venv/bin/python
  elif ! nvidia-smi -L > /dev/null 2>&1; then
    die "no NVIDIA GPU here (nvidia-smi finds none) and no torch that sees one; this script is for a machine with an NVIDIA GPU (CPU tests: pytest)"
  elif [ -e .venv ]; then
    die "neither python3's nor .venv's torch sees the GPU; set PYTHON to a python whose torch does"
  else
    python3 -m venv .venv --system-site-packages && timeout 300 .venv/bin/pip install -q torch || die "could not install torch into .venv"
    has_cuda .venv/bin/python || die ".venv's new torch sees no CUDA device"
    py=.venv/bin/python
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-reports/device-check}"
mkdir -p "$out" || die "cannot create $out"
if ! "$py" -c "import specter, torchao, pluggy, hypothesis, transformers, accelerate, yaml" 2>/dev/null; then
  timeout 120 "$py" -m pip install -q -e '.[test]' || die "$py lacks Specter's dependencies and pip could not install them (offline: carry wheels in .whl/)"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$py" -c "import torch, specter; print('torch', torch.__version__, 'specter', specter.__version__)"

summary=()
timings_failed=0
# stage NAME LIMIT_S LOG COMMAND...: runs COMMAND under the smaller of LIMIT_S and what is left of
# the budget, its output to the terminal and LOG; sets stage_rc (124: timed out or skipped).
stage() {
  local name=$1 limit=$2 log=$3 left
  shift 3
  left=$((budget_s - SECONDS))
  [ "$left" -ge "$limit" ] || limit=$left
  if [ "$limit" -lt "$min_stage_s" ]; then
    echo "$name: skipped, ${left}s of the ${budget_s}s budget left" | tee "$log"
    stage_rc=124
    summary+=("$(printf '%-18s SKIPPED (out of time)' "$name")")
    return
  fi
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$log"
  stage_rc=${PIPESTATUS[0]}  # the command's status, not tee's
  local said="ok"
  if [ "$stage_rc" -eq 124 ] || [ "$stage_rc" -eq 137 ]; then said="TIMED OUT after ${limit}s (rc=$stage_rc)"
  elif [ "$stage_rc" -ne 0 ]; then said="FAILED (rc=$stage_rc)"; fi
  summary+=("$(printf '%-18s %s' "$name" "$said")")
}

mapfile -t gpu_files < <(grep -rl "mark.gpu" tests --include='test_*.py' | sort)
if [ "${#gpu_files[@]}" -eq 0 ]; then
  echo "no test file under tests/ holds a GPU mark" | tee "$out/gpu_tests.log"
  tests_rc=5
  summary+=("$(printf '%-18s FAILED (no GPU test files)' "gpu tests")")
else
  stage "gpu tests" 150 "$out/gpu_tests.log" \
    "$py" -m pytest -q -m "gpu and not slow" -p no:cacheprovider -p no:logging -rs "${gpu_files[@]}"
  tests_rc=$stage_rc
  [ "$tests_rc" -eq 0 ] || echo "gpu tests: FAILED (rc=$tests_rc)"
fi
stage "gpu_bench" 90 "$out/gpu_bench.log" \
  "$py" scripts/gpu_bench.py --layers 8 --experts 8 --budget 0.25 --tokens 32 --json "$out/gpu_bench.json"
[ "$stage_rc" -eq 0 ] || timings_failed=1
links='{"local": {"kind": "local"}, "cuda": {"kind": "cuda"}}'
stage "bench eager" 150 "$out/bench_eager.log" \
  "$py" -m specter.bench recipes/bench-proxy.yaml --set max_new_tokens=16 --repeats 1 --twins "" \
  --compile eager --engines resident,ondemand,ondemand@same-memory,router-lookahead,specter,hf-offload \
  --links "$links" --out "$out/bench-eager" --no-plots
[ "$stage_rc" -eq 0 ] || timings_failed=1
stage "bench compiled" 130 "$out/bench_compiled.log" \
  "$py" -m specter.bench recipes/bench-proxy.yaml --set max_new_tokens=16 --repeats 1 --twins "" \
  --compile compiled --budgets 0.5 --k 4 --engines resident,ondemand,specter --links '{"cuda": {"kind": "cuda"}}' \
  --out "$out/bench-compiled" --no-plots
[ "$stage_rc" -eq 0 ] || timings_failed=1
[ -z "${OUT:-}" ] || rm -f "$out"/bench-*/*.md  # the logs hold the same tables; at most 8 files come back from a device call

echo "== device_check: ${SECONDS}s of a ${budget_s}s budget; logs and JSON in $out =="
printf '%s\n' "${summary[@]}"
[ "$tests_rc" -eq 0 ] || exit "$tests_rc"
exit "$timings_failed"
