"""``meshtrain bench comm``: how fast this machine's (or cluster's) collectives are.

Times all_reduce, all_gather, reduce_scatter, all_to_all, broadcast and send/recv over message
sizes from 1 KiB to 256 MiB on the current process group (gloo on CPU, NCCL on GPU) and prints,
per operation and size, the time, the algorithm bandwidth (bytes / time) and the bus bandwidth:
the algorithm bandwidth times the factor nccl-tests uses so that every operation can be compared
with the link's speed (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n;
broadcast and send/recv 1; n ranks). A size is the whole buffer, as in nccl-tests: all_gather's
output, reduce_scatter's input, each rank's all_to_all buffer. The time is the slowest rank's.
``--json FILE`` saves the table for the planner.

    meshtrain bench comm --devices 2                      # 2 local processes (gloo on CPU)
    meshtrain run --nproc-per-node 8 -m meshtrain.plan.bench_comm --json comm.json   # a launcher's world
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from meshtrain.errors import ConfigError

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
# What meshtrain sends through shared memory between the CPU processes of one host
# (local_comm="auto", parallel/shm/p2p.py): FSDP2's all-gather and reduce-scatter
# (parallel/data/fsdp_comm.py), the pipeline's sends and the tp axis's all-reduces
# (parallel/shm/collectives.py); measured again that way, up to SHARED_MAX bytes (each pair
# of ranks maps rings of a few of the largest message)
SHARED_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
KIB = 1024
SHARED_MAX = 64 * KIB ** 2


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth for ``op`` on ``n`` ranks."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def parse_size(text: str) -> int:
    """'1KiB', '256MiB', '4096' -> bytes."""
    units = {"kib": KIB, "mib": KIB ** 2, "gib": KIB ** 3, "b": 1, "": 1}
    number = text.strip().rstrip("BbIiKkMmGg")
    unit = text.strip()[len(number):].lower()
    if unit in ("k", "m", "g"):
        unit += "ib"
    if not number.isdigit() or unit not in units or int(number) < 1:
        raise ConfigError(f"{text!r} is not a size; write e.g. 1KiB, 64MiB or 4096 (bytes)")
    return int(number) * units[unit]


def sizes_between(smallest: int, largest: int) -> list[int]:
    """Powers of 4 times ``smallest`` up to ``largest``."""
    if smallest > largest:
        raise ConfigError(f"--min-size {smallest} is above --max-size {largest}")
    out = [smallest]
    while out[-1] * 4 <= largest:
        out.append(out[-1] * 4)
    return out


def _operation(op: str, size: int, dist, device, rank: int, n: int, p2p=None):
    """(run once, check the last result): buffers of float32 for ``size`` bytes in all; with
    ``p2p`` (a LocalP2PGroup of every rank), the op as meshtrain runs it through shared memory."""
    import torch

    numel = max(n, size // 4 // n * n)  # divisible by n
    chunk = numel // n
    fill = float(rank + 1)
    if p2p is not None and op in ("all_gather", "reduce_scatter"):
        from meshtrain.parallel.data.fsdp_comm import SharedMemoryAllGather, _reduce_scatter_shared

        if op == "all_gather":
            gather = SharedMemoryAllGather(p2p)
            out, mine = torch.empty(numel), torch.full((chunk,), fill)
            return (lambda: gather(out, mine, p2p)), lambda: out[chunk * (n - 1)].item() == n
        inp, out = torch.full((numel,), fill), torch.empty(chunk)
        return (lambda: _reduce_scatter_shared(out, inp, rank, n, False, False, p2p)), \
            lambda: out[0].item() == n * (n + 1) / 2
    if op == "all_reduce":
        buf = torch.full((numel,), fill, device=device)
        def run():
            buf.fill_(fill)
            dist.all_reduce(buf, group=p2p)  # (p2p: the tp axis's shared-memory group)
        return run, lambda: buf[0].item() == n * (n + 1) / 2
    if op == "all_gather":
        out, mine = torch.empty(numel, device=device), torch.full((chunk,), fill, device=device)
        return (lambda: dist.all_gather_into_tensor(out, mine)), \
            lambda: out[chunk * (n - 1)].item() == n
    if op == "reduce_scatter":
        inp, out = torch.full((numel,), fill, device=device), torch.empty(chunk, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return (lambda: scatter(out, inp)), lambda: out[0].item() == n * (n + 1) / 2
    if op == "all_to_all":
        inp = torch.full((numel,), fill, device=device)
        out = torch.empty(numel, device=device)
        return (lambda: dist.all_to_all_single(out, inp)), lambda: out[chunk * (n - 1)].item() == n
    if op == "broadcast":
        buf = torch.full((numel,), fill, device=device)
        def run():
            buf.fill_(fill)
            dist.broadcast(buf, src=0)
        return run, lambda: buf[0].item() == 1.0
    assert op == "send_recv", op
    out, mine = torch.empty(numel, device=device), torch.full((numel,), fill, device=device)
    def ring():
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, (rank + 1) % n, p2p),
                                           dist.P2POp(dist.irecv, out, (rank - 1) % n, p2p)])
        for request in requests:
            request.wait()
    return ring, lambda: out[0].item() == float((rank - 1) % n + 1)


def measure(ops=OPS, sizes=None, *, min_seconds: float = 0.05, max_iters: int = 50,
            p2p=None) -> list[dict]:
    """Collective (call on every rank of the default group): one row per operation and size,
    {op, bytes, seconds (slowest rank), algbw_GBps, busbw_GBps, iters}; with ``p2p`` (a
    LocalP2PGroup of every rank) the :data:`SHARED_OPS` as meshtrain runs them through it."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError("meshtrain bench comm needs a process group: use --devices N, or start "
                          "it under a launcher (meshtrain run / torchrun / srun)")
    n, rank = dist.get_world_size(), dist.get_rank()
    if n < 2:
        raise ConfigError("meshtrain bench comm needs at least 2 processes (--devices 2)")
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for op in ops:
        for size in sizes or sizes_between(KIB, 256 * KIB ** 2):
            run, check = _operation(op, size, dist, device, rank, n, p2p)
            run()  # warm-up (and connection set-up)
            sync()
            ok = torch.tensor([1.0 if check() else 0.0])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            assert ok.item() == 1.0, f"{op} at {size} bytes gave a wrong result"
            iters = _iterations(run, sync, dist, min_seconds, max_iters)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                run()
            sync()
            seconds = torch.tensor([(time.perf_counter() - start) / iters])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            algbw = size / seconds.item() / 1e9
            rows.append({"op": op, "bytes": size, "seconds": seconds.item(), "iters": iters,
                         "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(op, n)})
    return rows


def measure_drift(burst_seconds: float = 0.01, bursts: int = 60) -> float:
    """Seconds a small collective costs between bursts of compute beyond what it costs back to
    back: the ranks drift apart while they compute (on a machine with fewer cores than
    processes, by the scheduler's time slices) and the collective waits for the last. Every
    rank runs the same bursts alone, with a 1 KiB all_reduce after each, and the all_reduces
    alone; the slowest rank's difference per burst."""
    import torch
    import torch.distributed as dist

    a, small = torch.randn(128, 128), torch.zeros(256)
    start, k = time.perf_counter(), 0
    while time.perf_counter() - start < burst_seconds * 5:
        a @ a
        k += 1
    per_burst = max(1, k // 5)

    def loop(compute: bool, collective: bool) -> float:
        dist.barrier()
        begin = time.perf_counter()
        for _ in range(bursts):
            for _ in range(per_burst if compute else 0):
                a @ a
            if collective:
                dist.all_reduce(small)
        dist.barrier()
        return (time.perf_counter() - begin) / bursts

    loop(True, True)  # warm-up
    drifts = sorted(loop(True, True) - loop(True, False) - loop(False, True) for _ in range(3))
    extra = torch.tensor([drifts[1]])  # the median of three: each is a difference of noisy times
    dist.all_reduce(extra, op=dist.ReduceOp.MAX)
    return max(0.0, extra.item())


def _iterations(run, sync, dist, min_seconds: float, max_iters: int) -> int:
    """Enough calls to last ``min_seconds`` (from one timed call; the same on every rank)."""
    import torch

    start = time.perf_counter()
    run()
    sync()
    once = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(once, op=dist.ReduceOp.MAX)
    return int(min(max_iters, max(3, min_seconds / max(once.item(), 1e-9))))


def table(rows: list[dict], world_size: int, backend: str) -> str:
    lines = [f"meshtrain bench comm: {world_size} processes, {backend}; time of the slowest rank",
             *table_rows(rows)]
    return "\n".join(lines)


def table_rows(rows: list[dict]) -> list[str]:
    """A header and one line per row."""
    lines = [f"{'op':15} {'size':>10} {'time (us)':>12} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for row in rows:
        size = row["bytes"]
        label = f"{size // KIB ** 2} MiB" if size >= KIB ** 2 else f"{size // KIB} KiB"
        lines.append(f"{row['op']:15} {label:>10} {row['seconds'] * 1e6:>12.1f} "
                     f"{row['algbw_GBps']:>11.3f} {row['busbw_GBps']:>11.3f}")
    return lines


def measure_shared(ops, sizes) -> list[dict]:
    """The :data:`SHARED_OPS` among ``ops`` through shared memory, when every rank of the gloo
    job shares this host's memory (else no rows): what a CPU job with local_comm="auto" pays."""
    import torch.distributed as dist

    from meshtrain.parallel.shm import collectives as shm_collectives, p2p as shm_p2p

    shared = [op for op in ops if op in SHARED_OPS]
    if not shared or not shm_p2p.applies("cpu", "auto"):
        return []
    # the tp axis's group: its all-reduce, and the sends FSDP's and the pipeline's are made of
    group = dist.new_group(list(range(dist.get_world_size())), backend=shm_collectives.BACKEND)
    return measure(shared, [size for size in sizes if size <= SHARED_MAX], p2p=group)


def _job(ops, sizes, json_path):
    """Every rank: set up the group from the environment, measure; rank 0 prints and saves."""
    import torch
    import torch.distributed as dist

    from meshtrain.launch.network import choose_interfaces
    from meshtrain.launch.spawn import DistEnv, init_process_group

    env = DistEnv.from_environ()
    choose_interfaces(os.environ.get("MASTER_ADDR") or "127.0.0.1")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    if not dist.is_initialized():
        init_process_group(env, backend, timedelta(seconds=300))
    rows = measure(ops, sizes)
    result = {"world_size": dist.get_world_size(), "backend": backend, "rows": rows,
              "shared_rows": measure_shared(ops, sizes) if backend == "gloo" else [],
              "drift_seconds": measure_drift() if backend == "gloo" else 0.0}
    if env.rank == 0:
        print(table(rows, result["world_size"], backend), flush=True)
        if result["shared_rows"]:
            print("through shared memory, as meshtrain runs them on one host "
                  "(local_comm='auto': FSDP2's all-gather and reduce-scatter, pipeline sends, "
                  "the tp axis's all-reduce)",
                  *table_rows(result["shared_rows"]), sep="\n", flush=True)
        print(f"drift: a collective between 10 ms bursts of compute waits "
              f"{result['drift_seconds'] * 1e3:.2f} ms more than back to back", flush=True)
        if json_path:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(json_path).write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshtrain bench comm", description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=None,
                        help="start this many local processes (default: the launcher's world)")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--min-size", default="1KiB")
    parser.add_argument("--max-size", default="256MiB")
    parser.add_argument("--json", metavar="FILE", help="save the rows for the planner")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    sizes = sizes_between(parse_size(args.min_size), parse_size(args.max_size))
    from meshtrain.launch.spawn import DistEnv, run_workers

    if DistEnv.from_environ() is not None:
        if args.devices not in (None, DistEnv.from_environ().world_size):
            raise ConfigError(f"--devices {args.devices} but the launcher started "
                              f"{DistEnv.from_environ().world_size} processes; drop --devices")
        _job(args.ops, sizes, args.json)
        return 0
    if args.devices is None or args.devices < 2:
        raise ConfigError("give --devices N (N >= 2 local processes), or start meshtrain bench comm "
                          "under a launcher: meshtrain run --nproc-per-node N -m "
                          "meshtrain.plan.bench_comm")
    run_workers(_job, args.devices, (args.ops, sizes, args.json), timeout=3600)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as error:
        print(f"meshtrain bench comm: error: {error}", file=sys.stderr)
        sys.exit(2)
