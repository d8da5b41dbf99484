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
from meshtrain.observe.report import figures, ranks
from meshtrain.observe.report.collect import Run, collect, has_values

TEMPLATE = "report.html.j2"
SECTIONS = ("summary", "config", "environment", "loss", "throughput", "breakdown", "memory",
            "experts", "pipeline", "events", "traces", "missing")
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
                            if k not in ("settings", "ending")],  # (under config, summary)
            "ending": _ending(run),
            "loss": figures.loss_figure(run.metrics), "throughput": _throughput(run),
            "breakdown": ranks.breakdown(run.breakdown, ranks.margin(run)),
            "memory": ranks.memory(run),
            "pipeline": _pipeline(run), "events": _events(run),
            "experts": figures.expert_load_figure(run.experts),
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
            *_final_metrics(run.metrics),
            ("layout", _text(env.get("layout") or run.config.get("trainer", {}).get("layout"))),
            ("world size", _world(env)),
            ("started", _text(env.get("started"))), ("finished", _text(env.get("finished")))]
    if run.error is not None:
        rows.insert(3, ("error", run.error))
    return rows


def _ending(run: Run) -> dict | None:
    """Who recorded the ending, and the first failing rank's traceback (observe/ending.py)."""
    ending = run.environment.get("ending")
    if not isinstance(ending, dict) or ending.get("status") in (None, "finished"):
        return None
    by = ", ".join(str(x) for x in (ending.get("recorded_by"), ending.get("time")) if x)
    return {"recorded_by": by or None, "signal": ending.get("signal"),
            "traceback": ending.get("traceback"), "rank": ending.get("rank")}


def _final_metrics(rows: Sequence[dict]) -> list[tuple[str, str]]:
    """("final <name>", "<value> (step <n>)") for every other metric the run logged (the
    user's own, ``self.log``/``trainer.log``, included), in the order first logged; the
    throughput's are in their own section."""
    names = dict.fromkeys(key for row in rows for key in row)
    rows_out = []
    for name in names:
        if name in ("step", "train/loss", "val/loss") or name in run_files.NOT_SUMMARISED:
            continue
        last = next((row for row in reversed(rows) if row.get(name) is not None), None)
        if last is not None:
            rows_out.append((f"final {name}", f"{_num(last[name])} (step {last.get('step')})"))
    return rows_out


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
             "path": e.get("path"), "href": _href(run, e.get("path")),
             "removed": e.get("removed")} for e in run.events]
    removed = {e["path"]: e["removed"] for e in run.events if e.get("removed")}
    return {"counts": counts, "rows": rows, "removed": sorted(removed.items()),
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
