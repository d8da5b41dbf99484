"""What README.md promises about the Trainer's data API: ``trainer.test``, DataLoaders given to
``fit`` (their collate_fn honoured) and loader worker processes, each against one-process
training or a loss computed by hand."""

import os

import multiprocessing

import pytest
import torch
import torch.nn.functional as F
from conftest import LossRecorder, RecordingDataset, full_loss, quiet_trainer, state_of
from parity import IN_FEATURES, LOSSES, OUT_FEATURES, adamw, max_param_diff, mlp, regression_data
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate, get_worker_info

from meshtrain.launch.spawn import run_workers
from meshtrain.observe.loggers import read_metrics_csv

# single-process checkpoints: DCP says it saves/loads without a process group, as intended
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.usefixtures("one_thread")]


def _data(n: int, seed: int = 5) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_FEATURES, generator=gen)
    return TensorDataset(x, torch.randn(n, OUT_FEATURES, generator=gen))


# ---- trainer.test -----------------------------------------------------------------------------
def test_test_is_the_mean_loss_over_the_whole_test_set(tmp_path):
    test_set = _data(23)  # batches of 4: five full ones and one of 3
    trainer = quiet_trainer(tmp_path, max_steps=3, micro_batch_size=4, loggers=("csv",))
    model = trainer.fit(mlp, regression_data(), optimizer=adamw, loss_fn=F.mse_loss)
    before = state_of(model)
    result = trainer.test(test_set)

    assert set(result) == {"test/loss"}
    expected = full_loss(model, test_set)
    assert result["test/loss"] == pytest.approx(expected, rel=1e-6, abs=1e-7)
    x, y = test_set.tensors
    with torch.no_grad():  # what a plain mean of the batch means would give instead
        means = [F.mse_loss(model(x[i:i + 4]), y[i:i + 4]).item() for i in range(0, 23, 4)]
    assert abs(sum(means) / len(means) - expected) > 1e-4, "the data does not tell them apart"
    # test() changes nothing, leaves train mode on, and logs the value at the last step
    assert max_param_diff(before, state_of(model)) == 0.0
    assert model.training
    rows = [r for r in read_metrics_csv(tmp_path / "metrics.csv") if r.get("test/loss")]
    assert [(r["step"], r["test/loss"]) for r in rows] == [(3, pytest.approx(expected, rel=1e-6))]


def test_test_sees_the_whole_test_set_even_with_limit_val_batches(tmp_path):
    test_set = _data(23)
    trainer = quiet_trainer(tmp_path, max_steps=3, micro_batch_size=4, limit_val_batches=1)
    model = trainer.fit(mlp, regression_data(), optimizer=adamw, loss_fn=F.mse_loss)
    result = trainer.test(test_set)
    assert result["test/loss"] == pytest.approx(full_loss(model, test_set), rel=1e-6)


def _validate_limited(run_dir, layout):
    from parity import GPT4_FNS, token_data

    torch.set_num_threads(1)
    trainer = quiet_trainer(run_dir, layout=layout, max_steps=2, global_batch_size=8,
                            limit_val_batches=2)  # 2 global batches: samples 0-15
    val, fns = RecordingDataset(token_data(seed=3)), GPT4_FNS
    trainer.fit(fns["model_fn"], token_data(), val, optimizer=fns["optimizer_fn"],
                loss_fn=fns["loss_fn"])
    fetched = sorted(val.fetched)
    return trainer.callback_metrics["val/loss"], fetched, trainer.test(val)["test/loss"]


@pytest.mark.timeout(120)
def test_limit_val_batches_validates_the_same_samples_under_any_layout(tmp_path):
    want, fetched, whole = _validate_limited(tmp_path / "one", None)
    assert fetched == list(range(16))
    assert abs(whole - want) > 1e-3  # the data tells a limited validation from a whole one
    for layout in ("dp=2", "pp=2"):  # pp: micro-batches of 2 (4 per step), not 8
        ranks = run_workers(_validate_limited, 2, (tmp_path / layout, layout), timeout=100)
        for rank, (got, _, _) in enumerate(ranks):
            assert got == pytest.approx(want, abs=1e-5), (layout, rank)
        seen = sorted(i for _, part, _ in ranks for i in part)
        assert set(seen) == set(range(16)), (layout, seen)


TEST_SIZES = (23, 17, 1)  # eval batches of 2 x 4: 7 left over; 1 (rank 1 gets none of it); 1


def _test_rank(run_dir):
    torch.set_num_threads(1)
    trainer = quiet_trainer(run_dir, layout="dp=2", max_steps=3, micro_batch_size=4)
    model = trainer.fit(mlp, regression_data(), optimizer=adamw, loss_fn=F.mse_loss)
    results = {}
    for n in TEST_SIZES:
        test_set = RecordingDataset(_data(n))
        results[n] = (trainer.test(test_set)["test/loss"], test_set.fetched)
    return {"rank": int(os.environ["RANK"]), "params": state_of(model), "test": results}


@pytest.mark.timeout(120)
def test_test_on_two_ranks_sees_every_sample_once(tmp_path):
    one = quiet_trainer(tmp_path / "one", max_steps=3, micro_batch_size=4)
    one_model = one.fit(mlp, regression_data(), optimizer=adamw, loss_fn=F.mse_loss)

    ranks = run_workers(_test_rank, 2, (str(tmp_path / "two"),), timeout=100)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert max_param_diff(ranks[0]["params"], state_of(one_model)) < 1e-5
    model = mlp()
    model.load_state_dict(ranks[0]["params"])
    for n in TEST_SIZES:
        (loss0, fetched0), (loss1, fetched1) = ranks[0]["test"][n], ranks[1]["test"][n]
        assert sorted(fetched0 + fetched1) == list(range(n)), f"{n} samples: {fetched0} {fetched1}"
        assert loss0 == loss1, "both ranks must report the same, global value"
        # the hand-computed mean over the whole set, with the weights the two ranks trained
        assert loss0 == pytest.approx(full_loss(model, _data(n)), rel=1e-6, abs=1e-7), n
        assert loss0 == pytest.approx(one.test(_data(n))["test/loss"], rel=1e-5), n
    # 17 = two global batches of 2 ranks x 4, then sample 16 alone: rank 0 gets it, rank 1 nothing
    assert ranks[0]["test"][17][1] == [0, 1, 2, 3, 8, 9, 10, 11, 16]
    assert ranks[1]["test"][17][1] == [4, 5, 6, 7, 12, 13, 14, 15]


# ---- validate() and test() after fit, with the default loggers (the README's example) ----------
def _fit_validate_test(run_dir, layout=None):
    """fit, then validate() and test(), with the default settings (csv and TensorBoard
    loggers, which fit closes when it ends)."""
    from meshtrain import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(layout=layout, max_steps=3, global_batch_size=16, micro_batch_size=4,
                      run_dir=run_dir, progress_bar=False, seed=0, val_every_n_steps=None)
    trainer.fit(mlp, regression_data(), _data(16, seed=7), optimizer=adamw, loss_fn=F.mse_loss)
    return trainer.validate(), trainer.test(_data(23))


def _logged_after_fit(run_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = read_metrics_csv(run_dir / "metrics.csv")
    csv_values = {k: (r["step"], v) for r in rows for k, v in r.items()
                  if k in ("val/loss", "test/loss") and v is not None}
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tb_values = {tag: (e.step, e.value) for tag in ("val/loss", "test/loss")
                 if tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    return {"csv": csv_values, "tensorboard": tb_values}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", [None, "dp=2"])
def test_validate_and_test_after_fit_log_to_the_default_loggers(tmp_path, layout):
    """They crashed with 'TensorBoardLogger was used after finalize()': fit closes its loggers.
    The run's loggers open again for the row and close after it."""
    run_dir = tmp_path / "run"
    if layout is None:
        val, test = _fit_validate_test(run_dir)
    else:
        (val, test), other = run_workers(_fit_validate_test, 2, (run_dir, layout), timeout=100)
        assert other == (val, test), "both ranks report the same, global values"
    assert set(val) == {"val/loss"} and set(test) == {"test/loss"}
    logged = _logged_after_fit(run_dir)
    for where in ("csv", "tensorboard"):
        assert logged[where]["val/loss"] == (3, pytest.approx(val["val/loss"], rel=1e-6)), where
        assert logged[where]["test/loss"] == (3, pytest.approx(test["test/loss"], rel=1e-6)), where


# ---- DataLoaders given to fit -----------------------------------------------------------------
def _fit(run_dir, data, *, steps=14, **kwargs):
    """Train the MLP; 14 steps of 16 out of 96 samples: three epochs (reshuffled each)."""
    recorder = LossRecorder()
    trainer = quiet_trainer(run_dir, max_steps=steps, micro_batch_size=8, log_every_n_steps=1,
                            callbacks=[recorder], **kwargs)
    model = trainer.fit(mlp, data, optimizer=adamw, loss_fn=F.mse_loss)
    losses = torch.tensor(list(recorder.losses.values()))
    return trainer, dict(state_of(model), **{LOSSES: losses})


def _squash_targets(samples):
    """A collate_fn that changes what is learnt: targets are squashed into (-0.5, 0.5)."""
    x, y = default_collate(samples)
    return x, 0.5 * torch.tanh(3 * y)


def _squashed(dataset: TensorDataset) -> TensorDataset:
    x, y = dataset.tensors
    return TensorDataset(x, 0.5 * torch.tanh(3 * y))


def _same(a: dict, b: dict) -> bool:
    return max_param_diff(a, b) <= 1e-6 and torch.allclose(a[LOSSES], b[LOSSES], rtol=0, atol=1e-6)


def test_a_dataloader_trains_like_its_dataset(tmp_path):
    data = regression_data()
    _, from_dataset = _fit(tmp_path / "dataset", data)
    _, from_loader = _fit(tmp_path / "loader", DataLoader(data, batch_size=16, shuffle=True))
    assert _same(from_dataset, from_loader)


def test_the_dataloaders_collate_fn_is_used_for_training_and_test(tmp_path):
    data = regression_data()
    _, plain = _fit(tmp_path / "plain", data)
    trainer, collated = _fit(tmp_path / "collate", DataLoader(data, collate_fn=_squash_targets,
                                                                     shuffle=True))
    _, transformed = _fit(tmp_path / "transformed", _squashed(data))
    assert _same(collated, transformed)
    assert max_param_diff(collated, plain) > 1e-2, "the collate_fn made no difference"
    # trainer.test honours a DataLoader's collate_fn as well
    test_set = _data(23)
    result = trainer.test(DataLoader(test_set, collate_fn=_squash_targets))["test/loss"]
    assert result == pytest.approx(full_loss(trainer.model, _squashed(test_set)), rel=1e-6)
    assert abs(result - trainer.test(test_set)["test/loss"]) > 1e-2


# ---- loader worker processes ------------------------------------------------------------------
class WorkerOnlyDataset(Dataset):
    """Refuses to load in the main process: proves the samples came from loader workers."""

    def __init__(self, base: TensorDataset):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        if get_worker_info() is None:
            raise RuntimeError("loaded in the main process, not in a DataLoader worker")
        return self.base[index]


@pytest.mark.timeout(120)
def test_num_workers_gives_the_same_training_as_loading_in_the_main_process(tmp_path):
    data = regression_data()
    _, reference = _fit(tmp_path / "zero", data)
    trainer, workers = _fit(tmp_path / "trainer", WorkerOnlyDataset(data), num_workers=2)
    assert _same(reference, workers)
    _, loader = _fit(tmp_path / "loader", DataLoader(WorkerOnlyDataset(data), num_workers=2,
                                                          shuffle=True))
    assert _same(reference, loader)
    # validation and test load through workers too, and see every sample once
    test_set = _data(23)
    assert trainer.test(WorkerOnlyDataset(test_set))["test/loss"] == pytest.approx(
        full_loss(trainer.model, test_set), rel=1e-6)
    # fit and test end their loader processes (left to the garbage collector, joining them
    # blocked a later test for 20 s)
    assert multiprocessing.active_children() == []
