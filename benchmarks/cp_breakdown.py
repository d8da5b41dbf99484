"""Where context parallel's step time goes on this machine, beside data parallel: the planner
benchmark's GPT (benchmarks/planner.py) under ``dp=W`` and ``cp=W`` on W processes, the
per-part step breakdown every rank records (``breakdown.csv``: compute, comm, optimizer, ...;
cp's all-gathers and reduce-scatters run inside "compute"), the median over the steps after
the first three, the slowest rank, interleaved ``--repeats`` times; beside it the planner's
estimate of the same (``meshtrain.plan``, this machine's preset, calibrated first).

It measures what the planner's model of cp misses here (issue 53's tau): on 4 processes over 2
cores the cp rows run slower than predicted beside dp, and the ratio cp/dp of the compute part,
set beside the same ratio on 2 processes (a core each), shows how much of that is the cost of
cp's synchronising collectives when processes share cores.

    python benchmarks/cp_breakdown.py [--world 4] [--repeats 2] [--out results/cp_breakdown_4.json]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
from pathlib import Path

import torch
from harness import end_process_group, machine, table, token_pairs, write_json

from meshtrain.launch.spawn import run_workers

MODEL = "gpt:num_layers=4,num_heads=4,d_model=256,vocab_size=2048,seq_len=128"
GLOBAL_BATCH, SEQ, STEPS = 16, 128, 10
PARTS = ("step_s", "compute_s", "comm_s", "optimizer_s", "other_s")


def worker(settings: dict, run_dir: str) -> None:
    from meshtrain import Trainer, losses
    from meshtrain.plan.model_spec import ModelSpec

    spec = ModelSpec.load(MODEL)
    data = token_pairs(spec.vocab_size, GLOBAL_BATCH * (STEPS + 1), SEQ)
    trainer = Trainer(accelerator="cpu", max_steps=STEPS, global_batch_size=GLOBAL_BATCH,
                      loggers=(), progress_bar=False, save_final_checkpoint=False,
                      log_every_n_steps=1, run_dir=run_dir, report=False, model_summary=False,
                      **settings)
    trainer.fit(lambda: spec.build(), data,
                optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                loss_fn=losses.cross_entropy())
    end_process_group()


def measure(settings: dict, world: int) -> dict[str, float]:
    """The slowest rank's median of each part over the steps after the third."""
    with tempfile.TemporaryDirectory() as run_dir:
        run_workers(worker, world, (settings, run_dir), timeout=600, threads=1)
        rows = [r for r in csv.DictReader(open(Path(run_dir) / "breakdown.csv"))
                if int(r["step"]) > 3]
    ranks = sorted({r["rank"] for r in rows})
    return {part: max(statistics.median(float(r[part]) for r in rows if r["rank"] == rank)
                      for rank in ranks) for part in PARTS}


def predicted(world: int, layouts: dict) -> dict[str, dict[str, float]]:
    """The planner's step time and its compute and cp parts for each layout on this machine
    (calibrated here first, before any worker runs)."""
    from meshtrain.plan.candidate import Candidate, Job
    from meshtrain.plan.cluster import Cluster
    from meshtrain.plan.estimate import Estimator
    from meshtrain.plan.model_spec import ModelSpec

    estimator = Estimator(ModelSpec.load(MODEL), Cluster.preset("this-machine", processes=world),
                          Job(GLOBAL_BATCH, SEQ))
    out = {}
    for name, settings in layouts.items():
        e = estimator.estimate(Candidate(settings["layout"], settings["micro_batch_size"]))
        out[name] = {"step_s": e.step_seconds, "compute_s": e.seconds["compute"],
                     "cp_s": e.seconds["tp_cp_comm"]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    w = args.world
    layouts = {f"dp={w}": {"layout": f"dp={w}", "micro_batch_size": GLOBAL_BATCH // w},
               f"cp={w}": {"layout": f"cp={w}", "micro_batch_size": GLOBAL_BATCH}}
    planned = predicted(w, layouts)
    runs = {name: [] for name in layouts}
    for _ in range(args.repeats):  # interleaved: a slow stretch of the machine hits both
        for name, settings in layouts.items():
            runs[name].append(measure(settings, w))
    result = {name: {part: statistics.median(r[part] for r in rs) for part in PARTS}
              for name, rs in runs.items()}
    dp, cp = result[f"dp={w}"], result[f"cp={w}"]
    result["cp_over_dp"] = {part: cp[part] / dp[part] for part in ("step_s", "compute_s")}
    print(table(["layout", *PARTS], [[name, *(f"{values[part]:.3f}" for part in PARTS)]
                                      for name, values in result.items() if name in runs]))
    p_dp, p_cp = planned[f"dp={w}"], planned[f"cp={w}"]
    result["predicted"] = planned
    result["predicted_cp_over_dp"] = {
        "step_s": p_cp["step_s"] / p_dp["step_s"],
        "compute_s": (p_cp["compute_s"] + p_cp["cp_s"]) / p_dp["compute_s"]}
    print(f"cp/dp measured: step {result['cp_over_dp']['step_s']:.2f}, compute (with cp's "
          f"collectives) {result['cp_over_dp']['compute_s']:.2f}; predicted: step "
          f"{result['predicted_cp_over_dp']['step_s']:.2f}, compute + cp collectives "
          f"{result['predicted_cp_over_dp']['compute_s']:.2f}")
    if args.out:
        write_json(args.out, {"machine": machine(), "model": MODEL, "world": w,
                              "repeats": args.repeats, "runs": runs, **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
