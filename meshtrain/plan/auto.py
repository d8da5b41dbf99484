"""``layout="auto"``: the planner's pick for the Trainer's own model, machines and batch.

    Trainer(layout="auto", devices=4, global_batch_size=32, ...)       # every axis planned
    Trainer(layout="auto,tp=2", devices=4, activation_checkpointing="full", ...)   # pinned

The layout string's pairs after ``auto`` pin axes (as ``meshtrain plan --pin``); the planned
settings (micro_batch_size, activation_checkpointing, sequence_parallel, pp_schedule,
stages_per_rank) are pinned by giving them a value other than their default. Everything else
is the planner's to choose. The model: meshtrain's GPT and Hugging Face causal LMs from their
configs; any other as it is, probed with the job's sample and loss (plan/own_model.py). The
machines: ``plan_cluster`` (a preset), or this machine's
measured speed on CPU and the GPU's preset (H100, H200) by name. The pick is the fastest
estimated row that the Trainer's own checks accept; under several processes rank 0's pick is
the job's (each rank plans, and a measured machine can differ slightly between ranks).
"""

from __future__ import annotations

import dataclasses

import torch

from meshtrain.errors import ConfigError
from meshtrain.plan.candidate import Candidate, Job
from meshtrain.plan.model_spec import ModelSpec

#: The Trainer settings a pick sets, and their defaults (a value other than these pins it).
PLANNED = {"micro_batch_size": None, "activation_checkpointing": None,
           "sequence_parallel": False, "pp_schedule": "1f1b", "stages_per_rank": 1}


def auto_pins(layout) -> dict | None:
    """None for a concrete layout; for ``"auto"`` / ``"auto,tp=2,..."`` the pinned degrees.
    (``plan_cluster``'s need, layout="auto", is in the settings table.)"""
    head, _, rest = layout.strip().partition(",") if isinstance(layout, str) else ("", "", "")
    if head.strip() != "auto":
        return None
    from meshtrain.plan.planner import parse_pins

    try:
        return parse_pins(rest.strip() or None)
    except ConfigError as error:
        raise ConfigError(f"layout={layout!r}: {error}; write e.g. layout=\"auto,tp=2\"") from None


def model_spec(model: torch.nn.Module | None, example=None, loss_fn=None) -> ModelSpec:
    """What the planner probes: meshtrain's GPT or a Hugging Face causal LM from its config
    (it builds their blocks at other depths on meta); any other model as it is, with the job's
    sample ``example`` (a function giving one batch) and ``loss_fn`` (plan/own_model.py)."""
    from meshtrain.models.gpt import GPT

    if isinstance(model, GPT):
        return ModelSpec.from_config(model.config)
    config = getattr(model, "config", None)
    if model is not None and type(config).__name__ != "dict" and hasattr(
            config, "num_hidden_layers") and hasattr(model, "generate"):
        return ModelSpec.from_config(config)
    if not isinstance(model, torch.nn.Module):  # (a factory that cannot build on meta)
        raise ConfigError('layout="auto" probes the model on the meta device, and the model '
                          "factory cannot build there (it failed under torch.device(\"meta\")); "
                          'give a layout (e.g. layout="zero3=4")')
    from meshtrain.plan.own_model import OwnModelSpec
    from meshtrain.parallel.whole_state import skeleton

    meta = model if all(t.is_meta for t in (*model.parameters(), *model.buffers())) \
        else skeleton(model)
    return OwnModelSpec.from_model(meta, example() if example is not None else None, loss_fn)


def seq_len_of(sample_inputs, spec: ModelSpec) -> int:
    """The training sequence length: the first samples' inputs, else the model's maximum."""
    inputs = sample_inputs() if sample_inputs is not None else None
    if isinstance(inputs, dict):
        inputs = inputs.get("input_ids")
    if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2:
        return int(inputs.shape[1])
    return min(spec.max_seq_len, 2048)


def cluster_for(settings: dict, world_size: int, local_world_size: int, device_type: str):
    """The machines the job runs on, as the planner sees them."""
    from meshtrain.plan.cluster import Cluster

    name = settings["plan_cluster"]
    if name is None:
        if device_type == "cpu":
            name = "this-machine"
        else:
            gpu = torch.cuda.get_device_name()
            name = next((f"8x{k}" for k in ("H200", "H100") if k in gpu), None)
            if name is None:
                raise ConfigError(f'layout="auto" has no figures for {gpu}; set plan_cluster to '
                                  'the nearest preset ("8xH100", "8xH200") or give a layout')
    if name == "this-machine":
        cluster = Cluster.preset(name, processes=world_size)
    else:
        local = min(local_world_size, world_size)
        if world_size % local:
            raise ConfigError(f"{world_size} processes do not fill nodes of {local}")
        cluster = dataclasses.replace(Cluster.preset(name), devices_per_node=local,
                                      nodes=world_size // local)
    dtype = "fp32" if settings["precision"] == "fp32" else "bf16-mixed"
    return dataclasses.replace(cluster, dtype=dtype)


@dataclasses.dataclass
class Pick:
    candidate: Candidate
    settings: dict  # the Trainer settings the pick sets
    summary: str  # what to print: the top rows and why this one


def choose(settings: dict, model, sample_inputs, *, world_size: int, local_world_size: int,
           device_type: str, pins: dict, accepts, example=None, loss_fn=None) -> Pick:
    """The fastest estimated layout whose settings ``accepts(settings)`` takes (the Trainer's
    checks; raises ConfigError when it does not) under the user's pins."""
    from meshtrain.plan.planner import plan, table

    import torch.distributed as dist

    if dist.is_initialized():
        raise ConfigError('layout="auto" plans before the process group exists (it builds the '
                          "model in a simulated world); create the Trainer before "
                          "init_process_group, or give a layout")
    spec = model_spec(model, example, loss_fn)
    cluster = cluster_for(settings, world_size, local_world_size, device_type)
    job = Job(settings["global_batch_size"],
              1 if spec.own else seq_len_of(sample_inputs, spec))
    pinned = {k: settings[k] for k, default in PLANNED.items() if settings[k] != default}
    result = plan(spec, cluster, job, pins=pins, fixed=pinned)
    refused = []
    for estimate in result.rows:
        # the pick's layout replaces "auto", and plan_cluster with it (it needs layout="auto")
        chosen = {**PLANNED, **estimate.candidate.settings(), **pinned, "plan_cluster": None}
        try:
            accepts(chosen)
        except ConfigError as error:
            refused.append(f"{estimate.candidate}: {error}")
            continue
        why = (f'layout="auto" picked {estimate.candidate} (of {len(result.rows)} that fit in '
               f"{cluster.memory / (1 << 30):.1f} GiB per device: the fastest estimated"
               + (f"; {len(refused)} faster refused by the Trainer" if refused else "") + ")")
        return Pick(estimate.candidate, chosen, table(result, cluster, 5) + "\n" + why)
    if refused:
        raise ConfigError(f'layout="auto": every layout that fits was refused; the fastest: '
                          f"{refused[0]}")
    if result.too_big or not pinned:
        raise ConfigError(f'layout="auto": {result.nothing_fits()}')
    names = ", ".join(f"{k}={v!r}" for k, v in pinned.items())
    reasons = sorted({reason for _, reason in result.rejected})
    raise ConfigError(f'layout="auto": no layout takes {names}'
                      + (f" ({'; '.join(reasons[:3])})" if reasons else "")
                      + f"; drop or change {names}")


def plan_layout(trainer, model, meta_model, sample_inputs, check_model, *, loss_fn=None,
                example=None) -> None:
    """Pick the layout for ``trainer`` (made with layout="auto") and take it: the fastest row
    that the Trainer's settings checks and ``check_model(trainer)`` (the model against the
    layout) accept. Prints the planner's top rows and the pick."""
    from meshtrain.loop.layout_settings import use_layout

    t = trainer
    before = dict(t.__dict__)

    def accepts(chosen: dict) -> None:
        from meshtrain.check_skips import collecting

        try:
            use_layout(t, {**t._settings, **chosen}, t.world_size)
            with collecting():  # (what a refused candidate could not check is not said)
                check_model(t)
        except ConfigError:
            t.__dict__.update(before)
            raise

    env = t._env
    pick = choose(t._settings, meta_model if meta_model is not None else model, sample_inputs,
                  world_size=t.world_size, device_type=t.device_type, pins=t._auto_pins,
                  local_world_size=env.local_world_size if env else t.world_size,
                  accepts=accepts, example=example, loss_fn=loss_fn)
    t.print(pick.summary)


def agree(trainer) -> None:
    """(After the process group exists.) Every rank takes rank 0's pick: a measured machine
    can rank two close layouts differently in different processes."""
    import torch.distributed as dist

    t = trainer
    if t._auto_pins is None or t.world_size == 1:
        return
    names = ["layout", *PLANNED]
    mine = {k: t._settings[k] for k in names}
    shared = [mine]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] != mine:
        from meshtrain.loop.layout_settings import use_layout

        use_layout(t, {**t._settings, **shared[0]}, t.world_size)


def resolved_config(config: dict, trainer) -> dict:
    """A recipe's ``config`` sections with layout="auto" replaced by the pick and the settings
    it planned (plan_cluster dropped): the run folder's config.toml then trains the same layout
    again."""
    if trainer._auto_pins is None:
        return config
    from meshtrain.settings import SETTINGS

    out = {section: dict(values) for section, values in config.items()}
    for name in ("layout", "plan_cluster", *PLANNED):  # the pick's layout ("dp=1", not "single")
        out.setdefault(SETTINGS[name].section, {})[name] = trainer._settings[name]
    return out
