"""Character-level GPT language model: the main job (``make demo``).

Its config: the sections of ``DEFAULTS`` below ([job], [data], [model], [optimizer], [sample])
and the Trainer's ([trainer], [parallel], [pipeline], [checkpoint], [fault], [logging]; see
docs/reference.md), with this recipe's own defaults in ``TRAINER_DEFAULTS``.

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

from meshtrain import losses, settings
from meshtrain.callbacks import Callback
from meshtrain.config import dumps_toml
from meshtrain.data.text import CharChunks, CharTokenizer, split_tokens, stdlib_text, unigram_cross_entropy
from meshtrain.errors import ConfigError
from meshtrain.metrics import fit_metric_names
from meshtrain.models.from_config import moe_metric_names
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.plan.auto import resolved_config
from meshtrain.trainer import Trainer

# This recipe's own defaults of Trainer settings; every other setting keeps the Trainer's.
TRAINER_DEFAULTS = {
    "trainer": {"layout": "dp=2", "devices": 2, "max_steps": 400, "grad_clip_norm": 1.0,
                "val_every_n_steps": 100},
    "logging": {"log_every_n_steps": 10},  # name "auto": the config file's name
}


def _trainer_sections() -> dict[str, dict]:
    sections = settings.config_sections()
    for section, values in TRAINER_DEFAULTS.items():
        assert set(values) <= set(sections[section]), (section, values)
        sections[section].update(values)
    return sections


DEFAULTS = {
    "job": {"recipe": "char_lm"},
    "data": {"path": "", "max_chars": 1_500_000, "seq_len": 128, "val_fraction": 0.05},
    # vocab_multiple: the vocabulary is padded to a multiple of it, so that tensor parallel
    # (which splits the embedding and head by vocabulary rows) divides it
    # num_experts > 0: every MLP a mixture of experts (GPTConfig, docs/moe.md; 0 = dense)
    "model": {"num_layers": 4, "num_heads": 4, "d_model": 128, "mlp_ratio": 4, "dropout": 0.0,
              "vocab_multiple": 8, "num_experts": 0, "experts_per_token": 2,
              "expert_hidden_dim": 0, "shared_expert": False, "router_score": "softmax",
              "router_aux_loss_coef": 0.01, "router_bias_rate": 0.0},
    "optimizer": {"lr": 3e-3, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95,
                  "warmup_steps": 20, "min_lr_ratio": 0.1},
    **_trainer_sections(),  # [trainer] [parallel] [pipeline] [checkpoint] [fault] [logging]
    "sample": {"prompt": "def ", "num_chars": 300, "temperature": 0.8, "top_k": 20},
}


def trainer_keywords(config: dict, mode: str = "train") -> dict:
    """The Trainer's keywords from the config's Trainer sections (for ``mode``)."""
    keywords = settings.flatten(config)
    if mode == "memory":  # one step is enough to measure every rank's model state
        keywords = settings.impose(keywords, MEMORY_RUN)
    return keywords


#: what ``meshtrain memory`` runs: one step, nothing saved or logged
MEMORY_RUN = dict(max_steps=1, max_epochs=None, val_every_n_steps=None, progress_bar=False,
                  resume=None, checkpoint_every_n_steps=None, checkpoint_every_n_minutes=None,
                  checkpoint_every_n_epochs=None, loggers=(), save_final_checkpoint=False)


def _check_data_path(data: dict) -> None:
    if data["path"] and not Path(data["path"]).is_file():
        raise ConfigError(
            f"data.path {data['path']} does not exist; give a text file, or leave data.path "
            "empty to train on the Python standard library's sources"
        )


def check(config: dict, mode: str = "train") -> str:
    """``--dry-run``: every check ``mode`` makes before any process starts (``Trainer.check``:
    the settings, the data, the model against the layout); reads the text, trains nothing."""
    keywords = trainer_keywords(config, mode)
    trainer = Trainer(**keywords)
    _, tokenizer, train_tokens, val_tokens = _data(config)
    seq_len = config["data"]["seq_len"]
    parts = _parts(config, tokenizer, trainer.seed, keywords["max_steps"] or 10**9)
    train = mode == "train"  # lr-find and memory: no validation data, no scheduler
    trainer.check(parts["model"], CharChunks(train_tokens, seq_len),
                  CharChunks(val_tokens, seq_len) if train else None,
                  optimizer=parts["optimizer"], loss_fn=parts["loss_fn"],
                  lr_scheduler=parts["lr_scheduler"] if train else None)
    facts = [f"{name} {getattr(trainer, attr)}" for name, attr in (
        ("layout", "layout"), ("processes", "world_size"), ("micro-batch", "micro_batch_size"),
        ("accumulation", "grad_accum_steps")) if hasattr(trainer, attr)]
    return ", ".join(facts)


def metrics(config: dict) -> list[str]:
    """The names a run of this job logs (``meshtrain sweep`` checks its objective against them
    before any trial): the Trainer's, over token ids, with validation (val_fraction > 0)."""
    sizes = model_config(config, vocab_size=1)  # (the routers do not depend on it)
    return (fit_metric_names(settings.flatten(config), unit="tokens", validation=True)
            + moe_metric_names(lambda: GPT(sizes)))


def load_text(data: dict) -> str:
    _check_data_path(data)
    if data["path"]:
        path = Path(data["path"])
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
            config = resolved_config(self.config, trainer)  # layout="auto": the pick
            (trainer.run_dir / "config.toml").write_text(dumps_toml(config))
            (trainer.run_dir / "tokenizer.json").write_text(json.dumps(self.tokenizer.to_dict()))


def model_config(config: dict, vocab_size: int) -> GPTConfig:
    """The GPT's sizes: [model], with the vocabulary padded to a multiple of vocab_multiple."""
    sizes = dict(config["model"])
    multiple = sizes.pop("vocab_multiple")
    if not isinstance(multiple, int) or multiple < 1:
        raise ConfigError(f"model.vocab_multiple must be a positive integer, got {multiple!r}")
    padded = -(-vocab_size // multiple) * multiple
    return GPTConfig(vocab_size=padded, seq_len=config["data"]["seq_len"], **sizes)


def _data(config: dict):
    data = config["data"]
    text = load_text(data)
    tokenizer = CharTokenizer.from_text(text)
    train_tokens, val_tokens = split_tokens(tokenizer.encode(text), data["val_fraction"])
    return text, tokenizer, train_tokens, val_tokens


def _parts(config: dict, tokenizer: CharTokenizer, seed: int, total_steps: int) -> dict:
    """Model factory, optimizer and scheduler factories and loss of the job."""
    opt = config["optimizer"]
    sizes = model_config(config, tokenizer.vocab_size)
    schedule = cosine_with_warmup(total_steps, opt["warmup_steps"], opt["min_lr_ratio"])
    return dict(
        model=lambda: GPT(sizes, seed=seed),
        optimizer=lambda params: torch.optim.AdamW(
            params, lr=opt["lr"], weight_decay=opt["weight_decay"],
            betas=(opt["beta1"], opt["beta2"])),
        loss_fn=losses.cross_entropy(),  # token mean over the global batch
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, schedule))


def job(config: dict) -> dict:
    """The job ``meshtrain parity`` trains: model, training data, optimizer, loss, scheduler."""
    _, tokenizer, train_tokens, _ = _data(config)
    flat = settings.flatten(config)
    return dict(_parts(config, tokenizer, flat["seed"], flat["max_steps"] or 10**9),
                train_data=CharChunks(train_tokens, config["data"]["seq_len"]))


def run(config: dict, mode: str = "train"):
    data = config["data"]
    keywords = trainer_keywords(config, mode)
    text, tokenizer, train_tokens, val_tokens = _data(config)
    train_set = CharChunks(train_tokens, data["seq_len"])
    val_set = CharChunks(val_tokens, data["seq_len"])
    baseline = unigram_cross_entropy(train_tokens, val_tokens, tokenizer.vocab_size)
    trainer = Trainer(**keywords, callbacks=[_SaveConfig(config, tokenizer)])
    parts = _parts(config, tokenizer, trainer.seed, keywords["max_steps"] or 10**9)
    build, optimizer, loss_fn = parts["model"], parts["optimizer"], parts["loss_fn"]

    if mode == "lr-find":
        return trainer.lr_find(build, train_set, optimizer=optimizer, loss_fn=loss_fn)
    if mode == "memory":
        trainer.fit(build, train_set, optimizer=optimizer, loss_fn=loss_fn)
        return {"run_dir": trainer.run_dir}

    trainer.print(f"data: {len(text):,} characters, vocabulary {tokenizer.vocab_size}, "
                  f"{len(train_set):,} training and {len(val_set):,} validation sequences")
    trainer.fit(build, train_set, val_set, optimizer=optimizer, loss_fn=loss_fn,
                lr_scheduler=parts["lr_scheduler"])
    val_loss = trainer.callback_metrics.get("val/loss")
    model = trainer.whole_model()  # (collective) sample from one whole model, on one rank
    if trainer.is_global_zero:
        model = model.to(trainer.device)
        sample = config["sample"]
        prompt = tokenizer.encode(sample["prompt"]).unsqueeze(0).to(trainer.device)
        generator = torch.Generator(device=trainer.device).manual_seed(trainer.seed)
        ids = model.generate(prompt, sample["num_chars"], temperature=sample["temperature"],
                             top_k=sample["top_k"], generator=generator)
        print(f"\nvalidation loss {val_loss:.3f} nats/char; unigram baseline {baseline:.3f} "
              f"nats/char ({model.num_params():,} parameters, {trainer.global_step} steps)")
        print("--- sample ---------------------------------------------------------")
        print(tokenizer.decode([i for i in ids[0].tolist() if i < tokenizer.vocab_size]))
        print("--------------------------------------------------------------------")
        print(f"report: {trainer.run_dir / 'report.html'} (loss, throughput and MFU, where "
              "each rank's step time and memory went; open it in a browser)")
    return {"val_loss": val_loss, "baseline": baseline, "run_dir": trainer.run_dir}
