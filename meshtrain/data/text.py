"""Character-level text data that exists on every machine: Python's own standard library.

``stdlib_text()`` reads the interpreter's top-level standard-library modules, ``CharTokenizer``
maps characters to ids, ``CharChunks`` cuts a token stream into next-token samples, and
``unigram_cross_entropy`` gives the baseline loss a language model has to beat.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from meshtrain.errors import ConfigError


def stdlib_text(max_chars: int = 1_500_000) -> str:
    """Up to ``max_chars`` characters of the standard library's top-level ``*.py`` files.

    Files are read in name order (so the text is the same on every run of one Python
    version); test modules and files that are not UTF-8 are skipped.
    """
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars <= 0:
        raise ConfigError(f"max_chars must be a positive integer, got {max_chars!r}.")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if not p.name.startswith(("test", "_test")))
    parts: list[str] = []
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text[: max_chars - total])
        total += len(parts[-1])
        if total >= max_chars:
            break
    if total == 0:
        raise ConfigError(
            f"no standard-library source files found under {stdlib}; this Python installation "
            f"ships without its .py sources. Install them (e.g. the python3-full or libpython "
            f"stdlib package) or load your own text file instead."
        )
    return "".join(parts)


class CharTokenizer:
    """One id per character, in sorted character order.

    Encoding a character that is not in the vocabulary raises ``ConfigError`` (there is no
    unknown-token fallback): build the tokenizer from text that covers everything you encode.
    """

    def __init__(self, chars: str | list[str]) -> None:
        chars = list(chars)
        if not chars:
            raise ConfigError("a CharTokenizer needs at least one character; pass non-empty text.")
        if any(not isinstance(c, str) or len(c) != 1 for c in chars):
            raise ConfigError("CharTokenizer vocabulary entries must be single characters.")
        if len(set(chars)) != len(chars):
            raise ConfigError("CharTokenizer vocabulary has repeated characters; deduplicate it.")
        self.chars = chars
        self._code_points = np.array([ord(c) for c in chars], dtype=np.int64)
        self._order = np.argsort(self._code_points)
        self._sorted_code_points = self._code_points[self._order]

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Vocabulary of the characters present in ``text``, sorted."""
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Ids of ``text`` as a 1-D LongTensor."""
        code_points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        pos = np.searchsorted(self._sorted_code_points, code_points)
        pos = np.minimum(pos, len(self.chars) - 1)
        known = self._sorted_code_points[pos] == code_points
        if not known.all():
            unknown = sorted({chr(c) for c in code_points[~known].tolist()})
            raise ConfigError(
                f"text contains {len(unknown)} character(s) not in the vocabulary, e.g. "
                f"{unknown[:10]!r}; build the tokenizer from text that includes them."
            )
        return torch.from_numpy(self._order[pos].astype(np.int64))

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """Text of a 1-D sequence of ids."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        try:
            return "".join(self.chars[i] for i in ids)
        except (IndexError, TypeError) as exc:
            raise ConfigError(
                f"ids must be integers in [0, {self.vocab_size}); got {exc}."
            ) from exc

    def to_dict(self) -> dict:
        """JSON-serialisable description, for checkpoints."""
        return {"type": "char", "chars": list(self.chars)}

    @classmethod
    def from_dict(cls, state: dict) -> CharTokenizer:
        if state.get("type") != "char" or "chars" not in state:
            raise ConfigError(
                "not a CharTokenizer description; pass the dict from CharTokenizer.to_dict()."
            )
        return cls(state["chars"])


def _check_tokens(tokens: torch.Tensor) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point():
        raise ConfigError("tokens must be a 1-D integer tensor, e.g. from CharTokenizer.encode().")


class CharChunks(Dataset):
    """Non-overlapping next-token samples: sample i is ``(x, y)``, ``y`` = ``x`` shifted by one."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        _check_tokens(tokens)
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ConfigError(f"seq_len must be a positive integer, got {seq_len!r}.")
        if len(tokens) < seq_len + 1:
            raise ConfigError(
                f"{len(tokens)} tokens are too few for one sample of seq_len={seq_len} "
                f"(need at least {seq_len + 1}); use more text or a smaller seq_len."
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        start = index * self.seq_len
        x = self.tokens[start : start + self.seq_len]
        y = self.tokens[start + 1 : start + self.seq_len + 1]
        return x, y


def split_tokens(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous split: the last ``val_fraction`` of the tokens is validation."""
    _check_tokens(tokens)
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction!r}; e.g. 0.1.")
    num_val = round(len(tokens) * val_fraction)
    if num_val == 0 or num_val == len(tokens):
        raise ConfigError(
            f"val_fraction={val_fraction} of {len(tokens)} tokens leaves an empty split; "
            f"use more tokens or a val_fraction closer to 0.5."
        )
    cut = len(tokens) - num_val
    return tokens[:cut], tokens[cut:]


def unigram_cross_entropy(
    train_tokens: torch.Tensor, eval_tokens: torch.Tensor, vocab_size: int
) -> float:
    """Cross-entropy (nats/token) of ``eval_tokens`` under the add-one-smoothed unigram
    distribution of ``train_tokens``: the loss of a model that ignores context."""
    _check_tokens(train_tokens)
    _check_tokens(eval_tokens)
    if len(eval_tokens) == 0:
        raise ConfigError("eval_tokens is empty; pass at least one token to evaluate.")
    for name, t in (("train_tokens", train_tokens), ("eval_tokens", eval_tokens)):
        if len(t) and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
            raise ConfigError(f"{name} has ids outside [0, {vocab_size}); check vocab_size.")
    counts = torch.bincount(train_tokens.long(), minlength=vocab_size).double() + 1.0
    log_probs = counts.log() - math.log(float(counts.sum()))
    return float(-log_probs[eval_tokens.long()].mean())
