"""How evenly the pipeline splits of
``meshtrain.parallel.pipeline.partition.partition_blocks`` spread the forward + backward time over
the stages.

A pipeline's step is set by its slowest stage, so for K stages the split's max/mean stage time is
its efficiency loss (1.0: perfectly even). For each block sequence and K in (2, 4) the split
points are chosen by ``partition_blocks`` with ``balance="params"``, ``"time"`` (the partitioner
times each block itself) and ``"memory"``, and by block count ("even"). Then, independently of
the partitioner, the forward + backward time of every contiguous run of blocks [a, b) is measured
on the hidden state that enters block a (as in the running sequence), with
``out.backward(ones)``: thread CPU time with one torch thread (other processes cannot inflate
it), median over ``--repeats`` rounds after one warm-up round, every range once per round in a
shuffled order so that load from elsewhere hits them alike. A split's stage times are the times
of its ranges. "best" is the split with the smallest measured slowest stage over all contiguous
splits (chosen on the same noisy figures, so slightly optimistic); "x best" = a split's slowest
stage / best's. The table has one line per distinct split, naming every method that chose it.

Block sequences:

* ``uneven-mlp``: 8 residual MLP blocks (d 256, hidden 64 x4, 448, 256 x3) on 512 tokens;
* ``gpt``: the 8 layers of ``meshtrain.models.gpt.GPT`` (d 128, 4 heads, mlp_ratio 4), batch 1
  x seq 512: equal blocks, the control case;
* ``gpt-wide-5-6-7`` and ``gpt-wide-0-6-7``: the same with the MLPs of those layers four times
  wider (mlp_ratio 16): 3x the parameters of a plain layer but only about 2.1x its time
  (attention's cost grows with seq, not with parameters).

    python benchmarks/partition.py                   # 9 repeats (~1-2 min)
    python benchmarks/partition.py --quick           # smoke run: 1/4 of the tokens, 2 repeats
    python benchmarks/partition.py --repeats 15 --json /tmp/partition.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from harness import WallClock, machine, table, write_json
from torch import nn

from meshtrain.models.gpt import GPT, Block, GPTConfig
from meshtrain.parallel.pipeline.partition import partition_blocks

HIDDEN = [64, 64, 64, 64, 448, 256, 256, 256]  # the old unit test's uneven blocks
STAGES = (2, 4)
SPLITS = ("even", "params", "time", "memory")


class MLPBlock(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(d_model, hidden)
        self.fc_out = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(F.gelu(self.fc_in(x)))


def uneven_mlp(scale: int) -> tuple[nn.ModuleList, torch.Tensor]:
    torch.manual_seed(0)
    return nn.ModuleList(MLPBlock(256, h) for h in HIDDEN), torch.randn(512 // scale, 256)


def gpt(scale: int, wide: tuple[int, ...] = ()) -> tuple[nn.ModuleList, torch.Tensor]:
    config = GPTConfig(vocab_size=256, seq_len=512, num_layers=8, num_heads=4, d_model=128)
    model = GPT(config)
    for i in wide:
        model.layers[i] = Block(dataclasses.replace(config, mlp_ratio=16))
    idx = torch.randint(0, 256, (1, 512 // scale), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.layers, model.embed(idx)


SEQUENCES = {"uneven-mlp": uneven_mlp, "gpt": gpt,
             "gpt-wide-5-6-7": lambda scale: gpt(scale, (5, 6, 7)),
             "gpt-wide-0-6-7": lambda scale: gpt(scale, (0, 6, 7))}


def range_times(blocks: nn.ModuleList, x: torch.Tensor, repeats: int) -> dict:
    """Median forward + backward thread CPU seconds of every contiguous run of blocks."""
    inputs = []
    with torch.no_grad():
        for block in blocks:
            inputs.append(x)
            x = block(x)
    n = len(blocks)
    ranges = [(a, b) for a in range(n) for b in range(a + 1, n + 1)]
    samples: dict = {r: [] for r in ranges}
    for round_ in range(1 + repeats):  # round 0 is the warm-up
        random.Random(round_).shuffle(ranges)
        for a, b in ranges:
            start = time.thread_time()
            out = inputs[a].detach().requires_grad_()
            for block in blocks[a:b]:
                out = block(out)
            out.backward(torch.ones_like(out))
            blocks.zero_grad(set_to_none=True)
            if round_:
                samples[(a, b)].append(time.thread_time() - start)
    return {r: statistics.median(s) for r, s in samples.items()}


def stage_times(times: dict, splits: list[int], n: int) -> list[float]:
    bounds = [0, *splits, n]
    return [times[(a, b)] for a, b in itertools.pairwise(bounds)]


def bench_sequence(name: str, scale: int, repeats: int) -> list[dict]:
    blocks, x = SEQUENCES[name](scale)
    n = len(blocks)
    chosen = {}
    for k in STAGES:
        chosen[k] = {"even": [n * i // k for i in range(1, k)]}
        for balance in ("params", "time", "memory"):
            chosen[k][balance] = partition_blocks(blocks, k, balance=balance, sample_input=x)
    times = range_times(blocks, x, repeats)
    rows = []
    for k in STAGES:
        every = [list(s) for s in itertools.combinations(range(1, n), k - 1)]
        chosen[k]["best"] = min(every, key=lambda s: max(stage_times(times, s, n)))
        best_max = max(stage_times(times, chosen[k]["best"], n))
        for by, splits in chosen[k].items():
            stages = stage_times(times, splits, n)
            rows.append({"sequence": name, "stages": k, "split_by": by, "splits": splits,
                         "stage_ms": [1e3 * t for t in stages],
                         "max_over_mean": max(stages) / statistics.mean(stages),
                         "x_best": max(stages) / best_max})
    return rows


def format_table(rows: list[dict]) -> str:
    """One line per distinct split of a sequence and K, naming every method that chose it."""
    merged: dict = {}
    for r in rows:
        merged.setdefault((r["sequence"], r["stages"], str(r["splits"])), []).append(r)
    header = ("sequence", "K", "split by", "split points", "stage ms", "max/mean", "x best")
    return table(header, [(
        name, str(k), ",".join(r["split_by"] for r in same), splits,
        " ".join(f"{t:.1f}" for t in same[0]["stage_ms"]), f"{same[0]['max_over_mean']:.3f}",
        f"{same[0]['x_best']:.3f}") for (name, k, splits), same in merged.items()], left=5)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds (9)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1/4 of the tokens, 2 repeats")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 2
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    scale = 4 if args.quick else 1
    torch.set_num_threads(1)  # then block_time_costs, too, times thread CPU time
    print(f"partition benchmark: {args.repeats} repeats, 1 torch thread, torch "
          f"{torch.__version__}", flush=True)
    clock = WallClock()
    rows = [row for name in SEQUENCES for row in bench_sequence(name, scale, args.repeats)]
    print(f"({clock.stop()})\n")
    print(format_table(rows))
    if args.json:
        result = {
            "command": " ".join(["python", *sys.argv]),
            "config": {"repeats": args.repeats, "quick": args.quick, "stages": list(STAGES),
                       "sequences": list(SEQUENCES)},
            "machine": machine(**clock.loads(), wall_s=clock.wall_s),
            "summary": rows,
        }
        print(f"\nwrote {write_json(args.json, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
