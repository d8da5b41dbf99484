"""``meshtrain export``: turn a (sharded) training checkpoint into one plain ``state_dict`` file
(or, with ``--hf``, a Hugging Face model folder: :func:`meshtrain.checkpoint.hf_export.export_hf`).

Training checkpoints are torch distributed checkpoints: one file per rank, loadable on any world
size, and they hold optimizer state too. For inference one usually wants the model's weights
alone in a ``torch.save`` file that ``model.load_state_dict(torch.load(path))`` reads. This reads
only the model entries of the checkpoint, in one process, with no process group, and reads
only plain data (``safe_load.py``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from meshtrain.checkpoint.safe_load import read_model_state
from meshtrain.errors import ConfigError


def export_model(checkpoint_dir: str | os.PathLike, out_file: str | os.PathLike,
                 dtype: torch.dtype | None = None) -> Path:
    """Write the model weights of ``checkpoint_dir`` to ``out_file``; return its path."""
    state = read_model_state(checkpoint_dir, dtype)
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out_file)
    return out_file


def saved_hf_config(checkpoint_dir: str | os.PathLike) -> Path:
    """The Hugging Face config saved with the run of ``checkpoint_dir``:
    ``<run>/hf_config/config.json`` next to ``<run>/checkpoints/<name>``."""
    folder = Path(checkpoint_dir).resolve().parent.parent / "hf_config"
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"no Hugging Face config given and none saved with the run ({folder / 'config.json'} "
            "does not exist); pass --config with the model's config folder or config.json"
        )
    return folder


def export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="meshtrain export",
        description="Write a checkpoint's model weights as one plain state_dict file, or (--hf) "
                    "as a Hugging Face model folder.",
    )
    parser.add_argument("checkpoint", help="checkpoint folder (e.g. runs/x/<time>/checkpoints/final)")
    parser.add_argument("out", nargs="?", help="output file, e.g. model.pt (not with --hf)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    parser.add_argument("--hf", metavar="OUT_DIR",
                        help="write a Hugging Face folder (config.json, model.safetensors)")
    parser.add_argument("--config", metavar="DIR_OR_FILE",
                        help="with --hf: the model's config folder or config.json (default: the "
                             "run's hf_config/ next to its checkpoints/)")
    parser.add_argument("--tokenizer", metavar="DIR", help="with --hf: copy its tokenizer files")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.hf is None:
        if args.out is None or args.config or args.tokenizer:
            parser.error("give an output file, or --hf OUT_DIR (--config and --tokenizer go "
                         "with --hf)")
        path = export_model(args.checkpoint, args.out, dtype)
        num_bytes = path.stat().st_size
        print(f"wrote {path} ({num_bytes / 2**20:.1f} MiB)")
        return 0
    if args.out is not None:
        parser.error("give either an output file or --hf OUT_DIR, not both")
    from meshtrain.checkpoint.hf_export import export_hf

    config = args.config if args.config else saved_hf_config(args.checkpoint)
    path = export_hf(args.checkpoint, args.hf, config=config, tokenizer_dir=args.tokenizer,
                     dtype=dtype)
    num_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"wrote {path} ({num_bytes / 2**20:.1f} MiB of weights)")
    return 0
