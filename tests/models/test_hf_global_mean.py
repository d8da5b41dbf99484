"""Hugging Face causal LMs with padded labels train the same under every layout (issue 13).

The model computes its own loss; meshtrain counts the step's targets (``labels[:, 1:]`` not
-100) over every rank and passes ``num_items_in_batch``, as ``transformers``' Trainer does. Under
pp the adapter's last-stage loss (``causal_lm_loss``) is the same global mean.
"""


import pytest
import torch
from parity import adamw_gpt, assert_parity
from torch.utils.data import Dataset

from meshtrain.models.hf import causal_lm_loss, count_lm_targets, tiny_llama

torch.set_num_threads(1)


class PaddedTokens(Dataset):
    """``{"input_ids", "labels"}``; sample i's labels after its first k_i tokens are -100."""

    def __init__(self, num_samples: int = 64, seq_len: int = 12, vocab_size: int = 32):
        gen = torch.Generator().manual_seed(5)
        self.tokens = torch.randint(0, vocab_size, (num_samples, seq_len), generator=gen)
        self.keep = torch.randint(2, seq_len + 1, (num_samples,), generator=gen)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.tokens[i].clone()
        labels[self.keep[i]:] = -100
        return {"input_ids": self.tokens[i], "labels": labels}


def tiny_llama_4_layers():
    return tiny_llama(num_layers=4)


FNS = dict(model_fn=tiny_llama_4_layers, data_fn=PaddedTokens, loss_fn=None,
           optimizer_fn=adamw_gpt)
BATCH = 8


def test_counts_and_loss_agree_with_the_model():
    model = tiny_llama()
    data = PaddedTokens()
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("input_ids", "labels")}
    count = count_lm_targets(batch)
    assert int(count) == int((batch["labels"][:, 1:] != -100).sum()) < 4 * 11
    assert int(causal_lm_loss.count(batch["labels"])) == int(count)
    mean = model(**batch).loss
    total = causal_lm_loss(model(batch["input_ids"]), batch["labels"])
    assert torch.allclose(total / count, mean)
    assert torch.allclose(model(**batch, num_items_in_batch=count.float()).loss, mean)


def test_accumulation_matches_one_process():
    assert_parity("dp=1", 1, steps=6, global_batch_size=BATCH, micro_batch_size=2, fns=FNS)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout, micro", [("dp=2", 2), ("pp=2", 1), ("cp=2", None)])
def test_layouts_match_one_process(layout, micro):
    assert_parity(layout, 2, steps=6, global_batch_size=BATCH, micro_batch_size=micro, fns=FNS)
