"""A forward written for the whole model (a head count hard-coded in a reshape) under tp: the
check before any process starts names the module and says to reshape with the local count,
instead of torch's bare shape error in the first step (meshtrain/parallel/tensor/tp_shapes.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import trainer_kwargs
from torch import nn
from torch.utils.data import TensorDataset

from meshtrain import Trainer
from meshtrain.errors import ConfigError
from meshtrain.parallel.tensor.tensor_parallel import attention_plan

VOCAB, SEQ, WIDTH, HEADS = 16, 8, 16, 4


class Attention(nn.Module):
    def __init__(self, heads_in_view):
        super().__init__()
        self.heads_in_view = heads_in_view  # 4: the whole model's count; -1: each rank's own
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.heads_in_view, WIDTH // HEADS).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class TinyLM(nn.Module):
    def __init__(self, heads_in_view):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.attn = Attention(heads_in_view)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        h = self.embed(idx)
        return self.head(h + self.attn(h))


def _data():
    tokens = torch.randint(0, VOCAB, (32, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _check(tmp_path, heads_in_view):
    trainer = Trainer(**trainer_kwargs(tmp_path, devices=2, layout="tp=2", max_steps=1,
                                       tp_plan=attention_plan("attn", "wq", "wk", "wv", "wo")))
    trainer.check(lambda: TinyLM(heads_in_view), _data(),
                  optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                  loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))


def test_a_hard_coded_head_count_under_tp_is_named_before_start(tmp_path):
    with pytest.raises(ConfigError) as error:
        _check(tmp_path, heads_in_view=HEADS)
    message = str(error.value)
    assert "the forward of attn (Attention) fails with the shapes one rank holds" in message
    assert "is invalid for input of size" in message  # torch's own words, first line
    assert "1/2 of the heads (the output features) of a column-parallel layer (attn.wq" in message
    assert "reshape with the local count: -1 (q.view(B, T, -1, head_dim))" in message
    assert not torch.distributed.is_initialized()


def test_the_local_count_passes_the_check(tmp_path):
    _check(tmp_path, heads_in_view=-1)  # no error: each rank's heads
