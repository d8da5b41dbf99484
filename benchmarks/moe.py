"""Expert parallel against data parallel on the same mixture-of-experts GPT: step time, bytes
each rank sends per step, and each rank's model state against the formula.

Both layouts train meshtrain's MoE GPT (GPTConfig.num_experts) on 2 processes (gloo, CPU, one
torch thread per rank), same data, global batch and seed:

* ``dp=2``: every rank holds all E experts; DDP all-reduces every gradient, the experts' too;
* ``ep=2``: each rank holds E / 2 experts; tokens travel to their experts' rank and back by
  all-to-all (meshtrain/parallel/expert/dispatch.py); only the dense gradients are
  all-reduced.

Bytes sent per rank and step: the all-to-all's are counted (each dispatch and combine's tokens
that leave the rank, measured by wrapping ``AllToAllExperts``; the backward sends the same
amounts back, so they count twice); the all-reduce's come from the ring formula,
2 (N - 1) / N x the bytes of the gradients DDP reduces. Memory: each rank's parameters and
AdamW state after the run, against the formula (dense state + 16 bytes x E / ep experts'
elements in fp32). Step time: (end of the last step - end of the last warm-up step) / timed
steps, the slower rank's, repeats interleaved (dp, ep, dp, ...).

    python benchmarks/moe.py             # 3 warm-up + 15 timed steps, 3 repeats
    python benchmarks/moe.py --quick     # smoke run
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import (
    WallClock, add_ratios, end_process_group, fmt, hang_guard, in_ms, interleaved, machine,
    table, write_json,
)
from torch.utils.data import TensorDataset

from meshtrain.launch.spawn import run_workers

LAYOUTS = ("dp=2", "ep=2")
KIB = 2**10


@dataclass(frozen=True)
class Config:
    steps: int = 15
    warmup: int = 3
    global_batch_size: int = 16
    seq_len: int = 64
    d_model: int = 128
    num_layers: int = 2
    num_experts: int = 8
    experts_per_token: int = 2
    expert_hidden_dim: int = 512
    vocab_size: int = 256


def build_model(cfg: Config):
    from meshtrain.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                         num_layers=cfg.num_layers, num_heads=4, d_model=cfg.d_model,
                         bias=False, num_experts=cfg.num_experts,
                         experts_per_token=cfg.experts_per_token,
                         expert_hidden_dim=cfg.expert_hidden_dim))


def build_data(cfg: Config) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    n = cfg.global_batch_size * (cfg.warmup + cfg.steps)
    tokens = torch.randint(0, cfg.vocab_size, (n, cfg.seq_len + 1), generator=gen)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def worker(layout: str, cfg: Config, hang_s: float) -> dict:
    import torch.distributed as dist

    from meshtrain import Trainer
    from meshtrain.callbacks import Callback
    from meshtrain.observe.memory.probe import memory_row
    from meshtrain.parallel.expert import expert_params
    from meshtrain.parallel.expert.dispatch import AllToAllExperts

    sent = {"bytes": 0}
    original = AllToAllExperts.__call__

    def counting(self, tokens, counts):  # the tokens that leave this rank, both ways
        rank = dist.get_rank(self.group)
        local = counts.numel() // self.size
        away = int(counts.sum()) - int(counts.view(self.size, local)[rank].sum())
        sent["bytes"] += 2 * away * tokens.shape[-1] * tokens.element_size()
        return original(self, tokens, counts)

    AllToAllExperts.__call__ = counting

    class Ends(Callback):
        def __init__(self):
            self.ends = []

        def on_train_step_end(self, trainer, metrics):
            self.ends.append(time.perf_counter())

    ends = Ends()
    total = cfg.warmup + cfg.steps
    with hang_guard(hang_s), tempfile.TemporaryDirectory(prefix="meshtrain-moe-") as run_dir:
        trainer = Trainer(layout=layout, accelerator="cpu", max_steps=total,
                          global_batch_size=cfg.global_batch_size, seed=0, callbacks=[ends],
                          loggers=(), progress_bar=False, save_final_checkpoint=False,
                          model_summary=False, report=False, log_every_n_steps=total,
                          run_dir=run_dir)
        model = trainer.fit(lambda: build_model(cfg), build_data(cfg),
                            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), loss_fn=lm_loss)
        row = memory_row(model, trainer.optimizer, trainer.layout)
        held = {id(p) for p in expert_params(model)}
        reduced = sum(p.numel() * p.element_size() for p in model.parameters()
                      if id(p) not in held)
        end_process_group()
    n = trainer.layout.world_size
    return {
        "step_s": (ends.ends[-1] - ends.ends[cfg.warmup - 1]) / cfg.steps,
        # forward's sends (dispatch + combine) and the backward's mirror of them
        "all_to_all_bytes": 2 * sent["bytes"] / total,
        "all_reduce_bytes": 2 * (n - 1) / n * reduced,
        "measured": row.measured.params + row.measured.optimizer,
        "predicted": row.predicted.params + row.predicted.optimizer,
        "expert_elements": sum(p.numel() for name, p in model.named_parameters()
                               if ".experts." in name),  # (this rank's)
    }


def run(layout: str, cfg: Config, timeout: float) -> dict:
    ranks = run_workers(worker, 2, (layout, cfg, timeout - 10), timeout=timeout, threads=1)
    return {"step_s": max(r["step_s"] for r in ranks), "ranks": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "moe.json"))
    args = parser.parse_args()
    cfg = Config(steps=4, warmup=2) if args.quick else Config()
    repeats = 1 if args.quick else args.repeats
    clock = WallClock()
    runs = interleaved(LAYOUTS, repeats, lambda layout: run(layout, cfg, 300),
                       lambda layout, r: f"{layout}: {1e3 * r['step_s']:.1f} ms/step")
    summary = {}
    for layout, reps in runs.items():
        ranks = reps[0]["ranks"]
        summary[layout] = {
            **in_ms([r["step_s"] for r in reps]),
            "all_to_all_kib": max(r["all_to_all_bytes"] for r in ranks) / KIB,
            "all_reduce_kib": max(r["all_reduce_bytes"] for r in ranks) / KIB,
            "state_kib": max(r["measured"] for r in ranks) / KIB,
            "formula_kib": max(r["predicted"] for r in ranks) / KIB,
            "expert_elements": ranks[0]["expert_elements"],
        }
    add_ratios(summary, "dp=2", {"time_vs_dp": "repeats_ms"})
    print(table(("layout", "step ms", "vs dp", "all-to-all KiB", "all-reduce KiB",
                 "state KiB", "formula KiB", "experts' elements"),
                [(name, f"{row['median_ms']:.1f}", fmt(row["time_vs_dp"], ".2f"),
                  f"{row['all_to_all_kib']:.0f}", f"{row['all_reduce_kib']:.0f}",
                  f"{row['state_kib']:.0f}", f"{row['formula_kib']:.0f}",
                  f"{row['expert_elements']:,}") for name, row in summary.items()]))
    print(clock.stop())
    path = write_json(args.out, {"config": asdict(cfg), "summary": summary,
                                 "machine": machine(**clock.loads()),
                                 "command": "python benchmarks/moe.py"
                                            + (" --quick" if args.quick else "")})
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
