"""Hyperparameter-search throughput on this machine: trials per hour for the same trial budget
run as several concurrent one-core trials against one trial at a time under dp over every core
(the seed notes' latency/throughput trade-off, measured).

Both variants run `meshtrain sweep` over the demo job (examples/char_gpt.toml: 0.8M-parameter
char GPT, global batch 32) with the learning rate searched, the same sampler seed and trial
budget; each trial trains --steps steps and validates at its end. Wall time covers the whole
sweep (trial start-up included: every trial is a fresh `meshtrain train` process).

    python benchmarks/sweep.py                       # 4 trials of 100 steps per variant
    python benchmarks/sweep.py --trials 2 --steps 10 # smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from harness import machine, table, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(variant: str, trials: int, steps: int, folder: Path) -> dict:
    from meshtrain.sweep import run_sweep

    cores = len(os.sched_getaffinity(0))
    concurrent = variant == "concurrent"
    table_ = {"objective": {"metric": "val/loss"},
              "sweep": {"trials": trials, "pruner": "none", "seed": 0,
                        "devices_per_trial": 1 if concurrent else cores,
                        "concurrent": cores if concurrent else 1},
              "params": {"optimizer.lr": {"low": 1e-3, "high": 1e-2, "log": True}}}
    devices = 1 if concurrent else cores
    overrides = [f"--trainer.max_steps={steps}", f"--trainer.val_every_n_steps={steps}",
                 f"--trainer.devices={devices}", "--trainer.layout=none",
                 "--checkpoint.checkpoint_every_n_steps=none", "--checkpoint.keep_last_k=none",
                 "--logging.report=false",
                 "--sample.num_chars=0"]
    start = time.perf_counter()
    study = run_sweep(str(ROOT / "examples" / "char_gpt.toml"), table=table_,
                      overrides=overrides, sweep_dir=folder / variant, log=lambda m: None)
    wall = time.perf_counter() - start
    done = [t for t in study.get_trials() if t.state.name == "COMPLETE"]
    return {"variant": variant, "trials": len(done), "wall_s": wall,
            "trials_per_hour": 3600 * len(done) / wall,
            "layout": "1 process per trial" if concurrent else f"dp={cores}",
            "concurrent": cores if concurrent else 1,
            "best_val_loss": min(t.value for t in done)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sweep.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        rows = [run(v, args.trials, args.steps, Path(folder))
                for v in ("concurrent", "one-at-a-time")]
    base = rows[1]["trials_per_hour"]
    print(table(("variant", "layout", "at once", "trials", "wall s", "trials/hour", "x",
                 "best val/loss"),
                [(r["variant"], r["layout"], str(r["concurrent"]), str(r["trials"]),
                  f"{r['wall_s']:.1f}", f"{r['trials_per_hour']:.0f}",
                  f"{r['trials_per_hour'] / base:.2f}", f"{r['best_val_loss']:.4f}")
                 for r in rows]))
    write_json(args.out, {"command": "python benchmarks/sweep.py " + " ".join(argv or sys.argv[1:]),
                          "steps": args.steps, "rows": rows, "machine": machine()})


if __name__ == "__main__":
    main()
