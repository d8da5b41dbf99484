"""`meshtrain prepare`: inputs of every kind into token shards, trained or given tokenizer."""

import json
import sys
import types

import pytest
from tokenizers import Tokenizer

from meshtrain.data.prepare import main, prepare, train_tokenizer
from meshtrain.data.tokens import PackedTokens, check_tokenizer, file_sha256, read_meta
from meshtrain.errors import ConfigError

TEXTS = [f"Document {i}: the quick brown fox {'jumps ' * i}over the lazy dog. ñ λ ✓\n"
         for i in range(10)]


def _corpus(root):
    """Inputs holding TEXTS in reading order: a .txt, a folder (sorted) and a .jsonl."""
    (root / "a.txt").write_text(TEXTS[0])
    folder = root / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.md").write_text(TEXTS[1])
    (folder / "c.py").write_text(TEXTS[2])
    (folder / "sub" / "d.txt").write_text(TEXTS[3])
    (folder / ".hidden").write_text("never read")
    (folder / "e.bin").write_bytes(b"\xff\xfe\x00binary")  # not UTF-8: skipped in a folder
    with open(root / "rest.jsonl", "w") as f:
        for t in TEXTS[4:]:
            f.write(json.dumps({"id": 1, "text": t}) + "\n")
        f.write("\n")
    return [root / "a.txt", folder, root / "rest.jsonl"]


def _documents(folder):
    """The documents of a shard folder, decoded with its tokenizer."""
    meta = read_meta(folder)
    tok = Tokenizer.from_file(str(folder.parent / "tokenizer.json"))
    stream = PackedTokens(folder, 1).read(0, meta["num_tokens"]).tolist()
    assert stream[-1] == meta["eos_id"]
    docs, cur = [], []
    for t in stream:
        if t == meta["eos_id"]:
            docs.append(tok.decode(cur, skip_special_tokens=False))
            cur = []
        else:
            cur.append(t)
    return docs


def test_prepare_trained_tokenizer_round_trip(tmp_path, capsys):
    inputs = _corpus(tmp_path)
    out = tmp_path / "out"
    summary = prepare(inputs, out, train_tokenizer_vocab=300, shard_tokens=50)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == 300 and tok.token_to_id("<|endoftext|>") == summary["eos_id"]
    assert _documents(out / "train") == TEXTS  # exact text back, in input order
    meta = read_meta(out / "train")
    assert len(meta["shards"]) > 2 and meta["vocab_size"] == 300
    assert meta["tokenizer_sha256"] == file_sha256(out / "tokenizer.json")
    assert summary["train"]["documents"] == 10 and not (out / "val").exists()
    assert summary["skipped_files"] == [str(tmp_path / "docs" / "e.bin")]
    printed = capsys.readouterr().out
    assert f"train: 10 documents, {meta['num_tokens']:,} tokens," in printed and "tokens/s" in printed
    check_tokenizer(out / "train", out / "tokenizer.json")


def test_prepare_given_tokenizer_and_val_split(tmp_path):
    inputs = _corpus(tmp_path)
    first = tmp_path / "first"
    prepare(inputs, first, train_tokenizer_vocab=300)
    (tmp_path / "tok.json").write_bytes((first / "tokenizer.json").read_bytes())
    out = tmp_path / "out"
    summary = prepare(inputs, out, tokenizer=tmp_path / "tok.json", val_fraction=0.2,
                      log=lambda *_: None)
    assert file_sha256(out / "tokenizer.json") == file_sha256(tmp_path / "tok.json")
    # every 5th document, deterministic: documents 4 and 9
    assert _documents(out / "val") == [TEXTS[4], TEXTS[9]]
    assert _documents(out / "train") == [t for i, t in enumerate(TEXTS) if i not in (4, 9)]
    assert summary["val"]["documents"] == 2 and summary["train"]["documents"] == 8
    total = read_meta(first / "train")["num_tokens"]
    assert summary["train"]["tokens"] + summary["val"]["tokens"] == total  # same tokenizer


def test_eos_text_inside_a_document_is_not_an_eos(tmp_path):
    (tmp_path / "a.txt").write_text("before <|endoftext|> after")
    out = tmp_path / "out"
    prepare([tmp_path / "a.txt"], out, train_tokenizer_vocab=280, log=lambda *_: None)
    assert read_meta(out / "train")["num_docs"] == 1
    assert _documents(out / "train") == ["before <|endoftext|> after"]


def test_main_cli_and_errors_before_work(tmp_path, capsys):
    inputs = [str(p) for p in _corpus(tmp_path)]
    out = tmp_path / "out"
    assert main([*inputs, "--out", str(out), "--train-tokenizer", "300",
                 "--val-fraction", "0.1"]) == 0
    printed = capsys.readouterr().out
    assert "train: 9 documents" in printed and "val: 1 documents" in printed

    def error(*argv):
        assert main(list(argv)) == 2
        return capsys.readouterr().err

    fresh = str(tmp_path / "fresh")
    assert "pass exactly one of --tokenizer" in error(*inputs, "--out", fresh)
    assert "pass exactly one of --tokenizer" in error(
        *inputs, "--out", fresh, "--tokenizer", str(out / "tokenizer.json"),
        "--train-tokenizer", "300")
    assert "tokenizer file" in error(*inputs, "--out", fresh, "--tokenizer", "nope.json")
    assert "missing does not exist" in error(str(tmp_path / "docs" / "sub" / "missing"), "--out",
                                           fresh, "--train-tokenizer", "300")
    (tmp_path / "empty").mkdir()
    assert "no input files found" in error(str(tmp_path / "empty"), "--out", fresh,
                                           "--train-tokenizer", "300")
    assert "too small" in error(*inputs, "--out", fresh, "--train-tokenizer", "100")
    assert "--val-fraction must be in [0, 1)" in error(*inputs, "--out", fresh,
                                                       "--train-tokenizer", "300",
                                                       "--val-fraction", "1.5")
    assert "not empty" in error(*inputs, "--out", str(out), "--train-tokenizer", "300")
    assert not (tmp_path / "fresh").exists()  # nothing was written by the failed runs
    # --overwrite replaces the splits, even with the tokenizer read from the folder itself
    assert main([*inputs, "--out", str(out), "--tokenizer", str(out / "tokenizer.json"),
                 "--overwrite"]) == 0
    assert not (out / "val").exists() and read_meta(out / "train")["num_docs"] == 10


def test_bad_jsonl_and_missing_eos(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"a.jsonl:1 has no string field 'text'.*--text-field"):
        prepare([tmp_path / "a.jsonl"], tmp_path / "o1", train_tokenizer_vocab=280)
    prepare([tmp_path / "a.jsonl"], tmp_path / "o2", train_tokenizer_vocab=280,
            text_field="body", log=lambda *_: None)
    assert _documents(tmp_path / "o2" / "train") == ["x"]
    (tmp_path / "b.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigError, match="b.jsonl:1 is not valid JSON"):
        prepare([tmp_path / "b.jsonl"], tmp_path / "o3", train_tokenizer_vocab=280)
    train_tokenizer(["abc"], 270, eos_token="</s>").save(str(tmp_path / "t.json"))
    with pytest.raises(ConfigError, match="has no '<\\|endoftext\\|>' token.*--eos-token"):
        prepare([tmp_path / "a.jsonl"], tmp_path / "o4", tokenizer=tmp_path / "t.json")
    prepare([tmp_path / "a.jsonl"], tmp_path / "o5", tokenizer=tmp_path / "t.json",
            eos_token="</s>", text_field="body", log=lambda *_: None)
    assert read_meta(tmp_path / "o5" / "train")["eos_id"] == 0
    with pytest.raises(ConfigError, match="val split got no documents.*larger --val-fraction"):
        prepare([tmp_path / "a.jsonl"], tmp_path / "o6", tokenizer=tmp_path / "t.json",
                eos_token="</s>", text_field="body", val_fraction=0.5, log=lambda *_: None)


def test_saved_hf_dataset(tmp_path, monkeypatch):
    saved = tmp_path / "hf"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    (saved / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(ConfigError, match="pip install datasets"):
        prepare([saved], tmp_path / "o1", train_tokenizer_vocab=280)

    class FakeDataset:
        column_names = ["text", "id"]

        def iter(self, batch_size):
            for lo in range(0, len(TEXTS), batch_size):
                yield {"text": TEXTS[lo : lo + batch_size]}

    fake = types.SimpleNamespace(load_from_disk=lambda path: FakeDataset())
    monkeypatch.setitem(sys.modules, "datasets", fake)
    prepare([saved], tmp_path / "o2", train_tokenizer_vocab=300, log=lambda *_: None)
    assert _documents(tmp_path / "o2" / "train") == TEXTS
    with pytest.raises(ConfigError, match="no column 'body'"):
        prepare([saved], tmp_path / "o3", train_tokenizer_vocab=300, text_field="body")


def test_one_large_text_file_is_cut_by_size_for_the_val_split(tmp_path, capsys):
    """One document cannot feed a val split at any fraction: it failed after writing train/.
    The document is cut by size (at line ends) into pieces; in order they give the text back."""
    text = "".join(f"line {i}: {'lorem ipsum ' * (i % 7)}\n" for i in range(200))
    (tmp_path / "book.txt").write_text(text)
    out = tmp_path / "out"
    assert main([str(tmp_path / "book.txt"), "--out", str(out), "--train-tokenizer", "300",
                 "--val-fraction", "0.1"]) == 0
    printed = capsys.readouterr().out
    assert "cut by size into 10 pieces" in printed
    assert "train: 9 documents" in printed and "val: 1 documents" in printed
    train, val = _documents(out / "train"), _documents(out / "val")
    assert "".join(train) + val[0] == text  # the last tenth, cut at line ends
    assert all(doc.endswith("\n") for doc in train)
    assert 0.05 < len(val[0]) / len(text) < 0.15


def test_an_error_leaves_no_output_behind(tmp_path, capsys):
    """Errors found while writing (a bad .jsonl line after good ones, a split with no document)
    left a half-written OUT that the retry had to --overwrite."""
    (tmp_path / "good.txt").write_text("a first document\n")
    with open(tmp_path / "bad.jsonl", "w") as f:
        f.write(json.dumps({"text": "fine"}) + "\n{not json\n")
    out = tmp_path / "out"
    assert main([str(tmp_path / "good.txt"), str(tmp_path / "bad.jsonl"), "--out", str(out),
                 "--train-tokenizer", "280"]) == 2
    assert "bad.jsonl:2 is not valid JSON" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.txt"]
    # over an existing output with --overwrite: the old splits stay as they were
    assert main([str(tmp_path / "good.txt"), "--out", str(out), "--train-tokenizer", "280"]) == 0
    before = {p.name: p.read_bytes() for p in (out / "train").iterdir()}
    (tmp_path / "tiny.txt").write_text("x")
    assert main([str(tmp_path / "tiny.txt"), "--out", str(out), "--train-tokenizer", "280",
                 "--val-fraction", "0.5", "--overwrite"]) == 2
    assert "Nothing was written" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (out / "train").iterdir()} == before
    assert not (out / "val").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.txt", "out",
                                                          "tiny.txt"]
