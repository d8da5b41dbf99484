"""Pipeline layouts through the Trainer reproduce one-process training (a 4-block GPT)."""

import json
import os

import pytest
import torch
from conftest import quiet_trainer
from parity import GPT4_FNS, adamw, assert_parity, token_data

from meshtrain.checkpoint.export import export_model
from meshtrain.launch.spawn import run_workers


@pytest.mark.timeout(200)
@pytest.mark.parametrize("pipeline", [
    dict(pp_schedule="1f1b"),
    dict(pp_schedule="gpipe"),
    # the stages on gloo's own send/recv (the others pass them through shared memory)
    dict(pp_schedule="interleaved-1f1b", stages_per_rank=2, local_comm="backend"),
    dict(pp_schedule="zero-bubble"),
])
def test_pp2_schedules_match_one_process(pipeline):
    assert_parity("pp=2", 2, steps=10, fns=GPT4_FNS, parallel_kwargs=pipeline)


@pytest.mark.timeout(200)
def test_pp2_with_clipping_by_the_norm_over_all_stages():
    assert_parity("pp=2", 2, steps=10, fns=GPT4_FNS, grad_clip_norm=0.05)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["pp=2,dp=2", "pp=2,dp_shard=2"])
def test_pp2_with_data_parallel_matches_one_process(layout):
    assert_parity(layout, 4, steps=6, fns=GPT4_FNS, micro_batch_size=2)


def _fit_with_validation(run_dir, layout):
    torch.set_num_threads(1)
    trainer = quiet_trainer(run_dir, layout=layout, max_steps=4, save_final_checkpoint=True)
    trainer.fit(GPT4_FNS["model_fn"], token_data(), token_data(seed=7), optimizer=adamw,
                loss_fn=GPT4_FNS["loss_fn"])
    if int(os.environ.get("RANK", 0)) == 0:
        return trainer.callback_metrics["val/loss"], trainer.callback_metrics["train/loss"]


@pytest.mark.timeout(200)
def test_pp2_validation_loss_and_checkpoint_match_one_process(tmp_path):
    val_pp, train_pp = run_workers(_fit_with_validation, 2, (str(tmp_path / "pp"), "pp=2"))[0]
    val_one, train_one = _fit_with_validation(str(tmp_path / "one"), None)
    assert (tmp_path / "pp" / "pipeline_timeline.png").stat().st_size > 0  # steps 3-4: diagram
    recorded = json.loads((tmp_path / "pp" / "pipeline.json").read_text())
    assert 0 < recorded["free_comm_bubble"] <= recorded["measured_bubble"] < 1
    assert val_pp == pytest.approx(val_one, abs=1e-5)
    assert train_pp == pytest.approx(train_one, abs=1e-5)
    # both stages' shards are in the checkpoint: it exports to the whole model
    exported = torch.load(export_model(tmp_path / "pp" / "checkpoints" / "final",
                                       tmp_path / "pp.pt"))
    reference = torch.load(export_model(tmp_path / "one" / "checkpoints" / "final",
                                        tmp_path / "one.pt"))
    assert exported.keys() == reference.keys()
    assert max((exported[k] - reference[k]).abs().max().item() for k in reference) < 1e-5
