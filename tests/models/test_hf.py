"""Hugging Face causal LMs built from configs (no download) train under dp, zero3 and tp."""

from functools import partial

import pytest
import torch
import transformers  # noqa: F401  (the `test` extra installs it: these tests never skip)
from parity import adamw_gpt, assert_parity
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshtrain.errors import ConfigError
from meshtrain.models.hf import (
    default_tp_plan, hf_tp_plan, random_token_data, tiny_causal_lm, tiny_gpt2, tiny_llama,
)
from meshtrain.parallel.tensor.tensor_parallel import ReplicateParallel

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


# Architectures whose attention differs from Llama's (tiny configs, untied): Qwen3 normalises
# each head's queries and keys (a norm on split heads), OLMo2 the whole projections, Mistral
# attends within a sliding window shorter than the sequence.
SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
             tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
             eos_token_id=None)


def tiny_qwen3():
    return tiny_causal_lm("Qwen3", head_dim=8, **SMALL)


def tiny_olmo2():
    return tiny_causal_lm("Olmo2", **SMALL)


def tiny_mistral_window():
    return tiny_causal_lm("Mistral", sliding_window=8, **SMALL)


def tokens_16():
    return random_token_data(seq_len=16, vocab_size=64)


def arch_fns(model_fn, optimizer_fn=adamw_gpt):
    return dict(model_fn=model_fn, data_fn=tokens_16, loss_fn=None, optimizer_fn=optimizer_fn)


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


def test_plan_is_the_models_own_declaration():
    """Every pattern transformers declares, translated; nothing guessed from module names."""
    model = tiny_llama()
    plan = hf_tp_plan(model, tp=2)
    assert set(plan) == set(model.tp_plan)
    assert isinstance(plan["model.embed_tokens"], RowwiseParallel)  # embedding_rowwise
    q, o = plan["model.layers.*.self_attn.q_proj"], plan["model.layers.*.self_attn.o_proj"]
    assert isinstance(q, ColwiseParallel) and q.output_layouts == (Shard(-1),)  # colwise
    assert isinstance(o, RowwiseParallel) and o.input_layouts == (Shard(-1),)  # rowwise
    head = plan["lm_head"]  # colwise_gather_output: the logits whole, for the model's own loss
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Replicate(),)
    qwen3 = plan_of(tiny_qwen3())  # per-head norms see this rank's heads: gradients summed
    norm = qwen3["model.layers.*.self_attn.q_norm"]
    assert isinstance(norm, ReplicateParallel) and norm.local_input
    olmo2 = plan_of(tiny_olmo2())  # norms over the whole projection: q/k/v gathered, o cut
    assert olmo2["model.layers.*.self_attn.k_proj"].output_layouts == (Replicate(),)
    assert olmo2["model.layers.*.self_attn.o_proj"].input_layouts == (Replicate(),)
    assert default_tp_plan(torch.nn.Linear(2, 2)) is None  # not HF: meshtrain's own plan


def plan_of(model):
    return hf_tp_plan(model, tp=2)


def test_tp_config_errors():
    with pytest.raises(ConfigError, match="num_key_value_heads=2"):
        hf_tp_plan(tiny_llama(num_heads=4, num_kv_heads=2), tp=4)
    with pytest.raises(ConfigError, match="declares no tensor-parallel plan"):
        default_tp_plan(tiny_gpt2(), 2)
    with pytest.raises(ConfigError, match="out_features of model.layers.0.mlp.gate_proj=24"):
        hf_tp_plan(tiny_llama(intermediate_size=24, num_heads=16, num_kv_heads=16), tp=16)
    moe = tiny_causal_lm("Qwen3Moe", vocab_size=32, hidden_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                         moe_intermediate_size=8, num_experts=2, num_experts_per_tok=1)
    with pytest.raises(ConfigError, match=r"mixture-of-experts model \(2 experts in each of 1 MoE "
                                          r"layer\) and meshtrain does not split .* "
                                          r"layout=\"ep=2\""):
        hf_tp_plan(moe, tp=2)


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
@pytest.mark.parametrize("layout", ["dp=2", "zero3=2", "cp=2"])
def test_gpt2_parity(layout):  # cp: learned positions from position_ids, attention registry
    assert_parity(layout, 2, steps=STEPS, global_batch_size=BATCH, fns=GPT2_FNS)


@pytest.mark.timeout(200)
def test_llama_context_parallel_parity():
    # labels are shifted before the sequence is cut, positions follow the zig-zag order
    assert_parity("cp=2", 2, steps=10, global_batch_size=BATCH, fns=LLAMA12_FNS)


def _cached_llama():
    from meshtrain.models.hf import tiny_llama

    model = tiny_llama()
    model.config.use_cache = True  # (transformers' default: a user's config has it)
    return model


@pytest.mark.timeout(200)
def test_llama_with_its_kv_cache_on_and_recomputed_blocks_matches_one_process():
    """A recomputed block would append its keys and values to the model's KV cache again (under
    cp its attention got twice the keys and the first step failed): meshtrain trains a
    Hugging Face model with use_cache=False."""
    assert_parity("cp=2", 2, steps=4, global_batch_size=BATCH,
                  fns=dict(LLAMA12_FNS, model_fn=_cached_llama), activation_checkpointing="full")


def test_llama_context_parallel_batch_keeps_every_target_once():
    from meshtrain.models.hf import HFContextParallel
    from meshtrain.parallel.context.context_parallel import unshard_sequence

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
    gemma2 = tiny_causal_lm("Gemma2", head_dim=8, attn_logit_softcapping=50.0, **SMALL)
    with pytest.raises(ConfigError, match=r"sets attn_logit_softcapping=50.0 \(soft-capping"):
        HFContextParallel(gemma2).check_context_parallel(2)


# AdamW, as users train it: in fp32 it turned one element of q_proj whose gradient is ~7e-9,
# below its eps, into a 3e-5 step either way, and this test ran on SGD; in float64 both sides
# take the same step (the gradient norm still shows a partial gradient at step 1).
@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", ["tp=2", "dp_shard=2,tp=2"])
def test_qwen3_per_head_norms_under_tp_match_one_process(layout):
    assert_parity(layout, 2 if layout == "tp=2" else 4, steps=STEPS, global_batch_size=BATCH,
                  fns=arch_fns(tiny_qwen3))


@pytest.mark.timeout(200)
def test_olmo2_whole_projection_norms_under_tp_match_one_process():
    assert_parity("tp=2", 2, steps=STEPS, global_batch_size=BATCH, fns=arch_fns(tiny_olmo2))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", ["pp=2", "cp=2"])
def test_mistral_sliding_window_under_pp_and_cp_matches_one_process(layout):
    """A window of 8 on 16-token sequences: the stages run the model's own masks, and context
    parallel masks the gathered keys by the window."""
    assert_parity(layout, 2, steps=STEPS, global_batch_size=BATCH,
                  fns=arch_fns(tiny_mistral_window))



def tiny_qwen3_moe():
    return tiny_causal_lm("Qwen3Moe", head_dim=8, moe_intermediate_size=16, num_experts=2,
                          num_experts_per_tok=1, **SMALL)


def tiny_qwen3_moe_router_loss():
    return tiny_causal_lm("Qwen3Moe", head_dim=8, moe_intermediate_size=16, num_experts=2,
                          num_experts_per_tok=1, output_router_logits=True, **SMALL)


@pytest.mark.parametrize("layout, devices, match", [
    ("tp=2", 2, r"does not split a Hugging Face model's experts by tensor parallel.*ep=2"),
    ("tp=4", 4, r"splits the num_key_value_heads over 4 ranks"),
    ("cp=2", 2, r"sets attn_logit_softcapping=50.0"),
    ("cp=2 sinks", 2, r"has attention sinks \(model\.layers\.0\.self_attn\.sinks"),
])
def test_what_a_path_does_not_implement_is_refused_before_any_process(tmp_path, monkeypatch,
                                                                      layout, devices, match):
    from conftest import trainer_kwargs

    from meshtrain import Trainer

    def no_world(*args, **kwargs):
        raise AssertionError("refused too late: the processes would start")

    monkeypatch.setattr("meshtrain.loop.setup.start_world", no_world)
    model = {"tp=2": tiny_qwen3_moe, "tp=4": tiny_qwen3, "cp=2": tiny_gemma2_softcap,
             "cp=2 sinks": tiny_gpt_oss}[layout]
    layout = layout.split()[0]
    trainer = Trainer(**trainer_kwargs(tmp_path / "run", layout=layout, devices=devices,
                                       max_steps=1, global_batch_size=8))
    with pytest.raises(ConfigError, match=match):
        trainer.fit(model, tokens_16(), optimizer=adamw_gpt)


def tiny_gpt_oss():
    return tiny_causal_lm("GptOss", head_dim=8, num_local_experts=2,
                          num_experts_per_tok=1, **SMALL)


def tiny_gemma2_softcap():
    return tiny_causal_lm("Gemma2", head_dim=8, attn_logit_softcapping=50.0, **SMALL)


def tiny_stablelm():  # transformers declares neither a tensor- nor a pipeline-parallel plan
    return tiny_causal_lm("StableLm", **SMALL)


@pytest.mark.parametrize("model, layout, recommended", [
    (tiny_stablelm, "tp=2", "train it without tp (dp, zero1-3), or"),
    (tiny_stablelm, "pp=2", "train it without pp (dp, zero1-3)"),
    (tiny_qwen3_moe, "tp=2", "layouts without tp: dp, zero1-3, pp, ep"),  # it has plans
    # its router loss on: pp refused (a pipeline cannot carry it), so not recommended
    (tiny_qwen3_moe_router_loss, "tp=2", "layouts without tp: dp, zero1-3, ep"),
])
def test_a_refusal_recommends_only_layouts_the_model_supports(tmp_path, model, layout,
                                                               recommended):
    from conftest import trainer_kwargs

    from meshtrain import Trainer

    trainer = Trainer(**trainer_kwargs(tmp_path, layout=layout, devices=2, max_steps=1,
                                       global_batch_size=8))
    with pytest.raises(ConfigError) as error:
        trainer.check(model, tokens_16(), optimizer=adamw_gpt)
    assert recommended in str(error.value), str(error.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", ["tiny", "213M"])
def test_a_granite_scaling_its_embeddings_is_refused_under_pp_at_any_size(tmp_path, monkeypatch,
                                                                          size):
    """Granite multiplies inputs_embeds by embedding_multiplier in its forward: every stage
    would do it again. Refused before any process starts, naming the field, also for a model
    too large to build for the check (213M parameters, above BUILD_LIMIT: checked on its meta
    copy with real stand-ins op by op; before, shapes alone passed)."""
    from conftest import trainer_kwargs

    from meshtrain import Trainer
    from meshtrain.parallel.pipeline.check import BUILD_LIMIT

    def no_world(*args, **kwargs):
        raise AssertionError("refused too late: the processes would start")

    monkeypatch.setattr("meshtrain.loop.setup.start_world", no_world)
    sizes = dict(SMALL) if size == "tiny" else dict(
        SMALL, vocab_size=4096, hidden_size=1024, num_hidden_layers=16, num_attention_heads=8,
        num_key_value_heads=8, intermediate_size=2816)
    config = transformers.GraniteConfig(**sizes, embedding_multiplier=12.0)
    built = []

    def factory():
        built.append(torch.get_default_device().type)
        return transformers.GraniteForCausalLM(config)

    trainer = Trainer(**trainer_kwargs(tmp_path / "run", layout="pp=2", devices=2,
                                       max_steps=1, global_batch_size=4))
    data = random_token_data(num_samples=8, seq_len=16, vocab_size=sizes["vocab_size"])
    with pytest.raises(ConfigError, match=r"config\.embedding_multiplier=12\.0 scales "
                                          r"inputs_embeds .* again"):
        trainer.fit(factory, data, optimizer=adamw_gpt)
    with torch.device("meta"):
        whole = sum(p.numel() for p in factory().parameters())
    assert (whole > BUILD_LIMIT) == (size != "tiny")
    assert built.count("cpu") == (size == "tiny")  # the 213M one never built whole
