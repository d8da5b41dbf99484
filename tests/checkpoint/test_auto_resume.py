"""Which run a resume continues (issue 12): resume="auto" continues only an unfinished run of the
same job and model, the newest one; a checkpoint of another model, or one at or past the stopping
point, is refused before training; the job's default name is the script's."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from parity import adamw, adamw_gpt, lm_loss, mlp, regression_data, tiny_gpt, token_data

from meshtrain import Callback, ConfigError, Trainer
from meshtrain.checkpoint.manager import list_complete

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Crashed(Exception):
    pass


class Steps(Callback):
    """The steps this fit trained; raises Crashed at step ``crash_at`` (a killed job)."""

    def __init__(self, crash_at=None):
        self.trained, self.crash_at = [], crash_at

    def on_train_step_end(self, trainer, metrics):
        self.trained.append(trainer.global_step)
        if trainer.global_step == self.crash_at:
            raise Crashed(f"killed at step {self.crash_at}")


def _fit(root, max_steps, model=mlp, crash_at=None, **kwargs):
    """(trainer, the steps it trained); the MLP, or a tiny GPT for ``model=tiny_gpt``."""
    steps = Steps(crash_at)
    callbacks = [steps, *kwargs.pop("callbacks", ())]
    options = dict(root_dir=root, name="job", max_steps=max_steps, global_batch_size=16,
                   loggers=(), progress_bar=False, seed=0, checkpoint_every_n_steps=2,
                   callbacks=callbacks, **kwargs)
    trainer = Trainer(**options)
    gpt = model is tiny_gpt or getattr(model, "gpt", False)
    data, optimizer, loss = ((token_data(), adamw_gpt, lm_loss) if gpt
                             else (regression_data(), adamw, F.mse_loss))
    try:
        trainer.fit(model, data, optimizer=optimizer, loss_fn=loss)
    except Crashed:
        pass
    return trainer, steps.trained


def _one_layer_gpt():
    return tiny_gpt(num_layers=1)


_one_layer_gpt.gpt = True


def _narrow_mlp():  # the MLP's names with other shapes: 16 hidden units instead of 32
    from parity import IN_FEATURES, OUT_FEATURES

    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, OUT_FEATURES))


def test_auto_does_not_resume_a_finished_run(tmp_path, capsys):
    # bug (a): a second script under the same name "resumed" the first one's final step and
    # trained nothing
    first, _ = _fit(tmp_path, 4)
    assert [p.name for p in list_complete(first.run_dir / "checkpoints")][-1] == "final"
    second, trained = _fit(tmp_path, 4)
    assert trained == [1, 2, 3, 4], "a new run from step 0"
    assert second.run_dir != first.run_dir and second.run_dir.parent == first.run_dir.parent
    out = capsys.readouterr().out
    assert (f"resume='auto': skipped {first.run_dir / 'checkpoints' / 'final'} (finished at "
            "step 4); starting a new run") in out
    assert "resumed from" not in out
    # a run a callback stopped early is finished too
    _, trained = _fit(tmp_path / "early", 10, callbacks=[StopAt(2)])
    assert trained == [1, 2]
    _, trained = _fit(tmp_path / "early", 10)
    assert trained == list(range(1, 11)), "not the early-stopped run's steps 3 to 10"


class StopAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_train_step_end(self, trainer, metrics):
        trainer.should_stop = trainer.global_step == self.step


def test_auto_continues_the_newest_unfinished_run_not_the_highest_step(tmp_path, capsys):
    # bug (b): the highest step won, even a finished run's, even past max_steps
    older, _ = _fit(tmp_path, 20, crash_at=5)  # unfinished at step 4
    # two more runs of the job, started afresh (auto would continue the first)
    finished, _ = _fit(tmp_path, 6, resume=None)  # finished at step 6: the highest step
    newest, _ = _fit(tmp_path, 20, crash_at=3, resume=None)  # unfinished at step 2, the newest
    assert len({older.run_dir, finished.run_dir, newest.run_dir}) == 3
    capsys.readouterr()
    again, trained = _fit(tmp_path, 5)
    assert again.run_dir == newest.run_dir and trained == [3, 4, 5]
    out = capsys.readouterr().out
    assert f"(finished at step 6); continuing {newest.run_dir / 'checkpoints'}" in out
    assert f"resumed from {newest.run_dir / 'checkpoints' / 'step_00000002'} at step 2" in out
    # the older unfinished run is left alone, and still the one to continue after this one
    assert [p.name for p in list_complete(older.run_dir / "checkpoints")] == [
        "step_00000002", "step_00000004"]
    _, trained = _fit(tmp_path, 6)
    assert trained == [5, 6]


def test_auto_skips_an_unfinished_run_of_another_model(tmp_path, capsys):
    # bug (c): a job re-run under its name with another --model.num_layers loaded part of the
    # old weights (a 2-layer checkpoint into 1 layer) and trained on
    two_layers, _ = _fit(tmp_path, 10, model=tiny_gpt, crash_at=3)
    capsys.readouterr()
    one_layer, trained = _fit(tmp_path, 3, model=_one_layer_gpt)
    assert one_layer.run_dir != two_layers.run_dir and trained == [1, 2, 3]
    out = capsys.readouterr().out
    assert f"skipped {two_layers.run_dir / 'checkpoints' / 'step_00000002'} (another model: " in out
    assert "in the checkpoint but not in the model" in out and "starting a new run" in out
    # the same model again continues the 2-layer run
    again, trained = _fit(tmp_path, 4, model=tiny_gpt)
    assert again.run_dir == two_layers.run_dir and trained == [3, 4]


def test_a_checkpoint_of_another_model_is_refused_before_training(tmp_path):
    gpt, _ = _fit(tmp_path / "gpt", 2, model=tiny_gpt)
    gpt_final = gpt.run_dir / "checkpoints" / "final"
    steps = Steps()
    # 2 layers into 1: torch's strict load accepts the extra keys in the checkpoint
    with pytest.raises(ConfigError, match=r"holds another model than this one \(8 in the "
                       r"checkpoint but not in the model: layers\.1\.norm1\.weight, .*resume=None"):
        Trainer(max_steps=4, global_batch_size=16, loggers=(), progress_bar=False, seed=0,
                run_dir=tmp_path / "one", resume=gpt_final, callbacks=[steps]).fit(
            _one_layer_gpt, token_data(), optimizer=adamw_gpt, loss_fn=lm_loss)
    assert steps.trained == []
    # a GPT checkpoint into an MLP: both kinds of difference, with counts and a few names
    with pytest.raises(ConfigError, match=r"\(6 missing from the checkpoint: 0\.weight, 0\.bias, "
                       r"2\.weight, \.\.\.; 20 in the checkpoint but not in the model: "
                       r"tok_emb\.weight, "):
        _fit(tmp_path / "mlp", 4, resume=gpt_final)
    # the same names with other shapes
    mlp_run, _ = _fit(tmp_path / "mlp", 2)
    with pytest.raises(ConfigError, match=r"5 of another shape: 0\.weight \(checkpoint \[32, 12\], "
                                          r"model \[16, 12\]\), "):
        _fit(tmp_path / "narrow", 4, model=_narrow_mlp,
             resume=mlp_run.run_dir / "checkpoints" / "final")


def test_a_resume_at_or_past_the_stopping_point_is_refused(tmp_path):
    first, _ = _fit(tmp_path, 4)
    final = first.run_dir / "checkpoints" / "final"
    for max_steps in (4, 3):
        with pytest.raises(ConfigError, match=rf"resume='{final}' is at step 4, but this fit stops "
                           rf"at step {max_steps} \(max_steps={max_steps}\): nothing would be "
                           r"trained; raise max_steps .*start a new run with resume=None"):
            _fit(tmp_path, max_steps, resume=final)
    # by epochs: 96 samples, 16 a step, 6 steps an epoch
    by_epoch, _ = _fit(tmp_path / "epochs", None, max_epochs=1)
    with pytest.raises(ConfigError, match=r"stops at step 6 \(max_epochs=1\)"):
        _fit(tmp_path / "epochs", None, max_epochs=1,
             resume=by_epoch.run_dir / "checkpoints" / "final")
    # run_dir given: its newest checkpoint is the run, finished or not; nothing left is refused
    with pytest.raises(ConfigError, match=r"resume='auto' chose .*final, which is at step 4.*"
                                          r"resume=None and another run_dir"):
        _fit(tmp_path, 4, run_dir=first.run_dir)
    _, trained = _fit(tmp_path, 6, run_dir=first.run_dir)
    assert trained == [5, 6]


def test_the_default_job_name_is_the_script_file_name(tmp_path, monkeypatch):
    from meshtrain.recipes import resolve_config

    assert Trainer(max_steps=1).name == "run"  # under pytest: no script of the user's
    script = types.ModuleType("__main__")
    script.__file__ = str(tmp_path / "train_mlp.py")
    monkeypatch.setitem(sys.modules, "__main__", script)
    assert Trainer(max_steps=1).name == "train_mlp"
    assert Trainer(max_steps=1, name="mine").name == "mine"
    # meshtrain train CONFIG.toml: the config's file name, unless the config names the job
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "mt_name_recipe.py").write_text(
        "from meshtrain import settings\nDEFAULTS = {'job': {}, **settings.config_sections()}\n"
        "def run(config, mode='train'):\n    pass\n")
    (tmp_path / "small_mlp.toml").write_text('[job]\nrecipe = "mt_name_recipe"\n')
    assert resolve_config(str(tmp_path / "small_mlp.toml"), [])[2]["name"] == "small_mlp"
    assert resolve_config(str(tmp_path / "small_mlp.toml"),
                          ["--logging.name=big"])[2]["name"] == "big"
