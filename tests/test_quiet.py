"""Third-party noise kept off the terminal: only the lines Specter means to drop are dropped."""

from __future__ import annotations

import logging

import pytest

from specter.quiet import verbose


@pytest.mark.skipif(verbose(), reason="SPECTER_VERBOSE shows everything")
def test_accelerates_offload_notice_is_dropped_and_its_other_warnings_are_not():
    # importing specter (above, for specter.quiet) installed the filter on accelerate's logger
    logger = logging.getLogger("accelerate.big_modeling")

    def record(message: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 0, message, None, None)

    assert not logger.filter(record("Some parameters are on the meta device because they were offloaded to the disk."))
    assert logger.filter(record("another accelerate warning"))


def test_verbose_lets_the_offload_notice_through_again(monkeypatch):
    from specter.quiet import VERBOSE_ENV, quiet_third_party, unquiet

    monkeypatch.setenv(VERBOSE_ENV, "")  # restored after the test, whatever unquiet sets
    logger = logging.getLogger("accelerate.big_modeling")
    notice = logger.makeRecord(logger.name, logging.WARNING, __file__, 0,
                               "Some parameters are on the meta device because they were offloaded to the disk.",
                               None, None)
    try:
        unquiet()
        assert logger.filter(notice)
    finally:
        monkeypatch.setenv(VERBOSE_ENV, "")
        quiet_third_party()  # the rest of the suite runs quiet, as it started
    assert not logger.filter(notice)


def test_a_specter_warning_prints_on_one_line_in_the_clis_and_others_as_python_prints_them(monkeypatch):
    import warnings

    from specter.plugins import PluginLoadWarning
    from specter.quiet import one_line_warnings

    monkeypatch.delenv("SPECTER_VERBOSE", raising=False)
    monkeypatch.setattr(warnings, "formatwarning", getattr(warnings.formatwarning, "plain", warnings.formatwarning))
    plain = warnings.formatwarning
    one_line_warnings()
    one_line_warnings()  # once installed, not wrapped twice
    assert warnings.formatwarning("skipped plugin x", PluginLoadWarning, "/elsewhere/p.py", 3) == "warning: skipped plugin x\n"
    import specter.memory.copy_repair as ours

    assert warnings.formatwarning("reloaded", RuntimeWarning, ours.__file__, 40) == "warning: reloaded\n"
    theirs = warnings.formatwarning("deprecated", DeprecationWarning, "/site-packages/lib.py", 7)
    assert theirs == plain("deprecated", DeprecationWarning, "/site-packages/lib.py", 7) and "lib.py:7" in theirs


def test_verbose_keeps_pythons_own_warning_format(monkeypatch):
    import warnings

    from specter.plugins import PluginLoadWarning
    from specter.quiet import one_line_warnings

    monkeypatch.setattr(warnings, "formatwarning", getattr(warnings.formatwarning, "plain", warnings.formatwarning))
    monkeypatch.delenv("SPECTER_VERBOSE", raising=False)
    one_line_warnings()  # an earlier CLI call in the same process, without --verbose
    monkeypatch.setenv("SPECTER_VERBOSE", "1")
    one_line_warnings()
    assert "PluginLoadWarning" in warnings.formatwarning("skipped plugin x", PluginLoadWarning, "/elsewhere/p.py", 3)
