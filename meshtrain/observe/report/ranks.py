"""The report's per-rank sections, from breakdown.csv: where each rank's step time goes (and
whether one rank is a straggler), and each rank's peak memory against what it may use."""

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


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "–"


def _nodes(run: Run, ranks: list[int]) -> list[list[int]]:
    """The ranks by node: launchers number a node's ranks in a row (node n holds ranks
    n*per_node to (n+1)*per_node - 1)."""
    env = run.environment
    per_node = env.get("processes_per_node") or env.get("world_size") or len(ranks)
    try:
        per_node = max(1, int(per_node))
    except (TypeError, ValueError):
        per_node = len(ranks)
    nodes: dict[int, list[int]] = {}
    for rank in ranks:
        nodes.setdefault(rank // per_node, []).append(rank)
    return list(nodes.values())


def memory(run: Run) -> dict | None:
    """Each rank's peak against what it may use: its own GPU's memory, or on CPU the node's
    memory (a cgroup limit when one is set), which the node's ranks share: there the node's
    ranks' peaks are also summed against it (at most what they held at once)."""
    ranks = per_rank(run.breakdown)
    if not ranks:
        return None
    env = run.environment
    peaks = {rank: max(row["mem_peak_bytes"] for row in history)
             for rank, history in ranks.items()}
    limits = {rank: history[-1]["mem_limit_bytes"] for rank, history in ranks.items()}
    scope = env.get("memory_limit_scope") or (
        "device" if env.get("device_type") == "cuda" else "node")
    source = env.get("memory_limit_source") or (
        "the GPU's memory" if scope == "device" else "the machine's physical memory")
    table = [(rank, size(peaks[rank]), size(limits[rank]), _share(peaks[rank], limits[rank]))
             for rank in ranks]
    if scope == "device":
        return {"scope": scope, "source": source, "limit_label": "its GPU's memory",
                "table": table, "nodes": [],
                "figure": figures.memory_figure(
                    [(f"rank {r}", [(r, peaks[r])], limits[r]) for r in ranks],
                    "peak memory per rank against its GPU's memory")}
    nodes = []
    for index, members in enumerate(_nodes(run, list(ranks))):
        limit = max(limits[rank] for rank in members)
        total = sum(peaks[rank] for rank in members)
        nodes.append({"label": f"node {index}" if len(ranks) > len(members) else "the node",
                      "ranks": members, "limit": limit, "total": total,
                      "text": (f"ranks {members[0]}-{members[-1]}" if len(members) > 1
                               else f"rank {members[0]}"),
                      "sum": size(total), "size": size(limit), "share": _share(total, limit)})
    return {"scope": scope, "source": source, "table": table, "nodes": nodes,
            "limit_label": "the node's memory, shared by its ranks",
            "figure": figures.memory_figure(
                [(node["label"], [(r, peaks[r]) for r in node["ranks"]], node["limit"])
                 for node in nodes],
                "peak resident memory of each node's ranks (stacked) against the node's "
                "memory")}
