"""What a pipeline step did: its recorded actions, the bubble they leave, the formula's, and
the drawing of the timeline.
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
