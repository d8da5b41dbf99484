"""Peak memory per rank of context-parallel attention as the sequence grows and ``cp`` rises.

One attention layer's forward and backward (batch 1, 4 heads of 64, float32, causal) on each
of ``cp`` CPU processes (gloo, one torch thread each), each holding its zig-zag share of the
tokens: the all-gather of K/V, then meshtrain's blockwise path (parallel/context/blockwise.py)
or the dense one it replaced (one SDPA call with a local_len x seq_len mask). ``cp=1`` is torch's
own fused causal attention on the whole sequence. The peak is the resident-memory high-water
mark above the start (``PeakRSS``), the largest over the ranks; the time the slower rank's.

    python benchmarks/cp_memory.py                       # 4k, 8k, 16k tokens; cp 1, 2, 4
    python benchmarks/cp_memory.py --lengths 2048 --cps 1 2   # smoke run
"""

from __future__ import annotations

import argparse
import time

import harness
import torch

HEADS, DIM = 4, 64


def _rank(length: int, blockwise: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from meshtrain.observe.memory.peak_rss import PeakRSS
    from meshtrain.parallel.context import blockwise as block_mod
    from meshtrain.parallel.context.context_parallel import cp_attention

    torch.set_num_threads(1)
    harness.init_gloo(600)
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)) if world > 1 else None
    block_mod.ENABLED = blockwise
    local = length // world
    gen = torch.Generator().manual_seed(0)

    def run(n):
        q, k, v = (torch.randn(1, HEADS, n, DIM, generator=gen, requires_grad=True)
                   for _ in range(3))
        cp_attention(q, k, v, mesh).sum().backward()

    run(min(local, 256))  # the first call's one-time costs (gloo buffers, kernels)
    torch.distributed.barrier()
    with PeakRSS() as peak:
        start = time.perf_counter()
        run(local)
        seconds = time.perf_counter() - start
    harness.end_process_group()
    return {"peak_mib": peak.bytes / 2**20, "seconds": seconds}


def measure(length: int, cp: int, blockwise: bool) -> dict:
    from meshtrain.launch.spawn import run_workers

    ranks = run_workers(_rank, cp, (length, blockwise), timeout=1200)
    return {"peak_mib": max(r["peak_mib"] for r in ranks),
            "seconds": max(r["seconds"] for r in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    rows, results = [], []
    for length in args.lengths:
        for cp in args.cps:
            paths = ["fused"] if cp == 1 else ["blockwise", "dense"]
            for path in paths:
                r = measure(length, cp, path != "dense")
                results.append({"tokens": length, "cp": cp, "path": path, **r})
                rows.append([str(length), str(cp), path, harness.fmt(r["peak_mib"], ".0f"),
                             harness.fmt(r["seconds"], ".2f")])
                print(harness.table(["tokens", "cp", "path", "peak MiB/rank", "s"], rows[-1:]),
                      flush=True)
    print(harness.table(["tokens", "cp", "path", "peak MiB/rank", "s"], rows))
    if args.out:
        harness.write_json(args.out, harness.machine(results=results))


if __name__ == "__main__":
    main()
