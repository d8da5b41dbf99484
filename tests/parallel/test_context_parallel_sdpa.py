"""Context parallel for a transformer of your own that calls F.scaled_dot_product_attention,
without changes to its code (meshtrain/parallel/context/sdpa.py): the same training as one
process, with a learned position table at the root read at each rank's global positions."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import adamw_gpt, assert_parity
from torch.utils.data import TensorDataset

from meshtrain.errors import ConfigError

VOCAB, SEQ, WIDTH, HEADS = 32, 16, 32, 4


class Block(nn.Module):
    def __init__(self, kv_heads: int = HEADS):
        super().__init__()
        self.kv_heads, self.head_dim = kv_heads, WIDTH // HEADS
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q = nn.Linear(WIDTH, WIDTH)
        self.kv = nn.Linear(WIDTH, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, HEADS, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv_heads != HEADS)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.mlp(self.norm2(x))


class MyTransformer(nn.Module):
    """Written as one would without meshtrain: positions a root-level parameter sliced to the
    input's length, attention through SDPA."""

    def __init__(self, kv_heads: int = HEADS):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(0.1 * torch.randn(SEQ, WIDTH))
        self.blocks = nn.ModuleList(Block(kv_heads) for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def grouped_query():
    return MyTransformer(kv_heads=2)


def tokens():
    gen = torch.Generator().manual_seed(5)
    data = torch.randint(0, VOCAB, (64, SEQ + 1), generator=gen)
    return TensorDataset(data[:, :-1], data[:, 1:])


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


FNS = dict(model_fn=MyTransformer, data_fn=tokens, loss_fn=lm_loss, optimizer_fn=adamw_gpt)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, ranks, model_fn", [
    ("cp=2", 2, MyTransformer), ("dp_shard=2,cp=2", 4, MyTransformer),
    ("cp=2", 2, grouped_query)], ids=["cp=2", "dp_shard=2,cp=2", "cp=2-gqa"])
def test_your_sdpa_transformer_matches_one_process(layout, ranks, model_fn):
    assert_parity(layout, ranks, steps=6, global_batch_size=8, fns=dict(FNS, model_fn=model_fn))


class MaskedAttention(MyTransformer):
    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.size(1)]
        q = x.view(x.size(0), x.size(1), HEADS, -1).transpose(1, 2)
        mask = torch.ones(idx.size(1), idx.size(1), dtype=torch.bool).tril()
        y = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        return self.head(y.transpose(1, 2).flatten(2))


def assert_refused_under_cp(run_dir, model_fn, match: str) -> None:
    """``fit(model_fn)`` under cp=2 is refused with ``match`` (with the ``no_processes``
    fixture: before any process starts)."""
    from conftest import trainer_kwargs

    from meshtrain import Trainer

    trainer = Trainer(**trainer_kwargs(run_dir, layout="cp=2", devices=2, max_steps=1,
                                       global_batch_size=8))
    with pytest.raises(ConfigError, match=match):
        trainer.fit(model_fn, tokens(), optimizer=adamw_gpt, loss_fn=lm_loss)


def test_attention_meshtrain_cannot_split_is_refused_before_any_process(tmp_path, no_processes):
    assert_refused_under_cp(tmp_path, MaskedAttention, "with an attn_mask")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_your_sdpa_transformer_with_recomputed_blocks_matches_one_process(mode):
    """Activation checkpointing recomputes each block in the backward, outside the model's
    forward: its attention must again span the cp group (before, the recompute ran local
    attention and the first step failed)."""
    assert_parity("cp=2", 2, steps=4, global_batch_size=8, fns=FNS,
                  activation_checkpointing=mode)
