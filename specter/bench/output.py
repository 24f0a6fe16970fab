"""Where a bench's files go, and how a bench document read back is checked.

Contract:
- ``out_dir_argument(text) -> Path``: an ``--out`` value (argparse ``type``); an empty one is
  refused (``Path("")`` is the current folder: the files would land there unasked).
- ``prepare_out_dir(path) -> Path | None``: creates the folder ``path`` (and its parents) and
  checks a file can be written in it; returns the top-most folder this call created (None when
  ``path`` was there). Else raises ``SpecterError("--out: cannot write to PATH: why")``.
- ``drop_if_empty(path, top)``: removes the folder ``path``, then its parents up to ``top`` (what
  ``prepare_out_dir`` returned; nothing when None), while each is empty: an interrupted bench
  writes nothing until every cell has run. Never raises.
- ``write_atomic(path, text)``: writes ``text`` to a temporary file beside ``path`` and renames it
  over ``path``, so an interrupt never leaves half a file where an earlier run's whole one was.
- ``earlier_plots(out_dir, stem) -> list[Path]``: the figures ``plots.plot_all`` would write
  for ``stem`` that exist in ``out_dir`` (a ``--no-plots`` run warns that they are not its own).
- ``document_problem(bench) -> str | None``: why ``bench`` (a JSON document read back) cannot be
  drawn or tabled as ``specter.bench/2``: not a mapping, another schema, or a field of the wrong
  type (``rows[3].decode_tokens_per_s: expected a mapping or null, got int``); None when it can.
  Only the shapes the readers rely on are checked (mappings, lists, numbers, strings), not values.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import tempfile
from collections.abc import Mapping
from numbers import Real
from pathlib import Path

from specter.bench.plots import FIGURES, SCHEMA  # matplotlib itself is imported only when a figure is drawn
from specter.errors import SpecterError

_ROW_MAPPINGS = ("decode_tokens_per_s", "ratios", "k_histogram", "phases", "governor_summary", "prefetch",
                 "link_stats", "offload")
_ROW_NUMBERS = ("hit_rate", "io_wait_share", "copies_per_token", "acceptance_rate", "k", "k_mean",
                "device_bytes_total", "decode_step_s", "single_step_s", "memory_read_gibps")
_ROW_STRINGS = ("label", "engine", "link", "governor", "note", "twin_of")
_TOP_MAPPINGS = ("model", "machine", "links", "page_placement")
_TOP_NUMBERS = ("wall_s", "peak_rss_bytes", "threads", "prompts", "max_new_tokens", "repeats")
_MODEL_NUMBERS = ("n_moe_layers", "n_experts", "top_k", "expert_bytes")


def out_dir_argument(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a folder, got an empty path")
    return Path(text)


def prepare_out_dir(path: Path) -> Path | None:
    created = next((folder for folder in reversed([path, *path.parents]) if not folder.exists()), None)
    try:
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "it is a file, not a folder")
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise SpecterError(f"--out: cannot write to {path}: {error.strerror or error}") from None
    return created


def drop_if_empty(path: Path, top: Path | None) -> None:
    if top is None:
        return
    for folder in [path, *path.parents]:
        try:
            folder.rmdir()  # only an empty folder goes
        except OSError:
            return
        if folder == top:
            return


def write_atomic(path: Path, text: str) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def earlier_plots(out_dir: Path, stem: str) -> list[Path]:
    return [path for name in FIGURES if (path := out_dir / f"{stem}-{name}.png").is_file()]


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _expect(where: str, value: object, kind: str) -> str | None:
    ok = {"mapping": isinstance(value, Mapping), "list": isinstance(value, list), "string": isinstance(value, str),
          "number": isinstance(value, Real) and not isinstance(value, bool)}[kind]
    return None if value is None or ok else f"{where}: expected a {kind} or null, got {_kind(value)}"


def document_problem(bench: object) -> str | None:
    if not isinstance(bench, Mapping):
        return f"not a {SCHEMA} document (found {_kind(bench)!r})"
    if bench.get("schema") != SCHEMA:
        return f"not a {SCHEMA} document (found {bench.get('schema')!r})"
    checks = [_expect(key, bench.get(key), "mapping") for key in _TOP_MAPPINGS]
    checks += [_expect(key, bench.get(key), "number") for key in _TOP_NUMBERS]
    checks += [_expect("budgets", bench.get("budgets"), "list"), _expect("rows", bench.get("rows"), "list")]
    model = _mapping(bench.get("model"))
    checks += [_expect(f"model.{key}", model.get(key), "number") for key in _MODEL_NUMBERS]
    checks += [_expect(f"links.{name}", link, "mapping") for name, link in _mapping(bench.get("links")).items()]
    for i, row in enumerate(bench.get("rows") if isinstance(bench.get("rows"), list) else []):
        if not isinstance(row, Mapping):
            checks.append(f"rows[{i}]: expected a mapping, got {_kind(row)}")
            continue
        checks += [_expect(f"rows[{i}].{key}", row.get(key), "mapping") for key in _ROW_MAPPINGS]
        checks += [_expect(f"rows[{i}].{key}", row.get(key), "number") for key in _ROW_NUMBERS]
        checks += [_expect(f"rows[{i}].{key}", row.get(key), "string") for key in _ROW_STRINGS]
        tokens = _mapping(row.get("decode_tokens_per_s"))
        checks += [_expect(f"rows[{i}].decode_tokens_per_s.{key}", tokens.get(key), "number")
                   for key in ("median", "min", "max")]
        checks.append(_expect(f"rows[{i}].decode_tokens_per_s.runs", tokens.get("runs"), "list"))
        checks += _numbers(f"rows[{i}].decode_tokens_per_s.runs", tokens.get("runs"))
        checks += _numbers(f"rows[{i}].ratios", row.get("ratios"))
        checks += _numbers(f"rows[{i}].k_histogram", row.get("k_histogram"))
        summary = _mapping(row.get("governor_summary"))
        checks += [_expect(f"rows[{i}].governor_summary.{key}", summary.get(key), "list") for key in ("table", "trace")]
        checks += _numbers(f"rows[{i}].governor_summary.trace", summary.get("trace"))
    return next((problem for problem in checks if problem is not None), None)


def _mapping(value: object) -> Mapping:
    return value if isinstance(value, Mapping) else {}


def _numbers(where: str, values: object) -> list[str | None]:
    """A problem for each item of a list, or value of a mapping, that is not a number."""
    items = values.items() if isinstance(values, Mapping) else enumerate(values) if isinstance(values, list) else ()
    return [_expect(f"{where}[{key!r}]", value, "number") for key, value in items]
