"""A check made before start that cannot run says so (meshtrain/check_skips.py): the pipeline's
stages against the model's forward, context parallel's look at the attention and position
tables, tp's local shapes, and the model's checks when a factory cannot build it on the meta
device. ``Trainer.check`` returns the lines, ``fit`` prints them at start, ``meshtrain train
--dry-run`` under its config."""

import textwrap

import pytest
import torch
import torch.nn as nn
from conftest import quiet_trainer
from parity import VOCAB, adamw_gpt, lm_loss, mlp, regression_data, token_data
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshtrain.models.gpt import GPT, GPTConfig


class EvalFails(GPT):
    """Trains, but its forward refuses eval mode (the pipeline check runs model(x) in eval)."""

    def forward(self, *args, **kwargs):
        if not self.training:
            raise NotImplementedError("this model has no eval mode")
        return super().forward(*args, **kwargs)


def eval_fails():
    return EvalFails(GPTConfig(vocab_size=VOCAB, seq_len=16, num_layers=2, num_heads=2,
                               d_model=16))


class ReadsAValue(nn.Module):
    """Reads a value of its weights in its forward (``.item()``: not on the meta device)."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, VOCAB)

    def forward(self, idx):
        x = self.tok(idx) * (1.0 + 0.0 * self.up.weight.abs().max().item())
        y = torch.nn.functional.scaled_dot_product_attention(
            x[:, None], x[:, None], x[:, None], is_causal=True)[:, 0]
        return self.down(torch.relu(self.up(y)))


def no_meta():
    if torch.empty(0).is_meta:
        raise RuntimeError("this factory does not build on the meta device")
    return mlp()


@pytest.mark.parametrize("model, layout, data, loss, extra, said", [
    (eval_fails, "pp=2", token_data, lm_loss, {},
     r"pipeline check skipped: EvalFails's forward failed on a training sample "
     r"\(NotImplementedError: this model has no eval mode\)"),
    (ReadsAValue, "cp=2", token_data, lm_loss, {},
     r"context-parallel check skipped: ReadsAValue's forward failed on one rank's share of a "
     r"training sample on the meta device"),
    (ReadsAValue, "tp=2", token_data, lm_loss,
     {"tp_plan": {"up": ColwiseParallel(), "down": RowwiseParallel()}},
     r"tp shape check skipped: ReadsAValue's forward failed on the meta device"),
    (no_meta, "dp=2", regression_data, torch.nn.functional.mse_loss, {},
     r"the model's checks against the layout skipped: the factory cannot build it on the meta "
     r"device \(RuntimeError: this factory does not build")])
def test_a_check_that_cannot_run_says_so(tmp_path, no_processes, model, layout, data, loss,
                                          extra, said):
    trainer = quiet_trainer(tmp_path, layout=layout, devices=2, max_steps=1,
                            global_batch_size=8, **extra)
    lines = trainer.check(model, data(), optimizer=adamw_gpt, loss_fn=loss)
    assert any(__import__("re").match(said, line) for line in lines), lines


def test_fit_says_at_start_which_checks_did_not_run(tmp_path, capsys):
    quiet_trainer(tmp_path, devices=1, max_steps=1, global_batch_size=8).fit(
        no_meta, regression_data(), optimizer=adamw_gpt, loss_fn=torch.nn.functional.mse_loss)
    out = capsys.readouterr().out
    assert "the model's checks against the layout skipped: the factory cannot build it" in out


def test_the_dry_run_says_which_checks_did_not_run(tmp_path, monkeypatch, capsys):
    from meshtrain import cli

    (tmp_path / "skipping_recipe.py").write_text(textwrap.dedent("""
        import torch
        from meshtrain import settings
        from parity import adamw_gpt, lm_loss, token_data
        from test_check_skips import ReadsAValue

        DEFAULTS = {"job": {"recipe": "skipping_recipe"}, **settings.config_sections()}

        def job(config):
            return dict(model=ReadsAValue, train_data=token_data(), optimizer=adamw_gpt,
                        loss_fn=lm_loss)

        def run(config, mode="train"):
            raise AssertionError("a dry run trains nothing")
    """))
    (tmp_path / "job.toml").write_text('[job]\nrecipe = "skipping_recipe"\n'
                                       '[trainer]\nlayout = "cp=2"\ndevices = 2\n'
                                       'global_batch_size = 8\n')
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "job.toml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# context-parallel check skipped: ReadsAValue's forward failed" in out
    assert "config OK" in out
