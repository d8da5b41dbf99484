"""Lightning's Trainer arguments in meshtrain's words: one that means a meshtrain setting is taken
as that setting (said at start), one that meshtrain does another way is refused with that way.

Only the Python ``Trainer(...)`` reads them (a config file or the CLI uses meshtrain's names).
Lightning 2.x's names; its values where they differ (``precision=32``, ``strategy="fsdp"``,
``max_time="00:12:00:00"``).
"""

from __future__ import annotations

import datetime
import os

from meshtrain.errors import ConfigError

RENAMED = {"gradient_clip_val": "grad_clip_norm", "default_root_dir": "root_dir",
           "enable_progress_bar": "progress_bar", "enable_model_summary": "model_summary",
           "check_val_every_n_epoch": "val_every_n_epochs"}

# Lightning's strategy names -> a meshtrain layout over every process ("=-1": all of them)
STRATEGIES = {"ddp": "dp=-1", "ddp_spawn": "dp=-1", "ddp_fork": "dp=-1",
              "ddp_notebook": "dp=-1", "ddp_find_unused_parameters_true": "dp=-1",
              "ddp_find_unused_parameters_false": "dp=-1",
              "fsdp": "zero3=-1",  # FSDPStrategy's default sharding: FULL_SHARD
              "deepspeed_stage_1": "zero1=-1", "deepspeed_stage_2": "zero2=-1",
              "deepspeed_stage_3": "zero3=-1"}

PRECISIONS = {"32": "fp32", "32-true": "fp32", "16": "fp16-mixed", "16-mixed": "fp16-mixed",
              "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed"}

_STEP = ("meshtrain cuts an optimizer step by global_batch_size (its samples over all ranks, as "
         "one process reads them; a DataLoader's batch_size is taken as it) and "
         "micro_batch_size (the samples of one forward pass on one rank)")

# Lightning's arguments meshtrain does another way: the way
REFUSED = {
    "accumulate_grad_batches": _STEP + ": Lightning's batch_size=B with "
    "accumulate_grad_batches=K on one device is global_batch_size=K*B, micro_batch_size=B",
    "fast_dev_run": "for a quick try: max_steps=1, limit_val_batches=1, "
    "save_final_checkpoint=False, resume='none'",
    "limit_train_batches": "meshtrain's limit_train_batches is a number of batches, not a "
    "fraction",
    "overfit_batches": "train on a torch.utils.data.Subset of the dataset",
    "num_nodes": "the launcher decides the nodes (torchrun --nnodes, Slurm, `meshtrain run`): "
    "docs/fault_tolerance.md",
    "min_epochs": "meshtrain stops only at max_steps, max_epochs, max_time_minutes or a "
    "callback's trainer.should_stop",
    "min_steps": "meshtrain stops only at max_steps, max_epochs, max_time_minutes or a "
    "callback's trainer.should_stop",
    "deterministic": "call torch.use_deterministic_algorithms(True) in your script; meshtrain "
    "seeds every rank (seed=)",
    "benchmark": "set torch.backends.cudnn.benchmark in your script",
    "profiler": "profile_steps=[...] writes torch.profiler traces of those steps",
    "detect_anomaly": "wrap your training step in torch.autograd.detect_anomaly(); "
    "nan_policy= decides what a NaN loss does",
    "use_distributed_sampler": "meshtrain always draws each rank's samples itself (one seeded "
    "order whatever the layout)",
    "reload_dataloaders_every_n_epochs": "give train_data as a function: it is called once per "
    "fit",
    "limit_test_batches": "test on a torch.utils.data.Subset of the dataset",
    "limit_predict_batches": "predict on a torch.utils.data.Subset of the dataset",
    "inference_mode": "validation and prediction run under torch.no_grad()",
    "barebones": "progress_bar=False, model_summary=False, report=False, loggers=[]",
    "plugins": "precision= and layout= cover meshtrain's precisions and layouts",
    "model_registry": "save the final model with trainer.whole_model() or the HF export",
}


# values of those arguments that ask for what meshtrain does anyway (Lightning's defaults,
# mostly): taken without a word
SAME = {"accumulate_grad_batches": (1,), "fast_dev_run": (False,),
        "limit_train_batches": (None, 1.0), "overfit_batches": (0, 0.0), "num_nodes": (1,),
        "min_epochs": (None,), "min_steps": (None,), "deterministic": (None, False),
        "benchmark": (None, False), "profiler": (None,), "detect_anomaly": (False,),
        "use_distributed_sampler": (True,), "reload_dataloaders_every_n_epochs": (0,),
        "limit_test_batches": (None, 1.0), "limit_predict_batches": (None, 1.0),
        "inference_mode": (True,), "barebones": (False,), "plugins": (None,),
        "model_registry": (None,)}


def from_lightning(keywords: dict) -> tuple[dict, list[str]]:
    """(``keywords`` with Lightning's names and values turned into meshtrain's, the lines to
    print at start); ConfigError for a Lightning argument meshtrain does another way."""
    out, notes = dict(keywords), []

    def take(name: str, setting: str, value, said: str | None = None) -> None:
        if setting in keywords:
            raise ConfigError(f"{name}= and {setting}= are both given: Lightning's {name} is "
                              f"meshtrain's {setting}; give one")
        del out[name]
        if value is not _DROP:
            out[setting] = value
        notes.append(f"lightning: {name}={keywords[name]!r} is "
                     f"{said or f'{setting}={value!r}'}")

    for name in keywords:
        if name == "limit_train_batches" and isinstance(keywords[name], int) and \
                not isinstance(keywords[name], bool):  # a count: meshtrain's setting too
            continue
        if name in REFUSED and any(keywords[name] is v or (
                type(keywords[name]) is type(v) and keywords[name] == v) for v in SAME[name]):
            del out[name]
        elif name in REFUSED:
            raise ConfigError(f"{name}={keywords[name]!r} (a Lightning argument): "
                              f"{REFUSED[name]}")
        value = keywords[name]
        if name == "gradient_clip_val" and value == 0:  # Lightning's 0: no clipping
            take(name, "grad_clip_norm", _DROP, "no clipping")
        elif name in RENAMED:
            take(name, RENAMED[name], value)
        elif name == "strategy":
            take(name, "layout", *_strategy(value))
        elif name == "max_time":
            take(name, "max_time_minutes", _minutes(value))
        elif name == "val_check_interval":
            take(name, "val_every_n_steps", *_val_interval(value))
        elif name == "logger":
            if value is False:
                take(name, "loggers", [])
            elif value is None or value is True:
                take(name, "loggers", _DROP, "meshtrain's default loggers")
            else:
                raise ConfigError("logger= takes Lightning's logger objects, which meshtrain "
                                  "does not drive: loggers=['csv', 'tensorboard', 'mlflow', "
                                  "'wandb'] names meshtrain's, a Callback can feed your own")
        elif name == "enable_checkpointing":
            take(name, "save_final_checkpoint", False if value is False else _DROP,
                 None if value is False else "meshtrain's default (a final checkpoint)")
        elif name == "num_sanity_val_steps":
            if value != 0:
                raise ConfigError("num_sanity_val_steps: meshtrain runs no validation before "
                                  "training (its checks run before any process starts); "
                                  "leave it out, or 0")
            del out[name]
        elif name == "gradient_clip_algorithm":
            if value not in (None, "norm"):
                raise ConfigError(f"gradient_clip_algorithm={value!r}: meshtrain clips by the "
                                  "norm of all gradients only (grad_clip_norm=)")
            del out[name]
    precision = out.get("precision")
    if precision is not None and not isinstance(precision, bool) and \
            str(precision) in PRECISIONS and str(precision) != PRECISIONS[str(precision)]:
        out["precision"] = PRECISIONS[str(precision)]
        notes.append(f"lightning: precision={precision!r} is precision="
                     f"{out['precision']!r}")
    seeded = os.environ.get("PL_GLOBAL_SEED", "")
    if "seed" not in out and seeded.lstrip("-").isdigit():
        # lightning.seed_everything(N) said the run's seed: Trainer() would seed 0 over it
        out["seed"] = int(seeded)
        notes.append(f"lightning: seed_everything({seeded}) is seed={seeded}")
    return out, notes


_DROP = object()  # a Lightning value that is meshtrain's default: nothing to set


def _strategy(value) -> tuple:
    if not isinstance(value, str):
        raise ConfigError(f"strategy={type(value).__name__}(...): Lightning's strategy objects "
                          "are not read; give layout= (e.g. layout='zero3=4' for FSDP over 4 "
                          "processes, 'dp=2,tp=2' for DDP with tensor parallel): "
                          "docs/model_parallel.md")
    if value in ("auto", "single_device"):
        return _DROP, "meshtrain's default layout (data parallel over all processes)"
    if value not in STRATEGIES:
        raise ConfigError(f"strategy={value!r}: meshtrain knows Lightning's "
                          f"{', '.join(repr(s) for s in STRATEGIES)} and 'auto'; for another, "
                          "give layout= (docs/model_parallel.md)")
    layout = STRATEGIES[value]
    return layout, f"layout={layout!r} (-1: over every process)"


def _minutes(value) -> float:
    """Lightning's max_time ("DD:HH:MM:SS", a timedelta or a dict of its keywords) in minutes."""
    if isinstance(value, str):
        try:
            days, hours, minutes, seconds = (int(p) for p in value.split(":"))
        except ValueError:
            raise ConfigError(f"max_time={value!r}: write 'DD:HH:MM:SS' (or max_time_minutes=)")
        value = datetime.timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    elif isinstance(value, dict):
        value = datetime.timedelta(**value)
    if not isinstance(value, datetime.timedelta):
        raise ConfigError(f"max_time={value!r}: give 'DD:HH:MM:SS', a datetime.timedelta or a "
                          "dict of its keywords (or max_time_minutes=)")
    return value.total_seconds() / 60


def _val_interval(value) -> tuple:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value, f"val_every_n_steps={value} (optimizer steps)"
    raise ConfigError(f"val_check_interval={value!r}: meshtrain validates every "
                      "val_every_n_steps optimizer steps (an integer) and at the end of fit")
