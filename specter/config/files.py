"""Files a recipe names: ``_find`` looks a relative path up in the current directory, then in the
recipe's directory; ``_read_prompts`` reads a prompts file (.jsonl with a "prompt" field per line,
or any other file as one prompt), with one-line errors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from specter.config.schema import _error, _plain

def _find(path_text: str, base_dir: Path | None, predicate: Callable[[Path], bool]) -> Path | None:
    """First of ``path`` (cwd-relative) and ``base_dir / path`` satisfying ``predicate``."""
    try:
        path = Path(os.path.expanduser(path_text))
        candidates = [path] if path.is_absolute() else [Path.cwd() / path]
        if base_dir is not None and not path.is_absolute():
            candidates.append(base_dir / path)
        for candidate in candidates:
            if predicate(candidate):
                return candidate
    except (OSError, ValueError):
        return None
    return None


def _read_prompts(path: Path) -> list[str]:
    return read_texts(path, "prompts_file", ("prompt",))


def read_texts(path: Path, key: str, fields: tuple[str, ...]) -> list[str]:
    """The texts of a prompts/texts file: a ``.jsonl`` file gives one per line (the first of
    ``fields`` each JSON object has, a non-empty string), any other file is one text. Errors are
    ``RecipeError`` lines starting with ``key``."""
    wanted = " or ".join(f'"{name}"' for name in fields)
    allowed = f"allowed: one JSON object per line with a non-empty string {wanted} field"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _error(key, f"cannot read {_plain(str(path))}: {exc}") from None
    if path.suffix.lower() != ".jsonl":
        if not text:
            raise _error(key, f"{_plain(str(path))} is empty; allowed: a non-empty text file")
        return [text]
    texts = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{_plain(str(path))}:{line_number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _error(key, f"{where}: invalid JSON ({exc.msg}); {allowed}") from None
        value = next((item[name] for name in fields if name in item), None) if isinstance(item, dict) else None
        if not isinstance(value, str) or not value:
            raise _error(key, f"{where}: no string {wanted} field; {allowed}")
        texts.append(value)
    if not texts:
        raise _error(key, f"{_plain(str(path))} holds no texts; {allowed}")
    return texts
