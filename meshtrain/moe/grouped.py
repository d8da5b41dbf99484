"""The local experts' matmuls as one grouped GEMM over token offsets (``torch._grouped_mm``),
torchtitan's and NeMo AutoModel's way, with no host sync and no shape read from the data.

The tokens arrive sorted by expert, ``counts[e]`` of them for expert e (a tensor on the
tokens' device); ``offsets = cumsum(counts)`` (int32, on the device) tells the kernel where
each expert's rows end, so a layer's E experts are two kernel calls (``w_in``, then ``w_out``)
whatever the counts, an expert with no token included (its rows are empty, its weights'
gradient zero). The shapes are the routed tokens', fixed by the batch: ``torch.compile`` traces
the whole layer in one graph.

Where the kernel has no computation (torch 2.13: float32, bfloat16 and float16 on CPU and
CUDA, rows of a multiple of 16 bytes) the experts run in turn over all the tokens, each
keeping the rows it owns (:func:`masked_experts`): E times the FLOPs, but still no host sync
and fixed shapes, for float64 parity runs. Which one runs is chosen from the dtype and the
widths, and a fallback is said once (:func:`say_fallback`, outside compiled graphs).

torch 2.13's meta function of ``_grouped_mm`` (what ``torch.compile`` traces with) accepts
bfloat16 only, so inside a compiled graph float32 and float16 go through
``meshtrain::grouped_mm``, a custom operator around the same kernel with its own shape function
and backward (two more grouped GEMMs). Eagerly, and for bfloat16 (on a GPU Inductor has its
own kernels for it), ``torch._grouped_mm`` is called itself.
"""

from __future__ import annotations

import logging

import torch

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SAID: set[str] = set()


def fallback_reason(dtype: torch.dtype, *widths: int, device: torch.device | None = None
                    ) -> str | None:
    """None where ``torch._grouped_mm`` computes experts of these ``widths`` (d, h) in
    ``dtype``; else why not."""
    if dtype not in KERNEL_DTYPES:
        return (f"{dtype} has no grouped GEMM kernel (torch._grouped_mm computes float32, "
                "bfloat16 and float16)")
    align = 16 // dtype.itemsize
    if any(w % align for w in widths):
        return (f"torch._grouped_mm needs rows of a multiple of 16 bytes ({align} {dtype} "
                f"values) and the experts' widths are {' and '.join(map(str, widths))}")
    if device is not None and device.type == "cuda" and \
            torch.cuda.get_device_capability(device) < (8, 0):
        return "torch._grouped_mm needs a GPU of compute capability 8.0 or newer"
    return None


def say_once(message: str) -> None:
    """``message`` once a process, on rank 0 of a job (the ``meshtrain`` logger)."""
    if message in _SAID:
        return
    _SAID.add(message)
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        logging.getLogger("meshtrain").info(message)


def say_fallback(reason: str) -> None:
    """Once: meshtrain's MoE experts run in turn (:func:`masked_experts`), and why."""
    say_once(f"MoE experts: {reason}; each expert runs in turn over the routed tokens "
             "(masked: E times the grouped GEMM's FLOPs)")


def offsets_of(counts: torch.Tensor) -> torch.Tensor:
    """Where each expert's rows end: ``cumsum(counts)`` as int32, on the counts' device."""
    return counts.cumsum(0, dtype=torch.int32)


def grouped_mm(tokens: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor
               ) -> torch.Tensor:
    """``tokens`` [M, K] (rows sorted by group) x ``weights`` [G, K, N] -> [M, N]: rows
    ``offsets[g-1]:offsets[g]`` times ``weights[g]``; rows past ``offsets[-1]`` are not
    computed (left as the kernel leaves them: the caller covers every row)."""
    if torch.compiler.is_compiling():
        if tokens.dtype == torch.bfloat16:
            return torch._grouped_mm(tokens, weights, offs=offsets)
        return torch.ops.meshtrain.grouped_mm(tokens, weights, offsets)
    out = torch._grouped_mm(tokens, weights, offs=offsets)
    if out.requires_grad:  # (its backward refuses a gradient that is not contiguous: sum()'s)
        out.register_hook(torch.Tensor.contiguous)
    return out


@torch.library.custom_op("meshtrain::grouped_mm", mutates_args=())
def _grouped_mm_op(tokens: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor
                   ) -> torch.Tensor:
    return torch._grouped_mm(tokens.contiguous(), weights, offs=offsets)


@_grouped_mm_op.register_fake
def _(tokens, weights, offsets):
    return tokens.new_empty(tokens.shape[0], weights.shape[-1])


@torch.library.custom_op("meshtrain::grouped_mm_weight_grad", mutates_args=())
def _weight_grad_op(tokens: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor
                    ) -> torch.Tensor:
    """Each group's ``tokens[rows].T @ grad[rows]``: [G, K, N] (zero for an empty group)."""
    return torch._grouped_mm(tokens.contiguous().t(), grad.contiguous(), offs=offsets)


@_weight_grad_op.register_fake
def _(tokens, grad, offsets):
    return tokens.new_empty(offsets.shape[0], tokens.shape[1], grad.shape[1])


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    tokens, weights, offsets = ctx.saved_tensors
    grad_tokens = grad_weights = None
    if ctx.needs_input_grad[0]:
        grad_tokens = torch.ops.meshtrain.grouped_mm(grad, weights.transpose(-2, -1), offsets)
    if ctx.needs_input_grad[1]:
        grad_weights = torch.ops.meshtrain.grouped_mm_weight_grad(tokens, grad, offsets)
    return grad_tokens, grad_weights, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_experts(tokens: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                    counts: torch.Tensor, activation) -> torch.Tensor:
    """Every expert's ``activation(tokens @ w_in[e]) @ w_out[e]`` on its rows, as two grouped
    GEMMs (``counts.sum()`` must be the number of rows: every row is computed)."""
    offsets = offsets_of(counts)
    return grouped_mm(activation(grouped_mm(tokens, w_in, offsets)), w_out, offsets)


def masked_experts(tokens: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                   counts: torch.Tensor, activation) -> torch.Tensor:
    """The same as :func:`grouped_experts` without the kernel: each expert computes every row
    and keeps its own (``torch.where``: the other rows' gradient is exactly zero)."""
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    expert_of_row = torch.searchsorted(counts.cumsum(0), rows, right=True)
    out = tokens.new_zeros(tokens.shape[0], w_out.shape[-1])
    for e in range(w_in.shape[0]):
        mine = (expert_of_row == e).unsqueeze(-1)
        out = torch.where(mine, activation(tokens @ w_in[e]) @ w_out[e], out)
    return out


def looped_experts(tokens: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                   sizes: list[int], activation) -> torch.Tensor:
    """One matmul pair per expert on its slice of ``sizes[e]`` rows (sizes known on the host:
    the planner's meta-device probe, whose FLOP counter reads each matmul)."""
    outs = [activation(part @ a) @ b for part, a, b in zip(tokens.split(sizes), w_in, w_out)]
    return torch.cat(outs) if outs else tokens[:0]


__all__ = ["KERNEL_DTYPES", "fallback_reason", "grouped_experts", "grouped_mm",
           "looped_experts", "masked_experts", "offsets_of", "say_fallback", "say_once"]
