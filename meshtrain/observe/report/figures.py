"""The report's figures, each a PNG as a ``data:`` URI, ready for an ``<img src>``.

Drawn like :mod:`meshtrain.observe.plots` (a ``Figure`` on an Agg canvas; pyplot's global
state is never touched). A function given nothing to draw returns None: the page then says
what is not recorded instead of showing an empty chart.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence

from meshtrain.observe.plots import _finite, _new_figure, _series
from meshtrain.observe.report.experts import layer_loads, window_counts, worst_layer
from meshtrain.observe.run_files import PARTS

# one colour per part, the same in every figure and run
PART_COLORS = {"data": "#8172b3", "compute": "#4c72b0", "comm": "#dd8452", "bubble": "#c44e52",
               "optimizer": "#55a868", "checkpoint": "#937860", "other": "#8c8c8c"}
# the pipeline actions (meshtrain.parallel.pipeline's TimelineEvent kinds)
ACTION_COLORS = {"F": "#4c72b0", "L": "#8172b3", "B": "#55a868", "I": "#8fd19e", "W": "#dd8452"}
SLOWEST_COLOR = "#c0392b"
assert set(PART_COLORS) == set(PARTS)


def data_uri(fig) -> str:
    """The figure as ``data:image/png;base64,...``."""
    buffer = io.BytesIO()
    # zlib level 1: a third less time per figure than the default 6 (0.09-0.15 s here), for
    # somewhat larger files; the report is written at the end of every fit
    fig.savefig(buffer, format="png", pil_kwargs={"compress_level": 1})
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def loss_figure(rows: Sequence[Mapping]) -> str | None:
    """Train and validation loss over steps."""
    train, val = _series(rows, "train/loss"), _series(rows, "val/loss")
    if not (train[0] or val[0]):
        return None
    fig = _new_figure((8.0, 4.0))
    ax = fig.add_subplot()
    if train[0]:
        ax.plot(*train, label="train loss", linewidth=1.2)
    if val[0]:
        ax.plot(*val, label="validation loss", marker="o", markersize=4, linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return data_uri(fig)


def throughput_figure(rows: Sequence[Mapping], unit: str, peak_tflops: float | None
                      ) -> str | None:
    """Throughput (``train/<unit>_per_s``) over steps, and MFU below it when logged."""
    speed, mfu = _series(rows, f"train/{unit}_per_s"), _series(rows, "train/mfu")
    if not (speed[0] or mfu[0]):
        return None
    panels = [p for p in (speed, mfu) if p[0]]
    fig = _new_figure((8.0, 2.6 * len(panels) + 0.6))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    if speed[0]:
        ax.plot(*speed, color="#4c72b0", linewidth=1.2)
        ax.set_ylabel(f"{unit}/s")
        ax.set_title(f"throughput ({unit} per second, all ranks)")
        ax = axes[-1]
    if mfu[0]:
        ax.plot(mfu[0], [100 * y for y in mfu[1]], color="#dd8452", linewidth=1.2)
        ax.set_ylabel("MFU (%)")
        ax.set_ylim(0, None)
        against = f" of {peak_tflops:g} TFLOP/s per rank" if _finite(peak_tflops) else ""
        ax.set_title(f"model FLOPs utilization{against}")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    return data_uri(fig)


def _stacked_bars(ax, rows: Sequence[Mapping], straggler: int | None, title: str) -> None:
    """One horizontal bar per rank (rank 0 on top), its parts stacked in PARTS order."""
    ranks = [row["rank"] for row in rows]
    ys = range(len(rows))[::-1]
    left = [0.0] * len(rows)
    for part in PARTS:
        widths = [row[f"{part}_s"] for row in rows]
        ax.barh(ys, widths, left=left, color=PART_COLORS[part], label=part, height=0.7)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(ys, [f"rank {r}" + (" (straggler)" if r == straggler else "") for r in ranks])
    for y, row in zip(ys, rows):
        is_straggler = row["rank"] == straggler
        ax.text(row["step_s"], y, f" {row['step_s']:.3g} s", va="center", fontsize=8,
                color=SLOWEST_COLOR if is_straggler else "black",
                fontweight="bold" if is_straggler else "normal")
    for label in ax.get_yticklabels():
        if label.get_text().endswith("(straggler)"):
            label.set_color(SLOWEST_COLOR)
            label.set_fontweight("bold")
    ax.set_xlim(0, 1.15 * max((row["step_s"] for row in rows), default=1.0) or 1.0)
    ax.set_xlabel("seconds per step")
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)


def breakdown_figure(latest: Sequence[Mapping], mean: Sequence[Mapping], step: int,
                     straggler: int | None) -> str | None:
    """Step-time breakdown per rank: the latest interval beside the mean over the run.
    ``latest``/``mean``: one breakdown row per rank, in rank order."""
    if not latest:
        return None
    fig = _new_figure((10.0, 1.6 + 0.35 * len(latest)))
    fig.set_layout_engine("constrained")  # room for the legend outside the axes
    left, right = fig.subplots(1, 2, sharey=True)
    _stacked_bars(left, latest, straggler, f"latest interval (step {step})")
    _stacked_bars(right, mean, None, "mean over the run")
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(PARTS), fontsize=8)
    return data_uri(fig)


def expert_load_figure(rows: Sequence[Mapping]) -> dict | None:
    """An MoE model's expert load: per layer (rows) and expert (columns) the tokens it took
    over the mean expert's, summed over the logged steps (1 balanced; E: every token to one
    expert), beside the same for the last logged step; per layer that over the run and over
    the last logged steps, and the most imbalanced layer of those (report/experts.py). None
    without experts.jsonl rows."""
    import numpy as np

    if not rows:
        return None
    total = np.sum([np.asarray(r["counts"], dtype=float) for r in rows], axis=0)
    last = np.asarray(rows[-1]["counts"], dtype=float)

    def share(counts):
        return counts / np.maximum(counts.mean(axis=1, keepdims=True), 1e-12)

    layers, experts = total.shape
    fig = _new_figure((min(14.0, 3.0 + 0.9 * experts), 1.8 + 0.45 * layers))
    fig.set_layout_engine("constrained")
    axes = fig.subplots(1, 2, sharey=True)
    top = max(2.0, float(share(total).max()), float(share(last).max()))
    for ax, counts, title in ((axes[0], total, f"steps {rows[0]['step']}-{rows[-1]['step']}"),
                              (axes[1], last, f"step {rows[-1]['step']}")):
        image = ax.imshow(share(counts), vmin=0, vmax=top, cmap="viridis", aspect="auto")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("expert")
        ax.set_xticks(range(experts))
        ax.set_yticks(range(layers))
    axes[0].set_ylabel("layer")
    fig.colorbar(image, ax=axes, label="tokens / mean expert's", shrink=0.9)
    run_worst = share(total).max(axis=1)
    recent = layer_loads(window_counts(rows) or last.tolist())
    named = worst_layer(rows)
    return {"figure": data_uri(fig), "steps": len(rows),
            "window": named.steps if named else 1,
            "worst_layer": named.sentence() if named else None,
            "worst_index": named.layer if named else None,
            "worst": [(i, f"{w:.2f}", f"{recent[i][0]:.2f}", f"{100 * recent[i][1]:.0f}%")
                      for i, w in enumerate(run_worst)]}


def memory_figure(groups: Sequence[tuple[str, Sequence[tuple[int, float]], float]],
                  title: str) -> str | None:
    """Peak memory against a limit, one bar per group (label, [(rank, peak)], limit): a rank
    with its own GPU, or a node whose ranks' peaks are stacked under the node's memory (a line
    over its bar)."""
    if not groups:
        return None
    totals = [sum(peak for _, peak in members) for _, members, _ in groups]
    limits = [limit for _, _, limit in groups]
    gib = max((*totals, *limits)) >= 2**30
    scale, unit = (2**30, "GiB") if gib else (2**20, "MiB")
    xs = range(len(groups))
    fig = _new_figure((8.0, 3.8))
    fig.set_layout_engine("constrained")  # room for the legend outside the axes
    ax = fig.add_subplot()
    stacked = any(len(members) > 1 for _, members, _ in groups)
    for x, (_, members, _) in zip(xs, groups):
        bottom = 0.0
        for i, (rank, peak) in enumerate(members):
            ax.bar(x, peak / scale, bottom=bottom, width=0.6, edgecolor="white",
                   color="#4c72b0" if i % 2 == 0 else "#8fb3de",
                   label=("peak of a rank" if stacked else "peak") if x == i == 0 else None)
            if stacked:
                ax.text(x, bottom + peak / scale / 2, f"rank {rank}", ha="center",
                        va="center", fontsize=7, color="white")
            bottom += peak / scale
    ax.hlines([lim / scale for lim in limits], [x - 0.4 for x in xs], [x + 0.4 for x in xs],
              color=SLOWEST_COLOR, linewidth=2, label="limit")
    for x, total, limit in zip(xs, totals, limits):
        share = f"{100 * total / limit:.0f}%" if limit > 0 else ""
        ax.text(x, total / scale, share, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [label for label, _, _ in groups],
                  rotation=90 if len(groups) > 16 else 0)
    ax.set_ylabel(unit)
    ax.set_ylim(0, 1.1 * max((*totals, *limits)) / scale or 1.0)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=2, fontsize=8)
    return data_uri(fig)


def _actions(pipeline: Mapping) -> list[tuple[int, int, int, str, float, float]]:
    """pipeline.json's events as (rank, stage, microbatch, kind, start_s, end_s); malformed
    entries are left out."""
    actions = []
    for event in pipeline.get("events") or ():
        try:
            rank, stage, microbatch, kind, start, end = event
            actions.append((int(rank), int(stage), int(microbatch), str(kind), float(start),
                            float(end)))
        except (TypeError, ValueError):
            continue
    return actions


def pipeline_figure(pipeline: Mapping) -> str | None:
    """The recorded step's schedule (:func:`draw_actions`), titled with its bubble."""
    actions = _actions(pipeline)
    if not actions:
        return None
    fig = _new_figure((10.0, 1.4 + 0.6 * len({a[0] for a in actions})))
    ax = fig.add_subplot()
    draw_actions(ax, actions)
    ax.set_title(pipeline_title(pipeline))
    return data_uri(fig)


def draw_actions(ax, actions: Sequence[tuple]) -> None:
    """A pipeline step on ``ax``: one row per rank, one box per F/L/B/I/W action
    ``(rank, stage, microbatch, kind, start, end)`` labelled with its micro-batch (and stage,
    when a rank holds several)."""
    from matplotlib.patches import Patch

    ranks = sorted({a[0] for a in actions})
    several = len({a[1] for a in actions}) > len(ranks)
    t0 = min(a[4] for a in actions)
    span_ms = (max(a[5] for a in actions) - t0) * 1e3 or 1.0
    for rank, stage, microbatch, kind, start, end in actions:
        row = len(ranks) - 1 - ranks.index(rank)
        box = (start - t0) * 1e3, (end - start) * 1e3
        ax.broken_barh([box], (row - 0.4, 0.8), facecolors=ACTION_COLORS.get(kind, "#cccccc"),
                       edgecolor="black", linewidth=0.5)
        if box[1] > 0.015 * span_ms:  # label the boxes wide enough to hold one
            label = f"{microbatch}" + (f"/s{stage}" if several else "")
            ax.text(box[0] + box[1] / 2, row, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in reversed(ranks)])
    ax.set_xlabel("time (ms)")
    order = list(ACTION_COLORS)
    kinds = sorted({a[3] for a in actions},
                   key=lambda k: (order.index(k) if k in order else len(order), k))
    ax.legend(handles=[Patch(color=ACTION_COLORS.get(k, "#cccccc"), label=k) for k in kinds],
              loc="upper right", fontsize=7)


def pipeline_title(pipeline: Mapping) -> str:
    """``1f1b, p=2, m=8 (step 5): measured bubble 0.14, formula 0.11``."""
    measured, formula = _finite(pipeline.get("measured_bubble")), _finite(
        pipeline.get("formula_bubble"))
    bubbles = ", ".join(f"{name} bubble {value:.2f}" for name, value in
                        (("measured", measured), ("formula", formula)) if value is not None)
    head = (f"{pipeline.get('schedule', '?')}, p={pipeline.get('pp', '?')}, "
            f"m={pipeline.get('microbatches', '?')} (step {pipeline.get('step', '?')})")
    return f"{head}: {bubbles}" if bubbles else head
