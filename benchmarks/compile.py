"""torch.compile's speed-up on the demo model: eager against ``compile=True`` (each block) and
``compile="model"`` (the whole forward), meshtrain's Trainer in every variant.

The model is ``make demo``'s character GPT (examples/char_gpt.toml: 4 layers, 4 heads, d_model
128, 128-token sequences; a 128-symbol vocabulary stands in for the demo's character set) on
random tokens, under its layout ``dp=2`` (2 processes, gloo, CPU, one torch thread per rank),
global batch 32, AdamW. Each rank takes a timestamp at the end of every optimizer step; the step
time is (end of the last step - end of the last warm-up step) / timed steps, so compilation
(in the first step) is left out of it and reported on its own as the first step's time. Repeats
run interleaved (eager, blocks, model, eager, ...); the table gives each variant's median step
time over repeats, its ratio to eager, and the median of the per-repeat ratios (``paired``).

    python benchmarks/compile.py                  # 10 warm-up + 100 timed steps, 3 repeats
    python benchmarks/compile.py --quick          # smoke run
    python benchmarks/compile.py --out benchmarks/results/compile.json

Inductor caches what it compiled (/tmp/torchinductor_$USER): the first run on a machine pays
the full compile time in its first step; later runs (and the later repeats) load the kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time

import torch
from harness import add_ratios, end_process_group, fmt, interleaved, machine, spread, table, \
    write_json
from overhead import StepClock
from torch.utils.data import TensorDataset

from meshtrain.launch.spawn import run_workers

WORLD_SIZE, VOCAB, SEQ, GLOBAL_BATCH = 2, 128, 128, 32
VARIANTS = {"eager": False, "blocks": True, "model": "model"}


def demo_gpt():
    from meshtrain.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=4, num_heads=4, d_model=128))


def token_data(num_samples: int) -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (num_samples, SEQ + 1),
                           generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def worker(variant: str, warmup: int, steps: int) -> dict:
    from meshtrain import Callback, Trainer

    clock = StepClock(warmup, steps)
    first: list[float] = []

    class Clock(Callback):
        def on_train_step_start(self, trainer) -> None:
            if not first:
                first.append(time.perf_counter())

        def on_train_step_end(self, trainer, metrics: dict) -> None:
            clock.step_end()

    quiet = contextlib.redirect_stdout(io.StringIO())
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-") as run_dir, quiet:
        trainer = Trainer(layout=f"dp={WORLD_SIZE}", accelerator="cpu", compile=VARIANTS[variant],
                          max_steps=warmup + steps, global_batch_size=GLOBAL_BATCH, seed=0,
                          callbacks=[Clock()], loggers=(), progress_bar=False,
                          save_final_checkpoint=False, run_dir=run_dir, resume=None)
        trainer.fit(demo_gpt, token_data(GLOBAL_BATCH * (warmup + steps)),
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), loss_fn=lm_loss)
        end_process_group()
    result = clock.result(variant)
    result["first_step_s"] = clock.ends[0] - first[0]
    return result


def run_variant(variant: str, warmup: int, steps: int, timeout: float) -> dict:
    ranks = run_workers(worker, WORLD_SIZE, (variant, warmup, steps), timeout=timeout, threads=1)
    return {key: max(r[key] for r in ranks)  # the ranks step together: the slower one counts
            for key in ("mean_step_s", "cpu_step_s", "first_step_s")}


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    summary = {}
    for variant, reps in runs.items():
        means = [r["mean_step_s"] for r in reps]
        summary[variant] = {**spread(means, scale=1e3, suffix="_ms"),
                            "repeats_ms": [1e3 * m for m in means],
                            "first_step_s": [r["first_step_s"] for r in reps]}
    add_ratios(summary, "eager", {"ratio_vs_eager": "median_ms",
                                  "paired_ratio_median": "repeats_ms"})
    return summary


def format_table(summary: dict[str, dict]) -> str:
    header = ("variant", "median ms/step", "min", "max", "x eager", "paired", "speed-up",
              "first step s (each repeat)")
    return table(header, [(
        name, fmt(s["median_ms"], ".2f"), fmt(s["min_ms"], ".2f"), fmt(s["max_ms"], ".2f"),
        fmt(s["ratio_vs_eager"], ".3f"), fmt(s["paired_ratio_median"], ".3f"),
        fmt(1 / s["paired_ratio_median"], ".2f") + "x",
        " ".join(f"{t:.1f}" for t in s["first_step_s"]),
    ) for name, s in summary.items()])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--quick", action="store_true", help="3 warm-up + 10 steps, 1 repeat")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.steps, args.repeats = 3, 10, 1
    names = [v.strip() for v in args.variants.split(",")]
    if "eager" not in names or any(v not in VARIANTS for v in names):
        parser.error(f"--variants: a comma-separated subset of {', '.join(VARIANTS)} with eager")
    runs = interleaved(names, args.repeats,
                       lambda v: run_variant(v, args.warmup, args.steps, args.timeout),
                       lambda v, r: f"{v}: {1e3 * r['mean_step_s']:.2f} ms/step, first step "
                                    f"{r['first_step_s']:.1f} s")
    summary = summarize(runs)
    print(f"demo GPT (4 layers, d_model 128, seq {SEQ}), dp={WORLD_SIZE} on CPU, global batch "
          f"{GLOBAL_BATCH}: {args.warmup} warm-up + {args.steps} timed steps, {args.repeats} "
          "repeat(s)")
    print(format_table(summary))
    if args.out:
        write_json(args.out, {"command": " ".join(["python", *sys.argv]), "machine": machine(),
                              "warmup": args.warmup, "steps": args.steps,
                              "repeats": args.repeats, "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
