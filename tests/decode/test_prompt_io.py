"""The prompt side of an engine: the end-of-sequence ids a generation config gives."""

from __future__ import annotations

from types import SimpleNamespace

from specter.decode.prompt_io import PromptIO, eos_ids


def test_eos_ids_take_one_id_several_or_none():
    assert eos_ids(SimpleNamespace(eos_token_id=[151645, 151643])) == (151645, 151643)
    assert eos_ids(SimpleNamespace(eos_token_id=2)) == (2,)
    assert eos_ids(SimpleNamespace(eos_token_id=None)) == () == eos_ids(SimpleNamespace())


def test_setting_the_eos_token_id_makes_it_the_only_one():
    prompt_io = PromptIO()
    prompt_io.eos_token_ids = (5, 7)
    assert prompt_io.eos_token_id == 5
    prompt_io.eos_token_id = 9
    assert prompt_io.eos_token_ids == (9,)
    prompt_io.eos_token_id = None
    assert prompt_io.eos_token_ids == () and prompt_io.eos_token_id is None
