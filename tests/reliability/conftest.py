"""Fault-injecting plugins (links that stall, fail, corrupt or fill the wrong slot; predictors,
policies and governors that raise) and a helper that runs the CLI in-process."""

from __future__ import annotations

import threading

import pytest
import torch

from specter.decode.governors import FixedGovernor
from specter.hookspecs import hookimpl
from specter.memory.link import CompletedTransfer, Link, Transfer, copy_all, transfer_nbytes
from specter.plugins import register_plugin, reset_plugins
from specter.policies.lru import LRUPolicy
from specter.predictors.draft import DraftPredictor
from specter.run import main


class NeverTransfer(Transfer):
    """A copy that never completes (its ``wait`` honours the deadline it is given)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._never = threading.Event()

    def done(self) -> bool:
        return False

    def wait(self, timeout: float | None = None) -> float:
        from specter.memory.link import TransferTimeout

        if not self._never.wait(timeout if timeout is not None else 3600):
            raise TransferTimeout("never completes")
        return 0.0


class StallingLink(Link):
    kind = "test-stall"

    def submit(self, dst, src, slot) -> Transfer:
        return NeverTransfer(transfer_nbytes(src))


class BlindTransfer(Transfer):
    """Never completes, and its ``wait`` takes no timeout: the deadline must come from outside."""

    nbytes = 0

    def done(self) -> bool:
        return False

    def wait(self) -> float:  # deliberately without the timeout parameter
        threading.Event().wait()
        return 0.0


class BlindStallingLink(Link):
    kind = "test-stall-blind"

    def submit(self, dst, src, slot) -> Transfer:
        return BlindTransfer()


class SubmitFailsLink(Link):
    kind = "test-submit-fails"

    def submit(self, dst, src, slot) -> Transfer:
        raise OSError("device unplugged")


class FailedTransfer(CompletedTransfer):
    def wait(self, timeout: float | None = None) -> float:
        raise RuntimeError("DMA error")


class FlakyLink(Link):
    """The 3rd, 6th and 9th copies fail (raise from wait) without writing the slot."""

    kind = "test-flaky"

    def __init__(self) -> None:
        self.submitted = 0

    def submit(self, dst, src, slot) -> Transfer:
        self.submitted += 1
        if self.submitted in (3, 6, 9):
            return FailedTransfer(transfer_nbytes(src))
        copy_all(dst, src)
        return CompletedTransfer(transfer_nbytes(src))


class CorruptingLink(Link):
    """Says every copy is done; every 5th one leaves the slot holding garbage."""

    kind = "test-corrupt"

    def __init__(self) -> None:
        self.submitted = 0

    def submit(self, dst, src, slot) -> Transfer:
        self.submitted += 1
        copy_all(dst, src)
        if self.submitted % 5 == 0:
            for tensor in dst.values():
                tensor.mul_(-3.0).add_(1.0)
        return CompletedTransfer(transfer_nbytes(src))


class ExplodingPredictor(DraftPredictor):
    name = "test-explode"

    def observe(self, layer, hidden, top_k_index, top_k_weights, mode) -> None:
        raise RuntimeError("predictor bug")


class OutOfRangePredictor(DraftPredictor):
    name = "test-out-of-range"

    def observe(self, layer, hidden, top_k_index, top_k_weights, mode) -> None:
        self.scheduler.add(layer, [10_000], [1.0])


class ExplodingPolicy(LRUPolicy):
    name = "test-explode"

    def choose_victim(self, candidates):
        raise KeyError("policy bug")


class ExplodingGovernor(FixedGovernor):
    name = "test-explode"

    def observe(self, drafted: int, accepted: int, **timings: float) -> None:
        raise ZeroDivisionError("governor bug")


class Faults:
    @hookimpl
    def register_links(self, register):
        for link in (StallingLink, BlindStallingLink, SubmitFailsLink, FlakyLink, CorruptingLink):
            register(link.kind, link)

    @hookimpl
    def register_predictors(self, register):
        register("test-explode", ExplodingPredictor)
        register("test-out-of-range", OutOfRangePredictor)

    @hookimpl
    def register_cache_policies(self, register):
        register("test-explode", ExplodingPolicy)

    @hookimpl
    def register_governors(self, register):
        register("test-explode", ExplodingGovernor)


@pytest.fixture(autouse=True)
def fault_plugins(monkeypatch):
    monkeypatch.setenv("SPECTER_PLUGINS", "")
    reset_plugins()
    register_plugin(Faults())
    torch.set_num_threads(1)
    yield
    reset_plugins()


@pytest.fixture
def cli(capsys):
    """Run ``python -m specter.run`` in-process: (exit code, stdout, stderr lines)."""

    def run(*argv: str) -> tuple[int, str, list[str]]:
        code = main(list(argv))
        captured = capsys.readouterr()
        return code, captured.out, [line for line in captured.err.splitlines() if line.strip()]

    return run
