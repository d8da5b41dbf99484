"""A Trainer takes a layout: its settings checked against it, the batch plan and the options each
strategy reads (``Trainer.__init__``, and layout="auto" once the planner has picked)."""

from __future__ import annotations

from meshtrain import checks
from meshtrain.data.user_loader import loader_settings
from meshtrain.errors import ConfigError
from meshtrain.models.hf import (hf_call_kwargs, hf_cp_support, hf_expert_layers, hf_loss_items,
                                hf_pp_support, hf_router_loss, hf_tp_plans)
from meshtrain.parallel.apply import ParallelOptions
from meshtrain.parallel.batch_plan import plan_batches
from meshtrain.parallel.pipeline.engine import PipelineOptions


def use_layout(t, s: dict, world_size: int) -> None:
    """Give Trainer ``t`` the settings ``s`` with their layout over ``world_size`` processes
    (raises ConfigError, changing nothing, when a setting does not apply to it)."""
    layout = checks.parse_layout(s["layout"], world_size, t._env)
    checks.check_settings_apply(layout, s)
    pipeline_options = PipelineOptions.from_settings(s, layout, hf_pp_support)
    batch_plan = plan_batches(layout, s["global_batch_size"], s["micro_batch_size"],
                              s["stages_per_rank"])
    parallel_options = ParallelOptions.from_settings(s, hf_tp_plans(
        layout.degree("tp"), s["sequence_parallel"], s["loss_parallel"]), hf_cp_support,
        hf_loss_items, hf_router_loss, hf_expert_layers, hf_call_kwargs)
    t._settings, t.layout, t.batch_plan = s, layout, batch_plan
    t.world_size = layout.world_size  # the mesh's ranks (not ps servers)
    t.micro_batch_size = batch_plan.micro_batch_size
    t.grad_accum_steps = batch_plan.grad_accum_steps
    t.pipeline_options, t.parallel_options = pipeline_options, parallel_options


def take_loader_settings(t, data) -> None:
    """A DataLoader given as training data lends the settings left at their default (its batch
    size, its order: meshtrain.data.user_loader); the batch plan follows. The lines saying so
    are printed at start (``t.loader_notes``)."""
    s, notes = loader_settings(data, t._settings, t._given)
    t.loader_notes = [n for n in t.loader_notes if not n.startswith("data: ")] + notes
    if s == t._settings:
        return
    if t._auto_pins is None:
        use_layout(t, s, t._processes)
    elif t.layout is None:  # layout="auto" not planned yet: planned with these
        t._settings = s
    else:
        raise ConfigError(
            "layout='auto' was planned for global_batch_size="
            f"{t._settings['global_batch_size']} before train_data's DataLoader (built by a "
            f"function) gave batch_size={s['global_batch_size']}; set global_batch_size")
