"""No setting silently does nothing: every setting of the table (meshtrain/settings/table.py),
given a value other than the run's, either changes what a run does or is refused before any
process starts, in one process and under dp=2 (two processes); and each changes a run somewhere
(``effect``: a layout, data or other settings where it applies). A setting added to the table
needs a probe here, and a probe that changes nothing fails: so does a setting nothing reads.

What "changes a run" means is tests/settings_walk.py's fingerprint: what the run did (steps,
metrics, parameters, files, output, forward calls, threads, processes, signal handlers,
process groups' timeouts, the modules and meshtrain objects built), never the settings given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from meshtrain.launch.spawn import run_workers
from meshtrain.settings import SETTINGS

from settings_walk import run_configs
from walk_jobs import make_context

# Every run: 3 steps of a tiny GPT, 16 samples each (an epoch is 2 steps), quiet; a probe's value
# differs from these (e.g. loggers=["csv"], report=True).
COMMON = dict(accelerator="cpu", max_steps=3, global_batch_size=16, log_every_n_steps=1,
              loggers=(), progress_bar=False, report=False, model_summary=False,
              save_final_checkpoint=False, peak_tflops=1.0)
# Under dp=2 no straggler check besides straggler_margin's own probe: a 3-step run on a busy
# machine can look like one (a warning now and then: noise).
TWO = dict(devices=2, straggler_margin=None)
MAKE = lambda name: {"make": name}  # noqa: E731 - an object made where the run is (walk_jobs)
PP4 = {"layout": "pp=2", "job": "lm4"}  # a pipeline of two stages of 2 blocks each


@dataclass(frozen=True)
class Probe:
    """``value`` given on top of ``base`` (what the setting needs besides the layout) must be
    refused or change the run in each of ``worlds`` ("one": one process, "two": dp=2), and
    change it in ``effect`` (settings on top of ``base``, with "world": 1, 2, 3 or "fresh" (2
    processes that have not trained yet) and "job") or, without an effect, in a world.
    ``mode``: "plan" (the Trainer's plan only), "prepare" (no training step) or "fit"."""

    value: object
    base: dict = field(default_factory=dict)
    effect: dict | None = None
    job: str = "lm"
    mode: str = "fit"
    worlds: tuple = ("one", "two")
    errors: tuple = ()  # what a run may end with (NaN under nan_policy="error", a wrong plan)


PROBES = {
    # -- trainer
    "layout": Probe("tp=2"),
    "plan_cluster": Probe("8xH200", effect={"world": 1, "layout": "auto",
                                            "plan_cluster": "8xH100"}),
    "devices": Probe(4, mode="plan"),
    # refused without a GPU; with one, one process (a GPU takes one NCCL rank, not two)
    "accelerator": Probe("cuda", worlds=("one",) if torch.cuda.is_available() else ("one", "two")),
    "max_steps": Probe(2),
    "max_epochs": Probe(1),
    "max_time_minutes": Probe(1e-9),
    "global_batch_size": Probe(8),
    "micro_batch_size": Probe(4),
    "grad_clip_norm": Probe(1e-3),
    "precision": Probe("bf16-mixed"),
    "float8": Probe("tensorwise"),  # refused on CPU without float8_emulate
    "float8_emulate": Probe(True),  # refused without float8
    "seed": Probe(1),
    "shuffle": Probe(False),
    "val_every_n_steps": Probe(1),
    "val_every_n_epochs": Probe(1),
    "limit_train_batches": Probe(1),
    "limit_val_batches": Probe(1),
    "metrics": Probe(["perplexity"]),
    # (run_workers' processes are daemons, which may not start DataLoader workers)
    "num_workers": Probe(1, worlds=("one",)),
    "callbacks": Probe(MAKE("stop_after_one_step")),
    # -- parallel
    "bucket_cap_mb": Probe(1e-4),
    "comm_hook": Probe("bf16"),
    "powersgd_rank": Probe(2, base={"comm_hook": "powersgd"}),
    "offload": Probe("cpu"),  # (refused on CPU)
    "local_comm": Probe("backend", effect={"layout": "zero3=2"}),
    "shard_unit_mb": Probe(1e-6, effect={"layout": "zero3=2"}),
    "activation_checkpointing": Probe("full"),
    "compile": Probe(True, mode="prepare"),  # (compiled at the first step: seconds)
    "blocks": Probe(MAKE("first_block"), base={"activation_checkpointing": "full"}),
    "meta_init": Probe(False, effect={"layout": "zero3=2"}),
    "sequence_parallel": Probe(True, effect={"layout": "tp=2"}),
    "loss_parallel": Probe(True, effect={"layout": "tp=2"}),
    "local_sgd_every": Probe(1),
    "outer_lr": Probe(0.7, base={"local_sgd_every": 1}),
    "outer_momentum": Probe(0.5, base={"local_sgd_every": 1, "outer_lr": 0.7}),
    "ps_mode": Probe("async", effect={"world": 3, "layout": "ps=1,dp=2"}),
    "ps_staleness": Probe(0, base={"ps_mode": "async"}),
    "sync_batchnorm": Probe(False, effect={"job": "bn"}),
    "tp_plan": Probe(MAKE("mlp_only_plan"), effect={"layout": "tp=2"}),
    "tp_check_steps": Probe(0, effect={"layout": "tp=2", "job": "scaled",
                                       "tp_plan": MAKE("scaled_plan")},
                            errors=("ConfigError",)),
    # -- pipeline
    "pp_schedule": Probe("gpipe", effect=PP4),
    "stages_per_rank": Probe(2, effect={**PP4, "pp_schedule": "interleaved-1f1b"}),
    "pp_balance": Probe("memory", effect=PP4),
    "split_points": Probe([1], effect=PP4),
    # -- checkpoint
    "checkpoint_every_n_steps": Probe(1),
    "checkpoint_every_n_epochs": Probe(1),
    "checkpoint_every_n_minutes": Probe(1e-9),
    "keep_last_k": Probe(1, base={"checkpoint_every_n_steps": 1}),
    # (one process here; two ranks write in the background in
    # tests/checkpoint/test_trainer_checkpoints.py)
    "async_checkpoint": Probe(True, base={"checkpoint_every_n_steps": 1}, worlds=("one",)),
    "resume": Probe(MAKE("checkpoint")),
    "init_from": Probe(MAKE("hf_folder")),
    "save_final_checkpoint": Probe(True),
    "stop_on_signal": Probe("SIGUSR2"),
    # -- fault
    "nan_policy": Probe("skip", job="nan", errors=("NonFiniteError",)),
    "collective_timeout_s": Probe(500.0),
    "init_timeout_s": Probe(500.0),
    "stall_timeout_s": Probe(None),
    "debug_collectives": Probe(True, effect={"world": "fresh"}),
    "mtbf_hours": Probe(5.0, base={"checkpoint_every_n_steps": 1}),
    "sdc_check_every_n_steps": Probe(1),  # (the replay's forward calls)
    # -- logging
    "log_every_n_steps": Probe(10),
    "log_grad_norm": Probe(True),
    "loggers": Probe(["csv"]),
    "progress_bar": Probe(True),
    "model_summary": Probe(True),
    "report": Probe(True),
    "breakdown_every_n_steps": Probe(None, base={"straggler_margin": 0.2}),
    # rank 1 reads its data 160 ms a step; steps 3 to 6 (DDP's first two are start-up)
    "straggler_margin": Probe(0.5, job="slow", base={"max_steps": 6}),
    "profile_steps": Probe([1]),
    "peak_tflops": Probe(2.0),
    "root_dir": Probe("elsewhere"),
    "name": Probe("walked"),
    "run_dir": Probe("here"),
}
# What the walk's CPU runs cannot show changing a run (refused in every world): offload needs a
# GPU job, accelerator="cuda" a GPU (with one, the walk requires it to change the run).
GPU_ONLY = {"offload"} | ({"accelerator"} if not torch.cuda.is_available() else set())
# ps_staleness bounds how far an async worker runs ahead of the slowest: it changes only how
# long a fast worker waits (timing, which the suite does not assert; tests/parallel/
# test_parameter_server.py checks the bound itself), so its effect is not walked here.
TIMING_ONLY = {"ps_staleness"}
# float8 runs on CPU only with float8_emulate, and float8_emulate only with float8: a probe sets
# one setting over a base that must run, so the walk sees each refused alone;
# tests/test_float8.py trains with both (the float8 layers counted, the loss off bf16's).
PAIRED = {"float8", "float8_emulate"}


def _configs(name: str, probe: Probe) -> dict:
    """(where, which) -> (the processes it runs on: "1", "2", "3" or "fresh", the config): base
    and probe in each world and in the effect."""
    out = {}
    for world in probe.worlds:
        devices = TWO if world == "two" else {}
        for which, extra in (("base", {}), ("probe", {name: probe.value})):
            out[world, which] = ("1" if world == "one" else "2", dict(
                settings={**COMMON, **devices, **probe.base, **extra}, job=probe.job,
                mode=probe.mode, errors=probe.errors))
    if probe.effect is not None:
        effect = dict(probe.effect)
        world, job = str(effect.pop("world", 2)), effect.pop("job", probe.job)
        devices = {} if world == "1" else {**TWO, "devices": 2 if world == "fresh" else int(world)}
        for which, extra in (("base", {}), ("probe", {name: probe.value})):
            # fresh: the probe alone in processes that have not trained (its base: dp=2's)
            runs_on = "2" if world == "fresh" and which == "base" else world
            out[f"effect-{world}", which] = (runs_on, dict(
                settings={**COMMON, **devices, **probe.base, **effect, **extra}, job=job,
                mode=probe.mode, errors=probe.errors))
    return out


def _key(config: dict) -> str:
    return repr(sorted((k, repr(v)) for k, v in config.items()))


def _walk(tmp_path) -> dict:
    """Every probe's configurations, each run once (a configuration shared by probes, e.g. the
    plain run, once), and the plain run once more: {(setting, where, which): result per rank},
    with ("again", world, "base") the plain run's second time."""
    plan = {name: _configs(name, probe) for name, probe in PROBES.items()}
    plain = {world: dict(settings={**COMMON, **devices}, job="lm", mode="fit", errors=())
             for world, devices in (("1", {}), ("2", TWO))}
    plan["again"] = {(world, "base"): (world, dict(config, again=True))
                     for world, config in plain.items()}
    plan["plain"] = {(world, "base"): (world, config) for world, config in plain.items()}
    groups: dict[str, dict[str, dict]] = {}  # processes -> {key: config}
    for configs in plan.values():
        for runs_on, config in configs.values():
            groups.setdefault(runs_on, {}).setdefault(_key(config), config)
    ctx = make_context(tmp_path)
    results = {}
    for world, configs in groups.items():
        order = sorted(configs, key=lambda k: bool(configs[k]["errors"]))  # failing runs last
        runs = [dict(configs[k], cwd=f"{world}-{i}") for i, k in enumerate(order)]
        if world == "1":
            per_rank = [run_configs(runs, ctx)]
        else:
            size = 2 if world in ("2", "fresh") else int(world)
            per_rank = run_workers(run_configs, size, (runs, ctx), timeout=240)
        for i, key in enumerate(order):
            results[world, key] = [rank[i] for rank in per_rank]
    return {(name, where, which): results[runs_on, _key(config)]
            for name, configs in plan.items()
            for (where, which), (runs_on, config) in configs.items()}


def _differs(base: list, probe: list) -> list[str]:
    """The parts of the fingerprints (on any rank) that differ."""
    return sorted({part for b, p in zip(base, probe, strict=True) for part in b["fingerprint"]
                   if b["fingerprint"][part] != p["fingerprint"].get(part)})


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("one_thread")
def test_every_setting_changes_the_run_or_is_refused(tmp_path):
    assert set(PROBES) == set(SETTINGS), (
        f"settings without a probe: {sorted(set(SETTINGS) - set(PROBES))}; probes of no "
        f"setting: {sorted(set(PROBES) - set(SETTINGS))}")
    results = _walk(tmp_path)
    for world in ("1", "2"):  # the fingerprint is not noise: the plain run twice is the same
        assert not _differs(results["plain", world, "base"], results["again", world, "base"])
    failures, changed = [], set()
    for name in PROBES:
        for where in sorted({where for (n, where, _) in results if n == name}):
            base, new = results[name, where, "base"], results[name, where, "probe"]
            refused = new[0].get("refused")
            if "refused" in base[0]:  # what the probe needs besides is refused here too
                if where.startswith("effect") or not refused:
                    failures.append(f"{name} @ {where}: its base is refused: {base[0]}")
            elif refused is not None:
                if where.startswith("effect"):
                    failures.append(f"{name} @ {where}: refused where it applies: {refused}")
                elif name not in refused:
                    failures.append(f"{name} @ {where}: refused without its name: {refused}")
            elif _differs(base, new):
                changed.add(name)
            else:
                failures.append(f"{name} @ {where}: changes nothing")
        if name not in changed | GPU_ONLY | TIMING_ONLY | PAIRED:
            failures.append(f"{name}: changes no run anywhere")
    assert not failures, "\n".join(failures)
