"""Step time and per-rank model-state memory of dp, zero1, zero2 and zero3 on the same job.

Every layout trains the same MLP (a few million parameters, so that memory differences are
visible) with AdamW on the same data and global batch, through ``Trainer(layout=...)`` on 2
processes (gloo, CPU, one torch thread per rank):

* ``dp``: DDP, everything replicated (ZeRO stage 0);
* ``zero1``: DDP + ``ZeroRedundancyOptimizer``: optimizer state sharded;
* ``zero2``: FSDP2 with ``reshard_after_forward=False``: gradients and optimizer state sharded;
* ``zero3``: FSDP2: parameters, gradients and optimizer state sharded;

and, for comparison, the same ZeRO-3 job as a user of a peer would write it (time only,
``sharding_peers.py``): ``fsdp2-raw`` (a hand-written FSDP2 loop) and ``lightning-fsdp2``
(Lightning's ``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``).
Lightning's FSDP1 strategy and Accelerate's FSDP2 plugin do not run on CPU (the reasons are
printed).

Step time: each run is fresh processes from ``run_workers``; every rank stamps the end of each
optimizer step, and the step time is (end of the last step - end of the last warm-up step) /
timed steps, the slower rank's. Repeats are interleaved (dp, zero1, zero2, zero3, the peers,
dp, ...); the table shows medians and ratios to dp (also paired by repeat) and the paired ratio
to meshtrain's zero3.

Memory: ``meshtrain.observe.memory.probe.MemoryProbe`` measures what a rank holds right after its
first optimizer step (before zero_grad); zero2's parameters are measured between forward and
backward, where FSDP2 holds them whole (the ZeRO formula's full Ψ; after backward it reshards
them, see "params at rest" in the JSON). Predicted = the ZeRO paper's per-rank formula.

    python benchmarks/sharding.py                  # 5 warm-up + 30 timed steps, 5 repeats
    python benchmarks/sharding.py --quick          # smoke run
    python benchmarks/sharding.py --out-dir /tmp/sharding
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import (
    add_ratios, end_process_group, fmt, hang_guard, in_ms, interleaved, machine, table,
    write_json,
)
from torch.utils.data import TensorDataset

from sharding_peers import NOT_RUN, PEERS, available, peer_worker

from meshtrain.launch.spawn import run_workers

# "-gloo": the same layout on gloo's collectives (local_comm="backend"), where the others pass
# FSDP's shards through shared memory as the Trainer does on one host
LAYOUTS = ("dp", "zero1", "zero2", "zero3", "zero2-gloo", "zero3-gloo")
ROWS = LAYOUTS + PEERS  # meshtrain's layouts, then the peers' ZeRO-3 (sharding_peers.py)
MIB = 2**20


@dataclass(frozen=True)
class Config:
    """What every layout trains."""

    steps: int = 30  # timed optimizer steps
    warmup: int = 5  # untimed steps before them
    global_batch_size: int = 64
    width: int = 1024  # 4 Linear(width, width): 4.2M parameters at 1024
    shard_unit_mb: float | None = 4.0  # the Trainer's default: blocks grouped into 4 MiB units
    world_size: int = 2
    depth: int = 4
    lr: float = 1e-3
    seed: int = 0

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def num_params(self) -> int:
        return self.depth * (self.width * self.width + self.width)


def build_model(cfg: Config) -> torch.nn.Module:
    layers = []
    for _ in range(cfg.depth):
        layers += [torch.nn.Linear(cfg.width, cfg.width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def build_data(cfg: Config) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    n = cfg.global_batch_size * cfg.total_steps  # one epoch covers the run
    return TensorDataset(torch.randn(n, cfg.width, generator=gen),
                         torch.randn(n, cfg.width, generator=gen))


# -------------------------------------------------------------------------------------------------
# one run (on every rank)
# -------------------------------------------------------------------------------------------------
def layout_worker(layout: str, cfg: Config, hang_s: float) -> dict:
    """Train ``layout`` for ``cfg.total_steps`` steps; return this rank's timing and memory."""
    from meshtrain import Trainer
    from meshtrain.callbacks import Callback
    from meshtrain.observe.memory.probe import MemoryProbe, model_state_bytes

    class Probe(Callback):
        def __init__(self):
            self.ends: list[float] = []
            self.memory = None

        def on_fit_start(self, trainer):
            self.memory = MemoryProbe(trainer.model, trainer.optimizer, trainer.layout)

        def on_train_step_end(self, trainer, metrics):
            self.ends.append(time.perf_counter())
            if len(self.ends) == 1:
                self.memory.remove()  # measured at the first step; no hooks in timed steps

    probe = Probe()
    stage, _, comm = layout.partition("-")
    with hang_guard(hang_s), tempfile.TemporaryDirectory(prefix="meshtrain-sharding-") as run_dir:
        trainer = Trainer(
            layout=f"{stage}={cfg.world_size}", accelerator="cpu", max_steps=cfg.total_steps,
            **({"shard_unit_mb": cfg.shard_unit_mb} if stage in ("zero2", "zero3") else {}),
            local_comm="backend" if comm == "gloo" else "auto",
            global_batch_size=cfg.global_batch_size, seed=cfg.seed, callbacks=[probe],
            loggers=(), progress_bar=False, save_final_checkpoint=False,
            log_every_n_steps=cfg.total_steps, run_dir=run_dir,
        )
        trainer.fit(lambda: build_model(cfg), build_data(cfg),
                    optimizer=lambda params: torch.optim.AdamW(params, lr=cfg.lr),
                    loss_fn=F.mse_loss)
        params_at_rest = model_state_bytes(trainer.model).params
        end_process_group()  # while the trainer is alive

    ends = probe.ends
    if len(ends) != cfg.total_steps:
        raise RuntimeError(f"{layout}: saw {len(ends)} step ends, expected {cfg.total_steps}")
    row = probe.memory.row
    return {
        "rank": int(os.environ.get("RANK", 0)),
        "step_s": (ends[-1] - ends[cfg.warmup - 1]) / cfg.steps,
        "measured": asdict(row.measured),
        "predicted": asdict(row.predicted),
        "params_at_rest": params_at_rest,
    }


def _peer(peer: str, cfg: Config, hang_s: float) -> dict:
    with hang_guard(hang_s):
        return peer_worker(peer, cfg, build_model, build_data)


def run_layout(layout: str, cfg: Config, timeout: float) -> dict:
    worker = _peer if layout in PEERS else layout_worker
    ranks = run_workers(worker, cfg.world_size, (layout, cfg, max(1.0, timeout - 10)),
                        timeout=timeout, threads=1)
    # Ranks step together (collectives every step): the slower rank's clock is the job's.
    return {"step_s": max(r["step_s"] for r in ranks), "ranks": ranks}


# -------------------------------------------------------------------------------------------------
# summary, table, chart
# -------------------------------------------------------------------------------------------------
def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    summary = {}
    for layout, reps in runs.items():
        times = [r["step_s"] for r in reps]
        if layout in PEERS:  # time only
            summary[layout] = {**in_ms(times), "measured": None, "measured_total": None}
            continue
        # Memory is deterministic; show the rank that holds the most (ZeRO-1 may be uneven).
        ranks = reps[0]["ranks"]
        top = max(ranks, key=lambda r: sum(r["measured"].values()))
        summary[layout] = {
            **in_ms(times),
            "measured": top["measured"],
            "predicted": top["predicted"],
            "params_at_rest": top["params_at_rest"],
            "measured_total": sum(top["measured"].values()),
            "predicted_total": sum(top["predicted"].values()),
            "per_rank_totals": [sum(r["measured"].values()) for r in ranks],
        }
    for row in summary.values():
        if row["measured"] is not None:
            row["ratio_vs_formula"] = row["measured_total"] / row["predicted_total"]
    add_ratios(summary, "dp", {"time_vs_dp": "median_ms", "paired_time_vs_dp": "repeats_ms"})
    add_ratios(summary, "zero3", {"paired_time_vs_zero3": "repeats_ms"})
    mem = {name: row for name, row in summary.items() if row["measured"] is not None}
    add_ratios(mem, "dp", {"memory_vs_dp": "measured_total"})
    return summary


def format_table(summary: dict[str, dict]) -> str:
    header = ("layout", "ms/step", "x dp", "paired", "paired x zero3", "params", "grads",
              "optim", "total MiB", "x dp", "predicted", "meas/pred")

    def memory(row):
        if row["measured"] is None:  # a peer: time only
            return ("",) * 7
        return (*(f"{row['measured'][k] / MIB:.1f}" for k in ("params", "grads", "optimizer")),
                f"{row['measured_total'] / MIB:.1f}", fmt(row["memory_vs_dp"], ".2f"),
                f"{row['predicted_total'] / MIB:.1f}", f"{row['ratio_vs_formula']:.3f}")

    return table(header, [(
        layout, f"{row['median_ms']:.1f}", fmt(row["time_vs_dp"], ".2f"),
        fmt(row["paired_time_vs_dp"], ".2f"), fmt(row.get("paired_time_vs_zero3"), ".2f"),
        *memory(row),
    ) for layout, row in summary.items()])


def plot_memory(summary: dict[str, dict], path: Path, title: str) -> Path:
    """Stacked bars of per-rank params / grads / optimizer (MiB), predicted total as a tick."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    names = [name for name, row in summary.items() if row["measured"] is not None]
    xs = range(len(names))
    bottom = [0.0] * len(names)
    colors = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868"}
    for part, color in colors.items():
        heights = [summary[n]["measured"][part] / MIB for n in names]
        ax.bar(xs, heights, 0.6, bottom=bottom, label=part, color=color)
        bottom = [b + h for b, h in zip(bottom, heights)]
    predicted = [summary[n]["predicted_total"] / MIB for n in names]
    ax.scatter(xs, predicted, marker="_", s=900, color="black", zorder=3,
               label="ZeRO formula")
    for x, total in zip(xs, bottom):
        ax.annotate(f"{total:.1f}", (x, total), textcoords="offset points", xytext=(0, 4),
                    ha="center", fontsize=8)
    ax.set_xticks(list(xs), [f"{n}\n{summary[n]['median_ms']:.0f} ms/step" for n in names])
    ax.set_ylabel("model state per rank (MiB)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, max(bottom + predicted) * 1.15)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


# -------------------------------------------------------------------------------------------------
# driver
# -------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run (30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (5)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats (5)")
    parser.add_argument("--width", type=int, default=1024, help="MLP width (1024: 4.2M params)")
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks (2; on a 16-core machine also 4 and 8)")
    parser.add_argument("--shard-unit-mb", default="4",
                        help="zero2/zero3: the Trainer's shard_unit_mb (4; 'none': a unit per block)")
    parser.add_argument("--layouts", default=",".join(ROWS),
                        help=f"comma-separated subset of {','.join(ROWS)} (the last are peers)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 warm-up + 5 timed steps, 1 repeat, width 256")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds before a hung run is killed")
    parser.add_argument("--out-dir", default="benchmarks/results",
                        help="where sharding.json and sharding_memory.png go")
    parser.add_argument("--from-json", help="only redraw table and chart from this sharding.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats, args.width = 5, 2, 1, 256
    if (min(args.steps, args.warmup, args.repeats, args.world_size) < 1
            or args.width % args.world_size or 64 % args.world_size):
        parser.error("--steps, --warmup, --repeats, --world-size must be >= 1, --width a "
                     "multiple of the world size, and the world size divide the batch (64)")
    return args


def _chart_title(title: str) -> str:
    return "Model state per rank by layout (bars: measured, ticks: ZeRO formula)\n" + title


def replot(json_path: Path, out_dir: Path) -> Path:
    """Table and chart again from a saved ``sharding.json`` (no training)."""
    result = json.loads(Path(json_path).read_text())
    print(format_table(result["summary"]))
    return plot_memory(result["summary"], out_dir / "sharding_memory.png",
                       _chart_title(result["title"]))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        print(f"wrote {replot(Path(args.from_json), Path(args.out_dir))}")
        return 0
    os.environ["OMP_NUM_THREADS"] = "1"  # one torch thread per rank (the Trainer respects it)
    cfg = Config(steps=args.steps, warmup=args.warmup, width=args.width,
                 world_size=args.world_size,
                 shard_unit_mb=None if args.shard_unit_mb == "none" else float(args.shard_unit_mb))
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = set(layouts) - set(ROWS)
    if unknown:
        print(f"unknown layouts {sorted(unknown)}; choose from {', '.join(ROWS)}")
        return 2
    for name in list(layouts):
        if (why := available(name)) is not None:
            print(f"{name}: skipped ({why})")
            layouts.remove(name)
    for name, why in NOT_RUN.items():
        print(f"{name}: not run ({why}; see sharding_peers.py)")

    title = (f"{cfg.world_size} ranks (gloo, CPU, 1 thread each), MLP {cfg.depth}x"
             f"Linear({cfg.width},{cfg.width}) = {cfg.num_params / 1e6:.2f}M params, AdamW")
    print(f"sharding benchmark: {title}, global batch {cfg.global_batch_size}, {cfg.warmup} "
          f"warm-up + {cfg.steps} timed steps, {args.repeats} repeats, torch {torch.__version__}",
          flush=True)
    runs = interleaved(layouts, args.repeats, lambda name: run_layout(name, cfg, args.timeout),
                       lambda name, res: f"{name:<6} {1e3 * res['step_s']:8.2f} ms/step")

    summary = summarize(runs)
    print()
    print(format_table(summary))
    out_dir = Path(args.out_dir)
    png = plot_memory(summary, out_dir / "sharding_memory.png", _chart_title(title))
    result = {
        "title": title,
        "config": asdict(cfg) | {"num_params": cfg.num_params},
        "repeats": args.repeats,
        "machine": machine(),
        "summary": summary,
        "runs": runs,
    }
    print(f"\nwrote {write_json(out_dir / 'sharding.json', result, indent=2)} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
