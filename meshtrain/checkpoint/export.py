"""``meshtrain export``: turn a (sharded) training checkpoint into one plain ``state_dict`` file.

Training checkpoints are torch distributed checkpoints: one file per rank, loadable on any world
size, and they hold optimizer state too. For inference one usually wants the model's weights
alone in a ``torch.save`` file that ``model.load_state_dict(torch.load(path))`` reads. This reads
only the model entries of the checkpoint, in one process, with no process group.
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

import torch

from meshtrain.errors import ConfigError


def export_model(checkpoint_dir: str | os.PathLike, out_file: str | os.PathLike,
                 dtype: torch.dtype | None = None) -> Path:
    """Write the model weights of ``checkpoint_dir`` to ``out_file``; return its path."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    checkpoint_dir, out_file = Path(checkpoint_dir), Path(out_file)
    if not (checkpoint_dir / ".metadata").is_file():
        raise ConfigError(
            f"{checkpoint_dir} is not a distributed checkpoint (no .metadata file); pass a "
            "checkpoint folder such as runs/<name>/<time>/checkpoints/final"
        )
    with warnings.catch_warnings():  # "no process group: loading in a single process" is the intent
        warnings.filterwarnings("ignore", message=".*single process")
        state = _load_state_dict_from_keys("model", checkpoint_id=str(checkpoint_dir))["model"]
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    out_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out_file)
    return out_file


def export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="meshtrain export",
        description="Write a checkpoint's model weights as one plain state_dict file.",
    )
    parser.add_argument("checkpoint", help="checkpoint folder (e.g. runs/x/<time>/checkpoints/final)")
    parser.add_argument("out", help="output file, e.g. model.pt")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    path = export_model(args.checkpoint, args.out, dtype)
    num_bytes = path.stat().st_size
    print(f"wrote {path} ({num_bytes / 2**20:.1f} MiB)")
    return 0
