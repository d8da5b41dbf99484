"""Checkpoint save and load time through meshtrain's CheckpointManager (DCP), sync vs async.

A stack of ``nn.Linear(d, d)`` layers holding ``--params-mb`` MiB of fp32 parameters, sharded with
FSDP2 ``fully_shard`` (per layer and at the root; ``--sharding replicated`` keeps a whole copy on
every rank instead), with AdamW state created by one step, so that a checkpoint is about 3x the
parameters (parameters, exp_avg, exp_avg_sq). On ``--world-size`` processes (gloo, CPU, one torch
thread per rank), each repeat measures, as the slower rank's time:

* ``sync save``: ``CheckpointManager.save`` (non-finite check, DCP write with fsync, rename):
  the time the caller is blocked;
* ``async save, until save() returns``: the same with ``async_save=True`` (folder set-up, the
  small per-rank files, the state dict; the copy into host memory runs in torch's
  ``DefaultStager`` thread); ``until the copy is made``: plus ``before_update()`` at once;
* ``async save, until committed``: from the start of ``save`` to the end of ``wait()`` called
  right after it (nothing else running);
* ``async + training``: the same, but the ranks run training steps of the checkpointed model
  meanwhile (forward and backward on ``--batch`` rows, ``before_update()``, AdamW), polling
  once per step and committing once every rank's write is done (DCP writes in a thread of
  the training process). The rows of meshtrain's former stager and writer process, which
  this replaced, are in benchmarks/results/checkpoint_stagers.json (benchmarks/README.md);
* ``load``: ``load_checkpoint`` of the sync checkpoint into the same sharded model and
  optimizer (DCP read + ``set_state_dict``); the files were just written, so they are read from
  the page cache;
* ``non-finite check``: the NaN/Inf scan of parameters and optimizer state alone.

A tiny model is saved and loaded once first (not timed), so that one-time costs of DCP's first
save and load stay out of the first repeat; the order of the three cases (sync + load, async,
async + training) rotates from repeat to repeat, and each checkpoint is
deleted after its case. The training "step time alone" is measured over ``--steps-alone`` steps
right before each async + training case. MiB/s = checkpoint size / median time.

    python benchmarks/checkpoint.py                       # 300 MiB params, 2 ranks, 3 repeats
    python benchmarks/checkpoint.py --params-mb 50 --repeats 1   # smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from harness import WallClock, init_gloo, machine, spread, table, write_json

from meshtrain.checkpoint.manager import CheckpointManager, checkpoint_name, local_all_finite
from meshtrain.checkpoint.state import load_checkpoint
from meshtrain.launch.spawn import run_workers

MIB = 2**20
MEASURES = [
    ("sync_blocking_s", "sync save"),
    ("async_blocking_s", "async save, until save() returns"),
    ("async_copied_s", "async save, until the copy is made"),
    ("async_total_s", "async save, until committed"),
    ("async_train_blocking_s", "async + training, blocking (save + waits)"),
    ("async_train_total_s", "async + training, until committed"),
    ("load_s", "load"),
    ("check_s", "non-finite check"),
]


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_worker(cfg: dict, base: str) -> dict:
    rank = init_gloo(cfg["timeout"])
    torch.manual_seed(0)
    d = cfg["d"]
    model = nn.Sequential(*[nn.Linear(d, d) for _ in range(cfg["layers"])])
    if cfg["sharding"] == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    else:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, d)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    ckpt_group = dist.new_group(backend="gloo")  # DCP's collectives, apart from training's
    batch = torch.randn(cfg["batch"], d, generator=torch.Generator().manual_seed(rank))
    warm = nn.Linear(8, 8)  # one-time costs of the first DCP save and load, not timed
    warm_opt = torch.optim.AdamW(warm.parameters())
    for async_save in (False, True):
        mgr = CheckpointManager(Path(base) / f"warmup{int(async_save)}", async_save=async_save,
                                process_group=ckpt_group)
        mgr.save(0, warm, warm_opt, {}, {"step": 0})
        load_checkpoint(mgr.wait() or Path(base) / "warmup0" / checkpoint_name(0), warm, warm_opt)
    # The background saves share one manager, as in a training run: its first save allocates
    # the host buffers (timed apart), later ones reuse them.
    amgr = CheckpointManager(Path(base) / "async", async_save=True, process_group=ckpt_group)
    dist.barrier()
    amgr.save_to(Path(base) / "first", 0, model, optimizer, {}, {"step": 0}, background=True)
    first = {"async_first_blocking_s": amgr.last_blocking_s + amgr.before_update()}
    amgr.wait()
    rows, size = [], None

    def train_step(fences: list[float], mgr=amgr):
        """A real step of the checkpointed model; the wait for a save's copy is recorded."""
        model(batch).square().mean().backward()
        fences.append(mgr.before_update())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync_and_load(root, step, row):
        nonlocal size
        mgr = CheckpointManager(root / "sync", process_group=ckpt_group)
        dist.barrier()
        mgr.save(step, model, optimizer, {"global_step": step}, {"step": step})
        row["sync_blocking_s"] = mgr.last_blocking_s
        path = root / "sync" / checkpoint_name(step)
        if rank == 0:
            size = _folder_bytes(path)
        dist.barrier()
        start = time.perf_counter()
        load_checkpoint(path, model, optimizer)
        row["load_s"] = time.perf_counter() - start
        start = time.perf_counter()
        local_all_finite(model, optimizer)
        row["check_s"] = time.perf_counter() - start

    def async_wait(root, step, row):
        dist.barrier()
        amgr.save_to(root / "async" / checkpoint_name(step), step, model, optimizer,
                     {"global_step": step}, {"step": step}, background=True)
        row["async_blocking_s"] = amgr.last_blocking_s
        row["async_copied_s"] = amgr.last_blocking_s + amgr.before_update()
        amgr.wait()
        row["async_total_s"] = amgr.last_save_s

    def async_train(root, step, row, mgr=amgr, tag=""):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(cfg["steps_alone"]):
            train_step([], mgr)
        row[f"train_step_alone{tag}_ms"] = (
            (time.perf_counter() - start) / cfg["steps_alone"] * 1e3)
        dist.barrier()
        mgr.save_to(root / f"train{tag}" / checkpoint_name(step), step, model, optimizer,
                    {"global_step": step}, {"step": step}, background=True)
        returned, fences = mgr.last_blocking_s, []
        steps, start = 0, time.perf_counter()
        while True:
            done = torch.tensor([int(mgr.poll())])
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if done.item():
                break
            train_step(fences, mgr)
            steps += 1
        row[f"train_step_during_write{tag}_ms"] = (
            (time.perf_counter() - start) / max(steps, 1) * 1e3)
        mgr.commit()
        row[f"async_train{tag}_blocking_s"] = returned + sum(fences)
        row[f"async_train{tag}_total_s"] = mgr.last_save_s
        row[f"train_steps_during_write{tag}"] = steps

    phases = [sync_and_load, async_wait, async_train]
    for rep in range(cfg["repeats"]):
        row, root = {}, Path(base) / f"rep{rep}"
        turn = rep % len(phases)
        for phase in phases[turn:] + phases[:turn]:  # rotate the order per repeat
            phase(root, rep + 1, row)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
        rows.append(row)
    return {"rank": rank, "rows": rows, "checkpoint_bytes": size, "peak_rss_mib": _peak_rss_mib(),
            **first}


def summarize(ranks: list[dict]) -> dict:
    repeats = len(ranks[0]["rows"])
    slower = [{k: max(r["rows"][i][k] for r in ranks) for k in ranks[0]["rows"][i]}
              for i in range(repeats)]
    out = {k: spread(row[k] for row in slower) for k, _ in MEASURES}
    for key in ("train_steps_during_write", "train_step_alone_ms", "train_step_during_write_ms"):
        out[key] = [row[key] for row in slower]
    out["checkpoint_bytes"] = ranks[0]["checkpoint_bytes"]
    out["async_first_blocking_s"] = max(r["async_first_blocking_s"] for r in ranks)
    out["blocking_vs_sync"] = [row["async_train_blocking_s"] / row["sync_blocking_s"]
                               for row in slower]
    out["peak_rss_mib_per_rank"] = [r["peak_rss_mib"] for r in ranks]
    out["per_repeat"] = slower
    return out


def format_table(summary: dict) -> str:
    size_mib = summary["checkpoint_bytes"] / MIB
    rows = []
    for key, label in MEASURES:
        m = summary[key]
        timed_write = key in ("sync_blocking_s", "load_s") or key.endswith("total_s")
        rate = f"{size_mib / m['median']:.0f}" if timed_write else ""
        rows.append((label, f"{m['median']:.3f}", f"{m['min']:.3f}", f"{m['max']:.3f}", rate))
    lines = [table(("measure (slower rank)", "median s", "min s", "max s", "MiB/s"), rows)]
    ms = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    lines.append(f"\ncheckpoint {size_mib:.0f} MiB on disk; peak RSS per rank "
                 f"{', '.join(f'{x:.0f}' for x in summary['peak_rss_mib_per_rank'])} MiB")
    ratios = sorted(summary["blocking_vs_sync"])
    lines.append(f"async + training blocking / sync save, paired per repeat: median "
                 f"{ratios[len(ratios) // 2]:.3f} (min {ratios[0]:.3f}, max {ratios[-1]:.3f}); "
                 f"the first async save (allocating the host buffers) blocked "
                 f"{summary['async_first_blocking_s']:.3f} s until copied")
    lines.append(f"training steps during the async write: "
                 f"{summary['train_steps_during_write']}; ms/step alone "
                 f"{ms(summary['train_step_alone_ms'])}, during the write "
                 f"{ms(summary['train_step_during_write_ms'])} (per repeat)")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="processes (2)")
    parser.add_argument("--params-mb", type=float, default=300.0,
                        help="MiB of fp32 parameters (300); the checkpoint is about 3x")
    parser.add_argument("--width", type=int, default=2048, help="d of each Linear(d, d) (2048)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats (3)")
    parser.add_argument("--batch", type=int, default=8, help="rows per rank per training step (8)")
    parser.add_argument("--steps-alone", type=int, default=3,
                        help="training steps timed before each async + training case (3)")
    parser.add_argument("--sharding", choices=["fsdp", "replicated"], default="fsdp")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where the temporary checkpoints go (the system temp dir)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds before a hung run is killed")
    parser.add_argument("--out", default="benchmarks/results/checkpoint.json",
                        help="JSON results file")
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.repeats < 1 or args.params_mb <= 0 or args.width < 1:
        parser.error("--world-size, --repeats, --params-mb and --width must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    d = args.width
    layers = max(1, round(args.params_mb * MIB / (4 * (d * d + d))))
    params_bytes = 4 * layers * (d * d + d)
    need = 3 * params_bytes  # parameters + AdamW's two moments
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    if free < 3 * need:
        print(f"Not enough free disk space in {args.dir}: a checkpoint takes about "
              f"{need / MIB:.0f} MiB and this benchmark wants 3x that ({3 * need / MIB:.0f} MiB) "
              f"free, but only {free / MIB:.0f} MiB are. Pass --dir elsewhere or a smaller "
              "--params-mb.", file=sys.stderr)
        return 1
    cfg = dict(d=d, layers=layers, sharding=args.sharding, repeats=args.repeats,
               timeout=args.timeout, batch=args.batch, steps_alone=args.steps_alone)
    title = (f"{layers} x Linear({d}, {d}) = {params_bytes / MIB:.0f} MiB fp32 params "
             f"({params_bytes // 4 / 1e6:.1f}M), AdamW, {args.sharding}, {args.world_size} ranks "
             "(gloo, CPU, 1 thread per rank)")
    print(f"checkpoint benchmark: {title}; {args.repeats} repeats, torch {torch.__version__}",
          flush=True)
    clock = WallClock()
    with tempfile.TemporaryDirectory(prefix="meshtrain-ckpt-bench-", dir=args.dir) as base:
        ranks = run_workers(bench_worker, args.world_size, (cfg, base),
                            timeout=args.timeout, threads=1)
    print(f"({clock.stop()})\n")
    summary = summarize(ranks)
    print(format_table(summary))
    result = {
        "title": title,
        "command": " ".join(["python", *sys.argv]),
        "config": cfg | {"world_size": args.world_size, "params_bytes": params_bytes},
        "machine": machine(**clock.loads(), wall_s=clock.wall_s),
        "summary": summary,
    }
    print(f"\nwrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
