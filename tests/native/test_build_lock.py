"""The native extension's build lock: a killed process's old lock is removed, a fresh one kept."""

from __future__ import annotations

import os

from specter.native import STALE_LOCK_S, clear_stale_build_lock


def test_an_old_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, caplog):
    lock = tmp_path / "lock"
    lock.touch()
    made = lock.stat().st_mtime
    assert not clear_stale_build_lock(tmp_path, now=made + 10)  # another process may be building
    assert lock.exists() and "waiting for another process" in caplog.text
    os.utime(lock, (made - STALE_LOCK_S - 1, made - STALE_LOCK_S - 1))
    assert clear_stale_build_lock(tmp_path, now=made)
    assert not lock.exists() and "stale build lock" in caplog.text
    assert not clear_stale_build_lock(tmp_path)  # no lock: nothing to do
