"""meshtrain's MoE GPT held by a research module (``meshtrain.TrainingModule``, Lightning's
style): its routers are balanced as under ``fit(model, loss_fn=...)`` (the balancing loss added
to the step's loss over the micro-step's global batch, the bias moved by the step's counts),
in one process and under expert parallel; what cannot carry the balancing is refused."""

import pytest
import torch
from parity import F64_TOL, adamw_gpt, compare_ranks, lm_loss, run_ranks, token_data, train_state
from test_moe_gpt import MOE_FNS, moe_gpt_bias_balanced

import meshtrain
from meshtrain.errors import ConfigError

torch.set_num_threads(1)


class MoEModule(meshtrain.TrainingModule):
    """The MoE GPT (balancing loss and bias balancing on, a shared expert) as ``self.model``."""

    def __init__(self):
        super().__init__()
        self.model = moe_gpt_bias_balanced()

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return lm_loss(self(x), y)


class TwiceModule(MoEModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return lm_loss(self(x), y) + 0 * self(x).sum()


class ManualModule(MoEModule):
    automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        self.manual_backward(lm_loss(self(x), y))
        optimizer.step()


MODULE_FNS = dict(model_fn=MoEModule, data_fn=token_data, optimizer_fn=adamw_gpt, loss_fn=None)


def _unwrapped(state: dict) -> dict:
    return {k.removeprefix("model."): v for k, v in state.items()}


@pytest.mark.timeout(300)
def test_a_module_holding_the_moe_gpt_balances_it_as_fit_does():
    """The module's steps equal ``fit(moe_gpt, loss_fn=lm_loss)`` step for step (the balancing
    loss in the loss and gradients, the bias moved: it picks the experts, so every weight
    differs without it; until 2026-11-29 a module's MoE model trained with no balancing at
    all, silently); under dp_shard=2,ep=2 the module equals itself in one process."""
    trainer = dict(max_steps=4, global_batch_size=16, log_grad_norm=True)
    plain = train_state(trainer, float64=True, **dict(MOE_FNS, model_fn=moe_gpt_bias_balanced))
    held = train_state(trainer, float64=True, **MODULE_FNS)
    compare_ranks(plain, [_unwrapped(held)], tol=F64_TOL, relative=True, label="a module")
    ranks = run_ranks(dict(trainer, layout="dp_shard=2,ep=2"), 2, timeout=200, float64=True,
                      **MODULE_FNS)
    compare_ranks(held, ranks, tol=F64_TOL, relative=True, label="a module, dp_shard=2,ep=2")


def test_what_cannot_carry_the_balancing_is_refused(tmp_path):
    from conftest import quiet_trainer

    trainer = quiet_trainer(tmp_path, max_steps=1, global_batch_size=8)
    with pytest.raises(ConfigError, match=r"drives its own backward passes .* Set the "
                                          r"coefficient to 0"):
        trainer.check(ManualModule, token_data(), optimizer=adamw_gpt)
    with pytest.raises(ConfigError, match=r"the training step ran the mixture-of-experts model "
                                          r"2 times"):
        quiet_trainer(tmp_path, max_steps=1, global_batch_size=8).fit(
            TwiceModule, token_data(), optimizer=adamw_gpt)
