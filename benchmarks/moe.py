"""meshtrain's mixture-of-experts GPT: expert parallel against data parallel (``--part ep``), its
training step against a dense GPT of equal active FLOPs (``--part dense``), and a Hugging Face
MoE's step under meshtrain against plain transformers' (``--part hf``).

``--part ep`` (the default): expert parallel against data parallel on the same MoE GPT: step
time, bytes each rank sends per step, and each rank's model state against the formula.

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

``--part dense`` (one process, one thread): the MoE GPT (8 experts of width 256, top-2)
against the same GPT with a dense MLP of width 512 (= 2 x 256: the same FLOPs a token, the
router's d x E aside), and the MoE GPT with its experts as the per-expert loop they replaced
(``tokens.split(counts.tolist())``, one matmul pair each). ``--part hf`` (one process, one
thread): a tiny Qwen3-MoE (transformers' default ``grouped_mm`` experts), plain transformers'
step (forward, backward, AdamW, zero_grad, the loss read, on a ready batch) against
``Trainer.fit``'s step on the same micro-batch (its data loading and logging included). Step
time as above, one process; runs interleaved.

    python benchmarks/moe.py             # 3 warm-up + 15 timed steps, 3 repeats
    python benchmarks/moe.py --part dense --repeats 5
    python benchmarks/moe.py --part dense --compile --repeats 5   # compile=True (2 rows)
    python benchmarks/moe.py --part hf --repeats 5
    python benchmarks/moe.py --quick     # smoke run (any part)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace
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
    dense_hidden_dim: int = 512  # (--part dense: mlp_ratio 4; the experts 2 x 256)


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
    parser.add_argument("--part", choices=("ep", "dense", "hf"), default="ep")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--compile", action="store_true", help="--part dense, compile=True")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None,
                        help="default: results/moe.json (ep), moe_dense.json, moe_hf.json")
    args = parser.parse_args()
    if args.compile and args.part != "dense":
        parser.error("--compile goes with --part dense")
    name = "moe" if args.part == "ep" else f"moe_{args.part}" + "_compiled" * args.compile
    args.out = args.out or str(Path(__file__).parent / "results" / f"{name}.json")
    command = "python benchmarks/moe.py" + ("" if args.part == "ep" else f" --part {args.part}") \
        + " --compile" * args.compile + (" --quick" if args.quick else f" --repeats {args.repeats}")
    (main_ep if args.part == "ep" else main_one_process)(args, command)


def main_ep(args, command: str) -> None:
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
                                 "machine": machine(**clock.loads()), "command": command})
    print(f"wrote {path}")


# ---- one process: the MoE step against a dense one, and against plain transformers ---------------
DENSE_ROWS = ("dense MLP", "MoE, grouped GEMM", "MoE, per-expert loop")
HF_ROWS = ("plain transformers", "meshtrain Trainer")
HF_QWEN3_MOE = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                    moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2)


def trainer_step_s(build, data, cfg: Config, loss_fn, compile: bool = False) -> float:
    """Seconds a step of ``Trainer.fit`` in this process, over the steps after ``cfg.warmup``
    (logging every ``warmup`` steps: the first log, which counts a Hugging Face model's FLOPs
    once, falls in the warm-up; the later ones are in the steps timed)."""
    from meshtrain import Trainer
    from meshtrain.callbacks import Callback

    class Ends(Callback):
        def __init__(self):
            self.ends = []

        def on_train_step_end(self, trainer, metrics):
            self.ends.append(time.perf_counter())

    ends, total = Ends(), cfg.warmup + cfg.steps
    with tempfile.TemporaryDirectory(prefix="meshtrain-moe-") as run_dir:
        trainer = Trainer(accelerator="cpu", max_steps=total, global_batch_size=cfg.global_batch_size,
                          seed=0, callbacks=[ends], loggers=(), progress_bar=False,
                          save_final_checkpoint=False, model_summary=False, report=False,
                          log_every_n_steps=cfg.warmup, run_dir=run_dir, shuffle=False,
                          compile=compile)
        trainer.fit(build, data, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                    loss_fn=loss_fn)
    return (ends.ends[-1] - ends.ends[cfg.warmup - 1]) / cfg.steps


def dense_row(row: str, cfg: Config, compile: bool = False) -> float:
    import unittest.mock

    from meshtrain.moe import grouped

    def looped(tokens, w_in, w_out, counts, activation):  # (what GroupedExperts ran before)
        return grouped.looped_experts(tokens, w_in, w_out, counts.tolist(), activation)

    def build():
        if row == "dense MLP":
            from meshtrain.models.gpt import GPT, GPTConfig

            return GPT(GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                                 num_layers=cfg.num_layers, num_heads=4, d_model=cfg.d_model,
                                 bias=False, mlp_ratio=cfg.dense_hidden_dim // cfg.d_model))
        return build_model(cfg)

    patch = unittest.mock.patch.object(grouped, "grouped_experts", looped) \
        if row == "MoE, per-expert loop" else contextlib.nullcontext()
    with patch:
        return trainer_step_s(build, build_data(cfg), cfg, lm_loss, compile)


def hf_row(row: str, cfg: Config) -> float:
    from meshtrain.models.hf import random_token_data, tiny_causal_lm

    samples = cfg.global_batch_size * (cfg.warmup + cfg.steps)
    data = random_token_data(samples, cfg.seq_len, HF_QWEN3_MOE["vocab_size"])

    def build():
        return tiny_causal_lm("Qwen3Moe", **HF_QWEN3_MOE)

    if row == "meshtrain Trainer":
        return trainer_step_s(build, data, cfg, None)
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b = cfg.global_batch_size
    batches = [{k: torch.stack([data[i][k] for i in range(s * b, (s + 1) * b)])
                for k in ("input_ids", "labels")} for s in range(cfg.warmup + cfg.steps)]
    for s, batch in enumerate(batches):
        if s == cfg.warmup:
            start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss.item()  # (the loss read each step, as a loop that logs it does)
    return (time.perf_counter() - start) / cfg.steps


def main_one_process(args, command: str) -> None:
    import logging

    torch.set_num_threads(1)
    logging.getLogger("meshtrain").setLevel(logging.WARNING)  # (each fit's lines)
    cfg = Config(steps=4, warmup=2) if args.quick else Config()
    cfg = replace(cfg, expert_hidden_dim=cfg.dense_hidden_dim // cfg.experts_per_token)
    repeats = 1 if args.quick else args.repeats
    rows, measure = (DENSE_ROWS, dense_row) if args.part == "dense" else (HF_ROWS, hf_row)
    if args.compile:  # (each block compiled; the loop's per-expert slices are not compiled)
        rows = rows[:2]
        measure = functools.partial(dense_row, compile=True)
    clock = WallClock()
    runs = interleaved(rows, repeats, lambda row: {"step_s": measure(row, cfg)},
                       lambda row, r: f"{row}: {1e3 * r['step_s']:.1f} ms/step")
    summary = {row: in_ms([r["step_s"] for r in reps]) for row, reps in runs.items()}
    add_ratios(summary, rows[0], {"ratio": "repeats_ms"})
    print(table(("step", "median ms", "min ms", "max ms", f"vs {rows[0]}"),
                [(name, f"{row['median_ms']:.1f}", f"{min(row['repeats_ms']):.1f}",
                  f"{max(row['repeats_ms']):.1f}", fmt(row["ratio"], ".2f"))
                 for name, row in summary.items()]))
    print(clock.stop())
    config = asdict(cfg) if args.part == "dense" else {**HF_QWEN3_MOE, "seq_len": cfg.seq_len,
                                                        "global_batch_size": cfg.global_batch_size}
    path = write_json(args.out, {"config": config, "summary": summary, "threads": 1,
                                 "machine": machine(**clock.loads()), "command": command})
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
