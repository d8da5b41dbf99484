"""The Trainer's periodic checkpoints and auto-resume (single process and 2 ranks)."""

import json

import pytest
import torch
import torch.nn.functional as F
from parity import mlp, regression_data

from meshtrain import Callback, ConfigError, Trainer
from meshtrain.checkpoint.manager import list_complete
from meshtrain.launch.spawn import run_workers

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _fit(root, max_steps, **kwargs):
    options = dict(root_dir=root, name="job", max_steps=max_steps, global_batch_size=16,
                   loggers=("csv",), progress_bar=False, accelerator="cpu", seed=0)
    options.update(kwargs)
    trainer = Trainer(**options)
    model = trainer.fit(mlp, regression_data(), optimizer=_adamw, loss_fn=F.mse_loss)
    return trainer, {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Killed(Exception):
    pass


class _KillAt(Callback):
    def on_train_step_end(self, trainer, metrics):
        if trainer.global_step == 5:
            raise _Killed


def test_running_the_same_command_again_resumes_the_run(tmp_path):
    _, full = _fit(tmp_path / "full", 9)
    with pytest.raises(_Killed):  # the job dies in step 5, after the checkpoint of step 4
        _fit(tmp_path / "job", 9, checkpoint_every_n_steps=2, keep_last_k=2, callbacks=[_KillAt()])
    (folder,) = (tmp_path / "job" / "job").iterdir()
    names = [p.name for p in list_complete(folder / "checkpoints")]
    assert names == ["step_00000002", "step_00000004"]
    # "the same command" again: continues the unfinished run in its folder from step 4
    again, resumed = _fit(tmp_path / "job", 9, checkpoint_every_n_steps=2, keep_last_k=2)
    assert again.run_dir == folder and again.global_step == 9
    for name, value in full.items():
        assert torch.equal(value, resumed[name]), name
    # keep_last_k=2 kept the two newest step checkpoints; "final" is not counted
    assert [p.name for p in list_complete(folder / "checkpoints")] == [
        "step_00000006", "step_00000008", "final"]
    summary = json.loads((folder / "checkpoints" / "final" / "meshtrain.json").read_text())
    assert summary["step"] == 9
    # resume=None starts afresh in a new folder
    fresh, _ = _fit(tmp_path / "job", 2, resume=None, run_dir=tmp_path / "job" / "fresh")
    assert fresh.global_step == 2


def test_resume_refuses_another_global_batch_or_seed(tmp_path):
    first, _ = _fit(tmp_path, 2)
    final = first.run_dir / "checkpoints" / "final"
    with pytest.raises(ConfigError, match="global_batch_size=16"):
        _fit(tmp_path, 4, resume=final, global_batch_size=32, run_dir=tmp_path / "b")
    with pytest.raises(ConfigError, match="seed=0"):
        _fit(tmp_path, 4, resume=final, seed=1, run_dir=tmp_path / "c")


def _two_rank_run(root, async_checkpoint, minutes):
    torch.set_num_threads(1)
    trainer, params = _fit(root, 12, layout="dp=2", checkpoint_every_n_steps=None if minutes
                           else 3, checkpoint_every_n_minutes=minutes,
                           async_checkpoint=async_checkpoint, keep_last_k=2)
    return params, [p.name for p in list_complete(trainer.run_dir / "checkpoints")]


@pytest.mark.timeout(150)
def test_async_and_timed_checkpoints_on_two_ranks(tmp_path):
    sync_params, sync_saved = run_workers(_two_rank_run, 2, (tmp_path / "sync", False, None),
                                          timeout=100)[0]
    async_params, async_saved = run_workers(_two_rank_run, 2, (tmp_path / "async", True, None),
                                            timeout=100)[0]
    assert sync_saved == async_saved == ["step_00000006", "step_00000009", "final"]
    for name, value in sync_params.items():
        assert torch.equal(value, async_params[name]), name
    # every 0.1 ms: due at every step by rank 0's clock, and all ranks agree (no hang)
    timed_params, timed_saved = run_workers(_two_rank_run, 2, (tmp_path / "timed", True, 2e-6),
                                            timeout=100)[0]
    assert timed_saved == ["step_00000010", "step_00000011", "final"]
    for name, value in sync_params.items():
        assert torch.equal(value, timed_params[name]), name
