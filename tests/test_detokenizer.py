"""The streaming detokenizer on adversarial input: characters split across tokens, stop
strings split across tokens, stop strings that overlap, and text that only looks like one."""

from __future__ import annotations

import random

import pytest

from minillm.decoding.detokenizer import IncrementalDetokenizer
from minillm.data.tokenizer import get_tokenizer

MULTIBYTE = "A llama 🦙 says こんにちは, 你好世界 and 日本語 😀!"


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


class Chunks:
    """A stand-in tokenizer whose token ``i`` is ``chunks[i]``: any split of any bytes."""

    eot = -1

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def token_bytes(self, token_id: int) -> bytes:
        return self.chunks[token_id]


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Every piece ``add`` returns, stopping where the detokenizer stops, then ``flush``."""
    pieces = []
    for token in ids:
        pieces.append(detok.add(token))
        if detok.stopped:
            break
    return pieces + [detok.flush()]


def split_randomly(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), rng.randint(0, len(data) - 1)))
    return [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]


def run_chunks(chunks: list[bytes], stop: list[str]) -> tuple[str, str | None]:
    detok = IncrementalDetokenizer(Chunks(chunks), stop)
    return "".join(stream(detok, list(range(len(chunks))))), detok.stop_reason


def test_split_characters_are_held_until_complete(tok):
    ids = tok.encode(MULTIBYTE)
    halves = [i for i in ids if not valid_utf8(tok.token_bytes(i))]
    assert len(halves) >= 8  # the test is only adversarial if tokens really split characters
    detok = IncrementalDetokenizer(tok)
    pieces = stream(detok, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tok.decode(ids) == MULTIBYTE
    llama = tok.encode(" 🦙")
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in llama] == [" ", "", "🦙"]


def valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("seed", range(20))
def test_any_split_of_the_bytes_gives_the_full_decode(seed):
    data = MULTIBYTE.encode() + b" \xff stray \x80 bytes \xe6\x97"
    chunks = split_randomly(data, random.Random(seed))
    pieces = stream(IncrementalDetokenizer(Chunks(chunks)), list(range(len(chunks))))
    assert "".join(pieces) == data.decode("utf-8", errors="replace")


def test_a_byte_that_can_never_complete_is_replaced_at_once(tok):
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode(" hi")[0]) == " hi"
    assert detok.add(tok.encode("🦙")[1]) == "\ufffd"  # a lone continuation byte


def test_flush_turns_a_dangling_partial_character_into_a_replacement(tok):
    ids = tok.encode("hi 🦙")[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add(i) for i in ids) == "hi "
    assert detok.flush() == "\ufffd" == tok.decode(ids)[len("hi "):]
    assert not detok.stopped


def test_a_stop_string_spanning_three_tokens(tok):
    ids = tok.encode("Once upon a time there was a llama.")
    stop = "upon a ti"
    assert [tok.decode([i]) for i in ids[1:4]] == [" upon", " a", " time"]
    detok = IncrementalDetokenizer(tok, [stop])
    pieces = stream(detok, ids)
    assert detok.stopped and detok.stop_reason == stop
    assert "".join(pieces) == "Once "
    assert len(pieces) == 5  # stopped at the fourth token, then flushed


def test_a_stop_string_that_starts_inside_text_held_for_another(tok):
    # " End" is held as the start of "The Endgame"; "End." then completes inside it.
    detok = IncrementalDetokenizer(tok, ["The Endgame", "End."])
    pieces = stream(detok, tok.encode("It was The End. More"))
    assert detok.stop_reason == "End."
    assert "".join(pieces) == "It was The "


@pytest.mark.parametrize("stop", [["ab", "abc"], ["abc", "ab"]])
def test_overlapping_stop_strings_first_completed_wins(stop):
    for chunks in ([b"xxabcx"], [b"xx", b"a", b"b", b"c"], [b"x", b"xabc", b"x"]):
        assert run_chunks(chunks, stop) == ("xx", "ab")


def test_the_stop_string_completed_first_wins_not_the_one_starting_first():
    # "abcde" starts first, but "bcd" is complete one character earlier.
    for chunks in ([b"abcdef"], [b"a", b"b", b"c", b"d", b"e", b"f"]):
        assert run_chunks(chunks, ["abcde", "bcd"]) == ("a", "bcd")


@pytest.mark.parametrize("seed", range(20))
def test_stop_results_do_not_depend_on_the_token_split(seed):
    text = "Lily said 日本語 🦙 the end. THE END? The End!! tail".encode()
    stops = ["The End!", "🦙 t", "end?", "END", "日本語 🦙 the e"]
    rng = random.Random(seed)
    chosen = rng.sample(stops, rng.randint(1, len(stops)))
    assert run_chunks(split_randomly(text, rng), chosen) == run_chunks([text], chosen)


def test_a_stop_string_in_the_very_first_token(tok):
    detok = IncrementalDetokenizer(tok, ["Hello"])
    assert detok.add(tok.encode("Hello world")[0]) == ""
    assert detok.stopped and detok.flush() == ""


def test_text_that_only_looks_like_a_stop_string_is_released(tok):
    ids = tok.encode("The Enders said the End.")
    detok = IncrementalDetokenizer(tok, ["The End."])
    pieces = [detok.add(i) for i in ids]
    assert pieces[:3] == ["", "", "The Enders"]  # held while it might be "The End."
    assert not detok.stopped
    assert "".join(pieces) + detok.flush() == "The Enders said the End."


def test_held_stop_prefix_is_released_by_flush(tok):
    detok = IncrementalDetokenizer(tok, ["\n\nTHE END"])
    pieces = stream(detok, tok.encode("and they played.\n\nTHE"))
    assert pieces[-1] == "\n\nTHE" and not detok.stopped
    assert "".join(pieces) == "and they played.\n\nTHE"


def test_a_stop_string_across_a_split_character(tok):
    ids = tok.encode("Hi 🦙 friend")
    detok = IncrementalDetokenizer(tok, ["🦙"])
    assert "".join(stream(detok, ids)) == "Hi " and detok.stop_reason == "🦙"


def test_end_of_text_adds_nothing(tok):
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode("Hi")[0]) == "Hi"
    assert detok.add(tok.eot) == ""
    assert detok.flush() == ""


def test_finished_detokenizers_refuse_more_tokens(tok):
    stopped = IncrementalDetokenizer(tok, ["Hi"])
    stopped.add(tok.encode("Hi")[0])
    flushed = IncrementalDetokenizer(tok)
    flushed.flush()
    for detok in (stopped, flushed):
        with pytest.raises(RuntimeError, match="finished"):
            detok.add(0)
        assert detok.flush() == ""


@pytest.mark.parametrize("stop", [[""], ["ok", ""], [3]])
def test_bad_stop_strings_are_refused(tok, stop):
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tok, stop)


def test_a_single_string_is_one_stop_string(tok):
    detok = IncrementalDetokenizer(tok, "ab")
    assert "".join(stream(detok, tok.encode("a b ab"))) == "a b " and detok.stop_reason == "ab"


@pytest.mark.parametrize("seed", range(100))
def test_held_text_is_exactly_the_longest_stop_prefix_at_every_token(seed):
    """After every token, what is held back is the longest suffix of the text read that a
    stop string could still complete, checked by brute force over a two-letter alphabet
    (where self-overlapping stops such as "abab" and "aab" are common)."""
    rng = random.Random(seed)
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(2, 7))) for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choice("ab") for _ in range(60))
    chunks = [c for c in split_randomly(text.encode(), rng)]
    detok = IncrementalDetokenizer(Chunks(chunks), stops)
    read = released = ""
    for i, chunk in enumerate(chunks):
        released += detok.add(i)
        read += chunk.decode()
        if detok.stopped:
            break
        expected = max((k for s in stops for k in range(1, len(s)) if read.endswith(s[:k])), default=0)
        assert released == read[: len(read) - expected], (stops, read)


def test_a_long_stop_string_is_held_in_memory_linear_in_its_length(tok):
    """A stop string of 100,000 characters: held as every one of its prefixes it would take
    about 5 x 10^9 characters; the failure table is one integer per character."""
    stop = "ab" * 50_000
    detok = IncrementalDetokenizer(tok, [stop])
    assert sum(len(m.fail) for m in detok._matches) == len(stop)
    pieces = stream(detok, tok.encode("ab" * 300 + " and more"))
    assert not detok.stopped and "".join(pieces) == "ab" * 300 + " and more"
