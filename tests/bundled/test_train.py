"""``specter.bundled.train``: the contract of the script that trains the bundled tiny MoE, checked on
tiny inputs (the real run takes ~25 minutes and is never run here).

Covered: the corpus builder (stdlib ``.py`` sources without folders named ``test``/``tests``/
``idle_test``/``site-packages``/``__pycache__`` below the stdlib root, regular licence files, copyright
files deduplicated by content) on a fake stdlib and ``/usr/share`` under ``tmp_path``, and the real
stdlib's training/held-out split being disjoint; the held-out files; the byte-level BPE tokenizer
(round trip, determinism) and corpus encoding; the model the config describes; the learning-rate
schedule, batch sampling, per-layer balance loss and held-out evaluation; the CLI's argument
checks; and a tiny end-to-end ``main`` run (a 2-layer, 4-expert config, 3 steps) on the fake
system, run four times: it writes the documented files, the same seed and corpus reproduce the
weights byte for byte, the manifest hash follows the training text, and the held-out text never
reaches training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specter.bundled import train
from specter.bundled.train import TrainConfig


@dataclasses.dataclass(frozen=True)
class TinyConfig(TrainConfig):
    """The training config shrunk so that ``main`` runs in about a second on one thread."""

    vocab_size: int = 300
    hidden_size: int = 32
    intermediate_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    num_experts: int = 4
    top_k: int = 2
    max_positions: int = 64
    seq_len: int = 16
    batch_size: int = 2
    warmup_steps: int = 2
    steps: int = 5  # main is always given --steps STEPS and --threads 1: the summary shows they were used
    threads: int = 2
    eval_windows: int = 3
    heldout_bytes: int = 10**9  # the e2e fixture sets it so that two of the three held-out files are used


STEPS = 3
NO_TOKEN_IDS = SimpleNamespace(bos_token_id=0, eos_token_id=0, pad_token_id=0)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def python_text(name: str, lines: int) -> str:
    return "".join(f"def {name}_{i}(x, y):\n    return x * {i} + y  # {name}\n\n" for i in range(lines))


def make_fake_system(base: Path) -> SimpleNamespace:
    """A fake stdlib (under a folder itself named ``test``, to show that only folders below the
    stdlib root count), a licence folder and a ``/usr/share/doc``; returns what the corpus builder
    must keep, in its documented order, and the held-out files."""
    root = base / "test" / "lib" / "python3.x"
    sources = [
        write(root / "abc_mod.py", python_text("abc", 12)),
        write(root / "test.py", python_text("top", 6)),  # a file named test.py is not a test folder
        write(root / "testing" / "helpers.py", python_text("helper", 6)),
        write(root / "pkg" / "__init__.py", ""),
        write(root / "pkg" / "core.py", python_text("core", 12)),
        write(root / "pkg" / "sub" / "deep.py", python_text("deep", 6)),
    ]
    excluded = [
        write(root / "pkg" / "tests" / "test_core.py", python_text("EXCLUDED_tests", 3)),
        write(root / "idlelib" / "idle_test" / "test_idle.py", python_text("EXCLUDED_idle", 3)),
        write(root / "site-packages" / "thirdparty" / "mod.py", python_text("EXCLUDED_site", 3)),
        write(root / "pkg" / "__pycache__" / "core.py", python_text("EXCLUDED_cache", 3)),
        write(root / "pkg" / "sub" / "test" / "inner.py", python_text("EXCLUDED_inner", 3)),
    ]
    write(root / "pkg" / "data.txt", "not python\n")
    held = [
        write(root / "test" / "test_alpha.py", python_text("HELDOUT_alpha", 8)),
        write(root / "test" / "test_beta.py", python_text("HELDOUT_beta", 8)),
        write(root / "test" / "test_gamma.py", python_text("HELDOUT_gamma", 8)),
        write(root / "test" / "sub" / "test_nested.py", python_text("HELDOUT_nested", 8)),
    ]
    write(root / "test" / "data.txt", "held-out data that is not python\n")

    lic = base / "common-licenses"
    licenses = [
        write(lic / "Apache-2.0", "Apache License, Version 2.0\n" * 20),
        write(lic / "BSD", "Redistribution and use in source and binary forms\n" * 10),
        write(lic / "GPL-3", "GNU GENERAL PUBLIC LICENSE Version 3\n" * 20),
    ]
    (lic / "GPL").symlink_to(lic / "GPL-3")  # a symlink: the same text again, left out
    (lic / "folder").mkdir()

    doc = base / "doc"
    shared = "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\nLicense: MIT\n"
    copyrights = [
        write(doc / "aaa" / "copyright", shared),
        write(doc / "ccc" / "copyright", "Copyright 2024 Somebody\nLicense: GPL-2+\n" * 4),
    ]
    write(doc / "bbb" / "copyright", shared)  # same content as aaa: deduplicated
    (doc / "ddd").mkdir()
    (doc / "ddd" / "copyright").symlink_to(doc / "ccc" / "copyright")  # symlink: left out
    (doc / "eee").symlink_to(doc / "ccc", target_is_directory=True)  # same content via a linked folder
    write(doc / "fff" / "README", "not a copyright file\n")
    return SimpleNamespace(root=root, sources=sources, excluded=excluded, held=held, licenses=licenses,
                           copyrights=copyrights, license_dir=lic, doc_dir=doc)


def point_train_at(patch: pytest.MonkeyPatch, system: SimpleNamespace) -> None:
    patch.setattr(train, "stdlib_root", lambda: system.root)
    patch.setattr(train, "LICENSE_DIR", system.license_dir)
    patch.setattr(train, "COPYRIGHT_GLOB_ROOT", system.doc_dir)


@contextlib.contextmanager
def global_state_restored():
    """``main`` seeds torch and ``random`` and sets torch's thread count: undo that for other tests."""
    torch_state, py_state, threads = torch.get_rng_state(), random.getstate(), torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(py_state)
        torch.set_num_threads(threads)


@pytest.fixture
def fake_system(tmp_path, monkeypatch) -> SimpleNamespace:
    system = make_fake_system(tmp_path)
    point_train_at(monkeypatch, system)
    return system


# --- the corpus -----------------------------------------------------------------------------------


def test_training_files_are_sorted_sources_then_licences_then_unique_copyrights(fake_system):
    assert train.training_files() == (
        sorted(fake_system.sources) + sorted(fake_system.licenses) + fake_system.copyrights
    )


def test_excluded_folders_count_only_below_the_stdlib_root(fake_system):
    files = train.training_files()
    assert "test" in fake_system.root.parts  # the fake stdlib itself lives under a folder named test
    for path in fake_system.excluded + fake_system.held:
        assert path not in files
    kept_sources = [p for p in files if p.is_relative_to(fake_system.root)]
    assert kept_sources == sorted(fake_system.sources)
    assert not any(p.suffix != ".py" for p in kept_sources)


def test_training_files_tolerate_a_missing_licence_folder_and_doc_tree(fake_system, monkeypatch, tmp_path):
    monkeypatch.setattr(train, "LICENSE_DIR", tmp_path / "nowhere")
    monkeypatch.setattr(train, "COPYRIGHT_GLOB_ROOT", tmp_path / "nowhere-either")
    assert train.training_files() == sorted(fake_system.sources)


def test_heldout_files_are_the_sorted_python_files_of_the_stdlib_test_folder(fake_system):
    held = train.heldout_files()
    assert held == sorted(fake_system.held)
    assert not set(held) & set(train.training_files())


@pytest.mark.skipif(not (train.stdlib_root() / "test").is_dir(), reason="this Python has no stdlib test/ folder")
def test_the_real_stdlib_split_is_disjoint_and_free_of_excluded_folders():
    root = train.stdlib_root()
    files = train.training_files()
    held = train.heldout_files()
    assert held and files
    assert not set(files) & set(held)
    assert all(p.relative_to(root).parts[0] == "test" for p in held)
    sources = [p for p in files if p.is_relative_to(root)]
    assert sources == sorted(sources) and all(p.suffix == ".py" for p in sources)
    assert all(not set(p.relative_to(root).parts[:-1]) & train.EXCLUDED_DIR_NAMES for p in sources)
    assert root / "os.py" in sources  # an ordinary stdlib module is in the corpus


def test_read_text_decodes_utf8_and_replaces_bad_bytes(tmp_path):
    path = tmp_path / "f.py"
    path.write_bytes("naïve = 1\n".encode() + b"\xff\xfe end")
    assert train.read_text(path) == "naïve = 1\n\ufffd\ufffd end"


# --- tokenizer and encoding -------------------------------------------------------------------------

TOKENIZER_CORPUS = [python_text("alpha", 10), python_text("beta", 10), "class Thing:\n    pass\n" * 10,
                    "# ünïcödé comment ✓\n\tx = 'tab'\r\n" * 5]


@pytest.fixture(scope="module")
def tokenizer():
    return train.build_tokenizer(TOKENIZER_CORPUS, 300)


@pytest.mark.parametrize("text", [
    TOKENIZER_CORPUS[0], TOKENIZER_CORPUS[3],
    "  leading and trailing spaces  ", "x = f(a , b) ; y = [1 ,2 ] .", "never seen: 日本語 🚀 \x00\x7f\n\n\n",
])
def test_the_tokenizer_round_trips_text_byte_for_byte(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_the_tokenizer_is_byte_level_bpe_with_one_end_of_text_token(tokenizer):
    assert 257 < len(tokenizer) <= 300  # 256 bytes + <|endoftext|> + learned merges, within the budget
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = tokenizer(TOKENIZER_CORPUS[0], add_special_tokens=False)["input_ids"]
    assert len(ids) < len(TOKENIZER_CORPUS[0].encode()) / 2  # the merges compress the training text


def test_tokenizer_training_is_deterministic(tokenizer):
    again = train.build_tokenizer(TOKENIZER_CORPUS, 300)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_encode_corpus_ends_every_document_with_end_of_text(tokenizer):
    texts = ["def a():\n    pass\n", "", "x = 1\n"]
    ids = train.encode_corpus(tokenizer, texts)
    assert ids.dtype == torch.long
    eos = tokenizer.eos_token_id
    assert ids[-1].item() == eos and (ids == eos).sum().item() == len(texts)
    docs, current = [], []
    for i in ids.tolist():
        if i == eos:
            docs.append(tokenizer.decode(current))
            current = []
        else:
            current.append(i)
    assert docs == texts


# --- model, schedule, batches, losses --------------------------------------------------------------


def test_make_model_builds_the_configured_mixtral(tokenizer):
    cfg = TinyConfig()
    model = train.make_model(cfg, tokenizer)
    config = model.config
    assert config.model_type == "mixtral"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (300, 32, 32)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 2, 2)
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    assert config.max_position_embeddings == 64 and config.router_aux_loss_coef == cfg.router_aux_loss_coef
    assert config.eos_token_id == config.bos_token_id == config.pad_token_id == tokenizer.eos_token_id
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    # main zero-initialises the routers through this attribute
    assert all(layer.mlp.gate.weight.shape == (4, 32) for layer in model.model.layers)


def test_the_learning_rate_warms_up_linearly_then_follows_a_cosine_to_the_floor():
    cfg = TrainConfig(lr=1.0, warmup_steps=4, steps=14, min_lr_ratio=0.1)
    assert [train.lr_at(s, cfg) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert train.lr_at(4, cfg) == pytest.approx(1.0)
    assert train.lr_at(9, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the cosine
    assert train.lr_at(14, cfg) == pytest.approx(0.1)
    assert train.lr_at(1000, cfg) == pytest.approx(0.1)  # clamped past the end
    decay = [train.lr_at(s, cfg) for s in range(4, 30)]
    assert all(a >= b for a, b in zip(decay, decay[1:])) and min(decay) >= 0.1 - 1e-12
    real = TrainConfig()
    assert max(train.lr_at(s, real) for s in range(real.steps)) == pytest.approx(real.lr)
    assert train.lr_at(real.steps - 1, real) == pytest.approx(real.lr * real.min_lr_ratio, rel=1e-3)


def test_batches_are_contiguous_windows_reproducible_from_the_seed():
    cfg = TinyConfig(seq_len=8, batch_size=5)
    tokens = torch.arange(100)
    batch = train.sample_batch(tokens, cfg, torch.Generator().manual_seed(0))
    assert batch.shape == (5, 9)
    for row in batch:
        assert row.tolist() == list(range(row[0].item(), row[0].item() + 9))
    again = train.sample_batch(tokens, cfg, torch.Generator().manual_seed(0))
    other = train.sample_batch(tokens, cfg, torch.Generator().manual_seed(1))
    assert torch.equal(batch, again) and not torch.equal(batch, other)


def _logits(pattern: list[list[float]]) -> torch.Tensor:
    return torch.tensor(pattern, dtype=torch.float32)


def test_balance_loss_is_one_when_routing_is_balanced():
    balanced = _logits([[2, 2, 0, 0], [0, 0, 2, 2]] * 3)
    loss, smallest = train.per_layer_balance_loss((balanced, balanced), top_k=2)
    assert loss.item() == pytest.approx(1.0) and smallest == pytest.approx(0.25)


def test_balance_loss_is_per_layer_and_sees_a_layer_that_starves_experts():
    """Layer 0 sends every token to experts 0-1 and layer 1 to experts 2-3: balanced if the layers
    were pooled (as transformers' aux loss does), starved within each layer."""
    first, second = _logits([[2, 2, 0, 0]] * 6), _logits([[0, 0, 2, 2]] * 6)
    p = math.exp(2) / (2 * math.exp(2) + 2)  # the probability of each preferred expert
    loss, smallest = train.per_layer_balance_loss((first, second), top_k=2)
    assert loss.item() == pytest.approx(4 * p) and loss.item() > 1.5
    assert smallest == 0.0
    pooled, _ = train.per_layer_balance_loss((torch.cat([first, second]),), top_k=2)
    assert pooled.item() == pytest.approx(1.0)
    one, _ = train.per_layer_balance_loss((first,), top_k=2)
    two, _ = train.per_layer_balance_loss((second,), top_k=2)
    assert loss.item() == pytest.approx((one.item() + two.item()) / 2)  # averaged over layers


def test_balance_loss_pushes_the_router_away_from_overloaded_experts():
    logits = _logits([[2, 2, 0, 0]] * 6).requires_grad_()
    loss, _ = train.per_layer_balance_loss((logits,), top_k=2)
    loss.backward()
    assert (logits.grad[:, :2] > 0).all() and (logits.grad[:, 2:] < 0).all()


def test_evaluate_averages_evenly_spaced_windows_and_reports_routed_shares():
    cfg = TinyConfig(seq_len=8, eval_windows=3)
    torch.manual_seed(0)
    model = train.make_model(cfg, NO_TOKEN_IDS)
    model.train()
    tokens = torch.randint(0, cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(0))
    loss, share = train.evaluate(model, tokens, cfg)
    assert model.training  # back in training mode
    assert all(p.grad is None for p in model.parameters())
    stride = (60 - 9) // 3
    model.eval()
    with torch.no_grad():
        expected = [
            torch.nn.functional.cross_entropy(model(w[None, :-1]).logits[0], w[1:]).item()
            for w in (tokens[i * stride : i * stride + 9] for i in range(3))
        ]
    assert loss == pytest.approx(sum(expected) / 3, rel=1e-5)
    assert len(share) == cfg.num_layers and all(len(row) == cfg.num_experts for row in share)
    routed = 3 * cfg.seq_len * cfg.top_k  # assignments per layer
    for row in share:
        assert sum(row) == pytest.approx(1.0)
        assert all(abs(s * routed - round(s * routed)) < 1e-4 for s in row)  # shares of whole counts
        assert max(row) <= 1 / cfg.top_k + 1e-6  # a token counts once for each of its top-k experts
    with torch.no_grad():  # zeroed routers tie every expert: each token goes to the same top-k experts
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
    _, tied = train.evaluate(model, tokens, cfg)
    assert all(sorted(row) == [0.0, 0.0, 0.5, 0.5] for row in tied)


# --- the command line -------------------------------------------------------------------------------


class CorpusBuilt(Exception):
    """Raised by a stubbed corpus builder: ``main`` got past its argument checks."""


@pytest.fixture
def no_corpus(monkeypatch):
    def refuse():
        raise CorpusBuilt

    monkeypatch.setattr(train, "training_files", refuse)
    monkeypatch.setattr(train, "heldout_files", refuse)
    with global_state_restored():
        yield


@pytest.mark.parametrize(("argv", "message"), [
    ([], "the following arguments are required: --out"),
    (["--steps", "10"], "the following arguments are required: --out"),
    (["--out", "{out}", "--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["--out", "{out}", "--threads", "1.5"], "argument --threads: invalid int value: '1.5'"),
    (["--out", "{out}", "--seed", "3"], "unrecognized arguments: --seed 3"),
])
def test_the_cli_refuses_bad_arguments_before_doing_any_work(argv, message, no_corpus, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        train.main([a.format(out=out) for a in argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_the_cli_reaches_the_corpus_with_good_arguments(no_corpus, tmp_path):
    with pytest.raises(CorpusBuilt):
        train.main(["--out", str(tmp_path / "out"), "--steps", "5", "--threads", "1"])
    assert (tmp_path / "out").is_dir()


@pytest.mark.parametrize("option", ["--steps", "--threads"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_the_cli_refuses_a_count_below_one_before_doing_any_work(option, value, no_corpus, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:  # 0 steps trained nothing and wrote a NaN loss; 0 threads a traceback
        train.main(["--out", str(out), option, value])
    assert info.value.code == 2
    assert f"argument {option}: must be at least 1, got {value}" in capsys.readouterr().err
    assert not out.exists()


# --- a tiny end-to-end run --------------------------------------------------------------------------


def _run(out: Path) -> SimpleNamespace:
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        assert train.main(["--out", str(out), "--steps", str(STEPS), "--threads", "1"]) == 0
    summary_text = (out / "training_summary.json").read_text()
    return SimpleNamespace(out=out, log=log.getvalue(), summary_text=summary_text,
                           summary=json.loads(summary_text),
                           weights=(out / "model.safetensors").read_bytes(),
                           tokenizer=(out / "tokenizer.json").read_text(),
                           manifest=(out / "corpus_manifest.txt").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``main`` four times on the fake system: ``a`` and ``b`` on the same corpus, ``changed_training``
    after one training file changed, ``changed_heldout`` after a used held-out file changed instead
    (same length)."""
    base = tmp_path_factory.mktemp("train-e2e")
    system = make_fake_system(base / "system")
    with pytest.MonkeyPatch.context() as patch, global_state_restored():
        point_train_at(patch, system)
        held = train.heldout_files()
        threshold = len(held[0].read_bytes()) + 1  # crossed by the second file: two files held out
        patch.setattr(train, "TrainConfig", dataclasses.make_dataclass(
            "TinyRunConfig", [("heldout_bytes", int, dataclasses.field(default=threshold))],
            bases=(TinyConfig,), frozen=True))
        result = SimpleNamespace(system=system, cfg=train.TrainConfig(steps=STEPS, threads=1))
        result.a = _run(base / "a")
        result.b = _run(base / "b")

        original = system.sources[0].read_text()
        system.sources[0].write_text(original + "def extra():\n    return 42\n")
        result.changed_training = _run(base / "changed_training")
        system.sources[0].write_text(original)

        text = held[0].read_text()
        held[0].write_text(text.replace("HELDOUT", "HeLdOuT").replace("x * ", "y - "))
        assert len(held[0].read_bytes()) == len(text.encode())
        result.changed_heldout = _run(base / "changed_heldout")
        held[0].write_text(text)
    return result


def test_a_heldout_text_shorter_than_a_window_stops_the_run_before_training(fake_system, monkeypatch, tmp_path):
    for path in fake_system.held:
        path.write_text("1")  # two tokens a file with its end of text: no evaluation window fits
    monkeypatch.setattr(train, "TrainConfig", TinyConfig)
    trained = []
    monkeypatch.setattr(train, "sample_batch", lambda *args: trained.append(args) or pytest.fail("trained"))
    with global_state_restored(), pytest.raises(SystemExit) as info, contextlib.redirect_stdout(io.StringIO()):
        train.main(["--out", str(tmp_path / "out"), "--steps", str(STEPS), "--threads", "1"])
    assert str(info.value).startswith("train: the held-out text has ")
    assert f"needs at least {TinyConfig.seq_len + 2}" in str(info.value) and not trained


def test_the_run_writes_the_documented_files(runs):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = runs.a.out
    for name in ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                 "corpus_manifest.txt", "training_summary.json", "MODEL_CARD.md"]:
        assert (out / name).is_file(), name
    assert not list(out.glob("*.bin"))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
    assert config["num_experts_per_tok"] == 2 and config["num_hidden_layers"] == 2
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert not config.get("output_router_logits")
    with safe_open(str(out / "model.safetensors"), framework="pt") as weights:
        names = list(weights.keys())
        assert names and all(weights.get_tensor(n).dtype == torch.bfloat16 for n in names)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "def abc_1(x, y):\n    return x * 1 + y\n"
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == text
    assert model(ids).logits.shape == (1, ids.shape[1], 300)
    assert tokenizer.eos_token == "<|endoftext|>" and model.config.eos_token_id == tokenizer.eos_token_id


def test_the_routers_start_from_zero(runs):
    """After a few AdamW steps (each moves a weight by about the learning rate at most) the routers
    are still near zero; a random initialisation (std 0.02 over 4 x 32 weights) would not be."""
    from safetensors import safe_open

    bound = 2 * sum(train.lr_at(s, runs.cfg) for s in range(STEPS))
    with safe_open(str(runs.a.out / "model.safetensors"), framework="pt") as weights:
        gates = [n for n in weights.keys() if n.endswith(".gate.weight")]  # router: mlp. or block_sparse_moe.
        assert len(gates) == runs.cfg.num_layers
        assert all(weights.get_tensor(n).abs().max().item() <= bound for n in gates)
    assert bound < 0.02


def test_the_summary_has_the_documented_keys_and_consistent_values(runs):
    summary, cfg = runs.a.summary, runs.cfg
    json.loads(runs.a.summary_text, parse_constant=lambda c: pytest.fail(f"{c} in training_summary.json"))
    assert {"config", "corpus", "wall_s", "heldout_loss", "heldout_routed_share", "min_routed_share",
            "final_train_loss", "parameters", "weights_bytes", "heldout", "train_s", "tokens_per_s",
            "machine"} <= summary.keys()
    assert summary["config"] == json.loads(json.dumps(dataclasses.asdict(cfg)))
    assert summary["config"]["steps"] == STEPS and summary["config"]["threads"] == 1
    corpus = summary["corpus"]
    assert corpus["manifest_sha256"] == hashlib.sha256(runs.a.manifest.encode()).hexdigest()
    files = sorted(runs.system.sources) + sorted(runs.system.licenses) + runs.system.copyrights
    assert corpus["files"] == len(files)
    expected_bytes = sum(len(train.read_text(p).encode()) for p in files)
    assert corpus["bytes"] == expected_bytes and corpus["tokens"] > 0
    assert summary["heldout"]["description"].startswith("the first 2 files")
    assert summary["wall_s"] >= summary["train_s"] > 0 and summary["tokens_per_s"] > 0
    assert 0 < summary["heldout_loss"] < 2 * math.log(cfg.vocab_size) and math.isfinite(summary["final_train_loss"])
    share = summary["heldout_routed_share"]
    assert len(share) == cfg.num_layers and all(len(row) == cfg.num_experts for row in share)
    assert all(sum(row) == pytest.approx(1.0) for row in share)
    assert summary["min_routed_share"] == min(min(row) for row in share)
    assert summary["weights_bytes"] == (runs.a.out / "model.safetensors").stat().st_size
    assert summary["parameters"] > 0
    assert f"corpus: {corpus['files']} files" in runs.a.log and f"step {STEPS - 1}/{STEPS}" in runs.a.log


def test_the_manifest_lists_each_training_file_with_its_sha256(runs):
    expected = sorted(runs.system.sources) + sorted(runs.system.licenses) + runs.system.copyrights
    lines = runs.a.manifest.splitlines()
    assert runs.a.manifest.endswith("\n") and len(lines) == len(expected)
    for line, path in zip(lines, expected):
        assert line == f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path}"
    assert not any(str(p) in runs.a.manifest for p in runs.system.held + runs.system.excluded)


def test_the_same_seed_and_corpus_reproduce_the_run(runs):
    a, b = runs.a, runs.b
    assert a.weights == b.weights
    assert a.tokenizer == b.tokenizer
    assert a.manifest == b.manifest
    for key in ["heldout_loss", "final_train_loss", "heldout_routed_share", "parameters", "corpus", "heldout"]:
        assert a.summary[key] == b.summary[key], key


def test_changing_the_training_text_changes_the_manifest_hash_and_the_model(runs):
    a, changed = runs.a, runs.changed_training
    assert changed.summary["corpus"]["manifest_sha256"] != a.summary["corpus"]["manifest_sha256"]
    assert changed.summary["corpus"]["files"] == a.summary["corpus"]["files"]
    assert changed.manifest.splitlines()[1:] == a.manifest.splitlines()[1:]  # only the edited file's line
    assert changed.weights != a.weights


def test_the_heldout_text_never_reaches_training(runs):
    """A used held-out file edited: the tokenizer, the corpus and the trained weights are unchanged;
    only the held-out loss moves."""
    a, changed = runs.a, runs.changed_heldout
    assert changed.weights == a.weights
    assert changed.tokenizer == a.tokenizer
    assert changed.manifest == a.manifest
    assert changed.summary["final_train_loss"] == a.summary["final_train_loss"]
    assert changed.summary["heldout_loss"] != a.summary["heldout_loss"]


def test_the_model_card_reports_the_summary(runs):
    summary, card = runs.a.summary, (runs.a.out / "MODEL_CARD.md").read_text()
    assert card.startswith("# tiny-moe (bundled with Specter)")
    assert f"**{summary['heldout_loss']:.3f}**" in card
    assert f"Final training loss {summary['final_train_loss']:.3f}" in card
    assert summary["corpus"]["manifest_sha256"] in card
    assert f"{summary['parameters']:,} parameters" in card
    assert f"{STEPS} steps of" in card and "Seed 0;" in card
    assert "| layer | e0 | e1 | e2 | e3 | min |" in card
    for layer, row in enumerate(summary["heldout_routed_share"]):
        cells = " | ".join(f"{100 * s:.1f}" for s in row)
        assert f"| {layer} | {cells} | {100 * min(row):.1f} |" in card
    assert f"smallest share overall: {100 * summary['min_routed_share']:.2f}%" in card
