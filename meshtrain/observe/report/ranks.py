"""The report's per-rank sections, from breakdown.csv: where each rank's step time goes (and
whether one rank is a straggler), and each rank's peak memory."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from meshtrain.observe import run_files, stragglers
from meshtrain.observe.report import figures
from meshtrain.observe.report.collect import Run, setting


def per_rank(rows: Sequence[dict]) -> dict[int, list[dict]]:
    ranks: dict[int, list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["step"]):  # stable: a resumed step's last row wins
        ranks.setdefault(row["rank"], []).append(row)
    return dict(sorted(ranks.items()))


def own_work_by_interval(rows: Sequence[dict]) -> list[dict[int, float]]:
    """Each logging interval's own work by rank, oldest first (a resumed step's last rows
    win)."""
    intervals: dict[int, dict[int, float]] = {}
    for row in rows:
        intervals.setdefault(row["step"], {})[row["rank"]] = stragglers.own_work(row)
    return [intervals[step] for step in sorted(intervals)]


def margin(run: Run) -> float:
    """The run's straggler_margin (0.2 when not recorded or off)."""
    value = setting(run, "straggler_margin")
    try:
        return float(value) if value is not None else 0.2
    except (TypeError, ValueError):
        return 0.2


def _verdict(latest: list[dict], judged: stragglers.Judgement, margin: float) -> str:
    step = max(row["step"] for row in latest)
    step_s = max(row["step_s"] for row in latest)
    if len(latest) == 1:
        return f"One rank: {step_s:.3g} s per step at step {step}."
    rank, own, others = judged.rank, judged.own, judged.others
    above = 100 * (own / others - 1) if others > 0 else 0.0
    rule = (f"more than {judged.threshold:.3g} s: the largest of {margin:.0%} of that median, "
            f"the other ranks' spread and {stragglers.NOISE_TIMES}x its jitter "
            f"({judged.jitter:.3g} s, the median change of its lead over them from one "
            "interval to the next)")
    if judged.straggler is not None:
        return (f"Straggler at step {step}: rank {rank}, its own work (step minus comm and "
                f"bubble, where a rank waits for the others) {own:.3g} s per step, {above:.0f}% "
                f"above the other ranks' median ({others:.3g} s), and above it by {rule} in "
                f"each of the last {judged.slow_intervals} logging intervals.")
    busy = [stragglers.own_work(row) for row in latest]
    head = (f"All {len(latest)} ranks: {step_s:.3g} s per step at step {step}; their own work "
            f"(step minus comm and bubble) {min(busy):.3g}-{max(busy):.3g} s")
    if judged.intervals < stragglers.MIN_INTERVALS:
        return (f"{head}: {judged.intervals} logging interval(s), too few to tell a straggler "
                f"from noise (a rank is named after {stragglers.PATIENCE} in a row, with "
                f"{stragglers.MIN_INTERVALS} recorded).")
    if judged.slow_intervals:
        return (f"{head}. Rank {rank}'s is {above:.0f}% above the other ranks' median "
                f"({others:.3g} s), by {rule}, but only in the last {judged.slow_intervals} "
                f"logging interval(s), not {stragglers.PATIENCE} in a row: no straggler (yet).")
    return (f"{head}: no straggler (none above the other ranks' median by more than a "
            f"straggler's lead, {stragglers.PATIENCE} logging intervals in a row; rank "
            f"{rank}'s would be {rule}).")


def breakdown(rows: Sequence[dict], margin: float = 0.2) -> dict | None:
    """The latest interval of each rank (table and bars), the mean over the run, and a
    straggler (:func:`meshtrain.observe.stragglers.judge`), marked."""
    ranks = per_rank(rows)
    if not ranks:
        return None
    latest = [history[-1] for history in ranks.values()]
    keys = ("step_s", *(f"{p}_s" for p in run_files.PARTS))
    mean = [{"rank": rank, **{k: statistics.fmean(row[k] for row in history) for k in keys}}
            for rank, history in ranks.items()]
    step = max(row["step"] for row in latest)
    judged = stragglers.judge(own_work_by_interval(rows), margin)
    table = [{"rank": row["rank"], "step": row["step"], "step_s": f"{row['step_s']:.4g}",
              "wall_s": f"{row['wall_s']:.4g}",
              "straggler": row["rank"] == judged.straggler,
              "parts": [f"{row[f'{p}_s']:.3g} s" + (
                  f" ({100 * row[f'{p}_s'] / row['step_s']:.0f}%)" if row["step_s"] else "")
                  for p in run_files.PARTS]}
             for row in latest]
    return {"figure": figures.breakdown_figure(latest, mean, step, judged.straggler),
            "table": table, "verdict": _verdict(latest, judged, margin),
            "parts": run_files.PARTS, "straggler": judged.straggler}


def size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def memory(run: Run) -> dict | None:
    ranks = per_rank(run.breakdown)
    if not ranks:
        return None
    peaks = [max(row["mem_peak_bytes"] for row in history) for history in ranks.values()]
    limits = [history[-1]["mem_limit_bytes"] for history in ranks.values()]
    table = [(rank, size(peak), size(limit),
              f"{100 * peak / limit:.0f}%" if limit > 0 else "–")
             for rank, peak, limit in zip(ranks, peaks, limits)]
    return {"figure": figures.memory_figure(list(ranks), peaks, limits), "table": table}
