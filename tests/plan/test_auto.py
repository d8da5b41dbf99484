"""layout="auto": the Trainer takes the planner's pick for its own model, machines and batch,
under the user's pins, trains like one process, and refuses before any process starts what
cannot be planned (meshtrain/plan/auto.py)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import rank_1_plans_backwards, trainer_kwargs
from parity import GPT_FNS, adamw_gpt, assert_parity, lm_loss, mlp, regression_data, tiny_gpt
from parity import tiny_gpt_4_layers, token_data

from meshtrain import Trainer
from meshtrain.errors import ConfigError
from meshtrain.plan.cluster import Cluster
from meshtrain.plan.estimate import Job
from meshtrain.plan.model_spec import ModelSpec
from meshtrain.plan.planner import plan

pytestmark = pytest.mark.timeout(300)


def checked(tmp_path, model=tiny_gpt, **settings) -> Trainer:
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=2, global_batch_size=16, **settings))
    trainer.check(model, token_data(), optimizer=adamw_gpt, loss_fn=lm_loss)
    return trainer


def test_the_pick_is_the_planners_fastest_row(tmp_path, capsys):
    trainer = checked(tmp_path, layout="auto", devices=4, plan_cluster="8xH100")
    spec = ModelSpec.from_config(tiny_gpt().config)
    cluster = Cluster.preset("8xH100")
    cluster = type(cluster)(**{**cluster.__dict__, "devices_per_node": 4, "dtype": "fp32"})
    best = plan(spec, cluster, Job(16, token_data()[0][0].shape[0])).rows[0].candidate
    assert str(trainer.layout) == str(type(trainer.layout).parse(best.layout, 4))
    assert trainer.micro_batch_size == best.micro_batch
    assert trainer.activation_checkpointing == best.activation_checkpointing
    assert trainer.layout.world_size == 4
    out = capsys.readouterr().out
    assert f'layout="auto" picked {best}' in out and "GiB/dev" in out  # the table, then why


def test_pins_are_kept(tmp_path):
    trainer = checked(tmp_path, layout="auto,tp=2", devices=4, plan_cluster="8xH100",
                      activation_checkpointing="full", micro_batch_size=2)
    assert trainer.layout.degree("tp") == 2 and trainer.layout.world_size == 4
    assert trainer.activation_checkpointing == "full" and trainer.micro_batch_size == 2
    # a pipeline setting pins a pipeline: 2 blocks cannot be split, 4 can
    with pytest.raises(ConfigError, match="pp=2 leaves fewer than 2 of 2 blocks per stage"):
        checked(tmp_path, layout="auto", devices=4, plan_cluster="8xH100", pp_schedule="gpipe")
    trainer = checked(tmp_path, tiny_gpt_4_layers, layout="auto", devices=4,
                      plan_cluster="8xH100", pp_schedule="gpipe")
    assert trainer.layout.degree("pp") > 1 and trainer.pp_schedule == "gpipe"


H100 = dict(devices=4, plan_cluster="8xH100")


def test_the_pick_drops_plan_cluster_so_its_config_trains_again(tmp_path):
    """plan_cluster needs layout="auto" (the settings table): the run folder's config.toml,
    with the pick's layout, leaves it out, so running that config again is not refused."""
    from meshtrain.plan.auto import resolved_config
    from meshtrain.settings import flatten

    trainer = checked(tmp_path, layout="auto", **H100)
    config = {"trainer": {"layout": "auto", "devices": 4, "plan_cluster": "8xH100"}}
    again = flatten(resolved_config(config, trainer))
    assert again["layout"] == str(trainer.layout) and again["plan_cluster"] is None
    Trainer(**trainer_kwargs(tmp_path, max_steps=2, global_batch_size=16, **again))
    with pytest.raises(ConfigError, match="used by layout='auto' only"):
        Trainer(**trainer_kwargs(tmp_path, max_steps=2, global_batch_size=16,
                                 **{**again, "plan_cluster": "8xH100"}))


@pytest.mark.parametrize("settings, words", [
    (dict(layout="auto,tp=3", **H100), "tp=3 does not divide 4 devices"),
    (dict(layout="auto,tp=4", **H100), "tp=4 does not divide the 2 heads"),
    (dict(layout="auto", micro_batch_size=3, **H100), "micro_batch_size=3 does not divide"),
    (dict(layout="auto,tq=2", **H100), "layout='auto,tq=2'"),
    (dict(layout="dp=2", devices=2, plan_cluster="8xH100"), "drop plan_cluster"),
])
def test_what_cannot_be_planned_is_refused_before_any_process(tmp_path, settings, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        checked(tmp_path, **settings)
    assert not torch.distributed.is_initialized()


def test_a_model_the_planner_cannot_probe_is_refused(tmp_path):
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=2, global_batch_size=16,
                                       layout="auto", devices=2))
    with pytest.raises(ConfigError, match='Give a layout'):
        trainer.check(mlp, regression_data(), optimizer=adamw_gpt,
                      loss_fn=torch.nn.functional.mse_loss)


def test_auto_trains_like_one_process():
    """Each rank plans on this machine's measured speed; rank 1 here ranks the rows backwards,
    so its own pick differs: it takes rank 0's, and every rank matches one process."""
    assert_parity("auto", 2, steps=4, fns=GPT_FNS, setup=rank_1_plans_backwards)


def test_auto_outside_the_trainer_names_the_way_to_the_pick():
    from meshtrain.parallel.layout import Layout, LayoutError

    for spec in ("auto", "auto,tp=2"):
        with pytest.raises(LayoutError, match="the Trainer's to plan.*--trainer.layout=auto --dry-run"):
            Layout.parse(spec, 4)
