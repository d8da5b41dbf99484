"""Hugging Face causal LMs built from configs (no download) train under dp, zero3 and tp."""

from functools import partial

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
# context parallel: 12-token sequences (not a power of two), grouped-query attention (4 heads,
# 2 K/V heads), RoPE positions
LLAMA12_FNS = dict(model_fn=tiny_llama, data_fn=partial(random_token_data, seq_len=12),
                   loss_fn=None, optimizer_fn=adamw_gpt)
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
    with pytest.raises(ConfigError, match="sequence_parallel"):
        default_tp_plan(tiny_llama(), 2, sequence_parallel=True)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", ["dp=2", "zero3=2", "tp=2", "dp_shard=2,tp=2"])
def test_llama_parity(layout):
    ranks = 4 if "," in layout else 2
    assert_parity(layout, ranks, steps=10, global_batch_size=BATCH, fns=LLAMA_FNS)


def tied_llama():
    return tiny_llama(tie_word_embeddings=True)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", ["tp=2", "dp_shard=2,tp=2"])
def test_tied_embeddings_under_tp_match_one_process(layout):
    """The embedding and the head share one weight, split by vocabulary rows in both: it must
    stay one parameter after the split (refused before; parallelize_module alone unties it)."""
    fns = dict(LLAMA_FNS, model_fn=tied_llama)
    assert_parity(layout, 2 if layout == "tp=2" else 4, steps=STEPS, global_batch_size=BATCH,
                  fns=fns)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", ["dp=2", "zero3=2"])
def test_gpt2_parity(layout):
    assert_parity(layout, 2, steps=STEPS, global_batch_size=BATCH, fns=GPT2_FNS)


@pytest.mark.timeout(200)
def test_llama_context_parallel_parity():
    # labels are shifted before the sequence is cut, positions follow the zig-zag order
    assert_parity("cp=2", 2, steps=10, global_batch_size=BATCH, fns=LLAMA12_FNS)


def test_llama_context_parallel_batch_keeps_every_target_once():
    from meshtrain.models.hf import HFContextParallel
    from meshtrain.parallel.context_parallel import unshard_sequence

    class FakeCPMesh:  # what shard_context_parallel_batch reads of the cp mesh
        def __init__(self, rank):
            self.rank = rank

        def get_local_rank(self):
            return self.rank

        def size(self):
            return 2

    data = random_token_data(num_samples=2, seq_len=12)
    batch = {k: torch.stack([data[i][k] for i in range(2)]) for k in ("input_ids", "labels")}
    cp = HFContextParallel(tiny_llama())
    parts = [cp.shard_context_parallel_batch(batch, FakeCPMesh(r)) for r in range(2)]
    ids = unshard_sequence([p["input_ids"] for p in parts], 2, 1)
    targets = unshard_sequence([p["shift_labels"] for p in parts], 2, 1)
    positions = unshard_sequence([p["position_ids"] for p in parts], 2, 1)
    assert torch.equal(ids, batch["input_ids"])
    assert torch.equal(targets[:, :-1], batch["labels"][:, 1:]) and (targets[:, -1] == -100).all()
    assert torch.equal(positions, torch.arange(12).expand(2, 12))
    assert sum(int((p["shift_labels"] != -100).sum()) for p in parts) == 2 * 11
    with pytest.raises(ConfigError, match="padding"):
        cp.shard_context_parallel_batch({**batch, "attention_mask": torch.zeros(2, 12)},
                                        FakeCPMesh(0))
    with pytest.raises(ConfigError, match="no context-parallel support"):
        HFContextParallel(tiny_gpt2()).check_context_parallel(2)
