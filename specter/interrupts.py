"""Ctrl-C in the command-line tools: held across imports, and exit status 130 whatever CPython
decides at shutdown.

Contract:
- ``deferred()``: a context manager that holds SIGINT (blocked in the main thread, pending) for
  its block and lets it through at the end, where Python raises ``KeyboardInterrupt`` as usual.
  The block is the main thread's: Ctrl-C (sent to the process) waits only where no other thread
  leaves SIGINT open, as at a CLI's start (threads started inside the block inherit the hold).
  For the heavy imports (torch, transformers, numpy): an interrupt in the middle of one leaves a
  module half-initialised in ``sys.modules``, and its next use fails with an unrelated error
  (numpy's ``__getattr__`` recursing until ``RecursionError``: exit 1 and a long traceback, seen
  in 2 of 25 interrupts 0.3-4 s after start). Outside the main thread, or where the platform has
  no ``pthread_sigmask``, it does nothing.
- ``exit_status(code) -> int``: a CLI's exit status on its way out: ``code`` itself, except an
  interrupted run's 130, for which ``exit_interrupted(130)`` runs. ``exit_interrupted(code=130)``:
  flushes stdout and stderr and ends the process with ``code`` at once. CPython ends a process
  whose ``KeyboardInterrupt`` it judged unhandled by SIGINT itself at shutdown, whatever status
  the program gave; an interrupt that passed through code an extension ran with ``PyRun_*`` is
  judged so although the CLI caught it (status -2 in 2 of 25 interrupts during the model load).
  Call it only where nothing remains to be done but exiting.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def exit_interrupted(code: int = 130) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def exit_status(code: int) -> int:
    if code == 130:
        exit_interrupted(code)  # CPython could still end the process by SIGINT (status -2)
    return code
