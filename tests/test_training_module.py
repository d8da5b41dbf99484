"""Research code on the model (meshtrain.TrainingModule): the seed notes' MNIST-style module
with training_step / validation_step / configure_optimizers, trained under dp, zero3, tp and
HSDP like one process; self.log reduced over the ranks as a hand computation over the global
batch; EarlyStopping on a logged metric; what cannot work refused before any process."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer, state_of
from torch.utils.data import TensorDataset

import meshtrain
from meshtrain import ConfigError, EarlyStopping
from meshtrain.launch.spawn import run_workers

STEPS, BATCH = 6, 16


class MNISTLike(meshtrain.TrainingModule):
    """The seed notes' LitMNIST on 8x8 synthetic 'images': a 2-layer MLP, cross-entropy,
    accuracy logged, SGD with momentum from configure_optimizers."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(64, 32), torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_acc", (logits.argmax(1) == y).float().mean())
        return F.cross_entropy(logits, y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    def tp_plan(self, tp_degree, *, sequence_parallel=False, loss_parallel=False):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def images(n=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 8, 8, generator=gen)
    return TensorDataset(x, (x.flatten(1)[:, :10] * 3).argmax(1))


def _model():
    torch.manual_seed(0)
    return MNISTLike()


def _fit(run_dir, layout=None, **settings):
    kwargs = dict(max_steps=STEPS, global_batch_size=BATCH, log_every_n_steps=1,
                  val_every_n_steps=3, limit_val_batches=None, shuffle=False)
    trainer = quiet_trainer(run_dir, **({"layout": layout} if layout else {}),
                            **{**kwargs, **settings})
    model = trainer.fit(_model, images(), images(64, seed=1))
    return trainer, model


def _rank(run_dir, layout):
    torch.set_num_threads(1)
    trainer, model = _fit(run_dir, layout)
    if layout.startswith("tp"):
        from torch.distributed.tensor import DTensor

        state = {k: v.full_tensor() if isinstance(v, DTensor) else v
                 for k, v in model.state_dict().items()}
    elif "zero" in layout or "dp_shard" in layout:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    else:
        state = state_of(model)
    metrics = dict(trainer.callback_metrics)
    return ({k: v.detach().cpu().clone() for k, v in state.items()}, metrics) \
        if trainer.is_global_zero else None


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    torch.set_num_threads(1)
    trainer, model = _fit(tmp_path_factory.mktemp("one"))
    return state_of(model), dict(trainer.callback_metrics)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout,processes", [("dp=2", 2), ("zero3=2", 2), ("tp=2", 2),
                                              ("dp_replicate=2,dp_shard=2", 4)])
def test_the_module_trains_like_one_process(tmp_path, one_process, layout, processes):
    runs = run_workers(_rank, processes, (str(tmp_path), layout), timeout=150)
    state, metrics = next(run for run in runs if run is not None)  # (ps: rank 0 is a server)
    reference, reference_metrics = one_process
    assert set(state) == set(reference)
    for name, value in reference.items():
        assert torch.allclose(state[name], value, atol=1e-5, rtol=0), name
    # the logged accuracy and the validation step's loss and accuracy agree too
    for name in ("train_acc", "val/loss", "val_acc", "train/loss"):
        assert metrics[name] == pytest.approx(reference_metrics[name], abs=1e-5), name


class SequenceLM(meshtrain.TrainingModule):
    """A language model's step on the model; context parallel through the hook it passes on
    to the GPT it holds (a model supplies its own cp hooks)."""

    def __init__(self):
        super().__init__()
        from parity import tiny_gpt_seq12

        self.gpt = tiny_gpt_seq12()

    def enable_context_parallel(self, cp_mesh):
        self.gpt.enable_context_parallel(cp_mesh)

    def training_step(self, batch, batch_idx):
        from parity import lm_loss

        return lm_loss(self.gpt(batch[0]), batch[1])

    def configure_optimizers(self):
        from parity import adamw_gpt

        return adamw_gpt(self.parameters())


def _module_rank(run_dir, layout, module):
    """Rank 0's state after 4 steps of ``module`` ("lm": SequenceLM on 12-token sequences,
    "adamw": AdamWModule on images) under ``layout`` (None: one process)."""
    from parity import token_data_seq12

    torch.set_num_threads(1)
    model_class, data, batch = {"lm": (SequenceLM, token_data_seq12, 8),
                                "adamw": (AdamWModule, lambda: images(64), 16)}[module]
    trainer = quiet_trainer(run_dir, **({"layout": layout} if layout else {}), max_steps=4,
                            global_batch_size=batch, shuffle=False)
    model = trainer.fit(model_class, data())
    return state_of(model) if trainer.is_global_zero else None


def _same_as_one_process(tmp_path, layout, module):
    reference = _module_rank(str(tmp_path / "one"), None, module)
    state = run_workers(_module_rank, 2, (str(tmp_path / "two"), layout, module),
                        timeout=120)[0]
    for name, value in reference.items():
        assert torch.allclose(state[name], value, atol=1e-5, rtol=0), name


@pytest.mark.timeout(150)
def test_the_step_runs_on_each_ranks_chunks_of_the_sequence_under_cp(tmp_path):
    _same_as_one_process(tmp_path, "cp=2", "lm")


# -- self.log --------------------------------------------------------------------------------
class Logged(MNISTLike):
    """Logs, per micro-batch, the mean, sum and max of the targets it got."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.log("y_mean", y.float().mean())
        self.log("y_sum", y.float().sum(), reduce="sum")
        self.log("y_max", y.float().max(), reduce="max", on_epoch=True)
        self.trainer.log("items", len(y), reduce="sum", on_step=False, on_epoch=True)
        return F.cross_entropy(self(x), y)


def _logged_rank(run_dir):
    torch.set_num_threads(1)
    trainer = quiet_trainer(run_dir, layout="dp=2", max_steps=4, global_batch_size=BATCH,
                            micro_batch_size=4, log_every_n_steps=2, shuffle=False,
                            loggers=("csv",))
    trainer.fit(Logged, images(64))  # one epoch of 4 steps
    return str(trainer.run_dir)


@pytest.mark.timeout(150)
def test_logged_values_are_reduced_over_the_global_batch(tmp_path):
    from meshtrain.observe.loggers import read_metrics_csv

    run_dir = run_workers(_logged_rank, 2, (str(tmp_path),), timeout=120)[0]
    rows = {}  # the step's row and, at step 4, the epoch's (merged)
    for row in read_metrics_csv(f"{run_dir}/metrics.csv"):
        rows.setdefault(row["step"], {}).update({k: v for k, v in row.items() if v is not None})
    y = images(64).tensors[1].float()
    for step in (2, 4):  # each logging interval: two steps of 16 samples, in order
        seen = y[(step - 2) * BATCH: step * BATCH]
        assert rows[step]["y_mean"] == pytest.approx(float(seen.mean()), abs=1e-6)
        assert rows[step]["y_sum"] == float(seen.sum())
        assert rows[step]["y_max"] == float(seen.max())
    assert rows[4]["items"] == 64 and rows[4]["y_max_epoch"] == float(y.max())
    assert "items" not in rows[2]  # on_epoch only: logged once, at the epoch's end


class ScriptedScore(MNISTLike):
    """Logs a validation score that gets worse after the second validation."""

    def validation_step(self, batch, batch_idx):
        self.log("score", [0.5, 0.4, 0.6, 0.7, 0.8][self.trainer.global_step // 2 - 1])
        return None


def test_early_stopping_on_a_logged_metric(tmp_path):
    stop = EarlyStopping(monitor="score", patience=2, mode="min")
    trainer = quiet_trainer(tmp_path, max_steps=10, global_batch_size=BATCH,
                            val_every_n_steps=2, callbacks=[stop])
    trainer.fit(ScriptedScore, images(), images(32, seed=1))
    # best 0.4 at step 4; 0.6 (step 6) and 0.7 (step 8) do not improve: stop at step 8
    assert trainer.global_step == 8 and stop.best == 0.4
    assert "val/loss" not in trainer.callback_metrics  # its validation_step returns nothing


# -- refused before any process --------------------------------------------------------------
def test_what_a_module_cannot_do_is_refused_before_any_process(tmp_path):
    data = images()
    with pytest.raises(ConfigError, match="cannot pipeline MNISTLike: it needs its blocks in "
                                          "model.layers"):  # (BlockMNIST can: above)
        quiet_trainer(tmp_path, layout="pp=2", devices=2, max_steps=2).check(MNISTLike, data)
    with pytest.raises(ConfigError, match="computes the loss: drop loss_fn"):
        quiet_trainer(tmp_path, max_steps=2).check(MNISTLike, data, loss_fn=F.cross_entropy)
    with pytest.raises(ConfigError, match="needs a validation_step"):
        quiet_trainer(tmp_path, max_steps=2).check(Plain, data, images(32))
    with pytest.raises(ConfigError, match="fit needs an optimizer"):
        quiet_trainer(tmp_path, max_steps=2).check(lambda: torch.nn.Linear(64, 10), data,
                                                   loss_fn=F.cross_entropy)
    with pytest.raises(ConfigError, match="self.log"):
        quiet_trainer(tmp_path, max_steps=2, metrics=["token_accuracy"]).check(MNISTLike, data)
    with pytest.raises(ConfigError, match="under zero1 meshtrain builds the sharded optimizer"):
        quiet_trainer(tmp_path, layout="zero1=2", devices=2, max_steps=2).check(MNISTLike, data)
    with pytest.raises(ConfigError, match="several optimizers"):
        quiet_trainer(tmp_path, max_steps=2).check(TwoOptimizers, data)
    with pytest.raises(ConfigError, match="outside fit"):
        MNISTLike().log("x", 1.0)


class AdamWModule(MNISTLike):
    """configure_optimizers returns torch's AdamW: under zero1 meshtrain rebuilds it from its
    defaults, which hold decoupled_weight_decay, not a constructor argument (it failed)."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


@pytest.mark.timeout(150)
def test_a_module_s_own_adamw_under_zero1_trains_as_one_process(tmp_path):
    _same_as_one_process(tmp_path, "zero1=2", "adamw")


class TwoOptimizers(MNISTLike):
    def configure_optimizers(self):
        return (torch.optim.SGD(self.fc1.parameters(), lr=0.1),
                torch.optim.SGD(self.fc2.parameters(), lr=0.1))


class Plain(torch.nn.Module):
    """No TrainingModule base: a plain module with the methods works (trainer.log logs)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return {"loss": F.cross_entropy(self.fc(x.flatten(1)), y)}

    def configure_optimizers(self):
        return {"optimizer": torch.optim.SGD(self.parameters(), lr=0.1)}


def test_a_plain_module_with_a_training_step_matches_a_hand_written_loop(tmp_path):
    torch.manual_seed(0)
    model = Plain()
    reference = Plain()
    reference.load_state_dict(model.state_dict())
    quiet_trainer(tmp_path, max_steps=4, global_batch_size=BATCH, shuffle=False).fit(
        model, images())
    x, y = images().tensors
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        optimizer.zero_grad()
        reference.training_step((x[step * BATCH:(step + 1) * BATCH],
                                 y[step * BATCH:(step + 1) * BATCH]), step)["loss"].backward()
        optimizer.step()
    for name, value in reference.state_dict().items():
        assert torch.allclose(model.state_dict()[name], value, atol=1e-6), name


# -- snapshots every N epochs ------------------------------------------------------------------
def test_a_snapshot_at_each_epoch_end_resumes_the_next_epoch_exactly(tmp_path):
    """4 steps per epoch of 64 samples: snapshots at steps 4, 8, 12; the run resumed from
    the first trains to the same weights as the uninterrupted one."""
    common = dict(max_epochs=3, max_steps=None, global_batch_size=BATCH, seed=3)
    full = quiet_trainer(tmp_path / "full", checkpoint_every_n_epochs=1, **common)
    weights = state_of(full.fit(Plain, images(64)))
    folders = sorted(p.name for p in (tmp_path / "full" / "checkpoints").glob("step_*"))
    assert folders == ["step_00000004", "step_00000008", "step_00000012"]
    resumed = quiet_trainer(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoints"
                                                              / "step_00000004"), **common)
    again = state_of(resumed.fit(Plain, images(64)))
    assert resumed.global_step == 12
    for name, value in weights.items():
        assert torch.equal(again[name], value), name


# -- the time limit ---------------------------------------------------------------------------
def test_max_time_stops_with_a_checkpoint_from_which_the_job_continues_exactly(tmp_path):
    """A limit already passed at the first logging interval (step 2) stops there; running the
    job again resumes that run and ends with the uninterrupted run's weights."""
    common = dict(max_steps=6, global_batch_size=BATCH, log_every_n_steps=2, seed=3,
                  root_dir=str(tmp_path), name="timed", resume="auto",
                  save_final_checkpoint=False)
    full = state_of(quiet_trainer(None, **{**common, "root_dir": str(tmp_path / "full")}).fit(
        Plain, images(64)))
    first = quiet_trainer(None, max_time_minutes=1e-9, **common)
    first.fit(Plain, images(64))
    assert first.global_step == 2 and first.stop_reason == "max_time"
    again = quiet_trainer(None, **common)
    weights = state_of(again.fit(Plain, images(64)))
    assert again.run_dir == first.run_dir and again.global_step == 6  # the same run, continued
    for name, value in full.items():
        assert torch.equal(weights[name], value), name


# -- EMA of the weights -----------------------------------------------------------------------
class ParamsAfterEachStep(meshtrain.Callback):
    def __init__(self):
        self.steps = []

    def on_train_step_end(self, trainer, metrics):
        self.steps.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})


def _ema_rank(run_dir, layout, decay):
    torch.set_num_threads(1)
    ema = meshtrain.EMA(decay=decay)
    trainer = quiet_trainer(run_dir, **({"layout": layout} if layout else {}), max_steps=5,
                            global_batch_size=BATCH, shuffle=False, callbacks=[ema])
    trainer.fit(_model, images())
    from torch.distributed.tensor import DTensor

    whole = {n: (v.full_tensor() if isinstance(v, DTensor) else v).cpu()
             for n, v in ema.weights().items()}
    return whole if int(os.environ.get("RANK", 0)) == 0 else None


@pytest.mark.timeout(150)
def test_ema_under_zero3_equals_a_hand_computed_ema(tmp_path):
    decay = 0.8
    torch.set_num_threads(1)
    record = ParamsAfterEachStep()
    trainer = quiet_trainer(tmp_path / "one", max_steps=5, global_batch_size=BATCH,
                            shuffle=False, callbacks=[record])
    model = _model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.fit(model, images())
    hand = start
    for after in record.steps:  # ema = decay * ema + (1 - decay) * param, step by step
        hand = {n: decay * hand[n] + (1 - decay) * after[n] for n in hand}
    ema = run_workers(_ema_rank, 2, (str(tmp_path / "z3"), "zero3=2", decay), timeout=120)[0]
    assert set(ema) == set(hand)
    for name, value in hand.items():
        assert torch.allclose(ema[name], value, atol=1e-5, rtol=0), name
    assert not torch.allclose(hand["fc1.weight"], record.steps[-1]["fc1.weight"], atol=1e-3)


def test_ema_weights_validate_when_asked_and_training_weights_come_back(tmp_path):
    ema = meshtrain.EMA(decay=0.5, use_for_validation=True)
    trainer = quiet_trainer(tmp_path, max_steps=4, global_batch_size=BATCH, callbacks=[ema],
                            limit_val_batches=None)
    val = images(32, seed=1)
    model = trainer.fit(_model, images(), val)
    averaged = MNISTLike()
    averaged.load_state_dict(ema.weights())
    x, y = val.tensors
    with torch.no_grad():
        expected = float(F.cross_entropy(averaged(x), y))
        trained = float(F.cross_entropy(model(x), y))
    assert trainer.callback_metrics["val/loss"] == pytest.approx(expected, abs=1e-6)
    assert abs(trained - expected) > 1e-4  # the model returned holds its own weights again


# -- prepare_data and data built after it -------------------------------------------------------
class Downloads(MNISTLike):
    """Its prepare_data 'downloads' the data set into a folder (and counts its calls)."""

    folder = None

    @classmethod
    def target(cls) -> str:
        return cls.folder

    def prepare_data(self):
        os.makedirs(self.target(), exist_ok=True)
        with open(f"{self.folder}/calls.txt", "a") as f:
            f.write(f"rank {os.environ.get('RANK', 0)}\n")
        time.sleep(0.5)  # a slow download: a rank that did not wait finds no file
        torch.save(images().tensors, f"{self.target()}/data.pt")


class DownloadsPerNode(Downloads):
    """Each node has its own disk: the data goes to a folder of the node."""

    prepare_data_per_node = True

    @classmethod
    def target(cls) -> str:
        return f"{cls.folder}/node{os.environ['RANK']}"  # one rank per node here


def _prepare_rank(folder, per_node):
    """``per_node``: two 'nodes' of one rank each (every rank is its node's local rank 0)."""
    torch.set_num_threads(1)
    module = DownloadsPerNode if per_node else Downloads
    if per_node:
        os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = "0", "1"
    module.folder = folder

    def read():  # built after prepare_data, on every rank (the file must exist by then)
        return TensorDataset(*torch.load(f"{module.target()}/data.pt"))

    trainer = quiet_trainer(f"{folder}/run", layout="dp=2", max_steps=2,
                            global_batch_size=BATCH)
    trainer.fit(module, read)
    return trainer.global_step


@pytest.mark.timeout(120)
def test_prepare_data_runs_once_and_the_other_rank_reads_after_it(tmp_path):
    steps = run_workers(_prepare_rank, 2, (str(tmp_path), False), timeout=100)
    assert steps == [2, 2]
    assert (tmp_path / "calls.txt").read_text() == "rank 0\n"


@pytest.mark.timeout(120)
def test_prepare_data_per_node_runs_on_each_nodes_first_rank(tmp_path):
    steps = run_workers(_prepare_rank, 2, (str(tmp_path), True), timeout=100)
    assert steps == [2, 2]
    assert sorted((tmp_path / "calls.txt").read_text().split("\n")) == ["", "rank 0", "rank 1"]


def _swa_rank(run_dir, layout):
    torch.set_num_threads(1)
    swa = meshtrain.SWA(start_step=3)
    trainer = quiet_trainer(run_dir, **({"layout": layout} if layout else {}), max_steps=6,
                            global_batch_size=BATCH, shuffle=False, callbacks=[swa])
    model = trainer.fit(_model, images())
    from torch.distributed.tensor import DTensor

    whole = {n: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
             for n, v in model.named_parameters()}
    return whole if int(os.environ.get("RANK", 0)) == 0 else None


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", ["dp=2", "zero3=2"])
def test_swa_averages_the_weights_of_the_steps_from_its_start(tmp_path, layout):
    """The model fit returns holds the mean of the weights after steps 3, 4, 5 and 6, as a
    one-process run recorded them."""
    torch.set_num_threads(1)
    record = ParamsAfterEachStep()
    quiet_trainer(tmp_path / "one", max_steps=6, global_batch_size=BATCH, shuffle=False,
                  callbacks=[record]).fit(_model, images())
    hand = {n: torch.stack([step[n] for step in record.steps[2:]]).mean(0)
            for n in record.steps[0]}
    swa = run_workers(_swa_rank, 2, (str(tmp_path / "two"), layout), timeout=120)[0]
    for name, value in hand.items():
        assert torch.allclose(swa[name], value, atol=1e-5, rtol=0), name
    assert not torch.allclose(hand["fc1.weight"], record.steps[-1]["fc1.weight"], atol=1e-4)


# -- a loss over the whole global batch's items, from inside the step ---------------------------
class TokenSum(torch.nn.Module):
    """Next-token logits over a tiny vocabulary; targets -100 are padding. Its steps return
    the micro-batch's summed loss; count_loss_items says over how many tokens."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)

    def forward(self, x):
        return self.head(self.emb(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten(), ignore_index=-100,
                               reduction="sum")

    def count_loss_items(self, batch):
        return (batch[1] != -100).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def padded_tokens(n=64, seq=6):
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(0, 11, (n, seq), generator=gen)
    y = torch.randint(0, 11, (n, seq), generator=gen)
    lengths = torch.randint(1, seq + 1, (n,), generator=gen)  # uneven padding per sample
    y[torch.arange(seq)[None, :] >= lengths[:, None]] = -100
    return TensorDataset(x, y)


def _token_rank(run_dir):
    torch.set_num_threads(1)
    trainer = quiet_trainer(run_dir, layout="dp=2", max_steps=4, global_batch_size=BATCH,
                            micro_batch_size=4, shuffle=False)
    model = trainer.fit(TokenSum, padded_tokens())
    return state_of(model) if int(os.environ["RANK"]) == 0 else None


@pytest.mark.timeout(120)
def test_a_step_returning_sums_gets_the_global_batch_mean_over_ranks_and_micro_batches(tmp_path):
    """Ranks and micro-batches hold different numbers of real tokens: each step's gradient is
    the mean over every real token of the global batch, as one process computes it by hand."""
    reference = TokenSum()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    x, y = padded_tokens().tensors
    for step in range(4):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        optimizer.zero_grad()
        F.cross_entropy(reference(x[batch]).flatten(0, 1), y[batch].flatten(),
                        ignore_index=-100).backward()  # the mean over the step's real tokens
        optimizer.step()
    state = run_workers(_token_rank, 2, (str(tmp_path),), timeout=100)[0]
    for name, value in state_of(reference).items():
        assert torch.allclose(state[name], value, atol=1e-5, rtol=0), name
