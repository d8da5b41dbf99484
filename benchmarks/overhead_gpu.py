"""Framework overhead on one GPU: meshtrain's Trainer against a hand-written training loop.

Both variants train the same GPT (meshtrain.models.gpt: 8 layers, d_model 512, 8 heads,
512-token sequences, vocabulary 8192) on the same random tokens with AdamW (fused on CUDA), batch
16, fp32 with TF32 matmuls allowed, in one process on one device:

* ``raw``: model.to(device), a shuffling ``DataLoader`` (pinned memory), per batch a
  non-blocking copy to the device, forward, cross-entropy, backward, step, zero_grad;
* ``meshtrain``: ``Trainer(accelerator=..., devices=1)`` fit on the same model and data, with
  loggers, progress bar and final checkpoint off (its per-step NaN/Inf check on; ``--nan-policy
  none`` leaves it out).

Each run is a fresh process; the device is synchronised at the end of the last warm-up step and
of the last timed step only, so the step time is (that interval) / timed steps and includes all
a framework does between steps. Repeats are interleaved (raw, meshtrain, raw, ...); the table
gives each variant's median step time, its ratio to raw and the median per-repeat ratio.

    python benchmarks/overhead_gpu.py --out benchmarks/results/overhead_gpu_h100.json
    python benchmarks/overhead_gpu.py --tiny --device cpu     # smoke run without a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from harness import add_ratios, fmt, interleaved, machine, spread, table, write_json

from meshtrain.launch.spawn import run_workers


@dataclass(frozen=True)
class Config:
    device: str = "cuda"
    layers: int = 8
    d_model: int = 512
    heads: int = 8
    seq_len: int = 512
    vocab: int = 8192
    batch: int = 16
    warmup: int = 20
    steps: int = 200
    nan_policy: str = "error"
    breakdown: str = "1"  # breakdown_every_n_steps ("none": off)


def build_model(cfg: Config):
    from meshtrain.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=cfg.vocab, seq_len=cfg.seq_len, num_layers=cfg.layers,
                         num_heads=cfg.heads, d_model=cfg.d_model), seed=0)


def build_data(cfg: Config):
    n = cfg.batch * (cfg.warmup + cfg.steps)
    tokens = torch.randint(0, cfg.vocab, (n, cfg.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_optimizer(params, device: str):
    return torch.optim.AdamW(params, lr=3e-4, fused=device == "cuda")


class Window:
    """Synchronise and stamp the time at the end of the warm-up and of the last step."""

    def __init__(self, cfg: Config):
        self.cfg, self.step, self.marks = cfg, 0, []

    def step_end(self) -> None:
        self.step += 1
        if self.step in (self.cfg.warmup, self.cfg.warmup + self.cfg.steps):
            if self.cfg.device == "cuda":
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())

    def step_s(self) -> float:
        assert len(self.marks) == 2, f"saw {self.step} steps"
        return (self.marks[1] - self.marks[0]) / self.cfg.steps


def raw(cfg: Config) -> float:
    torch.manual_seed(0)
    model = build_model(cfg).to(cfg.device)
    optimizer = make_optimizer(model.parameters(), cfg.device)
    loader = torch.utils.data.DataLoader(build_data(cfg), batch_size=cfg.batch, shuffle=True,
                                         drop_last=True, pin_memory=cfg.device == "cuda")
    window = Window(cfg)
    for inputs, targets in loader:
        inputs = inputs.to(cfg.device, non_blocking=True)
        targets = targets.to(cfg.device, non_blocking=True)
        lm_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        window.step_end()
    return window.step_s()


def meshtrain(cfg: Config) -> float:
    from meshtrain import Callback, Trainer

    window = Window(cfg)

    class Clock(Callback):
        def on_train_step_end(self, trainer, metrics) -> None:
            window.step_end()

    with tempfile.TemporaryDirectory() as run_dir, contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(accelerator=cfg.device, devices=1, max_steps=cfg.warmup + cfg.steps,
                          global_batch_size=cfg.batch, seed=0, callbacks=[Clock()], loggers=(),
                          progress_bar=False, save_final_checkpoint=False, run_dir=run_dir,
                          resume=None, log_every_n_steps=50,
                          nan_policy=None if cfg.nan_policy == "none" else cfg.nan_policy,
                          breakdown_every_n_steps=None if cfg.breakdown == "none"
                          else int(cfg.breakdown))
        trainer.fit(lambda: build_model(cfg), build_data(cfg),
                    optimizer=lambda params: make_optimizer(params, cfg.device), loss_fn=lm_loss)
    return window.step_s()


def worker(variant: str, cfg: Config) -> dict:
    if cfg.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    return {"step_s": (raw if variant == "raw" else meshtrain)(cfg)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--nan-policy", choices=("error", "none"), default="error")
    parser.add_argument("--breakdown-every", default="1",
                        help="the Trainer's breakdown_every_n_steps (none: off)")
    parser.add_argument("--tiny", action="store_true", help="2 small layers, 3 + 10 steps")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device is visible; use --device cpu (with --tiny for a smoke run)")
    cfg = Config(device=args.device, steps=args.steps, warmup=args.warmup,
                 nan_policy=args.nan_policy, breakdown=args.breakdown_every)
    if args.tiny:
        cfg = Config(device=args.device, layers=2, d_model=64, heads=4, seq_len=64, vocab=256,
                     batch=8, warmup=3, steps=10, nan_policy=args.nan_policy,
                     breakdown=args.breakdown_every)
        args.repeats = 1
    runs = interleaved(["raw", "meshtrain"], args.repeats,
                       lambda v: run_workers(worker, 1, (v, cfg), timeout=900)[0],
                       lambda v, r: f"{v}: {1e3 * r['step_s']:.2f} ms/step")
    summary = {v: {**spread([r["step_s"] for r in reps], scale=1e3, suffix="_ms"),
                   "repeats_ms": [1e3 * r["step_s"] for r in reps]} for v, reps in runs.items()}
    add_ratios(summary, "raw", {"ratio_vs_raw": "median_ms", "paired_ratio_median": "repeats_ms"})
    device = torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu"
    print(f"{device}: GPT {cfg.layers}x{cfg.d_model}, seq {cfg.seq_len}, batch {cfg.batch}; "
          f"{cfg.warmup} warm-up + {cfg.steps} timed steps, {args.repeats} repeat(s)")
    print(table(("variant", "median ms/step", "min", "max", "x raw", "paired"), [(
        name, fmt(s["median_ms"], ".3f"), fmt(s["min_ms"], ".3f"), fmt(s["max_ms"], ".3f"),
        fmt(s["ratio_vs_raw"], ".4f"), fmt(s["paired_ratio_median"], ".4f"))
        for name, s in summary.items()]))
    if args.out:
        write_json(args.out, {"command": " ".join(["python", *sys.argv]),
                              "machine": machine(device=device), "config": asdict(cfg),
                              "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
