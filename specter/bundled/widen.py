"""The realistic benchmark model: the bundled model with every routed expert widened m times.

Contract:
- ``widen_checkpoint(source, out, m)`` writes a checkpoint whose routed experts have
  ``intermediate_size * m`` hidden units: each unit of an expert's gate (``w1``) and up (``w3``)
  projections is duplicated m times and the matching columns of its down projection (``w2``)
  are divided by m. For m a power of two this is exact in binary floating point, so the expert
  computes the same function (up to summation order), routing is unchanged, and greedy tokens
  stay the trained model's own. Attention, norms, routers, embeddings and the tokenizer are
  copied as they are. The write is atomic (a temporary directory renamed into place).
- ``materialize(m, root=None) -> Path``: the widened bundled model ``bundled:tiny-moe-x{m}``,
  built once into the user's cache directory (``$SPECTER_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/specter``, else ``~/.cache/specter``) with a progress bar on a terminal,
  and reused afterwards. The directory name carries a hash of the source checkpoint, so a
  rebuilt bundled model is widened again. The folder and its files are readable by every user
  (a shared cache); a cache directory that cannot be written is a ``SpecterError`` naming it and
  ``SPECTER_CACHE_DIR``.
Only the Mixtral per-expert checkpoint layout (``...experts.N.w1/w2/w3.weight``) is handled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from specter.errors import SpecterError

WIDE_NAME = re.compile(r"tiny-moe-x([0-9]+)")
MAX_FACTOR = 64
_EXPERT_KEY = re.compile(r".*\.experts\.[0-9]+\.(w1|w2|w3)\.weight")
_COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def parse_factor(name: str) -> int | None:
    """m of a ``tiny-moe-x{m}`` name, None for any other name; ValueError for a bad m."""
    match = WIDE_NAME.fullmatch(name)
    if match is None:
        return None
    factor = int(match.group(1))
    if factor < 2 or factor > MAX_FACTOR or factor & (factor - 1):
        raise ValueError(f"tiny-moe-x{factor}: the widening factor must be a power of two in 2..{MAX_FACTOR} "
                         "(only then is the widened model exactly the bundled one)")
    return factor


def cache_root() -> Path:
    explicit = os.environ.get("SPECTER_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "specter"


def widen_tensor(name: str, tensor, factor: int):
    """The widened version of one checkpoint tensor (unchanged unless it is an expert matrix)."""
    match = _EXPERT_KEY.fullmatch(name)
    if match is None:
        return tensor
    if match.group(1) == "w2":  # down [H, I] -> [H, I*m], each column split in m equal parts
        return tensor.repeat_interleave(factor, dim=1) / factor
    return tensor.repeat_interleave(factor, dim=0)  # gate / up [I, H] -> [I*m, H]


def widen_checkpoint(source: Path, out: Path, factor: int, progress: bool | None = None) -> Path:
    """Write the m-times widened copy of the checkpoint in ``source`` to ``out`` (see module doc)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    config = json.loads((source / "config.json").read_text())
    if config.get("model_type") != "mixtral":
        raise ValueError(f"widening handles the Mixtral layout only, not {config.get('model_type')!r}")
    weights = sorted(source.glob("*.safetensors"))
    if len(weights) != 1:
        raise ValueError(f"expected one safetensors file in {source}, found {len(weights)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tensors = {}
        with safe_open(weights[0], "pt") as reader:
            names = list(reader.keys())
            bar = tqdm(names, desc=f"widening experts x{factor}", unit="tensor", disable=None if progress is None else not progress)
            for name in bar:
                tensors[name] = widen_tensor(name, reader.get_tensor(name), factor).contiguous()
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        config["intermediate_size"] = config["intermediate_size"] * factor
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for file_name in _COPIED_FILES:
            if (source / file_name).exists():
                shutil.copy2(source / file_name, staging / file_name)
        (staging / "MODEL_CARD.md").write_text(model_card(factor, config))
        _readable_by_all(staging)  # mkdtemp's folder is the owner's alone; a cache may be shared
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def materialize(factor: int, root: Path | None = None, progress: bool | None = None) -> Path:
    from specter.bundled import BUNDLED_MODELS

    source = BUNDLED_MODELS["tiny-moe"]
    digest = hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()[:12]
    out = (root or cache_root()) / f"tiny-moe-x{factor}-{digest}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    try:
        return widen_checkpoint(source, out, factor, progress)
    except OSError as error:
        raise SpecterError(f"model: bundled:tiny-moe-x{factor} is built once into {out.parent}, which cannot be "
                           f"written ({error.strerror or error}); set SPECTER_CACHE_DIR to a writable folder") from None


def _readable_by_all(folder: Path) -> None:
    folder.chmod(0o755)
    for file in folder.iterdir():
        file.chmod(0o644)


def model_card(factor: int, config: dict) -> str:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    expert_mib = 3 * hidden * inter * 2 / 2**20
    return f"""# tiny-moe-x{factor} (generated by Specter, never committed)

The bundled `tiny-moe` with every routed expert widened {factor}x: each hidden unit of an expert's
gate and up projections is duplicated {factor} times and the matching columns of its down projection
are divided by {factor}. With a power-of-two factor this is exact, so the routing, the draft's
acceptance and the greedy tokens are the bundled model's own.

What it is for: benchmarking in the memory-bound regime of real MoE models. Its experts are
{hidden} x {inter} (gate, up and down: {expert_mib:.1f} MiB each in bf16, twice that in fp32),
so reading experts dominates a decode step and expert transfers are realistically large, as in
Mixtral, Phi-3.5-MoE or Qwen MoE models (whose experts are tens to hundreds of MB).

What it is not: a better or bigger language model. Attention (hidden {hidden}, 4 heads), the
vocabulary (4,096 tokens) and the context (1,024 positions) stay tiny, so attention and the LM
head cost far less than in a real model, and it knows no more than the bundled model.
Built by `specter.bundled.widen` from the bundled checkpoint; delete this directory to rebuild it.
"""
