"""``write_report``: a run folder as one self-contained ``report.html`` (figures as data URIs,
CSS inline), rendered from ``report.html.j2``; and the ``meshtrain report`` command."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

from meshtrain.errors import ConfigError
from meshtrain.observe import run_files
from meshtrain.observe.plots import _finite
from meshtrain.observe.report import figures
from meshtrain.observe.report.collect import Run, collect, has_values

TEMPLATE = "report.html.j2"
SECTIONS = ("summary", "config", "environment", "loss", "throughput", "breakdown", "memory",
            "pipeline", "events", "traces", "missing")
COUNTED_EVENTS = {"checkpoint": "checkpoints", "restart": "restarts", "skip": "skipped steps",
                  "rollback": "rollbacks"}


def write_report(run_dir) -> Path:
    """Write ``run_dir/report.html`` (replaced at once) and return its path; a ConfigError when
    ``run_dir`` is not a run folder."""
    run = collect(run_dir)
    html = _template().render(**context(run))
    out = run.path / "report.html"
    tmp = out.with_name(f".report.html.{os.getpid()}.tmp")
    try:
        tmp.write_text(html, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {out}: {error.strerror or error}") from None
    return out


def _template():
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    return env.get_template(TEMPLATE)


def context(run: Run) -> dict:
    """What the template shows, every number already written out."""
    return {"run": run, "sections": SECTIONS, "summary": _summary(run),
            "environment": [(k, _text(v)) for k, v in run.environment.items()
                            if k != "settings"],  # (shown under config)
            "loss": figures.loss_figure(run.metrics), "throughput": _throughput(run),
            "breakdown": _breakdown(run.breakdown, _margin(run)), "memory": _memory(run.breakdown),
            "pipeline": _pipeline(run), "events": _events(run),
            "part_docs": [(p, figures.PART_COLORS[p], run_files.PART_DOCS[p])
                          for p in run_files.PARTS]}


def _text(value) -> str:
    return "none" if value is None else str(value)


def _num(value, digits: int = 4) -> str:
    number = _finite(value)
    if number is None:
        return "–"
    return f"{number:,.0f}" if abs(number) >= 1e4 else f"{number:.{digits}g}"


def _last(rows: Sequence[dict], key: str):
    return next((row[key] for row in reversed(rows) if row.get(key) is not None), None)


def _summary(run: Run) -> list[tuple[str, str]]:
    steps = [row["step"] for row in run.metrics if row.get("step") is not None]
    steps += [row["step"] for row in run.breakdown]
    max_steps = run.config.get("trainer", {}).get("max_steps")
    step = str(max(steps)) if steps else "none logged"
    if steps and max_steps:
        step += f" of {max_steps}"
    env = run.environment
    rows = [("name", run.name), ("folder", str(run.path)), ("status", run.status),
            ("steps", step),
            ("final train loss", _num(_last(run.metrics, "train/loss"))),
            ("final validation loss", _num(_last(run.metrics, "val/loss"))),
            ("layout", _text(env.get("layout") or run.config.get("trainer", {}).get("layout"))),
            ("world size", _world(env)),
            ("started", _text(env.get("started"))), ("finished", _text(env.get("finished")))]
    if run.error is not None:
        rows.insert(3, ("error", run.error))
    return rows


def _world(env: dict) -> str:
    """'4', or '4 (2 nodes x 2)' when the launcher started the job on several nodes."""
    nodes, per_node = env.get("nodes"), env.get("processes_per_node")
    if not nodes or nodes == 1 or not per_node:
        return _text(env.get("world_size"))
    return f"{_text(env.get('world_size'))} ({nodes} nodes x {per_node})"


def _throughput(run: Run) -> dict:
    env = run.environment
    unit = env.get("unit") or next(
        (u for u in ("tokens", "samples") if has_values(run.metrics, f"train/{u}_per_s")),
        "tokens")
    peak = env.get("peak_tflops")
    rows = []
    for key, label, scale in ((f"train/{unit}_per_s", f"{unit} per second", 1),
                              ("train/mfu", "MFU (%)", 100),
                              ("train/tflops", "achieved TFLOP/s per rank", 1)):
        values = [row[key] * scale for row in run.metrics if row.get(key) is not None]
        if values:
            rows.append((label, _num(values[-1]), _num(statistics.fmean(values))))
    return {"figure": figures.throughput_figure(run.metrics, unit, peak), "rows": rows,
            "unit": unit, "peak": _num(peak) if _finite(peak) else None,
            "peak_source": _text(env.get("peak_source")),
            "flops_per_item": _num(env.get("flops_per_item"))}


def _per_rank(rows: Sequence[dict]) -> dict[int, list[dict]]:
    ranks: dict[int, list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["step"]):  # stable: a resumed step's last row wins
        ranks.setdefault(row["rank"], []).append(row)
    return dict(sorted(ranks.items()))


def _margin(run: Run) -> float:
    """The run's straggler_margin (0.2 when not recorded or off)."""
    for section, key, value in run.settings:
        if key == "straggler_margin":
            try:
                return float(value)
            except ValueError:
                break
    return 0.2


def _breakdown(rows: Sequence[dict], margin: float = 0.2) -> dict | None:
    """The latest interval of each rank (table and bars), the mean over the run, and a rank
    whose own work is more than ``margin`` above the ranks' median (marked as the slowest)."""
    ranks = _per_rank(rows)
    if not ranks:
        return None
    latest = [history[-1] for history in ranks.values()]
    keys = ("step_s", *(f"{p}_s" for p in run_files.PARTS))
    mean = [{"rank": rank, **{k: statistics.fmean(row[k] for row in history) for k in keys}}
            for rank, history in ranks.items()]
    step = max(row["step"] for row in latest)
    # in synchronous training every rank's step lasts as long as the slowest's (the others
    # wait for it in comm or bubble): ranks are compared by their own work, the rest
    busy = {row["rank"]: row["step_s"] - row["comm_s"] - row["bubble_s"] for row in latest}
    slowest = max(latest, key=lambda row: busy[row["rank"]])
    median = statistics.median(busy.values())
    slow_rank = slowest["rank"] if busy[slowest["rank"]] > median * (1 + margin) else None
    if slow_rank is not None:
        above = 100 * (busy[slow_rank] / median - 1) if median > 0 else 0.0
        verdict = (f"Slowest rank at step {slowest['step']}: rank {slow_rank}, its own work "
                   f"(step minus comm and bubble, where a rank waits for the others) "
                   f"{busy[slow_rank]:.3g} s per step, {above:.0f}% above the median "
                   f"({median:.3g} s).")
    else:
        verdict = f"One rank: {slowest['step_s']:.3g} s per step at step {slowest['step']}."
        if len(latest) > 1:
            verdict = (f"All {len(latest)} ranks: {slowest['step_s']:.3g} s per step at step "
                       f"{slowest['step']}; their own work (step minus comm and bubble) within "
                       f"{margin:.0%} of the median ({min(busy.values()):.3g}-"
                       f"{max(busy.values()):.3g} s): no straggler.")
    table = [{"rank": row["rank"], "step": row["step"], "step_s": f"{row['step_s']:.4g}",
              "wall_s": _num(row.get("wall_s")), "slowest": row["rank"] == slow_rank,
              "parts": [f"{row[f'{p}_s']:.3g} s" + (
                  f" ({100 * row[f'{p}_s'] / row['step_s']:.0f}%)" if row["step_s"] else "")
                  for p in run_files.PARTS]}
             for row in latest]
    return {"figure": figures.breakdown_figure(latest, mean, step, slow_rank),
            "table": table, "verdict": verdict, "parts": run_files.PARTS,
            "slowest": slow_rank}


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def _memory(rows: Sequence[dict]) -> dict | None:
    ranks = _per_rank(rows)
    if not ranks:
        return None
    peaks = [max(row["mem_peak_bytes"] for row in history) for history in ranks.values()]
    limits = [history[-1]["mem_limit_bytes"] for history in ranks.values()]
    table = [(rank, _size(peak), _size(limit),
              f"{100 * peak / limit:.0f}%" if limit > 0 else "–")
             for rank, peak, limit in zip(ranks, peaks, limits)]
    return {"figure": figures.memory_figure(list(ranks), peaks, limits), "table": table}


def _pipeline(run: Run) -> dict:
    pipeline = run.pipeline
    if pipeline is None:
        why = ("this run's layout has no pipeline stages (pp)" if not run.has_pipeline_layout
               else f"no readable {run_files.PIPELINE} in the run folder")
        return {"figure": None, "rows": [], "why": why}
    rows = [(label, _text(pipeline.get(key))) for key, label in (
        ("schedule", "schedule"), ("pp", "pipeline ranks (p)"),
        ("microbatches", "micro-batches (m)"), ("stages_per_rank", "stages per rank (v)"),
        ("step", "recorded step"), ("measured_bubble", "measured bubble"),
        ("free_comm_bubble", "bubble with free communication (the stages' own times)"),
        ("formula_bubble", "formula bubble (p-1)/(v*m+p-1)"))]
    figure = figures.pipeline_figure(pipeline)
    return {"figure": figure, "rows": rows, "title": figures.pipeline_title(pipeline),
            "why": None if figure else f"{run_files.PIPELINE} holds no F/B events"}


def _href(run: Run, path: str | None) -> str | None:
    """A link relative to the page (beside it in the run folder), for a path that exists
    there; None otherwise."""
    if not path or Path(path).is_absolute() or not (run.path / path).exists():
        return None
    return quote(Path(path).as_posix())


def _events(run: Run) -> dict:
    counts = {label: sum(e.get("kind") == kind for e in run.events)
              for kind, label in COUNTED_EVENTS.items()}
    for kind in run_files.EVENT_KINDS:
        if kind not in COUNTED_EVENTS and (n := sum(e.get("kind") == kind for e in run.events)):
            counts[kind] = n
    rows = [{"time": _text(e.get("time")), "step": _text(e.get("step")),
             "kind": _text(e.get("kind")), "message": _text(e.get("message")),
             "path": e.get("path"), "href": _href(run, e.get("path"))} for e in run.events]
    return {"counts": counts, "rows": rows,
            "traces": [(path, quote(path)) for path in run.traces],
            "checkpoints": [(path, quote(path)) for path in run.checkpoints]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="meshtrain report",
        description="Write RUN_DIR/report.html: one self-contained page of a run (its loss, "
                    "throughput and MFU, step-time breakdown and memory per rank, pipeline "
                    "timeline, events, traces, and what the run did not record).")
    parser.add_argument("run_dir", help="the run's folder, root_dir/<name>/<timestamp> "
                                        "(e.g. runs/char_gpt/20261126-120036)")
    args = parser.parse_args(argv)
    print(write_report(args.run_dir))
    return 0
