"""Soak (marked slow: ``pytest -m slow tests/reliability``): 4,000 tokens through the emulated
link and the speculative engine with flat memory and a clean thread exit; Ctrl-C ends a run
within 5 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

import specter

pytestmark = pytest.mark.slow


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_four_thousand_tokens_with_flat_memory_and_a_clean_thread_exit(tiny_mixtral):
    threads_before = threading.active_count()
    engine = specter.load({"model": str(tiny_mixtral), "engine": "specter", "threads": 1,
                           "offload": {"expert_budget": 0.25, "link": {"kind": "emulated", "gbps": 20}},
                           "speculation": {"governor": {"name": "roofline"}}})
    prompt = [[1, 17, 93, 4, 250, 31, 8, 66, 140, 7]]
    engine.generate(prompt, max_new_tokens=500)
    settled = rss_mib()
    result = engine.generate(prompt, max_new_tokens=4000)
    grown = rss_mib() - settled
    engine.close()
    print(f"soak: {len(result.token_ids[0])} tokens, resident memory grew {grown:.1f} MiB, "
          f"{result.report['decode_tokens_per_s']:.1f} tok/s")
    assert len(result.token_ids[0]) == 4000 or engine.eos_token_id in result.token_ids[0]
    assert grown < 64, f"resident memory grew {grown:.0f} MiB over 4,000 tokens"
    assert threading.active_count() == threads_before


def test_ctrl_c_ends_a_run_within_five_seconds(tiny_mixtral, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": str(tiny_mixtral), "engine": "specter", "threads": 1,
                                    "max_new_tokens": 4000, "prompt": "def f(x):",
                                    "offload": {"link": {"kind": "emulated", "gbps": 1}}}))
    # SIGINT at its default in the child: a shell's background job ignores it, and Python keeps an
    # inherited ignore (so the run would decode on to its end, exit 0)
    process = subprocess.Popen([sys.executable, "-m", "specter.run", str(path)], stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in process.stderr:  # wait until decoding runs
        if "prompt 1/1: 16/" in line:
            break
    started = time.perf_counter()
    process.send_signal(signal.SIGINT)
    code = process.wait(timeout=10)
    print(f"SIGINT: exit {code} after {time.perf_counter() - started:.2f} s")
    assert time.perf_counter() - started < 5
    assert code == 130
