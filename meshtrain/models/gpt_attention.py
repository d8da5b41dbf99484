"""The attention of meshtrain's GPT (models/gpt.py), and how packed documents reach a kernel.

Three paths: under context parallel
:func:`~meshtrain.parallel.context.context_parallel.cp_attention` (ring attention over the cp
group, documents included); packed documents (``document_eos``) without cp
:func:`document_attention`; otherwise SDPA's own causal attention.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.errors import ConfigError

_compiled_flex = None


def _flex_attention(device: torch.device):
    """``flex_attention`` compiled (once) on a GPU; as it is elsewhere (on a CPU torch 2.13 runs
    it unfused, forward only)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "cpu":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       documents: torch.Tensor, *, dropout_p: float = 0.0,
                       flex: bool | None = None) -> torch.Tensor:
    """Causal attention within each packed document (``documents``: ``(batch, seq)`` ids).

    ``flex``: FlexAttention with the documents' ``BlockMask``
    (meshtrain.packing.documents_block_mask: the blocks outside every document skipped, no
    ``seq x seq`` mask made); False: SDPA with a boolean ``seq x seq`` mask; None: FlexAttention
    on CUDA without dropout, SDPA elsewhere (torch 2.13's FlexAttention has no CPU backward)."""
    if flex is None:
        flex = q.device.type == "cuda" and dropout_p == 0.0
    if not flex:
        from meshtrain.parallel.context.context_parallel import cp_attention

        return cp_attention(q, k, v, None, dropout_p=dropout_p, documents=documents)
    if dropout_p:
        raise ConfigError(f"FlexAttention has no attention dropout (dropout={dropout_p}); "
                          "use GPTConfig.dropout=0, or the SDPA path (flex_documents=False)")
    from meshtrain.packing import documents_block_mask

    return _flex_attention(q.device)(q, k, v, block_mask=documents_block_mask(documents))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; the number of heads follows ``wq``'s output width.

    ``flex_documents`` chooses the kernel for packed documents without cp (see
    :func:`document_attention`'s ``flex``; None: FlexAttention on CUDA)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.wq = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.wk = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.wv = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.wo = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)
        self.cp_mesh = None  # set by GPT.enable_context_parallel
        self.flex_documents: bool | None = None

    @property
    def num_local_heads(self) -> int:
        """Heads held by this module (all of them, or this rank's shard under tensor parallel)."""
        return self.wq.out_features // self.head_dim

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """``documents``: the document ids of the whole window (packed documents, GPT.documents)."""
        batch, seq, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        dropout = self.dropout if self.training else 0.0
        if self.cp_mesh is not None:
            # this rank's queries over the whole sequence's keys (cp), in their documents
            from meshtrain.parallel.context.context_parallel import cp_attention

            out = cp_attention(q, k, v, self.cp_mesh, dropout_p=dropout, documents=documents)
        elif documents is not None:
            out = document_attention(q, k, v, documents, dropout_p=dropout,
                                     flex=self.flex_documents)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_drop(self.wo(out))
