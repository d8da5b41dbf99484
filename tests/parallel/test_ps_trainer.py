"""The ``ps`` layout behind the Trainer (meshtrain/parallel/ps/layout.py): synchronous
parameter servers train exactly as one process (1 and 2 servers), a ps checkpoint resumes under
dp and back, async ps lands near sync, and bad settings are refused before any process."""

import pytest
import torch
from conftest import full_loss
from parity import (
    LOSSES, compare_ranks, max_param_diff, mlp, params_of, regression_data, run_ranks,
    train_state,
)

from meshtrain import Trainer
from meshtrain.optim import AdamW
from meshtrain.errors import ConfigError, LayoutError

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 20


def adamw_lr(params):  # a constant rate: the servers take the worker's lr with every push
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def sgd(params):
    return torch.optim.SGD(params, lr=0.4)


def sgd_half(params):  # async: an update per worker's half batch, at half the rate
    return torch.optim.SGD(params, lr=0.2)


def split(ranks: list[dict], num_servers: int) -> tuple[list[dict], list[dict]]:
    """(workers' states, servers' states): the servers are the last ranks."""
    return ranks[:-num_servers], ranks[-num_servers:]


@pytest.fixture(scope="module")
def one_process():
    return train_state({"max_steps": STEPS, "global_batch_size": 16}, optimizer_fn=adamw_lr)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("num_servers", [1, 2])
def test_sync_ps_with_two_workers_matches_one_process(one_process, num_servers):
    ranks = run_ranks({"layout": f"ps={num_servers},dp=2", "devices": 2 + num_servers,
                       "max_steps": STEPS, "global_batch_size": 16}, 2 + num_servers,
                      timeout=200, optimizer_fn=adamw_lr)
    workers, servers = split(ranks, num_servers)
    assert compare_ranks(one_process, workers, label=f"ps={num_servers},dp=2") <= 1e-5
    for server in servers:  # each server process ends holding the trained model
        assert len(server[LOSSES]) == 0  # it never ran a training step
        assert max_param_diff(server, one_process) <= 1e-5


def _resume_job(first: dict, second: dict, tmp_path, steps: int = 8) -> list[dict]:
    """``first`` trains steps/2 steps and saves; ``second`` resumes it and trains to ``steps``."""
    half = dict(first, max_steps=steps // 2, global_batch_size=16, run_dir=str(tmp_path / "a"),
                save_final_checkpoint=True)
    run_ranks(half, half.pop("procs"), timeout=200, optimizer_fn=adamw_lr)
    rest = dict(second, max_steps=steps, global_batch_size=16, run_dir=str(tmp_path / "b"),
                resume=str(tmp_path / "a" / "checkpoints" / "final"))
    return run_ranks(rest, rest.pop("procs"), timeout=200, optimizer_fn=adamw_lr)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("first,second", [
    ({"layout": "ps=1,dp=2", "devices": 3, "procs": 3}, {"layout": "dp=2", "devices": 2,
                                                         "procs": 2}),
    ({"layout": "dp=2", "devices": 2, "procs": 2}, {"layout": "ps=2,dp=2", "devices": 4,
                                                    "procs": 4}),
], ids=["ps-to-dp", "dp-to-ps"])
def test_a_ps_checkpoint_resumes_under_dp_and_back(tmp_path, first, second):
    reference = train_state({"max_steps": 8, "global_batch_size": 16}, optimizer_fn=adamw_lr)
    ranks = _resume_job(first, second, tmp_path)
    workers = ranks[:2]  # dp=2's ranks, or ps=2,dp=2's workers
    for state in workers:  # the optimizer state came through too: AdamW would drift without it
        assert max_param_diff(state, reference) <= 1e-5


@pytest.mark.timeout(240)
def test_async_ps_lands_within_5_percent_of_sync():
    """60 SGD steps on the regression task: the async run (staleness 1) applies each worker's
    half-batch gradient on arrival at half the rate, and ends within 5 % of sync's loss
    (measured: sync 0.1061, async 0.1079, from 0.758)."""
    settings = {"max_steps": 60, "global_batch_size": 16, "devices": 3}
    sync = run_ranks({**settings, "layout": "ps=1,dp=2"}, 3, timeout=200, optimizer_fn=sgd)
    async_ = run_ranks({**settings, "layout": "ps=1,dp=2", "ps_mode": "async",
                        "ps_staleness": 1}, 3, timeout=200, optimizer_fn=sgd_half)
    losses = {}
    for name, ranks in (("sync", sync), ("async", async_)):
        model = mlp()
        model.load_state_dict(params_of(ranks[-1]))  # the server's final model
        losses[name] = full_loss(model, regression_data())
    torch.manual_seed(0)
    start = full_loss(mlp(), regression_data())
    assert losses["sync"] < 0.5 * start, (losses, start)
    assert abs(losses["async"] - losses["sync"]) <= 0.05 * losses["sync"], losses


@pytest.mark.parametrize("settings,match", [
    ({"layout": "ps=1", "devices": 1}, "leaves no workers"),
    ({"layout": "ps=2,dp=2", "devices": 3}, "needs 4 processes"),
    ({"layout": "ps=1,tp=2", "devices": 3}, "plain data parallel"),
    ({"layout": "ps=1,dp=2", "devices": 3, "ps_mode": "async", "ps_staleness": -1},
     "staleness must be an integer >= 0"),
    ({"layout": "dp=2", "devices": 2, "ps_mode": "async"}, "has no servers"),
    ({"layout": "ps=1,dp=2", "devices": 3, "grad_clip_norm": 1.0}, "drop grad_clip_norm"),
    ({"layout": "ps=1,dp=2", "devices": 3, "local_sgd_every": 4}, "drop local_sgd_every"),
    ({"layout": "ps=1,dp=2", "devices": 3, "comm_hook": "bf16"}, "DDP setting"),
])
def test_bad_ps_settings_are_refused_before_any_process(settings, match):
    with pytest.raises((ConfigError, LayoutError), match=match):
        Trainer(max_steps=1, **settings)


@pytest.mark.parametrize("num_servers,match", [(4, "fair share"), (7, "would hold nothing")])
def test_a_server_count_that_does_not_split_the_parameters_is_refused(num_servers, match):
    trainer = Trainer(layout=f"ps={num_servers},dp=1", devices=num_servers + 1, max_steps=1,
                      progress_bar=False, loggers=())
    with pytest.raises(ConfigError, match=match):  # at fit's checks, before any process
        trainer.fit(mlp, regression_data(), optimizer=adamw_lr, loss_fn=torch.nn.MSELoss())
    assert trainer.mesh is None  # no world was started


def two_rates(named_params):  # biases at three times the matrices' rate, no decay on them
    named_params = list(named_params)
    return torch.optim.AdamW(
        [{"params": [p for n, p in named_params if p.dim() > 1], "weight_decay": 0.1},
         {"params": [p for n, p in named_params if p.dim() <= 1], "lr": 3e-2,
          "weight_decay": 0.0}], lr=1e-2)


two_rates.takes_names = True


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer", [AdamW(lr=1e-2, weight_decay=0.1), two_rates],
                         ids=["recipe-adamw", "two-rates"])
def test_parameter_groups_keep_their_hyperparameters_on_the_servers(optimizer):
    """The recipe's AdamW (weight decay on matrices only) and groups with their own learning
    rates: ps=1,dp=2 equals one process in float64 (each group's decay and rate reached the
    server: one group's hyperparameters for all would differ by ~1e-3)."""
    settings = {"max_steps": STEPS, "global_batch_size": 16}
    reference = train_state(settings, optimizer_fn=optimizer, float64=True)
    ranks = run_ranks({**settings, "layout": "ps=1,dp=2", "devices": 3}, 3, timeout=200,
                      optimizer_fn=optimizer, float64=True)
    workers, servers = split(ranks, 1)
    assert compare_ranks(reference, workers, label="ps=1,dp=2 groups") <= 1e-10
    assert max_param_diff(servers[0], reference) <= 1e-10
