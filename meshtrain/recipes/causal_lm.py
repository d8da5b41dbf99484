"""Recipe ``causal_lm``: pre-train or fine-tune a causal language model on prepared token shards.

The model is a Hugging Face causal LM built from its config (``[model] architecture`` = llama,
qwen2 or mistral with the sizes below, or ``hf_config`` = a local config.json / folder, or
``pretrained`` = a local model folder whose weights initialise it), or meshtrain's own GPT
(``architecture = "gpt"``). The data are the memory-mapped shards ``meshtrain prepare`` writes
(``[data] path``: its ``--out`` folder, holding ``train/``, ``val/`` and ``tokenizer.json``),
packed into sequences of ``seq_len`` tokens. AdamW without weight decay on norms, biases and
embeddings (meshtrain.optim), linear warm-up then cosine; the loss is the token mean over the
global batch (meshtrain.losses). At the end it prints the validation perplexity beside the
unigram baseline of the same tokenizer, and a sample.

    meshtrain prepare mytexts/ --out data/mycorpus --train-tokenizer 4096 --val-fraction 0.02
    meshtrain train examples/llama_tiny.toml --data.path=data/mycorpus
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch

from meshtrain import losses, settings
from meshtrain.callbacks import Callback
from meshtrain.config import dumps_toml
from meshtrain.errors import ConfigError
from meshtrain.metrics import fit_metric_names
from meshtrain.models.from_config import model_config, model_factory, moe_metric_names
from meshtrain.optim import AdamW
from meshtrain.plan.auto import resolved_config
from meshtrain.recipes.char_lm import MEMORY_RUN, cosine_with_warmup
from meshtrain.trainer import Trainer

TRAINER_DEFAULTS = {
    "trainer": {"layout": "dp=2", "devices": 2, "max_steps": 300, "grad_clip_norm": 1.0,
                "val_every_n_steps": 100, "limit_val_batches": 20,
                "metrics": ["perplexity", "token_accuracy"]},
    "logging": {"log_every_n_steps": 10},
}


def _trainer_sections() -> dict[str, dict]:
    sections = settings.config_sections()
    for section, values in TRAINER_DEFAULTS.items():
        sections[section].update(values)
    return sections


DEFAULTS = {
    "job": {"recipe": "causal_lm"},
    # path: the --out folder of `meshtrain prepare`; tokenizer: its tokenizer.json unless given
    # document_mask: attention and targets kept inside each packed document (meshtrain.packing)
    "data": {"path": "", "seq_len": 256, "tokenizer": "", "document_mask": False},
    # sizes apply when neither hf_config nor pretrained gives the config; vocab_size 0: the
    # tokenizer's, padded to vocab_multiple (tensor parallel splits the vocabulary);
    # num_experts > 0 (architecture "gpt"): every MLP a mixture of experts (docs/moe.md; a
    # Hugging Face MoE model comes from its hf_config)
    "model": {"architecture": "llama", "hf_config": "", "pretrained": "", "hidden_size": 128,
              "num_layers": 4, "num_heads": 4, "num_kv_heads": 4, "intermediate_size": 0,
              "vocab_size": 0, "vocab_multiple": 64, "max_position_embeddings": 2048,
              "tie_word_embeddings": False, "num_experts": 0, "experts_per_token": 2,
              "expert_hidden_dim": 0, "shared_expert": False, "router_score": "softmax",
              "router_aux_loss_coef": 0.01, "router_bias_rate": 0.0},
    "optimizer": {"lr": 1e-3, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95,
                  "warmup_steps": 30, "min_lr_ratio": 0.1},
    **_trainer_sections(),
    "sample": {"prompt": "def ", "num_tokens": 48, "temperature": 0.8, "top_k": 20},
}


# -- data ----------------------------------------------------------------------------------------
def data_paths(data: dict) -> tuple[Path, Path, Path]:
    """(train folder, val folder, tokenizer.json) of ``[data]``, checked to exist."""
    if not data["path"]:
        raise ConfigError("data.path is empty: give the --out folder of `meshtrain prepare` "
                          "(e.g. `meshtrain prepare texts/ --out data/corpus --train-tokenizer "
                          "4096 --val-fraction 0.02`, then --data.path=data/corpus)")
    root = Path(data["path"])
    train, val = root / "train", root / "val"
    if not (train / "meta.json").is_file():
        raise ConfigError(f"data.path {root} holds no prepared token shards ({train}/meta.json "
                          "is missing); run `meshtrain prepare ... --out "
                          f"{root}` first")
    tokenizer = Path(data["tokenizer"]) if data["tokenizer"] else root / "tokenizer.json"
    return train, val, tokenizer


def load_data(config: dict):
    """The train and validation datasets (val None without a val split) and the shards' meta,
    after checking the tokenizer is the one the shards were written with."""
    from meshtrain.data.tokens import PackedTokens, check_tokenizer

    train, val, tokenizer = data_paths(config["data"])
    check_tokenizer(train, tokenizer)
    hf = config["model"]["architecture"] != "gpt"
    seq_len, documents = config["data"]["seq_len"], bool(config["data"].get("document_mask"))
    kwargs = dict(dict_batches=hf, document_mask=documents)
    train_set = PackedTokens(train, seq_len, **kwargs)
    val_set = PackedTokens(val, seq_len, **kwargs) if (val / "meta.json").is_file() else None
    return train_set, val_set, train_set.meta


def metrics(config: dict) -> list[str]:
    """The names a run of this job logs (``meshtrain sweep`` checks its objective against them
    before any trial): the Trainer's, over token ids; validation ones when the prepared data
    (checked to exist, as a run would) have a val split."""
    _, val, _ = data_paths(config["data"])
    validation = (val / "meta.json").is_file()
    routing = moe_metric_names(model_factory(config, job_model_config(config), seed=0))
    return fit_metric_names(settings.flatten(config), unit="tokens",
                            validation=validation) + routing


def unigram_baseline(train_set, val_set, vocab_size: int, max_tokens: int = 50_000_000) -> float:
    """Cross-entropy (nats/token) on the validation tokens of the unigram distribution of the
    training tokens (add-one smoothed): what a model has to beat."""
    def counts(dataset) -> np.ndarray:
        n = min(dataset.num_tokens, max_tokens)
        return np.bincount(dataset.read(0, n).astype(np.int64), minlength=vocab_size)

    train, val = counts(train_set), counts(val_set if val_set is not None else train_set)
    logp = np.log((train + 1) / (train.sum() + vocab_size))
    return float(-(val * logp).sum() / max(1, val.sum()))


# -- model (its config and factory: meshtrain/models/from_config.py) ---------------------------
def _tokenizer_vocab(tokenizer_path: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_path)).get_vocab_size(with_added_tokens=True)


# -- the job -------------------------------------------------------------------------------------
def job_model_config(config: dict):
    """The model's config for this job's tokenizer; meshtrain's GPT with ``data.document_mask``
    keeps the documents apart at the shards' eos id (GPTConfig.document_eos: its batches are
    (input, target) pairs, without positions)."""
    from meshtrain.data.tokens import read_meta

    train, _, tokenizer = data_paths(config["data"])
    cfg = model_config(config, _tokenizer_vocab(tokenizer))
    if config["data"].get("document_mask") and config["model"]["architecture"] == "gpt":
        cfg = dataclasses.replace(cfg, document_eos=read_meta(train)["eos_id"])
    return cfg


def trainer_keywords(config: dict) -> dict:
    keywords = settings.flatten(config)
    if config["model"]["pretrained"] and keywords.get("init_from") is None:
        keywords["init_from"] = config["model"]["pretrained"]
    return keywords


def check(config: dict, mode: str = "train") -> str:
    """``--dry-run``: every check ``mode`` makes before any process starts (``Trainer.check``:
    the settings, the data folder and tokenizer, the model config, and the model against the
    layout on a meta-device copy: no weights); nothing trains."""
    keywords = trainer_keywords(config)
    trainer = Trainer(**keywords)
    train_set, val_set, _ = load_data(config)
    cfg = job_model_config(config)
    parts = _parts(config, cfg, trainer.seed, keywords["max_steps"] or 10**9)
    train = mode == "train"  # lr-find and memory: no validation data, no scheduler
    trainer.check(parts["model"], train_set, val_set if train else None,
                  optimizer=parts["optimizer"], loss_fn=parts["loss_fn"],
                  lr_scheduler=parts["lr_scheduler"] if train else None)
    return (f"layout {trainer.layout}, {trainer.world_size} processes, model "
            f"{type(cfg).__name__}, vocabulary {cfg.vocab_size}")


class _SaveRun(Callback):
    """The resolved config, the model's config (``hf_config/``, what `meshtrain export --hf`
    reads) and the tokenizer, in the run folder."""

    def __init__(self, config: dict, cfg, tokenizer: Path):
        self.config, self.cfg, self.tokenizer = config, cfg, tokenizer

    def on_fit_start(self, trainer) -> None:
        if not trainer.is_global_zero:
            return
        config = resolved_config(self.config, trainer)  # layout="auto": the pick
        (trainer.run_dir / "config.toml").write_text(dumps_toml(config))
        if hasattr(self.cfg, "save_pretrained"):
            self.cfg.save_pretrained(trainer.run_dir / "hf_config")
        (trainer.run_dir / "tokenizer.json").write_bytes(self.tokenizer.read_bytes())


def job(config: dict) -> dict:
    """What ``meshtrain parity`` trains."""
    train_set, _, meta = load_data(config)
    cfg = job_model_config(config)
    flat = settings.flatten(config)
    return dict(_parts(config, cfg, flat["seed"], flat["max_steps"] or 10**9),
                train_data=train_set)


def _parts(config: dict, cfg, seed: int, total_steps: int) -> dict:
    opt = config["optimizer"]
    schedule = cosine_with_warmup(total_steps, opt["warmup_steps"], opt["min_lr_ratio"])
    gpt = config["model"]["architecture"] == "gpt"
    return dict(model=model_factory(config, cfg, seed),
                optimizer=AdamW(lr=opt["lr"], weight_decay=opt["weight_decay"],
                                betas=(opt["beta1"], opt["beta2"])),
                # Hugging Face models compute their own loss (a global mean too)
                loss_fn=losses.cross_entropy() if gpt else None,
                lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, schedule))


def run(config: dict, mode: str = "train"):
    train_set, val_set, meta = load_data(config)
    _, _, tokenizer_path = data_paths(config["data"])
    cfg = job_model_config(config)
    keywords = trainer_keywords(config)
    if mode == "memory":
        keywords = settings.impose(keywords, MEMORY_RUN)
    trainer = Trainer(**keywords, callbacks=[_SaveRun(config, cfg, tokenizer_path)])
    parts = _parts(config, cfg, trainer.seed, keywords["max_steps"] or 10**9)
    fit = dict(optimizer=parts["optimizer"], loss_fn=parts["loss_fn"])
    if mode == "lr-find":
        return trainer.lr_find(parts["model"], train_set, **fit)
    if mode == "memory":
        trainer.fit(parts["model"], train_set, **fit)
        return {"run_dir": trainer.run_dir}
    trainer.print(f"data: {train_set.num_tokens:,} training tokens in {len(train_set):,} "
                  f"sequences of {train_set.seq_len}; vocabulary {meta['vocab_size']}")
    trainer.fit(parts["model"], train_set, val_set, lr_scheduler=parts["lr_scheduler"], **fit)
    val_loss = trainer.callback_metrics.get("val/loss")
    baseline = unigram_baseline(train_set, val_set, meta["vocab_size"])
    model = sampling_model(trainer, parts["model"])  # (collective) None but on rank 0
    if trainer.is_global_zero:
        if val_loss is not None:
            accuracy = trainer.callback_metrics.get("val/token_accuracy")
            print(f"\nvalidation perplexity {math.exp(val_loss):.1f} (loss {val_loss:.3f} nats/"
                  f"token{'' if accuracy is None else f', token accuracy {accuracy:.3f}'}); "
                  f"unigram baseline {math.exp(baseline):.1f} ({baseline:.3f})")
        print("--- sample ---------------------------------------------------------")
        print(sample(model, tokenizer_path, config["sample"], trainer, config["data"]["seq_len"]))
        print("--------------------------------------------------------------------")
    return {"val_loss": val_loss, "baseline": baseline, "run_dir": trainer.run_dir}


def sampling_model(trainer, factory):
    """Collective: on rank 0, the trained model as a plain one-process module (None elsewhere),
    to sample from alone. ``Trainer.whole_model`` gathers a sharded or split one (zero3, tp,
    pp, ep) into a new module; where it gives back the trained module itself (dp, zero1/2,
    cp), rank 0 copies its weights into a fresh one from ``factory``: under cp the trained
    module's attention gathers keys and values from the other ranks, which do not sample."""
    whole = trainer.whole_model()
    if not trainer.is_global_zero:
        return None
    if whole is trainer.model and trainer.world_size > 1:
        plain = factory()
        plain.load_state_dict(whole.state_dict())
        whole = plain
    return whole.to(trainer.device)


@torch.no_grad()
def sample(model, tokenizer_path: Path, options: dict, trainer, window: int) -> str:
    """``options["num_tokens"]`` tokens after the prompt, top-k sampled, the model seeing at
    most the last ``window`` tokens (its training length)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    ids = torch.tensor([tokenizer.encode(options["prompt"]).ids], device=trainer.device)
    generator = torch.Generator(device=trainer.device).manual_seed(trainer.seed)
    model.eval()
    for _ in range(options["num_tokens"]):
        out = model(ids[:, -window:])
        logits = getattr(out, "logits", out)[:, -1, :].float() / max(options["temperature"], 1e-6)
        top = torch.topk(logits, min(options["top_k"], logits.shape[-1]))
        choice = torch.multinomial(torch.softmax(top.values, -1), 1, generator=generator)
        ids = torch.cat([ids, top.indices.gather(-1, choice)], dim=1)
    return tokenizer.decode(ids[0].tolist())
