"""The README's first example, as a user runs it: a script started with ``python``, the model
passed to ``fit`` as an object built after ``Trainer(...)`` (no seed of the user's), a validation
set, the default settings. Every rank of every layout must start from the same weights as one
process (torch's own default seed differs per process: the Trainer seeds it) and train to the
same model, which ``trainer.whole_model()`` gives whole under any layout. A model built before
the Trainer gets rank 0's weights on every rank, with a warning."""

import textwrap

import pytest
import torch
from conftest import run_script

TIMEOUT = 120

SCRIPT = """
import os, sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import TensorDataset

from meshtrain import Trainer

out, layout, when = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
(out / f"{os.getpid()}.pid").write_text(str(os.getpid()))


class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

    def tp_plan(self, tp_degree, *, sequence_parallel=False, loss_parallel=False):
        return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


g = torch.Generator().manual_seed(0)
x = torch.randn(96, 8, generator=g)
y = (x[:, :4].argmax(1) + (x[:, 4] > 0).long()) % 4
train_dataset, val_dataset = TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])

early = MyModel() if when == "before" else None  # built before the Trainer seeds torch
devices = 1 if layout == "none" else 2
trainer = Trainer(layout=None if layout == "none" else layout, devices=devices, max_steps=6,
                  global_batch_size=16, micro_batch_size=8, run_dir=out / "run", loggers=(),
                  report=False, progress_bar=False)
model = early if early is not None else MyModel()
if when != "before" and when != "after":  # a saved start: the weights of another run's rank 0
    model.load_state_dict(torch.load(when)["initial"])
initial = {k: v.clone() for k, v in model.state_dict().items()}
model = trainer.fit(model, train_dataset, val_dataset,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
                    loss_fn=F.cross_entropy)
whole = trainer.whole_model()  # collective: every rank
torch.save({"initial": initial, "final": {k: v.detach().clone() for k, v in
                                          whole.state_dict().items()},
            "val": trainer.callback_metrics["val/loss"], "class": type(whole).__name__},
           out / f"rank{trainer.rank}.pt")
"""


def _run(tmp_path, layout: str, when: str = "after") -> tuple[list[dict], str]:
    out = tmp_path / f"{layout}-{when if when in ('before', 'after') else 'from'}"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = run_script(script, out, layout, when, cwd=tmp_path, pid_dir=out, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = sorted(out.glob("rank*.pt"))
    return [torch.load(path) for path in ranks], done.stdout


@pytest.mark.timeout(4 * TIMEOUT)
def test_a_model_object_starts_and_trains_the_same_in_every_layout(tmp_path):
    (one,), _ = _run(tmp_path, "none")
    moved = max((one["final"][k] - one["initial"][k]).abs().max() for k in one["initial"])
    assert moved > 1e-2  # training changed the weights: agreeing below proves something
    for layout in ("dp=2", "zero3=2", "tp=2"):
        ranks, _ = _run(tmp_path, layout)
        assert len(ranks) == 2, layout
        for rank, got in enumerate(ranks):
            where = f"{layout} rank {rank}"
            assert got["class"] == "MyModel", where  # the user's own class, whole
            for name, want in one["initial"].items():  # bit for bit the same start
                assert torch.equal(got["initial"][name], want), f"{where}: initial {name}"
            for name, want in one["final"].items():
                torch.testing.assert_close(got["final"][name], want, rtol=0, atol=1e-6,
                                           msg=lambda m, w=where, n=name: f"{w} {n}: {m}")
            assert abs(got["val"] - one["val"]) < 1e-6, (where, got["val"], one["val"])


@pytest.mark.timeout(2 * TIMEOUT)
def test_a_model_built_before_the_trainer_gets_rank_0s_weights_with_a_warning(tmp_path):
    ranks, stdout = _run(tmp_path, "zero3=2", when="before")
    first = ranks[0]["initial"]
    assert any(not torch.equal(ranks[1]["initial"][k], first[k]) for k in first)  # as built
    assert "initial weights differed between ranks (rank(s) [1]" in stdout
    assert "fit(lambda: MyModel(), ...)" in stdout  # the fix
    # one model trained, rank 0's: one process started from its weights ends the same
    (one,), _ = _run(tmp_path, "none", when=str(tmp_path / "zero3=2-before" / "rank0.pt"))
    for name, want in one["final"].items():
        torch.testing.assert_close(ranks[0]["final"][name], want, rtol=0, atol=1e-6)


class TiedModel(torch.nn.Module):
    """A tied embedding and head, and a buffer outside the state dict (a rotary table's kind)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.mix = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((8,), 0.5), persistent=False)

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.embed(x))) * self.scale)


def _fit_whole(layout, run_dir):
    from parity import lm_loss, token_data

    from meshtrain import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(layout=layout, max_steps=3, global_batch_size=8, loggers=(), report=False,
                      progress_bar=False, save_final_checkpoint=False, run_dir=run_dir)
    trainer.fit(TiedModel(), token_data(), loss_fn=lm_loss,
                optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    whole = trainer.whole_model()
    tokens = token_data()[:4][0]
    return (whole.head.weight is whole.embed.weight, whole.scale.clone(),
            {k: v.detach().clone() for k, v in whole.state_dict().items()},
            whole(tokens).detach())


@pytest.mark.timeout(TIMEOUT)
def test_whole_model_under_zero3_keeps_ties_and_buffers(tmp_path):
    from meshtrain.launch.spawn import run_workers

    one = _fit_whole(None, tmp_path / "one")
    tied, scale, state, output = run_workers(_fit_whole, 2, ("zero3=2", tmp_path / "z"),
                                             timeout=TIMEOUT)[1]  # (rank 1: not only rank 0)
    assert tied and torch.equal(scale, torch.full((8,), 0.5))
    assert state.keys() == one[2].keys()
    for name, want in one[2].items():
        torch.testing.assert_close(state[name], want, rtol=0, atol=1e-6)
    torch.testing.assert_close(output, one[3], rtol=0, atol=1e-5)


def _fit_gpt_whole(layout, run_dir):
    from parity import GPT4_FNS, token_data

    from meshtrain import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(layout=layout, max_steps=2, global_batch_size=8, loggers=(), report=False,
                      progress_bar=False, save_final_checkpoint=False, run_dir=run_dir)
    trainer.fit(GPT4_FNS["model_fn"], token_data(), loss_fn=GPT4_FNS["loss_fn"],
                optimizer=GPT4_FNS["optimizer_fn"])
    whole = trainer.whole_model()
    return len(whole.layers), whole(token_data()[:4][0]).detach()


@pytest.mark.timeout(TIMEOUT)
def test_whole_model_under_pp_holds_every_stage(tmp_path):
    from meshtrain.launch.spawn import run_workers

    layers, want = _fit_gpt_whole(None, tmp_path / "one")
    for rank, (got_layers, got) in enumerate(run_workers(
            _fit_gpt_whole, 2, ("pp=2", tmp_path / "pp"), timeout=TIMEOUT)):
        assert got_layers == layers == 4, rank  # fit returns 2 of them on each rank
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _two_fits(layout, run_dir):
    """Pre-train, then fine-tune the result with another Trainer (one script, as users chain
    them); under a layout that changes the module, the trained model is taken whole first."""
    import copy
    import pickle

    from parity import lm_loss, token_data

    from meshtrain import Trainer
    from meshtrain.errors import ConfigError

    torch.set_num_threads(1)

    def trainer(name, steps):
        return Trainer(layout=layout, max_steps=steps, global_batch_size=8, loggers=(),
                       report=False, progress_bar=False, save_final_checkpoint=False,
                       run_dir=run_dir / name)

    def optimizer(params):
        return torch.optim.AdamW(params, lr=1e-2)

    first = trainer("pretrain", 3)
    model = first.fit(TiedModel(), token_data(), loss_fn=lm_loss, optimizer=optimizer)
    refused = None
    if layout is None:
        copied = copy.deepcopy(model)  # the trained module copies and pickles (no Trainer)
        assert copied.__dict__["_meshtrain_trainer"].trainer is None
        pickle.dumps(model)
    else:
        try:  # the laid-out module itself is refused, before anything starts
            trainer("refused", 2).fit(model, token_data(), loss_fn=lm_loss, optimizer=optimizer)
        except ConfigError as error:
            refused = str(error)
        model = first.whole_model()
    second = trainer("finetune", 2)
    tuned = second.fit(model, token_data(), loss_fn=lm_loss, optimizer=optimizer)
    return refused, {k: v.detach().clone() for k, v in second.whole_model().state_dict().items()}


@pytest.mark.timeout(TIMEOUT)
def test_a_trained_model_goes_on_to_another_fit(tmp_path):
    """It failed at the second fit ("cannot pickle '_thread.lock'": the module held its Trainer);
    a sharded one crashed there in FSDP2 ("Cannot flatten unevenly sharded tensor")."""
    from meshtrain.launch.spawn import run_workers

    _, want = _two_fits(None, tmp_path / "one")
    for refused, state in run_workers(_two_fits, 2, ("zero3=2", tmp_path / "z"),
                                      timeout=TIMEOUT):
        assert "TiedModel was given to an earlier fit under layout dp_shard=2" in refused
        assert "whole_model()" in refused
        for name, value in want.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)
