"""Context parallel through the Trainer reproduces one-process training (issue 11, item 7).

A tiny GPT on 12-token sequences (not a power of two): each cp rank holds 2 of the 2 x cp
chunks, attends over the keys and values gathered from the cp group, and the gradients of the
replicated parameters are averaged over the loss axes (batch axes and cp). Parameters, per-step
losses and gradient norms must equal one process on every rank (fp32, AdamW, 10 steps).
"""

import pytest
import torch
from parity import GPT12_FNS, assert_parity

from meshtrain import Trainer
from meshtrain.errors import ConfigError


@pytest.mark.timeout(200)
def test_cp2_matches_one_process():
    assert_parity("cp=2", 2, steps=10, fns=GPT12_FNS)


@pytest.mark.timeout(200)
def test_cp2_with_clipping_and_accumulation_matches_one_process():
    assert_parity("cp=2", 2, steps=10, fns=GPT12_FNS, micro_batch_size=4, grad_clip_norm=0.05)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["dp_shard=2,cp=2", "cp=2,tp=2", "dp=2,cp=2"])
def test_cp2_composed_matches_one_process(layout):
    assert_parity(layout, 4, steps=10, fns=GPT12_FNS)


def test_cp_with_a_sequence_that_does_not_split_is_refused_before_any_process(tmp_path):
    from parity import adamw_gpt, lm_loss, tiny_gpt, token_data  # seq_len 8: 8 % (2 x 3) != 0

    trainer = Trainer(layout="cp=3", devices=3, max_steps=1, run_dir=tmp_path, loggers=(),
                      global_batch_size=6)
    with pytest.raises(ConfigError, match=r"seq_len=8 does not split into 2 x cp=3 = 6"):
        trainer.fit(tiny_gpt, token_data(), optimizer=adamw_gpt, loss_fn=lm_loss)
    assert not torch.distributed.is_initialized() and trainer.mesh is None


def test_a_model_whose_attention_meshtrain_cannot_see_is_refused():
    from meshtrain.parallel.apply import ParallelOptions, check_model
    from meshtrain.parallel.layout import Layout

    layout, options = Layout.parse("cp=2", 2), ParallelOptions()
    with pytest.raises(ConfigError, match="Linear does not support context parallel .*calls no "
                                          "F.scaled_dot_product_attention"):
        check_model(torch.nn.Linear(4, 4), layout, options,
                    sample_inputs=lambda: torch.zeros(2, 8, 4))
    with pytest.raises(ConfigError, match="needs .inputs, targets. samples"):
        check_model(torch.nn.Linear(4, 4), layout, options,
                    sample_inputs=lambda: {"input_ids": torch.zeros(2, 8)})
