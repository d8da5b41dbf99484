"""How much of the cores a pipeline's processes keep busy here, against data parallel's, when
the processes outnumber the cores: the planner's pipelines on this machine take this long
over what their stages' work needs (``Cluster.pp_core_use``).

Sharing cores, the estimate lets a pipeline's stages pool their work: a stage that waits for
its peer lends its core (meshtrain/plan/estimate.py). They do not pool it perfectly. Measured
on 2026-12-01 (the planner benchmark's GPT on 4 processes over 2 cores, a quiet machine,
session scripts): a step of ``pp=2,dp=2`` left the machine's cores idle 4-8 % of the time, of
``dp=4`` 1.6-2.8 %, in 12 runs of each, the two using the same CPU seconds a step within
noise; beside a busy loop (``python3 -c "while True: pass"``) the four processes kept 0.67-0.69
of the 2 cores busy under ``pp=2,dp=2`` against 0.74-0.75 under ``dp=4``: a stage that sleeps
on its peer gives its core to whatever else runs, and another job takes it.

This runs a job outside the planner benchmark's table (its GPT with 2 blocks instead of 4, the
same widths) under ``dp=W`` and ``pp=2,dp=W/2`` by turns, ``repeats`` times; each run's core
use is the CPU seconds of its processes (every thread: gloo's too) over the timed steps, over
the cores times the wall time; the result is the median of the paired ratios (pipeline over
data parallel). benchmarks/planner.py measures it before it plans and keeps it in its JSON,
where ``Cluster.preset("this-machine")`` reads it back.

    python benchmarks/pp_core_use.py [--world 4] [--steps 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from harness import end_process_group, token_pairs

from meshtrain.launch.spawn import run_workers

MODEL = "gpt:num_layers=2,num_heads=4,d_model=256,vocab_size=2048,seq_len=128"
GLOBAL_BATCH, SEQ, MICRO_BATCH = 16, 128, 4


def worker(layout: str, steps: int) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) over the steps after the first two."""
    from meshtrain import Trainer, losses
    from meshtrain.callbacks import Callback
    from meshtrain.plan.model_spec import ModelSpec

    marks: list[tuple[float, float]] = []

    class Marks(Callback):
        def on_train_step_end(self, trainer, metrics):
            marks.append((time.process_time(), time.perf_counter()))

    spec = ModelSpec.load(MODEL)
    data = token_pairs(spec.vocab_size, GLOBAL_BATCH * (steps + 1), SEQ)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(accelerator="cpu", max_steps=steps, global_batch_size=GLOBAL_BATCH,
                          micro_batch_size=MICRO_BATCH, layout=layout, loggers=(),
                          callbacks=[Marks()], progress_bar=False, save_final_checkpoint=False,
                          run_dir=run_dir, log_every_n_steps=steps, report=False,
                          model_summary=False)
        trainer.fit(lambda: spec.build(), data,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                    loss_fn=losses.cross_entropy())
        end_process_group()
    (cpu0, wall0), (cpu1, wall1) = marks[1], marks[-1]
    return cpu1 - cpu0, wall1 - wall0


def core_use(layout: str, world: int, steps: int) -> float:
    """The share of this machine's cores the job's ``world`` processes keep busy."""
    ranks = run_workers(worker, world, (layout, steps), timeout=600, threads=1)
    cores = min(world, len(os.sched_getaffinity(0)))
    return sum(cpu for cpu, _ in ranks) / (cores * max(wall for _, wall in ranks))


def pp_core_use(world: int, steps: int = 8, repeats: int = 3) -> dict:
    """``{"world", "pp_core_use", "runs": [(pipeline, data parallel)], "model"}``: the median
    over ``repeats`` pairs of a ``pp=2`` job's core use over a data-parallel one's (1.0 where
    the processes do not outnumber the cores: each has its own, nothing to pool)."""
    out = {"world": world, "pp_core_use": 1.0, "runs": [], "model": MODEL}
    if world <= len(os.sched_getaffinity(0)) or world % 2:
        return out
    for _ in range(repeats):
        out["runs"].append((core_use(f"pp=2,dp={world // 2}", world, steps),
                            core_use(f"dp={world}", world, steps)))
    out["pp_core_use"] = min(1.0, statistics.median(pp / dp for pp, dp in out["runs"]))
    return out


def summary(measured: dict) -> str:
    runs = " ".join(f"{pp:.3f}/{dp:.3f}" for pp, dp in measured["runs"])
    return (f"pp_core_use on {measured['world']} processes: {measured['pp_core_use']:.3f} of "
            f"data parallel's (pipeline/data parallel core use: {runs or 'not measured'})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(summary(pp_core_use(args.world, args.steps, args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
