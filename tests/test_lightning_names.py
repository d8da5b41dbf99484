"""Lightning's Trainer arguments (meshtrain/settings/lightning.py): one that means a meshtrain
setting is that setting, said at start (``strategy="fsdp", devices=2`` trains as one process
does); one meshtrain does another way is refused before anything starts, with that way.
tests/test_training_module_lightning.py gives the same arguments to Lightning's Trainer and to
meshtrain's: the same weights."""

import datetime

import pytest
import torch
from parity import F64_TOL, GRAD_NORMS, compare_ranks, run_ranks, train_state

from meshtrain import Callback, Trainer
from meshtrain.errors import ConfigError


def test_lightning_names_are_meshtrain_settings(tmp_path):
    lightning = Trainer(strategy="fsdp", devices=2, precision=32, gradient_clip_val=0.5,
                        max_time="00:01:30:00", default_root_dir=tmp_path,
                        val_check_interval=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        accumulate_grad_batches=1, num_sanity_val_steps=0, deterministic=False)
    ours = Trainer(layout="zero3=2", devices=2, precision="fp32", grad_clip_norm=0.5,
                   max_time_minutes=90, root_dir=tmp_path, val_every_n_steps=5, loggers=[],
                   save_final_checkpoint=False, progress_bar=False, model_summary=False)
    assert lightning.hparams() == ours.hparams()
    assert str(lightning.layout) == "dp_shard=2"
    assert "lightning: strategy='fsdp' is layout='zero3=-1'" in lightning.loader_notes[0]
    for strategy, layout in [("ddp", "dp=2"), ("deepspeed_stage_2", "zero2=2"),
                             ("deepspeed_stage_1", "zero1=2")]:
        assert str(Trainer(strategy=strategy, devices=2).layout) == layout
    assert Trainer(max_time=datetime.timedelta(hours=2)).max_time_minutes == 120
    assert Trainer(max_time={"days": 1, "minutes": 30}).max_time_minutes == 24 * 60 + 30
    assert Trainer(precision="bf16").precision_name == "bf16-mixed"
    assert Trainer(precision="16-mixed").precision_name == "fp16-mixed"
    assert Trainer(gradient_clip_val=0).grad_clip_norm is None  # Lightning's 0: no clipping


@pytest.mark.parametrize("keywords, says", [
    ({"accumulate_grad_batches": 4}, "global_batch_size=K\\*B, micro_batch_size=B"),
    ({"fast_dev_run": True}, "max_steps=1, limit_val_batches=1"),
    ({"strategy": "ddp", "layout": "dp=2"}, "both given"),
    ({"strategy": object()}, "strategy objects are not read; give layout="),
    ({"strategy": "xla"}, "give layout="),
    ({"gradient_clip_algorithm": "value"}, "clips by the norm of all gradients only"),
    ({"logger": object()}, "loggers=\\['csv'"),
    ({"num_nodes": 2}, "the launcher decides the nodes"),
    ({"max_time": "2h"}, "DD:HH:MM:SS"),
    ({"val_check_interval": 0.25}, "val_every_n_steps"),
    ({"num_sanity_val_steps": 2}, "runs no validation before training"),
])
def test_what_meshtrain_does_another_way_is_refused_with_that_way(keywords, says):
    with pytest.raises(ConfigError, match=says):
        Trainer(**keywords)


@pytest.mark.timeout(180)
def test_lightnings_fsdp_strategy_with_clipping_trains_as_one_process():
    common = dict(max_steps=6, global_batch_size=16, log_grad_norm=True)
    reference = train_state(dict(common, grad_clip_norm=0.05), float64=True)
    assert float(reference[GRAD_NORMS].min()) > 0.05  # the clipping bites at every step
    ranks = run_ranks(dict(common, strategy="fsdp", devices=2, gradient_clip_val=0.05,
                           precision="32-true"), 2, float64=True)
    compare_ranks(reference, ranks, tol=F64_TOL, relative=True,
                  label="strategy='fsdp' on 2 ranks in float64")


def test_a_callback_written_for_lightning_is_refused_at_once_naming_meshtrains_hook():
    class EpochEnd(Callback):
        def on_train_epoch_end(self, trainer, pl_module):  # Lightning's arguments
            pass

    class BatchEnd(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pass

    class Fine(Callback):
        def on_train_step_end(self, trainer, metrics):
            pass

        def on_exception(self, trainer, *args):
            pass

    with pytest.raises(ConfigError, match=r"meshtrain calls on_train_epoch_end\(trainer\) "
                                          r"\(Lightning's pl_module is trainer.model\)"):
        Trainer(callbacks=[EpochEnd()])
    with pytest.raises(ConfigError, match="on_train_batch_end is a Lightning callback hook that "
                                          "meshtrain never calls; use on_train_step_start"):
        Trainer(callbacks=[BatchEnd()])
    Trainer(callbacks=[Fine()])


def test_lightnings_seed_everything_is_the_runs_seed(monkeypatch):
    """lightning.seed_everything(N) before the Trainer: the Trainer seeds N, not its own
    default 0 over it (which made every seed_everything value train alike); a seed given to
    the Trainer still wins."""
    lightning = pytest.importorskip("lightning")
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # (restored after the test)
    lightning.seed_everything(7)
    trainer = Trainer(loggers=())
    assert trainer.seed == 7 and any("seed_everything(7) is seed=7" in n
                                     for n in trainer.loader_notes)
    drawn = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.rand(3))
    assert Trainer(loggers=(), seed=3).seed == 3
