"""What a context-parallel collective costs inside a training step here, beyond its transfer:
the planner's cp collectives wait this long each on this machine (``Cluster.cp_sync``).

``meshtrain bench comm`` times collectives back to back, and its drift (a 1 KiB all-reduce
after even 10 ms bursts of matmuls) adds 1-2 ms; inside a step, cp's all-gather of K/V (forward)
and its reduce-scatter (backward) wait for ranks that reach them at uneven times, and with more
processes than cores for peers the scheduler has not run. Measured on 2026-11-29 (a quiet
machine, the planner benchmark's GPT under ``cp=4`` on 4 processes over 2 cores, the gathers
timed synchronously): 15 ms a forward all-gather and 28 ms a backward reduce-scatter of 4 MiB,
against 6.5 and 9.2 ms back to back and 8-11 and 13-14 ms between 10-40 ms bursts of matmuls.

This runs a job outside the planner benchmark's table (its GPT with 2 blocks instead of 4, the
same widths, so the same collective sizes) under each cp degree up to ``W`` on W processes
(``cp=2,dp=2`` and ``cp=4`` for 4: the wait depends on how many ranks must meet) with every
K/V gather made
synchronous and timed on every rank (``dist.all_gather_single`` forward,
``dist.reduce_scatter_single`` backward, in place of the autograd-aware functional
collective; the step time is the same within noise: 0.554-0.560 against 0.560 s for the
4-block GPT), and returns the mean time per collective less the ``bench comm`` table's transfer
at its size (the median of 3 runs: single runs of cp=4 gave 9.5-14.5 ms). benchmarks/planner.py measures it before it plans and saves it in its JSON, where
``Cluster.preset("this-machine")`` reads it back.

    python benchmarks/cp_sync.py [--world 4] [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from harness import end_process_group, token_pairs

from meshtrain.launch.spawn import run_workers

MODEL = "gpt:num_layers=2,num_heads=4,d_model=256,vocab_size=2048,seq_len=128"
GLOBAL_BATCH, SEQ = 16, 128


def worker(world: int, cp: int, steps: int) -> list[tuple[str, int, float]]:
    """Train ``MODEL`` under ``cp`` (data parallel over the rest of ``world``); every K/V
    collective as (op, bytes, seconds) after the first two steps."""
    import torch.distributed as dist

    from meshtrain import Trainer, losses
    from meshtrain.parallel.context import context_parallel
    from meshtrain.plan.model_spec import ModelSpec

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    timed: list[tuple[str, int, float]] = []

    class TimedGather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, local, dim, group):
            ctx.dim, ctx.group = dim, group
            x = local.movedim(dim, 0).contiguous()
            out = x.new_empty((dist.get_world_size(group) * x.size(0), *x.shape[1:]))
            start = time.perf_counter()
            gather(out, x, group=group)
            timed.append(("all_gather", out.numel() * out.element_size(),
                          time.perf_counter() - start))
            return out.movedim(0, dim)

        @staticmethod
        def backward(ctx, grad):
            x = grad.movedim(ctx.dim, 0).contiguous()
            out = x.new_empty((x.size(0) // dist.get_world_size(ctx.group), *x.shape[1:]))
            start = time.perf_counter()
            scatter(out, x, group=ctx.group)
            timed.append(("reduce_scatter", x.numel() * x.element_size(),
                          time.perf_counter() - start))
            return out.movedim(0, ctx.dim), None, None

    context_parallel._gather_sequence = lambda local, dim, group: TimedGather.apply(
        local.contiguous(), dim, group)
    spec = ModelSpec.load(MODEL)
    data = token_pairs(spec.vocab_size, GLOBAL_BATCH * (steps + 1), SEQ)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(accelerator="cpu", max_steps=steps, global_batch_size=GLOBAL_BATCH,
                          micro_batch_size=GLOBAL_BATCH * cp // world,
                          layout=f"cp={cp}" + (f",dp={world // cp}" if cp < world else ""),
                          loggers=(),
                          progress_bar=False, save_final_checkpoint=False, run_dir=run_dir,
                          log_every_n_steps=steps, report=False, model_summary=False)
        trainer.fit(lambda: spec.build(), data,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                    loss_fn=losses.cross_entropy())
        end_process_group()
    per_step = len(timed) // steps
    return timed[2 * per_step:]


def cp_sync(world: int, cluster, steps: int = 8, repeats: int = 3) -> dict:
    """Seconds a cp collective of each cp degree (2, 4, ... up to ``world``; data parallel over
    the rest of the processes) takes inside a step beyond ``cluster``'s transfer time for it
    (the mean over every rank's collectives; the median of ``repeats`` runs, the degrees
    interleaved), with what it is made of:
    ``{"world", "cp_sync": {degree: seconds}, "runs": {degree: [...]}, "detail": {...}}``."""
    degrees = [d for d in range(2, world + 1) if world % d == 0]
    runs: dict[int, list] = {cp: [] for cp in degrees}
    for _ in range(repeats):
        for cp in degrees:
            ranks = run_workers(worker, world, (world, cp, steps), timeout=600, threads=1)
            runs[cp].append([call for rank in ranks for call in rank])
    out = {"world": world, "cp_sync": {}, "runs": {}, "detail": {}, "model": MODEL}
    for cp, measured in runs.items():
        assert all(measured), "the cp job ran no K/V collective"
        waits = [statistics.mean(seconds - cluster.comm_seconds(op, size, cp, crosses_nodes=False)
                                 for op, size, seconds in calls) for calls in measured]
        calls = [call for run in measured for call in run]
        by_op = {op: statistics.mean(s for o, _, s in calls if o == op)
                 for op in ("all_gather", "reduce_scatter")}
        out["cp_sync"][cp] = max(0.0, statistics.median(waits))
        out["runs"][cp] = waits
        out["detail"][cp] = {
            "in_step_mean": by_op, "collectives": len(calls), "bytes": calls[0][1],
            "table": {op: cluster.comm_seconds(op, calls[0][1], cp, crosses_nodes=False)
                      for op in by_op}}
    return out


def summary(measured: dict) -> str:
    """One line per cp degree: the collectives in a step, the table's, the wait."""
    return "\n".join(
        f"cp={cp} on {measured['world']} processes: "
        + ", ".join(f"{op} {s * 1e3:.1f} ms in a step (table {d['table'][op] * 1e3:.1f})"
                    for op, s in d["in_step_mean"].items())
        + f"; cp_sync {measured['cp_sync'][cp] * 1e3:.1f} ms a collective (runs: "
        + " ".join(f"{w * 1e3:.1f}" for w in measured["runs"][cp]) + ")"
        for cp, d in measured["detail"].items())


def main() -> int:
    from meshtrain.plan.cluster import Cluster

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(summary(cp_sync(args.world, Cluster.preset("this-machine", processes=args.world),
                          args.steps, args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
