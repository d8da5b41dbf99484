"""Context parallel for a transformer built from PyTorch's own blocks (``nn.TransformerEncoder``,
``nn.MultiheadAttention``), without changes to its code (meshtrain/parallel/context/mha.py):
the same training as one process, and what cannot be split refused before any process."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import adamw_gpt, assert_parity

from test_context_parallel_sdpa import (HEADS, SEQ, VOCAB, WIDTH, assert_refused_under_cp,
                                        lm_loss, tokens)

from meshtrain.errors import ConfigError
from meshtrain.parallel.context import mha


class TorchTransformer(nn.Module):
    """As a PyTorch user writes one: an encoder stack under a causal mask (which
    nn.TransformerEncoder recognises as causal by itself), a learned position table."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(0.1 * torch.randn(SEQ, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 2 * WIDTH, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        mask = nn.Transformer.generate_square_subsequent_mask(idx.size(1))
        x = self.tok(idx) + self.pos[: idx.size(1)]
        return self.head(self.encoder(x, mask=mask))


class SequenceFirst(nn.Module):
    """nn.MultiheadAttention called directly on (length, batch, width), no out-projection
    bias, a position buffer."""

    def __init__(self, need_weights: bool = False, padding: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.need_weights, self.padding = need_weights, padding
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.register_buffer("pos", torch.randn(SEQ, 1, WIDTH))
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, bias=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        length = idx.size(1)
        x = self.tok(idx).transpose(0, 1) + self.pos[:length]
        mask = nn.Transformer.generate_square_subsequent_mask(length)
        padding = torch.zeros(idx.shape) if self.padding else None
        y, _ = self.attn(x, x, x, attn_mask=mask, is_causal=True, key_padding_mask=padding,
                         need_weights=self.need_weights)
        return self.head(self.norm(x + y)).transpose(0, 1)


class CrossAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.memory = nn.Parameter(torch.randn(4, WIDTH))
        self.layer = nn.TransformerDecoderLayer(WIDTH, HEADS, 2 * WIDTH, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        memory = self.memory.expand(idx.size(0), -1, -1)
        mask = nn.Transformer.generate_square_subsequent_mask(idx.size(1))
        return self.head(self.layer(self.tok(idx), memory, tgt_mask=mask, tgt_is_causal=True))


FNS = dict(model_fn=TorchTransformer, data_fn=tokens, loss_fn=lm_loss, optimizer_fn=adamw_gpt)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, ranks, model_fn", [
    ("cp=2", 2, TorchTransformer), ("dp_shard=2,cp=2", 4, TorchTransformer),
    ("cp=2", 2, SequenceFirst)], ids=["encoder-cp=2", "encoder-dp_shard=2,cp=2", "mha-cp=2"])
def test_a_torch_transformer_matches_one_process(layout, ranks, model_fn):
    assert_parity(layout, ranks, steps=6, global_batch_size=8, fns=dict(FNS, model_fn=model_fn))


@pytest.mark.parametrize("separate, batched", [(False, True), (True, True), (False, False)])
def test_the_call_is_computed_as_torch_computes_it(separate, batched):
    """mha.forward with plain causal attention equals torch's own function (float64), packed
    or separate projection weights, batched or not."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = rand(SEQ, 3, WIDTH) if batched else rand(SEQ, WIDTH)
    weights = dict(q_proj_weight=rand(WIDTH, WIDTH), k_proj_weight=rand(WIDTH, WIDTH),
                   v_proj_weight=rand(WIDTH, WIDTH)) if separate else {}
    args = (x, x, x, WIDTH, HEADS, None if separate else rand(3 * WIDTH, WIDTH),
            rand(3 * WIDTH), None, None, False, 0.0, rand(WIDTH, WIDTH), rand(WIDTH))
    kwargs = dict(attn_mask=nn.Transformer.generate_square_subsequent_mask(SEQ,
                                                                           dtype=torch.float64),
                  is_causal=True, need_weights=False, use_separate_proj_weight=separate,
                  **weights)
    expected, _ = F.multi_head_attention_forward(*args, **kwargs)
    call = mha.mha_args(args, kwargs)
    assert mha.refusal("M", call) is None
    got, weights_out = mha.forward(call, lambda q, k, v, p: F.scaled_dot_product_attention(
        q, k, v, dropout_p=p, is_causal=True))
    assert weights_out is None and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("model_fn, match", [
    (lambda: SequenceFirst(need_weights=True), "need_weights=False"),
    (lambda: SequenceFirst(padding=True), "key_padding_mask"),
    (CrossAttention, "cross-attention"),
], ids=["weights", "padding", "cross-attention"])
def test_attention_context_parallel_cannot_split_is_refused_before_any_process(
        tmp_path, no_processes, model_fn, match):
    assert_refused_under_cp(tmp_path, model_fn, match)


def _evaluated(run_dir, layout):
    from conftest import trainer_kwargs

    from meshtrain import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(**trainer_kwargs(run_dir, layout=layout, devices=2 if layout else 1,
                                       max_steps=3, global_batch_size=8))
    trainer.fit(TorchTransformer, tokens(), optimizer=adamw_gpt, loss_fn=lm_loss)
    inputs = torch.utils.data.TensorDataset(tokens().tensors[0][:4])
    return trainer.validate(tokens())["val/loss"], trainer.predict(inputs)


@pytest.mark.timeout(300)
def test_validation_and_predict_in_eval_mode_match_one_process(tmp_path):
    """In eval mode nn.TransformerEncoderLayer may take torch's fused path, which would attend
    within this rank's chunks only: under cp the whole sequence's attention still runs."""
    from meshtrain.launch.spawn import run_workers

    loss, outputs = _evaluated(tmp_path / "one", None)
    cp_loss, cp_outputs = run_workers(_evaluated, 2, (tmp_path / "cp", "cp=2"), timeout=240)[0]
    assert cp_loss == pytest.approx(loss, rel=1e-5)
    assert cp_outputs.shape == outputs.shape
    torch.testing.assert_close(cp_outputs, outputs, rtol=1e-4, atol=1e-5)


def test_a_pipeline_of_an_encoder_stack_is_refused_naming_where_its_blocks_are(tmp_path,
                                                                              no_processes):
    """pp cuts model.layers; nn.TransformerEncoder keeps its blocks at model.encoder.layers:
    the refusal says where they are and how a pipeline runs them."""
    from conftest import trainer_kwargs

    from meshtrain import Trainer

    trainer = Trainer(**trainer_kwargs(tmp_path, layout="pp=2", devices=2, max_steps=1,
                                       global_batch_size=8))
    with pytest.raises(ConfigError, match=r"repeated modules at model\.encoder\.layers: if "
                                          "those are its blocks, keep them as model.layers"):
        trainer.fit(TorchTransformer, tokens(), optimizer=adamw_gpt, loss_fn=lm_loss)
