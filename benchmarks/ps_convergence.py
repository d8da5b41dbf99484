"""How far asynchronous parameter servers and local SGD land from synchronous training on the
demo job (examples/char_gpt.toml: a 4-layer char GPT, 0.8M parameters, AdamW with warm-up and
cosine decay, 400 steps of 32 sequences of 128 characters, W = 2 workers).

Every variant runs ``meshtrain train examples/char_gpt.toml`` with the same data, model and
schedule; only the layout and its settings change (gradient clipping is off everywhere, since
parameter servers cannot clip by the global norm). Reported: the validation loss at steps 100,
200, 300, 400 (10 batches each, as the demo) and its gap to synchronous dp=2.

    python benchmarks/ps_convergence.py            # all variants (~35 min on 2 cores)
    python benchmarks/ps_convergence.py --steps 100 --only dp async   # a subset, shorter
    python benchmarks/ps_convergence.py --from-json benchmarks/results/ps_convergence.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, table, write_json  # noqa: E402

# name: (label, overrides[, step multiplier: the run takes that many times the steps, and its
# validation at step k * multiplier is reported under step k])
VARIANTS = {
    "dp": ("dp=2 (all-reduce every step)", ["--trainer.layout=dp=2"]),
    "async": ("ps=1,dp=2 async, staleness 1", ["--trainer.layout=ps=1,dp=2",
                                                "--trainer.devices=3", "--parallel.ps_mode=async",
                                                "--parallel.ps_staleness=1"]),
    "async_half_lr": ("  same, half the learning rate", ["--trainer.layout=ps=1,dp=2",
                                                         "--trainer.devices=3",
                                                         "--parallel.ps_mode=async",
                                                         "--parallel.ps_staleness=1",
                                                         "--optimizer.lr=1.5e-3"]),
    # what async changes, one thing at a time (see docs/parameter_server.md)
    "async_s0": ("ps=1,dp=2 async, staleness 0", ["--trainer.layout=ps=1,dp=2",
                                                   "--trainer.devices=3",
                                                   "--parallel.ps_mode=async",
                                                   "--parallel.ps_staleness=0"]),
    "async_s0_half_lr": ("  same, half the learning rate", ["--trainer.layout=ps=1,dp=2",
                                                            "--trainer.devices=3",
                                                            "--parallel.ps_mode=async",
                                                            "--parallel.ps_staleness=0",
                                                            "--optimizer.lr=1.5e-3"]),
    "half_batches": ("one process, batch 16, twice the steps", [
        "--trainer.layout=dp=1", "--trainer.devices=1", "--trainer.global_batch_size=16"], 2),
    "dp_double_lr": ("dp=2, twice the learning rate", ["--trainer.layout=dp=2",
                                                        "--optimizer.lr=6e-3"]),
    "local4": ("local SGD H=4, average", ["--trainer.layout=dp=2", "--parallel.local_sgd_every=4"]),
    "local16": ("local SGD H=16, average", ["--trainer.layout=dp=2",
                                            "--parallel.local_sgd_every=16"]),
    "diloco4": ("local SGD H=4, DiLoCo outer 0.7/0.9", ["--trainer.layout=dp=2",
                                                        "--parallel.local_sgd_every=4",
                                                        "--parallel.outer_lr=0.7"]),
    "diloco16": ("local SGD H=16, DiLoCo outer 0.7/0.9", ["--trainer.layout=dp=2",
                                                          "--parallel.local_sgd_every=16",
                                                          "--parallel.outer_lr=0.7"]),
}


def _multiplier(name: str) -> int:
    return VARIANTS[name][2] if len(VARIANTS[name]) > 2 else 1


def run(name: str, steps: int) -> dict:
    steps *= _multiplier(name)
    with tempfile.TemporaryDirectory() as run_dir:
        argv = [sys.executable, "-m", "meshtrain", "train", "examples/char_gpt.toml",
                *VARIANTS[name][1], "--trainer.grad_clip_norm=none",
                f"--trainer.max_steps={steps}", f"--trainer.val_every_n_steps={steps // 4}",
                f"--logging.run_dir={run_dir}", "--checkpoint.checkpoint_every_n_steps=none",
                "--checkpoint.keep_last_k=none",
                "--checkpoint.save_final_checkpoint=false", "--checkpoint.resume=none",
                "--logging.progress_bar=false", "--sample.num_chars=1"]
        start = time.perf_counter()
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        seconds = time.perf_counter() - start
        if out.returncode:
            raise SystemExit(f"{name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        val = {}
        with open(Path(run_dir) / "metrics.csv") as f:
            for row in csv.DictReader(f):
                if row.get("val/loss"):
                    val[int(row["step"])] = float(row["val/loss"])
    return {"val_loss": val, "seconds": seconds}


def report(result: dict) -> str:
    runs = {name: {int(k) // _multiplier(name): v for k, v in r["val_loss"].items()}
            for name, r in result["runs"].items()}
    base = runs["dp"]
    steps = sorted(base)
    end = steps[-1]
    header = ["variant", *[f"val@{s}" for s in steps], "gap at end", "seconds"]
    rows = []
    for name, val in runs.items():
        gap = val[end] - base[end]
        seconds = result["runs"][name]["seconds"]
        rows.append([VARIANTS[name][0], *[f"{val[s]:.4f}" for s in steps],
                     f"{gap:+.4f} ({100 * gap / base[end]:+.1f} %)",
                     "-" if seconds is None else f"{seconds:.0f}"])
    return table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--from-json")
    args = parser.parse_args()
    if args.from_json:
        print(report(json.loads(Path(args.from_json).read_text())))
        return
    names = ["dp"] + [n for n in args.only if n != "dp"]
    result = {"machine": machine(), "steps": args.steps, "runs": {}}
    for name in names:
        result["runs"][name] = run(name, args.steps)
        print(f"{name}: {result['runs'][name]}", flush=True)
    print(report(result))
    if args.steps == 400 and set(names) == set(VARIANTS):
        write_json(ROOT / args.out_dir / "ps_convergence.json", result)


if __name__ == "__main__":
    main()
