"""Every Trainer setting, defined once: name, section, default, type, one-line doc, check.

The Python API (``Trainer(**keywords)``), the TOML sections of a recipe's config and their
``--section.key=value`` overrides, the ``--dry-run`` listing, the Trainer's ``Args:`` docstring
and ``docs/reference.md`` (``python tools/gen_reference.py``) all come from :data:`SETTINGS`.

A setting's check here looks at its own value only (type, range, choices). Checks that need
several settings or the layout (``stall_timeout_s < collective_timeout_s``, DDP settings without
DDP, ``sequence_parallel`` without ``tp``) stay with the code they protect (Trainer, fault.py).
TOML has no null: in a config ``"none"`` stands for ``None`` (:func:`flatten` converts it).
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from meshtrain.config import unknown_key_message
from meshtrain.errors import ConfigError

SECTIONS: dict[str, str] = {
    "trainer": "what to train on and for how long: layout, devices, batch sizes, precision, "
               "validation",
    "parallel": "how the layout is applied: DDP buckets and hooks, sharding options, "
                "activation checkpointing, tensor-parallel options",
    "pipeline": "pipeline parallel (pp=N): schedule and how the model's blocks are cut into stages",
    "checkpoint": "periodic and final checkpoints, and where a run resumes from",
    "fault": "fault tolerance: non-finite policy, collective timeouts, stall watchdog",
    "logging": "metrics, loggers, progress bar and where a run's folder goes",
}

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_layout(value) -> bool:
    from meshtrain.parallel.layout import Layout

    return isinstance(value, (str, dict, Layout))


# The kinds of value (Setting.type): whether a value fits, and the allowed values in words (a
# check's message and the reference's type column).
_FITS: dict[str, Callable[[Setting, object], bool]] = {
    "int": lambda s, v: _is_int(v) and (s.minimum is None or v >= s.minimum),
    "number": lambda s, v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and v > 0,
    "bool": lambda s, v: isinstance(v, bool),
    "str": lambda s, v: isinstance(v, str),
    "path": lambda s, v: isinstance(v, (str, os.PathLike)),
    "resume": lambda s, v: isinstance(v, (str, os.PathLike)),
    "choice": lambda s, v: any(v == c and type(v) is type(c) for c in s.choices),
    "devices": lambda s, v: v == "auto" or (_is_int(v) and v >= 1),
    "layout": lambda s, v: _is_layout(v),
    "loggers": lambda s, v: True,  # _check_loggers names the bad item
    "int_list": lambda s, v: isinstance(v, (list, tuple)) and all(_is_int(i) and i >= 1 for i in v)
    and all(a < b for a, b in zip(v, v[1:])),
    "callbacks": lambda s, v: isinstance(v, Iterable) and not isinstance(v, (str, bytes, dict)),
    "callable": lambda s, v: callable(v),
    "tp_plan": lambda s, v: isinstance(v, dict) or callable(v),
}
_WHAT = {
    "number": "a positive number", "bool": "True or False", "str": "a string", "path": "a path",
    "resume": "'auto' or a checkpoint folder", "devices": "a positive integer or 'auto'",
    "layout": "a layout string or table", "loggers": "a list of logger names",
    "int_list": "a list of strictly increasing block indices >= 1 (the first block of stages "
                "1, 2, ...)",
    "callbacks": "a list of Callback objects", "callable": "a function",
    "tp_plan": "a dict (module name -> ParallelStyle)",
}


@dataclass(frozen=True)
class Setting:
    """One Trainer keyword.

    ``type`` is a kind of value (a key of ``_FITS``); ``choices`` lists the allowed values of a
    ``choice`` (and of ``loggers``' items); ``none`` allows ``None``; ``minimum`` bounds an int
    (1: a positive integer, 0: >= 0); a number is always > 0. ``error`` replaces the default
    message (a format string with ``{name}`` and ``{value!r}``) where meshtrain's existing
    wording is kept. ``check`` is a further check of the value (raises ConfigError).
    ``config=False``: Python only (an object a TOML file cannot hold), not in config sections.
    """

    name: str
    section: str
    default: object
    type: str
    doc: str
    choices: tuple = ()
    none: bool = False
    minimum: int | None = None
    error: str | None = None
    check: Callable[[object], None] | None = None
    config: bool = True

    def __post_init__(self) -> None:
        assert self.section in SECTIONS and self.type in _FITS, (self.section, self.type)

    def validate(self, value) -> None:
        """Raise ConfigError, naming the setting and the allowed values, unless ``value`` fits."""
        if value is None and self.none:
            return
        if not _FITS[self.type](self, value):
            template = self.error or "{name} must be {what}, got {value!r}"
            raise ConfigError(template.format(name=self.name, value=value, what=self.what()))
        if self.check is not None:
            self.check(value)

    def what(self) -> str:
        """The allowed values in words: "a positive integer or None", "one of 'a', 'b', 'c'"."""
        if self.type == "int":
            what = {1: "a positive integer", 0: "an integer >= 0"}.get(self.minimum, "an integer")
        elif self.type == "choice":
            names = [repr(c) for c in self.choices]
            what = "one of " + ", ".join(names) if len(names) > 2 else " or ".join(names)
        else:
            what = _WHAT[self.type]
        return what + (" or None" if self.none else "")


# -- checks that are more than a type: each names its setting ---------------------------------
def _check_loggers(value) -> None:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)):
        raise ConfigError(f"loggers must be a list of logger names ('csv', 'tensorboard'), "
                          f"got {value!r}")
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(f"unknown logger {name!r} in loggers; choose from 'csv', "
                              "'tensorboard' (or an empty list for none)")


def _check_callbacks(value) -> None:
    from meshtrain.callbacks import Callback

    for item in value:
        if not isinstance(item, Callback):
            raise ConfigError(f"callbacks must be Callback objects (subclasses of "
                              f"meshtrain.Callback), got {type(item).__name__}")


def _check_resume(value) -> None:
    from meshtrain.checkpoint.resume import check_resume  # does the folder hold a checkpoint?

    check_resume(value)


# The choices, as the modules that implement them define them (tests/test_settings.py checks
# they agree).
ACCELERATORS = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
COMM_HOOKS = ("fp16", "bf16", "powersgd")
OFFLOADS = ("cpu",)
ACTIVATION_CHECKPOINTING = ("full", "selective")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv",
                "dualpipev")
PP_BALANCES = ("params", "time", "memory")
NAN_POLICIES = ("error", "skip", "rollback")
LOGGERS = ("csv", "tensorboard")

_S = Setting
_DEFINITIONS = [
    # -- trainer ------------------------------------------------------------------------------
    _S("layout", "trainer", None, "layout",
       'The parallel layout over the mesh, e.g. "dp=2", "zero3=4", "pp=2,dp_shard=2,tp=2" (a '
       "string, a table/dict or a Layout; see docs/model_parallel.md); none: data parallel over "
       "all processes.", none=True),
    _S("devices", "trainer", 1, "devices",
       "Processes on this machine when started with plain python; under meshtrain run/torchrun "
       'the launcher decides and this must match or be "auto".',
       error="devices must be a positive integer or 'auto', got {value!r}"),
    _S("accelerator", "trainer", "auto", "choice",
       '"cpu", "cuda" or "auto" (a GPU when one is visible).', choices=ACCELERATORS,
       error="accelerator must be 'cpu', 'cuda' or 'auto', got {value!r}"),
    _S("max_steps", "trainer", None, "int",
       "Stop after this many optimizer steps (set max_steps or max_epochs, or both).",
       none=True, minimum=1),
    _S("max_epochs", "trainer", None, "int",
       "Stop after this many passes over the training data.", none=True, minimum=1),
    _S("global_batch_size", "trainer", 32, "int",
       "Samples per optimizer step over all ranks (= dp x micro_batch_size x accumulation).",
       minimum=1),
    _S("micro_batch_size", "trainer", None, "int",
       "Samples per forward pass on one rank; none: as large as possible (no accumulation), "
       "under pp one micro-batch per stage.", none=True, minimum=1),
    _S("grad_clip_norm", "trainer", None, "number",
       "Clip the gradients by their global L2 norm (over every shard and stage); none: no "
       "clipping.", none=True),
    _S("precision", "trainer", "fp32", "choice",
       '"fp32", "bf16-mixed" or "fp16-mixed" (float16 autocast with a grad scaler; CPU and '
       "GPU). Parity with fp32: docs/precision.md.",
       choices=PRECISIONS,
       error="unknown precision {value!r}; choose one of fp32, bf16-mixed, fp16-mixed"),
    _S("seed", "trainer", 0, "int",
       "Seeds the initial parameters (the same on every rank), the data order and each rank's "
       "dropout."),
    _S("shuffle", "trainer", True, "bool",
       "Shuffle the training data each epoch (one seeded order, independent of the number of "
       "ranks)."),
    _S("val_every_n_steps", "trainer", None, "int",
       "Validate every N optimizer steps and at the end of fit; none: at the end only.",
       none=True, minimum=1),
    _S("limit_val_batches", "trainer", None, "int",
       "Use at most this many validation micro-batches per rank; none: all of them.",
       none=True, minimum=1),
    _S("num_workers", "trainer", 0, "int",
       "DataLoader worker processes per rank (for data given as a Dataset).", minimum=0),
    _S("callbacks", "trainer", (), "callbacks",
       "Callback objects (EarlyStopping, ModelCheckpoint, LearningRateMonitor or your own; see "
       "Callbacks below).", check=_check_callbacks, config=False),
    # -- parallel -----------------------------------------------------------------------------
    _S("bucket_cap_mb", "parallel", None, "number",
       "DDP gradient bucket size in MiB; none: 25. A DDP setting: an error under a layout "
       "without DDP (zero2/zero3/dp_shard, tp, pp).", none=True),
    _S("comm_hook", "parallel", None, "choice",
       'DDP communication hook: "fp16" or "bf16" (compressed all-reduce) or "powersgd" '
       "(low-rank); none: plain all-reduce. An error under a layout without DDP.",
       choices=COMM_HOOKS, none=True,
       error="unknown comm_hook {value!r}; choose one of fp16, bf16, powersgd or None"),
    _S("powersgd_rank", "parallel", 1, "int",
       'Rank of PowerSGD\'s low-rank gradient approximation (with comm_hook="powersgd" only).',
       minimum=1),
    _S("offload", "parallel", None, "choice",
       '"cpu": keep the sharded parameters, gradients and optimizer state in CPU memory (a '
       "sharded layout on GPUs); none: no offload.", choices=OFFLOADS, none=True,
       error="unknown offload {value!r}; choose None (no offload) or 'cpu'"),
    _S("activation_checkpointing", "parallel", None, "choice",
       '"full" recomputes each block\'s activations in backward, "selective" only the cheap '
       "element-wise ones (matmul and attention outputs are kept); none: off.",
       choices=ACTIVATION_CHECKPOINTING, none=True,
       error="activation_checkpointing must be 'full', 'selective' or None, got {value!r}"),
    _S("blocks", "parallel", None, "callable",
       "A function model -> the submodules sharded (and checkpointed) one by one; none: the "
       "model's repeated blocks (e.g. model.layers).", none=True, config=False,
       error="blocks must be a function (model -> iterable of modules) or None, got {value!r}"),
    _S("meta_init", "parallel", "auto", "choice",
       "Build a sharded model given as a factory on the meta device and let each rank "
       'initialise only its shards (needs init_weights()); "auto": whenever possible.',
       choices=(True, False, "auto"),
       error="meta_init must be True, False or 'auto', got {value!r}"),
    _S("sequence_parallel", "parallel", False, "bool",
       "Tensor parallel: norms and dropout work on sequence shards (the sequence length must "
       "divide by tp). Needs tp in the layout."),
    _S("loss_parallel", "parallel", False, "bool",
       "Tensor parallel: keep the logits sharded over the vocabulary and compute the "
       "cross-entropy on the shards. Needs tp in the layout."),
    _S("sync_batchnorm", "parallel", True, "bool",
       "BatchNorm statistics over the micro-batches of every data-parallel rank together (as "
       "one process on the global micro-batch); False: per rank, not layout-invariant."),
    _S("tp_plan", "parallel", None, "tp_plan",
       "Your own tensor-parallel plan (module name -> ParallelStyle), used instead of the "
       "model's tp_plan(). Needs tp in the layout.", none=True, config=False),
    # -- pipeline -----------------------------------------------------------------------------
    _S("pp_schedule", "pipeline", "1f1b", "choice",
       "Pipeline schedule (torch.distributed.pipelining): gpipe, 1f1b, interleaved-1f1b, "
       "looped-bfs, zero-bubble (several stages per rank), zbv, dualpipev (two per rank, V).",
       choices=PP_SCHEDULES,
       error="unknown pipeline schedule {value!r} (pp_schedule); choose one of "
             + ", ".join(PP_SCHEDULES)),
    _S("stages_per_rank", "pipeline", 1, "int",
       "Pipeline stages on each rank (2 or more for the interleaved schedules, 2 for zbv and "
       "dualpipev).", minimum=1),
    _S("pp_balance", "pipeline", "params", "choice",
       'How the blocks are cut into stages of equal cost: "params" (parameter count), "time" '
       '(measured forward+backward) or "memory" (parameters plus saved activations).',
       choices=PP_BALANCES,
       error="pp_balance must be 'params', 'time' or 'memory', got {value!r}"),
    _S("split_points", "pipeline", None, "int_list",
       "Cut points given by hand: the first block index of stages 1, 2, ... (e.g. [3, 6]); "
       "none: from pp_balance.", none=True),
    # -- checkpoint ---------------------------------------------------------------------------
    _S("checkpoint_every_n_steps", "checkpoint", None, "int",
       "Save a checkpoint every N optimizer steps into run_dir/checkpoints/step_*; none: no "
       "periodic checkpoints.", none=True, minimum=1),
    _S("checkpoint_every_n_minutes", "checkpoint", None, "number",
       "Save a checkpoint when this many minutes have passed since the last one; none: off.",
       none=True,
       error="checkpoint_every_n_minutes must be a number > 0 or None, got {value!r}"),
    _S("keep_last_k", "checkpoint", None, "int",
       "Keep only the newest k periodic checkpoints; none: keep all.", none=True, minimum=1),
    _S("async_checkpoint", "checkpoint", False, "bool",
       "Write periodic checkpoints in the background (a copy to CPU memory blocks the step, the "
       "write does not)."),
    _S("resume", "checkpoint", "auto", "resume",
       '"auto": continue the newest unfinished run of this job and model (root_dir/name), or '
       "run_dir's newest checkpoint; a checkpoint folder; none: start afresh.", none=True,
       check=_check_resume,
       error="resume must be 'auto', None or a checkpoint folder, got {value!r}"),
    _S("save_final_checkpoint", "checkpoint", True, "bool",
       "Save run_dir/checkpoints/final at the end of fit."),
    # -- fault --------------------------------------------------------------------------------
    _S("nan_policy", "fault", "error", "choice",
       'What a NaN/Inf loss or gradient does (every rank alike): "error" stops, "skip" drops '
       'the update, "rollback" restores the last checkpoint and skips the batch; none: no check.',
       choices=NAN_POLICIES, none=True,
       error="nan_policy must be one of 'error', 'skip', 'rollback' or None, got {value!r}"),
    _S("collective_timeout_s", "fault", 300.0, "number",
       "After the first step a collective waiting this long raises instead of hanging (must "
       "exceed the slowest checkpoint write)."),
    _S("init_timeout_s", "fault", 600.0, "number",
       "Collective timeout for start-up and the first step."),
    _S("stall_timeout_s", "fault", 240.0, "number",
       "A step running this long writes every rank's Python stacks to run_dir/stacks/ and ends "
       "the job (below collective_timeout_s); none: no watchdog.", none=True),
    _S("debug_collectives", "fault", False, "bool",
       "Check every collective across ranks first and name the ranks and call sites of a "
       "desync (a few ms per collective: for debugging)."),
    _S("mtbf_hours", "fault", 3.0, "number",
       "Expected hours between failures, for the Young/Daly checkpoint interval fit prints."),
    # -- logging ------------------------------------------------------------------------------
    _S("log_every_n_steps", "logging", 10, "int",
       "How often the loss is averaged over ranks and logged.", minimum=1),
    _S("log_grad_norm", "logging", False, "bool",
       "Log train/grad_norm, the global L2 norm of the gradients before clipping (over every "
       "shard and stage)."),
    _S("loggers", "logging", ("csv", "tensorboard"), "loggers",
       "Where metrics go in the run folder: metrics.csv (and loss.png) and/or TensorBoard "
       "event files.", choices=LOGGERS, check=_check_loggers),
    _S("progress_bar", "logging", True, "bool", "Show a progress bar on rank 0."),
    _S("root_dir", "logging", "runs", "path",
       "Run folders go to root_dir/name/<time> (unless run_dir is given)."),
    _S("name", "logging", "auto", "str", 'The job\'s name: its runs go to root_dir/name/; "auto": '
       "the script's file name (train.py: train), or the config's under `meshtrain train`."),
    _S("run_dir", "logging", None, "path",
       "Where this run's logs and checkpoints go; none: root_dir/name/<time> (or the folder of "
       "the run being resumed).", none=True),
]
del _S

SETTINGS: dict[str, Setting] = {
    s.name: s for section in SECTIONS for s in _DEFINITIONS if s.section == section}
assert len(SETTINGS) == len(_DEFINITIONS), "a setting is defined twice"


# -- the API ----------------------------------------------------------------------------------
def defaults() -> dict[str, object]:
    """Every setting's default, by name (the Trainer's keyword defaults)."""
    return {name: s.default for name, s in SETTINGS.items()}


def _unknown_setting(name: str) -> str:
    close = difflib.get_close_matches(name, list(SETTINGS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ";"
    return f"unknown Trainer setting {name!r}{hint} known: {', '.join(SETTINGS)}"


def check(values: dict) -> dict:
    """Check the given settings (flat keywords, any subset) and return every setting's value:
    the defaults updated with ``values``. Raises ConfigError naming the setting at fault."""
    for name, value in values.items():
        if name not in SETTINGS:
            raise ConfigError(_unknown_setting(name))
        SETTINGS[name].validate(value)
    from meshtrain.checkpoint.resume import job_name  # name="auto": the script's name
    return {**defaults(), **values, "name": job_name(values.get("name", SETTINGS["name"].default))}


def config_sections() -> dict[str, dict]:
    """``{section: {name: default}}`` of the settings a config file can hold (what a recipe's
    DEFAULTS holds for the Trainer)."""
    sections: dict[str, dict] = {section: {} for section in SECTIONS}
    for s in SETTINGS.values():
        if s.config:
            default = s.default  # TOML has arrays, not tuples
            sections[s.section][s.name] = list(default) if isinstance(default, tuple) else default
    return sections


def flatten(config: dict) -> dict:
    """The Trainer sections of a resolved config -> Trainer keywords. Other sections (a
    recipe's own, e.g. [model]) are ignored; TOML stand-ins are converted: ``"none"`` -> None
    where None is allowed, arrays -> lists."""
    flat: dict[str, object] = {}
    for section in SECTIONS:
        for name, value in config.get(section, {}).items():
            setting = SETTINGS.get(name)
            if setting is None or setting.section != section or not setting.config:
                raise ConfigError(unknown_key_message(config_sections(), section, name,
                                                      "the config"))
            if isinstance(value, str) and setting.none and value.strip().lower() in ("none", ""):
                value = None
            elif isinstance(value, tuple):
                value = list(value)
            flat[name] = value
    return flat


# -- documentation, written by meshtrain/reference.py from the definitions above ---------------
def reference_markdown() -> str:
    """The text of docs/reference.md: every setting by section, then the callbacks' arguments."""
    from meshtrain.reference import reference_markdown as text

    return text()


def docstring() -> str:
    """An ``Args:`` block for the Trainer's docstring, by section (defaults as Python)."""
    from meshtrain.reference import docstring as text

    return text()
