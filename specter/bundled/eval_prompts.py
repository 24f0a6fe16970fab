"""Build the repository's evaluation prompts from the standard library's test files.

Contract: ``python -m specter.bundled.eval_prompts --out recipes/prompts/eval.jsonl`` writes N
prompts (JSONL, one ``{"prompt": ..., "source": "test/FILE.py:LINE"}`` per line), each the
first few lines of a ``def test_...`` method, taken deterministically from the stdlib's
``test/`` folder — text the bundled model never saw in training (its corpus leaves ``test/`` out,
and its held-out loss uses the first files of ``test/``, which these prompts skip).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specter.bundled.train import TrainConfig, heldout_files, read_text, stdlib_root


def select_prompts(count: int = 16, lines: int = 4, max_chars: int = 240) -> list[dict]:
    files = heldout_files()
    held = 0
    first_unseen = len(files)  # every file held out unless the bytes run past the threshold first
    for index, path in enumerate(files):
        held += len(read_text(path).encode())
        if held >= TrainConfig.heldout_bytes:
            first_unseen = index + 1
            break
    candidates = files[first_unseen:]
    stride = max(1, len(candidates) // (count * 2))
    prompts: list[dict] = []
    root = stdlib_root()
    for path in candidates[::stride]:
        text_lines = read_text(path).splitlines()
        for number, line in enumerate(text_lines):
            if line.startswith("    def test_") and line.rstrip().endswith(":"):
                snippet = "\n".join(text_lines[number : number + lines]) + "\n"
                if len(snippet) <= max_chars and snippet.count("\n") == lines:
                    prompts.append({"prompt": snippet, "source": f"{path.relative_to(root)}:{number + 1}"})
                    break
        if len(prompts) == count:
            break
    return prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=16)
    args = parser.parse_args(argv)
    prompts = select_prompts(args.count)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"wrote {len(prompts)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
