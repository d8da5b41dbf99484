"""Callbacks whose state outlives a resume: EMA's and SWA's averages are saved in checkpoints
as each rank holds them (shards under zero3) and loaded on another layout, so a run resumed
elsewhere ends with the averages of the uninterrupted one."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import quiet_trainer
from test_training_module import BATCH, _model, images

import meshtrain
from meshtrain.launch.spawn import run_workers

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
CHECKPOINT = "checkpoints/step_00000003"


def _averages(run_dir, layout, resume=None):
    """Six steps with EMA and SWA (from step 2) on ``layout``, a checkpoint every 3 steps (or
    resumed from ``resume``): rank 0's whole averages, and the steps this run trained."""
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    ema, swa = meshtrain.EMA(decay=0.7), meshtrain.SWA(start_step=2, swap_at_end=False)
    steps = []

    class Count(meshtrain.Callback):
        def on_train_step_end(self, trainer, metrics):
            steps.append(trainer.global_step)

    trainer = quiet_trainer(run_dir, **({"layout": layout} if layout else {}), max_steps=6,
                            global_batch_size=BATCH, shuffle=False, checkpoint_every_n_steps=3,
                            resume=resume, callbacks=[ema, swa, Count()])
    trainer.fit(_model, images())
    whole = {f"{which}.{n}": (v.full_tensor() if isinstance(v, DTensor) else v).cpu()
             for which, weights in (("ema", ema.weights()), ("swa", swa.weights()))
             for n, v in weights.items()}
    return (whole, steps, swa.num_averaged) if int(os.environ.get("RANK", 0)) == 0 else None


@pytest.mark.timeout(150)
def test_ema_and_swa_resume_from_zero3_on_one_process_as_if_uninterrupted(tmp_path):
    full, steps, count = _averages(str(tmp_path / "one"), None)
    assert steps == [1, 2, 3, 4, 5, 6] and count == 5
    run_workers(_averages, 2, (str(tmp_path / "z3"), "zero3=2"), timeout=120)
    resumed, steps, count = _averages(str(tmp_path / "again"), None,
                                      resume=str(tmp_path / "z3" / CHECKPOINT))
    assert steps == [4, 5, 6] and count == 5  # SWA's count came back with the averages
    assert set(resumed) == set(full)
    for name, value in full.items():
        assert torch.allclose(resumed[name], value, atol=1e-5, rtol=0), name


def test_a_checkpoint_without_the_callback_leaves_its_state_and_says_so(tmp_path, capsys):
    quiet_trainer(tmp_path / "plain", max_steps=3, global_batch_size=BATCH, shuffle=False,
                  checkpoint_every_n_steps=3).fit(_model, images())
    ema = meshtrain.EMA(decay=0.5)
    trainer = quiet_trainer(tmp_path / "ema", max_steps=4, global_batch_size=BATCH,
                            shuffle=False, resume=str(tmp_path / "plain" / CHECKPOINT),
                            callbacks=[ema])
    trainer.fit(_model, images())
    assert "EMA: not in the checkpoint" in capsys.readouterr().out
    assert trainer.global_step == 4
