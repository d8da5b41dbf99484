"""``nn.MultiheadAttention`` under context parallel: its causal self-attention computed over the
cp group's keys and values.

``nn.MultiheadAttention`` (and with it ``nn.TransformerEncoderLayer``, the block most PyTorch
transformers are built from) calls ``F.multi_head_attention_forward``, which calls SDPA inside.
sdpa.py's ``TorchFunctionMode`` cannot see that inner call: a mode is suspended while it handles
the outer one. So the mode takes the outer call and computes it here, as torch's function does
(the in-projection, the heads, attention, the out-projection), with the attention spanning the
cp group. Only what context parallel can split is let through (:func:`refusal`): causal
self-attention (``is_causal=True``; ``nn.TransformerEncoder`` detects a causal mask itself) with
no padding mask, no attention weights returned (``need_weights=False``, which
``nn.TransformerEncoderLayer`` passes) and no added key (``add_bias_kv``, ``add_zero_attn``).
"""

from __future__ import annotations

import inspect

import torch.nn.functional as F

MHA = F.multi_head_attention_forward
_SIGNATURE = inspect.signature(MHA)


def mha_args(args, kwargs) -> dict:
    """The call's arguments by name, defaults included."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def refusal(name: str, call: dict) -> str | None:
    """Why context parallel cannot compute this call, with the fix; None when it can."""
    where = f"{name}'s nn.MultiheadAttention"
    if not (call["key"] is call["query"] and call["value"] is call["query"]):
        return (f"{where} attends to another sequence (its keys and values are not its "
                "queries: cross-attention), which meshtrain's context parallel does not split; "
                "drop cp")
    if call["need_weights"]:
        return (f"{where} returns its attention weights (need_weights=True, its default), "
                "which need every position's scores on one rank; call it with "
                "need_weights=False (as nn.TransformerEncoderLayer does), or drop cp")
    if call["key_padding_mask"] is not None:
        return (f"{where} is given a key_padding_mask, which meshtrain's context parallel "
                "does not split; train on full-length (packed) sequences, or drop cp")
    if not call["is_causal"]:
        return (f"{where} is called without is_causal=True; meshtrain's context parallel "
                "computes causal attention only: pass the causal mask "
                "(nn.Transformer.generate_square_subsequent_mask(T)) with is_causal=True, or "
                "drop cp")
    if call["bias_k"] is not None or call["add_zero_attn"] or \
            call["static_k"] is not None or call["static_v"] is not None:
        return (f"{where} adds keys of its own (add_bias_kv, add_zero_attn or static keys), "
                "which meshtrain's context parallel does not split; drop them, or drop cp")
    return None


def forward(call: dict, attend):
    """``F.multi_head_attention_forward(**call)`` for a call :func:`refusal` lets through, with
    ``attend(q, k, v, dropout_p)`` (each ``(batch, heads, length, head_dim)``, causal) as its
    attention. Returns ``(output, None)`` as torch's function does without weights."""
    x = call["query"]  # (length, batch, width); (length, width) unbatched
    batched = x.dim() == 3
    if not batched:
        x = x.unsqueeze(1)
    length, batch, width = x.shape
    if call["use_separate_proj_weight"]:
        weights = call["q_proj_weight"], call["k_proj_weight"], call["v_proj_weight"]
    else:
        weights = call["in_proj_weight"].chunk(3)
    bias = call["in_proj_bias"]
    biases = bias.chunk(3) if bias is not None else (None, None, None)
    q, k, v = (F.linear(x, w, b).view(length, batch, call["num_heads"], -1).permute(1, 2, 0, 3)
               for w, b in zip(weights, biases))
    y = attend(q, k, v, call["dropout_p"] if call["training"] else 0.0)
    y = y.permute(2, 0, 1, 3).reshape(length * batch, width)
    y = F.linear(y, call["out_proj_weight"], call["out_proj_bias"]).view(length, batch, width)
    return (y if batched else y.squeeze(1)), None
