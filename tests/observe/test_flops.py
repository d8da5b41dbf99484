"""FLOPs per token for a model that states none: torch's FlopCounterMode over one forward and
backward of a meta-device copy (meshtrain/observe/flops.py), against the GPT's own formula."""

import torch

from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.observe.flops import counted_flops_per_item, flops_per_item


def test_counted_flops_match_the_gpt_formula():
    config = GPTConfig(vocab_size=64, seq_len=32, num_layers=4, d_model=64, num_heads=4)
    with torch.device("meta"):
        model = GPT(config)
    own = model.flops_per_token(32)  # 6 x matmul parameters + 12 L d T (attention)
    counted = counted_flops_per_item(model, torch.zeros(2, 32, dtype=torch.long))
    assert abs(counted / own - 1) < 0.03, (counted, own)
    attention = 12 * 4 * 64 * 32
    assert counted > own - attention / 2  # the attention is in the count, not only 6 x params


class NoFormula(torch.nn.Module):
    """A model with attention and no flops_per_token of its own."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT(GPTConfig(vocab_size=64, seq_len=32, num_layers=4, d_model=64,
                                 num_heads=4))

    def forward(self, idx):
        return self.gpt(idx)


def test_a_model_without_its_own_count_is_counted_not_estimated():
    with torch.device("meta"):
        meta = NoFormula()
    sample = torch.zeros(2, 32, dtype=torch.long)
    counted = flops_per_item(meta, meta_model=meta, sample=sample)
    assert counted == counted_flops_per_item(meta, sample)
    assert counted > flops_per_item(meta) * 1.05  # 6 x params misses the attention
    assert flops_per_item(meta, meta_model=meta, sample=None) == flops_per_item(meta)
