"""Which transformers Specter runs with, checked before a model is built or offloaded.

Contract: ``require_supported_transformers(version=None)`` returns silently for transformers
>= ``MIN_TRANSFORMERS`` (below 6) and raises ``SpecterError`` naming the installed version and
the fix otherwise. Why a check and not only the pip pin: a machine image can put an older
transformers on the path (an H200 image had 5.17), and there the engines do not fail, they
decode wrongly: before 5.24 a model takes its KV cache as ``past_key_values``, the ``cache``
keyword Specter passes is swallowed, and every step after the prompt runs without its past
(measured: 5.23 and 5.17 gave [175, 0, 0, ...] where 5.24 and transformers' own ``generate``
gave [175, 15, 126, ...]); sliding-window caches also changed shape (GPT-OSS).
"""

from __future__ import annotations

import re

from specter.errors import SpecterError

MIN_TRANSFORMERS = (5, 24)
BELOW = (6, 0)


def _release(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise SpecterError(f"transformers reports an unreadable version {version!r}")
    return int(match.group(1)), int(match.group(2))


def require_supported_transformers(version: str | None = None) -> None:
    if version is None:
        import transformers

        version = transformers.__version__
    if not MIN_TRANSFORMERS <= _release(version) < BELOW:
        wanted = f"transformers>={'.'.join(map(str, MIN_TRANSFORMERS))},<{BELOW[0]}"
        raise SpecterError(f"transformers {version} is installed; Specter needs {wanted} "
                           f"(older releases take the KV cache under another name and would decode wrongly): "
                           f"pip install '{wanted}'")
