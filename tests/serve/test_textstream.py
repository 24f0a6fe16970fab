"""specter.serve.textstream: deltas never split a character, never show a stop string or part of
one, and add up to the final text. A byte-level fake tokenizer (one token per UTF-8 byte) makes
every multi-byte character span several tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specter.serve.textstream import TextStream

EOS = 256


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def ids_of(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def feed(text: str, stop=(), eos: bool = False) -> tuple[list[str], TextStream]:
    """Feed ``text`` token by token as an engine would (ids so far each step), then the final
    update; returns the deltas and the stream."""
    stream = TextStream(decode, stop, EOS)
    ids = ids_of(text) + ([EOS] if eos else [])
    deltas = []
    for n in range(1, len(ids) + 1):
        delta, stopped = stream.update(ids[:n])
        deltas.append(delta)
        if stopped:
            return deltas, stream
    deltas.append(stream.update(ids, final=True)[0])
    return deltas, stream


def test_multibyte_characters_are_never_split():
    deltas, stream = feed("héllo wörld → 世界 🎉")
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == stream.text == "héllo wörld → 世界 🎉"
    assert "世" in deltas  # the three bytes of 世 came out together, once complete


def test_the_end_of_sequence_token_is_not_text():
    deltas, stream = feed("done", eos=True)
    assert "".join(deltas) == "done" and stream.ended_by_eos and not stream.stopped


def test_any_of_several_end_of_sequence_tokens_is_not_text():
    stream = TextStream(decode, (), (EOS, EOS + 1))
    assert stream.update(ids_of("ok") + [EOS + 1], final=True) == ("ok", False) and stream.ended_by_eos
    alone = TextStream(decode, (), None)
    assert alone.update(ids_of("ok"), final=True) == ("ok", False) and not alone.ended_by_eos


def test_a_stop_string_cuts_the_text_before_it_and_is_never_sent():
    deltas, stream = feed("x = 1\nreturn x\n", stop=["return"])
    assert stream.stopped and stream.text == "x = 1\n" == "".join(deltas)
    assert not any("r" in d for d in deltas)  # not even the stop's first letters went out


def test_a_partial_stop_is_held_back_then_released_when_it_does_not_complete():
    stream = TextStream(decode, ["abc"], EOS)
    assert stream.update(ids_of("xa")) == ("x", False)
    assert stream.update(ids_of("xab")) == ("", False)
    assert stream.update(ids_of("xabd")) == ("abd", False)
    assert stream.update(ids_of("xabd"), final=True) == ("", False)


def test_the_earliest_of_several_stops_wins_and_a_final_update_flushes():
    deltas, stream = feed("one two three", stop=["three", "two"])
    assert stream.text == "one "
    stream = TextStream(decode, ["zz"], EOS)
    assert stream.update(ids_of("az")) == ("a", False)
    assert stream.update(ids_of("az"), final=True) == ("z", False)  # generation ended: nothing to wait for


def test_an_invalid_byte_sequence_comes_out_as_replacement_at_the_end():
    stream = TextStream(decode, (), EOS)
    assert stream.update([0x68, 0xE4]) == ("h", False)
    assert stream.update([0x68, 0xE4], final=True) == ("\ufffd", False)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab \n→é世🎉")), max_size=40),
       stops=st.lists(st.text(alphabet=st.sampled_from(list("ab→é")), min_size=1, max_size=3), max_size=3))
def test_deltas_add_up_to_the_text_cut_at_the_first_stop_to_appear(text, stops):
    deltas, stream = feed(text, stop=stops)
    expected, hit = text, False
    for end in range(1, len(text) + 1):  # the text grows a character at a time
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            expected, hit = text[:min(starts)], True
            break
    assert "".join(deltas) == stream.text == expected
    assert stream.stopped == hit
    assert all("\ufffd" not in d for d in deltas)
