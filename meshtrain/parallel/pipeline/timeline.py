"""What a pipeline step did: its recorded actions, the bubble they leave, the formula's, the
same step replayed with free communication (what the schedule and the stages' own times leave),
and the drawing of the timeline.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TimelineEvent:
    """One compute action (F forward, L the loss, B backward, I / W its input- and weight-grad
    halves); times are seconds from a barrier taken at the start of the step."""
    rank: int
    stage: int
    microbatch: int
    kind: str
    start: float
    end: float


def ideal_bubble_fraction(pp_degree: int, num_microbatches: int, stages_per_rank: int = 1):
    """Idle share of a step with equal stage times: (p-1)/(m+p-1), or (p-1)/(v*m+p-1) with v
    stages per rank (interleaving divides the bubble by v)."""
    p, m, v = pp_degree, num_microbatches, stages_per_rank
    return (p - 1) / (v * m + p - 1)


def bubble_fraction(events: list[TimelineEvent]) -> float:
    """Measured idle time / step time for each rank (a device), averaged over the ranks; the
    step spans the first start to the last end over all ranks."""
    span = max(e.end for e in events) - min(e.start for e in events)
    ranks = sorted({e.rank for e in events})
    busy = [sum(e.end - e.start for e in events if e.rank == r) for r in ranks]
    return sum(1 - b / span for b in busy) / len(ranks)


def _inputs(event: TimelineEvent, kinds: set, last_stage: int) -> list[tuple[int, int, str]]:
    """The (stage, micro-batch, kind) actions whose results ``event`` starts from."""
    s, mb, kind = event.stage, event.microbatch, event.kind
    if kind == "F":
        return [(s - 1, mb, "F")] if s > 0 else []
    if kind == "L":
        return [(s, mb, "F")]
    if kind == "W":  # the weight half of a split backward: after its input half
        return [(s, mb, "I")]
    # B or I: the gradient from the next stage (the loss on the last), and the stage's forward
    if s == last_stage:
        return [(s, mb, "L" if (s, mb, "L") in kinds else "F")]
    after = (s + 1, mb, "B") if (s + 1, mb, "B") in kinds else (s + 1, mb, "I")
    return [after, (s, mb, "F")]


def replay(events: list[TimelineEvent], handoff_s: float = 0.0,
           host_s: float = 0.0) -> list[TimelineEvent]:
    """The recorded step run again on paper: every rank runs its actions in their recorded
    order and with their recorded durations, each as soon as its rank is free and its inputs are
    done (F after the previous stage's F, L after F, B after the next stage's B or the loss, W
    after I); an input made on another rank arrives ``handoff_s`` later, and every action starts
    ``host_s`` after its rank is ready. With both 0, the bubble of the result is what the
    schedule leaves with these stage times and free communication (the formula's, when the
    stages take equal times), never more than the recorded one: the measured bubble's excess
    over it is the sends and the host work between actions."""
    last_stage = max(e.stage for e in events)
    kinds = {(e.stage, e.microbatch, e.kind) for e in events}
    rank_of = {(e.stage, e.microbatch, e.kind): e.rank for e in events}
    queues = {r: sorted((e for e in events if e.rank == r), key=lambda e: e.start)
              for r in {e.rank for e in events}}
    done: dict[tuple[int, int, str], float] = {}
    first = min(e.start for e in events)  # the replay starts where the step did
    free = {r: first for r in queues}
    out: list[TimelineEvent] = []
    position = {r: 0 for r in queues}
    progress = True
    while progress:
        progress = False
        for r, queue in queues.items():
            while position[r] < len(queue):
                e = queue[position[r]]
                needs = [k for k in _inputs(e, kinds, last_stage) if k in kinds]
                if any(k not in done for k in needs):
                    break  # waits for another rank's action
                ready = max([free[r]] + [done[k] + (handoff_s if rank_of[k] != r else 0.0)
                                         for k in needs])
                start = ready + host_s
                end = start + (e.end - e.start)
                done[(e.stage, e.microbatch, e.kind)], free[r] = end, end
                out.append(TimelineEvent(r, e.stage, e.microbatch, e.kind, start, end))
                position[r] += 1
                progress = True
    stuck = [queues[r][position[r]] for r in queues if position[r] < len(queues[r])]
    if stuck:
        raise ValueError(f"the recorded actions cannot run in their order: {stuck[0]} waits on "
                         "an action that comes after it")
    return sorted(out, key=lambda e: e.start)


def plot_timeline(events: list[TimelineEvent], out_png, title: str | None = None):
    """The pipeline diagram (the report's own drawing) written to ``out_png``; returns the
    Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from meshtrain.observe.report.figures import draw_actions

    fig = Figure(figsize=(10, 1 + 0.6 * len({e.rank for e in events})))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    draw_actions(ax, [(e.rank, e.stage, e.microbatch, e.kind, e.start, e.end) for e in events])
    ax.set_title(title or f"measured bubble {bubble_fraction(events):.2f}")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    return fig
