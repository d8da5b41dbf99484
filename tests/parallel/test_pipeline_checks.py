"""Pipeline checks (issue 12): stages must compute the model's own forward (refused before any
process starts when they would not, naming what differs), weights shared across stages through
``forward`` are refused, and time/memory balancing gives every rank one split."""

import os

import pytest
import torch
import torch.distributed as dist
from conftest import trainer_kwargs
from parity import GPT4_FNS, SEQ, VOCAB, adamw_gpt, lm_loss, mlp, tiny_gpt, token_data
from torch import nn

from meshtrain import ConfigError, Trainer
from meshtrain.launch.spawn import run_workers

D = VOCAB  # hidden width equal to the vocabulary: a stage's hidden state has the logits' shape


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class PosAfterEmbed(nn.Module):
    """``forward`` adds a learned positional term after ``embed``: every shape fits, so stages
    running embed -> layers -> norm -> head would train a different function silently."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(0.5 * torch.randn(SEQ, D))
        self.layers = nn.ModuleList(Residual() for _ in range(4))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        h = self.embed(idx) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class TiedThroughForward(nn.Module):
    """The output projection is the embedding's weight, used in ``forward`` (no shared module):
    the last stage would not hold ``embed.weight``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Residual() for _ in range(4))
        self.norm = nn.LayerNorm(D)

    def forward(self, idx):
        h = self.embed(idx)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h) @ self.embed.weight.T


class ScaledOutput(TiedThroughForward):
    """A parameter-free difference: only comparing the outputs can see it."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        h = self.embed(idx)
        for layer in self.layers:
            h = layer(h)
        return 2.0 * self.head(self.norm(h))


class TupleOutput(ScaledOutput):
    def forward(self, idx):
        return super().forward(idx) / 2.0, idx


@pytest.fixture
def rank_0_of_two(monkeypatch):
    """Look like rank 0 of a 2-process job from a launcher; starting the world fails loudly, so
    a check that lets the model through fails the test at once (instead of waiting for rank 1)."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)

    def no_world(*args, **kwargs):
        raise _WorldStarted("the pipeline check let the model through: processes would start")

    monkeypatch.setattr("meshtrain.loop.setup.start_world", no_world)
    yield
    assert not dist.is_initialized()


class _WorldStarted(Exception):
    pass


def _fit(tmp_path, model, **settings):
    trainer = Trainer(**trainer_kwargs(tmp_path / "run", layout="pp=2", max_steps=2,
                                       global_batch_size=8, **settings))
    trainer.fit(model, token_data(), optimizer=adamw_gpt, loss_fn=lm_loss)


def _refused(tmp_path, model, **settings) -> str:
    with pytest.raises(ConfigError) as info:
        _fit(tmp_path, model, **settings)
    assert not (tmp_path / "run").exists(), "the run folder was created before the refusal"
    return str(info.value)


# ---- (a) a forward that is not embed -> layers -> norm -> head -------------------------------
@pytest.mark.parametrize("as_factory", [True, False], ids=["factory", "module"])
def test_positional_term_added_in_forward_is_refused_before_any_process(
        rank_0_of_two, tmp_path, as_factory):
    message = _refused(tmp_path, PosAfterEmbed if as_factory else PosAfterEmbed())
    assert "would not compute its forward" in message
    assert "max |difference|" in message and "(2, 8, 16)" in message  # shapes agree, values not
    assert "parameters the stages never use: pos" in message
    assert "embed" in message and "model.layers" in message  # how to restructure it


def test_a_factory_too_big_to_build_is_checked_on_its_meta_copy(monkeypatch):
    """Not built for real (whole), yet judged on values: each op takes real stand-ins of the
    meta tensors it uses (pipeline/stand_ins.py), the same verdict as a built model's."""
    from meshtrain.checks import inspect_model
    from meshtrain.parallel.pipeline import check as pipeline_check

    monkeypatch.setattr(pipeline_check, "BUILD_LIMIT", 0)
    built = []
    factory = lambda: built.append(1) or PosAfterEmbed()
    with pytest.raises(ConfigError, match="never use: pos") as info:
        pipeline_check.check_before_start(inspect_model(factory), factory,
                                          lambda: token_data().tensors[0][:2])
    assert "max |difference|" in str(info.value)  # values, from the stand-ins
    assert built == [1]  # only inspect_model's meta build


def test_parameter_free_difference_is_seen_in_the_outputs(rank_0_of_two, tmp_path):
    message = _refused(tmp_path, ScaledOutput)
    assert "max |difference|" in message and "never use" not in message


def test_tuple_output_is_refused(rank_0_of_two, tmp_path):
    assert "returns a tuple" in _refused(tmp_path, TupleOutput)


# ---- (b) a weight shared across stages through forward -----------------------------------------
def test_head_tied_to_the_embedding_through_forward_is_refused(rank_0_of_two, tmp_path):
    message = _refused(tmp_path, TiedThroughForward)
    assert "embed.weight" in message and "shared" in message
    assert "after the last block" in message and "first stage" in message
    assert "untie" in message  # what to do


def tied_gpt():
    model = tiny_gpt(num_layers=4)
    model.head.weight = model.tok_emb.weight
    return model


@pytest.mark.timeout(240)
def test_a_head_module_tied_to_the_embedding_trains_as_one_process():
    """A tie the stages use as the model does (a head module holding the embedding's weight)
    passes the check: the first and last stage each hold a copy under the name one process
    gives it (tok_emb.weight), their gradients summed (pipeline/tied.py)."""
    from meshtrain.parallel.pipeline import split_model
    from parity import assert_parity

    model = tied_gpt()
    last = split_model(model, [2], 1)
    assert last.head.weight is last.tok_emb.weight and "tok_emb.weight" in dict(
        last.named_parameters())
    assert dict(last.named_parameters()).keys() == {
        n for n, _ in model.named_parameters()} - {n for n, _ in split_model(
            model, [2], 0).named_parameters()} | {"tok_emb.weight"}
    assert_parity("pp=2", 2, steps=6, global_batch_size=8, micro_batch_size=2,
                  fns=dict(GPT4_FNS, model_fn=tied_gpt))


# ---- (d) conventional models pass ---------------------------------------------------------------
def test_conventional_models_pass_the_check(monkeypatch):
    from meshtrain.parallel.pipeline import check as pipeline_check

    inputs = token_data().tensors[0][:2]
    pipeline_check.check_stage_forward(tiny_gpt(num_layers=4), inputs)
    pipeline_check.check_stage_forward(mlp(), torch.randn(2, 12))
    with torch.device("meta"):  # too big to build for real: real stand-ins op by op
        meta = tiny_gpt(num_layers=4)
    pipeline_check.check_stage_forward(meta, inputs)
    with torch.device("meta"), pytest.raises(ConfigError, match="never use: pos"):
        pipeline_check.check_stage_forward(PosAfterEmbed(), inputs)


def test_trainer_runs_the_check_and_an_ordinary_gpt_passes(rank_0_of_two, tmp_path, monkeypatch):
    from meshtrain.parallel.pipeline import check as pipeline_check

    checked = []
    original = pipeline_check.check_stage_forward
    monkeypatch.setattr(pipeline_check, "check_stage_forward",
                        lambda model, inputs: checked.append(inputs.shape) or original(model,
                                                                                         inputs))
    with pytest.raises(_WorldStarted):
        _fit(tmp_path, GPT4_FNS["model_fn"])
    assert checked == [(2, SEQ)]  # once, in this process, on the first two samples


# ---- (c) time/memory balancing: one split on every rank -----------------------------------------
def _split_with_rank_dependent_costs(run_dir, balance):
    from meshtrain.parallel.pipeline import partition

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    costs = [1.0, 1.0, 1.0, 10.0] if rank == 0 else [10.0, 1.0, 1.0, 1.0]
    name = "block_time_costs" if balance == "time" else "block_memory_costs"
    setattr(partition, name, lambda blocks, sample_input, **kwargs: list(costs))
    trainer = Trainer(**trainer_kwargs(run_dir, layout="pp=2", max_steps=1, global_batch_size=8,
                                       pp_balance=balance))
    trainer.fit(GPT4_FNS["model_fn"], token_data(), optimizer=adamw_gpt, loss_fn=lm_loss)
    return trainer.engine.split_points


@pytest.mark.timeout(200)
@pytest.mark.parametrize("balance", ["time", "memory"])
def test_time_and_memory_balance_give_every_rank_the_same_split(tmp_path, balance):
    # alone, rank 0's costs split before block 3 and rank 1's before block 1
    splits = run_workers(_split_with_rank_dependent_costs, 2, (str(tmp_path / "run"), balance))
    assert splits[0] == splits[1], f"the ranks split the model differently: {splits}"
    assert splits[0] == [2]  # the median of the two measurements: [5.5, 1, 1, 5.5]


@pytest.mark.timeout(120)
def test_a_per_sample_loss_under_pp_is_refused_naming_the_shape():
    """The schedule runs backward on the loss itself: a per-sample loss must be a clear error
    (the one-process path says the same), not torch's message from inside the schedule."""
    from meshtrain.errors import WorkerFailed

    with pytest.raises(WorkerFailed, match=r"loss_fn returned tensor \(2, 8\) float32, but "
                                           r"meshtrain needs one number per micro-batch"):
        run_workers(_per_sample_loss_rank, 2, timeout=100)


def _per_sample_loss_rank():
    from parity import train_state

    fns = dict(GPT4_FNS, loss_fn=_per_token_loss)
    train_state(dict(layout="pp=2", max_steps=1, global_batch_size=8, micro_batch_size=2), **fns)


def _per_token_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")


class MeanPoolFc(nn.Module):
    """A classifier: the blocks, then the mean over the sequence and a head named ``fc``. No
    weight is shared; the stages never run ``fc`` (nor the mean) after the last block."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Residual() for _ in range(4))
        self.fc = nn.Linear(D, 3)

    def forward(self, idx):
        h = self.embed(idx)
        for layer in self.layers:
            h = layer(h)
        return self.fc(h.mean(dim=1))


def test_a_head_named_fc_is_not_called_a_shared_weight(rank_0_of_two, tmp_path):
    message = _refused(tmp_path, MeanPoolFc)
    assert "shared" not in message and "untie" not in message, message
    assert ("fc.weight is used after the last block (on the last stage) only, but the stages "
            "hold it on the first stage (embed): after the last block they run model.norm and "
            "model.head alone, and its module is neither; make it model.head (with what forward "
            "computes there, e.g. a mean over the sequence, inside it)") in message
    assert "model(x) gives (2, 3), the stages (2, 8, 16)" in message
