"""``scripts/device_check.sh`` without a GPU: the script runs from a scratch copy of the repository
with ``PYTHON`` set to a fake interpreter (a shell script) that answers the CUDA check as told and
exits each stage (pytest, gpu_bench.py, the two benches) with the status the test gives it. So the
exit status (a failing ``pytest | tee`` must not read as a pass), the engines each stage times, where
the figures go and the time budget are checked on a CPU; a machine without a GPU is refused at once,
with nothing installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$1" in
  -c) case "$2" in *cuda.is_available*) exit "${FAKE_CUDA_RC:-0}" ;; esac; echo "fake $2"; exit 0 ;;
  -m) case "$2" in
        pytest) echo "1 failed, 14 passed"; exit "${FAKE_PYTEST_RC:-0}" ;;
        specter.bench) exit "${FAKE_BENCH_RC:-0}" ;;
      esac ;;
  scripts/gpu_bench.py) sleep "${FAKE_GPU_BENCH_SLEEP:-0}"; exit "${FAKE_GPU_BENCH_RC:-0}" ;;
esac
exit 0
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A scratch repository root: the script, one test file with a GPU mark, a fake nvidia-smi."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "device_check.sh", root / "scripts")
    (root / "tests").mkdir()
    (root / "tests" / "test_gpu.py").write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_x():\n    pass\n")
    fake = root / "fakepy"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho fake-gpu\n")
    smi.chmod(0o755)
    return root


def run(repo: Path, timeout: float = 60, with_smi: bool = True, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    log = repo / "fake.log"
    path = os.environ["PATH"]
    environment = {**os.environ, "PYTHON": str(repo / "fakepy"), "FAKE_LOG": str(log), "OUT": str(repo / "out"),
                   "PATH": f"{repo.parent / 'bin'}:{path}" if with_smi else path, **env}
    done = subprocess.run(["bash", str(repo / "scripts" / "device_check.sh")], env=environment, cwd=repo,
                          capture_output=True, text=True, timeout=timeout)
    return done, log.read_text().splitlines() if log.exists() else []


def test_every_stage_passing_exits_0_and_times_every_engine(repo: Path) -> None:
    done, calls = run(repo)
    assert done.returncode == 0, done.stdout + done.stderr
    pytest_call = next(call for call in calls if call.startswith("-m pytest"))
    assert "-m gpu and not slow" in pytest_call and "tests/test_gpu.py" in pytest_call
    gpu_bench = next(call for call in calls if call.startswith("scripts/gpu_bench.py"))
    assert f"--json {repo / 'out' / 'gpu_bench.json'}" in gpu_bench  # the figures land where they come back
    eager, compiled = [call for call in calls if call.startswith("-m specter.bench")]
    assert "--compile eager" in eager and '"cuda": {"kind": "cuda"}' in eager
    engines = eager.split("--engines ")[1].split()[0].split(",")
    assert {"resident", "ondemand", "router-lookahead", "specter", "hf-offload"} <= set(engines)
    assert "--compile compiled" in compiled and f"--out {repo / 'out' / 'bench-compiled'}" in compiled
    for log in ("gpu_tests.log", "gpu_bench.log", "bench_eager.log", "bench_compiled.log"):
        assert (repo / "out" / log).exists()
    summary = done.stdout[done.stdout.index("== device_check"):].splitlines()[1:]
    assert [line.split()[-1] for line in summary] == ["ok"] * 4


def test_failing_gpu_tests_fail_the_script_after_the_timings(repo: Path) -> None:
    done, calls = run(repo, FAKE_PYTEST_RC="1")
    assert done.returncode == 1  # pytest's status, not tee's
    assert sum(call.startswith("-m specter.bench") for call in calls) == 2  # the timings still ran
    assert "gpu tests          FAILED (rc=1)" in done.stdout
    assert "1 failed, 14 passed" in (repo / "out" / "gpu_tests.log").read_text()


def test_a_failing_timing_stage_fails_the_script(repo: Path) -> None:
    done, _ = run(repo, FAKE_GPU_BENCH_RC="1")
    assert done.returncode == 1
    assert "gpu_bench          FAILED (rc=1)" in done.stdout
    done, _ = run(repo, FAKE_BENCH_RC="3")
    assert done.returncode == 1
    assert "bench compiled     FAILED (rc=3)" in done.stdout


def test_a_budget_too_small_for_any_stage_skips_them_all_and_fails(repo: Path) -> None:
    done, calls = run(repo, DEVICE_CHECK_BUDGET_S="5")
    assert done.returncode == 124  # the GPU tests did not run: not a pass
    assert "gpu tests          SKIPPED (out of time)" in done.stdout
    assert not any(call.startswith(("-m pytest", "scripts/gpu_bench.py", "-m specter.bench")) for call in calls)


@pytest.mark.slow
def test_stages_are_cut_to_the_budget_and_skipped_when_it_is_spent(repo: Path) -> None:
    started = time.monotonic()
    done, calls = run(repo, DEVICE_CHECK_BUDGET_S="12", FAKE_GPU_BENCH_SLEEP="60")
    assert time.monotonic() - started < 30  # gpu_bench.py killed at the budget, not at its own 90 s
    assert done.returncode == 1
    assert "gpu_bench          TIMED OUT" in done.stdout
    assert "bench eager        SKIPPED (out of time)" in done.stdout
    assert not any(call.startswith("-m specter.bench") for call in calls)


def test_a_python_that_sees_no_gpu_is_refused_at_once(repo: Path) -> None:
    done, calls = run(repo, FAKE_CUDA_RC="1")
    assert done.returncode == 2
    assert "its torch sees no CUDA device" in done.stderr
    assert not any("pytest" in call or "pip" in call for call in calls)
    assert not (repo / "out").exists() and not (repo / ".venv").exists()


def test_a_machine_without_a_gpu_installs_nothing(repo: Path) -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi (the script would install torch into the scratch .venv)")
    environment = {key: value for key, value in os.environ.items() if key != "PYTHON"}
    # no fake nvidia-smi; python3 is the system's (its torch, if any, sees no GPU here)
    done = subprocess.run(["bash", str(repo / "scripts" / "device_check.sh")], env={**environment, "OUT": str(repo / "out")},
                          cwd=repo, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no NVIDIA GPU here" in done.stderr, done.stderr
    assert not (repo / ".venv").exists()
