"""Asynchronous checkpoints' staging (meshtrain/checkpoint/staging.py: torch's DefaultStager
with meshtrain's checks) through the CheckpointManager: the copy runs in the background and
before_update() waits for it, model buffers are copied at once, the host copy is made once and
reused, and a non-finite state is refused when it is staged."""

import threading

import pytest
import torch
import torch.nn as nn
from test_manager import _model_and_adamw, _step, _summary, _trainer_state
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from meshtrain.checkpoint.manager import CheckpointManager


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP's thread
def test_async_save_copies_in_the_background_and_buffers_at_once(tmp_path, monkeypatch):
    # a slow background copy: save() returns before it; before_update() waits for it; a model
    # buffer (batch norm statistics, which the next forward changes in place) is copied at once
    from torch.distributed.checkpoint.staging import DefaultStager

    started, release = threading.Event(), threading.Event()
    copy = DefaultStager._stage  # (torch's stager, in its background thread)

    def slow_copy(self, state_dict, **kwargs):
        started.set()
        assert release.wait(30)
        return copy(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "_stage", slow_copy)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    saved_mean, saved_weight = model[1].running_mean.clone(), model[0].weight.detach().clone()
    mgr = CheckpointManager(tmp_path, async_save=True)
    assert mgr.save(1, model, optimizer, _trainer_state(1), _summary(1))
    assert started.wait(30) and mgr.in_flight
    model(torch.randn(8, 4) + 5)  # the next forward: running_mean changes, parameters do not
    assert not torch.equal(model[1].running_mean, saved_mean)
    threading.Timer(0.2, release.set).start()
    assert mgr.before_update() > 0  # it waited for the copy
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the update
    assert mgr.wait() == tmp_path / "step_00000001"
    out = tmp_path / "flat.pt"
    dcp_to_torch_save(tmp_path / "step_00000001", out)
    saved = torch.load(out, weights_only=True)["model"]
    assert torch.equal(saved["1.running_mean"], saved_mean)
    assert torch.equal(saved["0.weight"], saved_weight)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP's thread
def test_async_save_of_non_finite_state_is_refused_at_commit(tmp_path):
    model, optimizer = _model_and_adamw()
    _step(model, optimizer, 0)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    mgr = CheckpointManager(tmp_path, async_save=True)
    assert mgr.save(1, model, optimizer, _trainer_state(1), _summary(1))
    with pytest.warns(UserWarning, match="NaN/Inf"):
        assert mgr.wait() is None
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing half-written


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP's thread
def test_later_saves_reuse_the_host_copy_and_write_the_values_of_their_own_step(tmp_path):
    """The stager's host buffers are allocated by the first save and reused (no second copy of
    the state per save); each checkpoint still holds its own step's values."""
    model, optimizer = _model_and_adamw()
    mgr = CheckpointManager(tmp_path, async_save=True)
    saved, storages = {}, []
    for step in (1, 2, 3):
        _step(model, optimizer, step)
        saved[step] = model[0].weight.detach().clone()
        assert mgr.save(step, model, optimizer, _trainer_state(step), _summary(step))
        mgr.before_update()
        staged = mgr._stager.inner._state_dict_stager._cached_storage_mapping
        storages.append({id(s) for s in staged.values()})
        mgr.wait()
    assert storages[0] and storages[0] == storages[1] == storages[2]
    for step in (1, 2, 3):
        out = tmp_path / f"flat{step}.pt"
        dcp_to_torch_save(tmp_path / f"step_{step:08d}", out)
        assert torch.equal(torch.load(out, weights_only=True)["model"]["0.weight"], saved[step])
