"""Every script in scripts/ runs its ``main`` end to end with small arguments (a smoke run: each
exits 0 and prints its table), so an op, module or option it depends on cannot go away unnoticed.
Slow (about a minute in all): ``pytest -m slow tests/scripts``. ``gpu_bench.py`` needs CUDA and is
run by ``scripts/device_check.sh``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specter import native

ROOT = Path(__file__).resolve().parents[2]
NATIVE = {"blocked_rows_bench.py", "fresh_expert_reads.py", "wave_bookkeeping.py"}  # call specter_native ops directly
RUNS = {
    "acceptance_estimate_sim.py": [],
    "bench_expert_kernel.py": ["--slots", "4", "--hidden", "64", "--inter", "256"],
    "blocked_rows_bench.py": ["--experts", "2", "--hidden", "64", "--inter", "128", "--rows", "1,3", "--calls", "4"],
    "cache_replay.py": ["--slots", "8", "--widths", "1,2"],
    "copy_contention.py": ["--expert-mib", "1", "--repeats", "1"],
    "draft_step_parts.py": [],
    "fresh_expert_reads.py": ["--rows", "1", "--repeats", "1"],
    "governor_noise_sim.py": ["--rounds", "60", "--seeds", "2"],
    "int4_kernels.py": ["--shapes", "bundled", "--weights", "4"],
    "memory_placement.py": ["--buffers", "2", "--mib", "16", "--repeats", "2"],
    "round_parts.py": ["recipes/bench-bundled.yaml", "--budget", "0.5", "--link", "fast", "--k", "2", "--repeats", "1"],
    "verify_beside_copies.py": ["recipes/bench-bundled.yaml", "--budget", "0.5", "--k", "2", "--repeats", "1"],
    "wave_bookkeeping.py": ["--repeats", "12"],
}


def test_every_script_but_the_gpu_one_has_a_smoke_run() -> None:
    scripts = {path.name for path in (ROOT / "scripts").glob("*.py")}
    assert scripts - set(RUNS) == {"gpu_bench.py"}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(RUNS))
def test_the_script_runs_to_the_end(script: str) -> None:
    if script in NATIVE and not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *RUNS[script]], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{script} failed:\n{done.stderr[-2000:]}"
    assert done.stdout.strip(), f"{script} printed nothing"
