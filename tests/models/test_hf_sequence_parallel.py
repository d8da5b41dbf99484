"""Sequence and loss parallel for Hugging Face causal LMs, built on their declared tp plans
(meshtrain/models/hf/tp_sequence.py): the same training as one process."""

import pytest
import torch
import transformers  # noqa: F401  (the `test` extra installs it: these tests never skip)
from parity import adamw_gpt, assert_parity, sgd
from torch.distributed.tensor import Shard

from meshtrain.errors import ConfigError
from meshtrain.models.hf import default_tp_plan, random_token_data, tiny_causal_lm, tiny_llama
from meshtrain.models.hf.tp_sequence import GatherHiddenStates, TakeSequenceShard

torch.set_num_threads(1)
STEPS, BATCH = 6, 8
SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
             tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
             eos_token_id=None)
SP, SP_LP = dict(sequence_parallel=True), dict(sequence_parallel=True, loss_parallel=True)


def llama():
    return tiny_llama(num_layers=4)


def qwen3():
    return tiny_causal_lm("Qwen3", head_dim=8, **SMALL)


def qwen2():
    return tiny_causal_lm("Qwen2", **SMALL)


def mistral_window():  # a sliding window (8) shorter than the sequence (16): a mask to keep
    return tiny_causal_lm("Mistral", sliding_window=8, **SMALL)


def tokens_16():
    return random_token_data(seq_len=16, vocab_size=64)


def fns(model_fn, data_fn=random_token_data):
    return dict(model_fn=model_fn, data_fn=data_fn, loss_fn=None, optimizer_fn=adamw_gpt)


def test_the_plan_keeps_the_stream_split_between_the_layers():
    plan = default_tp_plan(llama(), 2, **SP_LP)
    assert isinstance(plan["model.layers.0"], TakeSequenceShard)  # the first layer cuts
    for i in range(4):
        assert isinstance(plan[f"model.layers.{i}.self_attn"], GatherHiddenStates)
        assert isinstance(plan[f"model.layers.{i}.mlp"], GatherHiddenStates)
        assert plan[f"model.layers.{i}.input_layernorm"].local_input  # on the shards
    assert plan["model.layers.*.self_attn.o_proj"].output_layouts == (Shard(1),)
    assert plan["model.norm"].local_input
    assert plan["lm_head"].input_layouts == (Shard(1),)
    assert plan["lm_head"].output_layouts == (Shard(-1),)  # loss parallel: vocabulary split
    lp_only = default_tp_plan(llama(), 2, loss_parallel=True)
    assert "model.layers.0" not in lp_only and lp_only["lm_head"].output_layouts == (Shard(-1),)


def test_what_sequence_parallel_cannot_split_is_refused():
    with pytest.raises(ConfigError, match="model.layers.0.self_attn is a Olmo2Attention, not "
                                          "a norm"):  # its norms run on whole projections
        default_tp_plan(tiny_causal_lm("Olmo2", **SMALL), 2, **SP)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout, ranks, options", [
    ("tp=2", 2, SP), ("tp=2", 2, SP_LP), ("pp=2,tp=2", 4, SP), ("pp=2,tp=2", 4, SP_LP),
    ("dp_shard=2,tp=2", 4, SP_LP)])
def test_llama_matches_one_process(layout, ranks, options):
    """(Loss parallel: transformers' cross-entropy runs in float32 whatever the model; split over
    the vocabulary it rounds otherwise, 1e-7 of the logits' gradients, which AdamW turns into
    whole steps for elements whose gradient is below its eps: trained with SGD, judged at the
    model's own float64 floor.)"""
    optimizer = sgd if options.get("loss_parallel") else adamw_gpt
    assert_parity(layout, ranks, steps=STEPS, global_batch_size=BATCH,
                  fns=dict(fns(llama), optimizer_fn=optimizer),
                  micro_batch_size=2 if "pp" in layout else None, parallel_kwargs=options)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_fn", [qwen2, qwen3, mistral_window])
def test_other_families_match_one_process(model_fn):
    assert_parity("tp=2", 2, steps=STEPS, global_batch_size=BATCH,
                  fns=fns(model_fn, tokens_16), parallel_kwargs=SP)


def _fit_15_tokens():
    from meshtrain import Trainer

    Trainer(layout="tp=2", sequence_parallel=True, max_steps=1, global_batch_size=4,
            loggers=(), progress_bar=False, report=False, save_final_checkpoint=False,
            resume=None).fit(llama, random_token_data(seq_len=15), optimizer=adamw_gpt)


@pytest.mark.timeout(120)
def test_a_length_tp_does_not_divide_is_a_clear_error(tmp_path, monkeypatch):
    from meshtrain.launch.spawn import WorkerFailed, run_workers

    monkeypatch.chdir(tmp_path)
    with pytest.raises(WorkerFailed, match="holds 15 per sequence; use a sequence length that "
                                           "divides by tp"):
        run_workers(_fit_15_tokens, 2, timeout=100)
