"""``specter.bundled.eval_prompts``: the evaluation prompts taken from the stdlib's ``test/`` folder.

Most tests point the module at a small fake stdlib under ``tmp_path`` (a ``test/`` folder of a
few files, a held-out threshold of a few hundred bytes) and check the contract exactly: the files
the bundled model's held-out loss uses are skipped, every other ``stride``-th file gives at most
one prompt, the first ``lines`` lines of its first fitting ``    def test_...:`` method, with a
``test/FILE.py:LINE`` source, and ``main`` writes them as JSONL. One test reads the real stdlib.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specter.bundled import eval_prompts, train
from specter.bundled.eval_prompts import main, select_prompts
from specter.bundled.train import TrainConfig

CLASS_HEAD = "import unittest\n\n\nclass T(unittest.TestCase):\n"


def method(name: str, body_lines: int = 3, width: int = 10) -> str:
    body = "".join(f"        x{i} = {'1' * width}\n" for i in range(body_lines))
    return f"    def {name}(self):\n{body}\n"


@pytest.fixture
def fake_stdlib(tmp_path: Path, monkeypatch):
    """``write(name, text)`` creates ``<root>/test/name``; ``held(bytes)`` sets the held-out threshold."""
    root = tmp_path / "lib"
    (root / "test").mkdir(parents=True)
    monkeypatch.setattr(train, "stdlib_root", lambda: root)
    monkeypatch.setattr(eval_prompts, "stdlib_root", lambda: root)

    class Stdlib:
        def write(self, name: str, text: str) -> Path:
            path = root / "test" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return path

        def held(self, threshold: int) -> None:
            monkeypatch.setattr(TrainConfig, "heldout_bytes", threshold)

    return Stdlib()


def test_the_held_out_files_are_skipped_and_each_prompt_is_a_methods_first_lines(fake_stdlib) -> None:
    text = CLASS_HEAD + method("setUp") + method("test_alpha") + method("test_beta")
    first = fake_stdlib.write("a_held.py", text)
    fake_stdlib.write("b_held.py", text)  # crosses the threshold: still held out
    fake_stdlib.write("c_seen.py", CLASS_HEAD + method("test_gamma"))
    fake_stdlib.write("sub/d_seen.py", CLASS_HEAD + method("test_delta", width=3))
    fake_stdlib.held(len(first.read_bytes()) + 1)
    prompts = select_prompts()
    assert prompts == [
        {"prompt": "    def test_gamma(self):\n" + "        x0 = 1111111111\n        x1 = 1111111111\n"
                   "        x2 = 1111111111\n", "source": "test/c_seen.py:5"},
        {"prompt": "    def test_delta(self):\n        x0 = 111\n        x1 = 111\n        x2 = 111\n",
         "source": "test/sub/d_seen.py:5"},
    ]
    assert select_prompts() == prompts  # deterministic


def test_a_file_exactly_at_the_threshold_is_held_out(fake_stdlib) -> None:
    held = fake_stdlib.write("a_held.py", CLASS_HEAD + method("test_alpha"))
    fake_stdlib.write("b_seen.py", CLASS_HEAD + method("test_beta"))
    fake_stdlib.held(len(held.read_bytes()))
    assert [p["source"] for p in select_prompts()] == ["test/b_seen.py:5"]


def test_only_a_fitting_indented_test_method_is_taken_once_per_file(fake_stdlib) -> None:
    fake_stdlib.write("a_held.py", "x = 1\n")
    text = (
        "def test_top_level():\n    pass\n    pass\n    pass\n\n"            # not a method
        + CLASS_HEAD
        + method("helper")                                                  # not a test
        + "    def test_wrapped(self,\n            arg):\n        a = 1\n        b = 2\n\n"  # no ':' on the def line
        + "    def test_nested(self):\n        def test_inner():\n            pass\n        pass\n\n"
        + method("test_too_wide", width=300)                               # longer than max_chars
        + method("test_fits")
        + method("test_also_fits")
    )
    path = fake_stdlib.write("b_seen.py", text)
    fake_stdlib.held(1)
    prompts = select_prompts()
    lines = path.read_text().splitlines()
    assert [p["source"] for p in prompts] == [f"test/b_seen.py:{lines.index('    def test_nested(self):') + 1}"]
    assert prompts[0]["prompt"] == "\n".join(lines[lines.index("    def test_nested(self):"):][:4]) + "\n"
    # without test_nested the inner def (not a method) is passed over, and test_too_wide too
    path.write_text(text.replace("    def test_nested(self):", "    def nested(self):"))
    assert [p["source"] for p in select_prompts()] == [
        f"test/b_seen.py:{path.read_text().splitlines().index('    def test_fits(self):') + 1}"]


def test_too_long_and_too_short_snippets_move_on_to_the_next_method(fake_stdlib) -> None:
    fake_stdlib.write("a_held.py", "x = 1\n")
    fake_stdlib.write("b_seen.py", CLASS_HEAD + method("test_wide", width=300) + method("test_ok"))
    fake_stdlib.write("c_seen.py", CLASS_HEAD + "    def test_at_the_end(self):\n        pass")  # only 2 lines
    fake_stdlib.held(1)
    prompts = select_prompts()
    assert [p["source"] for p in prompts] == ["test/b_seen.py:10"]
    assert prompts[0]["prompt"].startswith("    def test_ok(self):\n")


def test_max_chars_is_inclusive(fake_stdlib) -> None:
    fake_stdlib.write("a_held.py", "x = 1\n")
    fake_stdlib.write("b_seen.py", CLASS_HEAD + method("test_one"))
    fake_stdlib.held(1)
    snippet = select_prompts()[0]["prompt"]
    assert select_prompts(max_chars=len(snippet)) == [{"prompt": snippet, "source": "test/b_seen.py:5"}]
    assert select_prompts(max_chars=len(snippet) - 1) == []
    two = select_prompts(lines=2)
    assert two == [{"prompt": "    def test_one(self):\n        x0 = 1111111111\n", "source": "test/b_seen.py:5"}]


@pytest.mark.parametrize(("count", "taken"), [(2, ["f00", "f03"]), (3, ["f00", "f02", "f04"]), (8, ["f00", "f01"])])
def test_candidates_are_strided_and_the_count_stops_the_search(fake_stdlib, count: int, taken: list[str]) -> None:
    """12 candidate files: the stride is ``max(1, 12 // (2 * count))``; with ``count=8`` the stride
    is 1 and only two of the files have a test method."""
    fake_stdlib.write("a_held.py", "x = 1\n")
    for i in range(12):
        has_test = count != 8 or i < 2
        fake_stdlib.write(f"f{i:02}.py", CLASS_HEAD + method("test_it" if has_test else "helper"))
    fake_stdlib.held(1)
    prompts = select_prompts(count=count)
    assert [p["source"] for p in prompts] == [f"test/{name}.py:5" for name in taken]


def test_no_test_folder_gives_no_prompts(fake_stdlib) -> None:
    fake_stdlib.held(1)
    assert select_prompts() == []


def test_when_every_file_is_held_out_there_are_no_prompts(fake_stdlib) -> None:
    fake_stdlib.write("a_held.py", CLASS_HEAD + method("test_alpha"))
    fake_stdlib.write("b_held.py", CLASS_HEAD + method("test_beta"))
    fake_stdlib.held(10**9)
    assert select_prompts() == []


def test_main_writes_one_json_object_a_line(fake_stdlib, tmp_path: Path, capsys) -> None:
    fake_stdlib.write("a_held.py", "x = 1\n")
    for i in range(5):
        fake_stdlib.write(f"f{i}.py", CLASS_HEAD + method(f"test_{i}"))
    fake_stdlib.held(1)
    out = tmp_path / "new" / "dir" / "eval.jsonl"
    assert main(["--out", str(out), "--count", "3"]) == 0
    assert capsys.readouterr().out == f"wrote 3 prompts to {out}\n"
    text = out.read_text()
    assert text.endswith("\n") and text.count("\n") == 3
    assert [json.loads(line) for line in text.splitlines()] == select_prompts(3)
    assert json.loads(text.splitlines()[0]) == {"prompt": method("test_0").split("\n\n")[0] + "\n",
                                                "source": "test/f0.py:5"}


def test_main_needs_out(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "the following arguments are required: --out" in capsys.readouterr().err


@pytest.mark.skipif(not (train.stdlib_root() / "test").is_dir(), reason="this Python has no stdlib test/ folder")
def test_the_real_stdlib_gives_sixteen_unseen_test_methods() -> None:
    root = train.stdlib_root()
    held, total = set(), 0
    for path in train.heldout_files():  # the training script's own held-out rule
        held.add(path)
        total += len(train.read_text(path).encode())
        if total >= TrainConfig.heldout_bytes:
            break
    prompts = select_prompts()
    assert len(prompts) == 16
    for prompt in prompts:
        name, line = prompt["source"].rsplit(":", 1)
        assert name.startswith("test/") and (root / name) not in held
        lines = train.read_text(root / name).splitlines()
        assert prompt["prompt"] == "\n".join(lines[int(line) - 1:int(line) + 3]) + "\n"
        assert prompt["prompt"].startswith("    def test_") and len(prompt["prompt"]) <= 240
