"""No checkpoint runs code when it is loaded: crafted files given to resume= and to
`meshtrain export` are refused before anything in them runs; a checkpoint of an older meshtrain
is refused with the opt-in named, and loads after `meshtrain upgrade-checkpoint --trust`."""

import os
import pickle
import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from parity import mlp, regression_data

from meshtrain import ConfigError, Trainer
from meshtrain.checkpoint.safe_load import check_plain, load_plain, read_metadata
from meshtrain.checkpoint.state import set_rng_state
from meshtrain.cli import main as cli

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")]


class _Marker:
    """Unpickling this creates ``path`` (what a hostile checkpoint would do, harmlessly)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _fit(run_dir, max_steps, **kwargs):
    trainer = Trainer(run_dir=run_dir, max_steps=max_steps, global_batch_size=16,
                      loggers=("csv",), progress_bar=False, accelerator="cpu", seed=0, **kwargs)
    model = trainer.fit(mlp, regression_data(), optimizer=_adamw, loss_fn=F.mse_loss)
    return trainer, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real checkpoint at step 2 (and the parameters of a 4-step run, to compare a resume)."""
    root = tmp_path_factory.mktemp("saved")
    _, full = _fit(root / "full", 4)
    _fit(root / "run", 2)
    return root / "run" / "checkpoints" / "final", full


def _copy(saved, tmp_path):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    return folder


def test_a_saved_checkpoint_is_plain_data(saved):
    folder, _ = saved
    for file in folder.glob("*.pt"):
        load_plain(file)  # would raise if it held objects
    assert "model.0.weight" in read_metadata(folder).state_dict_metadata


@pytest.mark.parametrize("poisoned", ["trainer_state.pt", "rng_rank0.pt", ".metadata"])
def test_crafted_files_are_refused_before_they_run(saved, tmp_path, poisoned, capsys):
    folder = _copy(saved[0], tmp_path)
    marker = tmp_path / "marker"
    with open(folder / poisoned, "wb") as f:
        pickle.dump({"global_step": 1, "x": _Marker(marker)}, f)
    # (the trainer state and RNG files were not plain before: converting is the fix named)
    fix = "do not use this checkpoint" if poisoned == ".metadata" else "upgrade-checkpoint"
    with pytest.raises(ConfigError, match=f"{poisoned} was refused.*{fix}"):
        _fit(tmp_path / "resumed", 4, resume=str(folder))
    assert not marker.exists()
    assert cli(["export", str(folder), str(tmp_path / "model.pt")]) == 2
    assert "was refused" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "model.pt").exists()
    # resume="auto" finds it in the run folder: refused too, not skipped or loaded
    run = tmp_path / "auto"
    (run / "checkpoints").mkdir(parents=True)
    os.rename(folder, run / "checkpoints" / "step_00000002")
    with pytest.raises(ConfigError, match="was refused"):
        _fit(run, 4, resume="auto")
    assert not marker.exists()


def test_a_crafted_entry_inside_the_distributed_checkpoint_is_refused(tmp_path, capsys):
    marker = tmp_path / "marker"
    dcp.save({"model": {"weight": torch.ones(2), "extra": _Marker(marker)}},
             checkpoint_id=tmp_path / "ckpt")
    torch.save({"global_step": 1}, tmp_path / "ckpt" / "trainer_state.pt")
    assert cli(["export", str(tmp_path / "ckpt"), str(tmp_path / "model.pt")]) == 2
    assert "extra" in capsys.readouterr().err and not marker.exists()


def _as_older_meshtrain_wrote_it(folder):
    """The RNG file as meshtrain wrote it before safe loading: Python's and NumPy's own state
    objects (NumPy's holds an array, which only a full unpickle reads)."""
    state = load_plain(folder / "rng_rank0.pt")
    random.seed(1)
    np.random.seed(1)
    torch.save({"torch": state["torch"], "python": random.getstate(),
                "numpy": np.random.get_state()}, folder / "rng_rank0.pt")


def test_an_older_checkpoint_is_refused_until_its_owner_upgrades_it(saved, tmp_path, capsys):
    folder, full = _copy(saved[0], tmp_path), saved[1]
    _as_older_meshtrain_wrote_it(folder)
    with pytest.raises(ConfigError, match=f"upgrade-checkpoint {folder} --trust"):
        _fit(tmp_path / "resumed", 4, resume=str(folder))
    assert cli(["upgrade-checkpoint", str(folder)]) == 2  # --trust is required
    assert "--trust" in capsys.readouterr().err
    assert cli(["upgrade-checkpoint", str(folder), "--trust"]) == 0
    assert "rng_rank0.pt" in capsys.readouterr().out
    load_plain(folder / "rng_rank0.pt")
    trainer, resumed = _fit(tmp_path / "resumed", 4, resume=str(folder))
    assert trainer.global_step == 4
    for name, value in full.items():  # the model, optimizer and data position continued
        assert torch.equal(value, resumed[name]), name
    set_rng_state(load_plain(folder / "rng_rank0.pt"))  # the converted states are the saved ones
    drawn = (random.random(), np.random.rand())
    random.seed(1)
    np.random.seed(1)
    assert drawn == (random.random(), np.random.rand())
    assert cli(["upgrade-checkpoint", str(folder), "--trust"]) == 0
    assert "nothing to change" in capsys.readouterr().out


class _Schedule:
    """A learning-rate rule object whose state holds a non-plain value (a NumPy float)."""

    def __init__(self):
        self.floor = np.float64(0.1)

    def __call__(self, step):
        return max(float(self.floor), 1.0 / (1 + step))


def test_a_trainer_state_that_is_not_plain_is_refused_before_training(tmp_path):
    trainer = Trainer(run_dir=tmp_path, max_steps=2, global_batch_size=16, progress_bar=False,
                      accelerator="cpu", loggers=())
    with pytest.raises(ConfigError, match=r"\['lr_lambdas'\]\[0\]\['floor'\] is a numpy.float64"):
        trainer.fit(mlp, regression_data(), optimizer=_adamw, loss_fn=F.mse_loss,
                    lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, _Schedule()))
    assert trainer.global_step == 0 and not (tmp_path / "checkpoints").exists()


def test_check_plain_accepts_what_checkpoints_hold():
    check_plain({"step": 3, "lr": [1e-3], "name": "x", "none": None, "t": torch.ones(2),
                 "betas": (0.9, 0.99), "size": torch.Size([2])}, "state")
