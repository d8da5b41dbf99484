"""The Trainer's features, mostly in one process; the distributed ones against one process."""

import math
import os
import struct

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    LossRecorder, RecordingDataset, full_loss, quiet_trainer, sgd_momentum, state_of,
)
from parity import (
    IN_FEATURES, LOSSES, OUT_FEATURES, adamw, max_param_diff, mlp, regression_data, run_layout,
)
from torch.utils.data import TensorDataset

from meshtrain import Callback
from meshtrain.checkpoint.state import load_model_weights
from meshtrain.launch.spawn import run_workers
from meshtrain.observe.loggers import read_metrics_csv

# single-process checkpoints: DCP says it saves/loads without a process group, as intended
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.usefixtures("one_thread")]


# ---- training ---------------------------------------------------------------------------------
def test_loss_goes_down_and_the_users_model_comes_back(tmp_path):
    data = regression_data()
    model = mlp()
    before = full_loss(model, data)
    recorder = LossRecorder()
    trainer = quiet_trainer(tmp_path, max_steps=30, log_every_n_steps=1, callbacks=[recorder])
    returned = trainer.fit(model, data, optimizer=adamw, loss_fn=F.mse_loss)

    assert returned is model and type(returned) is torch.nn.Sequential  # no wrapper
    assert trainer.model is model
    assert trainer.global_step == 30
    assert sorted(recorder.losses) == list(range(1, 31))
    first, last = recorder.losses[1], sum(recorder.losses[s] for s in range(26, 31)) / 5
    assert last < 0.5 * first, f"loss went from {first:.4f} to {last:.4f}"
    # the model object the user holds was trained in place
    assert full_loss(model, data) < 0.5 * before


def test_max_epochs_sets_the_number_of_steps(tmp_path):
    # 42 samples, global batch 8: 5 full batches per epoch (the last 2 samples are dropped)
    base = TensorDataset(torch.randn(42, 4), torch.randn(42, 2))
    data = RecordingDataset(base)
    recorder = LossRecorder()
    trainer = quiet_trainer(tmp_path, max_epochs=3, global_batch_size=8, micro_batch_size=4,
                            log_every_n_steps=1, callbacks=[recorder])
    trainer.fit(torch.nn.Linear(4, 2), data, optimizer=adamw, loss_fn=F.mse_loss)

    assert trainer.global_step == 3 * (42 // 8) == recorder.steps_ended
    assert recorder.epochs_started == 3
    assert trainer.current_epoch == 2
    assert len(data.fetched) == 3 * 40
    for epoch in range(3):  # every epoch sees 40 distinct samples
        seen = data.fetched[epoch * 40:(epoch + 1) * 40]
        assert len(set(seen)) == 40
    assert data.fetched[:40] != data.fetched[40:80], "epochs are shuffled differently"


def test_max_steps_and_max_epochs_stop_at_the_earlier(tmp_path):
    data = TensorDataset(torch.randn(40, 4), torch.randn(40, 2))
    trainer = quiet_trainer(tmp_path / "a", max_epochs=3, max_steps=7, global_batch_size=8)
    trainer.fit(torch.nn.Linear(4, 2), data, optimizer=adamw, loss_fn=F.mse_loss)
    assert trainer.global_step == 7
    trainer = quiet_trainer(tmp_path / "b", max_epochs=1, max_steps=7, global_batch_size=8)
    trainer.fit(torch.nn.Linear(4, 2), data, optimizer=adamw, loss_fn=F.mse_loss)
    assert trainer.global_step == 5


def test_lr_scheduler_steps_once_per_optimizer_step(tmp_path):
    seen_lrs = []

    class LrRecorder(Callback):
        def on_train_step_start(self, trainer):
            seen_lrs.append(trainer.optimizer.param_groups[0]["lr"])

    calls = []

    def factor(step):
        calls.append(step)
        return 0.5 ** step

    def scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    # 4 micro-batches per step: a scheduler stepped per micro-batch would decay 4x faster
    trainer = quiet_trainer(tmp_path, max_steps=5, micro_batch_size=4, callbacks=[LrRecorder()])
    trainer.fit(mlp, regression_data(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                loss_fn=F.mse_loss, lr_scheduler=scheduler)
    assert trainer.grad_accum_steps == 4
    assert seen_lrs == pytest.approx([0.1 * 0.5 ** s for s in range(5)])
    assert trainer.lr_scheduler.last_epoch == 5
    assert calls == list(range(6))  # once at construction, then once per optimizer step
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 5)


# ---- validation -------------------------------------------------------------------------------
def _val_data(n=23):
    gen = torch.Generator().manual_seed(99)
    x = torch.randn(n, IN_FEATURES, generator=gen)
    return TensorDataset(x, torch.randn(n, OUT_FEATURES, generator=gen))


def test_validate_is_the_sample_weighted_mean_over_the_whole_set(tmp_path):
    val = _val_data(23)  # 23 = 5 batches of 4 and one of 3: a plain mean of batch means is wrong
    trainer = quiet_trainer(tmp_path, max_steps=3, global_batch_size=16, micro_batch_size=4)
    model = trainer.fit(mlp, regression_data(), optimizer=adamw, loss_fn=F.mse_loss)
    result = trainer.validate(val)
    assert set(result) == {"val/loss"}
    expected = full_loss(model, val)
    assert result["val/loss"] == pytest.approx(expected, rel=1e-6, abs=1e-7)
    x, y = val.tensors
    with torch.no_grad():
        batch_means = [F.mse_loss(model(x[i:i + 4]), y[i:i + 4]).item() for i in range(0, 23, 4)]
    unweighted = sum(batch_means) / len(batch_means)
    assert abs(unweighted - expected) > 1e-4, "the data does not tell the two means apart"
    assert model.training, "validate must restore train mode"


def _validate_rank(run_dir, steps):
    torch.set_num_threads(1)
    trainer = quiet_trainer(run_dir, layout="dp=2", max_steps=steps, global_batch_size=16,
                            micro_batch_size=4)
    torch.manual_seed(0)  # the initial parameters the one-process run gets from seed=0
    user_model = mlp()
    model = trainer.fit(user_model, regression_data(), optimizer=adamw, loss_fn=F.mse_loss)
    val = RecordingDataset(_val_data(23))
    result = trainer.validate(val)
    return {
        "val": result["val/loss"], "fetched": val.fetched, "params": state_of(model),
        "same_model": model is user_model and type(model) is torch.nn.Sequential,
        "rank": int(os.environ["RANK"]),
    }


@pytest.mark.timeout(120)
def test_validate_on_two_ranks_sees_every_sample_once_and_matches_one_process(tmp_path):
    steps = 3
    one = quiet_trainer(tmp_path / "one", max_steps=steps, global_batch_size=16, micro_batch_size=4)
    one_model = one.fit(mlp, regression_data(), optimizer=adamw, loss_fn=F.mse_loss)
    reference = one.validate(_val_data(23))["val/loss"]

    ranks = run_workers(_validate_rank, 2, (str(tmp_path / "two"), steps), timeout=100)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["same_model"] for r in ranks)
    # every one of the 23 indices was fetched exactly once over both ranks
    fetched = ranks[0]["fetched"] + ranks[1]["fetched"]
    assert sorted(fetched) == list(range(23))
    assert ranks[0]["fetched"] and ranks[1]["fetched"]
    # both ranks report the same, global value, equal to one process's
    assert ranks[0]["val"] == ranks[1]["val"]
    assert abs(ranks[0]["val"] - reference) <= 1e-6
    assert max_param_diff(ranks[0]["params"], state_of(one_model)) < 1e-5
    # and equal to the hand-computed mean loss of the parameters the two ranks trained
    model = mlp()
    model.load_state_dict(ranks[0]["params"])
    assert ranks[0]["val"] == pytest.approx(full_loss(model, _val_data(23)), rel=1e-6)


# ---- checkpoints ------------------------------------------------------------------------------
def _dropout_mlp():
    # dropout makes the run depend on the random number generator, which a resume must restore
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, 32), torch.nn.GELU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(32, OUT_FEATURES),
    )


def _cosine(optimizer):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)


def _resume_runs(base_dir, k, layout=None):
    """(losses and params of a k+1-step run, and of k steps + save + a fresh resumed run)."""
    from pathlib import Path

    base_dir = Path(base_dir)
    common = dict(global_batch_size=16, micro_batch_size=4, log_every_n_steps=1, layout=layout)
    fit = dict(optimizer=adamw, loss_fn=F.mse_loss, lr_scheduler=_cosine)

    full = LossRecorder()
    trainer = quiet_trainer(base_dir / "full", max_steps=k + 1, callbacks=[full], **common)
    full_params = state_of(trainer.fit(_dropout_mlp, regression_data(), **fit))

    first = quiet_trainer(base_dir / "first", max_steps=k, save_final_checkpoint=True, **common)
    first.fit(_dropout_mlp, regression_data(), **fit)

    resumed_losses = LossRecorder()
    resumed = quiet_trainer(base_dir / "resumed", max_steps=k + 1, callbacks=[resumed_losses],
                            resume=base_dir / "first" / "checkpoints" / "final", **common)
    torch.manual_seed(1)  # a fresh model with other parameters: all must come from the checkpoint
    model = resumed.fit(_dropout_mlp(), regression_data(), **fit)
    return {
        "full_losses": full.losses, "full_params": full_params,
        "resumed_losses": resumed_losses.losses, "resumed_params": state_of(model),
        "resumed_step": resumed.global_step,
        "lr": (trainer.optimizer.param_groups[0]["lr"], resumed.optimizer.param_groups[0]["lr"]),
    }


def _check_resume(out, k):
    assert out["resumed_step"] == k + 1
    assert list(out["resumed_losses"]) == [k + 1], "the resumed run must do exactly one step"
    assert out["resumed_losses"][k + 1] == out["full_losses"][k + 1]  # exact
    assert out["lr"][0] == out["lr"][1]
    for name, value in out["full_params"].items():
        assert torch.equal(value, out["resumed_params"][name]), name


# 96 samples / 16 = 6 steps per epoch: k=6 saves at the end of an epoch (the sampler is exhausted
# there), k=7 in the middle of the second one
@pytest.mark.parametrize("k", [6, 7])
def test_checkpoint_resume_reproduces_the_uninterrupted_run(tmp_path, k):
    out = _resume_runs(tmp_path, k)
    _check_resume(out, k)
    # the step-(k+1) loss is not the same as a fresh run's first loss (the test would be empty)
    assert out["full_losses"][k + 1] != out["full_losses"][1]


def test_validation_does_not_change_training(tmp_path):
    # validation builds its own loader iterator; it must not draw from the random stream that
    # the training step's dropout uses
    fit = dict(optimizer=adamw, loss_fn=F.mse_loss)
    plain = quiet_trainer(tmp_path / "a", max_steps=6, global_batch_size=16)
    without = state_of(plain.fit(_dropout_mlp, regression_data(), **fit))
    validated = quiet_trainer(tmp_path / "b", max_steps=6, global_batch_size=16,
                              val_every_n_steps=2)
    with_val = state_of(validated.fit(_dropout_mlp, regression_data(), _val_data(), **fit))
    for name, value in without.items():
        assert torch.equal(value, with_val[name]), name


def _resume_rank(base_dir, k):
    torch.set_num_threads(1)
    out = _resume_runs(base_dir, k, layout="dp=2")
    return out if int(os.environ["RANK"]) == 0 else None


@pytest.mark.timeout(120)
def test_checkpoint_resume_on_two_ranks(tmp_path):
    k = 4
    out = run_workers(_resume_rank, 2, (str(tmp_path), k), timeout=100)[0]
    _check_resume(out, k)
    # both ranks' random states were saved (each rank has its own dropout masks)
    final = tmp_path / "first" / "checkpoints" / "final"
    assert (final / "rng_rank0.pt").exists() and (final / "rng_rank1.pt").exists()


# ---- run folder -------------------------------------------------------------------------------
def test_run_folder_contents(tmp_path, capsys):
    run_dir = tmp_path / "run"
    trainer = quiet_trainer(run_dir, max_steps=6, log_every_n_steps=2, val_every_n_steps=3,
                            loggers=("csv", "tensorboard"), save_final_checkpoint=True)
    model = trainer.fit(mlp, regression_data(), _val_data(), optimizer=adamw,
                        loss_fn=F.mse_loss)
    lines = capsys.readouterr().out.splitlines()  # fit names its folder first and last
    assert lines[0] == lines[-1] == f"run folder: {run_dir}", lines

    rows = read_metrics_csv(run_dir / "metrics.csv")
    train_steps = [r["step"] for r in rows if r.get("train/loss") is not None]
    val_steps = [r["step"] for r in rows if r.get("val/loss") is not None]
    assert train_steps == [2, 4, 6]
    assert val_steps == [3, 6]
    assert all(math.isfinite(r["train/loss"]) for r in rows if r.get("train/loss") is not None)

    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0

    png = (run_dir / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 100 and height > 100

    final = run_dir / "checkpoints" / "final"
    for name in (".metadata", "trainer_state.pt", "rng_rank0.pt", "meshtrain.json"):
        assert (final / name).is_file(), name
    assert not list((run_dir / "checkpoints").glob(".tmp-*")), "a temporary folder was left"
    import json

    summary = json.loads((final / "meshtrain.json").read_text())
    assert summary["step"] == 6 and summary["world_size"] == 1
    # the final checkpoint holds the returned model's weights
    fresh = mlp()
    load_model_weights(final, fresh)
    assert max_param_diff(state_of(fresh), state_of(model)) == 0.0


# ---- communication hooks and precision --------------------------------------------------------
HOOK_COMMON = dict(max_steps=20, global_batch_size=16, accelerator="cpu")


def _hooks_rank(hooks):
    from parity import train_state

    return {hook: train_state(dict(HOOK_COMMON, layout="dp=2", comm_hook=hook),
                              optimizer_fn=sgd_momentum) for hook in hooks}


@pytest.mark.timeout(150)
def test_comm_hooks_on_two_ranks(tmp_path):
    reference = run_layout(dict(HOOK_COMMON), 1, optimizer_fn=sgd_momentum)
    moved = max_param_diff(
        reference, run_layout(dict(HOOK_COMMON, max_steps=1), 1, optimizer_fn=sgd_momentum))
    # one job, fresh Trainers in it: cheaper than starting processes per hook
    results = run_workers(_hooks_rank, 2, ((None, "fp16", "bf16", "powersgd"),), timeout=140)[0]
    diffs = {hook: max_param_diff(reference, state) for hook, state in results.items()}
    assert diffs[None] <= 1e-5
    # fp16 / bf16 gradients in the all-reduce: rounding only, so close to one process
    # (1e-2 is the looser parity tolerance for compressed communication)
    for hook in ("fp16", "bf16"):
        assert diffs[hook] <= 1e-2, f"comm_hook={hook}: {diffs[hook]:.3e} from one process"
        assert moved > 10 * diffs[hook]
    # the hooks really ran: rounding shows, and bf16 (8 mantissa bits) rounds more than fp16 (11)
    assert diffs[None] < diffs["fp16"] < diffs["bf16"]

    # PowerSGD is lossy by design (rank-1 compression with error feedback): it must train
    data = regression_data()
    torch.manual_seed(0)
    initial = full_loss(mlp(), data)
    trained = {}
    for hook in (None, "powersgd"):
        model = mlp()
        model.load_state_dict({k: v for k, v in results[hook].items() if k != LOSSES})
        trained[hook] = full_loss(model, data)
    assert trained["powersgd"] < 0.7 * initial
    # at least half of the progress exact all-reduce makes in the same steps
    assert initial - trained["powersgd"] > 0.5 * (initial - trained[None])
    assert diffs["powersgd"] > diffs["fp16"]


def test_bf16_mixed_on_cpu_runs_close_to_fp32(tmp_path):
    common = dict(max_steps=20, global_batch_size=16, accelerator="cpu")
    fp32 = run_layout(dict(common), 1)
    bf16 = run_layout(dict(common, precision="bf16-mixed"), 1)
    torch.manual_seed(0)
    moved = max_param_diff(fp32, state_of(mlp()))  # how far fp32 training went from the start
    diff = max_param_diff(fp32, bf16)
    # bf16 autocast keeps ~3 significant digits in matmuls; AdamW (lr 1e-2) normalises the
    # gradient, so its rounding noise moves each parameter by up to ~lr per step. 5e-2 is the
    # looser tolerance seen for bf16 vs fp32 with this optimizer (the notes measured 0.05).
    assert diff <= 5e-2, f"bf16-mixed differs from fp32 by {diff:.3e}"
    assert diff > 0, "autocast did not run in bf16"
    assert diff < moved / 4
    data = regression_data()
    model = mlp()
    model.load_state_dict({k: v for k, v in bf16.items() if k != LOSSES})
    torch.manual_seed(0)
    assert full_loss(model, data) < 0.5 * full_loss(mlp(), data)
