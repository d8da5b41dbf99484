"""Context parallel reads every position-dependent tensor of a model of your own at each rank's
global positions, or refuses the model before any process starts
(meshtrain/parallel/context/positions.py): a table kept as a plain tensor attribute (as Meta's
Llama keeps freqs_cis), positions from ``torch.arange(T)`` (rotary angles, a learned position
embedding), an ALiBi-style bias built from ``arange`` (refused: an attention mask), and a table
the forward builds for itself (refused, with the fix)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import adamw_gpt, assert_parity

from test_context_parallel_sdpa import (HEADS, SEQ, VOCAB, WIDTH, Block,
                                        assert_refused_under_cp, lm_loss, tokens)


def _rotate(x, cos, sin):
    """A rotary-style mix of neighbouring features by position-dependent angles."""
    return x * cos + x.roll(1, dims=-1) * sin


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def rest(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class AttributeTable(_Base):
    """cos/sin tables as plain tensor attributes, sliced to the input's length."""

    def __init__(self):
        super().__init__()
        angles = torch.arange(SEQ)[:, None] * torch.linspace(0.1, 1.0, WIDTH)
        self.cos, self.sin = angles.cos(), angles.sin()

    def forward(self, idx):
        t = idx.size(1)
        return self.rest(_rotate(self.tok(idx), self.cos[:t], self.sin[:t]))


class ArangeAngles(_Base):
    """Angles computed every forward from torch.arange(T) and a frequency buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freq", torch.linspace(0.1, 1.0, WIDTH), persistent=False)

    def forward(self, idx):
        angles = torch.arange(idx.size(1), device=idx.device)[:, None] * self.freq
        return self.rest(_rotate(self.tok(idx), angles.cos(), angles.sin()))


class LearnedPositions(_Base):
    """A learned absolute position embedding looked up at torch.arange(T)."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(SEQ, WIDTH)

    def forward(self, idx):
        return self.rest(self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device)))


class AlibiBias(_Base):
    """ALiBi: a linear bias by distance, built from arange and passed to SDPA as a mask."""

    def forward(self, idx):
        b, t = idx.shape
        x = self.tok(idx)
        pos = torch.arange(t, device=idx.device)
        distance = (pos[:, None] - pos[None, :]).to(x.dtype)
        bias = (-0.5 * distance).masked_fill(distance < 0, float("-inf"))
        q = x.view(b, t, HEADS, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, q, q, attn_mask=bias)
        return self.head(y.transpose(1, 2).reshape(b, t, WIDTH))


class BuiltTable(_Base):
    """A position table the forward builds for itself at the full length, then slices."""

    def forward(self, idx):
        angles = torch.arange(SEQ, device=idx.device)[:, None] * torch.linspace(0.1, 1.0, WIDTH)
        t = idx.size(1)
        return self.rest(_rotate(self.tok(idx), angles.cos()[:t], angles.sin()[:t]))


FNS = dict(data_fn=tokens, loss_fn=lm_loss, optimizer_fn=adamw_gpt)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_fn", [AttributeTable, ArangeAngles, LearnedPositions])
def test_positions_are_read_at_each_ranks_global_positions(model_fn):
    assert_parity("cp=2", 2, steps=4, global_batch_size=8, fns=dict(FNS, model_fn=model_fn))


@pytest.mark.parametrize("model_fn, refusal", [
    (AlibiBias, "calls F.scaled_dot_product_attention with an attn_mask"),
    (BuiltTable, r"cuts a tensor of length 16 to the sequence's length \(8 tokens on each cp "
                 r"rank\).*neither a parameter or buffer.*register_buffer")])
def test_positions_meshtrain_cannot_read_are_refused_before_any_process(
        tmp_path, no_processes, model_fn, refusal):
    assert_refused_under_cp(tmp_path, model_fn, refusal)
