"""Hugging Face causal LMs under pipeline parallel, cut by the pipeline plan they declare."""

from functools import partial

import pytest
import torch
import transformers  # noqa: F401  (the `test` extra installs it: these tests never skip)
from conftest import trainer_kwargs
from parity import adamw_gpt, assert_parity
from torch.utils.data import TensorDataset

from meshtrain import Trainer
from meshtrain.errors import ConfigError
from meshtrain.models.hf import pipeline as hf_pipeline
from meshtrain.models.hf import (
    causal_lm_loss, hf_pp_support, random_token_data, tiny_causal_lm, tiny_gpt2, tiny_llama,
)
from meshtrain.parallel.pipeline.engine import merge_stages
from meshtrain.parallel.pipeline.check import check_stage_forward

torch.set_num_threads(1)
STEPS, BATCH, MICRO = 6, 8, 2


# Module-level functions from importable modules: the workers are spawned and unpickle them.
def tiny_llama_4_layers():
    return tiny_llama(num_layers=4)


def token_pairs():
    """The same tokens as (input_ids, labels) pairs."""
    data = random_token_data()
    return TensorDataset(data.tokens, data.tokens.clone())


# dict batches, no loss_fn: one process uses the model's own loss, pp the adapter's
DICT_FNS = dict(model_fn=tiny_llama_4_layers, data_fn=random_token_data, loss_fn=None,
                optimizer_fn=adamw_gpt)
# (input_ids, labels) pairs with an explicit loss_fn: one process applies it to model(input_ids)
PAIR_FNS = dict(model_fn=tiny_llama_4_layers, data_fn=token_pairs, loss_fn=causal_lm_loss,
                optimizer_fn=adamw_gpt)


def test_stages_compose_to_the_model_and_keep_full_names():
    model = tiny_llama_4_layers()
    adapter = hf_pp_support(model)
    ids = adapter.example_inputs(model)
    check_stage_forward(model, ids, adapter)  # the pipeline check passes
    stages = [adapter.split(model, [1, 3], i) for i in range(3)]
    x = ids
    for stage in stages:
        x = stage(x)
    assert torch.equal(x, model(ids).logits)
    names = {n for stage in stages for n, _ in stage.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}
    assert "lm_head.weight" in dict(stages[2].named_parameters())
    assert "model.layers.2.self_attn.q_proj.weight" in dict(stages[1].named_parameters())
    merged = merge_stages([stages[0], stages[2]])  # interleaved: two stages on one rank
    assert {n for n, _ in merged.named_parameters()} == {
        n for s in (stages[0], stages[2]) for n, _ in s.named_parameters()}
    batch = {"input_ids": ids, "labels": ids}
    # a global mean: the sum over the targets, and how many there are
    assert torch.allclose(causal_lm_loss(model(ids), ids) / causal_lm_loss.count(ids),
                          model(**batch).loss)


def test_refusals():
    adapter = hf_pp_support(tiny_llama())
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        tied = tiny_llama(tie_word_embeddings=True)
        adapter.split(tied, [1], 0)
    with pytest.raises(ConfigError, match="declares no pipeline plan"):
        hf_pp_support(tiny_gpt2())
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ConfigError, match="padding"):
        adapter.split_batch({"input_ids": ids, "labels": ids, "attention_mask": ids})
    assert adapter.split_batch({"input_ids": ids, "labels": ids + 1})[1].eq(1).all()
    assert hf_pp_support(torch.nn.Linear(2, 2)) is None


def test_forward_check_refuses_stages_that_differ(monkeypatch):
    model = tiny_llama_4_layers()
    adapter = hf_pp_support(model)
    run_stage = hf_pipeline.run_stage  # a stage that scales the hidden state it receives
    monkeypatch.setattr(hf_pipeline, "run_stage", lambda model, x, first, last: run_stage(
        model, x if first else 2 * x, first, last))
    with pytest.raises(ConfigError, match=r"would not compute its forward(.|\n)*own forward"):
        check_stage_forward(model, adapter.example_inputs(model), adapter)


def test_tied_llama_is_refused_before_any_process(tmp_path, monkeypatch):
    def no_world(*args, **kwargs):
        raise AssertionError("the pipeline check let the model through: processes would start")

    monkeypatch.setattr("meshtrain.loop.setup.start_world", no_world)
    trainer = Trainer(**trainer_kwargs(tmp_path / "run", layout="pp=2", devices=2, max_steps=1,
                                       global_batch_size=8))
    with pytest.raises(ConfigError, match="shared across stages"):
        trainer.fit(partial(tiny_llama, tie_word_embeddings=True), random_token_data(),
                    optimizer=adamw_gpt)


def test_llama_pp2_dict_batches_match_one_process():
    assert_parity("pp=2", 2, steps=10, global_batch_size=BATCH, micro_batch_size=MICRO,
                  fns=DICT_FNS)


def test_llama_pp2_pairs_with_loss_fn_match_one_process():
    assert_parity("pp=2", 2, steps=STEPS, global_batch_size=BATCH, micro_batch_size=MICRO,
                  fns=PAIR_FNS)


def test_llama_pp2_dp_shard2_match_one_process():
    assert_parity("pp=2,dp_shard=2", 4, steps=STEPS, global_batch_size=BATCH,
                  micro_batch_size=MICRO, fns=DICT_FNS)


def test_llama_interleaved_two_stages_per_rank_match_one_process():
    assert_parity("pp=2", 2, steps=STEPS, global_batch_size=BATCH, micro_batch_size=1,
                  fns=DICT_FNS, parallel_kwargs=dict(pp_schedule="interleaved-1f1b",
                                                     stages_per_rank=2))


def test_llama_pp2_tp2_match_one_process():  # each stage gets the built-in tp plan
    assert_parity("pp=2,tp=2", 4, steps=STEPS, global_batch_size=BATCH,
                  micro_batch_size=MICRO, fns=DICT_FNS)


def test_per_layer_attention_types_follow_their_layers_onto_the_stages(monkeypatch):
    """Qwen3 with sliding and full layers alternating: each one-layer stage must use its own
    layer's type (the model indexes config.layer_types by the position in its layer list)."""
    model = tiny_causal_lm("Qwen3", head_dim=8, sliding_window=4, use_sliding_window=True,
                           layer_types=["sliding_attention", "full_attention"] * 2,
                           **dict(SMALL, num_hidden_layers=4))
    adapter = hf_pp_support(model)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    check_stage_forward(model, ids, adapter)
    stages = [adapter.split(model, [1, 2, 3], i) for i in range(4)]
    assert [s.config.layer_types for s in stages] == [["sliding_attention"], ["full_attention"]] * 2
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2  # restored


def test_the_check_runs_on_training_samples_as_long_as_the_sequence(tmp_path, monkeypatch):
    """Stages that lose Mistral's sliding window (8) differ from the model only past 8 tokens:
    the check before any process starts sees it on the 16-token training samples (it ran on
    16 example tokens whatever the data)."""
    def no_world(*args, **kwargs):
        raise AssertionError("the pipeline check let the model through: processes would start")

    run_stage = hf_pipeline.run_stage

    def without_window(model, x, first, last):
        window, model.config.sliding_window = model.config.sliding_window, None
        try:
            return run_stage(model, x, first, last)
        finally:
            model.config.sliding_window = window

    monkeypatch.setattr("meshtrain.loop.setup.start_world", no_world)
    monkeypatch.setattr(hf_pipeline, "run_stage", without_window)
    monkeypatch.setattr(hf_pipeline.HFPipeline, "example_inputs",  # too short to show it
                        lambda self, model: torch.zeros(2, 8, dtype=torch.long))
    trainer = Trainer(**trainer_kwargs(tmp_path / "run", layout="pp=2", devices=2, max_steps=1,
                                       global_batch_size=8))
    with pytest.raises(ConfigError, match="the outputs differ"):
        trainer.fit(mistral_window, random_token_data(seq_len=16, vocab_size=64),
                    optimizer=adamw_gpt)


SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
             tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)


def mistral_window():
    return tiny_causal_lm("Mistral", sliding_window=8, **SMALL)
