"""The most imbalanced expert layer of a run's last logged steps, from ``experts.jsonl``
(:func:`meshtrain.observe.run_files.read_expert_load`'s rows: one step's tokens per expert,
[layer][expert], at each logging interval): what the report and fit's closing summary name.

A layer's load over a window is its counts summed over the window's rows; its imbalance is
the busiest expert's share over the mean expert's (1 balanced; E: one expert takes every
token), and ``top2`` the fraction of its picks that go to its two busiest experts (2/E
balanced; 1 when the others get none). A run-summed table hides a layer that collapsed late
(its early, balanced steps dilute it): the window is the last :data:`WINDOW` logged steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

WINDOW = 5  # logged steps


@dataclass
class WorstLayer:
    """The most imbalanced layer over steps ``first``..``last`` (``steps`` logged rows)."""

    layer: int
    imbalance: float
    top2: float
    first: int
    last: int
    steps: int
    num_experts: int

    def sentence(self) -> str:
        window = (f"the last {self.steps} logged steps (steps {self.first}-{self.last})"
                  if self.steps > 1 else f"the last logged step (step {self.last})")
        return (f"layer {self.layer} is the most imbalanced over {window}: its busiest expert "
                f"took {self.imbalance:.2f}x the mean expert's tokens (1 balanced, "
                f"{self.num_experts} all to one) and its top 2 experts "
                f"{100 * self.top2:.0f}% of its picks")


def layer_loads(counts: Sequence[Sequence[float]]) -> list[tuple[float, float]]:
    """Per layer (imbalance: max / mean, top2: the two busiest experts' share)."""
    loads = []
    for layer in counts:
        values = sorted((float(c) for c in layer), reverse=True)
        total = sum(values)
        mean = total / len(values) if values else 0.0
        loads.append((values[0] / mean if mean > 0 else 1.0,
                      sum(values[:2]) / total if total > 0 else 0.0))
    return loads


def window_counts(rows: Sequence[Mapping], size: int = WINDOW) -> list[list[float]] | None:
    """The counts of the last ``size`` rows summed ([layer][expert]); None without rows (or
    rows of different shapes: a run resumed with another model)."""
    window = [r["counts"] for r in rows[-size:]]
    if not window or any(len(c) != len(window[0]) or
                         any(len(a) != len(b) for a, b in zip(c, window[0])) for c in window):
        return None
    return [[sum(float(c[i][e]) for c in window) for e in range(len(window[0][i]))]
            for i in range(len(window[0]))]


def worst_layer(rows: Sequence[Mapping], size: int = WINDOW) -> WorstLayer | None:
    """The most imbalanced layer (by max / mean, then by its top 2's share) of the last
    ``size`` rows summed; None without rows."""
    counts = window_counts(rows, size)
    if not counts:
        return None
    loads = layer_loads(counts)
    layer = max(range(len(loads)), key=lambda i: loads[i])
    window = rows[-size:]
    return WorstLayer(layer, *loads[layer], first=window[0].get("step"),
                      last=window[-1].get("step"), steps=len(window),
                      num_experts=len(counts[layer]))
