"""What ``sdc_check_every_n_steps=N`` costs (meshtrain/fault/sdc.py): per step, checked and not.

One process trains a small GPT (meshtrain.models.gpt: 4 blocks, d_model 128, 64 tokens, vocab
256, global batch 16, dropout 0.1) with the check off and with it every N steps, interleaved
repeats. A callback stamps each optimizer step's start and end; the table gives, per variant, the median
unchecked step, the median checked step (the replay: the first micro-batch's forward and
backward again and a checksum of every gradient) and the mean step over the timed steps, and
the overhead: mean step with the check / without - 1. With one micro-batch a step (the default)
a checked step costs about two steps, so the overhead is about 1/N; with A micro-batches about
1/(A N).

    python benchmarks/sdc_overhead.py                       # N=10, 100 timed steps, 3 repeats
    python benchmarks/sdc_overhead.py --every 5 --micro-batch-size 8
    python benchmarks/sdc_overhead.py --quick               # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import WallClock, interleaved, machine, table, token_pairs, write_json

from meshtrain import Callback, Trainer
from meshtrain.models.gpt import GPT, GPTConfig

VOCAB, SEQ = 256, 64


class Stamps(Callback):
    def __init__(self):
        self.starts, self.ends = [], []

    def on_train_step_start(self, trainer):
        self.starts.append(time.perf_counter())

    def on_train_step_end(self, trainer, metrics):
        self.ends.append(time.perf_counter())


def run(every: int | None, args) -> dict:
    stamps = Stamps()
    with tempfile.TemporaryDirectory() as folder:
        trainer = Trainer(
            max_steps=args.warmup + args.steps, global_batch_size=16,
            micro_batch_size=args.micro_batch_size, run_dir=Path(folder), loggers=(),
            progress_bar=False, report=False, model_summary=False, save_final_checkpoint=False,
            log_every_n_steps=50, sdc_check_every_n_steps=every, callbacks=[stamps],
            accelerator="cpu", seed=0)
        trainer.fit(lambda: GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=4,
                                          num_heads=4, d_model=128, dropout=0.1), seed=0),
                    token_pairs(VOCAB, 16 * 32, SEQ),
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                    loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    times = [end - start for start, end in zip(stamps.starts, stamps.ends)]
    steps = range(args.warmup + 1, args.warmup + args.steps + 1)
    timed = {step: times[step - 1] for step in steps}
    checked = [t for s, t in timed.items() if every and s % every == 0]
    plain = [t for s, t in timed.items() if not (every and s % every == 0)]
    return {"unchecked_ms": 1e3 * statistics.median(plain),
            "checked_ms": 1e3 * statistics.median(checked) if checked else None,
            "mean_ms": 1e3 * statistics.fmean(timed.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="benchmarks/results/sdc_overhead.json")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 20, 2, 1
    torch.set_num_threads(1)
    clock = WallClock()
    names = ["off", f"every {args.every}"]
    runs = interleaved(names, args.repeats,
                       lambda name: run(None if name == "off" else args.every, args),
                       lambda name, r: f"{name}: mean {r['mean_ms']:.1f} ms/step")
    summary = {name: {key: statistics.median(r[key] for r in results)
                      if results[0][key] is not None else None for key in results[0]}
               for name, results in runs.items()}
    base = summary["off"]["mean_ms"]
    rows = [(name, f"{s['unchecked_ms']:.1f}",
             "-" if s["checked_ms"] is None else f"{s['checked_ms']:.1f}",
             f"{s['mean_ms']:.1f}", f"{s['mean_ms'] / base - 1:+.1%}")
            for name, s in summary.items()]
    print(table(("check", "unchecked ms", "checked ms", "mean ms/step", "overhead"), rows))
    print(clock.stop())
    write_json(args.out, {"args": vars(args), "summary": summary, "runs": runs,
                          "machine": machine(**clock.loads())})


if __name__ == "__main__":
    main()
