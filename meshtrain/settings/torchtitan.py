"""torchtitan's config names in a meshtrain config file or override: ``[parallelism]`` degrees
become one ``layout`` (``data_parallel_shard_degree`` -1 by default, as torchtitan's
ParallelDims fills the world with FSDP), ``[training] steps`` is ``max_steps`` and so on; each is
said at start. A torchtitan name meshtrain does another way is refused with that way.

Read by :func:`meshtrain.config.resolve` before meshtrain's own keys, so a job's config may mix
both (a torchtitan name and the meshtrain setting it stands for together are refused). torchtitan's
way to name the config, ``--job.config_file PATH``, names it for ``meshtrain train`` too
(:func:`config_file_first`).
"""

from __future__ import annotations

from meshtrain.errors import ConfigError

DEGREES = {"data_parallel_replicate_degree": "dp_replicate",
           "data_parallel_shard_degree": "dp_shard", "context_parallel_degree": "cp",
           "tensor_parallel_degree": "tp", "pipeline_parallel_degree": "pp",
           "expert_parallel_degree": "ep"}
SCHEDULES = {"1F1B": "1f1b", "Interleaved1F1B": "interleaved-1f1b", "GPipe": "gpipe",
             "LoopedBFS": "looped-bfs", "InterleavedZeroBubble": "zero-bubble",
             "ZBVZeroBubble": "zbv", "DualPipeV": "dualpipev"}
PRECISIONS = {"bfloat16": "bf16-mixed", "float16": "fp16-mixed", "float32": "fp32"}
AC_MODES = {"none": "none", "full": "full", "selective": "selective"}  # ("none": TOML's None)


CONFIG_FILE = "--job.config_file"


def config_file_first(argv: list[str]) -> list[str]:
    """A command's arguments with torchtitan's ``--job.config_file PATH`` (or ``=PATH``) taken
    as the config path, moved first where meshtrain's commands read it; ``argv`` as it is
    without one. A config path given both ways is a ``ConfigError``."""
    for i, arg in enumerate(argv):
        if arg != CONFIG_FILE and not arg.startswith(CONFIG_FILE + "="):
            continue
        path = arg.partition("=")[2] if arg != CONFIG_FILE else (
            argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "")
        if not path:
            raise ConfigError(f"{CONFIG_FILE} needs the config file's path: {CONFIG_FILE} "
                              "job.toml (or give it first: meshtrain train job.toml)")
        rest = argv[:i] + argv[i + (1 if arg != CONFIG_FILE else 2):]
        if rest and not rest[0].startswith("-"):
            raise ConfigError(f"the config file is given twice: {rest[0]} and {CONFIG_FILE} "
                              f"{path}; give one")
        return [path, *rest]
    return argv


def _same(value):
    return value


def _nonzero(value):
    return value or "none"  # keep_latest_k 0: keep all


# (section, key) -> (meshtrain section, setting, conversion)
RENAMED = {
    ("training", "steps"): ("trainer", "max_steps", _same),
    ("training", "max_norm"): ("trainer", "grad_clip_norm", _same),
    ("training", "global_batch_size"): ("trainer", "global_batch_size", _same),
    ("training", "local_batch_size"): ("trainer", "micro_batch_size", _same),
    ("training", "seed"): ("trainer", "seed", _same),
    ("training", "mixed_precision_param"): ("trainer", "precision", PRECISIONS.get),
    ("training", "seq_len"): ("data", "seq_len", _same),
    ("parallelism", "pipeline_parallel_schedule"): ("pipeline", "pp_schedule", SCHEDULES.get),
    ("parallelism", "pipeline_parallel_microbatch_size"): ("trainer", "micro_batch_size", _same),
    ("parallelism", "disable_loss_parallel"): ("parallel", "loss_parallel",
                                               lambda v: not v if isinstance(v, bool) else None),
    ("activation_checkpoint", "mode"): ("parallel", "activation_checkpointing", AC_MODES.get),
    ("compile", "enable"): ("parallel", "compile",  # torchtitan compiles each block
                            lambda v: "blocks" if v is True else False if v is False else None),
    ("checkpoint", "interval"): ("checkpoint", "checkpoint_every_n_steps", _same),
    ("checkpoint", "keep_latest_k"): ("checkpoint", "keep_last_k", _nonzero),
    ("checkpoint", "async_mode"): ("checkpoint", "async_checkpoint",
                                   lambda v: {"disabled": False, "async": True}.get(v)),
    ("metrics", "log_freq"): ("logging", "log_every_n_steps", _same),
    ("comm", "init_timeout_seconds"): ("fault", "init_timeout_s", _same),
    ("comm", "train_timeout_seconds"): ("fault", "collective_timeout_s", _same),
    ("job", "dump_folder"): ("logging", "root_dir", _same),
    ("lr_scheduler", "warmup_steps"): ("optimizer", "warmup_steps", _same),
}
SECTIONS = {s for s, _ in RENAMED} | {"parallelism", "metrics", "float8", "profiling"}
REFUSED = {
    "float8": "trainer.float8 = \"tensorwise\" or \"rowwise\" (torchao's recipes; "
              "trainer.float8_emulate for emulate; under zero2/zero3 tensorwise weights are "
              "all-gathered in float8 with no setting)",
    "profiling": "logging.profile_steps = [...] writes torch.profiler traces of those steps",
    ("training", "gradient_accumulation_steps"): "meshtrain accumulates as global_batch_size / "
    "(data-parallel degree x micro_batch_size) says",
    ("checkpoint", "initial_load_path"): "checkpoint.init_from (Hugging Face safetensors) or "
    "checkpoint.resume (a meshtrain checkpoint folder)",
    ("checkpoint", "folder"): "checkpoints go to <run folder>/checkpoints (logging.root_dir)",
    ("parallelism", "pipeline_parallel_split_points"): "pipeline.split_points (block indices)",
    ("parallelism", "enable_async_tensor_parallel"): "meshtrain's tensor parallel is DTensor's "
    "(no async TP yet)",
    ("parallelism", "fsdp_reshard_after_forward"): "layout zero2=N keeps parameters gathered "
    "between forward and backward, zero3=N (dp_shard) reshards",
}


def from_torchtitan(levels: list[list[tuple[str, str, object, str]]], known: dict
                    ) -> tuple[list[list[tuple[str, str, object, str]]], list[str]]:
    """Each level of entries (the file's, then the overrides': (section, key, value, origin))
    with torchtitan's names turned into meshtrain's, and the lines to print at start. The
    degrees of every level make one layout (a later level's degree wins), set at the last
    level that gave one. ``known``: the job's two-level defaults (a section meshtrain has is
    meshtrain's, but for torchtitan keys it lacks, e.g. [job] dump_folder)."""
    notes, degrees, loggers, outs = [], {}, {}, []
    for entries in levels:
        mine = [e for e in entries if not _is_torchtitan(e[0], e[1], known)]
        out = []
        for section, key, value, origin in entries:
            if (section, key, value, origin) not in mine:
                _translate(section, key, value, origin, out, notes, degrees, loggers)
        outs.append((mine, out))
    for name, (axes, said, made) in {"layout": (degrees, "[parallelism]'s degrees (-1: the "
                                                "processes left)", _layout),
                                     "loggers": (loggers, "[metrics] enable_*", _loggers)}.items():
        if axes:
            _, level, origin = max(axes.values(), key=lambda given: given[1])
            value = made({axis: v[0] for axis, v in axes.items()})
            outs[level][1].append(("trainer" if name == "layout" else "logging", name, value,
                                   origin))
            notes.append(f"torchtitan: {said} is {outs[level][1][-1][0]}.{name}="
                         f"{_toml(value)}")
    for mine, out in outs:
        both = sorted({f"{s}.{k}" for s, k, _, _ in mine} & {f"{s}.{k}" for s, k, _, _ in out})
        if both:
            raise ConfigError(f"{', '.join(both)} given both as itself and by its torchtitan "
                              "name; give one")
    return [mine + out for mine, out in outs], notes


def _translate(section, key, value, origin, out, notes, degrees, loggers) -> None:
    why = REFUSED.get(section) or REFUSED.get((section, key))
    if why:
        raise ConfigError(f"{section}.{key} in {origin} is torchtitan's; meshtrain does it "
                          f"another way: {why}")
    said, level = f"{section}.{key}={_toml(value)}", origin_level(origin)
    if section == "parallelism" and key in DEGREES:
        degrees[DEGREES[key]] = (value, level, origin)
    elif section == "metrics" and key in ("enable_tensorboard", "enable_wandb"):
        loggers[key.removeprefix("enable_")] = (value, level, origin)
    elif (section, key) == ("job", "description"):  # (a label: nothing to run)
        notes.append("torchtitan: job.description is not used")
    else:
        if (section, key) in (("checkpoint", "enable"), ("checkpoint", "enable_checkpoint")):
            to_section, setting, converted = "checkpoint", "save_final_checkpoint", bool(value)
        elif (section, key) in RENAMED:
            to_section, setting, convert = RENAMED[(section, key)]
            converted = convert(value)
        else:
            raise ConfigError(f"{section}.{key} in {origin}: an unknown torchtitan key (meshtrain "
                              "reads torchtitan's [parallelism] degrees, [training], "
                              "[checkpoint], [activation_checkpoint], [compile], [metrics], "
                              "[comm]: docs/reference.md has meshtrain's own)")
        if converted is None:
            raise ConfigError(f"{said} in {origin} (torchtitan's): meshtrain has no such value "
                              f"of {to_section}.{setting}")
        out.append((to_section, setting, converted, origin))
        notes.append(f"torchtitan: {said} is {to_section}.{setting}={_toml(converted)}")


def origin_level(origin: str) -> int:
    """0 for the config file, 1 for an override (resolve's origins)."""
    return 1 if origin.startswith("override") else 0


def _layout(degrees: dict) -> str:
    degrees.setdefault("dp_shard", -1)  # torchtitan's default: FSDP over the rest
    return ",".join(f"{axis}={degrees[axis]}" for axis in DEGREES.values()
                    if axis in degrees and (degrees[axis] != 1 or axis == "dp_shard"))


def _loggers(enabled: dict) -> list[str]:
    return ["csv"] + [name for name in ("tensorboard", "wandb")
                      if enabled.get(name, name == "tensorboard")]


OWN = {*RENAMED, *(k for k in REFUSED if isinstance(k, tuple)),
       *(("parallelism", k) for k in DEGREES), ("checkpoint", "enable"),
       ("checkpoint", "enable_checkpoint"), ("metrics", "enable_tensorboard"),
       ("metrics", "enable_wandb"), ("job", "description")}


def _is_torchtitan(section: str, key: str, known: dict) -> bool:
    if section in known:  # a section of meshtrain's: torchtitan's keys that are not meshtrain's
        return key not in known[section] and (section, key) in OWN
    return section in SECTIONS or section in REFUSED


def _toml(value) -> str:
    return repr(value).replace("True", "true").replace("False", "false") \
        if not isinstance(value, str) else f'"{value}"'
