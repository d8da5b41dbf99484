"""Which checkpoint a new fit starts from (``Trainer(resume=...)``), and what a resume under a
different layout or world size can and cannot continue exactly.

``resume="auto"`` looks for the newest complete checkpoint of this job: in ``run_dir/checkpoints``
when a run folder is given, else in every ``root_dir/name/*/checkpoints``; the run then continues
in that checkpoint's run folder. Running the same command again after a crash (or under
``meshtrain run --max-restarts K``) therefore picks up where the job stopped.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from meshtrain.checkpoint.manager import checkpoint_step, latest_complete
from meshtrain.checkpoint.state import TRAINER_STATE
from meshtrain.errors import ConfigError


def check_resume(resume) -> None:
    """Before any process starts: ``resume`` is "auto", None or an existing complete checkpoint."""
    if resume is None or resume == "auto":
        return
    if not isinstance(resume, (str, os.PathLike)):
        raise ConfigError(f"resume must be 'auto', None or a checkpoint folder, got {resume!r}")
    path = Path(resume)
    if not path.is_dir():
        raise ConfigError(
            f"resume={str(resume)!r} does not exist; give a checkpoint folder such as "
            "runs/<name>/<time>/checkpoints/step_00000100, resume='auto' or resume=None"
        )
    if not (path / TRAINER_STATE).is_file():
        raise ConfigError(
            f"resume={str(resume)!r} is not a complete meshtrain checkpoint (no {TRAINER_STATE}; "
            "an interrupted save?); pick another folder in its checkpoints/ or use resume='auto'"
        )


def find_checkpoint(resume, *, run_dir: Path | None, root_dir: Path,
                    name: str) -> tuple[Path | None, Path | None]:
    """(checkpoint to load or None, the run folder to continue in or None for a new one)."""
    if resume is None:
        return None, None
    if resume != "auto":
        return Path(resume), None
    if run_dir is not None:
        return latest_complete(run_dir / "checkpoints"), None
    job = root_dir / name
    found = [c for c in (latest_complete(d) for d in job.glob("*/checkpoints")) if c is not None]
    if not found:
        return None, None
    newest = max(found, key=lambda path: (checkpoint_step(path), path.stat().st_mtime))
    return newest, newest.parent.parent


def resolve_run_dir(resume, *, run_dir, root_dir, name: str, rank: int) -> tuple[Path, Path | None]:
    """(the run folder, the checkpoint to resume from or None): rank 0 decides, every rank
    follows (collective when a process group exists), and rank 0 creates the folder."""
    from datetime import datetime

    import torch.distributed as dist

    path, resume_from = Path(run_dir) if run_dir else None, None
    if rank == 0:
        resume_from, resumed_run = find_checkpoint(resume, run_dir=path, root_dir=Path(root_dir),
                                                   name=name)
        path = path or resumed_run or Path(root_dir) / name / datetime.now().strftime(
            "%Y%m%d-%H%M%S")
    if dist.is_initialized():  # every rank writes checkpoints into rank 0's folder
        box = [str(path), resume_from and str(resume_from)]
        dist.broadcast_object_list(box, src=0)
        path, resume_from = Path(box[0]), box[1] and Path(box[1])
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    return path, resume_from


def has_randomness(model: torch.nn.Module) -> bool:
    """Does the forward pass draw random numbers (dropout with p > 0)?"""
    return any(
        isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()
    )


def check_same_run(saved: dict, now: dict) -> None:
    """Refuse what cannot continue the same run; warn about what continues only approximately."""
    if saved.get("global_batch_size") != now["global_batch_size"]:
        raise ConfigError(
            f"the checkpoint was trained with global_batch_size={saved.get('global_batch_size')} "
            f"but this Trainer uses {now['global_batch_size']}; resume with the same global "
            "batch (the micro-batch and accumulation may change freely)"
        )
    for key in ("seed", "shuffle"):
        if key in saved and saved[key] != now[key]:
            raise ConfigError(
                f"the checkpoint was trained with {key}={saved[key]!r} but this Trainer uses "
                f"{now[key]!r}: the data order would change mid-run; use {key}={saved[key]!r}"
            )


def warn_rng_change(saved: dict, now: dict, random_model: bool) -> bool:
    """True if the per-rank RNG states can be restored (same world size and layout)."""
    same = saved.get("world_size") == now["world_size"] and saved.get("layout") == now["layout"]
    if not same and random_model:
        warnings.warn(
            f"resuming a checkpoint saved by {saved.get('world_size')} ranks under layout "
            f"{saved.get('layout')} on {now['world_size']} ranks under {now['layout']}: the "
            "model, optimizer and data position continue exactly, but the per-rank random "
            "streams (dropout masks) start afresh, so the run will not match an uninterrupted "
            "one bit for bit",
            stacklevel=3,
        )
    return same


def restore(path, model, optimizer, *, identity: dict, seed: int, rank: int) -> dict:
    """Collective: load a checkpoint into ``model`` and ``optimizer`` after refusing one of
    another run (``identity``: see :func:`check_same_run`); return its trainer state. When the
    saved RNG streams belong to other ranks, start reproducible new ones."""
    from meshtrain.checkpoint.state import load_checkpoint

    path = Path(path)
    if (path / TRAINER_STATE).is_file():  # refuse before touching the model
        check_same_run(torch.load(path / TRAINER_STATE, weights_only=False), identity)
    state = load_checkpoint(path, model, optimizer)
    if not warn_rng_change(state, identity, has_randomness(model)):
        torch.manual_seed(seed + 1 + rank + 1_000_003 * state["global_step"])
    return state
