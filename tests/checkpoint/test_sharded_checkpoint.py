"""Sharded checkpoints: each rank saves its own shards (DCP); a run resumes exactly, also under
another layout, and `meshtrain export` writes one plain state_dict."""

import os
from pathlib import Path

import pytest
import torch
from parity import GPT_FNS, adamw, max_param_diff, train_state  # noqa: F401

from meshtrain import Callback, Trainer
from meshtrain.checkpoint.export import export_model
from meshtrain.launch.spawn import run_workers

K = 4  # steps before the checkpoint


class Losses(Callback):
    def __init__(self):
        self.by_step = {}

    def on_train_step_end(self, trainer, metrics):
        self.by_step[trainer.global_step] = metrics["train/loss"]


def _fit(run_dir, layout, steps, ckpt=None, save=False):
    losses = Losses()
    trainer = Trainer(layout=layout, max_steps=steps, global_batch_size=16, micro_batch_size=4,
                      log_every_n_steps=1, loggers=(), progress_bar=False, run_dir=run_dir,
                      save_final_checkpoint=save, callbacks=[losses], resume=ckpt)
    model = trainer.fit(GPT_FNS["model_fn"], GPT_FNS["data_fn"](), optimizer=adamw,
                        loss_fn=GPT_FNS["loss_fn"])
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
              for k, v in model.state_dict().items()}
    return losses.by_step, params


def _save_and_resume(base, layout):
    torch.set_num_threads(1)
    base = Path(base)
    full_losses, full_params = _fit(base / "full", layout, K + 1)
    _, saved_params = _fit(base / "first", layout, K, save=True)
    ckpt = base / "first" / "checkpoints" / "final"
    resumed_losses, resumed_params = _fit(base / "resumed", layout, K + 1, ckpt=ckpt)
    if int(os.environ["RANK"]):
        return None
    return dict(full_losses=full_losses, full_params=full_params, saved_params=saved_params,
                resumed_losses=resumed_losses, resumed_params=resumed_params)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["zero3=2", "zero1=2"])
def test_sharded_resume_is_exact_and_loads_under_other_layouts(tmp_path, layout):
    out = run_workers(_save_and_resume, 2, (str(tmp_path), layout), timeout=200)[0]
    assert list(out["resumed_losses"]) == [K + 1]
    assert out["resumed_losses"][K + 1] == out["full_losses"][K + 1]
    assert max_param_diff(out["full_params"], out["resumed_params"]) == 0.0
    ckpt = tmp_path / "first" / "checkpoints" / "final"
    assert len(list(ckpt.glob("*.distcp"))) == 2, "each rank writes its own file"

    # the same checkpoint resumed by one process (no process group, plain optimizer)
    single_losses, single_params = _fit(tmp_path / "single", None, K + 1, ckpt=ckpt)
    assert single_losses[K + 1] == pytest.approx(out["full_losses"][K + 1], abs=1e-6)
    assert max_param_diff(out["full_params"], single_params) < 5e-5  # see the GPT note in parity

    # export: one plain state_dict equal to the gathered parameters at the checkpoint
    exported = torch.load(export_model(ckpt, tmp_path / "model.pt"))
    assert max_param_diff(out["saved_params"], exported) == 0.0
    model = GPT_FNS["model_fn"]()
    model.load_state_dict(exported)  # strict: names and shapes of the plain model


def test_export_rejects_a_folder_that_is_not_a_checkpoint(tmp_path):
    from meshtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="not a distributed checkpoint"):
        export_model(tmp_path, tmp_path / "x.pt")
