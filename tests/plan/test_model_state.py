"""Per-rank model-state bytes by arithmetic (meshtrain.plan.model_state) equal what a simulated
world built for real holds (meshtrain.plan.simulate), on every rank of many layouts, for a
Hugging Face Llama and meshtrain's GPT with sizes that do not divide evenly."""

import math

import pytest
import transformers

from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.plan.model_state import ModelStateSizes, chunk_size
from meshtrain.plan.simulate import simulate

LLAMA = transformers.LlamaConfig(vocab_size=40, hidden_size=48, num_hidden_layers=5,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=76, max_position_embeddings=16,
                                 tie_word_embeddings=False)
GPT_SIZES = GPTConfig(vocab_size=40, seq_len=16, num_layers=5, num_heads=4, d_model=48)
LAYOUTS = ["dp=4", "zero1=4", "zero2=4", "zero3=4", "dp_shard=3", "tp=2,dp_shard=2",
           "dp_shard=2,tp=2", "dp_replicate=2,dp_shard=2", "cp=2,dp_shard=2", "pp=2,dp_shard=2",
           "pp=2,tp=2", "pp=2,dp=2", "pp=3"]


def _llama():
    return transformers.LlamaForCausalLM(LLAMA)


def _gpt():
    return GPT(GPT_SIZES, seed=0)


@pytest.mark.parametrize("factory", [_llama, _gpt], ids=["llama", "gpt"])
def test_every_rank_of_every_layout_matches_a_built_world(factory):
    sizes = ModelStateSizes(factory)
    layouts = LAYOUTS + (["tp=4"] if factory is _gpt else [])  # the Llama has 2 K/V heads
    for layout in layouts:
        world = 1
        for part in layout.split(","):
            world *= int(part.split("=")[1])
        for rank in range(world):
            built, counted = simulate(factory, layout, rank=rank), sizes.rank(layout, rank)
            assert (counted.local_params, counted.params, counted.grads, counted.optimizer) == (
                built.local_params, built.params, built.grads, built.optimizer), (layout, rank)


def test_chunks_are_torch_chunks():
    import torch

    for length in (0, 1, 5, 7, 8, 40):
        for parts in (1, 2, 3, 4, 8):
            expected = [len(c) for c in torch.arange(length).chunk(parts)] if length else []
            expected += [0] * (parts - len(expected))
            assert [chunk_size(length, parts, i) for i in range(parts)] == expected


def _moe_gpt():
    return GPT(GPTConfig(vocab_size=40, seq_len=16, num_layers=4, num_heads=4, d_model=48,
                         num_experts=4, experts_per_token=2), seed=0)


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=40, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=16, head_dim=8))


@pytest.mark.parametrize("factory", [_moe_gpt, _qwen3_moe], ids=["moe-gpt", "qwen3-moe"])
def test_expert_parallel_layouts_match_a_built_world(factory):
    """Under ep each rank holds its rows of every expert weight, which FSDP shards over the
    edp ranks holding the same rows (dp_shard=4,ep=2: 2 of them); the rest as without ep
    (pp, dp_shard and cp mixed in). meshtrain's MoE GPT under tp: each rank holds h/tp
    columns of every expert."""
    sizes = ModelStateSizes(factory)
    for layout, world in [("ep=2", 2), ("dp_shard=4,ep=2", 4), ("pp=2,ep=2", 4),
                          ("pp=2,dp_shard=2,ep=2", 4), ("dp=4,ep=4", 4),
                          ("cp=2,dp_shard=2,ep=4", 4), ("pp=2,dp_shard=4,ep=2", 8),
                          ("dp_replicate=2,dp_shard=2,ep=2", 4)] + (
            # meshtrain's MoE GPT under tp: every expert split by hidden unit
            [("tp=2", 2), ("dp_shard=2,tp=2", 4), ("pp=2,tp=2", 4)] if factory is _moe_gpt
            else []):
        for rank in range(world):
            built = simulate(factory, layout, world_size=world, rank=rank)
            counted = sizes.rank(layout, rank, world_size=world)
            assert (counted.local_params, counted.params, counted.grads, counted.optimizer) == (
                built.local_params, built.params, built.grads, built.optimizer), (layout, rank)
    whole = sizes.rank("dp=2", 0, world_size=2)
    split = sizes.rank("ep=2", 0, world_size=2)
    experts = sum(math.prod(p.shape) for p in sizes.params if p.name in sizes._expert_names())
    assert whole.local_params - split.local_params == experts // 2 > 0
