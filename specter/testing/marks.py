"""Pytest marks shared by the test suite (this module imports pytest: tests only).

``needs_native``: skip a test where Specter's native CPU kernels are not available, saying why
(``specter.native.unavailable_reason``; checking builds them on first use).
"""

from __future__ import annotations

import pytest

from specter import native

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")
