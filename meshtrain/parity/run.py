"""Training the runs ``meshtrain parity`` compares: one process and each layout, in fp32 and in
float64, each in fresh processes; then one :class:`~meshtrain.parity.verdict.Row` per layout."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import warnings

import torch

from meshtrain.callbacks import Callback
from meshtrain.errors import ConfigError
from meshtrain.parallel.whole_state import whole_state
from meshtrain.parity.job import Source, floor_split, layout_world_size, run_settings
from meshtrain.parity.verdict import (
    F64_TOL, FLOOR_SLACK, HEADER, GradSizes, Row, compare, compare_float64, float64_job,
    fp32_differences, model_floor, table,
)

#: max |dparam| and |dloss| a layout may differ from one process by in fp32 (the verdict where
#: no float64 run exists; mixed precision: see docs/parity.md for how they were measured)
TOLERANCE = {"fp32": 1e-5}

#: --reference: what each layout is judged by (meshtrain/parity/verdict.py)
REFERENCES = ("auto", "float64", "fp32")


class Curves(Callback):
    """Records every step's logged loss (averaged over the ranks) and gradient norm."""

    def __init__(self):
        self.losses, self.grad_norms = [], []

    def on_train_step_end(self, trainer, metrics):
        if "train/loss" in metrics:
            self.losses.append(metrics["train/loss"])
        norm = trainer.grad_norm
        self.grad_norms.append(float(norm) if norm is not None else float("nan"))


def train(source: Source, layout: str | None, steps: int, quiet: bool = True,
          float64: bool = False, extra: dict | None = None) -> dict | None:
    """Train ``steps`` steps of the job under ``layout`` (one process when None; ``float64``:
    the job cast to float64; ``extra``: settings besides the job's) on this rank; rank 0
    returns {"params", "losses", "grad_norms", "seconds"} (one process: also "grad_sizes", each
    parameter's largest gradient element), the other ranks None."""
    from meshtrain.trainer import Trainer

    if quiet:  # torch's performance notes, once per rank and run (--verbose shows them)
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    job = source.load()
    if float64:
        job = float64_job(job)
    curves, sizes = Curves(), GradSizes()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        kwargs = run_settings(job, layout, steps, run_dir, extra)
        kwargs["callbacks"] = [curves, *([] if layout else [sizes]), *kwargs.get("callbacks", ())]
        with contextlib.redirect_stdout(open(os.devnull, "w")) if quiet else \
                contextlib.nullcontext():
            trainer = Trainer(**kwargs)
            model = trainer.fit(job["model"], job["train_data"], optimizer=job["optimizer"],
                                loss_fn=job.get("loss_fn"), lr_scheduler=job.get("lr_scheduler"))
        params = whole_state(model, trainer.layout.degree("pp"))
    if not trainer.is_global_zero:
        return None
    return {"params": params, "losses": torch.tensor(curves.losses, dtype=torch.float64),
            "grad_norms": torch.tensor(curves.grad_norms, dtype=torch.float64),
            "grad_sizes": sizes.sizes, "seconds": time.perf_counter() - start}


def _train_rank(source: Source, layout: str | None, steps: int, quiet: bool,
                float64: bool = False, extra: dict | None = None):
    try:
        return train(source, layout, steps, quiet, float64, extra)
    except ConfigError as error:  # the message, not a traceback per rank
        raise SystemExit(f"meshtrain: error: {error}") from None


class _Runner:
    """Runs of one job, each in fresh processes (``run_workers``); rank 0's result."""

    def __init__(self, source: Source, steps: int, quiet: bool, timeout: float):
        self.args, self.timeout = (source, steps, quiet), timeout

    def __call__(self, layout: str | None, float64: bool = False, extra: dict | None = None):
        from meshtrain.launch.spawn import run_workers

        source, steps, quiet = self.args
        ranks = layout_world_size(layout) if layout else 1
        return run_workers(_train_rank, ranks, (source, layout, steps, quiet, float64, extra),
                           timeout=self.timeout)[0]


def parity(source: Source, layouts: list[str], steps: int, *, tol: float | None = None,
           timeout: float = 600, quiet: bool = True, out=print,
           reference: str = "auto") -> list[Row]:
    """Train one process, then each layout; return one :class:`Row` per layout.
    ``reference``: "auto" judges each layout in float64 where the job and the layout can run
    so (else in fp32, marked); "float64" insists; "fp32": fp32 runs alone, the tolerance."""
    if reference not in REFERENCES:
        raise ConfigError(f"--reference must be one of {', '.join(REFERENCES)}, got {reference!r}")
    from meshtrain.trainer import Trainer

    job = source.load()  # the job's own errors, before any process starts
    precision = job["settings"].get("precision") or "fp32"
    if tol is None:
        if precision not in TOLERANCE:
            raise ConfigError(f"no default parity tolerance for precision={precision!r}; pass "
                              f"--tol (measured tolerances: {TOLERANCE})")
        tol = TOLERANCE[precision]
    rows, runnable, cuts = [], [], {}
    for layout in layouts:
        row = Row(layout, 0, tol=tol)
        try:
            row.ranks = layout_world_size(layout)
            with tempfile.TemporaryDirectory() as run_dir:  # refused before any process starts?
                trainer = Trainer(**run_settings(job, layout, steps, run_dir))
                _check(trainer, job)
            # the samples of one micro-step over all ranks, where it cuts the step's batch
            samples = (trainer.micro_batch_size or trainer.global_batch_size) * \
                trainer.layout.batch_degree
            cuts[layout] = samples if samples < trainer.global_batch_size else None
            runnable.append(row)
        except ConfigError as error:
            row.error = f"refused before start: {error}"
        rows.append(row)
    out(f"parity: {steps} steps of {source.target}, precision {precision}; one process first, "
        f"then {len(runnable)} layout(s): "
        + "; ".join(f"{row.layout} on {row.ranks} process(es)" for row in runnable)
        + (" (several layouts are separated by ';': \"dp=2;tp=2\" is two)"
           if len(layouts) == 1 and "," in layouts[0] else ""))
    run = _Runner(source, steps, quiet, timeout)
    try:  # (not when every layout was refused: nothing to compare it with)
        ref32 = run(None) if runnable else None
    except Exception as error:  # noqa: BLE001 -- no reference: each row says why, not a crash
        for row in runnable:
            row.error = f"the one-process reference failed: {_last_line(str(error))}"
        runnable = []
    one64, floor, no64, coupled = None, None, "--reference fp32", False
    if runnable and reference != "fp32":
        try:
            float64_job(job)  # a job that cannot be cast says why, before any process
            one64 = run(None, float64=True)
        except Exception as error:  # noqa: BLE001 -- a model that cannot run in float64
            no64 = f"one process cannot run in float64: {_last_line(str(error))}"
            if reference == "float64":
                for row in runnable:
                    row.error = no64
                runnable = []
            else:
                out(f"  {no64}: every layout judged in fp32, by the tolerance {tol:.0e}")
    if one64 is not None:
        floor, coupled = _model_floor(run, job, one64, out)
    same_cut: dict = {}  # micro-step samples -> one process in float64 cut the same way
    for row in runnable:
        out(f"  {row.layout} on {row.ranks} process(es) ...")
        try:
            run32 = run(row.layout)
        except Exception as error:  # noqa: BLE001 -- one failing layout is a row, not the end
            row.error = _last_line(str(error))
            continue
        run64, why = None, no64
        if one64 is not None:
            try:
                run64 = run(row.layout, float64=True)
            except Exception as error:  # noqa: BLE001 -- this layout cannot run in float64
                why = f"the layout cannot run in float64: {_last_line(str(error))}"
                if reference == "float64":
                    row.error = why
                    continue
        if run64 is None:
            compare(ref32, run32, row, one64, why=why)
        elif not fp32_differences(ref32, run32, row).error:
            compare_float64(one64, run64, row, floor)
            row.seconds += run64["seconds"]
            if coupled and not row.ok and cuts[row.layout]:
                _same_cut(run, same_cut, cuts[row.layout], run64, row)
    out(table([HEADER] + [row.cells() for row in rows]))
    for row in rows:
        if row.fp32_verdict and not row.error:
            out(f"{row.layout}: judged in fp32 ({row.fp32_verdict})")
        if row.note:
            out(f"{row.layout}: {row.note}")
    zero = sorted({name for row in rows for name in row.zero_gradient})
    if zero:
        out(f"~0 gradient in one process, so moved by the optimizer's reaction to rounding "
            f"alone (not judged): {', '.join(zero)}")
    return rows


def _check(trainer, job: dict) -> None:
    """What ``fit`` checks before any process starts (the model against the layout on a meta
    copy): a refusal is the layout's row, said once, instead of every rank's error."""
    try:
        trainer.check(job["model"], job["train_data"], optimizer=job["optimizer"],
                      loss_fn=job.get("loss_fn"), lr_scheduler=job.get("lr_scheduler"))
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 -- not a refusal: the layout's run shows what fails
        pass


def _model_floor(run, job: dict, one64: dict, out) -> tuple[float | None, bool]:
    """The model's own float64 floor (verdict.model_floor), from one more one-process run, and
    whether cutting the batch into micro-batches changes this job's training."""
    split = floor_split(job)
    if split is None:
        out(f"  float64: judged to {F64_TOL:.0e} (the batch has no other split)")
        return None, False
    try:
        again = run(None, float64=True, extra={"micro_batch_size": split})
    except Exception as error:  # noqa: BLE001 -- the split refused: no floor, the tight bound
        out(f"  float64: judged to {F64_TOL:.0e} (micro-batches of {split} refused: "
            f"{_last_line(str(error))})")
        return None, False
    floor = model_floor(one64, again)
    if floor is None:
        out(f"  float64: judged to {F64_TOL:.0e} (micro-batches of {split} change this job's "
            "training: batch statistics or a loss averaged per micro-batch)")
    else:
        out(f"  float64: one process with micro-batches of {split} moves {floor:.1e} (the "
            f"model's own floor): judged to max({F64_TOL:.0e}, {FLOOR_SLACK:g} x floor)")
    return floor, floor is None


def _same_cut(run, cache: dict, samples: int, run64: dict, row: Row) -> None:
    """For a job whose training changes with the micro-batch, a layout that differs from one
    process: is it one process cut as the layout cuts each step (micro-steps of ``samples``
    over all ranks)? Then the difference is the job's, and ``row.note`` says so."""
    if samples not in cache:
        try:
            cache[samples] = run(None, float64=True, extra={"micro_batch_size": samples})
        except Exception:  # noqa: BLE001 -- no such one-process run: nothing more to say
            cache[samples] = None
    if cache[samples] is None:
        return
    probe = compare_float64(cache[samples], run64, Row(row.layout, row.ranks, tol=row.tol))
    if probe.ok:
        row.note = (f"equal ({probe.rel64:.0e}) to one process with micro-batches of {samples}, "
                    f"as this layout cuts each step: the difference is the job's, whose training "
                    "changes with the micro-batch (batch statistics, a loss averaged per "
                    "micro-batch, experts balanced per micro-step), not the layout's")


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else text
    return last.removeprefix("SystemExit: ").removeprefix("meshtrain: error: ")
