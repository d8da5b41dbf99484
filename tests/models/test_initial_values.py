"""Every layout starts from the values one process starts from, for the models meshtrain
initialises itself (a Hugging Face model from its config, built on the meta device under a
splitting layout and filled module by module; meshtrain's GPT, dense and MoE), and the set-up
check (meshtrain/parallel/data/init_check.py) stops a run whose ranks' parts are not the
whole tensors one process draws.

Built in float64 (the default dtype of each process) so that the trained weights after 10 steps
are judged to F64_TOL relative (the losses to 1e-6: transformers computes its cross-entropy in
float32); the initial weights must be equal bit for bit.
"""

import pytest
import torch
from parity import (LOSSES, SEQ, VOCAB, adamw_gpt, compare_ranks, lm_loss, params_of,
                    token_data)

from meshtrain import Callback, Trainer
from meshtrain.errors import WorkerFailed
from meshtrain.launch.spawn import run_workers
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.models.hf import random_token_data
from meshtrain.parallel.whole_state import whole_state
from meshtrain.parity import F64_TOL

STEPS = 10
INITIAL = "__initial__"


def qwen3_moe():
    """A tiny Qwen3-MoE from its config, as the causal_lm recipe builds one from hf_config
    (models/from_config.py: HFCausalLM(cls, config, seed))."""
    import transformers as tf

    from meshtrain.models.hf.init import HFCausalLM

    config = tf.Qwen3MoeConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=16, moe_intermediate_size=8,
        num_experts=4, num_experts_per_tok=2, use_cache=False,
        experts_implementation="eager")  # (grouped_mm has no float64 kernel on the CPU)
    return HFCausalLM(tf.Qwen3MoeForCausalLM, config, seed=0)


def moe_gpt():
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=2, num_heads=2, d_model=16,
                         bias=False, num_experts=4, experts_per_token=2))


def dense_gpt():  # (no biases: the keys' bias has no gradient but rounding, which AdamW scales)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=2, num_heads=2, d_model=16,
                         bias=False))


# each job's model factory (made in the process that trains), data and loss
JOBS = {"qwen3_moe": dict(factory=qwen3_moe, data=random_token_data, loss=None),
        "moe_gpt": dict(factory=lambda: moe_gpt, data=token_data, loss=lm_loss),
        "dense_gpt": dict(factory=lambda: dense_gpt, data=token_data, loss=lm_loss)}


class _Initial(Callback):
    """The whole model as the first step starts (collective: every rank calls it)."""

    def on_train_step_start(self, trainer) -> None:
        if not hasattr(self, "state"):
            self.state = whole_state(trainer.model, trainer.layout.degree("pp"))


class _Losses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_step_end(self, trainer, metrics: dict) -> None:
        self.losses.append(metrics["train/loss"])


def _train(job: str, layout: str | None, perturb: str | None = None) -> dict:
    """One rank (or the one process): the whole model at the start and after STEPS steps.
    ``perturb``: on rank 1 the module of that name draws from another seed."""
    import os

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    if perturb and os.environ.get("RANK") == "1":
        import meshtrain.models.hf.init as hf_init

        own = hf_init.module_seed
        hf_init.module_seed = lambda seed, name: own(seed + (name == perturb), name)
    spec, initial, losses = JOBS[job], _Initial(), _Losses()
    import tempfile

    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(layout=layout, max_steps=STEPS, global_batch_size=8, shuffle=False,
                          loggers=(), progress_bar=False, save_final_checkpoint=False,
                          report=False, run_dir=run_dir, seed=0, log_every_n_steps=1,
                          callbacks=[initial, losses])
        model = trainer.fit(spec["factory"](), spec["data"](), optimizer=adamw_gpt,
                            loss_fn=spec["loss"])
        state = whole_state(model, trainer.layout.degree("pp"))
    state[INITIAL] = initial.state
    state[LOSSES] = torch.tensor(losses.losses, dtype=torch.float64)
    return state


def _ranks(job: str, layout: str | None, devices: int, perturb: str | None = None) -> list:
    if devices == 1:  # (in this process: its default dtype and thread count restored after)
        dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
        try:
            return [_train(job, layout)]
        finally:
            torch.set_default_dtype(dtype)
            torch.set_num_threads(threads)
    return run_workers(_train, devices, (job, layout, perturb), timeout=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("job, layouts", [
    ("qwen3_moe", [("ep=2", 2), ("dp_shard=2,ep=2", 2), ("dp_shard=4,ep=2", 4)]),
    ("moe_gpt", [("dp_replicate=2,dp_shard=2,ep=2", 4)]),
    ("dense_gpt", [("zero3=2", 2)]),
])
def test_every_layout_starts_and_trains_from_one_process_values(job, layouts):
    reference = _ranks(job, None, 1)[0]
    want = params_of(reference[INITIAL])
    for layout, devices in layouts:
        ranks = _ranks(job, layout, devices)
        for rank, state in enumerate(ranks):
            got = params_of(state.pop(INITIAL))
            assert got.keys() == want.keys()
            differ = [k for k in want if not torch.equal(got[k], want[k])]
            assert not differ, f"{job} {layout}: rank {rank} starts from other values: {differ}"
        compare_ranks(params_of(reference), [params_of(state) for state in ranks],
                      tol=F64_TOL, relative=True, label=f"{job} {layout}")
        for state in ranks:  # (transformers sums its cross-entropy in float32)
            torch.testing.assert_close(state[LOSSES], reference[LOSSES], rtol=1e-6, atol=0)


@pytest.mark.timeout(300)
def test_a_rank_whose_init_draws_other_values_stops_the_run_before_its_first_step():
    name = "model.layers.0.self_attn.q_proj"
    with pytest.raises(WorkerFailed, match=rf"InitialValuesDiffer: .*{name}\.weight \(drawn "
                                           r"differently by ranks 0 / 1\)"):
        _ranks("qwen3_moe", "dp_shard=2,ep=2", 2, perturb=name)
