"""The resume matrix: a checkpoint from every layout resumes under every layout (up to 4 ranks).

Layouts: 1 process, dp=2, zero1=2, zero3=2, tp=2, pp=2 (1f1b), pp=2 interleaved (2 stages per
rank), dp_shard=2,tp=2, dp_replicate=2,dp_shard=2, pp=2,dp_shard=2. A 4-block GPT (AdamW, fp32,
no dropout) trains ``--steps`` steps under each "from" layout and saves a checkpoint there; every
"to" layout resumes from each checkpoint and trains one more step. One process trained
``--steps`` + 1 steps straight through is the reference. Per cell:

* ``loaded = saved``: the full model and optimizer state (parameters, exp_avg, exp_avg_sq,
  step, each parameter's hyperparameters) right after loading, gathered over the ranks, minus
  the "from" run's at its save: must be 0;
* ``position``: step, epoch and consumed samples after loading equal the reference's;
* ``batch``: the samples of the next global batch (every rank's fetched indices, merged over
  the batch ranks; ranks that share a batch must fetch the same) equal the reference's;
* ``loss diff``: the next step's loss minus the reference's (<= 1e-6);
* ``param diff``: the parameters after that step minus the reference's (<= 1e-5).

The checks live in ``tests/checkpoint/resume_matrix_lib.py``, which the suite's diagonal
(``tests/checkpoint/test_resume_matrix.py``) uses too. Exit status 1 if any cell does not pass
(a failure, an error or a refusal).

    python benchmarks/resume_matrix.py                          # all 10 x 10 cells
    python benchmarks/resume_matrix.py --from dp=2 zero3=2 --to "1 process" pp=2
    python benchmarks/resume_matrix.py --steps 5 --out results/resume_matrix.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "checkpoint"), str(ROOT / "tests")]

import resume_matrix_lib as lib
from harness import WallClock, machine, table, write_json

from meshtrain.launch import spawn

spawn.FORKSERVER_PRELOAD += ["meshtrain", "meshtrain.trainer", "resume_matrix_lib"]


def _check_names(names: list[str], what: str) -> list[str]:
    unknown = [n for n in names if n not in lib.LAYOUTS]
    if unknown:
        sys.exit(f"unknown {what} layout(s) {unknown}; choose from {list(lib.LAYOUTS)}")
    return names


def _yes(flag: bool | None) -> str:
    return "-" if flag is None else ("yes" if flag else "NO")


def _sci(value: float | None) -> str:
    return "-" if value is None else ("0" if value == 0 else f"{value:.1e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from", dest="froms", nargs="+", default=list(lib.LAYOUTS),
                        metavar="LAYOUT", help="the layouts that save (default: all)")
    parser.add_argument("--to", dest="tos", nargs="+", default=list(lib.LAYOUTS),
                        metavar="LAYOUT", help="the layouts that resume (default: all)")
    parser.add_argument("--steps", type=int, default=lib.STEPS,
                        help="steps before the checkpoint (default %(default)s)")
    parser.add_argument("--group-by", choices=("to", "size"), default="to",
                        help="one group of processes per 'to' layout, or per world size")
    parser.add_argument("--out", default=None, help="JSON of the cells (under benchmarks/)")
    args = parser.parse_args(argv)
    froms, tos = _check_names(args.froms, "--from"), _check_names(args.tos, "--to")
    cells = [(f, t) for f in froms for t in tos]
    clock = WallClock()
    with tempfile.TemporaryDirectory(prefix="resume-matrix-") as base:
        def log(message: str) -> None:
            print(f"[{time.perf_counter() - clock.started:6.1f} s] {message}", flush=True)

        records = lib.run_matrix(cells, base, steps=args.steps, log=log, group_by=args.group_by)
    verdicts = {cell: lib.judge(records, cell, args.steps) for cell in cells}
    ran = clock.stop()

    rows = [(f"{f} -> {t}", v.status, _sci(v.loaded_diff), _yes(v.position_equal),
             _yes(v.batch_equal), _sci(v.loss_diff), _sci(v.param_diff))
            for (f, t), v in verdicts.items()]
    print()
    print(table(("from -> to", "result", "loaded - saved", "position equal", "batch equal",
                 f"step {args.steps + 1} loss diff", "params after diff"), rows, left=2))
    print()
    print(table(("from \\ to", *(str(i + 1) for i in range(len(tos)))),
                [(f, *("ok" if verdicts[(f, t)].ok else verdicts[(f, t)].status
                       for t in tos)) for f in froms]))
    print("columns: " + ", ".join(f"{i + 1} = {t}" for i, t in enumerate(tos)))
    bad = {cell: v for cell, v in verdicts.items() if not v.ok}
    for (f, t), v in bad.items():
        print(f"\n{f} -> {t}: {v.status}")
        for problem in v.problems:
            print(f"  {problem}")
    passed = len(cells) - len(bad)
    print(f"\n{passed} of {len(cells)} cells pass (loss <= {lib.LOSS_TOL:g}, parameters <= "
          f"{lib.PARAM_TOL:g}, loaded state exact); {ran}")
    if args.out:
        path = write_json(Path(__file__).parent / args.out, {
            "steps": args.steps, "machine": machine(), "wall_s": clock.wall_s, **clock.loads(),
            "cells": [{"from": f, "to": t, "status": v.status, "loaded_diff": v.loaded_diff,
                       "position_equal": v.position_equal, "batch_equal": v.batch_equal,
                       "loss_diff": v.loss_diff, "param_diff": v.param_diff,
                       "problems": list(v.problems)} for (f, t), v in verdicts.items()]})
        print(f"wrote {path}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
