"""``meshtrain upgrade-checkpoint DIR --trust``: rewrite a checkpoint of an older meshtrain so that
it loads without unpickling objects.

Checkpoints written before meshtrain read them with ``weights_only=True`` store NumPy's random
state as an array (``rng_rank*.pt``), which only a full unpickle reads; meshtrain now refuses
them (``safe_load.py``). This command reads those files the old way, once, because the user says
the checkpoint is theirs (``--trust``), converts them to plain data and replaces them in place
(each file written beside and renamed, so an interruption leaves the old file or the new one).
"""

from __future__ import annotations

import argparse
import os
import pickle
from pathlib import Path

import numpy as np
import torch

from meshtrain.checkpoint.safe_load import check_plain, load_plain, read_metadata
from meshtrain.checkpoint.state import TRAINER_STATE
from meshtrain.errors import ConfigError


def _plain_rng(state: dict) -> dict:
    """An RNG state file's contents in today's plain form (see ``state.rng_state``)."""
    state = dict(state)
    if isinstance(state.get("python"), tuple):
        version, internal, gauss = state["python"]
        state["python"] = [version, list(internal), gauss]
    if isinstance(state.get("numpy"), tuple):
        name, key, pos, has_gauss, gauss = state["numpy"]
        state["numpy"] = {"bit_generator": name,
                          "key": torch.from_numpy(np.asarray(key).astype(np.int64)),
                          "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}
    return state


def _needs_upgrade(file: Path) -> bool:
    try:
        load_plain(file)
    except ConfigError:
        return True
    return False


def upgrade_checkpoint(folder: str | os.PathLike) -> list[Path]:
    """Convert the files of checkpoint ``folder`` that :func:`load_plain` refuses; return them.
    Only for a checkpoint you trust: reading them runs whatever code they hold."""
    folder = Path(folder)
    if not (folder / TRAINER_STATE).is_file():
        raise ConfigError(f"{folder} is not a meshtrain checkpoint (no {TRAINER_STATE}); pass a "
                          "checkpoint folder such as runs/<name>/<time>/checkpoints/final")
    read_metadata(folder)  # DCP's part was always plain: one that is not, was not written by us
    changed = []
    for file in [folder / TRAINER_STATE, *sorted(folder.glob("rng_rank*.pt"))]:
        if not _needs_upgrade(file):
            continue
        value = torch.load(file, weights_only=False)  # trusted by the user (--trust)
        if file.name.startswith("rng_rank"):
            value = _plain_rng(value)
        check_plain(value, str(file))
        partial = file.with_name(f".{file.name}.partial")
        torch.save(value, partial)
        os.replace(partial, file)
        changed.append(file)
    return changed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="meshtrain upgrade-checkpoint",
        description="Rewrite a checkpoint written by an older meshtrain so that it loads safely "
                    "(plain data only). Reading the old files runs any code they hold: use it "
                    "only on checkpoints you or someone you trust wrote.")
    parser.add_argument("checkpoint", nargs="+", help="checkpoint folder(s)")
    parser.add_argument("--trust", action="store_true",
                        help="required: you trust these files (they are read with full unpickling)")
    args = parser.parse_args(argv)
    if not args.trust:
        raise ConfigError("upgrade-checkpoint reads the old files with full unpickling, which runs "
                          "any code they hold; add --trust if you (or someone you trust) wrote "
                          f"{' '.join(args.checkpoint)}")
    for folder in args.checkpoint:
        try:
            changed = upgrade_checkpoint(folder)
        except (pickle.UnpicklingError, EOFError, OSError) as error:
            raise ConfigError(f"{folder}: could not read it ({error})") from None
        what = ", ".join(f.name for f in changed) if changed else "nothing to change"
        print(f"{folder}: {what}")
    return 0
