"""Third-party noise kept off the terminal: only the lines Specter means to drop are dropped."""

from __future__ import annotations

import logging

import pytest

from specter.quiet import verbose


@pytest.mark.skipif(verbose(), reason="SPECTER_VERBOSE shows everything")
def test_accelerates_offload_notice_is_dropped_and_its_other_warnings_are_not(caplog):
    # importing specter (above, for specter.quiet) installed the filter
    logger = logging.getLogger("accelerate.big_modeling")
    with caplog.at_level(logging.WARNING):
        logger.warning("Some parameters are on the meta device because they were offloaded to the disk.")
        logger.warning("another accelerate warning")
    assert [record.getMessage() for record in caplog.records] == ["another accelerate warning"]
