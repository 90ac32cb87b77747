"""Incremental detokenization and stop strings (no model)."""

from __future__ import annotations

import random

import pytest

from trtllm_glm.runtime.tokenizer import ByteTokenizer
from trtllm_glm.serve.output import IncrementalDetokenizer, OutputProcessor, TokenStrings

pytestmark = pytest.mark.cpu_only

TOK = ByteTokenizer(264, bos_id=256, eos_id=257, pad_id=258)


def feed(proc: OutputProcessor, ids: list[int]) -> tuple[list[str], int]:
    """Pieces released per token (plus the final flush) and the tokens consumed before a stop."""
    pieces = []
    n = 0
    for t in ids:
        pieces.append(proc.add(t))
        n += 1
        if proc.stopped:
            return pieces, n
    pieces.append(proc.finish())
    return pieces, n


def test_streamed_text_equals_whole_decode_on_random_bytes() -> None:
    rng = random.Random(0)
    alphabet = list("aé中😀\n ") + ["\ud7ff"]
    for _ in range(300):
        ids: list[int] = []
        for _ in range(rng.randrange(1, 30)):
            r = rng.random()
            if r < 0.6:
                ids.extend(rng.choice(alphabet).encode("utf-8", "surrogatepass"))
            elif r < 0.8:
                ids.append(rng.randrange(256))  # any byte, often invalid UTF-8
            else:
                ids.append(rng.randrange(256, 264))  # specials and spare ids decode to nothing
        d = IncrementalDetokenizer(TOK)
        pieces = [d.add(t) for t in ids] + [d.flush()]
        assert "".join(pieces) == TOK.decode(ids) == d.text


def test_half_a_character_is_held_back() -> None:
    d = IncrementalDetokenizer(TOK)
    a, b = "é".encode()
    assert d.add(ord("x")) == "x"
    assert d.add(a) == ""
    assert d.add(257) == ""  # a special in the middle of a character changes nothing
    assert d.add(b) == "é"


def test_stop_string_across_tokens_is_cut_and_never_streamed() -> None:
    p = OutputProcessor(TOK, ["END"])
    pieces, n = feed(p, list(b"abcENDxyz"))
    assert "".join(pieces) == p.text == "abc"
    assert p.stopped and n == 6  # tokens after the stop string are not consumed
    assert "E" not in "".join(pieces)


def test_partial_stop_prefix_released_when_it_diverges() -> None:
    p = OutputProcessor(TOK, ["END"])
    pieces, n = feed(p, list(b"aENxEND"))
    assert pieces[:4] == ["a", "", "", "ENx"]
    assert p.text == "aENx" and p.stopped and n == 7


def test_earliest_of_several_stop_strings_wins_and_finish_flushes() -> None:
    p = OutputProcessor(TOK, ["zz", "b"])
    pieces, _ = feed(p, list(b"azzb"))
    assert p.text == "a" and p.stopped
    q = OutputProcessor(TOK, ["xyz"])
    pieces, n = feed(q, list(b"abxy"))
    assert "".join(pieces) == "abxy" and not q.stopped and n == 4  # the held "xy" comes out at the end


def test_stop_string_inside_a_multibyte_character_stream() -> None:
    p = OutputProcessor(TOK, ["中"])
    _, n = feed(p, list("a中b".encode()))
    assert p.text == "a" and p.stopped and n == 4


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        OutputProcessor(TOK, [""])


def test_token_strings_bytes_and_specials() -> None:
    ts = TokenStrings(TOK)
    assert ts(ord("a")) == ("a", [97])
    assert ts("é".encode()[0]) == ("bytes:\\xc3", [0xC3])
    assert ts(257) == ("<|eos|>", list(b"<|eos|>"))
    assert ts(261) == ("token_id:261", [])
    # Distinct tokens get distinct strings (completions key top_logprobs by them).
    assert len({ts(t)[0] for t in range(264)}) == 264
