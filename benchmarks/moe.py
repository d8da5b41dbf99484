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

``--device cuda`` (or ``auto``: cuda when there is one): throughput on one device at GPU size,
not the CPU parts above. Four rows, each trained ``--warmup`` + ``--steps`` steps on random
tokens (micro-batch 8 x 2048 tokens; 4 + 20 steps), bf16-mixed (float32 weights and AdamW
state, bf16 autocast), fused AdamW on CUDA, one after another in this process, in this order:

* ``moe``: meshtrain's MoE GPT (d_model 1536, 8 layers, 12 heads, 8 experts of width 3072,
  top-2, vocabulary 32000) through ``Trainer.fit``, compile per block (``--eager``: none);
* ``hf``: a Qwen3-MoE of the same shape (hidden 1536, 8 layers, 12 heads of 128, 8 experts,
  top-2, ``moe_intermediate_size`` 2048: its three SwiGLU matrices make the MoE GPT's two of
  3072; transformers' ``grouped_mm`` experts) trained by plain transformers, as its own Trainer
  would with bf16=True: float32 weights under bf16 autocast, eager, fused AdamW, forward,
  backward, step, zero_grad, the loss read, on batches already on the device;
* ``dense``: the MoE GPT with a dense MLP of width 6144 (= 2 x 3072: equal active FLOPs);
* ``hf_meshtrain``: the ``hf`` row's Qwen3-MoE through ``Trainer.fit`` (compile per block).

(transformers 5.x casts its experts' input to the weights' dtype, torch's grouped GEMM having no
autocast: with float32 weights both Qwen3-MoE rows run their experts in float32, and inside a
compiled graph, where it takes the grouped GEMM for bfloat16 weights only, through its own
fallback operator. The JSON records the model's ``experts_implementation``.)

Each row: tokens/s (tokens a step / mean step time after the warm-up, the device synchronised
at each step's end), model FLOPs per token counting the k of E experts a token runs (active
parameters: ``GPT.flops_per_token``; the Qwen3-MoE: 6 x ``active_flop_params`` + 12 L H T, the
same convention), MFU against the device's bf16 dense peak (benchmarks/mfu.py's table;
``--peak-tflops`` overrides; none on a CPU), peak memory, the first step's time (compilation).
Ratios: each row's tokens/s against ``hf`` (the issue's goal: >= 4x), and ``moe`` against
``dense``. A row that fails is recorded with its error and the next one runs; the JSON is
written after every row (a run cut short keeps the rows done).

    python benchmarks/moe.py --device cuda --out benchmarks/results/moe_gpu_h100.json
    python benchmarks/moe.py --device cpu --tiny --eager   # CPU smoke run of this path
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
    parser.add_argument("--part", choices=("ep", "dense", "hf"), default=None,
                        help="the CPU parts (default ep)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--compile", action="store_true", help="--part dense, compile=True")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None,
                        help="default: results/moe.json (ep), moe_dense.json, moe_hf.json, "
                             "moe_<device>.json (--device)")
    device = parser.add_argument_group("one device at GPU size (--device)")
    device.add_argument("--device", choices=("auto", "cuda", "cpu"), default=None,
                        help="tokens/s and MFU of the MoE GPT, the dense GPT, plain transformers' "
                             "Qwen3-MoE and meshtrain's, on this device")
    device.add_argument("--tiny", action="store_true", help="--device: tiny sizes (smoke run)")
    device.add_argument("--eager", action="store_true", help="--device: no compile")
    device.add_argument("--rows", default=",".join(DEVICE_ROWS),
                        help=f"--device: which rows, in order (default {','.join(DEVICE_ROWS)})")
    device.add_argument("--steps", type=int, default=None, help="--device: timed steps")
    device.add_argument("--warmup", type=int, default=None, help="--device: warm-up steps")
    device.add_argument("--micro-batch", type=int, default=None, help="--device: sequences a step")
    device.add_argument("--peak-tflops", type=float, default=None,
                        help="--device: the device's bf16 peak, overriding mfu.py's table")
    args = parser.parse_args()
    if args.device is not None:
        if args.part or args.quick or args.compile:
            parser.error("--device runs its own rows: no --part, --quick or --compile with it")
        rows = [r for r in args.rows.split(",") if r]
        if not rows or set(rows) - set(DEVICE_ROWS):
            parser.error(f"--rows: some of {','.join(DEVICE_ROWS)}, got {args.rows!r}")
        args.rows = rows
        return main_device(args)
    if args.tiny or args.eager or args.steps or args.warmup or args.micro_batch:
        parser.error("--tiny, --eager, --steps, --warmup, --micro-batch go with --device")
    args.part = args.part or "ep"
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


# ---- one device at GPU size (--device): tokens/s and MFU on active parameters ----------------
DEVICE_ROWS = ("moe", "hf", "dense", "hf_meshtrain")  # (the ratio the issue asks first)
ROW_NAMES = {"moe": "meshtrain MoE GPT", "dense": "meshtrain dense GPT (equal active FLOPs)",
             "hf": "transformers Qwen3-MoE (eager)", "hf_meshtrain": "meshtrain Trainer, Qwen3-MoE"}
GIB = 2**30


@dataclass(frozen=True)
class DeviceConfig:
    d_model: int = 1536
    num_layers: int = 8
    num_heads: int = 12
    num_experts: int = 8
    experts_per_token: int = 2
    expert_hidden_dim: int = 3072  # dense GPT: 2 x 3072 = 6144 = 4 x d_model
    vocab_size: int = 32000
    seq_len: int = 2048
    micro_batch: int = 8
    warmup: int = 4
    steps: int = 20
    compile: bool = True

    @property
    def dense_mlp_ratio(self) -> int:  # the dense GPT's MLP: k experts' width
        return self.experts_per_token * self.expert_hidden_dim // self.d_model

    @property
    def hf_intermediate(self) -> int:
        """The Qwen3-MoE expert width whose 3 SwiGLU matrices hold the GPT expert's 2: 2/3 of
        it, to a multiple of 32 (grouped GEMM rows of a multiple of 16 bytes)."""
        return max(32, round(2 * self.expert_hidden_dim / 3 / 32) * 32)


DEVICE_TINY = DeviceConfig(d_model=64, num_layers=2, num_heads=4, num_experts=4,
                           expert_hidden_dim=96, vocab_size=256, seq_len=32, micro_batch=2,
                           warmup=2, steps=3)


def device_gpt_config(cfg: DeviceConfig, moe: bool):
    from meshtrain.models.gpt import GPTConfig

    sizes = dict(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, num_layers=cfg.num_layers,
                 num_heads=cfg.num_heads, d_model=cfg.d_model, bias=False)
    if not moe:
        return GPTConfig(**sizes, mlp_ratio=cfg.dense_mlp_ratio)
    return GPTConfig(**sizes, num_experts=cfg.num_experts,
                     experts_per_token=cfg.experts_per_token,
                     expert_hidden_dim=cfg.expert_hidden_dim)


def qwen3_moe_config(cfg: DeviceConfig) -> dict:
    """The Qwen3-MoE of the MoE GPT's shape (multi-head attention like the GPT's)."""
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_heads, head_dim=cfg.d_model // cfg.num_heads,
                max_position_embeddings=cfg.seq_len, moe_intermediate_size=cfg.hf_intermediate,
                intermediate_size=cfg.dense_mlp_ratio * cfg.d_model, num_experts=cfg.num_experts,
                num_experts_per_tok=cfg.experts_per_token, tie_word_embeddings=False,
                attention_dropout=0.0, experts_implementation="grouped_mm")


def build_qwen3_moe(cfg: DeviceConfig):
    from meshtrain.models.hf import tiny_causal_lm

    return tiny_causal_lm("Qwen3Moe", **qwen3_moe_config(cfg))


def row_flops(row: str, cfg: DeviceConfig) -> dict:
    """Parameters (all, active: k of E experts) and model FLOPs per token of a row's model,
    counted on a meta-device copy."""
    from meshtrain.models.gpt import GPT
    from meshtrain.observe.flops import active_flop_params, count_flop_params

    with torch.device("meta"):
        if row in ("moe", "dense"):
            model = GPT(device_gpt_config(cfg, row == "moe"))
        else:
            import transformers

            config = transformers.Qwen3MoeConfig(use_cache=False, **qwen3_moe_config(cfg))
            model = transformers.Qwen3MoeForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    if row in ("moe", "dense"):
        flops = model.flops_per_token(cfg.seq_len)
    else:  # 6 x active matmul parameters + attention's 12 L H T (H: heads x head dim)
        c = model.config
        flops = 6.0 * active_flop_params(model) + \
            12.0 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * cfg.seq_len
    return {"params": total, "matmul_params": count_flop_params(model),
            "active_matmul_params": active_flop_params(model), "flops_per_token": flops}


def device_data(row: str, cfg: DeviceConfig):
    from meshtrain.models.hf import random_token_data

    samples = cfg.micro_batch * (cfg.warmup + cfg.steps)
    if row in ("hf", "hf_meshtrain"):
        return random_token_data(samples, cfg.seq_len, cfg.vocab_size)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (samples, cfg.seq_len + 1), generator=gen)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def trainer_row(row: str, cfg: DeviceConfig, device: str) -> dict:
    """``Trainer.fit`` of the row's model on ``device``: its step times and first-step time."""
    from meshtrain import Callback, Trainer
    from meshtrain.optim import AdamW
    from overhead import StepClock

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock, marks = StepClock(cfg.warmup, cfg.steps), {}

    class Clock(Callback):
        def on_train_step_start(self, trainer) -> None:
            if "first_start" not in marks:
                sync()
                marks["first_start"] = time.perf_counter()

        def on_train_step_end(self, trainer, metrics: dict) -> None:
            sync()  # the step's kernels have run
            clock.step_end()

    if row == "hf_meshtrain":
        build, loss_fn = (lambda: build_qwen3_moe(cfg)), None
    else:
        from meshtrain.models.gpt import GPT

        config = device_gpt_config(cfg, row == "moe")
        build, loss_fn = (lambda: GPT(config)), lm_loss
    total = cfg.warmup + cfg.steps
    with tempfile.TemporaryDirectory(prefix="meshtrain-moe-") as run_dir:
        # (logging every warm-up's steps: the first log, where a Hugging Face model's FLOPs are
        # counted once on a meta copy, ends the warm-up, outside the timed steps)
        trainer = Trainer(accelerator=device, devices=1, precision="bf16-mixed",
                          micro_batch_size=cfg.micro_batch, global_batch_size=cfg.micro_batch,
                          max_steps=total, compile=cfg.compile, seed=0, shuffle=False,
                          callbacks=[Clock()], loggers=(), progress_bar=False,
                          save_final_checkpoint=False, model_summary=False, report=False,
                          log_every_n_steps=cfg.warmup, run_dir=run_dir, resume=None)
        started = time.perf_counter()
        model = trainer.fit(build, device_data(row, cfg), loss_fn=loss_fn,
                            optimizer=AdamW(lr=3e-4, weight_decay=0.1,
                                            **({"fused": True} if cuda else {})))
        sync()
        loss = trainer.callback_metrics.get("train/loss")
        del model, trainer
    timing = clock.result(row)
    return {"setup_s": marks["first_start"] - started,
            "first_step_s": clock.ends[0] - marks["first_start"],
            "step_s": timing["mean_step_s"], "median_step_s": timing["median_step_s"],
            "train_loss": None if loss is None else float(loss)}


def plain_hf_row(cfg: DeviceConfig, device: str) -> dict:
    """Plain transformers' step on the Qwen3-MoE: float32 weights, bf16 autocast, eager, fused
    AdamW (what transformers' Trainer runs with bf16=True), batches on the device."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    started = time.perf_counter()
    model = build_qwen3_moe(cfg).to(device)
    model.train()
    implementation = getattr(model.config, "_experts_implementation", None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                  **({"fused": True} if cuda else {}))
    data, b = device_data("hf", cfg), cfg.micro_batch
    batches = [{k: torch.stack([data[i][k] for i in range(s * b, (s + 1) * b)]).to(device)
                for k in ("input_ids", "labels")} for s in range(cfg.warmup + cfg.steps)]
    sync()
    first = time.perf_counter()
    ends, losses = [], []
    for batch in batches:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())  # (the loss read each step, as a loop that logs it does)
        sync()
        ends.append(time.perf_counter())
    del model, optimizer, batches
    window = ends[cfg.warmup - 1:]
    deltas = [b - a for a, b in zip(window, window[1:])]
    return {"setup_s": first - started, "first_step_s": ends[0] - first,
            "step_s": (window[-1] - window[0]) / cfg.steps,
            "median_step_s": sorted(deltas)[len(deltas) // 2],
            "train_loss": sum(losses) / len(losses), "experts_implementation": implementation}


def device_row(row: str, cfg: DeviceConfig, device: str, peak: float | None) -> dict:
    import gc
    import traceback

    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()  # (each row compiles its own graphs: its first step shows it)
    result = {"name": ROW_NAMES[row]}
    try:
        result.update(row_flops(row, cfg))
        result.update(plain_hf_row(cfg, device) if row == "hf" else
                      trainer_row(row, cfg, device))
    except Exception as error:  # (recorded; the next row runs)
        traceback.print_exc()
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
    gc.collect()
    if cuda:
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        torch.cuda.empty_cache()
    if "step_s" in result:
        tokens = cfg.micro_batch * cfg.seq_len
        result["tokens_per_step"] = tokens
        result["tokens_per_s"] = tokens / result["step_s"]
        achieved = result["tokens_per_s"] * result["flops_per_token"]
        result["achieved_tflops"] = achieved / 1e12
        result["mfu"] = achieved / peak if peak else None
    return result


def device_ratios(rows: dict) -> dict:
    def ratio(a: str, b: str, key: str = "tokens_per_s"):
        if rows.get(a, {}).get(key) and rows.get(b, {}).get(key):
            return rows[a][key] / rows[b][key]
        return None

    return {"moe_vs_hf_tokens": ratio("moe", "hf"),
            "hf_meshtrain_vs_hf_tokens": ratio("hf_meshtrain", "hf"),
            "hf_meshtrain_vs_hf_mfu": ratio("hf_meshtrain", "hf", "mfu"),
            "moe_vs_hf_mfu": ratio("moe", "hf", "mfu"),
            "moe_vs_dense_tokens": ratio("moe", "dense")}


def device_table(rows: dict) -> str:
    hf = rows.get("hf", {}).get("tokens_per_s")

    def line(row: str, r: dict):
        if "error" in r:
            return (ROW_NAMES[row], "failed", "", "", "", "", "", "", r["error"][:60])
        pct = None if r["mfu"] is None else 100 * r["mfu"]
        return (ROW_NAMES[row], f"{1e3 * r['step_s']:.1f}", f"{r['tokens_per_s']:,.0f}",
                f"{r['flops_per_token'] / 1e9:.2f}", f"{r['achieved_tflops']:.3g}",
                fmt(pct, ".1f"), fmt(r.get("peak_allocated_gib"), ".1f"),
                f"{r['first_step_s']:.1f}", fmt(hf and r["tokens_per_s"] / hf, ".2f"))

    return table(("row", "step ms", "tokens/s", "GFLOP/token", "TFLOP/s", "MFU %",
                  "peak GiB", "1st step s", "vs transformers"),
                 [line(row, r) for row, r in rows.items()])


def main_device(args) -> None:
    import logging
    import shlex
    import sys

    from mfu import peak_flops

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = DEVICE_TINY if args.tiny else DeviceConfig()
    cfg = replace(cfg, compile=not args.eager, **{k: getattr(args, k) for k in
                                                  ("steps", "warmup", "micro_batch")
                                                  if getattr(args, k)})
    if cfg.experts_per_token * cfg.expert_hidden_dim % cfg.d_model:
        raise SystemExit("the dense GPT's MLP (k x expert width) must be a multiple of d_model")
    cuda = device == "cuda"
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (peak_flops(name) if cuda else None)
    args.out = args.out or str(Path(__file__).parent / "results" / f"moe_{device}.json")
    logging.getLogger("meshtrain").setLevel(logging.WARNING)  # (each fit's lines)
    print(f"moe --device {device} ({name}): {asdict(cfg)}; rows {', '.join(args.rows)}; peak "
          f"{fmt(peak and peak / 1e12, '.1f')} TFLOP/s; torch {torch.__version__}", flush=True)
    clock, rows = WallClock(), {}
    info = {"gpu": name, "cuda": torch.version.cuda} if cuda else {}
    for row in args.rows:
        start = time.perf_counter()
        rows[row] = device_row(row, cfg, device, peak)
        r = rows[row]
        print(f"{ROW_NAMES[row]}: " + (f"failed: {r['error']}" if "error" in r else
              f"{1e3 * r['step_s']:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, MFU "
              f"{fmt(r['mfu'] and 100 * r['mfu'], '.1f')} %")
              + f" ({time.perf_counter() - start:.0f} s)", flush=True)
        write_json(args.out, {"command": shlex.join(["python", *sys.argv]), "device": name,
                              "config": asdict(cfg), "qwen3_moe": qwen3_moe_config(cfg),
                              "peak_tflops": peak and peak / 1e12, "rows": rows,
                              "ratios": device_ratios(rows), "machine": machine(**info)},
                   indent=2)
    print()
    print(device_table(rows))
    print({k: None if v is None else round(v, 3) for k, v in device_ratios(rows).items()})
    print(clock.stop())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
