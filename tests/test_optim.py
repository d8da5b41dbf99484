"""meshtrain.optim.AdamW: weight decay on linear matrices only, by full-model names, under every
layout path (plain, zero1's wrapper) and equal to the same groups written by hand."""

import pytest
import torch
from parity import assert_parity

from meshtrain.models.hf import tiny_llama
from meshtrain.optim import AdamW, decays, params_factory


def test_groups_of_a_llama():
    model = tiny_llama()
    opt = params_factory(AdamW(lr=1e-3, weight_decay=0.1), model)(model.parameters())
    decayed, plain = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    decayed_names = {names[id(p)] for p in decayed["params"]}
    plain_names = {names[id(p)] for p in plain["params"]}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert "model.layers.0.self_attn.q_proj.weight" in decayed_names
    assert "lm_head.weight" in decayed_names
    assert "model.embed_tokens.weight" in plain_names
    assert {"model.norm.weight", "model.layers.0.input_layernorm.weight"} <= plain_names
    assert len(decayed_names) + len(plain_names) == len(list(model.parameters()))


def test_the_rule():
    assert decays("layers.0.attn.wq.weight", torch.zeros(2, 2))
    assert not decays("layers.0.attn.wq.bias", torch.zeros(2))
    assert not decays("tok_emb.weight", torch.zeros(2, 2))
    assert not decays("transformer.wte.weight", torch.zeros(2, 2))


def tiny_gpt_adamw_groups(params):
    # a large decay, so that grouping the embeddings wrongly moves them past the tolerance
    return AdamW(lr=1e-3, weight_decay=1.0)(params)


tiny_gpt_adamw_groups.takes_names = True


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", ["zero1=2", "zero3=2"])
def test_named_factory_under_sharded_layouts_matches_one_process(layout):
    from parity import GPT_FNS

    assert_parity(layout, 2, steps=6, fns=dict(GPT_FNS, optimizer_fn=tiny_gpt_adamw_groups))
