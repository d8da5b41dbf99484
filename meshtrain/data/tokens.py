"""Token shards on disk, memory-mapped: the corpus-scale data of language-model training.

Format ``meshtrain-tokens/1``, one folder per split:

* ``tokens_00000.bin``, ``tokens_00001.bin``, ...: raw little-endian token ids, ``uint16`` when
  the vocabulary has at most 65536 entries, else ``uint32``. Read in order, the shards are one
  stream: every document followed by the end-of-text token ``eos_id``. Every shard but the last
  holds exactly ``shard_tokens`` tokens, so a document may run on into the next shard.
* ``docs_00000.bin``, ...: ``int64`` offsets, inside that shard, of the first token of each
  document that *starts* in it (a document spanning shards is listed in the first one).
* ``meta.json``: ``{"format", "dtype", "vocab_size", "eos_id", "tokenizer_sha256",
  "shards": [{"tokens", "docs", "num_tokens", "num_docs"}], "num_tokens", "num_docs"}``;
  written last, so a folder without it is an unfinished write.

``PackedTokens`` packs the stream into samples of ``seq_len`` tokens (documents run into one
another); ``check_tokenizer`` and ``check_model_vocab`` catch shards used with the wrong
tokenizer or a model whose vocabulary is too small.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from meshtrain.errors import ConfigError
from meshtrain.packing import cut_targets

FORMAT = "meshtrain-tokens/1"
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB per shard in uint16


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits in it, else ``uint32`` (little-endian)."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}.")


class TokenShardWriter:
    """Appends documents to a new shard folder; ``close()`` (or leaving a ``with``) finishes it.

    Each document is written followed by ``eos_id``; shards are cut every ``shard_tokens``
    tokens, wherever that falls (see the module docstring).
    """

    def __init__(self, folder: str | os.PathLike, vocab_size: int, eos_id: int,
                 tokenizer_sha256: str, *, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> None:
        _positive_int("vocab_size", vocab_size)
        _positive_int("shard_tokens", shard_tokens)
        if isinstance(eos_id, bool) or not isinstance(eos_id, int) or not 0 <= eos_id < vocab_size:
            raise ConfigError(f"eos_id={eos_id!r} is not an id of a {vocab_size}-token vocabulary.")
        self.folder = Path(folder)
        if self.folder.exists() and any(self.folder.iterdir()):
            raise ConfigError(f"{self.folder} is not empty; token shards need an empty folder "
                              f"(delete it or choose another one).")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.vocab_size, self.eos_id, self.shard_tokens = vocab_size, eos_id, shard_tokens
        self.tokenizer_sha256 = tokenizer_sha256
        self.dtype = token_dtype(vocab_size)
        self.shards: list[dict] = []
        self.num_tokens = self.num_docs = 0
        self._file = None
        self._fill = 0  # tokens in the open shard
        self._doc_starts: list[int] = []
        self._closed = False

    def __enter__(self) -> TokenShardWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        elif self._file is not None:
            self._file.close()

    def add_document(self, ids) -> None:
        """Append one document (a sequence of token ids, without eos)."""
        if self._closed:
            raise ConfigError("add_document() after close(); open a new TokenShardWriter.")
        ids = np.asarray(ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ConfigError(f"a document must be a 1-D sequence of integer ids, got "
                              f"shape {ids.shape} dtype {ids.dtype}.")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ConfigError(f"document has ids outside [0, {self.vocab_size}); encode it with "
                              f"the tokenizer whose vocab_size the writer was given.")
        tokens = np.empty(ids.size + 1, dtype=self.dtype)
        tokens[:-1] = ids
        tokens[-1] = self.eos_id
        self._open_shard()
        self._doc_starts.append(self._fill)
        self.num_docs += 1
        start = 0
        while start < tokens.size:
            self._open_shard()
            take = min(tokens.size - start, self.shard_tokens - self._fill)
            self._file.write(tokens[start : start + take].tobytes())
            self._fill += take
            start += take
            if self._fill == self.shard_tokens:
                self._finish_shard()
        self.num_tokens += tokens.size

    def _open_shard(self) -> None:
        if self._file is None:
            self._file = open(self.folder / f"tokens_{len(self.shards):05d}.bin", "wb")

    def _finish_shard(self) -> None:
        index = len(self.shards)
        self._file.close()
        self._file = None
        docs = f"docs_{index:05d}.bin"
        np.asarray(self._doc_starts, dtype="<i8").tofile(self.folder / docs)
        self.shards.append({"tokens": f"tokens_{index:05d}.bin", "docs": docs,
                            "num_tokens": self._fill, "num_docs": len(self._doc_starts)})
        self._fill, self._doc_starts = 0, []

    def close(self) -> dict:
        """Write the last shard and ``meta.json``; the meta."""
        if not self._closed:
            if self._file is not None:
                self._finish_shard()
            self._closed = True
            meta = self.meta
            tmp = self.folder / "meta.json.tmp"
            tmp.write_text(json.dumps(meta, indent=1))
            os.replace(tmp, self.folder / "meta.json")
        return self.meta

    @property
    def meta(self) -> dict:
        return {"format": FORMAT, "dtype": self.dtype.name, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "tokenizer_sha256": self.tokenizer_sha256,
                "shards": list(self.shards), "num_tokens": self.num_tokens,
                "num_docs": self.num_docs}


def read_meta(folder: str | os.PathLike) -> dict:
    """``meta.json`` of a shard folder, checked to be of this format."""
    path = Path(folder) / "meta.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: {folder} is not a finished token-shard folder; "
                          f"create it with `meshtrain prepare` (or TokenShardWriter.close()).")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}; "
                          f"prepare the data again with this meshtrain version.")
    return meta


def _as_meta(folder_or_meta) -> dict:
    if isinstance(folder_or_meta, dict):
        return folder_or_meta
    if isinstance(folder_or_meta, PackedTokens):
        return folder_or_meta.meta
    return read_meta(folder_or_meta)


class PackedTokens(Dataset):
    """Samples of ``seq_len`` tokens packed from a shard folder: sample ``i`` is cut from the
    ``seq_len + 1`` tokens starting at ``i * seq_len`` of the whole stream.

    * default: ``(input_ids, labels)``, int64, ``labels`` = the next tokens (``window[1:]``),
      the pair a ``loss_fn`` expects;
    * ``dict_batches=True``: ``{"input_ids", "labels"}`` in the Hugging Face convention, both
      ``window[:-1]`` (labels == input_ids; the model shifts them, so the last token of each
      sample has no target);
    * ``document_positions=True`` (dict batches only): also ``"position_ids"``, counting from
      0 at each document's first token (the token after each eos the writer appended).
    * ``document_mask=True``: no target across a document boundary. Dict batches: documents
      kept apart, ``"position_ids"`` as above and ``labels`` -100 on each document's first token
      (meshtrain.packing.cut_targets); a Hugging Face model given these positions masks its
      attention to each document (meshtrain.packing). Pairs: the target of each document's
      last token (its eos, whose next token starts another document) is -100; a model that
      finds the documents from the eos ids keeps them apart (meshtrain's GPT with
      ``document_eos``).

    Opening reads only ``meta.json`` (and stats the token files); shards are memory-mapped on
    first use in each process, so the dataset pickles into DataLoader workers cheaply.
    """

    def __init__(self, folder: str | os.PathLike, seq_len: int, *, dict_batches: bool = False,
                 document_positions: bool = False, document_mask: bool = False) -> None:
        _positive_int("seq_len", seq_len)
        if document_positions and not dict_batches:
            raise ConfigError("document_positions=True returns 'position_ids', which needs dict "
                              "batches; pass dict_batches=True as well.")
        self.folder = Path(folder)
        self.meta = read_meta(folder)
        self.seq_len, self.dict_batches = seq_len, bool(dict_batches)
        self.document_mask = bool(document_mask)
        self.document_positions = bool(document_positions) or (self.document_mask and
                                                               self.dict_batches)
        self.dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        shards = self.meta["shards"]
        for shard in shards:
            path = self.folder / shard["tokens"]
            size = path.stat().st_size if path.is_file() else None
            if size != shard["num_tokens"] * self.dtype.itemsize:
                raise ConfigError(
                    f"{path} is {'missing' if size is None else f'{size} bytes'}, but meta.json "
                    f"says {shard['num_tokens']} {self.dtype.name} tokens; the folder is damaged "
                    f"or incomplete: run `meshtrain prepare` again.")
        counts = np.array([s["num_tokens"] for s in shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])  # shard k: [starts[k], starts[k+1])
        self.num_tokens = int(self._starts[-1])
        if self.num_tokens < seq_len + 1:
            raise ConfigError(f"{self.folder} holds {self.num_tokens} tokens, too few for one "
                              f"sample of seq_len={seq_len} (need {seq_len + 1}); use more data "
                              f"or a smaller seq_len.")
        self._maps: dict = {}
        self._pid = os.getpid()

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}}

    def _map(self, kind: str, k: int) -> np.ndarray:
        if self._pid != os.getpid():  # forked: do not share the parent's maps
            self._maps, self._pid = {}, os.getpid()
        key = (kind, k)
        arr = self._maps.get(key)
        if arr is None:
            shard = self.meta["shards"][k]
            if kind == "tokens":
                arr = np.memmap(self.folder / shard["tokens"], dtype=self.dtype, mode="r",
                                shape=(shard["num_tokens"],))
            elif shard["num_docs"]:
                arr = np.memmap(self.folder / shard["docs"], dtype="<i8", mode="r",
                                shape=(shard["num_docs"],))
            else:
                arr = np.zeros(0, dtype=np.int64)
            self._maps[key] = arr
        return arr

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` of the whole stream as int64 (across shards)."""
        if start < 0 or count < 0 or start + count > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + count}) out of range [0, {self.num_tokens})")
        out = np.empty(count, dtype=np.int64)
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while done < count:
            lo = start + done - int(self._starts[k])
            take = min(count - done, int(self._starts[k + 1]) - start - done)
            out[done : done + take] = self._map("tokens", k)[lo : lo + take]
            done += take
            k += 1
        return out

    def _doc_start(self, t: int) -> int:
        """Stream offset of the first token of the document holding token ``t``."""
        k = int(np.searchsorted(self._starts, t, side="right")) - 1
        local = t - int(self._starts[k])
        while k >= 0:
            docs = self._map("docs", k)
            j = int(np.searchsorted(docs, local, side="right"))
            if j:
                return int(self._starts[k]) + int(docs[j - 1])
            k, local = k - 1, np.iinfo(np.int64).max
        return 0

    def _positions(self, start: int, count: int) -> np.ndarray:
        """Position of each token in its document, for tokens ``[start, start + count)``."""
        first = self._doc_start(start)
        bounds = [first]
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        stop = start + count
        while k < len(self.meta["shards"]) and int(self._starts[k]) < stop:
            base = int(self._starts[k])
            docs = self._map("docs", k)
            lo, hi = np.searchsorted(docs, [start - base + 1, stop - base])
            bounds.extend((base + np.asarray(docs[lo:hi], dtype=np.int64)).tolist())
            k += 1
        bounds = np.asarray(bounds, dtype=np.int64)
        t = np.arange(start, stop, dtype=np.int64)
        return t - bounds[np.searchsorted(bounds, t, side="right") - 1]

    def __getitem__(self, index: int):
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"sample {index} out of range for {n} samples")
        start = index * self.seq_len
        window = torch.from_numpy(self.read(start, self.seq_len + 1))
        if not self.dict_batches:
            targets = window[1:]
            if self.document_mask:  # no target in another document (its first token)
                starts = torch.from_numpy(self._positions(start + 1, self.seq_len)) == 0
                targets = targets.masked_fill(starts, -100)
            return window[:-1], targets
        ids = window[:-1]
        sample = {"input_ids": ids, "labels": ids.clone()}
        if self.document_positions:
            sample["position_ids"] = torch.from_numpy(self._positions(start, self.seq_len))
        if self.document_mask:
            sample["labels"] = cut_targets(sample["labels"], sample["position_ids"])
        return sample


def check_tokenizer(folder_or_meta, tokenizer_path: str | os.PathLike) -> None:
    """Raise ``ConfigError`` unless ``tokenizer_path`` is the tokenizer the shards were made
    with (same sha256 of ``tokenizer.json``, hence the same vocabulary)."""
    meta = _as_meta(folder_or_meta)
    path = Path(tokenizer_path)
    if not path.is_file():
        raise ConfigError(f"tokenizer file {path} does not exist; pass the tokenizer.json the "
                          f"shards were prepared with (`meshtrain prepare` copies it to its --out "
                          f"folder).")
    sha = file_sha256(path)
    if sha == meta.get("tokenizer_sha256"):
        return
    try:
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception:  # not loadable: the sha256 alone tells them apart
        vocab = "unknown"
    raise ConfigError(
        f"tokenizer {path} (sha256 {sha[:16]}..., vocab_size {vocab}) is not the one the "
        f"shards were written with (sha256 {str(meta.get('tokenizer_sha256'))[:16]}..., "
        f"vocab_size {meta.get('vocab_size')}); run `meshtrain prepare` again with this "
        f"tokenizer, or use the tokenizer the shards came from.")


def check_model_vocab(folder_or_meta, model_vocab_size: int, *,
                      key: str = "model.vocab_size") -> None:
    """Raise ``ConfigError`` when a model with ``model_vocab_size`` embeddings cannot take every
    id of the shards (``key``: the config setting to name in the message)."""
    meta = _as_meta(folder_or_meta)
    if model_vocab_size < meta["vocab_size"]:
        raise ConfigError(
            f"the model's vocabulary ({model_vocab_size}) is smaller than the token shards' "
            f"vocab_size {meta['vocab_size']}, so some ids have no embedding; set {key} to at "
            f"least {meta['vocab_size']} (or use shards prepared with a smaller tokenizer).")
