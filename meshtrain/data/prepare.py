"""``meshtrain prepare``: text files, JSON lines or a saved Hugging Face dataset into token shards.

Inputs, in the order given (folders recursed in sorted order, hidden entries skipped):

* a ``.jsonl`` file: one document per line, the string field ``text_field``;
* a folder saved by ``datasets``' ``save_to_disk`` (it holds ``dataset_info.json``,
  ``state.json`` or ``dataset_dict.json``): one document per row, column ``text_field``;
* any other file: one document (UTF-8; in folders, files that are not UTF-8 are skipped).

Documents are encoded with a Hugging Face ``tokenizer.json``, or a byte-level BPE trained on
the inputs first, and written to ``OUT/train/`` (and ``OUT/val/``: document ``i`` goes to
validation when ``floor((i + 1) * f) > floor(i * f)``, i.e. evenly spread, ``floor(N * f)`` of
them) in the format of :mod:`meshtrain.data.tokens`; ``OUT/tokenizer.json`` is the tokenizer.
When the inputs hold too few documents for the validation split to get one (one large text
file), each document is cut by size into pieces, at line ends where it can, so that it does.
Everything is written to a hidden folder beside ``OUT`` and moved into place at the end: an
error leaves ``OUT`` as it was.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from meshtrain.data.tokens import DEFAULT_SHARD_TOKENS, TokenShardWriter, file_sha256
from meshtrain.errors import ConfigError

EOS_TOKEN = "<|endoftext|>"
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
BATCH_DOCS = 512


def _is_hf_dataset(folder: Path) -> bool:
    return any((folder / name).is_file() for name in HF_MARKERS)


def _load_hf(folder: Path, text_field: str) -> list:
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError(f"{folder} is a Hugging Face dataset saved with save_to_disk, and reading "
                          f"it needs the `datasets` package: pip install datasets") from exc
    loaded = datasets.load_from_disk(str(folder))
    parts = [loaded[name] for name in loaded] if isinstance(loaded, dict) else [loaded]
    for part in parts:
        if text_field not in part.column_names:
            raise ConfigError(f"dataset {folder} has no column {text_field!r} (columns: "
                              f"{part.column_names}); pass --text-field with the text column.")
    return parts


def find_sources(inputs, text_field: str = "text") -> list[tuple[str, object]]:
    """``(kind, source)`` for every input: ``("text", path)``, ``("jsonl", path)`` or
    ``("hf", dataset)``, in reading order."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    sources: list[tuple[str, object]] = []

    def visit(path: Path, top: bool) -> None:
        if path.is_dir():
            if _is_hf_dataset(path):
                sources.extend(("hf", (path, ds)) for ds in _load_hf(path, text_field))
                return
            for child in sorted(path.iterdir()):
                if not child.name.startswith(".") and child.name != "__pycache__":
                    visit(child, False)
        elif path.is_file():
            kind = "jsonl" if path.suffix == ".jsonl" else "text"
            sources.append((kind, (path, top)))
        elif top:
            raise ConfigError(f"input {path} does not exist; pass text files, .jsonl files, "
                              f"folders or a saved Hugging Face dataset.")

    for item in inputs:
        visit(Path(item), True)
    if not sources:
        raise ConfigError(f"no input files found in {[str(i) for i in inputs]}; pass text files, "
                          f".jsonl files, folders holding them, or a saved Hugging Face dataset.")
    return sources


def iter_documents(sources, text_field: str = "text", skipped: list | None = None) -> Iterator[str]:
    """The documents' texts, in order (empty ones left out)."""
    for kind, source in sources:
        if kind == "hf":
            path, ds = source
            for batch in ds.iter(batch_size=1000):
                yield from (t for t in batch[text_field] if t)
            continue
        path, explicit = source
        if kind == "text":
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                if explicit:
                    raise ConfigError(f"{path} is not UTF-8 text; convert it or leave it out.") from exc
                if skipped is not None:
                    skipped.append(path)
                continue
            if text:
                yield text
            continue
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{path}:{line_no} is not valid JSON ({exc.msg}); a .jsonl "
                                      f"file needs one JSON object per line.") from exc
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    fields = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ConfigError(f"{path}:{line_no} has no string field {text_field!r} "
                                      f"(it has {fields}); pass --text-field with the text field.")
                if text:
                    yield text


def count_documents(sources) -> int:
    """About how many documents ``sources`` hold (a text file is one, a .jsonl file its
    non-blank lines, a dataset its rows), without tokenizing anything."""
    count = 0
    for kind, source in sources:
        if kind == "hf":
            count += len(source[1])
        elif kind == "text":
            count += 1
        else:
            with open(source[0], encoding="utf-8", errors="replace") as f:
                count += sum(1 for line in f if line.strip())
    return count


def split_by_size(text: str, pieces: int) -> list[str]:
    """``text`` cut into up to ``pieces`` non-empty parts of about equal length, each cut moved
    to the next line end when there is one before the following cut."""
    if pieces <= 1:
        return [text]
    parts, start = [], 0
    for j in range(1, pieces):
        cut = max(start + 1, len(text) * j // pieces)
        end = text.find("\n", cut, len(text) * (j + 1) // pieces)
        cut = end + 1 if end >= 0 else cut
        if cut >= len(text):
            break
        parts.append(text[start:cut])
        start = cut
    parts.append(text[start:])
    return [part for part in parts if part]


def train_tokenizer(texts, vocab_size: int, eos_token: str = EOS_TOKEN):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` ids trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; pass a folder.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"--out {out} is not empty; choose an empty folder or pass --overwrite "
                          f"(which replaces its train/, val/ and tokenizer.json).")


def prepare(inputs, out_dir, *, tokenizer=None, train_tokenizer_vocab: int | None = None,
            val_fraction: float = 0.0, text_field: str = "text",
            shard_tokens: int = DEFAULT_SHARD_TOKENS, eos_token: str = EOS_TOKEN,
            overwrite: bool = False, log=print) -> dict:
    """Tokenize ``inputs`` into ``out_dir/train`` (and ``out_dir/val``); a summary per split."""
    from tokenizers import Tokenizer

    if (tokenizer is None) == (train_tokenizer_vocab is None):
        raise ConfigError("pass exactly one of --tokenizer tokenizer.json (a Hugging Face "
                          "tokenizer) or --train-tokenizer VOCAB_SIZE (train a byte-level BPE).")
    if train_tokenizer_vocab is not None and (
            isinstance(train_tokenizer_vocab, bool) or not isinstance(train_tokenizer_vocab, int)
            or train_tokenizer_vocab < 257):
        raise ConfigError(f"--train-tokenizer {train_tokenizer_vocab!r} is too small: a byte-level "
                          f"BPE needs 256 byte ids plus {eos_token}; use e.g. 32768.")
    if not (isinstance(val_fraction, (int, float)) and 0.0 <= val_fraction < 1.0):
        raise ConfigError(f"--val-fraction must be in [0, 1), got {val_fraction!r}; e.g. 0.01.")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens <= 0:
        raise ConfigError(f"--shard-tokens must be a positive integer, got {shard_tokens!r}.")
    out = Path(out_dir)
    tokenizer_bytes = tok = None
    if tokenizer is not None:
        if not Path(tokenizer).is_file():
            raise ConfigError(f"tokenizer file {tokenizer} does not exist; pass a Hugging Face "
                              f"tokenizer.json, or --train-tokenizer VOCAB_SIZE to train one.")
        tokenizer_bytes = Path(tokenizer).read_bytes()
    _check_out_dir(out, overwrite)
    sources = find_sources(inputs, text_field)
    if tokenizer_bytes is not None:
        tok = Tokenizer.from_str(tokenizer_bytes.decode("utf-8"))
        if tok.token_to_id(eos_token) is None:
            raise ConfigError(f"tokenizer {tokenizer} has no {eos_token!r} token to end documents "
                              f"with; pass --eos-token with its end-of-text token.")

    # everything goes to a hidden folder beside OUT first: an error leaves OUT as it was
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        summary = _prepare_into(work, sources, tok, tokenizer_bytes, train_tokenizer_vocab,
                                val_fraction, text_field, shard_tokens, eos_token, log)
        _move_into_place(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary["tokenizer"] = str(out / "tokenizer.json")
    for name in ("train", "val"):
        if name in summary:
            summary[name]["path"] = str(out / name)
    for line in summary.pop("lines"):
        log(line.replace(str(work), str(out)))
    return summary


def _move_into_place(work: Path, out: Path) -> None:
    """OUT's train/, val/ and tokenizer.json replaced by ``work``'s (other files kept)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("train", "val", "tokenizer.json"):
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        if (work / name).exists():
            os.replace(work / name, target)


def _prepare_into(out: Path, sources, tok, tokenizer_bytes, train_tokenizer_vocab,
                  val_fraction, text_field, shard_tokens, eos_token, log) -> dict:
    """The work of :func:`prepare`, written to ``out`` (a fresh folder); the summary, with the
    lines to print once the output is in place under "lines"."""
    tok_path = out / "tokenizer.json"
    started = time.perf_counter()
    if tokenizer_bytes is None:
        tok = train_tokenizer(iter_documents(sources, text_field), train_tokenizer_vocab, eos_token)
        log(f"tokenizer: trained byte-level BPE, {tok.get_vocab_size()} ids, "
            f"{time.perf_counter() - started:.1f} s")
        tok.save(str(tok_path))
    else:
        tok_path.write_bytes(tokenizer_bytes)
    tok.encode_special_tokens = True  # "<|endoftext|>" inside a document stays text
    eos_id = tok.token_to_id(eos_token)
    vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    sha = file_sha256(tok_path)

    names = ("train", "val") if val_fraction > 0 else ("train",)
    writers = {n: TokenShardWriter(out / n, vocab_size, eos_id, sha, shard_tokens=shard_tokens)
               for n in names}
    pending = {n: [] for n in names}
    seconds = dict.fromkeys(names, 0.0)

    def flush(name: str) -> None:
        t0 = time.perf_counter()
        for enc in tok.encode_batch(pending[name], add_special_tokens=False):
            writers[name].add_document(np.asarray(enc.ids, dtype=np.int64))
        pending[name].clear()
        seconds[name] += time.perf_counter() - t0

    skipped: list = []
    num_docs, pieces = 0, 1
    documents = iter_documents(sources, text_field, skipped)
    if val_fraction > 0:
        expected = count_documents(sources)
        if expected and math.floor(expected * val_fraction) < 1:  # val would get none
            pieces = math.ceil(1 / (expected * val_fraction))
            log(f"{expected} document(s) give validation no document at --val-fraction "
                f"{val_fraction}: each is cut by size into {pieces} pieces")
            documents = (part for text in documents for part in split_by_size(text, pieces))
    lines = []
    for i, text in enumerate(documents):
        val = val_fraction > 0 and math.floor((i + 1) * val_fraction) > math.floor(i * val_fraction)
        num_docs += 1
        name = "val" if val else "train"
        pending[name].append(text)
        if len(pending[name]) >= BATCH_DOCS:
            flush(name)
    summary = {"tokenizer": str(tok_path), "vocab_size": vocab_size, "eos_id": eos_id,
               "skipped_files": [str(p) for p in skipped], "lines": lines}
    for name in names:
        flush(name)
        meta = writers[name].close()
        if meta["num_docs"] == 0:
            short = (f"; the documents are too short to cut into {pieces} pieces"
                     if pieces > 1 else "")
            raise ConfigError(f"the {name} split got no documents (val_fraction={val_fraction} "
                              f"of {num_docs} documents{short}); use more inputs or "
                              f"a {'larger' if name == 'val' else 'smaller'} --val-fraction. "
                              "Nothing was written.")
        rate = meta["num_tokens"] / max(seconds[name], 1e-9)
        summary[name] = {"path": str(out / name), "documents": meta["num_docs"],
                         "tokens": meta["num_tokens"], "seconds": seconds[name],
                         "tokens_per_s": rate}
        lines.append(f"{name}: {meta['num_docs']:,} documents, {meta['num_tokens']:,} tokens, "
                     f"{seconds[name]:.1f} s, {rate:,.0f} tokens/s -> {out / name}")
    if skipped:
        lines.append(f"skipped {len(skipped)} file(s) that are not UTF-8 text, e.g. {skipped[0]}")
    return summary


def main(argv: list[str]) -> int:
    """``meshtrain prepare INPUT... --out DIR ...``; 0 on success, 2 on a ConfigError."""
    parser = argparse.ArgumentParser(
        prog="meshtrain prepare",
        description="Tokenize text files, .jsonl files, folders or a saved Hugging Face dataset "
                    "into memory-mapped token shards (OUT/train, OUT/val, OUT/tokenizer.json).")
    parser.add_argument("inputs", nargs="+", metavar="INPUT")
    parser.add_argument("--out", required=True, metavar="DIR")
    parser.add_argument("--tokenizer", metavar="TOKENIZER_JSON",
                        help="a Hugging Face tokenizer.json")
    parser.add_argument("--train-tokenizer", type=int, metavar="VOCAB_SIZE",
                        help="train a byte-level BPE of this many ids on the inputs")
    parser.add_argument("--val-fraction", type=float, default=0.0, metavar="F")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--eos-token", default=EOS_TOKEN)
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        prepare(args.inputs, args.out, tokenizer=args.tokenizer,
                train_tokenizer_vocab=args.train_tokenizer, val_fraction=args.val_fraction,
                text_field=args.text_field, shard_tokens=args.shard_tokens,
                eos_token=args.eos_token, overwrite=args.overwrite)
    except ConfigError as error:
        print(f"meshtrain prepare: error: {error}", file=sys.stderr)
        return 2
    return 0
