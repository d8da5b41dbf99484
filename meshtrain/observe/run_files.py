"""The files a run leaves in its folder for ``meshtrain report`` (beside ``metrics.csv``,
``config.toml``, ``memory.txt``, ``loss.png``, ``checkpoints/``, ``stacks/``), and how they
are written and read. Only global rank zero writes them; every write is whole lines (an
append, flushed) or a whole file replaced at once, so a run killed mid-way leaves readable
files.

* ``environment.json``: what ran where, and how the run ended (rewritten at the start and the
  end): ``torch``, ``python``, ``platform``, ``hostname``, ``device_type``, ``device_name``,
  ``world_size``, ``nodes``, ``processes_per_node``, ``layout``, ``memory_limit_scope``
  ("device": each rank's own GPU; "node": the node's memory, which its ranks share) and
  ``memory_limit_source`` (what ``mem_limit_bytes`` below is), ``unit`` ("tokens" or
  "samples"), ``flops_per_item`` (model FLOPs per token or sample, forward and backward),
  ``peak_tflops`` and ``peak_source`` (the peak MFU is measured against, per rank),
  ``started``/``finished`` (ISO times),
  ``status`` ("running", then "finished", "preempted", "failed", "stopped_by_watchdog" or
  "killed"), ``error`` (the cause, ``"Type: message"``, or null), ``ending`` (how it ended: the
  rank, cause, exception, traceback, signal, step and who recorded it; meshtrain/observe/
  ending.py, which writes these three) and ``settings`` (the Trainer's settings, shown when
  there is no ``config.toml``).
* ``breakdown.csv``: one row per rank per logging interval: ``step``, ``rank``, then seconds
  per optimizer step averaged over the interval: ``wall_s`` (the loop's own clock: the
  interval's wall time, validation excepted, over its steps), ``step_s`` (the measured steps)
  and its parts :data:`PARTS` (``<part>_s``), which add up to ``step_s``; ``mem_peak_bytes``
  (this rank's peak so far) and ``mem_limit_bytes``: on a GPU its device's memory, on a CPU
  the node's (its cgroup's limit when one is set, else the machine's), which the node's ranks
  share (meshtrain/observe/memory/limit.py).
* ``events.jsonl``: one JSON object per line: ``time`` (ISO), ``step``, ``kind`` (one of
  :data:`EVENT_KINDS`), ``message``, and ``path`` (a file or folder in the run folder the
  event refers to: a checkpoint, a stack dump, a trace) or null. ``removed``: a checkpoint
  folder deleted on purpose (a best-k one that a better one replaced); the periodic ones
  ``keep_last_k`` rotates away are told from the settings and the later checkpoints.
* ``pipeline.json`` (``pp`` layouts): ``schedule``, ``pp``, ``microbatches``,
  ``stages_per_rank``, ``step`` (the recorded step), ``measured_bubble``, ``formula_bubble``,
  ``free_comm_bubble`` (the recorded steps replayed with free communication and no host work:
  what the stages' own times leave), and ``events``: every F/B/W action of that step as
  ``[rank, stage, microbatch, kind, start_s, end_s]``.
* ``traces/rank<r>.json``: the torch profiler's Chrome trace of the ``profile_steps`` (every
  rank writes its own).
"""

from __future__ import annotations

import csv
import datetime
import json
import os
from pathlib import Path

PARTS = ("data", "compute", "comm", "bubble", "optimizer", "checkpoint", "other")
PART_DOCS = {
    "data": "waiting for the loader's next batch",
    "compute": "forward and backward (under pp: the schedule's F/B actions)",
    "comm": "blocked in collectives that compute did not hide (gradient sync after backward)",
    "bubble": "pp: the schedule's time outside this rank's F/B actions (waits and p2p)",
    "optimizer": "clipping, the optimizer step, zero_grad, the scheduler",
    "checkpoint": "training blocked by checkpoint saves",
    "other": "everything else: the loop, callbacks, logging, what runs between two steps",
}
BREAKDOWN_COLUMNS = ("step", "rank", "wall_s", "step_s", *(f"{p}_s" for p in PARTS),
                     "mem_peak_bytes", "mem_limit_bytes")
EVENT_KINDS = ("checkpoint", "restart", "skip", "rollback", "watchdog", "desync",
               "straggler", "profile", "failure", "killed", "preempted", "pruned", "removed")
# metrics meshtrain logs that the run's summaries (the report's, the lines fit ends with) leave
# to the throughput section and the fit line; every other metric, the user's own
# (self.log / trainer.log) included, is summarised with its last value
NOT_SUMMARISED = ("train/tokens_per_s", "train/samples_per_s", "train/tflops", "train/mfu",
                  "train/skipped_steps", "epoch")

ENVIRONMENT, BREAKDOWN, EVENTS, PIPELINE = ("environment.json", "breakdown.csv",
                                            "events.jsonl", "pipeline.json")
EXPERTS = "experts.jsonl"  # an MoE model's tokens per expert, each layer, at each log step


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def write_json(path: Path, data: dict) -> None:
    """``data`` as ``path``, replaced at once (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, or None when it is missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def update_environment(run_dir: Path, **fields) -> None:
    """Merge ``fields`` into ``environment.json``."""
    path = Path(run_dir) / ENVIRONMENT
    write_json(path, {**(read_json(path) or {}), **fields})


def _end_line(path: Path) -> None:
    """Finish a last line cut short by a kill, so that an append starts a line of its own."""
    try:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
    except OSError:  # missing or empty
        return
    if cut:
        with open(path, "a") as f:
            f.write("\n")


def append_event(run_dir: Path, kind: str, message: str, step: int | None = None,
                 path: str | os.PathLike | None = None) -> None:
    """One line in ``events.jsonl``; ``path`` is stored relative to the run folder."""
    assert kind in EVENT_KINDS, kind
    if path is not None:
        path = Path(path)
        try:
            path = path.resolve().relative_to(Path(run_dir).resolve())
        except ValueError:
            pass
        path = str(path)
    line = json.dumps({"time": now(), "step": step, "kind": kind, "message": message,
                       "path": path})
    _end_line(Path(run_dir) / EVENTS)
    with open(Path(run_dir) / EVENTS, "a") as f:
        f.write(line + "\n")


def append_expert_load(run_dir: Path, step: int, counts: list[list[float]]) -> None:
    """One line in ``experts.jsonl``: a step's tokens per expert ([layer][expert], every
    rank's)."""
    _end_line(Path(run_dir) / EXPERTS)
    with open(Path(run_dir) / EXPERTS, "a") as f:
        f.write(json.dumps({"step": step, "counts": counts}) + "\n")


def read_expert_load(run_dir: Path) -> list[dict]:
    """The lines of ``experts.jsonl`` in order (none when the model has no experts); a line
    cut short by a kill is left out."""
    path = Path(run_dir) / EXPERTS
    rows = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("counts"), list):
            rows.append(row)
    return rows


def read_events(run_dir: Path) -> list[dict]:
    """The events in order; a line cut short by a kill is left out."""
    path = Path(run_dir) / EVENTS
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def append_breakdown(run_dir: Path, rows: list[dict]) -> None:
    """Rows of :data:`BREAKDOWN_COLUMNS` (the header is written with the first)."""
    path = Path(run_dir) / BREAKDOWN
    new = not path.exists() or path.stat().st_size == 0
    _end_line(path)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, BREAKDOWN_COLUMNS)
        if new:
            writer.writeheader()
        writer.writerows(rows)


def read_breakdown(run_dir: Path) -> list[dict]:
    """Rows of ``breakdown.csv`` with numbers parsed (``step``/``rank`` as int); a row cut
    short by a kill is left out."""
    path = Path(run_dir) / BREAKDOWN
    if not path.exists():
        return []
    rows = []
    with open(path, newline="") as f:
        for raw in csv.DictReader(f):
            if None in raw or None in raw.values():  # a row cut short, or two run together
                continue
            try:
                row = {k: float(raw[k]) for k in BREAKDOWN_COLUMNS}
            except (TypeError, ValueError, KeyError):
                continue
            row["step"], row["rank"] = int(row["step"]), int(row["rank"])
            rows.append(row)
    return rows
