"""Is one rank a straggler? The judgement the live warning (monitor.py) and the report
(report/ranks.py) share, made on each rank's own work per logging interval.

In synchronous training every rank's step lasts as long as the slowest rank's: the others spend
the difference waiting in ``comm`` (or ``bubble``), so ranks are compared by their own work,
their step minus those waits. A rank's *lead* in an interval is its own work minus the other
ranks' median. On a busy machine every rank's own work jitters from interval to interval, and
one interval's blip on one rank is noise, not a straggler. A rank is a straggler when its lead
is, in each of the last :data:`PATIENCE` logging intervals, more than all of

* ``margin`` times the other ranks' median (the run's ``straggler_margin``),
* the spread of the other ranks: how far apart ranks doing the same work land (the slowest
  minus the fastest of them in an interval, the median over the last :data:`WINDOW`
  intervals),
* :data:`NOISE_TIMES` times its jitter: the median change of its lead from one interval to the
  next over the last :data:`WINDOW` intervals. A slowdown of the whole machine moves every
  rank alike and leaves the lead as it was; a rank that turned slow changes its lead once, so
  the median is the noise, not the slowdown,
* :data:`MIN_S` (the timer's resolution on tiny steps).

The jitter needs :data:`PATIENCE` changes to be measured: no rank is named before
:data:`MIN_INTERVALS` intervals.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PATIENCE = 3  # logging intervals in a row
MIN_INTERVALS = PATIENCE + 1
WINDOW = 16  # the latest intervals the jitter and the spread are measured over
NOISE_TIMES = 3
MIN_S = 0.002
WAITS = ("comm", "bubble")  # parts where a rank waits for the others


def own_work(row: Mapping) -> float:
    """A breakdown row's step minus its waits for the other ranks, in seconds."""
    return row["step_s"] - sum(row[f"{w}_s"] for w in WAITS)


@dataclass
class Judgement:
    """The latest interval judged. ``rank`` is the straggler when there is one, else the rank
    with the most own work in the latest interval (None with fewer than two ranks); ``own`` its
    own work there, ``others`` the other ranks' median, ``threshold`` the lead a straggler
    needs there, ``jitter`` the rank's, ``slow_intervals`` how many intervals in a row (ending
    with the latest) its lead was above the threshold; ``straggler``: ``rank`` when that is at
    least :data:`PATIENCE` (and :data:`MIN_INTERVALS` were recorded), else None."""

    intervals: int
    rank: int | None = None
    own: float = 0.0
    others: float = 0.0
    threshold: float = 0.0
    jitter: float = 0.0
    slow_intervals: int = 0
    straggler: int | None = None


def _leads(history: list[dict[int, float]], rank: int) -> list[tuple[float, float] | None]:
    """(``rank``'s lead, the other ranks' median) per interval; None where it or the others
    are absent."""
    leads = []
    for interval in history:
        others = [v for r, v in interval.items() if r != rank]
        if rank not in interval or not others:
            leads.append(None)
            continue
        median = statistics.median(others)
        leads.append((interval[rank] - median, median))
    return leads


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _judge_rank(history: list[dict[int, float]], rank: int,
                margin: float) -> tuple[int, float, float]:
    """(intervals in a row ``rank`` led by more than its threshold, that threshold in the
    latest interval, its jitter)."""
    leads = _leads(history, rank)
    jitter = _median([abs(b[0] - a[0]) for a, b in zip(leads, leads[1:]) if a and b])
    spread = _median([max(others) - min(others) for interval in history
                      if (others := [v for r, v in interval.items() if r != rank])])
    floor = max(spread, NOISE_TIMES * jitter, MIN_S)
    slow = 0
    for lead in reversed(leads):
        if lead is None or lead[0] <= max(floor, margin * lead[1]):
            break
        slow += 1
    latest = leads[-1]
    return slow, max(floor, margin * latest[1]) if latest else floor, jitter


def judge(history: Sequence[Mapping[int, float]], margin: float) -> Judgement:
    """``history``: each logging interval's own work by rank, oldest first (only the last
    :data:`WINDOW` are read). See the module's docstring."""
    history = [dict(interval) for interval in history[-WINDOW:] if interval]
    if not history or len(history[-1]) < 2:
        return Judgement(intervals=len(history))
    latest = history[-1]
    judged = {rank: _judge_rank(history, rank, margin) for rank in latest}
    stragglers = [rank for rank, (slow, _, _) in judged.items()
                  if slow >= PATIENCE and len(history) >= MIN_INTERVALS]
    rank = max(stragglers or latest, key=latest.get)
    slow, threshold, jitter = judged[rank]
    return Judgement(intervals=len(history), rank=rank, own=latest[rank],
                     others=statistics.median(v for r, v in latest.items() if r != rank),
                     threshold=threshold, jitter=jitter, slow_intervals=slow,
                     straggler=rank if stragglers else None)
