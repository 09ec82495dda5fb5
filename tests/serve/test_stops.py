"""Text as tokens come: characters split across tokens come whole, and the text ends before the first
stop string, held back while it may be starting one."""
import pytest

from selfattn.serve.stops import Detokenizer
from selfattn.tokenizers import ByteTokenizer


def _pieces(text: str, stops=()) -> tuple[list[str], Detokenizer]:
    detok = Detokenizer(ByteTokenizer(), stops)
    pieces = []
    for byte in text.encode():
        pieces.append(detok.push(byte))
        if detok.stopped:
            break
    return pieces + [detok.flush()], detok


def test_a_character_split_across_tokens_comes_whole():
    pieces, detok = _pieces("aé€")
    assert pieces == ["a", "", "é", "", "", "€", ""] and not detok.stopped


@pytest.mark.parametrize("text, stops, let_out, stopped", [
    ("hello world", ("wor",), "hello ", True),  # held "w", "wo" then the stop completes
    ("hello world", ("word",), "hello world", False),  # "wor" was held, then let out: no stop
    ("a stop", ("stop", " s"), "a", True),  # the earliest stop string wins
    ("stop at once", ("stop",), "", True),
    ("ends with a prefix: st", ("stop",), "ends with a prefix: st", False),  # flushed at the end
    ("é!", ("\u00e9",), "", True),  # a stop string of a character of two bytes
])
def test_the_text_ends_before_the_first_stop_string(text, stops, let_out, stopped):
    pieces, detok = _pieces(text, stops)
    assert "".join(pieces) == let_out and detok.stopped == stopped


def test_held_text_is_let_out_as_soon_as_no_stop_string_can_start_there():
    detok = Detokenizer(ByteTokenizer(), ("abc",))
    assert [detok.push(b) for b in b"xabx"] == ["x", "", "", "abx"]


def test_nothing_follows_a_stop_string_and_empty_stop_strings_are_refused():
    _, detok = _pieces("ab", ("b",))
    with pytest.raises(ValueError, match="ended at a stop string"):
        detok.push(1)
    with pytest.raises(ValueError, match="non-empty strings, got"):
        Detokenizer(ByteTokenizer(), ("",))
