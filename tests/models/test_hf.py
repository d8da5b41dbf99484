"""Hugging Face causal LMs built from configs (no download) train under dp, zero3 and tp."""

import pytest
import torch
import transformers  # noqa: F401  (the `test` extra installs it: these tests never skip)
from parity import adamw_gpt, assert_parity
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshtrain.errors import ConfigError
from meshtrain.models.hf import (
    default_tp_plan, hf_tp_plan, random_token_data, tiny_gpt2, tiny_llama,
)
from meshtrain.parallel.tensor_parallel import ReplicateParallel

torch.set_num_threads(1)

# Module-level functions from importable modules: the workers are spawned and unpickle them.
LLAMA_FNS = dict(model_fn=tiny_llama, data_fn=random_token_data, loss_fn=None,
                 optimizer_fn=adamw_gpt)
GPT2_FNS = dict(model_fn=tiny_gpt2, data_fn=random_token_data, loss_fn=None,
                optimizer_fn=adamw_gpt)
STEPS, BATCH = 6, 8


def test_tiny_models_return_their_loss_and_are_deterministic():
    batch = random_token_data(num_samples=4)[0]
    batch = {k: v[None] for k, v in batch.items()}
    for factory in (tiny_llama, tiny_gpt2):
        out = factory()(**batch)
        assert out.loss.ndim == 0 and torch.isfinite(out.loss)
        assert out.logits.shape == (1, 16, 32)
        a, b = factory().state_dict(), factory().state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert set(batch) == {"input_ids", "labels"}


def test_llama_plan_covers_every_parameter():
    model = tiny_llama()
    plan = hf_tp_plan(model, tp=2)
    assert isinstance(plan["model.embed_tokens"], RowwiseParallel)
    assert isinstance(plan["model.layers.1.self_attn.k_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.1.self_attn.o_proj"], RowwiseParallel)
    assert isinstance(plan["model.layers.0.mlp.up_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.0.mlp.down_proj"], RowwiseParallel)
    assert isinstance(plan["lm_head"], ColwiseParallel)
    assert isinstance(plan["model.norm"], ReplicateParallel)
    assert isinstance(plan["model.layers.0.input_layernorm"], ReplicateParallel)
    owners = {name.rsplit(".", 1)[0] for name, _ in model.named_parameters()}
    assert owners <= set(plan)  # every parameter becomes a DTensor
    assert default_tp_plan(torch.nn.Linear(2, 2)) is None  # not HF: meshtrain's own plan


def test_tp_config_errors():
    with pytest.raises(ConfigError, match="num_key_value_heads=2"):
        hf_tp_plan(tiny_llama(num_heads=4, num_kv_heads=2), tp=4)
    with pytest.raises(ConfigError, match="Conv1D"):
        default_tp_plan(tiny_gpt2(), 2)
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        hf_tp_plan(tiny_llama(tie_word_embeddings=True), tp=2)
    with pytest.raises(ConfigError, match="sequence_parallel"):
        default_tp_plan(tiny_llama(), 2, sequence_parallel=True)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", ["dp=2", "zero3=2", "tp=2"])
def test_llama_parity(layout):
    assert_parity(layout, 2, steps=STEPS, global_batch_size=BATCH, fns=LLAMA_FNS)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", ["dp=2", "zero3=2"])
def test_gpt2_parity(layout):
    assert_parity(layout, 2, steps=STEPS, global_batch_size=BATCH, fns=GPT2_FNS)
