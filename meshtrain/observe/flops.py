"""Model FLOPs per token (or sample) and the peak they are compared with: model FLOPs
utilisation (MFU) = achieved model FLOP/s per rank / that peak.

* FLOPs per item: a model's own ``flops_per_token()`` when it has one (meshtrain's GPT and
  Llama add attention's 12·L·d·T), else 6 × its parameters outside embedding tables (a forward
  multiply-add per parameter per token is 2 FLOPs, its backward 4; an embedding is a lookup).
  For inputs that are not token ids the same count is per sample. These are the model's
  FLOPs: recomputation (activation checkpointing) and padding do not count, as in PaLM's MFU.
* The peak per device: the ``peak_tflops`` setting; else a GPU's dense bf16 peak from
  :data:`GPU_PEAK_TFLOPS`; else (CPU) a float32 matmul measured once in the process with its
  threads (what a rank can reach here, not a data-sheet number).
"""

from __future__ import annotations

import functools
import time

import torch

# dense (not sparse) bf16 tensor-core peaks, TFLOP/s, from NVIDIA's data sheets; the first
# name contained in torch.cuda.get_device_name() wins
GPU_PEAK_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("B200", 2250.0),
                   ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0))


def count_flop_params(model: torch.nn.Module) -> int:
    """Parameters that take part in matmuls: all but embedding tables (counted once when
    shared, e.g. tied weights; a meta or sharded model counts its full shapes)."""
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or id(p) in embedding:
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def flops_per_item(model: torch.nn.Module, seq_len: int | None = None) -> float:
    """Model FLOPs (forward + backward) per token, or per sample for other inputs."""
    own = getattr(model, "flops_per_token", None)
    if callable(own):
        return float(own(seq_len))
    return 6.0 * count_flop_params(model)


@functools.cache
def measured_cpu_peak(threads: int, seconds: float = 0.05, size: int = 512) -> float:
    """TFLOP/s of float32 ``size`` × ``size`` matmuls on this process's ``threads`` (the
    current count; measured once per process and count)."""
    gen = torch.Generator().manual_seed(0)  # not the global RNG: training's dropout uses it
    a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)  # warm
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.mm(a, b, out=out)
        count += 1
    return 2 * size**3 * count / elapsed / 1e12


def peak_tflops(device: torch.device | str, override: float | None) -> tuple[float, str]:
    """(peak TFLOP/s of one device, where the number comes from)."""
    if override is not None:
        return float(override), "the peak_tflops setting"
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_TFLOPS:
            if key in name:
                return value, f"{name}: dense bf16 peak from the data sheet"
        peak = measured_gpu_peak(device)
        return peak, f"{name}: not in the table; a bf16 matmul measured on rank 0"
    threads = torch.get_num_threads()
    return measured_cpu_peak(threads), (f"CPU: a float32 matmul measured on rank 0 with its "
                                 f"{threads} thread{'s' * (threads > 1)} (each rank has as many)")


def measured_gpu_peak(device: torch.device, size: int = 4096, repeats: int = 20) -> float:
    """TFLOP/s of bf16 matmuls on a GPU that is not in the table."""
    a = torch.ones(size, size, device=device, dtype=torch.bfloat16)  # (the RNG left alone)
    torch.mm(a, a)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, a)
    torch.cuda.synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def mfu(flops_per_item_: float, items_per_s: float, num_ranks: int,
        peak: float) -> tuple[float, float]:
    """(achieved model TFLOP/s per rank, MFU) for ``items_per_s`` over the whole job."""
    achieved = flops_per_item_ * items_per_s / num_ranks / 1e12
    return achieved, achieved / peak if peak > 0 else 0.0
