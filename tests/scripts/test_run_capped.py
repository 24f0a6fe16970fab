"""``scripts/run_capped.sh``: a bad LIMIT_MIB is refused before any cgroup is made (status 2, one
line); where this process may make memory cgroups (root, a writable v1 controller or v2 with memory
enabled), the command's own exit status comes back, a command over the cap is killed (137), and
the cgroup is removed either way."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "run_capped.sh"
GROUPS = ["/sys/fs/cgroup/memory/specter-cap-*", "/sys/fs/cgroup/specter-cap-*"]


def groups() -> set[str]:
    return {path for pattern in GROUPS for path in glob.glob(pattern)}


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def can_make_memory_cgroups() -> bool:
    if os.geteuid() != 0:
        return False
    if os.path.isdir("/sys/fs/cgroup/memory"):
        return os.access("/sys/fs/cgroup/memory", os.W_OK)
    try:
        return "memory" in Path("/sys/fs/cgroup/cgroup.controllers").read_text().split()
    except OSError:
        return False


@pytest.mark.parametrize("limit", ["abc", "0", "12x", "-5", ""])
def test_a_bad_limit_is_refused_before_any_cgroup_is_made(limit: str) -> None:
    before = groups()
    done = run(limit, "true")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"{SCRIPT}: LIMIT_MIB must be a whole number of MiB above 0, got '{limit}'"]
    assert groups() == before


def test_too_few_arguments_print_the_usage() -> None:
    done = run("100")
    assert done.returncode == 2 and done.stderr.startswith("usage: ")


@pytest.mark.skipif(not can_make_memory_cgroups(), reason="needs root and a writable memory cgroup")
def test_the_commands_status_comes_back_and_the_cgroup_goes() -> None:
    before = groups()
    done = run("200", "sh", "-c", "exit 7")
    assert done.returncode == 7
    assert done.stderr.strip().splitlines()[-1].startswith("run_capped: limit 200 MiB, peak ")
    over = run("40", sys.executable, "-c", "x = bytearray(200 << 20)")
    assert over.returncode == 137, over.stderr
    assert groups() == before
