"""A simulated world (meshtrain.plan.simulate): layouts built for real at world sizes far past
this machine in one process, per-rank bytes equal to the ZeRO formulas, and at 2 ranks equal to
what a real 2-process world holds after a training step."""

import pytest
import torch
from conftest import end_together, join_gloo

from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import run_workers
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.observe.memory.zero_formulas import predicted_bytes
from meshtrain.plan.simulate import simulate

BILLION = GPTConfig(vocab_size=32000, seq_len=2048, num_layers=16, num_heads=16, d_model=2048)
TINY = GPTConfig(vocab_size=64, seq_len=16, num_layers=2, num_heads=4, d_model=32)


def _gpt(config):
    return lambda: GPT(config, seed=0)


def _tensors(config) -> int:
    with torch.device("meta"):
        return sum(1 for _ in GPT(config, seed=0).parameters())


@pytest.mark.parametrize("layout, stage", [("zero3=64", 3), ("zero1=64", 1), ("dp=64", 0)])
def test_a_1b_model_at_world_size_64_holds_what_the_zero_formulas_say(layout, stage):
    for rank in (0, 37, 63):
        state = simulate(_gpt(BILLION), layout, rank=rank)
        assert state.world_size == 64 and state.num_params == 941_002_752
        steps = 4 * _tensors(BILLION) / (64 if stage == 1 else 1)  # AdamW's step counters
        expected = predicted_bytes(state.num_params, stage, 64)
        assert (state.params, state.grads) == (expected.params, expected.grads)
        assert state.optimizer == pytest.approx(expected.optimizer + steps, abs=1)
        assert state.seconds < 10


def test_tensor_pipeline_and_data_sharding_at_256_ranks():
    """Every rank of one pipeline stage holds 1/64 of that stage (tp=8 x dp_shard=8), except
    what the GPT's plan replicates over tp (the position embedding, norms, row-parallel
    biases: 3.3 % of this model); the stages together hold the model."""
    stage_params = []
    for rank in (0, 64, 128, 192):  # one rank of each of the 4 stages (pp is the outer axis)
        state = simulate(_gpt(BILLION), "pp=4,dp_shard=8,tp=8", rank=rank)
        assert state.world_size == 256
        stage_params.append(state.local_params * 64)
    assert stage_params[0] != stage_params[1]  # the first stage holds the embedding
    assert 941_002_752 < sum(stage_params) <= 941_002_752 * 1.04


def _real_world_bytes(layout):
    """A real world: the same model built on meta, the layout applied, one AdamW step."""
    from meshtrain.observe.memory.probe import model_state_bytes
    from meshtrain.parallel.apply import ParallelOptions, parallelize
    from meshtrain.parallel.data.meta_init import materialize
    from meshtrain.parallel.layout import Layout
    from meshtrain.parallel.mesh import ParallelMesh
    from meshtrain.parallel.tensor.tensor_parallel import complete_partial_grads

    torch.set_num_threads(1)
    rank, world = join_gloo()
    mesh = ParallelMesh(Layout.parse(layout, world), "cpu")
    sharded = mesh.layout.is_sharded  # built on meta, as the Trainer builds a sharded model
    with torch.device("meta" if sharded else "cpu"):
        model = GPT(TINY, seed=0)
    train = parallelize(model, mesh, device=torch.device("cpu"), options=ParallelOptions())
    if sharded:
        materialize(model, "cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    train(torch.randint(0, 64, (2, 16))).float().mean().backward()
    complete_partial_grads(model.parameters())  # as the Trainer's Engine.sync_gradients
    optimizer.step()
    return end_together(model_state_bytes(model, optimizer))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["dp=2", "zero3=2", "tp=2"])
def test_a_simulated_world_holds_what_a_real_one_does(layout):
    real = run_workers(_real_world_bytes, 2, (layout,), timeout=100)
    for rank, measured in enumerate(real):
        state = simulate(_gpt(TINY), layout, rank=rank)
        assert (state.params, state.grads, state.optimizer) == (
            measured.params, measured.grads, measured.optimizer), rank


def test_what_cannot_be_simulated_is_refused():
    with pytest.raises(ConfigError, match="parameter servers"):
        simulate(_gpt(TINY), "ps=1,dp=2", world_size=3)
    with pytest.raises(ConfigError, match="rank 8 is not in a world of 8"):
        simulate(_gpt(TINY), "dp=8", rank=8)
    with pytest.raises(ConfigError, match="axis=degree"):
        simulate(_gpt(TINY), "zero3")


def test_a_hugging_face_model_follows_its_own_plans():
    """The Trainer's options by default: a Llama's own tp plan (q/k/v/o, gate/up/down split over
    tp; norms replicated) and its pipeline declaration."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         tie_word_embeddings=False)
    total = simulate(lambda: LlamaForCausalLM(config), "dp=1").local_params
    norms = 64 * (2 * 4 + 1)  # two RMSNorms per layer and the final one
    tp = simulate(lambda: LlamaForCausalLM(config), "tp=2", rank=1)
    assert tp.local_params == (total - norms) // 2 + norms
    with pytest.raises(ConfigError, match="num_key_value_heads=2 is not divisible by 4"):
        simulate(lambda: LlamaForCausalLM(config), "tp=4")
    first, last = (simulate(lambda: LlamaForCausalLM(config), "pp=2", rank=r) for r in (0, 1))
    assert first.local_params + last.local_params == total
    assert first.local_params != last.local_params
