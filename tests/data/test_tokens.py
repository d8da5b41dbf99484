"""Token shards: writer round trip, packed windows across shards, positions, pickling, checks."""

import json
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from meshtrain.data.tokens import (
    PackedTokens,
    TokenShardWriter,
    check_model_vocab,
    check_tokenizer,
    file_sha256,
    read_meta,
)
from meshtrain.errors import ConfigError

EOS = 0


def _docs(seed=0, n=23, vocab=50):
    rng = np.random.default_rng(seed)
    # ids 1..vocab-1, so the only eos tokens are the ones the writer appends; one empty document
    docs = [rng.integers(1, vocab, size=int(rng.integers(0, 12))).tolist() for _ in range(n)]
    docs[3] = []
    return docs


def _write(folder, docs, *, vocab=50, shard_tokens=7, sha="abc"):
    with TokenShardWriter(folder, vocab, EOS, sha, shard_tokens=shard_tokens) as w:
        for d in docs:
            w.add_document(d)
    return read_meta(folder)


def _stream(docs):
    return [t for d in docs for t in [*d, EOS]]


def test_round_trip_exact_stream_and_format(tmp_path):
    docs = _docs()
    meta = _write(tmp_path / "s", docs)
    stream = _stream(docs)
    assert meta["format"] == "meshtrain-tokens/1" and meta["dtype"] == "uint16"
    assert meta["num_tokens"] == len(stream) and meta["num_docs"] == len(docs)
    assert [s["num_tokens"] for s in meta["shards"][:-1]] == [7] * (len(meta["shards"]) - 1)
    raw = np.concatenate([np.fromfile(tmp_path / "s" / s["tokens"], dtype="<u2")
                          for s in meta["shards"]])
    assert raw.tolist() == stream
    # docs files: in-shard offsets of every document start, each listed in the shard it starts in
    starts = np.cumsum([0] + [len(d) + 1 for d in docs[:-1]])
    listed = np.concatenate([np.fromfile(tmp_path / "s" / s["docs"], dtype="<i8") + 7 * k
                             for k, s in enumerate(meta["shards"])])
    assert listed.tolist() == starts.tolist()
    assert sum(s["num_docs"] for s in meta["shards"]) == len(docs)
    ds = PackedTokens(tmp_path / "s", 4)
    assert ds.read(0, len(stream)).tolist() == stream
    assert ds.vocab_size == 50 and ds.eos_id == EOS and ds.meta["tokenizer_sha256"] == "abc"


def test_large_vocab_uses_uint32(tmp_path):
    _write(tmp_path / "s", [[70_000, 1, 65_536]], vocab=70_001, shard_tokens=100)
    meta = read_meta(tmp_path / "s")
    assert meta["dtype"] == "uint32"
    assert (tmp_path / "s" / "tokens_00000.bin").stat().st_size == 4 * 4
    ds = PackedTokens(tmp_path / "s", 3)
    assert ds[0][0].tolist() == [70_000, 1, 65_536] and ds[0][1].tolist() == [1, 65_536, EOS]


@pytest.mark.parametrize("seq_len", [1, 3, 5, 8, 16])
def test_packed_windows_across_shard_boundaries(tmp_path, seq_len):
    docs = _docs(seed=seq_len)
    _write(tmp_path / "s", docs, shard_tokens=5)
    stream = torch.tensor(_stream(docs))
    ds = PackedTokens(tmp_path / "s", seq_len)
    assert len(ds) == (len(stream) - 1) // seq_len
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == torch.int64 and x.shape == (seq_len,)
        assert torch.equal(x, stream[i * seq_len : (i + 1) * seq_len])
        assert torch.equal(y, stream[i * seq_len + 1 : (i + 1) * seq_len + 1])  # shifted by one
    assert torch.equal(ds[-1][0], ds[len(ds) - 1][0])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_dict_batches_and_document_positions(tmp_path):
    docs = _docs(seed=3, n=40)
    _write(tmp_path / "s", docs, shard_tokens=6)
    stream = _stream(docs)
    expected, pos = [], 0
    for t in stream:  # restart at 0 after every eos
        expected.append(pos)
        pos = 0 if t == EOS else pos + 1
    seq_len = 9
    ds = PackedTokens(tmp_path / "s", seq_len, dict_batches=True, document_positions=True)
    for i in range(len(ds)):
        s = ds[i]
        assert set(s) == {"input_ids", "labels", "position_ids"}
        assert s["input_ids"].tolist() == stream[i * seq_len : (i + 1) * seq_len]
        assert torch.equal(s["labels"], s["input_ids"])  # Hugging Face convention
        assert s["position_ids"].tolist() == expected[i * seq_len : (i + 1) * seq_len], i
    plain = PackedTokens(tmp_path / "s", seq_len, dict_batches=True)
    assert set(plain[0]) == {"input_ids", "labels"}
    with pytest.raises(ConfigError, match="dict_batches=True"):
        PackedTokens(tmp_path / "s", seq_len, document_positions=True)


def test_document_mask_drops_the_targets_that_cross_a_document(tmp_path):
    docs = _docs(seed=3, n=40)
    _write(tmp_path / "s", docs, shard_tokens=6)
    stream = _stream(docs)
    seq_len = 9
    ds = PackedTokens(tmp_path / "s", seq_len, dict_batches=True, document_mask=True)
    positioned = PackedTokens(tmp_path / "s", seq_len, dict_batches=True,
                              document_positions=True)
    cut = 0
    for i in range(len(ds)):
        s, p = ds[i], positioned[i]
        assert torch.equal(s["position_ids"], p["position_ids"])
        for t in range(1, seq_len):  # labels[t] is token t-1's target (transformers' shift)
            crosses = stream[i * seq_len + t - 1] == EOS  # an eos: the next document's token
            assert s["labels"][t].item() == (-100 if crosses else stream[i * seq_len + t])
            cut += crosses
    assert cut > 5
    # (input, target) pairs: the target of each eos (another document's first token) is cut
    pairs = PackedTokens(tmp_path / "s", seq_len, document_mask=True)
    for i in range(len(pairs)):
        x, y = pairs[i]
        assert x.tolist() == stream[i * seq_len:(i + 1) * seq_len]
        want = [-100 if stream[t] == EOS else stream[t + 1]
                for t in range(i * seq_len, (i + 1) * seq_len)]
        assert y.tolist() == want, i


def test_position_of_a_document_spanning_many_shards(tmp_path):
    docs = [[1, 2], list(range(1, 30)), [3]]
    _write(tmp_path / "s", docs, shard_tokens=4)
    ds = PackedTokens(tmp_path / "s", 4, dict_batches=True, document_positions=True)
    # sample 5 = stream[20:24], inside the long document that started at stream offset 3
    assert ds[5]["position_ids"].tolist() == [17, 18, 19, 20]
    assert ds[0]["position_ids"].tolist() == [0, 1, 2, 0]


def test_lazy_open_pickle_and_dataloader_workers(tmp_path):
    docs = _docs(seed=5, n=200)
    _write(tmp_path / "s", docs, shard_tokens=64)
    ds = PackedTokens(tmp_path / "s", 8, dict_batches=True, document_positions=True)
    assert ds._maps == {}  # opening mapped nothing
    first = ds[3]
    assert ds._maps
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._maps == {}
    assert all(torch.equal(first[k], clone[3][k]) for k in first)
    loader = DataLoader(ds, batch_size=4, num_workers=2, shuffle=False)
    batches = list(loader)
    assert sum(len(b["input_ids"]) for b in batches) == len(ds)
    direct = torch.stack([ds[i]["position_ids"] for i in range(len(ds))])
    assert torch.equal(torch.cat([b["position_ids"] for b in batches]), direct)
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]),
                       torch.stack([ds[i]["input_ids"] for i in range(len(ds))]))


def test_damaged_or_missing_folders_raise(tmp_path):
    with pytest.raises(ConfigError, match="not a finished token-shard folder"):
        PackedTokens(tmp_path, 4)
    _write(tmp_path / "s", _docs(), shard_tokens=7)
    with pytest.raises(ConfigError, match="too few for one sample"):
        PackedTokens(tmp_path / "s", 10_000)
    with open(tmp_path / "s" / "tokens_00001.bin", "r+b") as f:
        f.truncate(6)
    with pytest.raises(ConfigError, match="tokens_00001.bin is 6 bytes.*run `meshtrain prepare`"):
        PackedTokens(tmp_path / "s", 4)
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    (tmp_path / "s" / "meta.json").write_text(json.dumps({**meta, "format": "other/9"}))
    with pytest.raises(ConfigError, match="expected 'meshtrain-tokens/1'"):
        PackedTokens(tmp_path / "s", 4)


def test_writer_rejects_bad_input(tmp_path):
    with pytest.raises(ConfigError, match="eos_id=60"):
        TokenShardWriter(tmp_path / "a", 50, 60, "x")
    w = TokenShardWriter(tmp_path / "a", 50, EOS, "x")
    with pytest.raises(ConfigError, match=r"outside \[0, 50\)"):
        w.add_document([1, 50])
    with pytest.raises(ConfigError, match="1-D"):
        w.add_document([[1, 2]])
    w.add_document([1])
    w.close()
    with pytest.raises(ConfigError, match="after close"):
        w.add_document([1])
    with pytest.raises(ConfigError, match="not empty"):
        TokenShardWriter(tmp_path / "a", 50, EOS, "x")


def _tokenizer_file(path, text):
    from meshtrain.data.prepare import train_tokenizer

    train_tokenizer([text] * 3, 280).save(str(path))
    return path


def test_check_tokenizer_and_model_vocab(tmp_path):
    good = _tokenizer_file(tmp_path / "good.json", "the cat sat on the mat " * 20)
    other = _tokenizer_file(tmp_path / "other.json", "zzz yyy xxx www " * 20)
    _write(tmp_path / "s", _docs(), vocab=280, sha=file_sha256(good))
    check_tokenizer(tmp_path / "s", good)  # the right tokenizer passes
    check_tokenizer(read_meta(tmp_path / "s"), good)
    with pytest.raises(ConfigError) as err:
        check_tokenizer(tmp_path / "s", other)
    msg = str(err.value)
    assert file_sha256(other)[:16] in msg and file_sha256(good)[:16] in msg
    assert "run `meshtrain prepare` again with this tokenizer" in msg
    assert "or use the tokenizer the shards came from" in msg
    with pytest.raises(ConfigError, match="does not exist"):
        check_tokenizer(tmp_path / "s", tmp_path / "missing.json")
    check_model_vocab(tmp_path / "s", 280)
    check_model_vocab(PackedTokens(tmp_path / "s", 4), 512)
    with pytest.raises(ConfigError, match="set model.vocab_size to at least 280"):
        check_model_vocab(read_meta(tmp_path / "s"), 279)
    with pytest.raises(ConfigError, match="set model.n_vocab to at least 280"):
        check_model_vocab(tmp_path / "s", 100, key="model.n_vocab")
