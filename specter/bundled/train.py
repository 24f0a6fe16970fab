"""Train the bundled tiny MoE (``bundled:tiny-moe``) from text every Python installation has.

Contract: ``python -m specter.bundled.train --out DIR`` builds the corpus (the standard library's
``.py`` sources without its test folders, plus Debian's common license texts and the unique
package copyright files), trains a byte-level BPE tokenizer and a 16-expert top-2
MixtralForCausalLM on it with a fixed seed, and writes to DIR: bf16 safetensors + config,
the tokenizer, ``training_summary.json`` (config, corpus manifest hash, wall time, held-out loss,
routed-token share per expert per layer) and ``MODEL_CARD.md``. The held-out text is the standard
library's own ``test/`` files, never seen in training. ``--steps`` and ``--threads`` must be at
least 1 (a usage error otherwise), and a training or held-out text shorter than one window stops
the run before it trains. CI never runs this; it takes ~25 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import random
import sysconfig
import time
from pathlib import Path

import torch

EXCLUDED_DIR_NAMES = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
LICENSE_DIR = Path("/usr/share/common-licenses")
COPYRIGHT_GLOB_ROOT = Path("/usr/share/doc")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every knob of the bundled model's training run; the defaults made the shipped weights."""

    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    num_experts: int = 16
    top_k: int = 2
    max_positions: int = 1024
    router_aux_loss_coef: float = 0.15
    zero_init_routers: bool = True  # start from uniform routing so no expert is starved early
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 50
    steps: int = 1100
    threads: int = 2
    eval_windows: int = 96
    heldout_bytes: int = 2_000_000


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def training_files() -> list[Path]:
    """Sorted list of the corpus files: stdlib sources (no test folders), license texts, copyrights."""
    root = stdlib_root()
    sources = [
        p for p in root.rglob("*.py")
        if not (set(p.relative_to(root).parts[:-1]) & EXCLUDED_DIR_NAMES)
    ]
    licenses = [p for p in LICENSE_DIR.iterdir() if p.is_file() and not p.is_symlink()] if LICENSE_DIR.is_dir() else []
    copyrights: list[Path] = []
    seen: set[str] = set()
    for p in sorted(COPYRIGHT_GLOB_ROOT.glob("*/copyright")):
        if p.is_symlink() or not p.is_file():
            continue
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            copyrights.append(p)
    return sorted(sources) + sorted(licenses) + copyrights


def heldout_files() -> list[Path]:
    """The stdlib's own test modules (``<stdlib>/test``): held out from training."""
    return sorted((stdlib_root() / "test").rglob("*.py"))


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
        unk_token=None, pad_token="<|endoftext|>",
    )


def encode_corpus(tokenizer, texts: list[str]) -> torch.Tensor:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for chunk in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(chunk)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def make_model(cfg: TrainConfig, tokenizer):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        max_position_embeddings=cfg.max_positions,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        sliding_window=None,
    )
    return MixtralForCausalLM(config)


def per_layer_balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> tuple[torch.Tensor, float]:
    """Switch-style load-balancing loss computed for each MoE layer on its own, then averaged,
    and the smallest routed share of any expert in any layer (for the progress log).

    transformers' Mixtral aux loss concatenates every layer's router logits before counting, so
    it balances expert *indices* across layers and lets an expert starve inside one layer."""
    losses, smallest = [], 1.0
    for logits in router_logits:  # [tokens, E] per layer
        probs = logits.float().softmax(dim=-1)
        chosen = probs.topk(top_k, dim=-1).indices
        routed = torch.zeros_like(probs).scatter_(1, chosen, 1.0).mean(dim=0) / top_k  # [E], sums to 1
        losses.append(probs.shape[-1] * (routed * probs.mean(dim=0)).sum())
        smallest = min(smallest, routed.min().item())
    return torch.stack(losses).mean(), smallest


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def sample_batch(tokens: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
    return torch.stack([tokens[s : s + cfg.seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, cfg: TrainConfig) -> tuple[float, list[list[float]]]:
    """Mean next-token cross-entropy over evenly spaced held-out windows, and routed share per expert."""
    model.eval()
    n = cfg.eval_windows
    stride = (tokens.numel() - cfg.seq_len - 1) // n
    losses = []
    counts = torch.zeros(cfg.num_layers, cfg.num_experts)
    for i in range(n):
        window = tokens[i * stride : i * stride + cfg.seq_len + 1].unsqueeze(0)
        out = model(window[:, :-1], output_router_logits=True)
        logits = out.logits[0]
        losses.append(torch.nn.functional.cross_entropy(logits.float(), window[0, 1:]).item())
        for layer, router_logits in enumerate(out.router_logits):
            top = router_logits.topk(cfg.top_k, dim=-1).indices.flatten()
            counts[layer] += torch.bincount(top, minlength=cfg.num_experts).float()
    model.train()
    share = (counts / counts.sum(dim=1, keepdim=True)).tolist()
    return sum(losses) / len(losses), share


def write_model_card(out: Path, summary: dict) -> None:
    cfg = summary["config"]
    share = summary["heldout_routed_share"]
    rows = "\n".join(
        f"| {layer} | " + " | ".join(f"{100 * s:.1f}" for s in shares) + f" | {100 * min(shares):.1f} |"
        for layer, shares in enumerate(share)
    )
    header = "| layer | " + " | ".join(f"e{e}" for e in range(cfg["num_experts"])) + " | min |"
    sep = "|" + "---|" * (cfg["num_experts"] + 2)
    text = f"""# tiny-moe (bundled with Specter)

A deliberately small Mixture-of-Experts language model in the `MixtralForCausalLM` layout, with the
routing shape of Phi-3.5-MoE (16 experts, top-2). It exists so that Specter runs, tests and
benchmarks on any machine with no download. It is undertrained; its text is Python-flavoured.
All figures below were written by `specter/bundled/train.py` at the end of the run that made these weights.

## Architecture
hidden {cfg['hidden_size']}, {cfg['num_layers']} layers, {cfg['num_heads']} heads ({cfg['num_kv_heads']} KV heads),
{cfg['num_experts']} experts per layer, top-{cfg['top_k']}, expert intermediate {cfg['intermediate_size']},
vocabulary {cfg['vocab_size']} (byte-level BPE), tied embeddings, {summary['parameters']:,} parameters,
stored as bf16 safetensors ({summary['weights_bytes']:,} bytes).

## Corpus
{summary['corpus']['description']}
Files: {summary['corpus']['files']} ({summary['corpus']['bytes']:,} bytes, {summary['corpus']['tokens']:,} tokens);
the sorted file list with sha256 of each is in `corpus_manifest.txt` (manifest sha256
`{summary['corpus']['manifest_sha256']}`).
Held-out text: {summary['heldout']['description']} ({summary['heldout']['tokens']:,} tokens).

## Training
Seed {cfg['seed']}; AdamW betas {tuple(cfg['betas'])}, weight decay {cfg['weight_decay']}, peak lr {cfg['lr']},
{cfg['warmup_steps']} warm-up steps then cosine to {cfg['min_lr_ratio']}x; {cfg['steps']} steps of
{cfg['batch_size']} x {cfg['seq_len']} tokens; router load-balancing loss (Switch-style, per layer) coefficient {cfg['router_aux_loss_coef']}, routers zero-initialised;
{cfg['threads']} threads, fp32. Wall time {summary['wall_s'] / 60:.1f} min on {summary['machine']}
({summary['tokens_per_s']:.0f} training tokens/s).
Reproduce: `python -m specter.bundled.train --out specter/data/tiny-moe`.

## Results
Final held-out cross-entropy: **{summary['heldout_loss']:.3f}** nats/token (perplexity {math.exp(summary['heldout_loss']):.1f}),
{cfg['eval_windows']} windows of {cfg['seq_len']} tokens. Final training loss {summary['final_train_loss']:.3f}.

Share of routed tokens (top-{cfg['top_k']} assignments, %) per expert per layer on held-out text
(smallest share overall: {100 * summary['min_routed_share']:.2f}%):

{header}
{sep}
{rows}
"""
    (out / "MODEL_CARD.md").write_text(text)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=_positive_int, default=TrainConfig.steps)
    parser.add_argument("--threads", type=_positive_int, default=TrainConfig.threads)
    args = parser.parse_args(argv)
    cfg = dataclasses.replace(TrainConfig(), steps=args.steps, threads=args.threads)

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    started = time.time()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    files = training_files()
    texts = [read_text(p) for p in files]
    manifest = "\n".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p}" for p in files) + "\n"
    (out / "corpus_manifest.txt").write_text(manifest)
    held_texts = []
    held_bytes = 0
    for p in heldout_files():
        t = read_text(p)
        held_texts.append(t)
        held_bytes += len(t.encode())
        if held_bytes >= cfg.heldout_bytes:
            break
    print(f"corpus: {len(files)} files, {sum(len(t.encode()) for t in texts):,} bytes", flush=True)

    tokenizer = build_tokenizer(texts, cfg.vocab_size)
    train_tokens = encode_corpus(tokenizer, texts)
    held_tokens = encode_corpus(tokenizer, held_texts)
    print(f"tokens: train {train_tokens.numel():,}, held-out {held_tokens.numel():,}", flush=True)
    for name, tokens in (("training", train_tokens), ("held-out", held_tokens)):
        if tokens.numel() < cfg.seq_len + 2:  # found before the training run, not after it
            raise SystemExit(f"train: the {name} text has {tokens.numel()} tokens; a window of {cfg.seq_len + 1} "
                             f"needs at least {cfg.seq_len + 2}")

    model = make_model(cfg, tokenizer)
    if cfg.zero_init_routers:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.zero_()
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=cfg.betas,
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    train_started = time.time()
    loss_value = float("nan")
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = sample_batch(train_tokens, cfg, gen)
        out_ = model(batch[:, :-1], output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out_.logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        balance, smallest_share = per_layer_balance_loss(out_.router_logits, cfg.top_k)
        loss = ce + cfg.router_aux_loss_coef * balance
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = ce.item()
        if step % 50 == 0 or step == cfg.steps - 1:
            elapsed = time.time() - train_started
            print(f"step {step}/{cfg.steps} loss {loss_value:.3f} balance {balance.item():.3f} "
                  f"min share {100 * smallest_share:.2f}% lr {lr_at(step, cfg):.2e} "
                  f"{(step + 1) * cfg.batch_size * cfg.seq_len / elapsed:.0f} tok/s {elapsed / 60:.1f} min",
                  flush=True)
    train_s = time.time() - train_started

    heldout_loss, share = evaluate(model, held_tokens, cfg)
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    import platform
    summary = {
        "config": dataclasses.asdict(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
        "corpus": {
            "description": (
                f"Python {platform.python_version()} standard library `.py` files (without folders named "
                f"{', '.join(sorted(EXCLUDED_DIR_NAMES - {'__pycache__', 'site-packages'}))}, and without "
                "site-packages), Debian's /usr/share/common-licenses texts, and the unique "
                "/usr/share/doc/*/copyright files (deduplicated by content)."
            ),
            "files": len(files),
            "bytes": sum(len(t.encode()) for t in texts),
            "tokens": int(train_tokens.numel()),
            "manifest_sha256": hashlib.sha256(manifest.encode()).hexdigest(),
        },
        "heldout": {
            "description": f"the first {len(held_texts)} files (sorted) of the standard library's test/ folder",
            "tokens": int(held_tokens.numel()),
        },
        "wall_s": time.time() - started,
        "train_s": train_s,
        "tokens_per_s": cfg.steps * cfg.batch_size * cfg.seq_len / train_s,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "final_train_loss": loss_value,
        "heldout_loss": heldout_loss,
        "heldout_routed_share": share,
        "min_routed_share": min(min(s) for s in share),
    }
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_model_card(out, summary)
    print(f"held-out loss {heldout_loss:.3f}; min routed share {summary['min_routed_share']:.4f}; "
          f"wall {summary['wall_s'] / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
