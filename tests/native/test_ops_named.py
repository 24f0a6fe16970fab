"""Every ``torch.ops.specter_native.<op>`` the package and its scripts name is an op the built
extension defines: a renamed or removed op fails here, not in a script run by hand months later."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from specter.testing.marks import needs_native

ROOT = Path(__file__).resolve().parents[2]
OP_NAME = re.compile(r"torch\.ops\.specter_native\.(\w+)")


def named_ops() -> dict[str, list[str]]:
    """Op name -> the files (relative to the repository) that call it."""
    found: dict[str, list[str]] = {}
    for path in sorted([*(ROOT / "specter").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]):
        for name in set(OP_NAME.findall(path.read_text())):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


@needs_native
def test_every_native_op_the_code_names_is_defined() -> None:
    found = named_ops()
    assert "glu_expert_pairs" in found and "grouped_rows" in found  # the scan sees the calls
    missing = {name: files for name, files in found.items() if not hasattr(torch.ops.specter_native, name)}
    assert not missing, f"ops named but not defined by the extension: {missing}"
