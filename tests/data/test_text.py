"""Character-level text data: stdlib source, tokenizer, chunks, split, unigram baseline."""

import json
import math

import pytest
import torch

from meshtrain.data import text as text_module
from meshtrain.data.text import (
    CharChunks,
    CharTokenizer,
    split_tokens,
    stdlib_text,
    unigram_cross_entropy,
)
from meshtrain.errors import ConfigError


def test_stdlib_text_is_deterministic_bounded_python_source():
    a = stdlib_text(max_chars=50_000)
    assert len(a) == 50_000
    assert a == stdlib_text(max_chars=50_000)
    assert "def " in a and "import " in a
    assert stdlib_text(max_chars=1000) == a[:1000]


def test_stdlib_text_missing_sources_raise_config_error(monkeypatch, tmp_path):
    monkeypatch.setattr(text_module.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(ConfigError, match="no standard-library source files"):
        stdlib_text()
    with pytest.raises(ConfigError, match="max_chars"):
        stdlib_text(0)


def test_tokenizer_round_trip_and_sorted_vocab():
    tok = CharTokenizer.from_text("hello, world")
    assert tok.chars == sorted(set("hello, world"))
    assert tok.vocab_size == 9  # " ,dehlorw"
    ids = tok.encode("world hello")
    assert ids.dtype == torch.long and ids.shape == (11,)
    assert tok.decode(ids) == "world hello"
    assert tok.encode(" ").tolist() == [0]  # space sorts first
    assert tok.encode("").shape == (0,)


def test_tokenizer_non_ascii_and_dict_round_trip():
    text = "naïve café — λx: x² ✓\n"
    tok = CharTokenizer.from_text(text)
    restored = CharTokenizer.from_dict(json.loads(json.dumps(tok.to_dict())))
    assert restored.vocab_size == tok.vocab_size
    assert torch.equal(restored.encode(text), tok.encode(text))
    assert restored.decode(tok.encode(text)) == text


def test_tokenizer_with_unsorted_vocab_maps_chars_to_their_positions():
    tok = CharTokenizer(["z", "a", "m"])
    assert tok.encode("amz").tolist() == [1, 2, 0]
    assert tok.decode([0, 1, 2]) == "zam"


def test_tokenizer_errors():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ConfigError, match=r"not in the vocabulary.*'d'"):
        tok.encode("abd")
    with pytest.raises(ConfigError, match=r"\[0, 3\)"):
        tok.decode([0, 3])
    with pytest.raises(ConfigError, match="at least one character"):
        CharTokenizer.from_text("")
    with pytest.raises(ConfigError, match="to_dict"):
        CharTokenizer.from_dict({"chars": "abc"})


def test_char_chunks_shift_by_one():
    tokens = torch.arange(23)
    ds = CharChunks(tokens, seq_len=5)
    assert len(ds) == 4  # (23 - 1) // 5
    x, y = ds[1]
    assert x.tolist() == [5, 6, 7, 8, 9]
    assert y.tolist() == [6, 7, 8, 9, 10]
    x, y = ds[3]
    assert y.tolist() == [16, 17, 18, 19, 20]
    assert torch.equal(ds[-1][0], ds[3][0])
    with pytest.raises(IndexError):
        ds[4]
    assert len(CharChunks(torch.arange(21), seq_len=5)) == 4
    assert len(CharChunks(torch.arange(20), seq_len=5)) == 3


def test_char_chunks_too_short():
    with pytest.raises(ConfigError, match="need at least 6"):
        CharChunks(torch.arange(5), seq_len=5)
    with pytest.raises(ConfigError, match="seq_len"):
        CharChunks(torch.arange(50), seq_len=0)


def test_split_tokens_tail_is_validation():
    train, val = split_tokens(torch.arange(100), 0.1)
    assert train.tolist() == list(range(90))
    assert val.tolist() == list(range(90, 100))
    with pytest.raises(ConfigError, match="val_fraction"):
        split_tokens(torch.arange(100), 1.0)
    with pytest.raises(ConfigError, match="empty split"):
        split_tokens(torch.arange(3), 0.01)


def test_unigram_cross_entropy_matches_hand_computation():
    train = torch.tensor([0, 0, 0, 1])  # counts + 1 -> [4, 2, 1], total 7
    ce = unigram_cross_entropy(train, torch.tensor([0, 2]), vocab_size=3)
    assert ce == pytest.approx(-(math.log(4 / 7) + math.log(1 / 7)) / 2)
    # A uniform train set gives log(vocab_size).
    uniform = unigram_cross_entropy(torch.arange(8), torch.tensor([3]), 8)
    assert uniform == pytest.approx(math.log(8))
    with pytest.raises(ConfigError, match="vocab_size"):
        unigram_cross_entropy(train, torch.tensor([5]), vocab_size=3)


def test_unigram_baseline_on_stdlib_text_is_below_uniform():
    tok = CharTokenizer.from_text(stdlib_text(200_000))
    tokens = tok.encode(stdlib_text(200_000))
    train, val = split_tokens(tokens, 0.1)
    ce = unigram_cross_entropy(train, val, tok.vocab_size)
    assert 2.0 < ce < math.log(tok.vocab_size)
