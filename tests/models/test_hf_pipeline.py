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


def test_tied_embeddings_under_a_v_schedule_are_refused_before_any_process(tmp_path,
                                                                          no_processes):
    trainer = Trainer(**trainer_kwargs(tmp_path / "run", layout="pp=2", devices=2, max_steps=1,
                                       global_batch_size=8, pp_schedule="zbv", stages_per_rank=2))
    with pytest.raises(ConfigError, match="first and the last stage on one rank"):
        trainer.fit(partial(tiny_llama, num_layers=4, tie_word_embeddings=True),
                    random_token_data(), optimizer=adamw_gpt)


def test_tied_stages_hold_the_weight_under_its_own_name_on_both_ends():
    model = tied_qwen2()
    adapter = hf_pp_support(model)
    check_stage_forward(model, adapter.example_inputs(model), adapter)  # the check lets it by
    stages = [adapter.split(model, [1, 3], i) for i in range(3)]
    x = adapter.example_inputs(model)
    for stage in stages:
        x = stage(x)
    assert torch.equal(x, model(adapter.example_inputs(model)).logits)
    first, middle, last = (dict(s.named_parameters()) for s in stages)
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert not any("embed" in name for name in middle)
    # the last stage: one tensor, named as one process names it (checkpoints, optimizer state)
    assert "model.embed_tokens.weight" in last and "lm_head.weight" not in last
    assert stages[2].lm_head.weight is stages[2].model.embed_tokens.weight


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, procs", [("pp=2", 2), ("pp=4", 4), ("pp=2,dp_shard=2", 4)])
def test_tied_qwen2_matches_one_process(layout, procs):
    """The embedding's copy on the last stage: the same values at the start and the sum of both
    uses' gradients every step (pp=4: summed in a group of the first and last pp rank)."""
    assert_parity(layout, procs, steps=STEPS, global_batch_size=BATCH, micro_batch_size=MICRO,
                  fns=dict(DICT_FNS, model_fn=tied_qwen2, data_fn=tokens_64))


def _tied_fit(run_dir, layout, steps, resume=None):
    from meshtrain.parallel.whole_state import whole_state

    trainer = Trainer(**trainer_kwargs(run_dir, layout=layout, max_steps=steps,
                                       global_batch_size=BATCH, micro_batch_size=MICRO,
                                       save_final_checkpoint=True, resume=resume))
    model = trainer.fit(tied_qwen2, tokens_64(), optimizer=adamw_gpt)
    return whole_state(model, trainer.layout.degree("pp"))


@pytest.mark.timeout(300)
def test_tied_checkpoints_resume_across_pp_and_export_one_tensor(tmp_path):
    """A pp=2 checkpoint of tied Qwen2 resumes in one process and a one-process one under pp=2,
    both continuing the one-process run; `export --hf` writes one tensor for both uses."""
    from meshtrain.checkpoint.hf_export import export_hf
    from meshtrain.launch.spawn import run_workers

    import transformers

    straight = _tied_fit(tmp_path / "straight", None, 4)
    once = _tied_fit(tmp_path / "once", None, 2)
    piped = run_workers(_tied_fit, 2, (tmp_path / "piped", "pp=2", 2), timeout=200)[0]
    for name, value in once.items():
        assert torch.allclose(piped[name], value, atol=1e-5), name
    resumed = _tied_fit(tmp_path / "resumed", None, 4,
                        resume=tmp_path / "piped" / "checkpoints" / "final")
    across = run_workers(_tied_fit, 2, (tmp_path / "across", "pp=2", 4,
                                        tmp_path / "once" / "checkpoints" / "final"),
                         timeout=200)[1]
    assert max((a - straight[k]).abs().max().item() for k, a in once.items()) > 1e-3
    for state in (resumed, across):
        for name, value in straight.items():
            assert torch.allclose(state[name], value, atol=1e-5), name
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    out = export_hf(tmp_path / "piped" / "checkpoints" / "final", tmp_path / "hf",
                    config=tied_qwen2().config)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.allclose(model.lm_head.weight, once["lm_head.weight"], atol=1e-5)


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


def tied_qwen2():
    """Qwen2 with its output head tied to the input embedding (as Qwen2.5-0.5B-3B)."""
    return tiny_causal_lm("Qwen2", **dict(SMALL, num_hidden_layers=4, tie_word_embeddings=True))


def tokens_64():
    return random_token_data(vocab_size=64)


def mistral_window():
    return tiny_causal_lm("Mistral", sliding_window=8, **SMALL)
