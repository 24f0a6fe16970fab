"""``specter.interrupts``: Ctrl-C held across a block and let through at its end; the CLI's exit
status 130 made final."""

from __future__ import annotations

import signal
import threading

import pytest

from specter import run
from specter.interrupts import deferred


def test_an_interrupt_inside_the_block_is_raised_at_its_end_not_inside():
    reached_the_end = False
    with pytest.raises(KeyboardInterrupt):
        with deferred():
            # to this thread: other threads of the test process (copy threads, torch's) would take a
            # process-wide one; the CLIs enter the block before they start any
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            for _ in range(1000):  # bytecode boundaries where a pending KeyboardInterrupt would be raised
                pass
            reached_the_end = True
    assert reached_the_end
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # let through again


def test_a_block_without_an_interrupt_leaves_the_signal_mask_as_it_was():
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    with deferred():
        assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before


def test_the_cli_ends_an_interrupted_run_itself_with_130(monkeypatch):
    ended = []
    monkeypatch.setattr(run, "main", lambda: 130)
    monkeypatch.setattr("specter.interrupts.exit_interrupted", lambda code=130: ended.append(code))
    run.entry_point()
    assert ended == [130]
    monkeypatch.setattr(run, "main", lambda: 0)
    assert run.entry_point() == 0 and ended == [130]
