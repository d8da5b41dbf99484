"""float8 (torchao, emulated) against bf16 and fp32, and under zero3=2 and tp=2 against one process:
the numbers behind tests/test_float8.py's bounds (docs/precision.md).

* Numerics: tests/float8_job.py's task (the 4-block tiny GPT learns (3 x + 1) mod 16, 50 AdamW
  steps at lr 1e-2, one process), each run against a reference: the largest |dloss| over the
  steps as a fraction of the reference's first loss ("max dloss / loss0"), and the mean of the
  last 10 losses relative to the reference's ("last 10").
* Layouts: the parity harness's tiny GPT, 8 SGD steps, float8 tensorwise, in float64 and in
  fp32: max |dparam|, max |dloss|, max |dgrad-norm| against one process (zero3=2: on the same
  8-sample micro-batches, since the input's scale is taken per forward pass).
* ``--scaled-mm``: torch's CPU float8 matmul (``_scaled_mm``, what float8 without emulation
  would run on a CPU) against fp32 and the emulation, one Linear 512x512, 256 rows, fwd+bwd.

    python benchmarks/float8_numerics.py               # numerics and layouts
    python benchmarks/float8_numerics.py --scaled-mm   # the CPU float8 matmul's speed
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent.parent / "tests")
sys.path.insert(0, TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))

import float8_job  # noqa: E402  (tests/float8_job.py)
import parity  # noqa: E402  (tests/parity.py)

EMULATED = dict(float8_emulate=True)
NUMERIC_RUNS = {  # name: (settings, reference)
    "bf16-mixed": (dict(precision="bf16-mixed"), "fp32"),
    "float8 tensorwise + bf16-mixed": (dict(precision="bf16-mixed", float8="tensorwise"),
                                       "bf16-mixed"),
    "float8 rowwise + bf16-mixed": (dict(precision="bf16-mixed", float8="rowwise"), "bf16-mixed"),
    "float8 tensorwise (fp32)": (dict(float8="tensorwise"), "fp32"),
    "float8 rowwise (fp32)": (dict(float8="rowwise"), "fp32"),
}


def numerics() -> None:
    runs = {"fp32": parity.train_state(float8_job.NUMERICS, **float8_job.NUMERICS_FNS)}
    for name, (settings, _) in NUMERIC_RUNS.items():
        extra = EMULATED if "float8" in settings else {}
        runs[name] = parity.train_state(dict(float8_job.NUMERICS, **settings, **extra),
                                        **float8_job.NUMERICS_FNS)
    print(f"\n{'run':32}  {'against':10}  {'loss0':>6}  {'loss50':>6}  {'max dloss / loss0':>17}"
          f"  {'last 10':>7}")
    for name, (_, against) in NUMERIC_RUNS.items():
        losses, ref = runs[name][parity.LOSSES], runs[against][parity.LOSSES]
        gap = float8_job.loss_gap(losses, ref)
        print(f"{name:32}  {against:10}  {losses[0]:6.3f}  {losses[-1]:6.3f}  "
              f"{gap['steps']:17.2e}  {gap['last10']:7.2%}")


def layouts() -> None:
    print(f"\n{'dtype':7}  {'run':20}  {'against':22}  {'dparam':>8}  {'dloss':>8}  {'dnorm':>8}")
    for float64 in (True, False):
        fns = dict(float8_job.LAYOUT_FNS, float64=float64)
        f8 = dict(float8_job.LAYOUTS, float8="tensorwise", **EMULATED)
        one = parity.run_ranks(f8, 1, **fns)[0]
        split = parity.run_ranks(dict(f8, micro_batch_size=8), 1, **fns)[0]
        fp = parity.run_ranks(float8_job.LAYOUTS, 1, **fns)[0]
        rows = [("one process, float8", "one process, fp32", [one], fp)]
        for layout, ref, label in (("zero3=2", split, "one process, 2x8"),
                                   ("tp=2", one, "one process")):
            ranks = parity.run_ranks(dict(f8, layout=layout), 2, timeout=300, **fns)
            rows.append((f"{layout}, float8", label + ", float8", ranks, ref))
        for name, against, ranks, ref in rows:
            worst = [max(values) for values in zip(*(_gaps(s, ref) for s in ranks))]
            print(f"{'float64' if float64 else 'fp32':7}  {name:20}  {against:22}  "
                  + "  ".join(f"{v:8.1e}" for v in worst))


def _gaps(state: dict, ref: dict) -> tuple[float, float, float]:
    norm = ref[parity.GRAD_NORMS]
    return (parity.max_param_diff(state, ref),
            (state[parity.LOSSES] - ref[parity.LOSSES]).abs().max().item(),
            ((state[parity.GRAD_NORMS] - norm).abs() / norm.clamp(min=1)).max().item())


def scaled_mm(repeats: int = 5) -> None:
    import dataclasses

    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    x = torch.randn(256, 512)

    def ms_per_step(model) -> float:
        model(x).sum().backward()  # (warm-up)
        start = time.perf_counter()
        for _ in range(repeats):
            model(x).sum().backward()
        return (time.perf_counter() - start) / repeats * 1e3

    print(f"\n{'linear 512x512, 256 rows':32}  {'ms fwd+bwd':>10}")
    print(f"{'fp32':32}  {ms_per_step(torch.nn.Linear(512, 512)):10.1f}")
    for recipe in ("tensorwise", "rowwise"):
        for emulate in (True, False):
            model = torch.nn.Sequential(torch.nn.Linear(512, 512))
            config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe),
                                         emulate=emulate)
            convert_to_float8_training(model, config=config)
            how = "emulated" if emulate else "CPU _scaled_mm"
            print(f"{'float8 ' + recipe + ', ' + how:32}  {ms_per_step(model):10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scaled-mm", action="store_true",
                        help="time torch's CPU float8 matmul instead")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    if args.scaled_mm:
        scaled_mm()
        return
    start = time.perf_counter()
    numerics()
    layouts()
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
