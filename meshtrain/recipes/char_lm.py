"""Character-level GPT language model: the main job (``make demo``).

Text: a file named by ``data.path``, or by default the Python standard library's own sources,
which are on every machine. The job prints the unigram baseline beside the validation loss
(a model that learned nothing beyond character frequencies scores the baseline) and ends with
a generated sample.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from meshtrain.callbacks import Callback
from meshtrain.config import dumps_toml
from meshtrain.data.text import CharChunks, CharTokenizer, split_tokens, stdlib_text, unigram_cross_entropy
from meshtrain.errors import ConfigError
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.trainer import Trainer

DEFAULTS = {
    "job": {"recipe": "char_lm", "name": "char_gpt"},
    "data": {"path": "", "max_chars": 1_500_000, "seq_len": 128, "val_fraction": 0.05},
    "model": {"num_layers": 4, "num_heads": 4, "d_model": 128, "mlp_ratio": 4, "dropout": 0.0},
    "optimizer": {"lr": 3e-3, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95,
                  "warmup_steps": 20, "min_lr_ratio": 0.1},
    "trainer": {
        "layout": "dp=2", "devices": 2, "accelerator": "auto", "max_steps": 400,
        "max_epochs": None, "global_batch_size": 32, "micro_batch_size": None,
        "grad_clip_norm": 1.0, "log_grad_norm": False, "precision": "fp32", "seed": 0, "val_every_n_steps": 100,
        "limit_val_batches": None, "log_every_n_steps": 10, "root_dir": "runs",
        "num_workers": 0, "bucket_cap_mb": None, "comm_hook": None, "progress_bar": True,
        # fault tolerance: "resume" is "auto" (the latest checkpoint of this job), "none" or a path
        "checkpoint_every_n_steps": None, "checkpoint_every_n_minutes": None,
        "keep_last_k": None, "async_checkpoint": False, "resume": "auto", "nan_policy": "error",
        "stall_timeout_s": 240.0, "collective_timeout_s": 300.0, "debug_collectives": False,
    },
    "sample": {"prompt": "def ", "num_chars": 300, "temperature": 0.8, "top_k": 20},
}


def load_text(data: dict) -> str:
    if data["path"]:
        path = Path(data["path"])
        if not path.is_file():
            raise ConfigError(
                f"data.path {path} does not exist; give a text file, or leave data.path empty to "
                "train on the Python standard library's sources"
            )
        return path.read_text(encoding="utf-8", errors="replace")[: data["max_chars"]]
    return stdlib_text(data["max_chars"])


def cosine_with_warmup(total_steps: int, warmup_steps: int, min_ratio: float):
    """LR multiplier: linear warm-up, then cosine decay to ``min_ratio``."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


class _SaveConfig(Callback):
    def __init__(self, config: dict, tokenizer: CharTokenizer):
        self.config, self.tokenizer = config, tokenizer

    def on_fit_start(self, trainer) -> None:
        if trainer.is_global_zero:
            (trainer.run_dir / "config.toml").write_text(dumps_toml(self.config))
            (trainer.run_dir / "tokenizer.json").write_text(json.dumps(self.tokenizer.to_dict()))


def run(config: dict, mode: str = "train"):
    data, opt, trainer_cfg = config["data"], config["optimizer"], dict(config["trainer"])
    for key in ("resume", "nan_policy"):  # TOML has no null: "none" stands for None
        if trainer_cfg[key] in ("none", ""):
            trainer_cfg[key] = None
    if mode == "memory":  # one step is enough to measure every rank's model state
        trainer_cfg.update(max_steps=1, max_epochs=None, val_every_n_steps=None,
                           progress_bar=False, resume=None, checkpoint_every_n_steps=None,
                           checkpoint_every_n_minutes=None)
    text = load_text(data)
    tokenizer = CharTokenizer.from_text(text)
    train_tokens, val_tokens = split_tokens(tokenizer.encode(text), data["val_fraction"])
    train_set = CharChunks(train_tokens, data["seq_len"])
    val_set = CharChunks(val_tokens, data["seq_len"])
    baseline = unigram_cross_entropy(train_tokens, val_tokens, tokenizer.vocab_size)
    model_config = GPTConfig(vocab_size=tokenizer.vocab_size, seq_len=data["seq_len"],
                             **config["model"])

    extra = dict(loggers=(), save_final_checkpoint=False) if mode == "memory" else {}
    trainer = Trainer(name=config["job"]["name"],
                      callbacks=[_SaveConfig(config, tokenizer)], **trainer_cfg, **extra)
    build = lambda: GPT(model_config, seed=trainer.seed)  # noqa: E731
    optimizer = lambda params: torch.optim.AdamW(  # noqa: E731
        params, lr=opt["lr"], weight_decay=opt["weight_decay"], betas=(opt["beta1"], opt["beta2"]))
    loss_fn = lambda logits, targets: torch.nn.functional.cross_entropy(  # noqa: E731
        logits.flatten(0, 1), targets.flatten())

    if mode == "lr-find":
        return trainer.lr_find(build, train_set, optimizer=optimizer, loss_fn=loss_fn)
    if mode == "memory":
        trainer.fit(build, train_set, optimizer=optimizer, loss_fn=loss_fn)
        return {"run_dir": trainer.run_dir}

    total = trainer_cfg["max_steps"] or 10**9
    schedule = cosine_with_warmup(total, opt["warmup_steps"], opt["min_lr_ratio"])
    trainer.print(f"data: {len(text):,} characters, vocabulary {tokenizer.vocab_size}, "
                  f"{len(train_set):,} training and {len(val_set):,} validation sequences")
    model = trainer.fit(build, train_set, val_set, optimizer=optimizer, loss_fn=loss_fn,
                        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, schedule))
    val_loss = trainer.callback_metrics.get("val/loss")
    if trainer.is_global_zero:
        sample = config["sample"]
        prompt = tokenizer.encode(sample["prompt"]).unsqueeze(0).to(trainer.device)
        generator = torch.Generator(device=trainer.device).manual_seed(trainer.seed)
        ids = model.generate(prompt, sample["num_chars"], temperature=sample["temperature"],
                             top_k=sample["top_k"], generator=generator)
        print(f"\nvalidation loss {val_loss:.3f} nats/char; unigram baseline {baseline:.3f} "
              f"nats/char ({model.num_params():,} parameters, {trainer.global_step} steps)")
        print("--- sample ---------------------------------------------------------")
        print(tokenizer.decode(ids[0].tolist()))
        print("--------------------------------------------------------------------")
    return {"val_loss": val_loss, "baseline": baseline, "run_dir": trainer.run_dir}
