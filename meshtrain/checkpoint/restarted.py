"""A restarted job (``meshtrain run --max-restarts``, a Slurm requeue): which run folder it
continues, and what it says when there is no checkpoint to continue from.

``resume="auto"`` alone would start a restarted job afresh in a new folder whenever its earlier
attempt saved no checkpoint, leaving one folder per attempt and nothing saying that the work
was lost. Instead the restarted job continues the folder its earlier attempt wrote (the run
folder's lock names the job: run_lock.py), from its newest checkpoint or, without one, from
step 0, saying which steps are lost; the rows the earlier attempt logged are dropped.

Before a job under ``--max-restarts`` starts without any periodic checkpoint, one line says
that a restart would start again from step 0 (restarts are still useful there: a failure at
start-up, a short job), rather than refusing it.
"""

from __future__ import annotations

import os
from pathlib import Path

from meshtrain.checkpoint.manager import latest_complete


def restart_count() -> int:
    """How many times this job was restarted after a failure (torchrun), or requeued (Slurm)."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 0


def earlier_attempt(resume, run_dir, job_folder: Path) -> tuple[Path, Path | None] | None:
    """(The run folder, its newest checkpoint or None) that a restarted job continues under
    ``resume="auto"`` without ``run_dir``: the folder its earlier attempt wrote; None when this
    is not a restart, or no folder names this job."""
    from meshtrain.checkpoint.run_lock import folder_of_this_job

    if resume != "auto" or run_dir is not None or not restart_count():
        return None
    folder = folder_of_this_job(job_folder)
    if folder is None:
        return None
    return folder, latest_complete(folder / "checkpoints")


def note_start(trainer) -> None:
    """(Fit, after the resume or instead of one; rank 0 speaks.) A restart with nothing to
    resume from: the earlier attempts' logged rows dropped, and the loss said. A first attempt
    that may be restarted without periodic checkpoints: said once."""
    from meshtrain.observe.loggers.local import forget_steps_after

    t = trainer
    periodic = any(t._settings.get(name) for name in (
        "checkpoint_every_n_steps", "checkpoint_every_n_minutes", "checkpoint_every_n_epochs"))
    restarts = restart_count()
    if restarts and t._resume_from is None and t.resume == "auto":
        dropped = forget_steps_after(t, 0)
        logged = f" ({dropped} metrics.csv row(s) of it dropped)" if dropped else ""
        t.print(f"restart {restarts} of this job: {t.run_dir} holds no checkpoint to resume "
                f"from, so training starts again from step 0 there and what the earlier "
                f"attempt trained is lost{logged}; checkpoint_every_n_steps (or _minutes) "
                "keeps it")
    allowed = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if not restarts and not periodic and allowed.isdigit() and int(allowed) > 0:
        t.print(f"--max-restarts {allowed} without periodic checkpoints: a restart starts again "
                "from step 0 and the steps trained before the failure are lost; set "
                "checkpoint_every_n_steps (or _minutes) to resume from the last one instead")
