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


def failing_on_meta():
    model = mlp()
    model[0].weight.numpy()  # (a meta tensor has no data)
    return model


def test_a_model_the_planner_cannot_probe_is_refused(tmp_path):
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=2, global_batch_size=16,
                                       layout="auto", devices=2))
    with pytest.raises(ConfigError, match='cannot build there.*give a layout'):
        trainer.check(failing_on_meta, regression_data(), optimizer=adamw_gpt,
                      loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(ConfigError, match='could not probe Sequential.*Give a layout'):
        trainer.check(mlp, regression_data(), optimizer=adamw_gpt,
                      loss_fn=lambda output, target: output.sum().item())  # not on meta


class CNN(torch.nn.Module):
    """A user's own image classifier: nothing meshtrain knows, no config."""

    def __init__(self):
        super().__init__()
        conv = dict(kernel_size=3, padding=1)
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, **conv), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, **conv),
            torch.nn.ReLU(), torch.nn.Conv2d(8, 8, **conv), torch.nn.ReLU())
        self.head = torch.nn.Linear(8 * 6 * 6, 5)

    def forward(self, images):
        return self.head(self.features(images).flatten(1))


def image_data(seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(64, 3, 6, 6, generator=gen),
                                          torch.randint(0, 5, (64,), generator=gen))


class Block(torch.nn.Module):
    def __init__(self, width: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, -1).unbind(2)
        y = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(torch.nn.Module):
    """A user's own causal transformer written with F.scaled_dot_product_attention."""

    def __init__(self, vocab: int = 32, width: int = 16, depth: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


CNN_FNS = dict(model_fn=CNN, data_fn=image_data, loss_fn=torch.nn.functional.cross_entropy,
               optimizer_fn=adamw_gpt)
TRANSFORMER_FNS = dict(model_fn=TinyTransformer, data_fn=token_data, loss_fn=lm_loss,
                       optimizer_fn=adamw_gpt)


@pytest.mark.parametrize("fns, blocks", [(CNN_FNS, 3), (TRANSFORMER_FNS, 4)])
def test_auto_plans_a_users_own_model(tmp_path, fns, blocks, capsys):
    """A model of the user's own (no config meshtrain knows) is probed as it is, on meta with
    the job's sample and loss: its blocks priced (the CNN's repeated convolutions, the
    transformer's layers), data parallel and pp planned, tp and cp refused with the reason."""
    from meshtrain.plan.own_model import OwnModelSpec
    from meshtrain.plan.auto import model_spec
    from meshtrain import checks

    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=2, global_batch_size=16,
                                       layout="auto", devices=4))
    trainer.check(fns["model_fn"], fns["data_fn"](), optimizer=adamw_gpt, loss_fn=fns["loss_fn"])
    out = capsys.readouterr().out
    picked = re.search(r'layout="auto" picked (\S+)', out).group(1)
    assert str(trainer.layout).split(",")[0].split("=")[0] in picked, (picked, trainer.layout)
    assert "for tp give a layout" in out and "for cp give a layout" in out
    with torch.device("meta"):
        meta = fns["model_fn"]()
    spec = model_spec(meta, lambda: checks.first_batch(fns["data_fn"](), 1), fns["loss_fn"])
    assert isinstance(spec, OwnModelSpec) and spec.num_layers == blocks
    assert spec.pipelines == (fns is TRANSFORMER_FNS)  # (the CNN's blocks are not model.layers)
    from meshtrain.plan.probe import probe_own

    probe = probe_own(spec)
    assert probe.block.saved > 0 and probe.block.flops > 2 * probe.block.forward_flops > 0
    assert probe.last.saved > 0 and probe.block.inputs > 0


@pytest.mark.parametrize("fns, devices", [(CNN_FNS, 2), (TRANSFORMER_FNS, 4)],
                         ids=["cnn", "transformer"])
def test_auto_trains_a_users_own_model_like_one_process(fns, devices):
    """(The transformer on 4 processes: here, 2026-11-28, the pick was pp=2,dp=2 mb=4, a
    pipeline cutting the user's own blocks; a faster machine may pick dp=4.)"""
    assert_parity("auto", devices, steps=4, fns=fns)


def test_auto_trains_like_one_process():
    """Each rank plans on this machine's measured speed; rank 1 here ranks the rows backwards,
    so its own pick differs: it takes rank 0's, and every rank matches one process."""
    assert_parity("auto", 2, steps=4, fns=GPT_FNS, setup=rank_1_plans_backwards)


def test_auto_outside_the_trainer_names_the_way_to_the_pick():
    from meshtrain.parallel.layout import Layout, LayoutError

    for spec in ("auto", "auto,tp=2"):
        with pytest.raises(LayoutError, match="the Trainer's to plan.*--trainer.layout=auto --dry-run"):
            Layout.parse(spec, 4)


def test_auto_plans_a_users_own_model_given_as_an_object(tmp_path):
    """The path a user takes first: the model built, not a factory (probed on a meta copy)."""
    trainer = Trainer(**trainer_kwargs(tmp_path, max_steps=2, global_batch_size=16,
                                       layout="auto", devices=2))
    model = CNN()
    trainer.check(model, image_data(), optimizer=adamw_gpt,
                  loss_fn=torch.nn.functional.cross_entropy)
    assert trainer.layout.world_size == 2 and not next(model.parameters()).is_meta
