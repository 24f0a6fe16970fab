"""Files a recipe names (``specter.config.files``): ``_find``'s lookup order (current directory,
then the recipe's directory; absolute and ``~`` paths as given) and ``read_texts``/``_read_prompts``
(``.jsonl`` one text per line, any other file one text) with their one-line ``RecipeError``s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specter.config.files import _find, _read_prompts, read_texts
from specter.errors import RecipeError

PROBE_FIELDS = ("text", "prompt")
ALLOWED_TEXT_OR_PROMPT = 'allowed: one JSON object per line with a non-empty string "text" or "prompt" field'
ALLOWED_PROMPT = 'allowed: one JSON object per line with a non-empty string "prompt" field'


def error_of(path: Path, key: str = "--probe", fields: tuple[str, ...] = PROBE_FIELDS) -> str:
    """The message ``read_texts`` raises for ``path``; every one is a single line."""
    with pytest.raises(RecipeError) as caught:
        read_texts(path, key, fields)
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    return message


# ----------------------------------------------------------------------------- _find


def test_find_prefers_the_current_directory_over_the_recipe_directory(tmp_path: Path, monkeypatch) -> None:
    cwd, recipe_dir = tmp_path / "cwd", tmp_path / "recipes"
    for folder in (cwd, recipe_dir):
        folder.mkdir()
        (folder / "p.txt").write_text("x")
    monkeypatch.chdir(cwd)
    assert _find("p.txt", recipe_dir, Path.is_file) == cwd / "p.txt"


def test_find_falls_back_to_the_recipe_directory(tmp_path: Path, monkeypatch) -> None:
    cwd, recipe_dir = tmp_path / "cwd", tmp_path / "recipes"
    cwd.mkdir()
    (recipe_dir / "sub").mkdir(parents=True)
    (recipe_dir / "sub" / "p.txt").write_text("x")
    monkeypatch.chdir(cwd)
    assert _find("sub/p.txt", recipe_dir, Path.is_file) == recipe_dir / "sub" / "p.txt"
    assert _find("sub/p.txt", None, Path.is_file) is None  # no recipe directory: only the current one


def test_find_returns_the_first_candidate_the_predicate_accepts(tmp_path: Path, monkeypatch) -> None:
    cwd, recipe_dir = tmp_path / "cwd", tmp_path / "recipes"
    cwd.mkdir()
    (cwd / "ckpt").write_text("a file, not the directory wanted")
    (recipe_dir / "ckpt").mkdir(parents=True)
    monkeypatch.chdir(cwd)
    assert _find("ckpt", recipe_dir, Path.is_dir) == recipe_dir / "ckpt"
    assert _find("ckpt", recipe_dir, Path.is_file) == cwd / "ckpt"
    assert _find("missing", recipe_dir, Path.exists) is None


def test_find_takes_an_absolute_path_as_given_and_never_joins_it_to_the_recipe_directory(tmp_path: Path) -> None:
    target = tmp_path / "abs.txt"
    target.write_text("x")
    recipe_dir = tmp_path / "recipes"
    seen: list[Path] = []

    def record(candidate: Path) -> bool:
        seen.append(candidate)
        return False

    assert _find(str(target), recipe_dir, Path.is_file) == target
    assert _find(str(tmp_path / "nope.txt"), recipe_dir, record) is None
    assert seen == [tmp_path / "nope.txt"]


def test_find_expands_the_home_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "prompts.jsonl").write_text("x")
    assert _find("~/prompts.jsonl", Path("/nonexistent"), Path.is_file) == tmp_path / "prompts.jsonl"


def test_find_looks_at_the_current_directory_then_the_recipe_directory_in_that_order(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    seen: list[Path] = []

    def record(candidate: Path) -> bool:
        seen.append(candidate)
        return False

    assert _find("a/b.txt", Path("/recipes"), record) is None
    assert seen == [tmp_path / "a" / "b.txt", Path("/recipes/a/b.txt")]


@pytest.mark.parametrize("error", [OSError("denied"), ValueError("embedded null byte")])
def test_find_treats_a_path_that_cannot_be_checked_as_not_found(error: Exception) -> None:
    def fails(candidate: Path) -> bool:
        raise error

    assert _find("anything.txt", Path("/recipes"), fails) is None


# ----------------------------------------------------------------------------- read_texts


def test_jsonl_gives_one_text_per_non_blank_line_in_file_order(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "one"}\n\n   \n{"prompt": "two\\nlines"}\r\n{"text": " three ", "id": 3}\n')
    assert read_texts(path, "--probe", PROBE_FIELDS) == ["one", "two\nlines", " three "]


def test_the_first_listed_field_an_object_has_is_taken(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "from prompt", "text": "from text"}) + "\n")
    assert read_texts(path, "k", ("text", "prompt")) == ["from text"]
    assert read_texts(path, "k", ("prompt", "text")) == ["from prompt"]


def test_a_first_field_that_is_not_a_string_is_an_error_even_when_a_later_one_is(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": 5, "prompt": "fine"}\n')
    assert error_of(path) == f'--probe: {path}:1: no string "text" or "prompt" field; {ALLOWED_TEXT_OR_PROMPT}'


@pytest.mark.parametrize("suffix", [".txt", ".json", ".md", ""])
def test_any_other_file_is_one_text_verbatim(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"prompt{suffix}"
    text = '{"text": "not parsed"}\n\nsecond paragraph | with a pipe\n'
    path.write_text(text)
    assert read_texts(path, "--probe", PROBE_FIELDS) == [text]


def test_an_empty_text_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.txt"
    path.write_text("")
    assert error_of(path) == f"--probe: {path} is empty; allowed: a non-empty text file"


def test_a_jsonl_file_without_texts_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "blank.jsonl"
    path.write_text("\n  \n\n")
    assert error_of(path) == f"--probe: {path} holds no texts; {ALLOWED_TEXT_OR_PROMPT}"


def test_invalid_json_names_the_file_and_line_counting_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": \n')
    message = error_of(path)
    assert message.startswith(f"--probe: {path}:3: invalid JSON (")
    assert message.endswith(f"); {ALLOWED_TEXT_OR_PROMPT}")


@pytest.mark.parametrize("line", ['["a list"]', '"a bare string"', "7", "null", '{"text": ""}', '{"other": "x"}',
                                  '{"text": ["a"]}'])
def test_a_line_without_a_non_empty_string_field_is_refused(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    assert error_of(path) == f'--probe: {path}:2: no string "text" or "prompt" field; {ALLOWED_TEXT_OR_PROMPT}'


def test_unreadable_files_are_one_line_errors(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    assert error_of(missing).startswith(f"--probe: cannot read {missing}: [Errno 2] No such file or directory")
    assert error_of(tmp_path).startswith(f"--probe: cannot read {tmp_path}: [Errno 21] Is a directory")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9\n".encode("latin-1"))
    assert error_of(latin1).startswith(f"--probe: cannot read {latin1}: 'utf-8' codec can't decode byte 0xe9")


def test_a_path_that_is_not_printable_is_shown_as_its_repr(tmp_path: Path) -> None:
    path = tmp_path / "tab\there.txt"
    path.write_text("")
    assert error_of(path) == f"--probe: {str(path)!r} is empty; allowed: a non-empty text file"


# ----------------------------------------------------------------------------- _read_prompts


def test_read_prompts_reads_the_prompt_field_under_the_prompts_file_key(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "def f():"}\n{"prompt": "x = 1", "text": "ignored"}\n')
    assert _read_prompts(path) == ["def f():", "x = 1"]
    plain = tmp_path / "p.txt"
    plain.write_text("one whole prompt\n")
    assert _read_prompts(plain) == ["one whole prompt\n"]


def test_read_prompts_does_not_accept_a_text_field(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "not a prompt"}\n')
    with pytest.raises(RecipeError) as caught:
        _read_prompts(path)
    assert str(caught.value) == f'prompts_file: {path}:1: no string "prompt" field; {ALLOWED_PROMPT}'


def test_a_jsonl_suffix_in_capitals_is_still_one_text_per_line(tmp_path: Path) -> None:
    path = tmp_path / "T.JSONL"
    path.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    assert read_texts(path, "--probe", PROBE_FIELDS) == ["one", "two"]
