"""Trainer.predict: every sample's outputs in the data's order on rank 0, under dp, zero3, tp,
pp and cp (each rank's chunks of the sequence gathered back) as in one process (the same training, then predict on data that does not divide into
the ranks' batches)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import quiet_trainer
from parity import GPT4_FNS, adamw, mlp, regression_data, token_data
from torch.utils.data import TensorDataset

from meshtrain import ConfigError
from meshtrain.launch.spawn import run_workers

MLP_CASE = dict(model_fn=mlp, data_fn=regression_data, loss_fn=torch.nn.functional.mse_loss,
                optimizer_fn=adamw)


def _inputs(case: str, n: int = 37):
    """``n`` samples that are not training data: only inputs (a one-tensor dataset)."""
    data = (token_data(seed=5) if case == "gpt" else regression_data(seed=5)).tensors[0]
    return TensorDataset(data[:n])


def _fit_and_predict(run_dir, layout, case):
    torch.set_num_threads(1)
    fns = GPT4_FNS if case == "gpt" else MLP_CASE
    trainer = quiet_trainer(run_dir, **({"layout": layout} if layout else {}), max_steps=3,
                            global_batch_size=16, micro_batch_size=4)
    torch.manual_seed(0)
    model = trainer.fit(fns["model_fn"], fns["data_fn"](), optimizer=fns["optimizer_fn"],
                        loss_fn=fns["loss_fn"])
    out = trainer.predict(_inputs(case))
    if layout is None:  # by hand, in one batch: the order and the values
        with torch.no_grad():
            model.eval()
            assert torch.allclose(out, model(_inputs(case).tensors[0]), atol=1e-6)
    return out if int(os.environ.get("RANK", 0)) == 0 else None


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout,case", [("dp=2", "mlp"), ("zero3=2", "mlp"), ("tp=2", "gpt"),
                                         ("pp=2", "gpt"), ("cp=2", "gpt")])
def test_predict_returns_one_process_outputs_in_order(tmp_path, layout, case):
    reference = _fit_and_predict(str(tmp_path / "one"), None, case)
    out = run_workers(_fit_and_predict, 2, (str(tmp_path / "two"), layout, case),
                      timeout=150)[0]
    assert out.shape == reference.shape and out.shape[0] == 37
    assert torch.allclose(out, reference, atol=1e-5, rtol=0)


def test_predict_before_fit_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="before predict"):
        quiet_trainer(tmp_path, max_steps=1).predict(_inputs("mlp"))


def _pooled_under_cp(run_dir):
    torch.set_num_threads(1)
    trainer = quiet_trainer(run_dir, layout="cp=2", max_steps=1, global_batch_size=16,
                            micro_batch_size=4)
    model = trainer.fit(GPT4_FNS["model_fn"], GPT4_FNS["data_fn"](),
                        optimizer=GPT4_FNS["optimizer_fn"], loss_fn=GPT4_FNS["loss_fn"])
    model.predict_step = lambda batch, batch_idx: model(batch[0]).mean(1)  # one row per sample
    trainer.predict(_inputs("gpt", 8))


@pytest.mark.timeout(150)
def test_predict_under_cp_refuses_outputs_that_are_not_per_token(tmp_path):
    from meshtrain.errors import WorkerFailed

    with pytest.raises(WorkerFailed, match="not one row per token"):
        run_workers(_pooled_under_cp, 2, (str(tmp_path),), timeout=120)
