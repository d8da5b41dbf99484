"""Context parallel through a model's own hooks against meshtrain's reading of its SDPA calls.

meshtrain's GPT implements ``enable_context_parallel`` (its attention calls ``cp_attention``,
its positions are taken at the shard's global offsets). A model that does not is made context
parallel by ``parallel/context/sdpa.py``: a ``TorchFunctionMode`` active while the model runs
turns each ``F.scaled_dot_product_attention`` into ``cp_attention`` and reads position tables at
the global positions, which means every torch call of the forward passes through the mode's
Python. Here the same GPT trains under ``cp=2`` both ways: ``own`` as it is, ``sdpa`` wrapped
in a module without the hooks (so the Trainer falls back to the SDPA reading); same values,
same data, same seed. Each fit runs ``--steps`` optimizer steps on 2 processes (gloo, CPU, one
thread each); the step time is the median ``step_s`` of ``breakdown.csv`` past the first
interval (the slower rank), and the final losses of the two are compared. The two alternate
for ``--repeats`` rounds; the ratio is paired per round.

    python benchmarks/cp_paths.py                    # seq 512, d 256, 4 layers, 3 repeats
    python benchmarks/cp_paths.py --seq-len 128 --repeats 1   # smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
from harness import machine, table, write_json

from meshtrain import Trainer
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.observe import run_files

PATHS = ("own", "sdpa")


class Hidden(nn.Module):
    """The GPT without its context-parallel methods in sight: cp through its SDPA calls."""

    def __init__(self, config):
        super().__init__()
        self.gpt = GPT(config, seed=0)

    def forward(self, idx):
        return self.gpt(idx)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq_len, vocab):
        gen = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, vocab, (n, seq_len + 1), generator=gen)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i, :-1], self.rows[i, 1:]


def lm_loss(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def fit(path: str, rep: int, args, root: Path) -> dict:
    config = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, num_layers=args.layers,
                       d_model=args.d_model, num_heads=args.d_model // 64, dropout=0.0)
    model = (lambda: GPT(config, seed=0)) if path == "own" else (lambda: Hidden(config))
    run_dir = root / f"{path}-{rep}"  # (the same on every rank: the script runs on each)
    trainer = Trainer(layout="cp=2", devices=2, accelerator="cpu", max_steps=args.steps,
                      global_batch_size=args.batch, log_every_n_steps=args.every,
                      breakdown_every_n_steps=args.every, run_dir=str(run_dir), loggers=("csv",),
                      progress_bar=False, report=False, save_final_checkpoint=False, seed=0,
                      shuffle=False)
    trainer.fit(model, Tokens(args.batch * args.steps, args.seq_len, args.vocab),
                optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), loss_fn=lm_loss)
    rows = [r for r in run_files.read_breakdown(run_dir) if r["step"] > args.every]
    steps = sorted({r["step"] for r in rows})
    slower = [max(r["step_s"] for r in rows if r["step"] == s) for s in steps]
    from meshtrain.observe.loggers import read_metrics_csv

    losses = [m["train/loss"] for m in read_metrics_csv(run_dir / "metrics.csv")
              if m.get("train/loss") is not None]
    return {"step_s": statistics.median(slower), "loss": losses[-1]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "meshtrain-cp-paths")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    root = args.root
    if os.environ.get("RANK", "0") == "0":
        shutil.rmtree(root, ignore_errors=True)
    runs: dict[str, list[dict]] = {path: [] for path in PATHS}
    for rep in range(args.repeats):
        for path in PATHS if rep % 2 == 0 else PATHS[::-1]:
            runs[path].append(fit(path, rep, args, root))
            print(f"  repeat {rep + 1}: {path} {runs[path][-1]['step_s'] * 1e3:.1f} ms/step, "
                  f"final loss {runs[path][-1]['loss']:.6f}", flush=True)
    if os.environ.get("RANK", "0") != "0":
        return 0
    ratios = [s["step_s"] / o["step_s"] for s, o in zip(runs["sdpa"], runs["own"])]
    losses = [abs(s["loss"] - o["loss"]) for s, o in zip(runs["sdpa"], runs["own"])]
    print(table(("path", "median ms/step", "min", "max"), [
        (path, *(f"{f([r['step_s'] for r in runs[path]]) * 1e3:.1f}"
                 for f in (statistics.median, min, max))) for path in PATHS]))
    print(f"sdpa / own, paired per repeat: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); final losses differ by at most "
          f"{max(losses):.2e}")
    if args.out:
        write_json(args.out, {"machine": machine(), "args": {k: str(v) for k, v in
                                                              vars(args).items()},
                              "runs": runs, "sdpa_over_own": ratios, "loss_diff": losses})
    return 0


if __name__ == "__main__":
    sys.exit(main())
