"""Look for layouts that pass the checks before start but fail inside training.

Each row: a tiny model (meshtrain's GPT with a feature, or a Hugging Face family) under one
layout and settings; ``Trainer.check`` first (what ``--dry-run`` does), then 3 steps on real
processes (``run_workers``). A row that ends ``fit`` failed after its checks passed: a bug (it
should train, or be refused before start). ``check`` rows are refusals: read that they say why
and how to fix it. No parity is judged here (the suite does that); this finds crashes.

    python tools/hunt_layouts.py gpt dense moe doc dropout     # meshtrain's GPT
    python tools/hunt_layouts.py hf llama qwen2-tied qwen3-moe  # Hugging Face families
    python tools/hunt_layouts.py gpt+compile dense moe          # compile, precision, accumulation

2026-11-29 it found: dropout under tp (each rank drew its own masks), a Hugging Face model's
KV cache under cp with checkpointing, a model of your own under cp with checkpointing, fp16
under pp without clipping, sequence parallel with checkpointing (all mended, each with a test).
The `+compile` rows found (same day, all mended or refused before start, each with a test):
DDP with selective checkpointing in compiled blocks; a MoE GPT's compiled blocks with
checkpointing (its experts, and under pp its balancing hook); compiled blocks under tp with
sequence parallel and checkpointing (the tp check's hooks); selective checkpointing with
bf16/fp16-mixed under zero2/zero3 (refused, then mended: FSDP2's pre-hook runs inside the
checkpointed region). The rows of selective checkpointing with sequence parallel or with
sharded mixed precision, allowed since, ran ok on GPT dense/doc and Llama/Qwen2-tied, eager
and compiled (MoE rows refused before start: tp of experts). A grid of bf16/fp16 with
checkpointing, eager and compiled, over HSDP, zero2 x cp, pp x dp_shard, zero3 x ep, cp x tp
and pp x zero2 (GPT dense/moe/doc, Llama, Qwen3-MoE) found one more: fp16 with ep under a
sharded layout (the grad scaler met plain and DTensor gradients together; mended, tested);
4-process rows (dp_shard=4,ep=2, cp=2,dp_shard=2,ep=2, pp=2,dp_shard=2,ep=2, dp=4,ep=2,
zero2=4,ep=2) one more: the GPT's compiled MoE blocks with selective checkpointing where the
experts are FSDP-sharded and resharded after forward (refused before start, tested).
Every row now clips (grad_clip_norm=1.0) and steps AdamW with foreach=True (CUDA's default):
on 2026-11-29 that found ep under sharded layouts failing its first step (clipping, then the
optimizer, met plain tensors and DTensors in one foreach op; mended, tested). Every row now
saves a checkpoint after each of its 3 steps and trains on: 2026-11-29 (afternoon), after
ep's saves were found to corrupt the live optimizer state (examples/moe_gpt.toml failed its
step 101; mended, tested). Since that day the MoE rows under tp train (each expert split by
hidden unit), eager and compiled; they found tp's loss_parallel with a balancing loss
failing its first backward (mended, tested). pp x cp rows since 2026-11-29 (evening): GPT
dense/moe/doc eager, checkpointed, bf16 and compiled ok; Llama refused before start (its cp goes
through an adapter). ``HUNT_ROWS="pp=2,cp=2;dp=2"`` runs only those layouts' rows.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.data import Dataset, TensorDataset  # noqa: E402

from meshtrain import Trainer  # noqa: E402
from meshtrain.launch.spawn import run_workers  # noqa: E402
from meshtrain.parallel.layout import Layout  # noqa: E402

GPT_FEATURES = {"dense": {}, "moe": dict(num_experts=4), "doc": dict(document_eos=3),
                "moe-bias": dict(num_experts=4, router_bias_rate=0.01, router_aux_loss_coef=0.0),
                "dropout": dict(dropout=0.1), "nobias": dict(bias=False),
                "shared": dict(num_experts=4, shared_expert=True)}
HF_BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
HF_FAMILIES = {"llama": ("LlamaConfig", {}), "qwen2-tied": ("Qwen2Config",
                                                            dict(tie_word_embeddings=True)),
               "llama-dropout": ("LlamaConfig", dict(attention_dropout=0.1)),
               "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=16,
                                                    output_router_logits=True)),
               "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2))}
AC, SP = "activation_checkpointing", "sequence_parallel"
LAYOUTS = [("dp=2", {}), ("zero3=2", {}), ("zero1=2", {}), ("tp=2", {}), ("tp=2", {SP: True}),
           ("tp=2", {"loss_parallel": True}), ("cp=2", {}), ("pp=2", {}), ("ep=2", {}),
           ("cp=2,ep=2", {}), ("dp=2", {AC: "full"}), ("cp=2", {AC: "full"}),
           ("cp=2", {AC: "selective"}), ("tp=2", {AC: "selective"}), ("tp=2", {SP: True, AC: "full"}),
           ("pp=2", {AC: "full"}), ("dp=2", {"precision": "bf16-mixed"}),
           ("pp=2", {"precision": "fp16-mixed"}), ("tp=2", {"precision": "bf16-mixed"}),
           ("dp_shard=2,tp=2", {}), ("pp=2,tp=2", {SP: True, AC: "full"}), ("dp=2,cp=2", {}),
           ("tp=2", {SP: True, AC: "selective"}), ("pp=2,tp=2", {SP: True, AC: "selective"}),
           ("zero3=2", {AC: "selective", "precision": "bf16-mixed"}),
           ("dp_shard=2,tp=2", {SP: True, AC: "selective", "precision": "bf16-mixed"}),
           ("dp_shard=2,ep=2", {}), ("dp_replicate=2,dp_shard=2,ep=2", {}),
           ("pp=2,dp_shard=2,ep=2", {}), ("pp=2,cp=2", {}), ("pp=2,cp=2", {AC: "full"}),
           ("pp=2,cp=2", {"precision": "bf16-mixed"}), ("pp=2,cp=2,ep=2", {})]

COMPILE_ROWS = [("dp=2", {AC: "selective"}), ("dp=2", {AC: "selective", "micro_batch_size": 2}),
                ("zero3=2", {AC: "full"}), ("zero3=2", {AC: "full", "precision": "bf16-mixed"}),
                ("zero2=2", {AC: "selective", "micro_batch_size": 2}),
                ("zero1=2", {AC: "selective"}), ("cp=2", {AC: "selective"}), ("tp=2", {}),
                ("tp=2", {SP: True, AC: "full"}), ("pp=2", {AC: "full"}), ("ep=2", {}),
                ("dp=2", {AC: "selective", "precision": "bf16-mixed"}),
                ("dp_shard=2,tp=2", {AC: "selective"}), ("pp=2,dp=2", {AC: "full"}),
                ("zero3=2", {AC: "selective", "precision": "bf16-mixed"}),
                ("tp=2", {SP: True, AC: "selective"}), ("pp=2,cp=2", {AC: "full"})]


class Tokens(Dataset):
    """64 windows of 16 tokens: (input, target) pairs for the GPT, dicts for a HF model."""

    def __init__(self, pairs: bool):
        x = torch.randint(4, 64, (64, 17), generator=torch.Generator().manual_seed(0))
        x[:, 5] = x[:, 11] = 3  # end-of-text ids for the GPT's document masks
        self.x, self.pairs = x, pairs

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.pairs:
            return self.x[i, :-1], self.x[i, 1:]
        return {"input_ids": self.x[i, :-1], "labels": self.x[i, :-1]}


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())


def _model(kind: str, name: str):
    if kind == "gpt":
        from meshtrain.models.gpt import GPT, GPTConfig

        config = GPTConfig(vocab_size=64, seq_len=16, num_layers=4, num_heads=2, d_model=16,
                           **GPT_FEATURES[name])
        return lambda: GPT(config)
    import transformers

    config_name, extra = HF_FAMILIES[name]
    config = getattr(transformers, config_name)(**HF_BASE, **extra)
    model_class = getattr(transformers, config_name.replace("Config", "ForCausalLM"))
    return lambda: model_class(config)


def _optimizer(params):  # (foreach: CUDA's default, forced here on CPU)
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


def _trainer(layout: str, settings: dict, devices: int | None) -> Trainer:
    # a checkpoint after every step, training going on after it (saving must leave the live
    # state as it was)
    kwargs = dict(layout=layout, max_steps=3, global_batch_size=8, loggers=(), report=False,
                  progress_bar=False, checkpoint_every_n_steps=1, resume=None,
                  model_summary=False,
                  root_dir=str(Path(tempfile.gettempdir()) / "meshtrain-hunt"),
                  **{"grad_clip_norm": 1.0, **settings})
    return Trainer(devices=devices, **kwargs) if devices else Trainer(**kwargs)


def _fit(kind, name, layout, settings):
    fns = dict(loss_fn=lm_loss) if kind == "gpt" else {}
    _trainer(layout, settings, None).fit(_model(kind, name), Tokens(kind == "gpt"),
                                         optimizer=_optimizer, **fns)
    return 0


def row(kind: str, name: str, layout: str, settings: dict) -> tuple[str, str]:
    """("ok" | "check" | "fit", the error's lines that say what failed)."""
    ranks = Layout.processes_of(layout)
    fns = dict(loss_fn=lm_loss) if kind == "gpt" else {}
    stage = "check"
    try:
        _trainer(layout, settings, ranks).check(
            _model(kind, name), Tokens(kind == "gpt"), optimizer=_optimizer, **fns)
        stage = "fit"
        run_workers(_fit, ranks, (kind, name, layout, settings), timeout=200)
        return "ok", ""
    except Exception as error:  # noqa: BLE001 - every failure is a row of the table
        lines = [line for line in str(error).splitlines() if "Error" in line]
        return stage, " | ".join(lines or str(error).splitlines()[:1])[-400:]


def main(argv: list[str]) -> int:
    kind, names = argv[0], argv[1:]
    rows = LAYOUTS
    if kind.endswith("+compile"):  # every row compiled (compile=True: each block)
        kind = kind.removesuffix("+compile")
        rows = [(layout, {"compile": True, **settings}) for layout, settings in COMPILE_ROWS]
    if os.environ.get("HUNT_ROWS"):  # e.g. HUNT_ROWS="pp=2,cp=2;dp=2": those layouts' rows
        rows = [row for row in rows if row[0] in os.environ["HUNT_ROWS"].split(";")]
    for name in names:
        for layout, settings in rows:
            start = time.perf_counter()
            stage, why = row(kind, name, layout, settings)
            print(f"{name:13s} {layout:16s} {str(settings):50s} {stage:5s} "
                  f"{time.perf_counter() - start:5.1f}s {why}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
