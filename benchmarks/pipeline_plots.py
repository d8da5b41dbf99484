"""pipeline.py's charts: each schedule's timeline at one m, and the bubble against m."""

from __future__ import annotations

from pathlib import Path


def plot_timelines(summary: dict, out_dir: Path, schedules, plot_m: int, pp: int, case_name,
                   events) -> list[Path]:
    """The recorded step whose bubble is the median, for each schedule at ``plot_m``."""
    from meshtrain.parallel.pipeline import plot_timeline

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for schedule, v in schedules:
        row = summary.get(case_name(schedule, plot_m))
        if row is None:
            continue
        path = out_dir / f"pipeline_timeline_{schedule}.png"
        plot_timeline(events(row["timeline"]), path,
                      title=f"{schedule}, p={pp}, m={plot_m}, v={v}: measured bubble "
                            f"{row['bubble']:.2f} (formula {row['formula']:.2f}), "
                            f"step {row['span_ms']:.0f} ms")
        paths.append(path)
    return paths


def plot_bubble(summary: dict, out_dir: Path, title: str, schedules) -> Path:
    """Measured bubble (solid) and formula (dashed) against the number of micro-batches."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(6.5, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = {"gpipe": "#4c72b0", "1f1b": "#dd8452", "interleaved-1f1b": "#55a868"}
    for schedule, v in schedules:
        rows = [r for r in summary.values() if r.get("schedule") == schedule]
        ms = [r["m"] for r in rows]
        ax.plot(ms, [r["formula"] for r in rows], "--", color=colors[schedule], alpha=0.7)
        ax.plot(ms, [r["bubble"] for r in rows], "o-", color=colors[schedule],
                label=f"{schedule} (v={v})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["m"] for r in summary.values() if "m" in r}))
    ax.get_xaxis().set_major_formatter("{x:.0f}")
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble fraction")
    ax.set_ylim(0, None)
    ax.set_title("Pipeline bubble, p=2: measured (solid) vs formula (dashed)\n" + title,
                 fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "pipeline_bubble.png"
    fig.savefig(path)
    return path
