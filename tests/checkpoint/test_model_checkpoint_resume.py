"""ModelCheckpoint is a policy of the one checkpoint writer (issue 11, item 5): best-k holds across
a resume, ``last`` is the final checkpoint rather than a second copy, every-N-step folders have
the periodic checkpoints' names."""

import json

import torch
from parity import adamw, mlp, regression_data

from meshtrain import Callback, ModelCheckpoint, Trainer


class ValLosses(Callback):
    def __init__(self):
        self.values = {}

    def on_validation_end(self, trainer, metrics):
        self.values[trainer.global_step] = metrics["val/loss"]


def _fit(run_dir, max_steps, callbacks, **kwargs):
    torch.set_num_threads(1)
    trainer = Trainer(max_steps=max_steps, global_batch_size=16, val_every_n_steps=2,
                      run_dir=run_dir, loggers=(), progress_bar=False, seed=0,
                      checkpoint_every_n_steps=2, callbacks=callbacks, **kwargs)
    trainer.fit(mlp, regression_data(), regression_data(seed=7), optimizer=adamw,
                loss_fn=torch.nn.functional.mse_loss)
    return trainer


def test_save_top_k_holds_across_a_resume(tmp_path):
    seen = ValLosses()
    _fit(tmp_path, 6, [ModelCheckpoint(monitor="val/loss", save_top_k=2, save_last=False), seen],
         save_final_checkpoint=False)
    first_fit = dict(seen.values)
    checkpoint = ModelCheckpoint(monitor="val/loss", save_top_k=2, save_last=False)
    resumed = _fit(tmp_path, 12, [checkpoint, seen], save_final_checkpoint=False)
    assert resumed.global_step == 12 and len(seen.values) > len(first_fit)  # it did resume

    kept = sorted((tmp_path / "checkpoints").glob("best_step_*"))
    assert len(kept) == 2, [p.name for p in kept]
    best_two = sorted(seen.values, key=seen.values.get)[:2]
    assert sorted(int(p.name.rsplit("_", 1)[1]) for p in kept) == sorted(best_two)
    for path in kept:  # each folder holds the state of its step
        summary = json.loads((path / "meshtrain.json").read_text())
        assert summary["metrics"]["val/loss"] == seen.values[summary["step"]]
    assert checkpoint.best_model_path.name == f"best_step_{best_two[0]:07d}"


def test_last_is_the_final_checkpoint_not_a_copy(tmp_path):
    checkpoint = ModelCheckpoint(save_last=True)
    _fit(tmp_path, 4, [checkpoint], save_final_checkpoint=True)
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "last" not in folders and "final" in folders
    assert checkpoint.last_model_path == tmp_path / "checkpoints" / "final"


def test_every_n_steps_and_periodic_checkpoints_share_folders(tmp_path):
    checkpoint = ModelCheckpoint(every_n_steps=2, save_last=False)
    _fit(tmp_path, 4, [checkpoint], save_final_checkpoint=False)  # both policies: every 2
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders == ["step_00000002", "step_00000004"]


def test_last_is_the_periodic_checkpoint_of_the_last_step(tmp_path):
    # no final checkpoint, but the writer saved step 4 already: last names it, no copy
    checkpoint = ModelCheckpoint(save_last=True)
    trainer = _fit(tmp_path, 4, [checkpoint], save_final_checkpoint=False)
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders == ["step_00000002", "step_00000004"]
    assert checkpoint.last_model_path == tmp_path / "checkpoints" / "step_00000004"
    assert trainer.checkpoints.written_at(4) == checkpoint.last_model_path


def test_every_save_goes_through_the_one_writer(tmp_path):
    # a save asked for twice at one step (same folder) is written once; another step is new
    trainer = _fit(tmp_path, 2, [], save_final_checkpoint=False)
    target = tmp_path / "elsewhere" / "mine"
    assert trainer.save_checkpoint(target) == target
    written = (target / "meshtrain.json").stat().st_mtime_ns
    (target / "marker").write_text("kept")  # a rewrite would replace the whole folder
    assert trainer.save_checkpoint(target) == target
    assert (target / "marker").is_file() and (target / "meshtrain.json").stat().st_mtime_ns == written
    assert trainer.checkpoints.written_at(2) == target and trainer.checkpoints.written_at(1) is None
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]
