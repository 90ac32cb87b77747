"""ByteTokenizer round trips and specials; load_tokenizer selection and the optional ``tokenizers`` path."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from trtllm_glm.config import Glm5NextConfig
from trtllm_glm.runtime.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

pytestmark = pytest.mark.cpu_only


@pytest.fixture
def tok() -> ByteTokenizer:
    return ByteTokenizer(264, bos_id=256, eos_id=257, pad_id=258)


@pytest.mark.parametrize("text", ["hello", "Grüße, 世界! 🚀", "", "a\x00b\n\tc"])
def test_unicode_round_trip(tok, text) -> None:
    ids = tok.encode(text)
    assert ids[0] == 256 and ids[1:] == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode(torch.tensor(ids)) == text


def test_specials_skipped_or_named(tok) -> None:
    ids = [256, *b"hi", 257, 258, *b"!"]
    assert tok.decode(ids) == "hi!"
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>hi<|eos|><|pad|>!"
    assert tok.special_ids == {256, 257, 258}


def test_bad_ids_handled(tok) -> None:
    # Spare ids above the specials decode to nothing; a cut UTF-8 sequence becomes U+FFFD.
    assert tok.decode([*b"a", 260, 263, *b"b"]) == "ab"
    euro = "€".encode()
    assert tok.decode(list(euro[:2]) + list(b"x")) == "\ufffdx"
    assert tok.decode_bytes([256, *euro[:2], 261]) == euro[:2]
    with pytest.raises(ValueError, match="outside"):
        tok.decode([1, 264])
    with pytest.raises(ValueError, match="outside"):
        tok.decode([-1])


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(200, None, None, None)
    with pytest.raises(ValueError, match="bos_id"):
        ByteTokenizer(264, bos_id=65, eos_id=None, pad_id=None)
    with pytest.raises(ValueError, match="eos_id"):
        ByteTokenizer(264, bos_id=None, eos_id=264, pad_id=None)
    t = ByteTokenizer(256, None, None, None)
    assert t.encode("x") == [ord("x")]


def test_load_tokenizer_byte_fallback(tmp_path) -> None:
    cfg = Glm5NextConfig.from_pretrained("tiny")
    for src in ("tiny", tmp_path):
        t = load_tokenizer(src, cfg)
        assert isinstance(t, ByteTokenizer)
        assert (t.vocab_size, t.bos_id, t.eos_id, t.pad_id) == (264, 256, 257, 258)


def test_load_tokenizer_missing_package(tmp_path, monkeypatch) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` raise ImportError
    with pytest.raises(ImportError, match="'tokenizers' package"):
        load_tokenizer(tmp_path, Glm5NextConfig.from_pretrained("tiny"))


def test_load_tokenizer_hf_path_with_stub(tmp_path, monkeypatch) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    calls = {}

    class StubTok:
        @classmethod
        def from_file(cls, path):
            calls["path"] = path
            return cls()

        def encode(self, text, add_special_tokens=True):
            calls["add_special_tokens"] = add_special_tokens
            return types.SimpleNamespace(ids=[ord(c) % 200 + 10 for c in text])

        def decode(self, ids, skip_special_tokens=True):
            calls["skip"] = skip_special_tokens
            return "".join(chr(i - 10) for i in ids if i >= 10)

    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=StubTok))
    cfg = Glm5NextConfig.from_pretrained("tiny")
    t = load_tokenizer(tmp_path, cfg)
    assert isinstance(t, HFTokenizer)
    assert calls["path"] == str(tmp_path / "tokenizer.json")
    ids = t.encode("abc")
    assert ids == [cfg.bos_token_id, ord("a") + 10, ord("b") + 10, ord("c") + 10]
    assert calls["add_special_tokens"] is False
    assert t.encode("abc", add_bos=False) == ids[1:]
    assert t.decode(torch.tensor(ids[1:]), skip_special_tokens=False) == "abc"
    assert calls["skip"] is False
    assert t.eos_id == 257


def test_load_tokenizer_real_tokenizers(tmp_path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    hf = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(tmp_path, Glm5NextConfig.from_pretrained("tiny"))
    assert t.encode("hello world", add_bos=False) == [1, 2]
    assert t.decode([1, 2]) == "hello world"
