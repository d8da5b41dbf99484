"""How far mixed precision moves training from fp32, per layout: the table of docs/precision.md.

For each precision (fp32, bf16-mixed, fp16-mixed) the 4-block tiny GPT of tests/parity.py trains
``--steps`` steps in one process and under each layout (dp=2, zero3=2, pp=2 by default), same
seed and data. Each layout run is compared with

* fp32 in one process: what the format costs plus what the layout adds (the parity tests'
  tolerance must cover this);
* the same precision in one process on the same micro-batches (8 samples per forward pass,
  2 accumulated per step, as each layout runs them): what the layout alone adds (fp32 summation
  order of the gradient reduction; under zero3, FSDP2 casting the parameters to half precision
  once, where autocast casts them per operation and keeps norms and the loss in fp32).
  Against a one-process run on whole batches of 16 the layouts differ by as much as fp16/bf16
  differs from fp32: a half-precision weight gradient is rounded per micro-batch before the fp32
  sum, so splitting the batch changes the rounding.

Columns: max |dparam| over all parameters at the end, max |dloss| over the steps, max relative
difference of the gradient norm before clipping (relative to max(norm, 1), as
tests/parity.py compares it). The fp16 runs must skip no step (a skipped
step would show as an inf gradient norm). ``--optimizer sgd`` (default) keeps the parameter
difference proportional to the gradient error; under AdamW an element whose gradient is near
zero moves by about lr whatever its sign, so the difference is bounded by ~2 lr x steps for any
noise and says little about the format.

    python benchmarks/precision_parity.py                 # 8 steps, SGD, all 9 layout runs
    python benchmarks/precision_parity.py --optimizer adamw --precisions fp16-mixed
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import harness

TESTS = str(Path(__file__).resolve().parent.parent / "tests")
sys.path.insert(0, TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))

import parity  # tests/parity.py: the parity harness

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
LAYOUTS = ("dp=2", "zero3=2", "pp=2")


def fns(optimizer: str) -> dict:
    return dict(parity.GPT4_FNS, optimizer_fn=parity.sgd if optimizer == "sgd" else
                parity.adamw_gpt)


def differences(state: dict, reference: dict) -> tuple[float, float, float]:
    """(max |dparam|, max |dloss|, max |dgrad-norm| / max(grad-norm, 1)) of ``state`` against
    ``reference`` (the gradient norm as tests/parity.py compares it)."""
    dloss = (state[parity.LOSSES] - reference[parity.LOSSES]).abs().max().item()
    want = reference[parity.GRAD_NORMS]
    dnorm = ((state[parity.GRAD_NORMS] - want).abs() / want.abs().clamp(min=1)).max().item()
    return parity.max_param_diff(state, reference), dloss, dnorm


def measure(precisions, layouts, steps: int, optimizer: str) -> list[dict]:
    common = dict(max_steps=steps, global_batch_size=16, log_grad_norm=True)
    run_fns = fns(optimizer)
    one = {p: parity.train_state(dict(common, precision=p), **run_fns)
           for p in dict.fromkeys(("fp32", *precisions))}
    # the layouts' micro-batches: 8 samples per forward pass (per rank, or per pp micro-batch)
    split = {p: parity.train_state(dict(common, precision=p, micro_batch_size=8), **run_fns)
             for p in precisions}
    moved = parity.max_param_diff(one["fp32"], parity.train_state(dict(common, max_steps=1),
                                                                  **run_fns))
    rows = []
    for p in precisions:
        rows.append(dict(precision=p, layout="1 process", vs_fp32=differences(one[p], one["fp32"]),
                         vs_same=None))
        rows.append(dict(precision=p, layout="1 process, 2x8", vs_fp32=differences(
            split[p], one["fp32"]), vs_same=differences(split[p], one[p])))
        for layout in layouts:
            state = parity.run_layout(dict(common, precision=p, layout=layout), 2, **run_fns)
            if not state[parity.GRAD_NORMS].isfinite().all():
                raise AssertionError(f"{p} under {layout} skipped a step (inf gradients): the "
                                     "comparison with fp32 would be meaningless")
            rows.append(dict(precision=p, layout=layout, vs_fp32=differences(state, one["fp32"]),
                             vs_same=differences(state, split[p])))
    return moved, rows


def render(rows: list[dict]) -> str:
    def cells(values):
        return ["-"] * 3 if values is None else [f"{values[0]:.1e}", f"{values[1]:.1e}",
                                                 f"{values[2]:.1e}"]

    header = ["precision", "layout", "dparam fp32", "dloss fp32", "dnorm fp32", "dparam same",
              "dloss same", "dnorm same"]
    return harness.table(header, [[r["precision"], r["layout"], *cells(r["vs_fp32"]),
                                   *cells(r["vs_same"])] for r in rows], left=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    clock = harness.WallClock()
    moved, rows = measure(args.precisions.split(","), args.layouts.split(","), args.steps,
                          args.optimizer)
    print(f"tiny GPT (4 blocks), {args.steps} steps, {args.optimizer}, global batch 16 (the "
          f"parameters move by up to {moved:.1e} after step 1); "
          "'fp32': against fp32 in one process; 'same': against the same precision in one "
          "process on micro-batches of 8 (2x8; its own row: against whole batches of 16)")
    print(render(rows))
    print(clock.stop())
    if args.out:
        harness.write_json(args.out, {"machine": harness.machine(**clock.loads()),
                                      "args": vars(args), "moved": moved, "rows": rows})


if __name__ == "__main__":
    main()
