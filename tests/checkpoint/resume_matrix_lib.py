"""The resume matrix: a checkpoint saved under one layout resumes under another with the same
weights and optimizer state, the same data position, the same next global batch and the same
next-step loss as one process that never stopped.

Shared by ``benchmarks/resume_matrix.py`` (every pair of :data:`LAYOUTS`) and
``tests/checkpoint/test_resume_matrix.py`` (a few pairs). For a set of (from, to) cells:

1. **Reference**: one process trains ``steps + 1`` steps straight through, recording each
   step's loss and the global batch it consumed (the dataset indices, :class:`IndexedTokens`),
   its data position after step ``steps``, and the full parameters and optimizer state at the
   end.
2. **From**: each "from" layout trains ``steps`` steps and saves a periodic checkpoint at step
   ``steps`` (``checkpoint_every_n_steps``); its full model and optimizer state (DTensors
   gathered, pipeline stages and ZeRO-1 owners merged) is recorded at the end of the fit.
3. **To**: for each cell, the "to" layout resumes from that checkpoint (``resume=<folder>``)
   and trains one step. Before it, the loaded full state and the data position are recorded
   (``on_fit_start``); after it, the step's loss, its global batch (the indices every rank
   fetched, merged over the batch ranks) and the full state.

:func:`judge` then compares: loaded == saved (exactly), data position == the reference's,
next global batch == the reference's, next-step loss within 1e-6 of the reference's, and the
parameters after the step within 1e-5 of the reference's.

Ranks that run several fits run them one after the other in the same processes (one
``run_workers`` call per group of jobs of one world size); a group that fails or hangs is run
again one job per call, so that each failure is reported for its own cell.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from meshtrain import Callback, Trainer
from meshtrain.errors import ConfigError, WorkerFailed
from meshtrain.launch.spawn import run_workers

NUM_SAMPLES, VOCAB, SEQ = 96, 16, 8
GLOBAL_BATCH = 16  # 6 steps an epoch: step 4 (after 3) is mid-epoch
STEPS = 3  # trained before the checkpoint; the resumed run trains step STEPS + 1

LOSS_TOL, PARAM_TOL = 1e-6, 1e-5

# name -> (processes, Trainer settings)
LAYOUTS: dict[str, tuple[int, dict]] = {
    "1 process": (1, dict(layout=None)),
    "dp=2": (2, dict(layout="dp=2")),
    "zero1=2": (2, dict(layout="zero1=2")),
    "zero3=2": (2, dict(layout="zero3=2")),
    "tp=2": (2, dict(layout="tp=2")),
    "pp=2": (2, dict(layout="pp=2", pp_schedule="1f1b")),
    "pp=2 interleaved": (2, dict(layout="pp=2", pp_schedule="interleaved-1f1b",
                                 stages_per_rank=2)),
    "dp_shard=2,tp=2": (4, dict(layout="dp_shard=2,tp=2")),
    "dp_replicate=2,dp_shard=2": (4, dict(layout="dp_replicate=2,dp_shard=2")),
    "pp=2,dp_shard=2": (4, dict(layout="pp=2,dp_shard=2", pp_schedule="1f1b")),
}
REFERENCE = "reference"


# ---- model, data, optimizer ---------------------------------------------------------------------
def model():
    """A 4-block GPT (vocab 16, 8 tokens, d_model 16, 2 heads, no biases, no dropout): 4 blocks
    for 2 pipeline ranks x 2 stages each."""
    from meshtrain.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=4, num_heads=2, d_model=16,
                         bias=False, dropout=0.0))


def optimizer(params):
    # lr 1e-3 as in tests/parity.py: at 1e-2 Adam amplifies summation-order noise
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class IndexedTokens(Dataset):
    """Random token sequences (inputs, next-token targets) that record which indices this
    process fetched: the global batch of a step is what all batch ranks fetched during it."""

    def __init__(self, seed: int = 99):
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (NUM_SAMPLES, SEQ + 1), generator=gen)
        self.fetched: list[int] = []

    def __len__(self):
        return NUM_SAMPLES

    def __getitem__(self, index):
        self.fetched.append(int(index))
        return self.tokens[index, :-1], self.tokens[index, 1:]


# ---- full state ---------------------------------------------------------------------------------
def _full(value):
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else torch.tensor(value)


def full_state(trainer) -> dict[str, torch.Tensor]:
    """Collective: the whole model and optimizer state, as the checkpoint holds it, on every
    rank: ``model.<fqn>``, ``optim.<fqn>.<key>`` (exp_avg, exp_avg_sq, step) and
    ``optim.<fqn>.hyperparameters`` (lr, betas, eps, weight decay of its live group). Sharded
    tensors are gathered; what each rank holds alone (pipeline stages, ZeRO-1's owned state)
    is merged over the ranks."""
    from meshtrain.checkpoint.state import checkpoint_state

    sd = checkpoint_state(trainer.model, trainer.optimizer)
    flat = {f"model.{k}": _full(v) for k, v in sd["model"].items()}
    for fqn, entry in sd["optim"]["state"].items():
        for key, value in entry.items():
            flat[f"optim.{fqn}.{key}"] = _full(value)
    # each parameter's hyperparameters, as the live optimizer has them
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    for group in trainer.optimizer.param_groups:
        values = [group["lr"], *group["betas"], group["eps"], group["weight_decay"]]
        for p in group["params"]:
            if id(p) not in names:
                raise AssertionError("the optimizer holds a parameter the model does not name")
            flat[f"optim.{names[id(p)]}.hyperparameters"] = torch.tensor(values,
                                                                        dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, flat)
        merged: dict = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)
        flat = merged
    return dict(sorted(flat.items()))


def _position(trainer) -> dict:
    sampler = trainer.state.sampler
    return {"global_step": trainer.global_step, "epoch": sampler.epoch,
            "consumed_samples": sampler.consumed_samples}


class _Recorder(Callback):
    """Per step: the loss and this rank's fetched indices; full states where asked."""

    def __init__(self, dataset: IndexedTokens, capture_steps=(), capture_start=False):
        self.dataset, self.capture_steps, self.capture_start = dataset, set(capture_steps), \
            capture_start
        self.losses: dict[int, float] = {}
        self.fetched: dict[int, list[int]] = {}
        self.states: dict = {}
        self.positions: dict = {}

    def on_fit_start(self, trainer):
        self.dataset.fetched.clear()  # the Trainer's look at a sample input
        if self.capture_start:
            self.states["start"] = full_state(trainer)
            self.positions["start"] = _position(trainer)

    def on_train_step_end(self, trainer, metrics):
        step = trainer.global_step
        self.losses[step] = metrics["train/loss"]
        self.fetched[step] = list(self.dataset.fetched)
        self.dataset.fetched.clear()
        if step in self.capture_steps:
            self.states[step] = full_state(trainer)
            self.positions[step] = _position(trainer)

    def on_fit_end(self, trainer):
        self.states["end"] = full_state(trainer)


def _global_batches(trainer, fetched: dict[int, list[int]]) -> tuple[dict, list[str]]:
    """{step: sorted indices of the global batch}, and the disagreements between ranks that
    should have fetched the same samples (same batch rank: tensor or pipeline peers)."""
    mine = (trainer.dp_rank, fetched)
    parts = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    by_batch_rank: dict[int, dict] = {}
    problems = []
    for rank, (batch_rank, steps) in enumerate(parts):
        seen = by_batch_rank.setdefault(batch_rank, steps)
        if seen != steps:
            problems.append(f"rank {rank} (batch rank {batch_rank}) fetched {steps}, a peer "
                            f"{seen}")
    batches = {}
    for step in fetched:
        batches[step] = sorted(i for steps in by_batch_rank.values() for i in steps.get(step, []))
    return batches, problems


# ---- one fit ------------------------------------------------------------------------------------
def fit(layout: str, run_dir, max_steps: int, *, save_every: int | None = None,
        resume=None, capture_steps=(), capture_start=False) -> dict:
    """Train under ``LAYOUTS[layout]`` on this process's rank; rank 0 returns the record."""
    torch.set_num_threads(1)
    dataset = IndexedTokens()
    recorder = _Recorder(dataset, capture_steps, capture_start)
    trainer = Trainer(**LAYOUTS[layout][1], max_steps=max_steps,
                      global_batch_size=GLOBAL_BATCH, seed=0, log_every_n_steps=1, loggers=(),
                      progress_bar=False, save_final_checkpoint=False, run_dir=str(run_dir),
                      num_workers=0, accelerator="cpu", checkpoint_every_n_steps=save_every,
                      resume=None if resume is None else str(resume), callbacks=[recorder])
    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's progress lines
        trainer.fit(model, dataset, optimizer=optimizer, loss_fn=lm_loss)
    batches, problems = _global_batches(trainer, recorder.fetched)
    if trainer.rank != 0:
        return {}
    return {"losses": recorder.losses, "batches": batches, "batch_problems": problems,
            "states": recorder.states, "positions": recorder.positions,
            "micro_batch_size": trainer.micro_batch_size,
            "grad_accum_steps": trainer.grad_accum_steps}


@dataclass(frozen=True)
class Job:
    """One fit of a group: ``key`` names it in the results."""

    key: str
    layout: str
    run_dir: str
    max_steps: int
    save_every: int | None = None
    resume: str | None = None
    capture_steps: tuple = ()
    capture_start: bool = False


def _run_jobs(jobs: list[Job]) -> dict:
    """On every rank: the jobs one after the other. A refused one (ConfigError, raised alike on
    every rank) is recorded and the next one runs; any other error ends the group."""
    out = {}
    for job in jobs:
        try:
            result = fit(job.layout, job.run_dir, job.max_steps, save_every=job.save_every,
                         resume=job.resume, capture_steps=job.capture_steps,
                         capture_start=job.capture_start)
        except ConfigError as error:
            result = {"refused": f"{type(error).__name__}: {error}"}
        out[job.key] = result
    return out


def run_jobs(jobs: list[Job], *, timeout_per_job: float = 60.0, log=print) -> dict:
    """Run ``jobs`` (all of one world size) in one group of processes; if the group fails, run
    each job alone, so that a failure belongs to one job (``{"error": ...}``)."""
    if not jobs:
        return {}
    sizes = {LAYOUTS[job.layout][0] for job in jobs}
    assert len(sizes) == 1, f"jobs of several world sizes in one group: {sizes}"
    size = sizes.pop()
    try:
        return run_workers(_run_jobs, size, (jobs,), timeout=30 + timeout_per_job * len(jobs))[0]
    except WorkerFailed as error:
        if len(jobs) == 1:
            return {jobs[0].key: {"error": _short(error)}}
        log(f"a group of {len(jobs)} jobs on {size} processes failed; running them one by one "
            f"({_short(error)})")
    out = {}
    for job in jobs:
        out.update(run_jobs([job], timeout_per_job=timeout_per_job, log=log))
    return out


def _short(error: BaseException) -> str:
    """Each failed rank's last line: the exception (WorkerFailed lists every rank's)."""
    text = str(error)
    parts = re.split(r"^(rank \d+)(?: raised:\n|: )", text, flags=re.MULTILINE)
    if len(parts) < 3:
        return text.strip().splitlines()[-1] if text.strip() else repr(error)
    lines = []
    for rank, body in zip(parts[1::2], parts[2::2]):
        last = [line for line in body.strip().splitlines() if line.strip()]
        lines.append(f"{rank}: {last[-1].strip() if last else body.strip()}")
    return " | ".join(lines)


# ---- the matrix ---------------------------------------------------------------------------------
def checkpoint_of(base, layout: str, steps: int) -> Path:
    from meshtrain.checkpoint.manager import checkpoint_name

    return Path(base) / "from" / _slug(layout) / "checkpoints" / checkpoint_name(steps)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def run_matrix(cells: list[tuple[str, str]], base, *, steps: int = STEPS, log=print,
               group_by: str = "to") -> dict:
    """Run the reference, every "from" layout of ``cells`` and every cell; return all records:
    ``{"reference": ..., "from": {layout: ...}, "cells": {(from, to): ...}}``.

    ``group_by="to"``: one group of processes per "to" layout; ``"size"``: per world size."""
    base = Path(base)
    froms = sorted({f for f, _ in cells}, key=list(LAYOUTS).index)
    first = [Job(REFERENCE, "1 process", str(base / "reference"), steps + 1,
                 capture_steps=(steps,))]
    first += [Job(f, f, str(base / "from" / _slug(f)), steps, save_every=steps) for f in froms]
    records: dict = {"cells": {}}
    for size in sorted({LAYOUTS[j.layout][0] for j in first}):
        group = [j for j in first if LAYOUTS[j.layout][0] == size]
        log(f"training and saving: {', '.join(j.key for j in group)}")
        records.update(run_jobs(group, log=log))
    records["from"] = {f: records.pop(f) for f in froms}
    jobs = []
    for f, t in cells:
        ckpt = checkpoint_of(base, f, steps)
        jobs.append(Job(f"{f} -> {t}", t, str(base / "to" / f"{_slug(f)}__{_slug(t)}"),
                        steps + 1, resume=str(ckpt), capture_start=True))
    key = (lambda j: j.layout) if group_by == "to" else (lambda j: LAYOUTS[j.layout][0])
    groups: dict = {}
    for job in jobs:
        groups.setdefault(key(job), []).append(job)
    for name, group in groups.items():
        log(f"resuming under {name}: {len(group)} cell(s)")
        results = run_jobs(group, log=log)
        for (f, t), job in zip(cells, jobs):
            if job.key in results:
                records["cells"][(f, t)] = results[job.key]
    return records


def _max_diff(a: dict, b: dict, prefix: str = "") -> tuple[float, list[str]]:
    """Largest |a - b| over the keys starting with ``prefix``; keys missing on either side."""
    ka = {k for k in a if k.startswith(prefix)}
    kb = {k for k in b if k.startswith(prefix)}
    missing = sorted(ka ^ kb)
    worst = 0.0
    for k in sorted(ka & kb):
        if a[k].shape != b[k].shape:
            missing.append(f"{k} (shape {tuple(a[k].shape)} vs {tuple(b[k].shape)})")
            continue
        if a[k].numel():
            worst = max(worst, (a[k].double() - b[k].double()).abs().max().item())
    return worst, missing


@dataclass
class Verdict:
    """One cell: what was measured and whether it passes."""

    status: str  # "pass", "FAIL", "refused", "error"
    loaded_diff: float | None = None  # loaded vs saved, model and optimizer (must be 0)
    loss_diff: float | None = None
    param_diff: float | None = None
    position_equal: bool | None = None
    batch_equal: bool | None = None
    problems: tuple = ()

    @property
    def ok(self) -> bool:
        return self.status == "pass"


def judge(records: dict, cell: tuple[str, str], steps: int = STEPS) -> Verdict:
    """Compare one cell with its "from" run and with the reference."""
    ref, saved = records[REFERENCE], records["from"].get(cell[0], {})
    got = records["cells"].get(cell, {"error": "not run"})
    for what, record in (("reference", ref), ("from", saved), ("to", got)):
        if "refused" in record:
            return Verdict("refused", problems=(f"{what}: {record['refused']}",))
        if "error" in record:
            return Verdict("error", problems=(f"{what}: {record['error']}",))
    problems = []
    nxt = steps + 1
    loaded_diff, missing = _max_diff(got["states"]["start"], saved["states"]["end"])
    if missing:
        problems.append(f"loaded vs saved: keys differ: {missing[:4]}")
    if loaded_diff != 0.0:
        problems.append(f"loaded state differs from the saved one by {loaded_diff:.3g}")
    position_equal = got["positions"]["start"] == ref["positions"][steps]
    if not position_equal:
        problems.append(f"position {got['positions']['start']} != {ref['positions'][steps]}")
    if sorted(got["losses"]) != [nxt]:
        problems.append(f"resumed run trained steps {sorted(got['losses'])}, not [{nxt}]")
    batch_equal = got["batches"].get(nxt) == ref["batches"][nxt] and not got["batch_problems"]
    if not batch_equal:
        problems.append(f"batch of step {nxt}: {got['batches'].get(nxt)} != {ref['batches'][nxt]}"
                        f" {got['batch_problems'][:2]}")
    loss_diff = abs(got["losses"].get(nxt, float("nan")) - ref["losses"][nxt])
    if not loss_diff <= LOSS_TOL:
        problems.append(f"loss of step {nxt} differs by {loss_diff:.3g} (> {LOSS_TOL:g})")
    param_diff, missing = _max_diff(got["states"]["end"], ref["states"]["end"], "model.")
    if missing:
        problems.append(f"parameters after the step: keys differ: {missing[:4]}")
    if not param_diff <= PARAM_TOL:
        problems.append(f"parameters after the step differ by {param_diff:.3g} (> {PARAM_TOL:g})")
    return Verdict("FAIL" if problems else "pass", loaded_diff, loss_diff, param_diff,
                   position_equal, batch_equal, tuple(problems))
