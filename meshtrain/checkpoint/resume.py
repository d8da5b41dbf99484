"""Which checkpoint a new fit starts from (``Trainer(resume=...)``), and what a resume under a
different layout or world size can and cannot continue exactly.

``resume="auto"`` continues the newest *unfinished* run of this job: among the
``root_dir/name/*`` run folders, the newest (by time) whose last checkpoint did not reach its
stopping point and holds this model (the same parameter names and shapes); the run then goes on
in that folder. Finished runs and runs of another model are skipped (one line says so) and a new
run starts. Running the same command again after a crash (or under ``meshtrain run
--max-restarts K``) therefore picks up where the job stopped. With ``run_dir`` given, the folder
is the run: its newest checkpoint is continued, finished or not.

Every resume refuses, before training, a checkpoint of another model (the names that differ are
listed) and one at or past this fit's stopping point (nothing would be trained).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

from meshtrain.checkpoint.manager import latest_complete
from meshtrain.checkpoint.safe_load import check_complete, load_plain, read_metadata
from meshtrain.checkpoint.state import TRAINER_STATE
from meshtrain.errors import ConfigError
from meshtrain.loop.state import RESUMABLE_STOPS
from meshtrain.module.hparams import checkpointed

Shapes = dict[str, tuple | None]  # a model's state names -> shapes (None: not a tensor)


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
    try:
        check_complete(path)  # an unfinished save (.tmp-*), a missing or truncated file
    except ConfigError as error:
        raise ConfigError(f"resume={str(resume)!r}: {error}") from None


def job_name(name: str) -> str:
    """``name``, or for "auto" the running script's file name (``train_mlp.py`` ->
    ``train_mlp``); "run" without one (interactive, ``python -c``, pytest, a package's
    ``__main__``). ``meshtrain train CONFIG.toml`` names the job after its config instead."""
    if name != "auto":
        return name
    path = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    stem = os.path.splitext(os.path.basename(path))[0]
    if not path.endswith(".py") or stem in ("__main__", "ipykernel_launcher", "pytest"):
        return "run"
    return stem


# -- the model a checkpoint holds ---------------------------------------------------------------
def model_shapes(model: torch.nn.Module | None) -> Shapes | None:
    """The names and shapes a checkpoint of the (whole, unsharded) ``model`` holds; None for
    None. Works on a meta-device model; wrapper prefixes are dropped as the saver drops them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if model is None:
        return None
    try:
        state = get_model_state_dict(model)
    except Exception:  # noqa: BLE001 - a model DCP cannot list: no check (the load still is strict)
        return None
    return {name: tuple(value.shape) if isinstance(value, torch.Tensor) else None
            for name, value in state.items()}


def saved_shapes(path) -> Shapes:
    """The model's names and (global) shapes in checkpoint ``path``, from DCP's metadata: the
    whole model whatever the layout that saved it (pipeline ranks save their stages under the
    whole model's names)."""
    metadata = read_metadata(path).state_dict_metadata
    return {key[len("model."):]: tuple(item.size) if hasattr(item, "size") else None
            for key, item in metadata.items() if key.startswith("model.")}


def model_differences(saved: Shapes, expected: Shapes, few: int = 3) -> str:
    """What differs: per kind its count and up to ``few`` names ("" if nothing does)."""
    missing = [name for name in expected if name not in saved]
    unexpected = [name for name in saved if name not in expected]
    reshaped = [f"{name} (checkpoint {list(saved[name] or [])}, model {list(expected[name] or [])})"
                for name in expected if name in saved and saved[name] != expected[name]]
    parts = []
    for names, what in ((missing, "missing from the checkpoint"),
                        (unexpected, "in the checkpoint but not in the model"),
                        (reshaped, "of another shape")):
        if names:
            listed = f": {', '.join(names[:few])}" if few else ""
            more = ", ..." if len(names) > few > 0 else ""
            parts.append(f"{len(names)} {what}{listed}{more}")
    return "; ".join(parts)


def check_same_model(path, expected: Shapes | None) -> None:
    """Refuse a checkpoint whose model names or shapes differ from ``expected`` (None: no check)."""
    if expected is None:
        return
    differences = model_differences(saved_shapes(path), expected)
    if differences:
        raise ConfigError(
            f"checkpoint {path} holds another model than this one ({differences}); resume a "
            "checkpoint of this model (the same parameter names and shapes), or start a new run "
            "with resume=None (and another run_dir, if you gave one)")


# -- resume="auto": which run ---------------------------------------------------------------------
def is_finished(path: Path, state: dict) -> bool:
    """Did the checkpoint's run reach its stopping point? (Checkpoints older than the
    ``finished`` record: only the final one counts as finished.)"""
    return bool(state.get("finished", path.name == "final"))


def _why_not(path: Path, shapes: Shapes | None) -> str | None:
    """Why ``resume="auto"`` must not continue the run of checkpoint ``path`` (None: it may)."""
    try:
        state = load_plain(path / TRAINER_STATE)
        if is_finished(path, state):
            return f"finished at step {state.get('global_step')}"
        differences = model_differences(saved_shapes(path), shapes, few=0) if shapes else ""
    except ConfigError as error:  # refused as unsafe: the user decides, not "auto"
        raise ConfigError(f"resume='auto' found {path}: {error}; or start a new run with "
                          "resume=None") from None
    except Exception as error:  # noqa: BLE001 - a damaged checkpoint is skipped, and said so
        return f"unreadable: {type(error).__name__}"
    return f"another model: {differences}" if differences else None


def find_checkpoint(resume, *, run_dir: Path | None, root_dir: Path, name: str,
                    shapes: Shapes | None = None) -> tuple[Path | None, Path | None]:
    """(checkpoint to load or None, the run folder to continue in or None for a new one).

    ``shapes``: the model's (:func:`model_shapes`), so that "auto" skips runs of another model;
    None when unknown before the model is built (the load then refuses such a checkpoint)."""
    if resume is None:
        return None, None
    if resume != "auto":
        return Path(resume), None
    if run_dir is not None:
        return latest_complete(run_dir / "checkpoints"), None
    usable, skipped = [], []
    for folder in sorted((root_dir / name).glob("*/checkpoints")):
        last = latest_complete(folder)
        if last is not None:
            why = _why_not(last, shapes)
            if why:
                skipped.append(f"{last} ({why})")
            else:
                usable.append(last)
    chosen = max(usable, key=lambda path: (path / TRAINER_STATE).stat().st_mtime, default=None)
    if skipped:
        more = f" and {len(skipped) - 2} more" if len(skipped) > 2 else ""
        then = f"continuing {chosen}" if chosen else "starting a new run"
        print(f"resume='auto': skipped {', '.join(skipped[-2:])}{more}; {then}", flush=True)
    return (chosen, chosen.parent.parent) if chosen else (None, None)


def new_run_dir(job: Path) -> Path:
    """A run folder of its own, created: ``job/<time>``, with ``-2``, ``-3``... if that one
    exists (created here, so that two jobs starting in the same second get two folders)."""
    from datetime import datetime

    path = base = job / datetime.now().strftime("%Y%m%d-%H%M%S")
    number = 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            number += 1
            path = base.with_name(f"{base.name}-{number}")


def resolve_run_dir(resume, *, run_dir, root_dir, name: str, rank: int,
                    shapes: Shapes | None = None) -> tuple[Path, Path | None]:
    """(the run folder, the checkpoint to resume from or None): rank 0 decides, creates the
    folder and takes its lock (run_lock.py: another job writing it is refused, on every rank,
    before anything is written), every rank follows (collective when a process group exists).
    A restarted job continues the folder of its earlier attempt (restarted.py)."""
    import torch.distributed as dist

    from meshtrain.checkpoint import run_lock
    from meshtrain.checkpoint.restarted import earlier_attempt

    path, resume_from, refusal = Path(run_dir) if run_dir else None, None, None
    if rank == 0:
        try:
            earlier = earlier_attempt(resume, run_dir, Path(root_dir) / name)
            if earlier is not None:
                path, resume_from = earlier
            else:
                resume_from, resumed_run = find_checkpoint(
                    resume, run_dir=path, root_dir=Path(root_dir), name=name, shapes=shapes)
                path = path or resumed_run or new_run_dir(Path(root_dir) / name)
            path.mkdir(parents=True, exist_ok=True)
            note = run_lock.acquire(path)
            if note:
                print(note, flush=True)
        except ConfigError as error:  # told to every rank: none waits for rank 0 in vain
            refusal = str(error)
    if dist.is_initialized():  # every rank writes checkpoints into rank 0's folder
        box = [str(path), resume_from and str(resume_from), refusal]
        dist.broadcast_object_list(box, src=0)
        path, resume_from, refusal = Path(box[0]), box[1] and Path(box[1]), box[2]
    if refusal is not None:
        raise ConfigError(refusal)
    return path, resume_from


# -- what may change on resume ------------------------------------------------------------------
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
            "batch (the micro-batch and accumulation may change freely), or start a new run "
            "with resume=None"
        )
    for key in ("seed", "shuffle"):
        if key in saved and saved[key] != now[key]:
            raise ConfigError(
                f"the checkpoint was trained with {key}={saved[key]!r} but this Trainer uses "
                f"{now[key]!r}: the data order would change mid-run; use {key}={saved[key]!r} "
                "(or start a new run with resume=None)"
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


def restore(path, model, optimizer, *, identity: dict, seed: int, rank: int,
            shapes: Shapes | None = None, extra: dict | None = None) -> dict:
    """Collective: load a checkpoint into ``model`` and ``optimizer`` after refusing one of
    another run (``identity``: see :func:`check_same_run`) or another model (``shapes``: the
    whole model's, see :func:`model_shapes`); return its trainer state. When the saved RNG
    streams belong to other ranks, start reproducible new ones (``rank``: the stream's,
    ParallelMesh.random_rank)."""
    from meshtrain.checkpoint.state import load_checkpoint

    path = Path(path)
    if (path / TRAINER_STATE).is_file():  # refuse before touching the model
        check_same_run(load_plain(path / TRAINER_STATE), identity)
        check_same_model(path, shapes)
    state = load_checkpoint(path, model, optimizer, extra)
    if not warn_rng_change(state, identity, has_randomness(model)):
        torch.manual_seed(seed + 1 + rank + 1_000_003 * state["global_step"])
    return state


def run_identity(t) -> dict:
    """What a resumed run of Trainer ``t`` is compared against (:func:`check_same_run`)."""
    return {"global_batch_size": t.global_batch_size, "seed": t.seed, "shuffle": t.shuffle,
            "world_size": t.world_size, "layout": str(t.layout)}


def trainer_state(t) -> tuple[dict, dict]:
    """(Trainer ``t``'s state, a summary) as a checkpoint stores them beside model and
    optimizer."""
    state = {**t.state.state_dict(),
             "lr_scheduler": t.lr_scheduler.state_dict() if t.lr_scheduler else None,
             "grad_scaler": t.precision.state_dict(), **run_identity(t),
             "finished": (t.should_stop and t.stop_reason not in RESUMABLE_STOPS)
             or t.global_step >= t.total_steps()}
    summary = {"step": t.global_step, "epoch": t.current_epoch, "layout": str(t.layout),
               "world_size": t.world_size, "metrics": t.callback_metrics,
               "hparams": t.hparams(), "module_hparams": checkpointed(t.model)}
    return state, summary


def stateful_callbacks(callbacks) -> list[tuple[str, object]]:
    """(name, callback) of the callbacks that keep state across a resume (a non-empty
    ``state_dict()``), named by class (``EMA``; ``EMA-2`` for a second one)."""
    named, seen = [], {}
    for callback in callbacks:
        name = type(callback).__name__
        seen[name] = seen.get(name, 0) + 1
        if hasattr(callback, "state_dict") and callback.state_dict():
            named.append((name if seen[name] == 1 else f"{name}-{seen[name]}", callback))
    return named


def callback_states(callbacks) -> dict[str, dict]:
    """What a checkpoint saves of the callbacks: {name: state_dict()}."""
    return {name: callback.state_dict() for name, callback in stateful_callbacks(callbacks)}


def restore_trainer(t, path) -> None:
    """Trainer.load_checkpoint: model, optimizer, loop position, scheduler, grad scaler and the
    callbacks' state (a callback the checkpoint lacks keeps its own, with a note)."""
    named = stateful_callbacks(t.callbacks)
    states = {name: callback.state_dict() for name, callback in named}
    state = restore(path, t.model, t.optimizer, identity=run_identity(t), seed=t.seed,
                    rank=t.mesh.random_rank if t.mesh is not None else t.rank,
                    shapes=t._model_shapes, extra=states)
    for name, callback in named:
        if name in states:
            callback.load_state_dict(states[name])
        else:
            t.print(f"{name}: not in the checkpoint {path}; it starts from the loaded weights")
    t.state.load_state_dict(state)
    if t.lr_scheduler is not None and state["lr_scheduler"] is not None:
        t.lr_scheduler.load_state_dict(state["lr_scheduler"])
    t.precision.load_state_dict(state["grad_scaler"])


def resume_fit(trainer, path) -> None:
    """Fit's resume (collective): refuse a checkpoint at or past this fit's stopping point,
    load it (:func:`restore` refuses another model) and say where the run continues."""
    path, total = Path(path), trainer.total_steps()
    step = load_plain(path / TRAINER_STATE)["global_step"]
    if step >= total:
        setting = "max_steps" if trainer.max_steps == total else "max_epochs"
        what = (f"resume='auto' chose {path}, which is" if trainer.resume == "auto" else
                f"resume={str(path)!r} is")
        pinned = trainer.resume == "auto" and trainer._settings["run_dir"] is not None
        elsewhere = " and another run_dir" if pinned else ""
        raise ConfigError(
            f"{what} at step {step}, but this fit stops at step {total} ({setting}="
            f"{getattr(trainer, setting)}): nothing would be trained; raise {setting} to "
            f"continue that run past step {step}, or start a new run with resume=None{elsewhere}")
    trainer.load_checkpoint(path)
    from meshtrain.observe.loggers.local import forget_steps_after

    dropped = forget_steps_after(trainer, trainer.global_step)
    fresh = ("; resume=None (--checkpoint.resume=none) starts a new run instead"
             if trainer.resume == "auto" else "")
    trainer.print(f"resumed from {path} at step {trainer.global_step} (training on to step "
                  f"{total} in {trainer.run_dir}){fresh}")
    if dropped:
        trainer.print(f"metrics.csv: {dropped} row(s) of the steps after {trainer.global_step}, "
                      "logged before the stop, dropped (they are trained and logged again)")
