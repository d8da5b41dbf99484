"""Manual optimisation: a module that steps several optimizers itself (a GAN), under dp and
zero3 against the same loop written by hand in one process; clipping per optimizer, bf16, the
NaN policies that fit, resume, and what is refused."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer, state_of
from torch.utils.data import TensorDataset

import meshtrain
from meshtrain import ConfigError
from meshtrain.fault.nonfinite import NonFiniteError
from meshtrain.launch.spawn import run_workers

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
BATCH = 16


# -- several optimizers: a GAN -----------------------------------------------------------------
class GAN(meshtrain.TrainingModule):
    """A 1-D GAN: each sample carries the noise its generator turns into a fake. The
    discriminator steps first, then the generator, each with its own optimizer."""

    automatic_optimization = False
    clip = None  # clip each optimizer's gradients to this norm

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.generator = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(),
                                             torch.nn.Linear(16, 8))
        self.discriminator = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                                 torch.nn.Linear(16, 1))

    def configure_optimizers(self):
        return (torch.optim.Adam(self.generator.parameters(), lr=1e-2),
                torch.optim.SGD(self.discriminator.parameters(), lr=0.1, momentum=0.5))

    def training_step(self, batch, batch_idx):
        real, noise = batch
        opt_g, opt_d = self.optimizers()
        fake = self.generator(noise)
        real_score, fake_score = self.discriminator(real), self.discriminator(fake.detach())
        loss_d = (F.softplus(-real_score) + F.softplus(fake_score)).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        if self.clip:
            self.log("norm_d", self.clip_gradients(opt_d, self.clip), reduce="max")
        opt_d.step()
        loss_g = F.softplus(-self.discriminator(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        if self.clip:
            self.clip_gradients(opt_g, self.clip)
        opt_g.step()
        self.log("loss_d", loss_d)
        return {"loss": loss_g}


def gan_data(n=128):
    gen = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(n, 8, generator=gen) * 0.5 + 1.0,
                         torch.randn(n, 4, generator=gen))


class ClippedGAN(GAN):
    clip = 0.05


def hand_loop(module, steps: int = 5, autocast: bool = False):
    """The GAN's step written out in one process on each whole global batch; the first step's
    discriminator gradient norm (before clipping)."""
    opt_g, opt_d = module.configure_optimizers()
    real, noise = gan_data().tensors
    norms = []
    for step in range(steps):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            fake = module.generator(noise[batch])
            loss_d = (F.softplus(-module.discriminator(real[batch]))
                      + F.softplus(module.discriminator(fake.detach()))).mean()
        opt_d.zero_grad()
        loss_d.backward()
        if module.clip:
            norms.append(torch.nn.utils.clip_grad_norm_(module.discriminator.parameters(),
                                                        module.clip))
        opt_d.step()
        opt_g.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss_g = F.softplus(-module.discriminator(fake)).mean()
        loss_g.backward()
        if module.clip:
            torch.nn.utils.clip_grad_norm_(module.generator.parameters(), module.clip)
        opt_g.step()
    return norms


def _gan_rank(run_dir, layout, clipped):
    torch.set_num_threads(1)
    trainer = quiet_trainer(run_dir, layout=layout, max_steps=5, global_batch_size=BATCH,
                            shuffle=False, log_every_n_steps=1)
    model = trainer.fit(ClippedGAN if clipped else GAN, gan_data())
    from torch.distributed.tensor import DTensor

    sharded = [isinstance(p, DTensor) for p in model.parameters()]
    assert all(sharded) if layout.startswith("zero") else not any(sharded), layout
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
             for k, v in model.state_dict().items()}
    return (state, trainer.callback_metrics.get("norm_d")) if int(os.environ["RANK"]) == 0 \
        else None


# zero2/zero3: the generator and the discriminator are each sharded on their own; the zero3 run
# also clips each optimizer's gradients by their global norm over both ranks' shards
@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout,clipped", [("dp=2", False), ("zero2=2", False),
                                            ("zero3=2", True)])
def test_a_gan_with_two_optimizers_equals_the_manual_loop_in_one_process(tmp_path, layout,
                                                                         clipped):
    reference = ClippedGAN() if clipped else GAN()
    norms = hand_loop(reference)
    state, norm_d = run_workers(_gan_rank, 2, (str(tmp_path), layout, clipped), timeout=120)[0]
    for name, value in state_of(reference).items():
        assert torch.allclose(state[name], value, atol=1e-5, rtol=0), name
    assert not torch.allclose(state["generator.0.weight"], state_of(GAN())["generator.0.weight"])
    if clipped:  # the clip acted, and the norm it returned is the whole gradient's
        assert min(norms) > ClippedGAN.clip
        assert norm_d == pytest.approx(float(norms[-1]), rel=1e-5)


def test_a_gan_under_bf16_mixed_equals_the_hand_loop_under_autocast(tmp_path):
    reference = GAN()
    hand_loop(reference, autocast=True)
    model = quiet_trainer(tmp_path, max_steps=5, global_batch_size=BATCH, shuffle=False,
                          precision="bf16-mixed").fit(GAN, gan_data())
    fp32 = GAN()
    hand_loop(fp32)
    for name, value in state_of(reference).items():
        assert torch.allclose(model.state_dict()[name], value, atol=1e-6, rtol=0), name
    assert any(not torch.allclose(v, fp32.state_dict()[k], atol=1e-4)
               for k, v in state_of(reference).items()), "bf16 changed nothing"


class NaNAtStep3(GAN):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            batch = (batch[0] * float("nan"), batch[1])
        return super().training_step(batch, batch_idx)


def test_nan_policy_error_and_rollback_act_on_a_manual_step(tmp_path):
    with pytest.raises(NonFiniteError, match="step 3"):
        quiet_trainer(tmp_path / "error", max_steps=5, global_batch_size=BATCH,
                      shuffle=False).fit(NaNAtStep3, gan_data())
    trainer = quiet_trainer(tmp_path / "rollback", max_steps=5, global_batch_size=BATCH,
                            shuffle=False, nan_policy="rollback", checkpoint_every_n_steps=2)
    model = trainer.fit(NaNAtStep3, gan_data())
    assert trainer.num_rollbacks == 1 and trainer.num_skipped_steps == 1
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


def test_what_manual_optimisation_cannot_do_is_refused(tmp_path):
    for settings, match in (
            (dict(layout="zero1=2", devices=2), "zero1 shards the state of the one optimizer"),
            (dict(precision="fp16-mixed"), "use bf16-mixed"),
            (dict(nan_policy="skip"), "only a rollback can drop them"),
            (dict(grad_clip_norm=1.0), r"self.clip_gradients\(optimizer, max_norm\)")):
        with pytest.raises(ConfigError, match=match):
            quiet_trainer(tmp_path, max_steps=2, **settings).check(GAN, gan_data())


def _gan_resume_rank(folder, layout, async_checkpoint=False):
    """Six steps with a checkpoint at step 3, then a run resumed from it: both final states."""
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    common = dict(max_steps=6, global_batch_size=BATCH, shuffle=False,
                  **({"layout": layout} if layout else {}))
    class Count(meshtrain.Callback):
        steps = 0

        def on_train_step_end(self, trainer, metrics):
            Count.steps += 1

    states = []
    # (async_checkpoint writes periodic checkpoints: the resumed run has none)
    full = dict(checkpoint_every_n_steps=3, async_checkpoint=async_checkpoint)
    for run, extra in (("full", full),
                       ("resumed", dict(resume=f"{folder}/full/checkpoints/step_00000003"))):
        model = quiet_trainer(f"{folder}/{run}", **common, **extra,
                              callbacks=[Count()]).fit(GAN, gan_data())
        states.append({k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                       for k, v in model.state_dict().items()})
    assert Count.steps == 6 + 3, Count.steps  # the resumed run started at step 3
    return states


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", ["async", "zero3=2"])
def test_a_gan_resumes_both_optimizers_exactly(tmp_path, layout):
    """Both optimizers' state (Adam's moments, SGD's momentum; sharded under zero3) go into the
    checkpoint: the run resumed from step 3 ends where the uninterrupted one does. "async": the
    checkpoint is written in the background while the next steps (which step the optimizers
    inside the module's training_step) run."""
    if layout == "async":  # one process, the checkpoint written in the background
        weights, again = _gan_resume_rank(str(tmp_path), None, True)
    else:
        weights, again = run_workers(_gan_resume_rank, 2, (str(tmp_path), layout),
                                     timeout=120)[0]
    for name, value in weights.items():
        assert torch.equal(again[name], value), name


