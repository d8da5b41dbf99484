"""``meshtrain export``: turn a (sharded) training checkpoint into one plain ``state_dict`` file
(or, with ``--hf``, a Hugging Face model folder: :func:`meshtrain.checkpoint.hf_export.export_hf`).

Training checkpoints are torch distributed checkpoints: one file per rank, loadable on any world
size, and they hold optimizer state too. For inference one usually wants the model's weights
alone in a ``torch.save`` file that ``model.load_state_dict(torch.load(path))`` reads. This reads
only the model entries of the checkpoint, in one process, with no process group, and reads
only plain data (``safe_load.py``).

What to export may be given as the checkpoint folder itself or as the run folder
(``runs/<name>/<time>``, or its ``checkpoints/``): :func:`resolve_checkpoint` takes the run's
``checkpoints/final``, else its newest complete checkpoint, and ``--hf`` the run's
``hf_config/``.
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


_GIVE = ("give a run folder (runs/<name>/<time>) or one of its checkpoints "
         "(runs/<name>/<time>/checkpoints/final)")


def resolve_checkpoint(path: str | os.PathLike) -> tuple[Path, Path | None]:
    """(the checkpoint folder, its run folder or None) from what ``meshtrain export`` was
    given: a checkpoint folder (it holds DCP's ``.metadata``; its run is the folder above its
    ``checkpoints/``), or a run folder or its ``checkpoints/`` (then ``checkpoints/final``, else
    the newest complete checkpoint). Anything else is a ``ConfigError`` naming what to give."""
    from meshtrain.checkpoint.manager import checkpoint_step, latest_complete

    path = Path(path)
    if (path / ".metadata").is_file():
        above = path.resolve().parent
        return path, above.parent if above.name == "checkpoints" else None
    if not path.is_dir():
        raise ConfigError(f"{path} does not exist; {_GIVE}")
    run = path.parent if path.name == "checkpoints" else path
    checkpoints = run / "checkpoints"
    if checkpoints.is_dir():
        final = checkpoints / "final"
        chosen = final if checkpoint_step(final) is not None else latest_complete(checkpoints)
        if chosen is None:
            raise ConfigError(f"the run folder {run} holds no complete checkpoint in "
                              f"{checkpoints} (a run writes checkpoints/final at its end "
                              "unless save_final_checkpoint=False); export another run")
        return chosen, run
    runs = sorted((p for p in path.iterdir() if (p / "checkpoints").is_dir()),
                  key=lambda p: p.name)
    if runs:  # runs/<name>: one folder per run, named by its start time
        raise ConfigError(f"{path} holds {len(runs)} run folder(s); give one of them, e.g. "
                          f"the newest: {runs[-1]}")
    raise ConfigError(f"{path} is neither a checkpoint (no .metadata file) nor a run folder "
                      f"(no checkpoints/ in it); {_GIVE}")


def saved_hf_config(checkpoint_dir: str | os.PathLike, run: Path | None = None) -> Path:
    """The Hugging Face config saved with the run ``run`` (by default the run of
    ``checkpoint_dir``: the folder above its ``checkpoints/``): ``<run>/hf_config/``.
    Without one, a checkpoint of meshtrain's own GPT is refused saying why no config can
    exist and what to export instead."""
    from meshtrain.checkpoint.hf_export import refuse_meshtrain_gpt
    from meshtrain.checkpoint.safe_load import read_metadata

    run = run if run is not None else Path(checkpoint_dir).resolve().parent.parent
    folder = run / "hf_config"
    if (folder / "config.json").is_file():
        return folder
    names = [k.removeprefix("model.") for k in read_metadata(checkpoint_dir).state_dict_metadata
             if k.startswith("model.")]
    refuse_meshtrain_gpt(names, checkpoint_dir)
    raise ConfigError(
        f"no Hugging Face config given and none saved with the run ({folder / 'config.json'} "
        "does not exist; a run of a Hugging Face architecture, e.g. the causal_lm recipe's, "
        "saves it there); pass --config with the model's config folder or config.json")


def export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="meshtrain export",
        description="Write a checkpoint's model weights as one plain state_dict file, or (--hf) "
                    "as a Hugging Face model folder.",
    )
    parser.add_argument("checkpoint", help="a run folder (runs/x/<time>: its checkpoints/final, "
                        "else its newest checkpoint) or a checkpoint folder")
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
    if args.hf is None and (args.out is None or args.config or args.tokenizer):
        parser.error("give an output file, or --hf OUT_DIR (--config and --tokenizer go "
                     "with --hf)")
    if args.hf is not None and args.out is not None:
        parser.error("give either an output file or --hf OUT_DIR, not both")
    checkpoint, run = resolve_checkpoint(args.checkpoint)
    if Path(args.checkpoint) != checkpoint:
        print(f"exporting {checkpoint}")
    if args.hf is None:
        path = export_model(checkpoint, args.out, dtype)
        num_bytes = path.stat().st_size
        print(f"wrote {path} ({num_bytes / 2**20:.1f} MiB)")
        return 0
    from meshtrain.checkpoint.hf_export import export_hf

    config = args.config if args.config else saved_hf_config(checkpoint, run)
    path = export_hf(checkpoint, args.hf, config=config, tokenizer_dir=args.tokenizer,
                     dtype=dtype)
    num_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"wrote {path} ({num_bytes / 2**20:.1f} MiB of weights)")
    return 0
