"""What a first-time user met, each said with what to do (issue 78): checked before any process
starts, through the API a user calls (Trainer.check, the CLI's main in this process)."""

import pytest
import torch
from conftest import trainer_kwargs

from meshtrain import ConfigError, Trainer
from meshtrain.models.hf import random_token_data, tiny_causal_lm

torch.set_num_threads(1)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


@pytest.mark.timeout(120)
def test_tp_on_a_hugging_face_moe_model_says_experts_are_split_by_ep(tmp_path):
    """Not a tp_plan key the user never wrote: the reason (experts are not split by tp) and
    the layouts that work."""
    moe = tiny_causal_lm("Qwen3Moe", vocab_size=32, hidden_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=16, moe_intermediate_size=8, num_experts=4,
                         num_experts_per_tok=2, experts_implementation="eager")
    trainer = Trainer(**trainer_kwargs(tmp_path, layout="tp=2", devices=2, max_steps=1,
                                       global_batch_size=8))
    with pytest.raises(ConfigError) as error:
        trainer.check(moe, random_token_data(), optimizer=_adamw)
    message = str(error.value)
    assert "tp_plan key" not in message
    assert "mixture-of-experts model (4 experts in each of 2 MoE layers)" in message
    assert "does not split a Hugging Face model's experts by tensor parallel" in message
    assert 'layout="ep=2"' in message and '"dp_shard=2,ep=2"' in message
