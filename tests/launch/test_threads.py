"""Torch threads per process: one rule for one process and for N (issue 26 item 9).

A one-process run used to keep torch's default (every core) while each rank of ``dp=N`` got
cores/N: on a busy machine one process ran 11x slower than with one thread, which made
``dp=2`` look 8x faster than one process."""
import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from parity import adamw, mlp, regression_data

from meshtrain import Callback
from meshtrain.errors import ConfigError
from meshtrain.launch import world
from meshtrain.launch.world import threads_per_process


def test_the_rule_shares_the_cores_among_the_nodes_processes():
    assert threads_per_process(1, environ={}, cores=8) == (8, "8 core(s) / 1 process(es) on this node")
    assert threads_per_process(2, environ={}, cores=8)[0] == 4
    assert threads_per_process(3, environ={}, cores=8)[0] == 2
    assert threads_per_process(4, environ={}, cores=2)[0] == 1, "never fewer than one"


def test_an_explicit_omp_num_threads_wins():
    assert threads_per_process(4, environ={"OMP_NUM_THREADS": "3"}, cores=2) == \
        (3, "OMP_NUM_THREADS")
    for bad in ("0", "two", "-1"):
        with pytest.raises(ConfigError, match="OMP_NUM_THREADS"):
            threads_per_process(1, environ={"OMP_NUM_THREADS": bad}, cores=2)


class _Threads(Callback):
    def on_train_step_start(self, trainer):
        self.seen = torch.get_num_threads()


def _fit(tmp_path):
    seen = _Threads()
    trainer = quiet_trainer(tmp_path / "run", max_steps=1, micro_batch_size=8,
                            callbacks=[seen])
    trainer.fit(mlp, regression_data(), optimizer=adamw, loss_fn=F.mse_loss)
    return seen.seen


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_one_process_uses_the_cores_available_and_says_so(tmp_path, monkeypatch, capsys,
                                                          restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(world, "available_cores", lambda: 3)
    torch.set_num_threads(1)
    assert _fit(tmp_path) == 3
    assert "threads: 3 per process (3 core(s) / 1 process(es) on this node)" in \
        capsys.readouterr().out


def test_one_process_respects_omp_num_threads(tmp_path, monkeypatch, capsys, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(world, "available_cores", lambda: 7)
    assert _fit(tmp_path) == 2
    assert "threads: 2 per process (OMP_NUM_THREADS)" in capsys.readouterr().out
