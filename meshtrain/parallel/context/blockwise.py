"""Context-parallel attention block by block: memory that falls with ``cp``.

A rank's queries (two runs of the zig-zag split) attend to the whole sequence's keys, which the
all-gather brings as ``2 * cp`` chunks. Attending to all of them at once with a
``(local_len x seq_len)`` mask costs memory quadratic in the sequence at exactly the lengths
context parallelism is for, and keeps the fused kernels out. Here each (query run, key chunk)
pair that the mask does not hide entirely is one call of torch's fused CPU attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``: causal on the diagonal chunk, unmasked below
it, an explicit mask of one block only where a sliding window or document boundaries cut it),
which also returns each row's log-sum-exp; the blocks' outputs are merged by their
log-sum-exps (the online softmax of flash and ring attention). The backward runs the fused
kernel's backward per block with the merged output and log-sum-exp, which gives each block's
exact share of the gradients, so nothing of size ``local_len x seq_len`` is kept between forward
and backward: the largest transient is one block's scores (``(seq_len / (2 cp))**2`` per head).
Chunks wholly above the diagonal or outside the window are skipped (half the work of the
causal mask).
"""

from __future__ import annotations

import torch

#: False: the dense path (one SDPA call with a local_len x seq_len mask), which
#: benchmarks/cp_memory.py measures beside this one
ENABLED = True
_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> bool:
    """Can the blocks run here? CPU tensors of one head width, no dropout."""
    return (q.device.type == "cpu" and dropout_p == 0.0 and q.size(-1) == k.size(-1) == v.size(-1)
            and q.dtype in (torch.float32, torch.float64, torch.bfloat16))


def _blocks(q_pos: torch.Tensor, num_chunks: int, chunk: int, window: int | None,
            q_docs: torch.Tensor | None, k_docs: torch.Tensor | None, dtype: torch.dtype):
    """(query slice, key slice, causal?, additive mask or None, rows seeing any key or None)
    for every block the mask does not hide entirely. Queries are runs of ``chunk`` positions
    (``q_pos``: this rank's, zig-zag order), keys the sequence cut into ``num_chunks``."""
    runs = q_pos.numel() // chunk
    for r in range(runs):
        q_slice = slice(r * chunk, (r + 1) * chunk)
        i = int(q_pos[r * chunk]) // chunk  # this run's chunk index in the sequence
        for j in range(min(i, num_chunks - 1) + 1):  # later chunks: above the diagonal
            k_slice = slice(j * chunk, (j + 1) * chunk)
            if window is not None and (i - j - 1) * chunk + 1 >= window:
                continue  # every key of the chunk is a window or more behind every query
            mask = None
            if window is not None or q_docs is not None:
                qp = q_pos[q_slice]
                kp = torch.arange(j * chunk, (j + 1) * chunk, device=q_pos.device)
                distance = qp[:, None] - kp[None, :]
                mask = distance >= 0
                if window is not None:
                    mask = mask & (distance < window)
                mask = mask[None, None]
                if q_docs is not None:
                    mask = mask & (q_docs[:, None, q_slice, None] == k_docs[:, None, None, k_slice])
                if not bool(mask.any()):
                    continue
            if mask is None:
                yield q_slice, k_slice, i == j, None, None
            else:
                additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
                yield q_slice, k_slice, False, additive.masked_fill_(~mask, float("-inf")), \
                    mask.any(-1)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_pos, chunk, window, q_docs, k_docs, scale):
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device,
                         dtype=torch.promote_types(q.dtype, torch.float32))
        num_chunks = k.size(-2) // chunk
        for qs, ks, causal, mask, visible in _blocks(q_pos, num_chunks, chunk, window, q_docs,
                                                     k_docs, q.dtype):
            o_b, l_b = _FORWARD(q[..., qs, :], k[..., ks, :], v[..., ks, :], 0.0, causal,
                                attn_mask=mask, scale=scale)
            l_b = l_b.to(lse.dtype)
            if visible is not None:  # (a row that sees no key here: the kernel says lse 0)
                l_b = l_b.masked_fill(~visible, float("-inf"))
            before = lse[..., qs]
            merged = torch.logaddexp(before, l_b)
            safe = torch.where(merged.isinf(), 0.0, merged)
            a = torch.where(before.isinf(), 0.0, torch.exp(before - safe))
            b = torch.where(l_b.isinf(), 0.0, torch.exp(l_b - safe))
            out[..., qs, :] = out[..., qs, :] * a[..., None].to(q.dtype) + \
                o_b * b[..., None].to(q.dtype)
            lse[..., qs] = merged
        ctx.save_for_backward(q, k, v, out, lse, q_pos, q_docs, k_docs)
        ctx.chunk, ctx.window, ctx.scale = chunk, window, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, q_pos, q_docs, k_docs = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        num_chunks = k.size(-2) // ctx.chunk
        for qs, ks, causal, mask, _ in _blocks(q_pos, num_chunks, ctx.chunk, ctx.window, q_docs,
                                               k_docs, q.dtype):
            g_q, g_k, g_v = _BACKWARD(grad[..., qs, :], q[..., qs, :], k[..., ks, :],
                                      v[..., ks, :], out[..., qs, :].contiguous(),
                                      lse[..., qs].contiguous(), 0.0, causal, attn_mask=mask,
                                      scale=ctx.scale)
            dq[..., qs, :] += g_q
            dk[..., ks, :] += g_k
            dv[..., ks, :] += g_v
        return dq, dk, dv, None, None, None, None, None, None


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, *,
                    chunk: int, window: int | None = None, q_docs: torch.Tensor | None = None,
                    k_docs: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention of queries at sequence positions ``q_pos`` (runs of ``chunk``) over the
    whole sequence's keys and values (``(batch, heads, seq_len, dim)``, as many heads as the
    queries), block by block (see the module's doc). ``window``: a sliding window;
    ``q_docs`` / ``k_docs``: ``(batch, len)`` document ids of the queries and of the keys."""
    return _BlockAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), q_pos, chunk,
                                 window, q_docs, k_docs, scale)
